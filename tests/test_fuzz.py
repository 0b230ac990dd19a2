"""A seeded fuzz of the public scoring entries against a float64 reference written here.

Each case is drawn from its own seed (`Case.draw`): an entry (maxsim's in-batch, KD,
one-query and one-doc layouts, maxsim_pairs, maxsim_varlen), sizes from 0 tokens up, odd
head dims (1, 3, 7, 48 among others), masks with holes (fully masked rows included),
NaN or an infinity written into every masked position, now and then a NaN or infinity
in one valid token, normalize, the backward strategy, and whether gradients are taken;
and for the padded layouts with a doc mask and no normalize, now and then the doc mask
read as zeros (PyLate's convention, lik.runtime.api.maxsim_masked_as_zero).
The reference below (`expected`) sanitizes masked positions itself and shares no code
with lik.runtime.reference; its rule is the one that module's docstring writes down.

Both CPU paths run: the CPU backend path on small shapes, the generated kernels under the
Triton interpreter on tiny ones. Every group prints its case counts (pytest -s) and
records them as test properties. Under a minute in all on a 2-core CPU;
LIK_FUZZ_CASES=10 draws ten times as many cases.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch

from lik.runtime import api, backends, maxsim, maxsim_pairs, maxsim_varlen

NAN, INF = float("nan"), float("inf")
ENTRIES = ("dense", "kd", "one_query", "one_doc", "pairs", "varlen")
HEAD_DIMS = (1, 3, 7, 48)
BASE_SEED = 5200
# Cases per group: 50 s in all on a 2-core CPU that other jobs shared (the reference path
# ~15 ms a case, the interpreter ~0.2 s). LIK_FUZZ_CASES scales both (e.g. 10 for a soak).
SCALE = float(os.environ.get("LIK_FUZZ_CASES", "1"))
REFERENCE_CASES = round(400 * SCALE)
INTERPRETER_CASES = round(240 * SCALE)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
GRAD_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# On a GPU fp32 dots are tf32: DESIGN.md's 1e-3 (bf16 as on the CPU).
CUDA_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 1e-2}
CUDA_GRAD_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 2e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    seed: int
    path: str  # "cpu", "interpreter" or "cuda"
    entry: str
    dtype: torch.dtype
    nq: int
    nd: int  # docs, or K candidates per query (kd); == nq for pairs
    lq: int
    ld: int
    d: int
    q_mask: bool
    d_mask: bool
    poison: float | None  # written into every masked position
    valid_value: float | None  # written into one valid coordinate (forward only)
    normalize: bool
    backward: str | None
    grad: bool
    zero: bool = False  # the doc mask read as zeros (a masked doc token competes as 0)

    @classmethod
    def draw(cls, seed: int, path: str) -> Case:
        r = random.Random(seed)
        tiny = path == "interpreter"
        entry = r.choice(ENTRIES)
        nq = r.choice([0] + [1, 2, 3] * 6) if tiny else r.choice([0] + list(range(1, 6)) * 4)
        nd = nq if entry == "pairs" else (r.randint(1, 3) if tiny else r.randint(0, 6))
        lq = r.choice([0] + list(range(1, 10) if tiny else range(1, 40)) * 2)
        ld = r.choice([0] + list(range(1, 13) if tiny else range(1, 60)) * 2)
        d = r.choice(HEAD_DIMS + (r.randint(1, 20 if tiny else 130),))
        padded = entry != "varlen"
        q_mask = padded and r.random() < 0.5
        d_mask = padded and r.random() < 0.6
        poison = r.choice([NAN, INF, -INF, 3e38]) if q_mask or d_mask else None
        valid_value = r.choice([NAN, INF, -INF]) if r.random() < 0.1 else None
        grad = valid_value is None and r.random() < 0.5
        dtype = torch.bfloat16 if r.random() < 0.15 else torch.float32
        normalize, backward = r.random() < 0.4, r.choice([None, "unified", "lowmem"])
        # Drawn last, so that the draws above stay what they were before it existed.
        zero = entry in ("dense", "kd", "pairs") and d_mask and not normalize
        zero = zero and r.random() < 0.6
        return cls(seed, path, entry, dtype, nq, nd, lq, ld, d, q_mask, d_mask, poison,
                   valid_value, normalize, backward, grad, zero)  # fmt: skip

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        masks = "q" * self.q_mask + "d" * self.d_mask + " as zero" * self.zero or "none"
        sizes = f"nq={self.nq} nd={self.nd} lq={self.lq} ld={self.ld} d={self.d}"
        values = f"poison={self.poison} valid_value={self.valid_value}"
        call = f"normalize={self.normalize} backward={self.backward} grad={self.grad}"
        where = f"seed={self.seed} {self.path} {self.entry} {dtype}"
        return f"{where} {sizes} masks={masks} {values} {call}"


# ---------------------------------------------------------------------------------------
# Inputs


def _mask(shape, g):
    """A mask with holes: each token valid with a probability drawn per mask; now and then
    a whole row (a query, a doc) masked."""
    keep = 0.3 + 0.6 * torch.rand((), generator=g).item()
    mask = torch.rand(shape, generator=g) < keep
    if mask.dim() > 1 and mask.shape[0] > 1 and torch.rand((), generator=g).item() < 0.5:
        mask[-1] = False
    return mask


def _poisoned(X, mask, value):
    if mask is None or value is None:
        return X
    return torch.where(mask[..., None], X, torch.full((), value, dtype=X.dtype))


def _with_valid_value(X, mask, value, g):
    """X with `value` written into one coordinate of one valid token (if any)."""
    valid = torch.ones(X.shape[:-1], dtype=torch.bool) if mask is None else mask
    spots = valid.nonzero()
    if value is None or spots.shape[0] == 0 or X.shape[-1] == 0:
        return X
    spot = spots[torch.randint(spots.shape[0], (), generator=g)]
    X = X.clone()
    X[(*spot.tolist(), torch.randint(X.shape[-1], (), generator=g).item())] = value
    return X


def _shapes(case):
    q = (case.lq, case.d) if case.entry == "one_query" else (case.nq, case.lq, case.d)
    if case.entry == "kd":
        dshape = (case.nq, case.nd, case.ld, case.d)
    elif case.entry == "one_doc":
        dshape = (case.ld, case.d)
    else:
        dshape = (case.nd, case.ld, case.d)
    return q, dshape


def _padded_inputs(case, g):
    qshape, dshape = _shapes(case)
    Q, D = torch.randn(qshape, generator=g), torch.randn(dshape, generator=g)
    q_mask = _mask(qshape[:-1], g) if case.q_mask else None
    d_mask = _mask(dshape[:-1], g) if case.d_mask else None
    Q, D = _poisoned(Q, q_mask, case.poison), _poisoned(D, d_mask, case.poison)
    if torch.rand((), generator=g).item() < 0.5:
        Q = _with_valid_value(Q, q_mask, case.valid_value, g)
    else:
        D = _with_valid_value(D, d_mask, case.valid_value, g)
    return Q.to(case.dtype), D.to(case.dtype), q_mask, d_mask


def _offsets(count, longest, g):
    lengths = torch.randint(0, longest + 1, (count,), generator=g)
    return torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)


def _ragged_inputs(case, g):
    cu_q, cu_d = _offsets(case.nq, case.lq, g), _offsets(case.nd, case.ld, g)
    Q = torch.randn(int(cu_q[-1]), case.d, generator=g)
    D = torch.randn(int(cu_d[-1]), case.d, generator=g)
    if torch.rand((), generator=g).item() < 0.5:
        Q = _with_valid_value(Q, None, case.valid_value, g)
    else:
        D = _with_valid_value(D, None, case.valid_value, g)
    return Q.to(case.dtype), D.to(case.dtype), cu_q, cu_d


# ---------------------------------------------------------------------------------------
# The float64 reference of this file: masked positions are set to 0 here, before anything
# else, then scored in IEEE arithmetic.


def _zero_masked(X, mask):
    if mask is None:
        return X
    return torch.where(mask[..., None], X, torch.zeros((), dtype=X.dtype))


def _unit(X):
    return X / X.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def _best(sim, valid, zero=False):
    """Per query token, the max over its doc tokens that `valid` admits (None: all);
    0 where none is valid. zero: every token `valid` leaves out competes with similarity
    0 (the 0 wins a tie only as a 0: the valid token keeps the gradient)."""
    if sim.shape[-1] == 0:
        return sim.sum(dim=-1)
    if valid is None:
        return sim.amax(dim=-1)
    best = sim.masked_fill(~valid, -INF).amax(dim=-1)
    best = torch.where(valid.any(dim=-1), best, torch.zeros((), dtype=best.dtype))
    if zero:
        left_out = (~valid).any(dim=-1)
        best = torch.where(left_out & (best < 0), torch.zeros((), dtype=best.dtype), best)
    return best


def expected(case, Q, D, q_mask, d_mask):
    """Float64 scores of a padded case (Q and D float64 leaves, poison and all)."""
    Q, D = _zero_masked(Q, q_mask), _zero_masked(D, d_mask)
    if case.normalize:
        Q, D = _unit(Q), _unit(D)
    if case.entry == "one_query":
        Q, q_mask = Q[None], None if q_mask is None else q_mask[None]
    if case.entry == "one_doc":
        D, d_mask = D[None], None if d_mask is None else d_mask[None]
    if case.entry == "kd":
        sim = torch.einsum("isk,ictk->icst", Q, D)
        dm = None if d_mask is None else d_mask[:, :, None, :]
    elif case.entry == "pairs":
        sim = torch.einsum("bsk,btk->bst", Q, D)
        dm = None if d_mask is None else d_mask[:, None, :]
    else:
        sim = torch.einsum("isk,jtk->ijst", Q, D)
        dm = None if d_mask is None else d_mask[None, :, None, :]
    best = _best(sim, dm, case.zero)
    if q_mask is not None:
        qm = q_mask if case.entry == "pairs" else q_mask[:, None, :]
        best = torch.where(qm, best, torch.zeros((), dtype=best.dtype))
    out = best.sum(dim=-1)
    if case.entry == "one_query":
        out = out[0]
    if case.entry == "one_doc":
        out = out[..., 0]
    return out


def expected_ragged(case, Q, D, cu_q, cu_d):
    if case.normalize:
        Q, D = _unit(Q), _unit(D)
    nq, nd = len(cu_q) - 1, len(cu_d) - 1
    if nq * nd == 0:  # zeros that keep both inputs' graphs
        return (Q.sum() * 0 + D.sum() * 0).expand(nq, nd)
    rows = []
    for i in range(nq):
        q = Q[cu_q[i] : cu_q[i + 1]]
        rows.append(torch.stack([_best(q @ D[cu_d[j] : cu_d[j + 1]].T, None).sum()
                                 for j in range(nd)]))  # fmt: skip
    return torch.stack(rows)


# ---------------------------------------------------------------------------------------
# Running and checking a case


def _call(case, Q, D, q_mask, d_mask):
    kw = {"normalize": case.normalize, "backward": case.backward}
    if case.zero:
        return api.maxsim_masked_as_zero(Q, D, q_mask, d_mask, pairs=case.entry == "pairs",
                                         backward=case.backward)  # fmt: skip
    if case.entry == "pairs":
        return maxsim_pairs(Q, D, q_mask, d_mask, **kw)
    return maxsim(Q, D, q_mask, d_mask, **kw)


def _relative_error(out, ref):
    out, ref = out.double(), ref.double()
    if ref.numel() == 0:
        return 0.0
    scale = ref.norm().item()
    return (out - ref).norm().item() / (scale if scale > 0 else 1.0)


def _check_scores(out, ref, dtype, device="cpu"):
    """None when out matches ref: NaN where ref is NaN, the same infinities, close
    elsewhere; else what differs."""
    if out.dtype != torch.float32:
        return f"scores are {out.dtype}, not float32"
    if tuple(out.shape) != tuple(ref.shape):
        return f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    out, ref = out.double(), ref.detach()
    if not torch.equal(out.isnan(), ref.isnan()):
        return f"NaN pattern differs: {out.tolist()} vs {ref.tolist()}"
    infinite = ref.isinf()
    if not torch.equal(out[infinite], ref[infinite]) or out[~infinite].isinf().any():
        return f"infinities differ: {out.tolist()} vs {ref.tolist()}"
    finite = ref.isfinite()
    err = _relative_error(out[finite], ref[finite])
    tolerance = (CUDA_TOLERANCE if device == "cuda" else TOLERANCE)[dtype]
    if not err < tolerance:
        return f"relative error {err:.3g} >= {tolerance:g}"
    return None


def _check_grads(names, grads, refs, masks, dtype, device="cpu"):
    tolerance = (CUDA_GRAD_TOLERANCE if device == "cuda" else GRAD_TOLERANCE)[dtype]
    for name, grad, ref, mask in zip(names, grads, refs, masks, strict=True):
        if not grad.isfinite().all():
            return f"grad {name} is not finite where the reference's is"
        if mask is not None and (grad[~mask] != 0).any():
            return f"grad {name} is nonzero at masked positions"
        err = _relative_error(grad, ref)
        if not err < tolerance:
            return f"grad {name}: relative error {err:.3g} >= {tolerance:g}"
    return None


def _ties(case):
    """Whether the winners may tie: normalized tokens of head dim 1 are all +1 or -1 (the
    reference splits a tied max's gradient, the kernels give it to one token)."""
    return case.normalize and case.d == 1


def run_case(case) -> str | None:
    """None when the case passes, else what failed. The reference runs on the CPU in
    float64; lik on the case's path (the CPU's, or CUDA for path "cuda")."""
    g = torch.Generator().manual_seed(case.seed)
    device = "cuda" if case.path == "cuda" else "cpu"
    if case.entry == "varlen":
        Q, D, cu_q, cu_d = _ragged_inputs(case, g)
        given = case.nq and torch.rand((), generator=g).item() < 0.5
        bound = int((cu_q[1:] - cu_q[:-1]).max()) if given else None
        cu_q_lik, cu_d_lik = cu_q.to(device), cu_d.to(device)

        def score(q, d):
            return maxsim_varlen(q, d, cu_q_lik, cu_d_lik, max_seqlen_q=bound,
                                 normalize=case.normalize, backward=case.backward)  # fmt: skip

        def reference(q, d):
            return expected_ragged(case, q, d, cu_q.tolist(), cu_d.tolist())

        masks = (None, None)
    else:
        Q, D, q_mask, d_mask = _padded_inputs(case, g)
        q_mask_lik, d_mask_lik = (None if m is None else m.to(device) for m in (q_mask, d_mask))

        def score(q, d):
            return _call(case, q, d, q_mask_lik, d_mask_lik)

        def reference(q, d):
            return expected(case, q, d, q_mask, d_mask)

        masks = (q_mask, d_mask)
    grad = case.grad and not _ties(case)
    leaves = [X.to(device).requires_grad_(grad) for X in (Q.clone(), D.clone())]
    refs = [Q.double().requires_grad_(grad), D.double().requires_grad_(grad)]
    try:
        out = score(*leaves)
    except Exception as error:  # a case must score, not raise
        return f"raised {type(error).__name__}: {error}"
    ref = reference(*refs)
    problem = _check_scores(out.detach().cpu(), ref, case.dtype, device)
    if problem or not grad or out.numel() == 0:
        return problem
    weights = torch.rand(out.shape, generator=g, dtype=torch.float64) + 0.5
    try:
        lik_grads = torch.autograd.grad((out.double() * weights.to(device)).sum(), leaves,
                                        allow_unused=True)  # fmt: skip
    except Exception as error:
        return f"backward raised {type(error).__name__}: {error}"
    ref_grads = torch.autograd.grad((ref * weights).sum(), refs, allow_unused=True)
    lik_grads = [
        torch.zeros_like(x) if gr is None else gr.cpu()
        for gr, x in zip(lik_grads, refs, strict=True)
    ]
    ref_grads = [
        torch.zeros_like(x) if gr is None else gr for gr, x in zip(ref_grads, refs, strict=True)
    ]
    return _check_grads(("Q", "D"), lik_grads, ref_grads, masks, case.dtype, device)


# ---------------------------------------------------------------------------------------
# The groups


def _cases(path, count):
    return [Case.draw(BASE_SEED + i, path) for i in range(count)]


def _use_path(path, monkeypatch):
    if path == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    elif torch.cuda.is_available():
        pytest.skip("the interpreter runs where there is no GPU (make soak covers GPUs)")
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    if backends.device_backend(torch.device("cpu")) != path:
        pytest.skip(f"no {path} path here")


def _run_group(cases, record_property, group):
    failures = [f"{case}: {problem}" for case in cases if (problem := run_case(case))]
    counts = {
        "cases": len(cases),
        "with gradients": sum(c.grad and not _ties(c) for c in cases),
        "poisoned padding": sum(c.poison is not None for c in cases),
        "non-finite valid value": sum(c.valid_value is not None for c in cases),
        "doc mask as zeros": sum(c.zero for c in cases),
        "failed": len(failures),
    }
    for entry in ENTRIES:
        counts[entry] = sum(c.entry == entry for c in cases)
    record_property(f"fuzz {group}", counts)
    print(f"\nfuzz {group}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n" + "\n".join(failures)


quiet_numpy = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def test_fuzz_cpu_path(monkeypatch, record_property):
    _use_path("cpu", monkeypatch)
    _run_group(_cases("cpu", REFERENCE_CASES), record_property, "cpu path")


@quiet_numpy
def test_fuzz_interpreter_path(monkeypatch, record_property):
    _use_path("interpreter", monkeypatch)
    _run_group(_cases("interpreter", INTERPRETER_CASES), record_property, "interpreter path")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@quiet_numpy
def test_fuzz_cuda_path(record_property):
    """The same draws on the GPU: the compiled kernels, bf16 code included (the interpreter
    runs every dot in fp32). `make soak` runs it LIK_FUZZ_CASES times as often."""
    _run_group(_cases("cuda", REFERENCE_CASES), record_property, "cuda path")


def test_the_draws_cover_what_the_fuzz_promises():
    """The seeded draws reach every entry, the odd head dims, empty sizes, both mask
    sides, every poison and backward, on both paths (a change to Case.draw that lost one
    would fail here, not go unnoticed)."""
    for path, count in (("cpu", REFERENCE_CASES), ("interpreter", INTERPRETER_CASES)):
        cases = _cases(path, count)
        assert {c.entry for c in cases} == set(ENTRIES), path
        assert set(HEAD_DIMS) <= {c.d for c in cases}, path
        assert any(c.lq == 0 or c.ld == 0 or c.nq == 0 for c in cases), path
        assert any(c.q_mask for c in cases) and any(c.d_mask for c in cases), path
        poisons = {str(c.poison) for c in cases}
        assert {"nan", "inf", "-inf"} <= poisons, (path, poisons)
        assert {c.backward for c in cases if c.grad} == {None, "unified", "lowmem"}, path
        zero = [c for c in cases if c.zero]
        assert {c.entry for c in zero} == {"dense", "kd", "pairs"}, path
        assert any(c.grad for c in zero) and any(c.q_mask for c in zero), path
