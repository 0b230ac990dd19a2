"""Reliability of the public entries (maxsim, maxsim_pairs, retrieve, MaxSimScorer):
input checks, NaN/Inf semantics, 64-bit offsets, strided inputs, no host syncs on the hot
path, run-to-run determinism, thread safety of the caches, refusal of edited kernels.

Without a GPU the generated kernels run under the Triton interpreter (conftest); with one,
the same tests run the compiled kernels. GPU-only checks (a corpus past 2**31 elements,
CUDA graphs, sync debug mode, atomics spread) live in test_gpu_reliability.py.
"""

from __future__ import annotations

import ast
import collections
import functools
import importlib
import importlib.resources
import pathlib
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
from helpers import INTERPRETER_FP32_TOLERANCE, TOLERANCE, jit_functions, relative_error
from torch.utils._python_dispatch import TorchDispatchMode

from lik.runtime import backends, configs, maxsim, maxsim_pairs, registry
from lik.runtime.reference import maxsim_pairs_reference, maxsim_reference
from lik.runtime.retrieval import merge_top_k, retrieve, retrieve_sharded
from lik.runtime.scorer import MaxSimScorer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETER = DEVICE == "cpu"
KERNELS = backends.device_backend(torch.device(DEVICE)) in backends.GENERATED_TRITON
needs_kernels = pytest.mark.skipif(not KERNELS, reason="no Triton path on this machine")
ROOT = pathlib.Path(__file__).resolve().parents[1]
# Every structural MaxSim kernel (each serves all its masks, normalize values and dtypes).
GENERATED = sorted((ROOT / "generated" / "triton").glob("maxsim_*.py"))


def _tolerance(dtype):
    return (
        INTERPRETER_FP32_TOLERANCE if INTERPRETER and dtype == torch.float32 else TOLERANCE[dtype]
    )


# ---------------------------------------------------------------------------------------
# 1. Input validation: every public entry, one case per row


def _sharded(Q, D, top_k, q_mask, d_mask):
    return retrieve_sharded(Q, D, top_k, q_mask, d_mask)


ENTRIES = {
    "maxsim": lambda Q, D, qm, dm, k: maxsim(Q, D, qm, dm),
    "maxsim_pairs": lambda Q, D, qm, dm, k: maxsim_pairs(Q, D, qm, dm),
    "retrieve": lambda Q, D, qm, dm, k: retrieve(Q, D, k, qm, dm),
    "retrieve_sharded": lambda Q, D, qm, dm, k: _sharded(Q, D, k, qm, dm),
    "MaxSimScorer.forward": lambda Q, D, qm, dm, k: MaxSimScorer()(Q, D, qm, dm),
    "MaxSimScorer.score": lambda Q, D, qm, dm, k: MaxSimScorer().score(Q, D, qm, dm),
    "MaxSimScorer.retrieve": lambda Q, D, qm, dm, k: MaxSimScorer().retrieve(Q, D, k, qm, dm),
}
RETRIEVAL_ENTRIES = ["retrieve", "retrieve_sharded", "MaxSimScorer.retrieve"]

# B = Nq = Nd = 2, so the same inputs are valid for maxsim_pairs too.
Q0 = torch.randn(2, 5, 16, device=DEVICE)
D0 = torch.randn(2, 7, 16, device=DEVICE)
QM0 = torch.ones(2, 5, dtype=torch.bool, device=DEVICE)
DM0 = torch.ones(2, 7, dtype=torch.bool, device=DEVICE)
META = torch.device("meta")

