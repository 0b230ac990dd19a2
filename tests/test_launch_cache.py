"""lik.runtime.launch_cache: which launches reuse a compiled kernel, and with what
arguments. CPU: a stand-in JIT function records whether Triton's path or the compiled
kernel served each launch. The GPU test compares the two paths on a generated kernel."""

from __future__ import annotations

import contextlib
import threading
import types

import pytest
import torch
from helpers import INTERPRETER_FP32_TOLERANCE, relative_error

from lik.runtime import backends, launch_cache, launch_plan, maxsim
from lik.runtime.launch_cache import CachedLaunch, cached_launch
from lik.runtime.reference import maxsim_reference


class FakeCompiled:
    function = "function-handle"
    packed_metadata = ("packed",)

    def __init__(self):
        self.launches = []

    def run(self, *launch_args):
        self.launches.append(launch_args)


class FakeJit:
    """A JIT function with parameters (X, n, BLOCK: constexpr); run compiles per call."""

    def __init__(self, names=("X", "n", "BLOCK"), constexpr=("BLOCK",)):
        self.arg_names = list(names)
        self.params = [types.SimpleNamespace(name=n, is_constexpr=n in constexpr) for n in names]
        self.pre_run_hooks = []
        self.triton_launches = 0
        self.compiled = []

    def run(self, *args, grid, warmup, **meta):
        self.triton_launches += 1
        self.compiled.append(FakeCompiled())
        return self.compiled[-1]


@pytest.fixture(autouse=True)
def one_device(request, monkeypatch):
    """CPU tests: a stand-in device and stream (the GPU test keeps the real ones)."""
    if request.node.get_closest_marker("gpu"):
        return
    monkeypatch.setattr(launch_cache, "_current_device", lambda: 0)
    monkeypatch.setattr(launch_cache, "_raw_stream", lambda device: 1234)


def _tensor(dtype=torch.bfloat16, misaligned=False):
    base = torch.zeros(64, dtype=dtype)
    return base[1:] if misaligned else base


def test_a_repeated_launch_calls_the_compiled_kernel_with_every_argument_in_order():
    jit = FakeJit()
    kernel = CachedLaunch(jit)
    X = _tensor()
    kernel[(3,)](X, 40, BLOCK=64, num_warps=4)
    kernel[(5, 2)](X, 56, BLOCK=64, num_warps=4)  # 40 and 56: the same specialization
    assert jit.triton_launches == 1
    (launch,) = jit.compiled[0].launches
    assert launch[:7] == (5, 2, 1, 1234, "function-handle", ("packed",), None)
    assert launch[7:9] == (None, None)  # no hooks
    assert launch[9] is X and launch[10:] == (56, 64)


@pytest.mark.parametrize(
    "first, second",
    [
        ((_tensor(), 40), (_tensor(misaligned=True), 40)),  # 16-byte alignment
        ((_tensor(), 40), (_tensor(torch.float16), 40)),  # dtype
        ((_tensor(), 40), (_tensor(), 1)),  # an int equal to 1
        ((_tensor(), 40), (_tensor(), 32)),  # divisible by 16
        ((_tensor(), 40), (_tensor(), 2**31 + 8)),  # i32 -> i64
        ((_tensor(), 2**40 + 8), (_tensor(), 2**63 + 8)),  # i64 -> u64
        ((None, 40), (_tensor(), 40)),  # None against a tensor
        ((torch.nn.Parameter(_tensor()), 40), (torch.nn.Parameter(_tensor()[1:]), 40)),
        ((_tensor(), True), (_tensor(), False)),  # bools by value
    ],
)
def test_what_triton_specializes_on_selects_another_compiled_kernel(first, second):
    jit = FakeJit()
    kernel = CachedLaunch(jit)
    kernel[(1,)](*first, BLOCK=64)
    kernel[(1,)](*second, BLOCK=64)
    assert jit.triton_launches == 2
    kernel[(1,)](*second, BLOCK=64)
    assert jit.triton_launches == 2 and len(jit.compiled[1].launches) == 1


