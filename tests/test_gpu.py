"""GPU parity: every generated forward variant, compiled, against the float64 reference and
against same-dtype eager PyTorch. Skipped without CUDA; run with `make test-gpu`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    TOLERANCE,
    inference_variant_names,
    poisoned,
    relative_error,
    stable_seed,
    weighted_gradients,
)

from lik.runtime import configs, dispatch, heuristics, maxsim, registry
from lik.runtime.reference import maxsim_pairs_reference, maxsim_reference
from lik_gen.ir import Variant

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # tune.py
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
TORCH_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SHAPES = {  # (Nq, Nd or K, Lq, Ld, d)
    "colbert": (4, 300, 32, 300, 128),
    "odd": (3, 37, 27, 301, 96),
    "lateon": (2, 64, 32, 1024, 48),
    "long-query": (2, 8, 700, 130, 128),
}


def _eager(Q, D, q_mask, d_mask, layout, normalize, masked_as_zero=False):
    """What a user would write in the inputs' dtype: einsum + amax + masked sum (with
    masked_as_zero, PyLate's: the similarities times the doc mask)."""
    if normalize:
        Q, D = torch.nn.functional.normalize(Q, dim=-1), torch.nn.functional.normalize(D, dim=-1)
    spec = {"dense": "isk,jtk->ijst", "kd": "isk,ijtk->ijst", "pairs": "isk,itk->ist"}[layout]
    sim = torch.einsum(spec, Q, D)
    if d_mask is not None:
        if layout == "dense":
            dm = d_mask[None, :, None, :]
        elif layout == "kd":
            dm = d_mask[:, :, None, :]
        else:
            dm = d_mask[:, None, :]
        sim = sim * dm if masked_as_zero else sim.masked_fill(~dm, float("-inf"))
    best = sim.amax(-1).float()
    best = torch.where(torch.isneginf(best), torch.zeros_like(best), best)
    if q_mask is not None:
        best = best * (q_mask[:, None, :] if layout != "pairs" else q_mask).float()
    return best.sum(-1)


# Every variant on the odd shape; the bf16 variants (the dtype users train and serve in)
# on every shape. Each (variant, bucket) compiles once, so the full product costs minutes.
PADDED = inference_variant_names(registry.names())
CASES = [(n, "odd") for n in PADDED] + [
    (n, s) for n in PADDED if "_bf16_" in n for s in SHAPES if s != "odd"
]


@pytest.mark.parametrize("name, shape", CASES)
def test_gpu_variant_parity(name, shape):
    variant = Variant.parse(name)
    Nq, Nd, Lq, Ld, dim = SHAPES[shape]
    layout, dtype = variant.layout.value, TORCH_DTYPE[variant.dtype.value]
    d_shape = {"dense": (Nd, Ld), "kd": (Nq, Nd, Ld), "pairs": (Nq, Ld)}[layout]
    g = torch.Generator(device="cuda").manual_seed(stable_seed(name, shape))
    Q = torch.randn(Nq, Lq, dim, device="cuda", generator=g).to(dtype)
    D = torch.randn(*d_shape, dim, device="cuda", generator=g).to(dtype)
    q_mask = (torch.rand(Nq, Lq, device="cuda", generator=g) < 0.8) if variant.mask.has_q else None
    d_mask = (
        (torch.rand(*d_shape, device="cuda", generator=g) < 0.7) if variant.mask.has_d else None
    )
    zero = variant.mask.as_zero
    reference = maxsim_pairs_reference if layout == "pairs" else maxsim_reference
    ref = reference(Q.double(), D.double(), q_mask, d_mask, normalize=variant.normalize,
                    masked_as_zero=zero)  # fmt: skip
    out_shape = (Nq,) if layout == "pairs" else (Nq, Nd)
    out = dispatch.forward(layout, Q, D, q_mask, d_mask, variant.normalize,
                           poisoned(out_shape, "cuda"), masked_as_zero=zero)  # fmt: skip
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "unwritten (poisoned) output elements"
    err = relative_error(out, ref)
    assert err < TOLERANCE[dtype], f"relative error {err:.3g}"
    if dtype in (torch.float16, torch.bfloat16):
        eager = _eager(Q, D, q_mask, d_mask, layout, variant.normalize, zero)
        eager_err = relative_error(eager, ref)
        assert err <= 1.1 * eager_err + 1e-6, f"error {err:.3g} vs same-dtype eager {eager_err:.3g}"