# name: (Q, D, q_mask, d_mask), error, fragments (the argument, what was expected, what was given)
BAD_INPUTS = {
    "Q wrong rank": ((Q0[0, 0], D0, None, None), ValueError, ["Q must be", "got 1 dims"]),
    "D wrong rank": ((Q0, D0[None, None], None, None), ValueError, ["D must be", "got 5 dims"]),
    "Q not a tensor": (
        (Q0.tolist(), D0, None, None),
        TypeError,
        ["Q must be a torch.Tensor", "list"],
    ),
    "head dim mismatch": (
        (Q0, D0[..., :15], None, None),
        ValueError,
        ["head dim", "Q has 16", "D has 15"],
    ),
    "unsupported dtype": (
        (Q0.double(), D0.double(), None, None),
        TypeError,
        ["Q must have dtype in", "torch.bfloat16", "got torch.float64"],
    ),
    "integer embeddings": (
        (Q0, D0.long(), None, None),
        TypeError,
        ["D must have dtype in", "got torch.int64"],
    ),
    "mixed dtypes": (
        (Q0, D0.half(), None, None),
        TypeError,
        ["share a dtype", "Q is torch.float32", "D is torch.float16"],
    ),
    "mixed devices": (
        (Q0, D0.to(META), None, None),
        ValueError,
        ["one device", f"Q is on {Q0.device}", "D on meta"],
    ),
    "q_mask on another device": (
        (Q0, D0, QM0.to(META), None),
        ValueError,
        [f"q_mask must be on {Q0.device}", "got meta"],
    ),
    "d_mask on another device": (
        (Q0, D0, None, DM0.to(META)),
        ValueError,
        [f"d_mask must be on {Q0.device}", "got meta"],
    ),
    "q_mask wrong shape": (
        (Q0, D0, QM0[:1], None),
        ValueError,
        ["q_mask must have shape (2, 5)", "got (1, 5)"],
    ),
    "d_mask wrong shape": (
        (Q0, D0, None, DM0.t()),
        ValueError,
        ["d_mask must have shape (2, 7)", "got (7, 2)"],
    ),
    "q_mask float": ((Q0, D0, QM0.float(), None), TypeError, ["q_mask must be bool", "float32"]),
    "d_mask float": ((Q0, D0, None, DM0.half()), TypeError, ["d_mask must be bool", "float16"]),
    "q_mask not a tensor": ((Q0, D0, QM0.tolist(), None), TypeError, ["q_mask must be", "list"]),
    # A mask longer than its tensor is refused, never truncated.
    "q_mask longer than Lq": (
        (Q0, D0, torch.ones(2, 6, dtype=torch.bool, device=DEVICE), None),
        ValueError,
        ["q_mask must have shape (2, 5)", "got (2, 6)"],
    ),
    "d_mask longer than Ld": (
        (Q0, D0, None, torch.ones(2, 8, dtype=torch.bool, device=DEVICE)),
        ValueError,
        ["d_mask must have shape (2, 7)", "got (2, 8)"],
    ),
}