def test_constexprs_and_launch_options_are_keyed_by_value():
    jit = FakeJit()
    kernel = CachedLaunch(jit)
    X = _tensor()
    for block, warps in [(64, 4), (32, 4), (64, 8), (64, 4)]:
        kernel[(1,)](X, 40, BLOCK=block, num_warps=warps)
    assert jit.triton_launches == 3


def test_a_float_argument_is_keyed_by_type_only():
    jit = FakeJit(names=("X", "tau", "BLOCK"))
    kernel = CachedLaunch(jit)
    kernel[(1,)](_tensor(), 0.5, BLOCK=16)
    kernel[(1,)](_tensor(), 0.25, BLOCK=16)
    assert jit.triton_launches == 1
    assert jit.compiled[0].launches[0][-2] == 0.25


@pytest.mark.parametrize(
    "jit, args, meta",
    [
        (FakeJit(), (_tensor(), 40, 64), {}),  # a constexpr passed by position
        (FakeJit(), (_tensor(),), {"n": 40}),  # BLOCK left to a default
        (FakeJit(), (_tensor(), "forty"), {"BLOCK": 64}),  # an argument the key cannot read
    ],
)
def test_launches_the_key_cannot_rebuild_stay_on_tritons_path(jit, args, meta):
    kernel = CachedLaunch(jit)
    for _ in range(3):
        kernel[(1,)](*args, **meta)
    assert jit.triton_launches == 3
    assert all(not compiled.launches for compiled in jit.compiled)


def test_a_launch_hook_sends_every_launch_through_triton(monkeypatch):
    from triton import knobs

    jit = FakeJit()
    kernel = CachedLaunch(jit)
    kernel[(1,)](_tensor(), 40, BLOCK=64)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: None)
    kernel[(1,)](_tensor(), 40, BLOCK=64)
    assert jit.triton_launches == 2 and not jit.compiled[0].launches


def test_attributes_are_the_jit_functions_and_other_functions_stay_unwrapped():
    jit = FakeJit()
    assert CachedLaunch(jit).arg_names == jit.arg_names

    def plain(x):
        return x

    assert cached_launch(plain) is plain


@contextlib.contextmanager
def tritons_path(module, name):
    """Module attribute `name`, a cached launch, replaced by its JIT function meanwhile
    (launch plans recorded before or meanwhile forgotten: they would launch the cached
    kernel, or, recorded meanwhile, are refused)."""
    kernel = getattr(module, name)
    launch_plan.clear()
    setattr(module, name, kernel.kernel)
    try:
        yield
    finally:
        setattr(module, name, kernel)
        launch_plan.clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_generated_kernel_scores_the_same_through_the_cache_and_through_triton():
    """Aligned and misaligned views, repeated: the cached launches match Triton's own."""
    from lik.runtime import maxsim, registry

    module = registry.load("maxsim_dense_nomask_bf16_triton").module  # the kernel's module
    kernel = module.maxsim_dense_triton_fwd_kernel
    assert isinstance(kernel, CachedLaunch)
    g = torch.Generator(device="cuda").manual_seed(3)
    storage = torch.randn(7 * 37 * 64 + 1, generator=g, device="cuda", dtype=torch.bfloat16)
    Q = torch.randn(3, 11, 64, generator=g, device="cuda", dtype=torch.bfloat16)
    for offset in (0, 1, 0, 1):  # bf16 offset 1: a 2-byte-aligned doc pointer
        D = storage[offset : offset + 7 * 37 * 64].view(7, 37, 64)
        cached = maxsim(Q, D)  # the launcher's path, recording a launch plan
        replayed = maxsim(Q, D)  # its plan
        with tritons_path(module, "maxsim_dense_triton_fwd_kernel"):
            direct = maxsim(Q, D)
        assert torch.equal(cached, direct)
        assert torch.equal(replayed, direct)
    assert len(kernel._compiled) >= 2


def test_an_empty_hook_chain_is_no_hook():
    assert not launch_cache._hooked(None)
    assert not launch_cache._hooked(types.SimpleNamespace(calls=[]))
    assert launch_cache._hooked(types.SimpleNamespace(calls=[print]))
    assert launch_cache._hooked(print)