@pytest.fixture
def autotune_on(monkeypatch, tmp_path):
    """Call-time autotune on (the suite turns it off), a fresh cache, no configs looked up."""
    from lik.runtime import autotune

    monkeypatch.setenv("LIK_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LIK_AUTOTUNE", raising=False)
    monkeypatch.setattr(configs, "_configs", {})
    monkeypatch.setattr(configs, "_call_configs", {})
    autotune.forget()
    yield autotune
    autotune.forget()


def test_gpu_a_key_without_an_entry_sweeps_once_then_launches_its_winner(autotune_on):
    from lik.runtime import maxsim
    from lik.runtime.tuning import committed_source

    g = torch.Generator(device="cuda").manual_seed(3)
    # 64-token queries: no committed Hopper entry has that bucket.
    Q = torch.randn(4, 64, 128, device="cuda", generator=g).to(torch.bfloat16)
    D = torch.randn(300, 200, 128, device="cuda", generator=g).to(torch.bfloat16)
    name = "maxsim_dense_nomask_bf16_triton"
    key = configs.call_key(name, registry.load(name), Q, 64, 4 * 300, "fwd")
    assert committed_source(key) is None
    before = autotune_on.sweeps
    out = maxsim(Q, D)
    assert autotune_on.sweeps == before + 1
    ref = maxsim_reference(Q.double(), D.double())
    assert relative_error(out, ref) <= TOLERANCE[torch.bfloat16]
    entry = autotune_on.cached_entry(key)
    (launched,) = configs._call_configs.values()
    assert (launched.block_l, launched.num_warps, launched.query_group) == (
        entry["block_l"], entry["num_warps"], entry["query_group"])  # fmt: skip
    assert torch.equal(maxsim(Q, D), out) and autotune_on.sweeps == before + 1


def test_gpu_a_training_key_without_an_entry_sweeps_its_backward_once(autotune_on):
    from lik.runtime import maxsim

    g = torch.Generator(device="cuda").manual_seed(4)
    # 64-token queries: no committed Hopper entry, forward or backward, has that bucket.
    Q = torch.randn(16, 64, 128, device="cuda", generator=g).to(torch.bfloat16)
    D = torch.randn(48, 200, 128, device="cuda", generator=g).to(torch.bfloat16)
    weights = torch.randn(16, 48, device="cuda", generator=g)

    def grads(score):
        return weighted_gradients(score, Q, D, weights)

    want = grads(lambda q, d: maxsim_reference(q.double(), d.double()).float())
    before = autotune_on.sweeps
    first = grads(lambda q, d: maxsim(q, d, backward="lowmem"))
    assert autotune_on.sweeps == before + 2  # the forward key and the backward key
    for got, ref in zip(first, want, strict=True):
        assert relative_error(got, ref) <= 2e-2
    name = "maxsim_dense_nomask_bf16_triton_lowmem"
    key = configs.call_key(name, registry.load(name), Q, 64, 16 * 48, "bwd")
    entry = autotune_on.cached_entry(key)
    launched = configs._configs[key]  # the backward's config: the winner's
    assert (launched.block_l, launched.num_warps, launched.num_stages) == (
        entry["block_l"], entry["num_warps"], entry["num_stages"])  # fmt: skip
    again = grads(lambda q, d: maxsim(q, d, backward="lowmem"))
    assert autotune_on.sweeps == before + 2
    assert all(torch.equal(a, b) for a, b in zip(again, first, strict=True))  # repeatable


def test_gpu_make_tune_times_a_backward_as_graph_replays():
    # make tune's backward timing (lik's thread-local graph timer) on a small training step:
    # a positive time, outputs equal to a plain backward's, a disagreeing reference refused.
    import tune

    from lik.runtime.tuning import config_for

    shape = ("step-small", 8, 24, 32, 100, 128, "dense")
    _, backward_key = tune.train_keys(shape, tune.gpu_family(torch.device("cuda")))
    module = registry.load(backward_key.variant)
    _, backward = tune.train_runs(module, shape)
    config = config_for(backward_key, module.smem_bytes)
    plain = [t.clone() for t in backward(config)]
    ms, outputs, why = tune.time_config(backward, config, plain, quick=True, graph=True)
    assert why is None and 0 < ms < 10
    assert all(torch.equal(a, b) for a, b in zip(outputs, plain, strict=True))
    wrong = [t + 1 for t in plain]
    assert tune.time_config(backward, config, wrong, quick=True, graph=True)[0] is None


