"""Runtime: validation errors, device paths, keys, tuning configs, registry integrity."""

from __future__ import annotations

import pytest
import torch

from lik.runtime import (
    MaxSimScorer,
    backends,
    describe_backend,
    maxsim,
    maxsim_pairs,
    registry,
    retrieve,
)
from lik.runtime.keys import KernelKey, lq_bucket, padded_head_dim, size_class, variant_name
from lik.runtime.tuning import config_for, default_config

Q = torch.randn(2, 5, 16)
D = torch.randn(3, 7, 16)


@pytest.mark.parametrize(
    "call, error, fragments",
    [
        (lambda: maxsim(Q[0, 0], D), ValueError, ["Q must be", "got 1 dims"]),
        (lambda: maxsim(Q, D[None, None]), ValueError, ["D must be", "got 5 dims"]),
        (
            lambda: maxsim(Q, torch.randn(3, 7, 15)),
            ValueError,
            ["head dim", "Q has 16", "D has 15"],
        ),
        (lambda: maxsim(Q.double(), D.double()), TypeError, ["Q must have dtype", "torch.float64"]),
        (lambda: maxsim(Q, D.half()), TypeError, ["share a dtype", "torch.float16"]),
        (lambda: maxsim(Q.tolist(), D), TypeError, ["Q must be a torch.Tensor", "list"]),
        (
            lambda: maxsim(Q, D, torch.ones(2, 4, dtype=torch.bool)),
            ValueError,
            ["q_mask must have shape (2, 5)", "got (2, 4)"],
        ),
        (
            lambda: maxsim(Q, D, None, torch.ones(3, 7)),
            TypeError,
            ["d_mask must be bool", "float32"],
        ),
        (
            lambda: maxsim(Q, D, None, torch.ones(7, 3, dtype=torch.bool)),
            ValueError,
            ["d_mask must have shape (3, 7)"],
        ),
        (lambda: maxsim(Q, torch.randn(3, 4, 7, 16)), ValueError, ["kd layout", "Nq=2"]),
        (lambda: maxsim(Q, D, backward="fast"), ValueError, ["backward must be one of", "'fast'"]),
        (
            lambda: maxsim(torch.randn(2, 5, 600), torch.randn(3, 7, 600)),
            ValueError,
            ["head dim 600 exceeds"],
        ),
        (lambda: maxsim_pairs(Q, D), ValueError, ["one doc per query", "B=2", "3"]),
        (
            lambda: maxsim_pairs(Q, D[:2], None, torch.ones(2, 6, dtype=torch.bool)),
            ValueError,
            ["d_mask must have shape (2, 7)"],
        ),
    ],
)
def test_bad_inputs_raise_named_errors(call, error, fragments):
    with pytest.raises(error) as caught:
        call()
    for fragment in fragments:
        assert fragment in str(caught.value), f"{fragment!r} not in {caught.value}"


def test_masks_on_another_device_are_refused():
    meta_mask = torch.ones(2, 5, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match="q_mask must be on cpu"):
        maxsim(Q, D, meta_mask)


def test_cpu_backend_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert backends.device_backend(torch.device("cpu")) == "cpu"
    assert "CPU backend" in describe_backend("cpu")
    Qg = Q.clone().requires_grad_()
    out = maxsim(Qg, D)  # the reference is autograd-aware
    out.sum().backward()
    assert Qg.grad is not None and out.dtype == torch.float32


def test_buckets():
    assert [padded_head_dim(d) for d in (1, 16, 48, 96, 128, 129)] == [16, 16, 64, 128, 128, 256]
    assert [lq_bucket(n) for n in (1, 16, 17, 32, 300, 512, 900)] == [16, 16, 32, 32, 512, 512, 512]
    assert [size_class(n) for n in (1, 1023, 1024, 70000)] == ["s", "s", "m", "l"]


def test_variant_names_match_the_compiler():
    from lik_gen.ir import Variant

    name = variant_name("kd", True, False, True, torch.float16)
    assert name == "maxsim_kd_qmask_fp16_triton_norm"
    assert Variant.parse(name).name == name
    assert name in registry.names()


def test_every_runtime_variant_is_generated():
    """Each (layout, masks, normalize, dtype) the runtime can ask for exists in the manifest."""
    for layout in ("dense", "kd", "pairs"):
        for q in (False, True):
            for d in (False, True):
                for norm in (False, True):
                    for dtype in (torch.float32, torch.float16, torch.bfloat16):
                        assert variant_name(layout, q, d, norm, dtype) in registry.names()


def test_config_caps_pipeline_stages_to_shared_memory():
    key = KernelKey("maxsim_dense_nomask_fp32_triton", "ada", 512, 512, "l")
    module = registry.load(key.variant)
    config = config_for(key, module.smem_bytes)
    assert module.smem_bytes(512, config.block_l, 512, config.num_stages) <= 99 * 1024 or (
        config.num_stages == 1
    )
    assert config.num_stages < default_config(key)["num_stages"]


