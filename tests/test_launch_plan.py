"""Launch plans (lik.runtime.launch_plan): a launcher's recorded work, replayed on new
tensors, gives what the launcher gives; what the log cannot describe is never replayed.

The CPU tests drive Recording and Plan with a stand-in launcher whose "kernel" is a
Python function; the GPU tests replay the generated launchers' plans through lik's
entries and check them against the float64 reference."""

from __future__ import annotations

import ast
import functools
import sys
import types
from pathlib import Path

import pytest
import torch
from helpers import TOLERANCE, relative_error

from lik.runtime import launch_plan, workspace
from lik.runtime.launch_plan import Recording

GENERATED = Path(__file__).resolve().parents[1] / "generated" / "triton"


def _kernel(grid, stream, args):
    """A stand-in compiled launch: out[i] = 2 * X[i] + counts[i], for i < n."""
    X, counts, out, n = args
    out[:n] = 2 * X[:n] + counts[:n]


def _launcher(out, X, mask, *, n):
    """A stand-in generated launcher: a scratch buffer, a derived tensor, two launches."""
    counts = _count(mask)
    scratch = workspace.empty((n,), dtype=torch.float32, device=X.device)
    _log_launch(_kernel, (X, counts, scratch, n))
    _log_launch(_kernel, (scratch, counts, out, n))
    return out


@launch_plan.recorded
def _count(mask):
    return mask.sum(-1).float()


def _log_launch(kernel, args):
    """Launches as launch_cache does: runs, then logs to the open recording."""
    kernel((1, 1, 1), 0, args)
    log = launch_plan.recording()
    if log is not None:
        log.launch(kernel, (1, 1, 1), args)


def _inputs(seed: int, n: int = 5):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, generator=g)
    mask = torch.rand(n, 3, generator=g) > 0.5
    return torch.full((n,), float("nan")), X, mask


def _record(launcher, tensors, **kwargs):
    with Recording(tensors) as log:
        result = launcher(*tensors, **kwargs)
    return log.plan(result)


def test_a_replay_gives_what_the_launcher_gives_on_new_tensors():
    plan = _record(_launcher, list(_inputs(0)), n=5)
    assert plan is not None
    out, X, mask = _inputs(1)
    replayed = plan.replay([out, X, mask], stream=0)
    expected = _launcher(*_inputs(1), n=5)
    assert replayed is out  # the launcher returns its out argument: the replay does too
    assert torch.equal(replayed, expected)


def test_a_replay_makes_fresh_scratch_and_drops_it_after_its_last_use():
    def returns_scratch(out, X, mask, *, n):
        counts = _count(mask)
        made = workspace.zeros((n,), dtype=torch.float32, device=X.device)
        _log_launch(_kernel, (X, counts, made, n))
        return out, made

    plan = _record(returns_scratch, list(_inputs(0)), n=5)
    first = plan.replay(list(_inputs(1)), stream=0)[1]
    second = plan.replay(list(_inputs(2)), stream=0)[1]
    assert first is not second  # each replay allocates its own
    assert torch.equal(second, 2 * _inputs(2)[1] + _count(_inputs(2)[2]))
    # The returned buffer is kept; the counts (a helper's tensor used once) are dropped.
    dropped = [slot for step in plan.steps for slot in step[-1]]
    assert dropped == [3]


def _doubled(grid, stream, args):
    """A stand-in compiled launch: G = 2 * X over rows."""
    X, G = args
    G.copy_(2 * X)


def _finishing_launcher(X):
    """A launcher that returns a cast of fp32 scratch in X's shape and dtype, as the
    unified backward's finish does: rows of the head dim, a cast, a reshape."""
    X2 = workspace.head_rows(X)
    G = workspace.zeros(X2.shape, dtype=torch.float32, device=X.device)
    _log_launch(_doubled, (X2, G))
    return workspace.reshaped(workspace.converted(G, X.dtype), X.shape)


@pytest.mark.parametrize("strided_head", [False, True], ids=["rows", "strided-head-dim"])
def test_casts_and_views_through_workspace_replay_on_new_tensors(strided_head):
    def tokens(seed):
        X = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(seed))
        return X.transpose(1, 2).contiguous().transpose(1, 2) if strided_head else X

    plan = _record(_finishing_launcher, [tokens(0)])
    assert plan is not None
    X = tokens(1)
    replayed = plan.replay([X], stream=0)
    assert replayed.shape == X.shape and torch.equal(replayed, 2 * X)