def test_gpu_no_suite_shape_sweeps_at_call_time(autotune_on):
    # A key does not depend on Ld: each suite shape's key, called with 16-token docs.
    import tune

    from lik.runtime import maxsim

    before = autotune_on.sweeps
    for _, nq, nd, lq, _, d in tune.SHAPES:
        Q = torch.randn(nq, lq, d, device="cuda").to(torch.bfloat16)
        D = torch.randn(nd, 16, d, device="cuda").to(torch.bfloat16)
        maxsim(Q, D)
    # The training steps, forward and backward, as bench_train.py's lik-auto takes them.
    for _, nq, nd, lq, _, d, layout in tune.TRAIN_SHAPES:
        Q = torch.randn(nq, lq, d, device="cuda").to(torch.bfloat16).requires_grad_()
        docs = (nq, nd) if layout == "kd" else (nd,)
        D = torch.randn(*docs, 16, d, device="cuda").to(torch.bfloat16).requires_grad_()
        maxsim(Q, D, backward="auto").sum().backward()
    torch.cuda.synchronize()
    assert autotune_on.sweeps == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("normalize", [False, True])
def test_gpu_varlen_lowmem_gradients(dtype, normalize):
    # Ragged in-batch training at real tile sizes: docs of 0-301 tokens cross several
    # 64-token tiles, queries of 0-40 tokens; against float64, and bitwise repeatable.
    from lik.runtime import maxsim_varlen
    from lik.runtime.reference import score_pairs_packed_reference

    g = torch.Generator().manual_seed(21)
    lq = torch.randint(0, 41, (13,), generator=g)
    ld = torch.randint(0, 302, (29,), generator=g)
    lq[3], ld[5] = 0, 0
    cu_q, cu_d = (torch.cat([torch.zeros(1), n.cumsum(0)]).int().cuda() for n in (lq, ld))
    Q = torch.randn(int(lq.sum()), 96, generator=g).to("cuda", dtype)
    D = torch.randn(int(ld.sum()), 96, generator=g).to("cuda", dtype)
    weights = torch.randn(13, 29, generator=g).cuda()

    def lowmem(q, d):
        return maxsim_varlen(q, d, cu_q, cu_d, normalize=normalize, backward="lowmem")

    def reference(q, d):
        return score_pairs_packed_reference(q.double(), d.double(), cu_seqlens_q=cu_q,
                                            cu_seqlens_d=cu_d, layout="varlen",
                                            normalize=normalize).float()  # fmt: skip

    got = weighted_gradients(lowmem, Q, D, weights)
    want = weighted_gradients(reference, Q, D, weights)
    for grad, ref in zip(got, want, strict=True):
        assert grad.dtype == dtype and relative_error(grad, ref) < TOLERANCE[dtype]
    again = weighted_gradients(lowmem, Q, D, weights)
    assert all(torch.equal(a, b) for a, b in zip(again, got, strict=True))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_docs_stored_token_major_score_under_nested_docs(monkeypatch, dtype):
    # Docs whose head dim is not their contiguous axis ([Nd, d, Ld] storage seen as
    # [Nd, Ld, d]) made Triton 3.6's nested-docs loop read an illegal address on an H200
    # (found by a randomized sweep); lik now copies such docs head-contiguous first.
    monkeypatch.setattr(heuristics, "nested_docs_per_program", lambda config, nq, nd: 8)
    monkeypatch.setattr(configs, "_call_configs", {})
    monkeypatch.setenv("LIK_AUTOTUNE", "0")
    g = torch.Generator(device="cuda").manual_seed(4)
    Q = torch.randn(59, 19, 100, device="cuda", generator=g).to(dtype)
    D = torch.randn(1111, 100, 202, device="cuda", generator=g).to(dtype).transpose(1, 2)
    d_mask = torch.rand(1111, 202, device="cuda", generator=g) < 0.9
    out = maxsim(Q, D, None, d_mask, normalize=True)
    torch.cuda.synchronize()
    ref = maxsim_reference(Q.double(), D.double(), None, d_mask, normalize=True)
    assert relative_error(out, ref) < TOLERANCE[dtype]