@pytest.fixture(scope="module")
def single_rank_group():
    """A one-process gloo group, so retrieve_sharded can be called in this process."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _assert_raises(call, error, fragments):
    with pytest.raises(error) as caught:
        call()
    for fragment in fragments:
        assert fragment in str(caught.value), f"{fragment!r} not in {caught.value!r}"


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize("row", list(BAD_INPUTS))
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_every_entry_names_the_bad_argument(entry, row):
    (Q, D, q_mask, d_mask), error, fragments = BAD_INPUTS[row]
    _assert_raises(lambda: ENTRIES[entry](Q, D, q_mask, d_mask, 2), error, fragments)


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize("top_k, error", [(0, ValueError), (-1, ValueError), (1.5, TypeError)])
@pytest.mark.parametrize("entry", RETRIEVAL_ENTRIES)
def test_every_retrieval_entry_refuses_top_k_below_one(entry, top_k, error):
    _assert_raises(lambda: ENTRIES[entry](Q0, D0, None, None, top_k), error, ["top_k", "got"])


def test_token_ids_longer_than_the_embeddings_are_refused():
    scorer = MaxSimScorer(mask_pad_token=0)
    ids = torch.ones(2, 6, dtype=torch.long, device=DEVICE)
    _assert_raises(
        lambda: scorer.forward_with_ids(Q0, D0, ids, DM0.long()),
        ValueError,
        ["q_ids must have shape (2, 5)", "got (2, 6)"],
    )


# ---------------------------------------------------------------------------------------
# NaN and Inf: a non-finite input that takes part in a score makes that score NaN (or the
# IEEE infinity), never a silent finite number. Masked positions take no part: padding
# may hold anything.

NAN, INF = float("nan"), float("inf")
# The interpreter's numpy arithmetic warns on inf * 0 and the like; that is the point here.
quiet_numpy = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _nonfinite_case(where, value, layout, normalize, masked=False):
    g = torch.Generator().manual_seed(1)
    Q = torch.randn(2, 4, 16, generator=g)
    D = torch.randn(2 if layout == "pairs" else 3, 5, 16, generator=g)
    q_mask = torch.ones(2, 4, dtype=torch.bool)
    d_mask = torch.ones(D.shape[:2], dtype=torch.bool)
    # The doc token that wins for query 0, token 0 against doc 0.
    sim = Q[0] @ D[0].T
    token = {"winning": sim[0].argmax(), "losing": sim[0].argmin()}.get(where, 0)
    if where == "query":
        Q[0, 1, 3] = value
        q_mask[0, 1] = not masked
    else:
        D[0, token, 2] = value
        d_mask[0, token] = not masked
    return Q, D, q_mask, d_mask


def _score(layout, Q, D, q_mask, d_mask, normalize, device=DEVICE):
    args = (Q.to(device), D.to(device), q_mask.to(device), d_mask.to(device))
    if layout == "pairs":
        return maxsim_pairs(*args, normalize=normalize).cpu()
    return maxsim(*args, normalize=normalize).cpu()


def _reference(layout, Q, D, q_mask, d_mask, normalize):
    reference = maxsim_pairs_reference if layout == "pairs" else maxsim_reference
    return reference(Q.double(), D.double(), q_mask, d_mask, normalize=normalize)


def _assert_same_non_finite(out, ref):
    """NaN wherever the reference is NaN, non-finite wherever it is (an infinity may come
    back as NaN: split-precision fp32 dots compute inf - inf), close elsewhere."""
    assert torch.equal(out.isfinite(), ref.isfinite()), f"finite pattern: {out} vs {ref}"
    assert out[ref.isnan()].isnan().all(), f"NaN lost: {out} vs {ref}"
    finite = ref.isfinite()
    assert relative_error(out[finite], ref[finite]) < _tolerance(torch.float32)


NON_FINITE_CASES = {
    "NaN query token": ("query", NAN, False),
    "NaN query token normalized": ("query", NAN, True),
    "NaN winning doc token": ("winning", NAN, False),
    "NaN winning doc token normalized": ("winning", NAN, True),
    "NaN losing doc token": ("losing", NAN, False),
    "inf winning doc token": ("winning", INF, False),
    "-inf winning doc token": ("winning", -INF, False),
    "inf query token normalized": ("query", INF, True),
    "inf winning doc token normalized": ("winning", INF, True),
}


@pytest.mark.parametrize("layout", ["dense", "pairs"])
@pytest.mark.parametrize("case", list(NON_FINITE_CASES))
def test_non_finite_inputs_on_the_reference_path(case, layout, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    where, value, normalize = NON_FINITE_CASES[case]
    inputs = _nonfinite_case(where, value, layout, normalize)
    out = _score(layout, *inputs, normalize, device="cpu")
    ref = _reference(layout, *inputs, normalize)
    _assert_same_non_finite(out, ref)
    if value != value:  # NaN
        assert out.isnan().any()


@quiet_numpy
@needs_kernels
@pytest.mark.parametrize("layout", ["dense", "pairs"])
@pytest.mark.parametrize(
    "case",
    list(NON_FINITE_CASES),
)
def test_non_finite_inputs_on_the_kernel_path(case, layout):
    where, value, normalize = NON_FINITE_CASES[case]
    inputs = _nonfinite_case(where, value, layout, normalize)
    out = _score(layout, *inputs, normalize)
    _assert_same_non_finite(out, _reference(layout, *inputs, normalize))


@quiet_numpy
@pytest.mark.parametrize("path", ["kernel", "cpu"])
@pytest.mark.parametrize("where", ["query", "winning"])
@pytest.mark.parametrize("value", [NAN, INF])
def test_non_finite_values_in_masked_positions_are_ignored(value, where, path, monkeypatch):
    if path == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    elif not KERNELS:
        pytest.skip("no Triton path on this machine")
    device = "cpu" if path == "cpu" else DEVICE
    Q, D, q_mask, d_mask = _nonfinite_case(where, value, "dense", True, masked=True)
    out = _score("dense", Q, D, q_mask, d_mask, True, device=device)
    clean = _score("dense", Q.nan_to_num(0, 0, 0), D.nan_to_num(0, 0, 0), q_mask, d_mask, True,
                   device=device)  # fmt: skip
    assert out.isfinite().all()
    assert torch.equal(out, clean)


def test_retrieve_ranks_a_nan_score_first_whatever_its_sign_bit(monkeypatch):
    """Arithmetic NaN on x86 (inf - inf) has its sign bit set; NaN must still order above
    every number, as torch.topk orders it, so a NaN document shows at the top."""
    negative_nan = torch.tensor([-(2**22)], dtype=torch.int32).view(torch.float32)  # 0xFFC00000
    assert negative_nan.isnan().all()
    scores = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    scores[0, 3] = negative_nan
    ids = torch.arange(4)[None]
    best, best_ids = merge_top_k([(scores, ids)], 2)
    assert best[0, 0].isnan() and best_ids.tolist() == [[3, 1]]
    lowest, lowest_ids = merge_top_k([(scores, ids)], 2, largest=False)
    assert lowest_ids.tolist() == scores.topk(2, largest=False).indices.tolist() == [[0, 2]]

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the reference path propagates NaN
    Q, D = torch.randn(2, 3, 8), torch.randn(5, 4, 8)
    D[4, 1, 0] = -NAN
    top_scores, top_ids = retrieve(Q, D, 2, normalize=False)
    assert top_scores[:, 0].isnan().all() and (top_ids[:, 0] == 4).all()


# ---------------------------------------------------------------------------------------
# 2. 64-bit offsets. Nd * Ld * d (the corpus) and Nq * Nd * Lq (the saved argmax) pass
# 2**31 elements at real sizes; Triton computes in int32 unless an operand is int64, so
# every index that multiplies a stride must be int64 or a small within-row offset.


@functools.cache
def _parsed(path):
    return ast.parse(path.read_text())


def _is_int64_cast(node):
    """`x.to(tl.int64)` or `tl.cast(x, tl.int64)`."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    if node.func.attr == "to":
        return len(node.args) == 1 and ast.unparse(node.args[0]) == "tl.int64"
    return (
        ast.unparse(node.func) == "tl.cast"
        and len(node.args) == 2
        and ast.unparse(node.args[1]) == "tl.int64"
    )