def test_a_tensor_the_log_does_not_know_is_never_replayed():
    def makes_a_view(out, X, mask, *, n):
        _log_launch(_kernel, (X[:n], _count(mask), out, n))  # X[:n] is a new tensor object
        return out

    assert _record(makes_a_view, list(_inputs(0)), n=5) is None


def test_a_tensor_made_by_a_plain_torch_call_is_never_replayed():
    def allocates_unseen(out, X, mask, *, n):
        counts = torch.zeros(n)  # not through workspace: a replay would not make it
        _log_launch(_kernel, (X, counts, out, n))
        return out

    assert _record(allocates_unseen, list(_inputs(0)), n=5) is None


def test_an_argument_that_holds_a_tensor_is_never_replayed():
    def passes_a_descriptor(out, X, mask, *, n):
        descriptor = types.SimpleNamespace(base=X)  # as a TMA descriptor holds its base
        _log_launch(lambda grid, stream, args: None, (descriptor, out, n))
        return out

    assert _record(passes_a_descriptor, list(_inputs(0)), n=5) is None


def test_a_launch_off_the_logged_path_refuses_the_plan():
    def refuses(out, X, mask, *, n):
        launch_plan.refuse()  # as launch_cache does for a launch it sends through Triton
        return out

    assert _record(refuses, list(_inputs(0)), n=5) is None


def test_a_tensor_passed_twice_is_neither_replayed_nor_remembered():
    """maxsim(Q, Q)'s signature equals that of two tensors of Q's shape: a log of the
    aliased call would send both arguments to one slot on the next call."""
    out, X, mask = _inputs(0)
    with Recording([out, X, X]) as log:
        _log_launch(_kernel, (X, X, out, 5))
    assert log.aliased and log.plan(out) is None
    launch_plan.clear()
    launch_plan.remember_call(("aliased",), [(None, None)], (out, X, X))
    assert launch_plan.call_plan(("aliased",)) is None  # the next call is recorded afresh

def test_recordings_nest_and_close():
    assert launch_plan.recording() is None
    with Recording([]) as outer:
        with Recording([]) as inner:
            assert launch_plan.recording() is inner
        assert launch_plan.recording() is outer
    assert launch_plan.recording() is None


def test_cpu_calls_have_no_signature():
    out, X, mask = _inputs(0)
    assert launch_plan.signature(_launcher, None, (out, X, mask), {"n": 5}) == (None, None)


def test_a_call_with_one_replayable_launch_replays_it_from_its_own_tensors():
    """A call plan maps each launcher slot to the call tensor that filled it, so that a
    repeat of the call replays the launch on its new tensors without the launcher's
    signature; a call whose launcher met a copy, or that made two launches or one
    without a plan, keeps its own path (False)."""
    out, X, mask = _inputs(0)
    extra = torch.zeros(1)
    plan = _record(_launcher, [out, X, mask], n=5)
    launch_plan.clear()
    launch_plan.remember_call(("one",), [(plan, [out, X, mask, None])], (extra, X, out, mask))
    entry, sources, _ = launch_plan.call_plan(("one",))
    assert entry is plan and sources == (2, 1, 3, None)
    new = _inputs(1)
    call = (extra, new[1], new[0], new[2])
    replayed = plan.replay([None if s is None else call[s] for s in sources], stream=0)
    assert torch.equal(replayed, _launcher(*_inputs(1), n=5))
    launch_plan.remember_call(("copy",), [(plan, [out.clone(), X, mask])], (out, X, mask))
    launch_plan.remember_call(("two",), [(plan, [out, X, mask])] * 2, (out, X, mask))
    launch_plan.remember_call(("none",), [(None, None)], (out, X, mask))
    assert [launch_plan.call_plan((k,)) for k in ("copy", "two", "none")] == [False] * 3
    assert launch_plan.call_plan(("unseen",)) is None
    launch_plan.clear()
    assert launch_plan.call_plan(("one",)) is None

def test_plans_are_recorded_only_where_every_entry_kernel_launches_through_the_cache(
    monkeypatch,
):
    """A launcher's module whose entry kernels are all CachedLaunches qualifies; one with a
    kernel swapped for its JIT function, or left unwrapped by cached_launch, does not."""
    from lik.runtime import launch_cache

    module = types.ModuleType("lik_plan_probe")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(launch_cache._entry_kernels, module.__name__, {"fwd_kernel"})
    exec("def launch(out):\n    return out", module.__dict__)
    launcher = functools.partial(module.launch)  # registry binds launchers so
    module.fwd_kernel = launch_cache.CachedLaunch(object())
    assert launch_cache.launches_every_kernel_cached(launcher)
    module.fwd_kernel = object()  # its JIT function, say
    assert not launch_cache.launches_every_kernel_cached(launcher)
    module.fwd_kernel = launch_cache.CachedLaunch(object())
    monkeypatch.setattr(launch_cache, "_unwrapped_modules", {module.__name__})
    assert not launch_cache.launches_every_kernel_cached(launcher)