def test_hand_edited_generated_file_is_refused():
    import importlib.resources

    name = "maxsim_dense_nomask_fp32_triton"
    path = registry.kernel_file(name)
    text = (importlib.resources.files("lik.generated") / path).read_text()
    registry.verify_text(name, path, text)  # the committed file passes
    edited = text.replace("BLOCK_L: tl.constexpr", "BLOCK_L: tl.constexpr = 64")
    assert edited != text
    with pytest.raises(registry.GeneratedFileError, match="run `make generate`"):
        registry.verify_text(name, path, edited)
    with pytest.raises(registry.GeneratedFileError):
        registry.verify_text(name, path, text.replace("# body-sha256:", "# body:"))


def test_an_edit_that_rewrites_the_header_hash_is_still_refused():
    # The manifest records every file's own hash: a body edit that also recomputes the
    # header's body hash still differs from it.
    import hashlib
    import importlib.resources
    import re

    name = "maxsim_dense_nomask_fp32_triton"
    path = registry.kernel_file(name)
    text = (importlib.resources.files("lik.generated") / path).read_text()
    head, body = text.split("\n\n", 1)
    body = body.replace("row_max(best, sim, TOKEN_ROWS)", "tl.max(sim, axis=1)", 1)
    head = re.sub(
        r"body-sha256: [0-9a-f]{64}",
        "body-sha256: " + hashlib.sha256(body.encode()).hexdigest(),
        head,
    )
    forged = head + "\n\n" + body
    assert forged != text
    with pytest.raises(registry.GeneratedFileError, match="MANIFEST.json"):
        registry.verify_text(name, path, forged)


def test_a_missing_generated_file_names_itself_and_the_fix(monkeypatch):
    import importlib.resources

    name = "maxsim_dense_nomask_fp32_triton"

    class EmptyPackage:
        def __truediv__(self, child):
            def missing(self):
                raise FileNotFoundError(child)

            return type("File", (), {"read_text": missing})()

    monkeypatch.setattr(importlib.resources, "files", lambda package: EmptyPackage())
    with pytest.raises(
        registry.GeneratedFileError, match=r"maxsim_dense_triton\.py.*missing.*make generate"
    ):
        registry.read_verified(name)


def test_unknown_variant_names_say_how_to_add_one():
    with pytest.raises(KeyError, match="make generate"):
        registry.load("maxsim_dense_nomask_fp64_triton")


@pytest.mark.parametrize("entry", ["maxsim", "maxsim_pairs", "retrieve", "maxsim_smooth"])
def test_integer_masks_score_as_bool_masks_on_every_path(lik_path, entry):
    # HF-style int64 attention masks, nonzero = valid (2 counts as valid too).
    from lik.runtime import maxsim_smooth

    generator = torch.Generator().manual_seed(21)
    Q, D = torch.randn(3, 6, 16, generator=generator), torch.randn(3, 9, 16, generator=generator)
    q_mask = torch.rand(3, 6, generator=generator) < 0.7
    d_mask = torch.rand(3, 9, generator=generator) < 0.6
    call = {
        "maxsim": lambda qm, dm: maxsim(Q, D, qm, dm),
        "maxsim_pairs": lambda qm, dm: maxsim_pairs(Q, D, qm, dm),
        "retrieve": lambda qm, dm: retrieve(Q, D, 2, qm, dm)[0],
        "maxsim_smooth": lambda qm, dm: maxsim_smooth(Q, D, qm, dm, tau=0.5),
    }[entry]
    as_int = call(q_mask.long() * 2, d_mask.to(torch.int32))
    assert torch.equal(as_int, call(q_mask, d_mask))


FLAG_CALLS = {
    "maxsim normalize": lambda Q, D, v: maxsim(Q, D, normalize=v),
    "maxsim_pairs normalize": lambda Q, D, v: maxsim_pairs(Q, D, normalize=v),
    "retrieve largest": lambda Q, D, v: retrieve(Q, D, 2, largest=v),
    "retrieve sorted": lambda Q, D, v: retrieve(Q, D, 2, sorted=v),
    "MaxSimScorer normalize": lambda Q, D, v: MaxSimScorer(normalize=v),
}


@pytest.mark.parametrize("value", ["yes", None, 1])
@pytest.mark.parametrize("call", list(FLAG_CALLS))
def test_bool_flags_are_refused_unless_bools(call, value):
    # Not read by truthiness: "yes", None and 1 are refused, naming the argument.
    Q, D = torch.randn(3, 4, 8), torch.randn(3, 5, 8)
    name = call.split()[-1]
    with pytest.raises(TypeError, match=f"{name} must be a bool"):
        FLAG_CALLS[call](Q, D, value)


def test_numpy_bools_are_bools():
    numpy = pytest.importorskip("numpy")
    Q, D = torch.randn(3, 4, 8), torch.randn(3, 5, 8)
    assert torch.equal(maxsim(Q, D, normalize=numpy.True_), maxsim(Q, D, normalize=True))


def test_a_zero_head_dim_is_refused():
    with pytest.raises(ValueError, match="head dim .* at least 1"):
        maxsim(torch.randn(2, 3, 0), torch.randn(4, 5, 0))