@functools.cache
def _widths(fn):
    return _IndexWidths(fn)


class _IndexWidths:
    """Which names of one jit function hold int64 values, and which hold small offsets
    (built from tl.arange, constants, constexprs and tile loops within one row)."""

    def __init__(self, fn):
        self.constexpr = {
            a.arg for a in fn.args.args if a.annotation and "constexpr" in ast.unparse(a.annotation)
        }
        kernel = fn.name.endswith("_kernel")
        # Helper parameters named offs_* receive the callers' within-row offsets.
        self.small = set() if kernel else {a.arg for a in fn.args.args if a.arg.startswith("offs")}
        self.wide = set()
        assignments = [n for n in ast.walk(fn) if isinstance(n, ast.Assign | ast.For)]
        size = -1
        while size != len(self.wide) + len(self.small):  # to a fixed point
            size = len(self.wide) + len(self.small)
            for node in assignments:
                if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                    name = node.targets[0].id
                    if self.is_wide(node.value):
                        self.wide.add(name)
                    elif self.is_small(node.value):
                        self.small.add(name)
                elif isinstance(node, ast.For) and isinstance(node.target, ast.Name):
                    bounds = node.iter.args
                    if any(self.is_wide(b) for b in bounds):
                        self.wide.add(node.target.id)
                    elif len(bounds) == 3 or all(self.is_small(b) for b in bounds):
                        self.small.add(node.target.id)  # a tile loop, or a constant count

    def is_wide(self, e):
        if _is_int64_cast(e):
            return True
        if isinstance(e, ast.Name):
            return e.id in self.wide
        if isinstance(e, ast.BinOp):
            return self.is_wide(e.left) or self.is_wide(e.right)
        if isinstance(e, ast.UnaryOp):
            return self.is_wide(e.operand)
        if isinstance(e, ast.Subscript):
            return self.is_wide(e.value)
        if isinstance(e, ast.Call) and ast.unparse(e.func) in (
            "tl.minimum",
            "tl.maximum",
            "tl.where",
        ):
            return any(self.is_wide(a) for a in e.args[-2:])
        return False

    def is_small(self, e):
        if isinstance(e, ast.Constant):
            return True
        if isinstance(e, ast.Name):
            return e.id in self.small or e.id in self.constexpr
        if isinstance(e, ast.BinOp):
            return self.is_small(e.left) and self.is_small(e.right)
        if isinstance(e, ast.Subscript):
            return self.is_small(e.value)
        if isinstance(e, ast.Call):
            # _reversed_bits(value, NBITS) reorders the low NBITS bits of a small value.
            if ast.unparse(e.func) == "_reversed_bits":
                return self.is_small(e.args[0])
            return ast.unparse(e.func) == "tl.arange"
        return False


def _narrow_stride_products():
    """{(kernel role, index expression, stride): [variants]} for every index that
    multiplies a stride while neither int64 nor a small offset."""
    found = collections.defaultdict(list)
    for path in GENERATED:
        for fn in jit_functions(path):
            widths = _widths(fn)
            for node in ast.walk(fn):
                if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)):
                    continue
                for index, stride in ((node.left, node.right), (node.right, node.left)):
                    if isinstance(stride, ast.Name) and stride.id.startswith("stride"):
                        if not (widths.is_wide(index) or widths.is_small(index)):
                            role = fn.name.removeprefix(path.stem)
                            found[(role, ast.unparse(index), stride.id)].append(path.stem)
    return found


# Index expressions allowed to stay int32 while multiplying a stride (none today: the
# lowmem loops used to index rows with their int32 counters, wrong past 2**31 elements).
KNOWN_INT32_ROW_OFFSETS: set[tuple[str, str, str]] = set()