def _host_functions(path: Path):
    """The functions of a generated file that run on the host (not @triton.jit)."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not any(
            "jit" in ast.unparse(decorator) for decorator in node.decorator_list
        ):
            yield node


# Tensor-making torch calls a launcher must not make outside workspace's recorded helpers.
TORCH_CREATORS = {"empty", "zeros", "ones", "full", "empty_like", "zeros_like", "arange", "tensor"}


@pytest.mark.parametrize("path", sorted(GENERATED.glob("*.py")), ids=lambda p: p.stem)
def test_generated_launchers_allocate_through_workspace_and_write_nothing_in_place(path):
    """What a launch plan's log relies on: every tensor a launcher makes and passes on
    comes from a recorded helper (anything else is refused, as above), and no launcher
    changes a tensor in place outside its kernels, which a replay would not repeat."""
    for function in _host_functions(path):
        for node in ast.walk(function):
            where = f"{path.name}:{node.lineno if hasattr(node, 'lineno') else '?'}"
            assert not isinstance(node, ast.AugAssign), f"in-place update at {where}"
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            method = node.func.attr
            assert not (
                method.endswith("_") and not method.startswith("_")
            ), f"in-place {method} at {where}"
            owner = ast.unparse(node.func.value)
            assert not (
                owner == "torch" and method in TORCH_CREATORS
            ), f"torch.{method} at {where}: allocate through workspace"


# ---------------------------------------------------------------------------------------
# GPU: the generated launchers' plans, replayed through lik's entries.


def _tokens(*shape, seed, grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.nn.functional.normalize(torch.randn(*shape, generator=g, device="cuda"), dim=-1)
    return t.bfloat16().requires_grad_(grad)


def _prefix_mask(rows, length, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    lengths = torch.randint(0, length + 1, (rows,), generator=g, device="cuda")
    return torch.arange(length, device="cuda") < lengths[:, None]


def _matches_the_reference(scores, ref, leaves, ref_leaves, training):
    """scores, and when training the gradients of a random weighting of them, against the
    float64 reference's."""
    assert relative_error(scores, ref) < TOLERANCE[torch.bfloat16]
    if training:
        weights = torch.randn_like(ref)
        grads = torch.autograd.grad((scores * weights.float()).sum(), leaves)
        expected = torch.autograd.grad((ref * weights).sum(), ref_leaves)
        for got, want in zip(grads, expected, strict=True):
            assert relative_error(got, want) < TOLERANCE[torch.bfloat16]


def _every_launcher_replays() -> dict:
    """Asserts that every launcher recorded a replayable plan; returns the call plans by
    their kind (a call key's first flag)."""
    plans = [plan for plan, _ in launch_plan._plans.values()]
    assert plans and all(plan is not None for plan in plans), "every launcher replays"
    return {key[0]: entry for key, entry in launch_plan._calls.items()}


CALLS = {  # name -> (D shape, masked): in-batch, kd, split long docs (zeroed counters)
    "inbatch": ((9, 67, 96), False),
    "inbatch-masked": ((9, 67, 96), True),
    "kd": ((5, 3, 40, 96), False),
    "split-long-docs": ((2, 4096, 96), True),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("training", [False, True], ids=["forward", "training"])
def test_replayed_plans_score_and_train_as_the_reference(name, training):
    """Three calls of one signature on fresh inputs: the first records each launcher's
    plan, the others replay it; each matches the float64 reference, gradients too."""
    from lik.runtime import maxsim
    from lik.runtime.reference import maxsim_reference

    shape, masked = CALLS[name]
    nq = shape[0] if len(shape) == 4 else 5
    launch_plan.clear()
    for seed in range(3):
        Q = _tokens(nq, 19, 96, seed=10 * seed, grad=training)
        D = _tokens(*shape, seed=10 * seed + 1, grad=training)
        d_mask = _prefix_mask(shape[0] * (shape[1] if len(shape) == 4 else 1), shape[-2],
                              seed).view(shape[:-1]) if masked else None  # fmt: skip
        scores = maxsim(Q, D, d_mask=d_mask)
        Qr = Q.detach().double().requires_grad_(training)
        Dr = D.detach().double().requires_grad_(training)
        ref = maxsim_reference(Qr, Dr, d_mask=d_mask)
        _matches_the_reference(scores, ref, (Q, D), (Qr, Dr), training)
    calls = _every_launcher_replays()
    # Calls of one launch (all but split long docs' forward) replay from their own tensors.
    if name != "split-long-docs":
        assert calls.get("forward"), "the forward replays as a call plan"
    if training:
        assert calls.get("backward"), "the backward replays as a call plan"


def _ragged_offsets():
    """int32 offsets of 5 queries (1-23 tokens) and 4 docs (1-69 tokens) of ragged lengths."""
    g = torch.Generator().manual_seed(0)
    lengths = (torch.randint(1, 24, (5,), generator=g), torch.randint(1, 70, (4,), generator=g))
    return [torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)]).int().cuda()
            for n in lengths]  # fmt: skip