def test_a_grid_given_as_a_function_stays_on_tritons_path():
    jit = FakeJit()
    kernel = CachedLaunch(jit)
    for _ in range(2):
        kernel[lambda meta: (1,)](_tensor(), 40, BLOCK=64)
    assert jit.triton_launches == 2


@pytest.mark.parametrize(
    "version, supported",
    [
        ("3.5.1", False),
        ("3.6.0", True),
        ("3.9+git1a2b", True),
        ("3.10.0", True),
        ("4.0.0", False),
        ("unknown", False),
    ],  # fmt: skip
)
def test_only_triton_versions_with_the_checked_launch_contract_are_wrapped(version, supported):
    assert launch_cache._supported(version) == supported


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_inputs_on_another_gpu_than_the_current_one_are_scored_there():
    """No set_device: tensors on cuda:1 while cuda:0 is current. Forward and backward,
    through Triton's launch and then the cached one, run on cuda:1 and match float64."""
    from lik.runtime import maxsim
    from lik.runtime.reference import maxsim_reference

    assert torch.cuda.current_device() == 0
    g = torch.Generator(device="cuda:1").manual_seed(5)
    Q = torch.randn(3, 9, 64, generator=g, device="cuda:1").requires_grad_()
    D = torch.randn(5, 41, 64, generator=g, device="cuda:1").requires_grad_()
    maxsim(Q, D).sum().backward()  # first launches: through Triton; the next: cached
    Q.grad = D.grad = None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        scores = maxsim(Q, D)
        scores.sum().backward()
        torch.cuda.synchronize(1)
    ran_on = {e.device_index for e in profile.events() if e.name.startswith("maxsim_")}
    assert ran_on == {1}, ran_on  # peer access would let cuda:0 run them, reading over the link
    torch.testing.assert_close(scores, maxsim_reference(Q, D).float(), rtol=1e-4, atol=1e-4)
    Q64 = Q.detach().double().requires_grad_()
    D64 = D.detach().double().requires_grad_()
    maxsim_reference(Q64, D64).sum().backward()
    torch.testing.assert_close(Q.grad.double(), Q64.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(D.grad.double(), D64.grad, rtol=1e-4, atol=1e-4)
    assert torch.cuda.current_device() == 0


def _descriptor(dtype=torch.bfloat16, block=(16, 16), rows=64):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(torch.zeros(rows, 32, dtype=dtype), list(block))


@pytest.mark.parametrize(
    "second",
    [
        _descriptor(torch.float16),  # element type
        _descriptor(block=(32, 16)),  # block shape
        _descriptor(rows=1),  # a size equal to 1
        _descriptor(rows=40),  # a size not divisible by 16
    ],
    ids=["dtype", "block", "size-1", "size-40"],
)
def test_tma_descriptors_are_keyed_by_all_but_their_address(second):
    """A descriptor of another tensor with the same facts reuses the compiled kernel and
    reaches it as given (the launcher encodes it); other facts compile again."""
    jit = FakeJit()
    kernel = CachedLaunch(jit)
    first, again = _descriptor(), _descriptor()
    kernel[(1,)](first, 40, BLOCK=64)
    kernel[(1,)](again, 40, BLOCK=64)
    assert jit.triton_launches == 1
    assert jit.compiled[0].launches[0][9] is again
    kernel[(1,)](second, 40, BLOCK=64)
    assert jit.triton_launches == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("Ld", [64, 300], ids=["doc-blocks", "flat-tokens"])
def test_fused_head_scores_the_same_through_the_cache_and_through_triton(Ld):
    """The fused head's H arrives as a TMA descriptor (per-doc [Nd, Ld, d_model] or flat
    [Nd * Ld, d_model]); new descriptors of other tensors reuse the compiled kernel."""
    from lik.runtime import head, registry

    module = registry.load("head_dense_nomask_bf16_triton_norm")
    name = "head_dense_triton_fwd_kernel"
    kernel = getattr(module, name)
    g = torch.Generator(device="cuda").manual_seed(5)
    Q = torch.randn(2, 32, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    W = torch.randn(128, 256, generator=g, device="cuda", dtype=torch.bfloat16) / 16
    b = torch.randn(128, generator=g, device="cuda", dtype=torch.bfloat16)
    config = head.head_config(module, Q, Ld)
    for _ in range(3):
        H = torch.randn(5, Ld, 256, generator=g, device="cuda", dtype=torch.bfloat16)
        assert module._tma_operand(H, config)[1]
        cached, _ = head._forward(Q, H, W, b, None, True, False, config)
        with tritons_path(module.module, name):  # the kernel's module, not the bound variant
            direct, _ = head._forward(Q, H, W, b, None, True, False, config)
        assert torch.equal(cached, direct)
    # Every launch keyed (before descriptors were keyed, each stayed on Triton's path).
    assert kernel._compiled and all(e is not None for e in kernel._compiled.values())


# ---------------------------------------------------------------------------------------
# The interpreter (TRITON_INTERPRET=1) is not thread-safe: every interpreted launch of a
# generated kernel holds launch_cache.INTERPRETER_LOCK.

INTERPRETING = backends.device_backend(torch.device("cpu")) == "interpreter"
needs_interpreter = pytest.mark.skipif(not INTERPRETING, reason="runs under TRITON_INTERPRET=1")


@needs_interpreter
def test_an_interpreted_kernel_launches_holding_the_interpreter_lock(monkeypatch):
    from triton.runtime.interpreter import InterpretedFunction

    def kernel(X, n):
        pass

    interpreted = InterpretedFunction(kernel)
    held = []

    def run(*args, grid, warmup, **meta):
        # Another thread cannot take the lock while a launch runs.
        probe = threading.Thread(
            target=lambda: held.append(not launch_cache.INTERPRETER_LOCK.acquire(blocking=False))
        )
        probe.start()
        probe.join()
        return "launched"

    monkeypatch.setattr(interpreted, "run", run)
    wrapped = cached_launch(interpreted)
    assert isinstance(wrapped, launch_cache.SerializedInterpretedLaunch)
    assert wrapped.arg_names == ["X", "n"]
    assert wrapped[(1,)](_tensor(), 4) == "launched"
    assert wrapped.run(_tensor(), 4, grid=(1,), warmup=False) == "launched"
    assert held == [True, True]
    assert launch_cache.INTERPRETER_LOCK.acquire(blocking=False)  # released after each
    launch_cache.INTERPRETER_LOCK.release()


@needs_interpreter
def test_eight_threads_calling_maxsim_at_once_under_the_interpreter_get_correct_scores():
    """Forward and backward launches from 8 threads at once, with no lock of the test's
    own: each thread's scores and gradients are those of the float64 reference."""
    threads = 8
    barrier, results = threading.Barrier(threads), [None] * threads

    def caller(i):
        g = torch.Generator().manual_seed(i)
        Lq, d = (1, 9, 17, 33)[i % 4], (7, 16)[i // 4]
        Q = torch.randn(2, Lq, d, generator=g).requires_grad_()
        D = torch.randn(3, 11, d, generator=g)
        d_mask = (torch.rand(3, 11, generator=g) < 0.7) if i % 2 else None
        barrier.wait()
        try:
            for _ in range(2):
                out = maxsim(Q, D, None, d_mask)
                (grad,) = torch.autograd.grad(out.sum(), Q)
            Qr = Q.detach().double().requires_grad_()
            ref = maxsim_reference(Qr, D.double(), None, d_mask)
            (ref_grad,) = torch.autograd.grad(ref.sum(), Qr)
            results[i] = (relative_error(out.detach(), ref), relative_error(grad, ref_grad))
        except Exception as error:  # reported below, with the thread it failed in
            results[i] = error

    workers = [threading.Thread(target=caller, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    failed = {i: r for i, r in enumerate(results) if not isinstance(r, tuple)}
    assert not failed, failed
    assert all(err < INTERPRETER_FP32_TOLERANCE for pair in results for err in pair), results