def test_generated_sources_were_found():
    assert len(GENERATED) >= 25
    assert any(fn.name.endswith("_kernel") for fn in jit_functions(GENERATED[0]))


def test_every_program_id_is_cast_to_int64():
    def is_program_id(node):
        return isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "program_id"

    for path in GENERATED:
        calls = [n for n in ast.walk(_parsed(path)) if is_program_id(n)]
        cast = [
            n for n in ast.walk(_parsed(path)) if _is_int64_cast(n) and is_program_id(n.func.value)
        ]
        assert calls and len(cast) == len(calls), f"{path.name}: a program id stays int32"


def test_argmax_indices_are_int64_before_they_multiply_a_stride():
    checked = 0
    for path in GENERATED:
        for fn in jit_functions(path):
            widths = _widths(fn)
            loaded = {
                node.targets[0].id
                for node in ast.walk(fn)
                if isinstance(node, ast.Assign)
                and isinstance(node.targets[0], ast.Name)
                and "tl.load(Argmax" in ast.unparse(node.value)
            }
            for node in ast.walk(fn):
                if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
                    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                    if names & loaded and any(n.startswith("stride") for n in names):
                        checked += 1
                        index = node.left
                        assert widths.is_wide(index), f"{path.name} {fn.name}: {ast.unparse(node)}"
    assert checked > 0


def test_no_new_int32_row_offsets():
    found = _narrow_stride_products()
    new = {key: found[key][:2] for key in set(found) - KNOWN_INT32_ROW_OFFSETS}
    assert not new, f"indices multiplying strides in int32: {new}"


def test_lowmem_backward_row_offsets_are_int64():
    found = _narrow_stride_products()
    assert not found, f"int32 row offsets: {sorted(found)}"


# Views whose row strides push offsets past 2**31 elements over one lazily committed
# storage: only the few pages the views touch are ever written, so this costs megabytes.
# Each check runs in a child process, since an int32 offset there reads unmapped memory.
_HUGE_STRIDE_SCRIPT = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
from lik.runtime import maxsim, maxsim_pairs
from lik.runtime.reference import maxsim_pairs_reference, maxsim_reference

ROW = 2**30 + 64  # elements between rows: row 2 starts past 2**31
try:
    storage = torch.empty(2 * ROW + 1024, dtype=torch.float16)
except RuntimeError as exc:
    print("SKIP", exc)
    sys.exit(0)
g = torch.Generator().manual_seed(0)

def rows(n, shape, offset):
    view = storage[offset:].as_strided((n, *shape), (ROW, *torch.empty(shape).stride()))
    view.copy_(torch.randn(n, *shape, generator=g).half())
    return view

D = rows(3, (5, 16), 0)                 # doc 2 starts at element 2 * ROW > 2**31
Q = rows(3, (4, 16), 100)               # query 2 too
Dkd = rows(3, (2, 5, 16), 200)
cases = {
    "dense": (maxsim, maxsim_reference, Q, D),
    "kd": (maxsim, maxsim_reference, Q, Dkd),
    "pairs": (maxsim_pairs, maxsim_pairs_reference, Q, D),
}
backward = sys.argv[1]
for name, (score, reference, q, d) in cases.items():
    qg, dg = q.detach().requires_grad_(), d.detach().requires_grad_()
    qr, dr = q.double().requires_grad_(), d.double().requires_grad_()
    if backward == "none":
        with torch.no_grad():
            out = score(qg, dg)
    else:
        out = score(qg, dg, backward=backward)
        out.sum().backward()
    ref = reference(qr, dr)
    ref.sum().backward()
    errors = [(out.double() - ref).abs().max().item()]
    if backward != "none":
        errors += [(qg.grad.double() - qr.grad).abs().max().item(),
                   (dg.grad.double() - dr.grad).abs().max().item()]
    print(name, max(errors), flush=True)