RAGGED_CALLS = {  # name -> (score_pairs_packed's layout, normalize, backward strategy)
    "varlen": ("varlen", False, None),
    "varlen-unified-normalized": ("varlen", True, "unified"),
    "packed-pairs": ("packed_pairs", False, None),
    "packed-pairs-normalized": ("packed_pairs", True, None),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(RAGGED_CALLS))
@pytest.mark.parametrize("training", [False, True], ids=["forward", "training"])
def test_replayed_ragged_calls_score_and_train_as_the_reference(name, training):
    """As above for the ragged entries, whose backwards cast and reshape fp32 scratch:
    three calls of one signature, each replayed after the first, match the reference."""
    from lik.runtime import maxsim_varlen, score_pairs_packed
    from lik.runtime.reference import score_pairs_packed_reference

    layout, normalize, backward = RAGGED_CALLS[name]
    pair_q = torch.tensor([0, 4, 2, 2, 1, 3], device="cuda")
    pair_d = torch.tensor([1, 0, 3, 2, 3, 0], device="cuda")
    pairs = {} if layout == "varlen" else {"pair_q_idx": pair_q, "pair_d_idx": pair_d}
    launch_plan.clear()
    cu_q, cu_d = _ragged_offsets()  # one batch's, so that every call has one signature
    for seed in range(3):
        Q = _tokens(int(cu_q[-1]), 96, seed=10 * seed, grad=training)
        D = _tokens(int(cu_d[-1]), 96, seed=10 * seed + 1, grad=training)
        bounds = {"max_seqlen_q": 24, "max_seqlen_d": 70}
        if layout == "varlen":
            scores = maxsim_varlen(Q, D, cu_q, cu_d, 24, 70, normalize=normalize,
                                   backward=backward)  # fmt: skip
        else:
            scores = score_pairs_packed(Q, D, cu_q, cu_d, pair_q, pair_d, **bounds,
                                        normalize=normalize)  # fmt: skip
        Qr = Q.detach().double().requires_grad_(training)
        Dr = D.detach().double().requires_grad_(training)
        ref = score_pairs_packed_reference(Qr, Dr, cu_seqlens_q=cu_q, cu_seqlens_d=cu_d,
                                           layout=layout, normalize=normalize, **pairs)  # fmt: skip
        _matches_the_reference(scores, ref, (Q, D), (Qr, Dr), training)
    calls = _every_launcher_replays()
    assert calls.get("forward_ragged"), "the forward replays as a call plan"
    if training:
        assert calls.get("backward_ragged"), "the backward replays as a call plan"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("training", [False, True], ids=["forward", "training"])
def test_a_call_on_one_tensor_twice_does_not_steer_the_next_calls(training):
    """maxsim(Q, Q) first, then calls of two distinct tensors of the same signature: each
    scores (and trains) as the reference, the aliased call's tensor in neither slot."""
    from lik.runtime import maxsim
    from lik.runtime.reference import maxsim_reference

    launch_plan.clear()
    same = _tokens(6, 23, 64, seed=5, grad=training)
    fresh = [(_tokens(6, 23, 64, seed=s, grad=training),
              _tokens(6, 23, 64, seed=s + 1, grad=training)) for s in (6, 8)]  # fmt: skip
    calls = [(same, same), *fresh]
    for Q, D in calls:
        scores = maxsim(Q, D)
        Qr = Q.detach().double().requires_grad_(training)
        Dr = D.detach().double().requires_grad_(training)
        ref = maxsim_reference(Qr, Qr if D is Q else Dr)
        assert relative_error(scores, ref) < TOLERANCE[torch.bfloat16]
        if training and D is not Q:
            gq, gd = torch.autograd.grad(scores.sum(), (Q, D))
            rq, rd = torch.autograd.grad(ref.sum(), (Qr, Dr))
            assert relative_error(gq, rq) < TOLERANCE[torch.bfloat16]
            assert relative_error(gd, rd) < TOLERANCE[torch.bfloat16]