"""


@pytest.mark.skipif(
    not INTERPRETER, reason="lazily committed CPU storage; GPU: test_gpu_reliability"
)
@pytest.mark.parametrize(
    "backward",
    [
        "none",
        "unified",
        "lowmem",
    ],
)
def test_offsets_past_2_31_elements_with_huge_strides(backward):
    run = subprocess.run(
        # -P: a source checkout's lik/ folder must not shadow the installed package.
        [sys.executable, "-P", "-c", _HUGE_STRIDE_SCRIPT, backward],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if run.stdout.startswith("SKIP"):
        pytest.skip(f"cannot reserve 4 GiB of address space: {run.stdout}")
    assert run.returncode == 0, f"exit {run.returncode}: {run.stdout}{run.stderr[-2000:]}"
    results = dict(line.split() for line in run.stdout.splitlines())
    assert set(results) == {"dense", "kd", "pairs"}
    assert all(float(err) < 1e-2 for err in results.values()), results


# ---------------------------------------------------------------------------------------
# 3. Non-contiguous inputs: strides are kernel arguments, forward and backward


def _strided(layout, view, seed):
    """Non-contiguous (Q, D, q_mask, d_mask) for a layout, as views of leaf tensors that
    take the gradient; returns (leaves, build) where build(leaves) makes the views."""
    g = torch.Generator().manual_seed(seed)
    Nq, K, Lq, Ld, d = 3, 4, 5, 9, 24
    if view == "strided head dim":
        Qb = torch.randn(Nq, Lq, 2 * d, generator=g)
        Db = torch.randn(*({"dense": (K,), "kd": (Nq, K), "pairs": (Nq,)}[layout]), Ld, 2 * d,
                         generator=g)  # fmt: skip
        q_view = lambda t: t[..., ::2]
        d_view = lambda t: t[..., ::2]
    else:  # sliced queries, transposed doc axes
        Qb = torch.randn(2 * Nq, Lq + 2, d, generator=g)
        q_view = lambda t: t[::2, 1:-1]
        if layout == "kd":
            Db = torch.randn(K, Nq, Ld, d, generator=g)
            d_view = lambda t: t.transpose(0, 1)
        else:
            Db = torch.randn(Ld, {"dense": K, "pairs": Nq}[layout], d, generator=g)
            d_view = lambda t: t.transpose(0, 1)
    d_mask_shape = d_view(Db).shape[:-1]
    q_mask = (torch.rand(Nq, 2 * Lq, generator=g) < 0.8)[:, ::2]
    d_mask = (torch.rand(*reversed(d_mask_shape), generator=g) < 0.7).permute(
        *reversed(range(len(d_mask_shape)))
    )
    return Qb, Db, q_view, d_view, q_mask, d_mask


def _train(score, Qb, Db, q_view, d_view, q_mask, d_mask, weights, **options):
    Qb, Db = Qb.clone().requires_grad_(), Db.clone().requires_grad_()
    Q, D = q_view(Qb), d_view(Db)
    assert not Q.is_contiguous() and not D.is_contiguous()
    out = score(Q, D, q_mask, d_mask, **options)
    (out * weights).sum().backward()
    return out, Qb.grad, Db.grad


@needs_kernels
@pytest.mark.parametrize("layout", ["dense", "kd", "pairs"])
@pytest.mark.parametrize(
    "view, backward",
    [
        ("sliced and transposed", "unified"),
        ("sliced and transposed", "lowmem"),
        ("strided head dim", "unified"),
        ("strided head dim", "lowmem"),
    ],
)
def test_strided_inputs_forward_and_backward(layout, view, backward):
    Qb, Db, q_view, d_view, q_mask, d_mask = _strided(layout, view, seed=len(layout + view))
    assert not q_mask.is_contiguous() and not d_mask.is_contiguous()
    score = maxsim_pairs if layout == "pairs" else maxsim
    reference = maxsim_pairs_reference if layout == "pairs" else maxsim_reference
    n_out = {"dense": (3, 4), "kd": (3, 4), "pairs": (3,)}[layout]
    weights = torch.randn(n_out, generator=torch.Generator().manual_seed(3))
    to = lambda *ts: [t.to(DEVICE) for t in ts]
    out, gq, gd = _train(score, *to(Qb, Db), q_view, d_view, *to(q_mask, d_mask, weights),
                         normalize=True, backward=backward)  # fmt: skip
    ref, rq, rd = _train(reference, Qb.double(), Db.double(), q_view, d_view, q_mask, d_mask,
                         weights.double(), normalize=True)  # fmt: skip
    tolerance = _tolerance(torch.float32)
    assert relative_error(out, ref) < tolerance
    assert relative_error(gq, rq) < tolerance, f"grad_Q error {relative_error(gq, rq):.3g}"
    assert relative_error(gd, rd) < tolerance, f"grad_D error {relative_error(gd, rd):.3g}"


@needs_kernels
def test_broadcast_doc_mask_and_docs_with_zero_strides():
    """expand() views (stride 0) are common for shared padding masks; no copy is needed."""
    g = torch.Generator().manual_seed(6)
    Q = torch.randn(2, 5, 16, generator=g).to(DEVICE)
    D = torch.randn(1, 7, 16, generator=g).to(DEVICE).expand(4, 7, 16)
    d_mask = (torch.rand(7, generator=g) < 0.6).to(DEVICE).expand(4, 7)
    out = maxsim(Q, D, None, d_mask)
    ref = maxsim_reference(Q.double(), D.double(), None, d_mask)
    assert relative_error(out, ref) < _tolerance(torch.float32)


# ---------------------------------------------------------------------------------------
# 4. No device-to-host sync on the hot path (the GPU test runs sync debug mode and CUDA
# graphs; here: no syncing call in the source, and none observed in a training step)

HOT_PATH = ["runtime/api.py", "runtime/dispatch.py", "runtime/autograd.py"]
SYNC_METHODS = {"item", "tolist", "cpu", "numpy", "synchronize", "nonzero", "masked_select"}
SYNC_OPS = {
    "aten._local_scalar_dense.default",  # .item(), bool(t), int(t), float(t)
    "aten.nonzero.default",
    "aten.masked_select.default",
    "aten._unique2.default",
    "aten.is_nonzero.default",
    "aten.equal.default",
}


def _sync_calls(tree: ast.AST) -> list[str]:
    return [
        ast.unparse(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in SYNC_METHODS
    ]


def test_hot_path_sources_make_no_syncing_calls():
    for path in HOT_PATH:
        assert not _sync_calls(_parsed(ROOT / path)), path
    for path in GENERATED:  # the host glue of the generated modules
        assert not _sync_calls(_parsed(path)), path.name


class _HostSyncDetector(TorchDispatchMode):
    """Records syncing aten ops issued from lik's own code (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in SYNC_OPS:
            frame = sys._getframe(1)
            while frame is not None and frame.f_globals.get("__name__", "").startswith("torch"):
                frame = frame.f_back
            module = frame.f_globals.get("__name__", "") if frame else ""
            if module.startswith("lik."):
                self.seen.append(f"{func} from {module}:{frame.f_lineno}")
        return func(*args, **(kwargs or {}))


def test_sync_detector_sees_an_item_call_in_lik_code():
    code = compile("def f(t):\n    return t.sum().item()\n", "lik_probe", "exec")
    namespace = {"__name__": "lik.probe"}
    exec(code, namespace)
    with _HostSyncDetector() as detector:
        namespace["f"](torch.ones(2))
    assert detector.seen and "lik.probe" in detector.seen[0]


@needs_kernels
@pytest.mark.parametrize("layout", ["dense", "kd", "pairs"])
@pytest.mark.parametrize("backward", ["unified", "lowmem"])
def test_training_step_issues_no_syncing_op(layout, backward):
    g = torch.Generator().manual_seed(2)
    d_shape = {"dense": (3, 9), "kd": (2, 3, 9), "pairs": (2, 9)}[layout]
    Q = torch.randn(2, 5, 16, generator=g).to(DEVICE).requires_grad_()
    D = torch.randn(*d_shape, 16, generator=g).to(DEVICE).requires_grad_()
    q_mask = (torch.rand(2, 5, generator=g) < 0.8).to(DEVICE)
    d_mask = (torch.rand(d_shape, generator=g) < 0.8).to(DEVICE)
    score = maxsim_pairs if layout == "pairs" else maxsim
    with _HostSyncDetector() as detector:
        out = score(Q, D, q_mask, d_mask, normalize=True, backward=backward)
        out.square().sum().backward()
    assert not detector.seen
    assert Q.grad is not None and D.grad is not None


# ---------------------------------------------------------------------------------------
# 5. Determinism (dense forwards and dense lowmem are covered in test_kernels.py and
# test_training.py; here: the other layouts, and the training forwards)


def _layout_inputs(layout, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    d_shape = {"dense": (6, 33), "kd": (4, 3, 33), "pairs": (4, 33)}[layout]
    Q = torch.randn(4, 9, 48, generator=g).to(DEVICE, dtype)
    D = torch.randn(*d_shape, 48, generator=g).to(DEVICE, dtype)
    q_mask = (torch.rand(4, 9, generator=g) < 0.8).to(DEVICE)
    d_mask = (torch.rand(d_shape, generator=g) < 0.7).to(DEVICE)
    return Q, D, q_mask, d_mask


@needs_kernels
@pytest.mark.parametrize("layout", ["kd", "pairs"])
def test_forwards_of_other_layouts_are_bitwise_reproducible(layout):
    Q, D, q_mask, d_mask = _layout_inputs(layout, torch.bfloat16, 4)
    score = maxsim_pairs if layout == "pairs" else maxsim
    first = score(Q, D, q_mask, d_mask, normalize=True)
    assert torch.equal(first, score(Q, D, q_mask, d_mask, normalize=True))


@needs_kernels
@pytest.mark.parametrize("layout", ["dense", "kd", "pairs"])
def test_lowmem_training_step_is_bitwise_reproducible(layout):
    Q, D, q_mask, d_mask = _layout_inputs(layout, torch.bfloat16, 5)
    score = maxsim_pairs if layout == "pairs" else maxsim

    def step():
        Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
        out = score(Qg, Dg, q_mask, d_mask, normalize=True, backward="lowmem")
        out.square().sum().backward()
        return out, Qg.grad, Dg.grad

    first = step()
    for a, b in zip(first, step(), strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------
# 6. Thread safety of the registry and the launch-config cache


@pytest.fixture
def one_interpreter_at_a_time(monkeypatch):
    """The Triton interpreter keeps the program id in a module global, so two kernels
    interpreted at once corrupt each other; compiled kernels need no such lock. Kernel
    launches are serialized here, lik's own code (registry, configs, dispatch) is not."""
    if INTERPRETER:
        from triton.runtime import interpreter

        lock, call = threading.Lock(), interpreter.GridExecutor.__call__

        def serialized(self, *args, **kwargs):
            with lock:
                return call(self, *args, **kwargs)

        monkeypatch.setattr(interpreter.GridExecutor, "__call__", serialized)


def run_concurrent_new_buckets(monkeypatch, device, threads=8):
    """threads callers at once, each on a shape bucket no call has used (fresh registry
    and config cache): returns ({module: times imported}, [relative error per caller])."""
    monkeypatch.setattr(registry, "_kernels", {})
    monkeypatch.setattr(registry, "_bound", {})
    monkeypatch.setattr(configs, "_configs", {})
    monkeypatch.setattr(configs, "_call_configs", {})
    imports = collections.Counter()
    real_import = importlib.import_module

    def counting_import(name, package=None):
        if name.startswith("lik.generated."):
            imports[name] += 1
            time.sleep(0.02)  # widen the window in which a second loader could slip in
        return real_import(name, package)

    monkeypatch.setattr(importlib, "import_module", counting_import)
    barrier, errors = threading.Barrier(threads), [None] * threads

    def caller(i):
        g = torch.Generator().manual_seed(i)
        Lq, d = (1, 17, 33, 65)[i % 4], (16, 48)[i // 4 % 2]  # 4 Lq buckets x 2 head dims
        Q = torch.randn(2, Lq, d, generator=g).to(device)
        D = torch.randn(3, 11, d, generator=g).to(device)
        d_mask = (torch.rand(3, 11, generator=g) < 0.7).to(device) if i % 2 else None
        barrier.wait()
        out = maxsim(Q, D, None, d_mask)
        errors[i] = relative_error(out, maxsim_reference(Q.double(), D.double(), None, d_mask))

    workers = [threading.Thread(target=caller, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return imports, errors


@needs_kernels
@pytest.mark.usefixtures("one_interpreter_at_a_time")
def test_concurrent_callers_load_each_module_once_and_get_correct_scores(monkeypatch):
    imports, errors = run_concurrent_new_buckets(monkeypatch, DEVICE)
    # Both variants (with and without a doc mask) are one structural kernel.
    assert sorted(imports) == ["lik.generated.triton.maxsim_dense_triton"]
    assert set(imports.values()) == {1}, imports
    assert all(e is not None and e < _tolerance(torch.float32) for e in errors), errors
    assert len(configs._configs) == 8  # one per (variant, head dim, Lq bucket) key


# ---------------------------------------------------------------------------------------
# 8. An edited generated file is refused when its variant is first loaded


@needs_kernels
def test_an_edited_kernel_is_refused_at_load_and_never_imported(monkeypatch):
    name = "maxsim_dense_nomask_fp16_triton"
    path = registry.kernel_file(name)
    kernel = registry.entry(name)["kernel"]
    real_files = importlib.resources.files
    text = (real_files("lik.generated") / path).read_text()
    edited = text + "scale = 2.0\n"  # any change to the body

    class EditedPackage:
        def __truediv__(self, child):
            return type("File", (), {"read_text": lambda self: edited})()

    monkeypatch.setattr(registry, "_kernels", {})
    monkeypatch.setattr(registry, "_bound", {})
    monkeypatch.setattr(
        importlib.resources,
        "files",
        lambda pkg: EditedPackage() if pkg == "lik.generated" else real_files(pkg),
    )
    imported = []
    real_import = importlib.import_module
    monkeypatch.setattr(
        importlib, "import_module", lambda n, p=None: imported.append(n) or real_import(n, p)
    )
    Q = torch.randn(2, 3, 16, device=DEVICE, dtype=torch.float16)
    with pytest.raises(registry.GeneratedFileError, match=rf"{path}.*run `make generate`"):
        maxsim(Q, Q)
    assert not any(kernel in n for n in imported) and name not in registry._bound
