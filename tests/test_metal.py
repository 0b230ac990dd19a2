"""Metal, without a Mac.

A generated .metal file is one structural kernel; a variant is that file compiled after
lik.runtime.metal.preamble, which binds the variant's values (mask presence, normalize,
storage type) as compile-time constants, and after generated/metal/common.metal, the
helpers every kernel shares. The harness compiles exactly what the runtime hands
torch.mps.compile_shader: metal.source(name), preamble, common module and file.

(a) Every declared Metal variant (preamble + common module + its kernel's file) compiles
    as C++ against tests/metal/metal_syntax.h, which declares the Metal surface the
    templates use (one g++ -fsyntax-only run, -Werror: an unused kernel argument fails
    too); attribute names and buffer numbering are checked from each file's text, and
    compiler messages name the generated file and line (metal.source's #line).
(b) A handful of variants run on the CPU: tests/metal/metal_cpu.h implements that surface
    (32 lanes of a simdgroup in lockstep at every simdgroup function), driver.cpp exposes
    the kernels to ctypes, and results are compared with the float64 reference, forward
    (scores and argmax) and backward. An absent mask's slot is bound to a buffer of zeros
    here: a kernel that read it would mask every token and fail the comparison.
(c) The MPS runtime (lik.runtime.metal) is exercised on CPU tensors by replacing only the
    compile boundary, metal.compile_shader: the fake library checks every launch against
    the kernel's own signature (argument count, dtypes, scalars, grid) and runs it on the
    CPU build. Nothing here runs on Apple hardware or says anything about its speed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import subprocess
import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import TOLERANCE, relative_error

from lik.runtime import api, autograd, backends, metal, registry
from lik.runtime.keys import variant_name
from lik.runtime.reference import maxsim_pairs_reference, maxsim_reference
from lik_gen.ir import TORCH_DTYPE_NAME, Backward, DType, Target, Variant

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "tests" / "metal"
GENERATED = ROOT / "generated"
METAL_NAMES = sorted(n for n in registry.names() if Variant.parse(n).target is Target.METAL)
METAL_KERNELS = sorted({registry.entry(n)["kernel"] for n in METAL_NAMES})
# Variants built for execution: every layout, mask, dtype, normalize and backward value
# appears at least once, and several share a kernel's file.
EXECUTED = (
    "maxsim_dense_qdmask_fp32_metal_norm_lowmem",
    "maxsim_dense_qdmask_fp32_metal_norm",
    "maxsim_dense_nomask_bf16_metal_lowmem",
    "maxsim_dense_nomask_fp32_metal",
    "maxsim_kd_dmask_fp16_metal_lowmem",
    "maxsim_kd_qmask_bf16_metal_norm",
    "maxsim_pairs_qdmask_bf16_metal_norm_lowmem",
    "maxsim_pairs_nomask_fp16_metal",
)
# A kernel whose lanes disagree on a simdgroup function: the harness must refuse it.
DIVERGENT_KERNEL = """
kernel void divergent_sum(device float* out [[buffer(0)]],
                          uint group_index [[threadgroup_position_in_grid]],
                          ushort simdgroup_index [[simdgroup_index_in_threadgroup]],
                          ushort lane [[thread_index_in_simdgroup]]) {
    if (lane < 16) {
        out[group_index * 4 + simdgroup_index] = metal::simd_sum(1.0f);
    }
}
"""
CXXFLAGS = ["-std=c++17", "-Wall", "-Wextra", "-Werror", f"-I{HARNESS}", f"-I{HARNESS}/include"]
MSL_DTYPE = {"float": torch.float32, "uchar": torch.uint8, "short": torch.int16}
ATTRIBUTES = {"buffer", "threadgroup_position_in_grid", "simdgroup_index_in_threadgroup",
              "thread_index_in_simdgroup"}  # fmt: skip
# The mask slots, and the Mask property that says whether a variant has the mask.
MASK_SLOTS = {"q_mask": "has_q", "d_mask": "has_d"}


def torch_dtype(dtype: DType) -> torch.dtype:
    return getattr(torch, TORCH_DTYPE_NAME[dtype])


def kernel_text(kernel: str) -> str:
    return (GENERATED / registry.kernels()[kernel]["file"]).read_text()


COMMON_PATH, COMMON_TEXT = registry.read_shared("metal")  # the helpers every kernel shares


# --- building ----------------------------------------------------------------------------


def _compiler() -> list[str]:
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++ or clang++) to check the Metal sources with")
    ignore = "-Wno-unknown-attributes" if "clang" in Path(cxx).name else "-Wno-attributes"
    return [cxx, *CXXFLAGS, ignore]


def _namespaced_sources(names) -> str:
    """One translation unit for many variants: each variant's source (the runtime's
    preamble, the common module and its kernel's file) in a namespace of its own."""
    return "".join(f"namespace v{i} {{\n{metal.source(name)}}}\n" for i, name in enumerate(names))


def launch_key(variant: str, kernel: str) -> str:
    """The driver's name for a kernel of one variant's build (kernel names repeat across
    the variants of a file)."""
    return f"{variant}/{kernel}"


def _kernels_inc(names) -> str:
    entries = []
    for i, name in enumerate(names):
        for kernel in metal.launch_block(metal.source(name))["kernels"].values():
            key, function = launch_key(name, kernel["name"]), kernel["name"]
            entries.append(f'{{"{key}", &lik_cpu::launch_kernel<&v{i}::{function}>}}')
    entries.append('{"divergent_sum", &lik_cpu::launch_kernel<&divergent_sum>}')
    table = ",\n".join(f"    {e}" for e in entries)
    return (_namespaced_sources(names) + DIVERGENT_KERNEL
            + f"static const lik_cpu::KernelEntry LIK_KERNELS[] = {{\n{table}\n}};\n")  # fmt: skip


def build_library(cxx, tmp: Path, names) -> subprocess.Popen:
    """Starts the CPU build of the variants `names` (tmp/libmetal_cpu.so)."""
    (tmp / "kernels.inc").write_text(_kernels_inc(names))
    return subprocess.Popen([*cxx, "-O1", "-shared", "-fPIC", f"-I{tmp}",
                             str(HARNESS / "driver.cpp"), "-o", str(tmp / "libmetal_cpu.so")],
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def load_library(build: subprocess.Popen, tmp: Path):
    _, errors = build.communicate()
    assert build.returncode == 0, errors[-4000:]
    library = ctypes.CDLL(str(tmp / "libmetal_cpu.so"))
    library.lik_cpu_launch.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p),
                                       ctypes.c_long, ctypes.c_long, ctypes.c_char_p,
                                       ctypes.c_long]  # fmt: skip
    return library


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Starts both compiles at once (two cores): the syntax check of every declared
    variant, and the CPU library of the executed variants."""
    cxx = _compiler()
    tmp = tmp_path_factory.mktemp("metal")
    syntax_tu = '#include "metal_syntax.h"\n' + _namespaced_sources(METAL_NAMES)
    (tmp / "syntax.cpp").write_text(syntax_tu)
    syntax = subprocess.Popen([*cxx, "-fsyntax-only", str(tmp / "syntax.cpp")],
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
    build = build_library(cxx, tmp, EXECUTED)
    yield {"syntax": syntax, "build": build, "tmp": tmp, "cxx": cxx}
    for process in (syntax, build):
        if process.poll() is None:
            process.kill()


@pytest.fixture(scope="module")
def cpu_library(builds):
    return load_library(builds["build"], builds["tmp"])


# --- the fake compile boundary -----------------------------------------------------------


def kernel_signatures(source: str) -> dict[str, list[tuple[str, str, int]]]:
    """kernel name -> its buffer arguments as (MSL type, name, buffer index)."""
    out = {}
    for name, params in re.findall(r"kernel void (\w+)\((.*?)\)\s*\{", source, re.DOTALL):
        found = re.findall(r"(.+?)\s*\b(\w+) \[\[buffer\((\d+)\)\]\]", params)
        out[name] = [(decl.strip(" ,\n"), arg, int(index)) for decl, arg, index in found]
    return out


class CpuKernel:
    """One kernel of a variant's fake library: checks each argument against the kernel's
    MSL declaration the way torch.mps.compile_shader binds it (a tensor per device
    pointer, of the variant's dtype for Element; a Python float for `constant float&`, an
    int for `constant long&`, a list of ints for `constant long*`), then runs it on the
    CPU build."""

    def __init__(self, library, variant, name, signature, calls):
        self.library, self.name, self.signature, self.calls = library, name, signature, calls
        self.variant = Variant.parse(variant)
        self.key = launch_key(variant, name).encode()

    def __call__(self, *args, threads, group_size):
        self.calls.append((self.name, args, threads, group_size))
        assert len(args) == len(self.signature), f"{self.name}: {len(args)} arguments"
        assert threads % 32 == 0 and 0 < group_size <= 1024 and group_size % 32 == 0
        kept = [self._bind(decl, name, value)
                for (decl, name, _), value in zip(self.signature, args, strict=True)]  # fmt: skip
        argv = (ctypes.c_void_p * len(kept))(*(self._pointer(k) for k in kept))
        error = ctypes.create_string_buffer(4096)
        rc = self.library.lik_cpu_launch(self.key, argv, threads, group_size, error, 4096)
        assert rc == 0, error.value.decode()

    @staticmethod
    def _pointer(kept):
        """The void* the driver reads: a buffer as is, a scalar or an array by address."""
        if isinstance(kept, ctypes.c_void_p):
            return kept
        if isinstance(kept, torch.Tensor):
            return ctypes.c_void_p(kept.data_ptr())
        if isinstance(kept, ctypes.c_long | ctypes.c_float):
            kept = ctypes.pointer(kept)
        return ctypes.cast(kept, ctypes.c_void_p)

    def _bind(self, decl, name, value):
        where = f"{self.name}: {name}"
        if decl == "constant float&":
            assert type(value) is float, f"{where} must be a float, got {value!r}"
            return ctypes.c_float(value)
        if decl == "constant long&":
            assert type(value) is int, f"{where} must be an int, got {value!r}"
            return ctypes.c_long(value)
        if decl == "constant long*":
            assert isinstance(value, list) and all(type(v) is int for v in value), where
            return (ctypes.c_long * len(value))(*value)
        assert isinstance(value, torch.Tensor), f"{where} is not a tensor"
        if name in MASK_SLOTS and not getattr(self.variant.mask, MASK_SLOTS[name]):
            # An absent mask: any valid buffer binds (the runtime passes Q or D). The CPU
            # build reads zeros instead, so a kernel that read it would mask every token.
            return torch.zeros(value.untyped_storage().nbytes(), dtype=torch.uint8)
        element = decl.split()[-1].rstrip("*")
        dtype = torch_dtype(self.variant.dtype) if element == "Element" else MSL_DTYPE[element]
        assert value.dtype == dtype, f"{where} is {value.dtype}, not {element} ({dtype})"
        return ctypes.c_void_p(value.data_ptr())


class CpuLibrary:
    """The fake compile_shader's library of one variant: the source names the variant in
    its preamble's first line."""

    def __init__(self, library, source, calls):
        variant = re.match(r"// variant: (\w+)\n", source).group(1)
        self.variant = variant
        self._kernels = {name: CpuKernel(library, variant, name, signature, calls)
                         for name, signature in kernel_signatures(source).items()}  # fmt: skip

    def __getattr__(self, name):
        return self._kernels[name]


def install_fake_compiler(cpu_library, monkeypatch):
    """lik.runtime.metal with CPU tensors treated as MPS ones and compile_shader replaced by
    the CPU build. Returns the list of launches and the list of compiled variants."""
    calls, compiled = [], []

    def compile_shader(source):
        library = CpuLibrary(cpu_library, source, calls)
        compiled.append(library.variant)
        return library

    monkeypatch.setattr(metal, "compile_shader", compile_shader)
    monkeypatch.setattr(metal, "handles", lambda device: True)
    monkeypatch.setattr(metal, "_compiled", {})
    monkeypatch.setattr(metal, "_failures", {})
    return calls, compiled


@pytest.fixture
def fake_mps(cpu_library, monkeypatch):
    """The fake compiler (install_fake_compiler), backend chosen per call. Yields the list
    of launches and the list of compiled variants."""
    calls, compiled = install_fake_compiler(cpu_library, monkeypatch)
    monkeypatch.delenv(metal.FORCE_ENV, raising=False)
    metal._compiled_reference.cache_clear()
    yield calls, compiled
    metal._compiled_reference.cache_clear()


def kernel_of(name: str) -> str:
    """The structural kernel (generated file) a variant compiles from."""
    return registry.entry(name)["kernel"]


# --- inputs and the float64 ground truth --------------------------------------------------


def make_inputs(layout, dtype, Nq, Nd, Lq, Ld, dim, has_q_mask, has_d_mask, seed=0):
    g = torch.Generator().manual_seed(seed)
    d_rows = {"dense": (Nd, Ld), "kd": (Nq, Nd, Ld), "pairs": (Nq, Ld)}[layout]
    Q = torch.randn(Nq, Lq, dim, generator=g).to(dtype)
    D = torch.randn(*d_rows, dim, generator=g).to(dtype)
    q_mask = torch.rand(Nq, Lq, generator=g) < 0.7 if has_q_mask else None
    d_mask = None
    if has_d_mask:
        d_mask = torch.rand(d_rows, generator=g) < 0.6
        d_mask[0] = False  # a fully masked doc scores 0 and wins nothing
    return Q, D, q_mask, d_mask


def reference(layout, Q, D, q_mask, d_mask, normalize):
    fn = maxsim_pairs_reference if layout == "pairs" else maxsim_reference
    return fn(Q.double(), D.double(), q_mask, d_mask, normalize=normalize)


def reference_argmax(layout, Q, D, q_mask, d_mask, normalize):
    """Each query token's winning doc token in float64; -1 where none wins."""
    Q, D = Q.double(), D.double()
    if normalize:
        Q, D = F.normalize(Q, dim=-1), F.normalize(D, dim=-1)
    equation = {"dense": "isk,jtk->ijst", "kd": "isk,ictk->icst", "pairs": "bsk,btk->bst"}
    sim = torch.einsum(equation[layout], Q, D)
    if d_mask is not None:
        sim = sim.masked_fill(~(d_mask[:, None, :] if layout == "pairs" else
                                d_mask[None, :, None, :] if layout == "dense" else
                                d_mask[:, :, None, :]), float("-inf"))  # fmt: skip
    best = sim.amax(dim=-1, keepdim=True)
    positions = torch.arange(sim.shape[-1])
    # The earliest of equal maxima, as the kernels pick it. Copies of one token tie exactly
    # in the kernels; float64 einsum may round them apart by ~1e-16, hence the slack.
    tied = sim >= best - 1e-10 * best.abs().clamp(min=1)
    index = torch.where(tied, positions, sim.shape[-1]).amin(dim=-1)
    best = best[..., 0]
    index[torch.isneginf(best)] = -1
    if q_mask is not None:
        index[~(q_mask if layout == "pairs" else q_mask[:, None, :]).expand_as(index)] = -1
    return index


def parse(name):
    v = Variant.parse(name)
    return {
        "layout": v.layout.value,
        "has_q_mask": v.mask.has_q,
        "has_d_mask": v.mask.has_d,
        "dtype": torch_dtype(v.dtype),
        "normalize": v.normalize,
        "train": v.backward is not Backward.NONE,
    }


def fp32_bound(dtype):
    # The CPU build computes exactly in fp32, like the interpreter path.
    return 1e-5 if dtype == torch.float32 else TOLERANCE[dtype]


# --- (a) syntax and type check of every generated file ------------------------------------


def test_every_declared_metal_variant_compiles_against_the_declared_surface(builds):
    _, errors = builds["syntax"].communicate()
    assert builds["syntax"].returncode == 0, errors[-4000:]
    assert METAL_NAMES


def test_one_file_per_structural_kernel():
    files = sorted(p.name for p in (GENERATED / "metal").glob("*.metal"))
    kernel_files = [Path(registry.kernels()[k]["file"]).name for k in METAL_KERNELS]
    assert files == sorted([*kernel_files, Path(COMMON_PATH).name])  # and one shared module
    assert len(files) <= 20 < len(METAL_NAMES)
    for name in METAL_NAMES:  # a variant is its kernel's file and its values
        v = Variant.parse(name)
        assert kernel_of(name) == v.kernel.name
        assert registry.entry(name)["values"] == v.values()


def test_variants_of_one_kernel_differ_in_their_preamble_only():
    a, b = "maxsim_dense_qdmask_fp32_metal_norm_lowmem", "maxsim_dense_nomask_bf16_metal_lowmem"
    assert kernel_of(a) == kernel_of(b)
    text = kernel_text(kernel_of(a))
    head_a, head_b = metal.source(a).removesuffix(text), metal.source(b).removesuffix(text)
    assert head_a != head_b and metal.source(a) == head_a + text
    # Both compile the same common module in between, each file after its own #line.
    shared = f'#line 1 "{COMMON_PATH}"\n{COMMON_TEXT}#line 1 "{registry.kernel_file(a)}"\n'
    assert head_a.endswith(shared) and head_b.endswith(shared)
    assert "constant constexpr bool HAS_Q_MASK = true;" in head_a
    assert "constant constexpr bool HAS_Q_MASK = false;" in head_b
    assert "typedef float Element;" in head_a and "typedef ushort Element;" in head_b


def test_a_kernel_file_needs_its_preamble(builds, tmp_path):
    # The values are the preamble's: the file alone names constants nothing defines.
    alone = tmp_path / "alone.cpp"
    alone.write_text('#include "metal_syntax.h"\n' + kernel_text(kernel_of(EXECUTED[0])))
    run = subprocess.run([*builds["cxx"], "-fsyntax-only", str(alone)],
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode != 0 and "NORMALIZE" in run.stderr


def test_compiler_messages_name_the_file_and_line(builds, tmp_path):
    # metal.source puts a #line before the common module and before the kernel's file, so
    # an error points at the generated file's own line, whichever file it is in.
    name = EXECUTED[0]
    text = metal.source(name)
    for path, file_text, old in [(COMMON_PATH, COMMON_TEXT, "return src[i];"),
                                 (registry.kernel_file(name), kernel_text(kernel_of(name)),
                                  "const long unit")]:  # fmt: skip
        line = file_text[: file_text.index(old)].count("\n") + 1
        broken = tmp_path / "broken.cpp"
        broken.write_text(
            '#include "metal_syntax.h"\n' + text.replace(old, "undeclared; " + old, 1)
        )
        run = subprocess.run([*builds["cxx"], "-fsyntax-only", str(broken)],
                             capture_output=True, text=True)  # fmt: skip
        assert run.returncode != 0 and f"{path}:{line}:" in run.stderr, run.stderr[-2000:]


@pytest.mark.parametrize(
    "old, new",
    [("simd_sum(", "simd_prefix_inclusive_sum("),  # a builtin the surface does not declare
     ("    float best = -INFINITY;", "    threadgroup float tile[8];\n    float best = -INFINITY;"),
     ("const long unit", "const long unused = 0;\n    const long unit")],
    ids=["undeclared-builtin", "threadgroup-memory", "unused-variable"],
)  # fmt: skip
def test_syntax_check_rejects_a_broken_kernel(builds, tmp_path, old, new):
    text = metal.source(EXECUTED[0])
    assert old in text
    broken = tmp_path / "broken.cpp"
    broken.write_text('#include "metal_syntax.h"\n' + text.replace(old, new, 1))
    run = subprocess.run([*builds["cxx"], "-fsyntax-only", str(broken)],
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode != 0


# MSL has no double, no threadgroup memory here (see metal_syntax.h), no standard library.
FORBIDDEN = re.compile(r"\b(double|threadgroup|std::|printf|goto)\b")


def _code(text: str) -> str:
    """The MSL code without comments (the header and the launch block are comments)."""
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.DOTALL)


@pytest.mark.parametrize("kernel", METAL_KERNELS)
def test_generated_metal_uses_known_attributes_and_numbered_buffers(kernel):
    text = kernel_text(kernel)
    attributes = set(re.findall(r"\[\[(\w+)", text))
    assert attributes <= ATTRIBUTES, attributes - ATTRIBUTES
    assert not FORBIDDEN.search(_code(text))
    block = metal.launch_block(text)
    for kernel, signature in kernel_signatures(text).items():
        (spec,) = [k for k in block["kernels"].values() if k["name"] == kernel]
        assert [index for *_, index in signature] == list(range(len(signature)))
        assert [arg for _, arg, _ in signature] == [entry[0] for entry in spec["args"]]


def test_the_common_module_holds_the_helpers_once():
    # Helpers and constants live in generated/metal/common.metal only: no kernel file
    # defines them again, and the module itself defines no kernel and no launch block.
    code = _code(COMMON_TEXT)
    assert "kernel void" not in code and "/* launch:" not in COMMON_TEXT
    assert not FORBIDDEN.search(code) and not re.findall(r"\[\[(\w+)", code)
    defined = re.findall(r"^inline \w+ (\w+)\(|^constant constexpr \w+ (\w+) =", code, re.M)
    names = {a or b for a, b in defined}
    assert {"load_element", "load_fragment", "load_row", "SIMD_WIDTH", "NORM_EPS"} <= names
    for kernel in METAL_KERNELS:
        text = _code(kernel_text(kernel))
        assert "#include" not in text, kernel
        for helper in names:
            assert not re.search(rf"^(inline \w+|constant constexpr \w+) {helper}\b", text,
                                 re.M), (kernel, helper)  # fmt: skip


def test_hand_edited_common_module_is_refused(monkeypatch, tmp_path):
    name = METAL_NAMES[0]
    path = registry.kernel_file(name)
    (tmp_path / "metal").mkdir()
    (tmp_path / path).write_text((GENERATED / path).read_text())
    (tmp_path / COMMON_PATH).write_text(COMMON_TEXT.replace("NORM_EPS)", "1e-6f)", 1))
    monkeypatch.setattr(registry.importlib.resources, "files", lambda package: tmp_path)
    with pytest.raises(registry.GeneratedFileError, match=r"common\.metal.*edited by hand"):
        metal.source(name)
    (tmp_path / COMMON_PATH).unlink()
    with pytest.raises(registry.GeneratedFileError, match=r"common\.metal.*missing"):
        metal.source(name)


# --- (b) kernels on the CPU against the float64 reference ---------------------------------


def test_harness_refuses_divergent_simdgroup_functions(cpu_library):
    out = torch.zeros(4)
    argv = (ctypes.c_void_p * 1)(out.data_ptr())
    error = ctypes.create_string_buffer(512)
    assert cpu_library.lik_cpu_launch(b"divergent_sum", argv, 32, 32, error, 512) == 1
    assert b"diverged" in error.value


@pytest.mark.parametrize("name", EXECUTED)
@pytest.mark.parametrize("shape", [(3, 4, 11, 13, 40), (2, 3, 1, 9, 8)], ids=["odd", "Lq1"])
def test_forward_matches_float64_reference(fake_mps, name, shape):
    v = parse(name)
    Q, D, q_mask, d_mask = make_inputs(v["layout"], v["dtype"], *shape,
                                       v["has_q_mask"], v["has_d_mask"])  # fmt: skip
    ref = reference(v["layout"], Q, D, q_mask, d_mask, v["normalize"])
    out = torch.full(ref.shape, float("nan"))
    argmax = torch.full(ref.shape + (Q.shape[1],), -7, dtype=torch.int16) if v["train"] else None
    backward = "lowmem" if v["train"] else "none"
    metal.forward(v["layout"], Q, D, q_mask, d_mask, v["normalize"], out, backward=backward,
                  argmax=argmax)  # fmt: skip
    assert not out.isnan().any(), "unwritten scores"
    assert relative_error(out, ref) < fp32_bound(v["dtype"])
    if argmax is not None:
        expected = reference_argmax(v["layout"], Q, D, q_mask, d_mask, v["normalize"])
        assert torch.equal(argmax.long(), expected)


@pytest.mark.parametrize("name", [n for n in EXECUTED if n.endswith("_lowmem")])
def test_argmax_ties_go_to_the_earliest_doc_token(fake_mps, name):
    v = parse(name)
    layout, ties = v["layout"], [2, 3, 6, 9]
    Q, D, q_mask, d_mask = make_inputs(layout, v["dtype"], 3, 4, 11, 13, 16,
                                       v["has_q_mask"], v["has_d_mask"], seed=3)  # fmt: skip
    # One strong token at 2, copied to 3 (same lane), 6 (another lane) and 9 (next tile).
    D[..., ties, :] = (4 * Q.float().sum(dim=(0, 1)) / Q.shape[1]).to(v["dtype"])
    if d_mask is not None:
        d_mask[..., ties] = True
    out = torch.empty(reference(layout, Q, D, q_mask, d_mask, False).shape)
    argmax = torch.empty(out.shape + (Q.shape[1],), dtype=torch.int16)
    metal.forward(layout, Q, D, q_mask, d_mask, v["normalize"], out, backward="lowmem",
                  argmax=argmax)  # fmt: skip
    expected = reference_argmax(layout, Q, D, q_mask, d_mask, v["normalize"])
    assert (expected == 2).sum() > expected.numel() // 4, "too few ties to test"
    assert torch.equal(argmax.long(), expected)


@pytest.mark.parametrize("name", [n for n in EXECUTED if n.endswith("_lowmem")])
def test_backward_matches_float64_reference(fake_mps, name, monkeypatch):
    v = parse(name)
    layout = v["layout"]
    Q, D, q_mask, d_mask = make_inputs(layout, v["dtype"], 3, 4, 11, 13, 40,
                                       v["has_q_mask"], v["has_d_mask"], seed=1)  # fmt: skip
    out = torch.empty(reference(layout, Q, D, q_mask, d_mask, False).shape)
    argmax = torch.empty(out.shape + (Q.shape[1],), dtype=torch.int16)
    metal.forward(layout, Q, D, q_mask, d_mask, v["normalize"], out, backward="lowmem",
                  argmax=argmax)  # fmt: skip
    grad_out = torch.randn(out.shape)
    with _poisoned_empty(monkeypatch):
        GQ, GD = metal.backward(layout, grad_out, argmax, Q, D, v["has_q_mask"], v["has_d_mask"],
                                v["normalize"], "lowmem")  # fmt: skip
    Q64, D64 = Q.double().requires_grad_(), D.double().requires_grad_()
    fn = maxsim_pairs_reference if layout == "pairs" else maxsim_reference
    fn(Q64, D64, q_mask, d_mask, normalize=v["normalize"]).backward(grad_out.double())
    for got, want, what in ((GQ, Q64.grad, "grad_Q"), (GD, D64.grad, "grad_D")):
        assert got.dtype == v["dtype"] and not got.isnan().any(), f"{what}: unwritten"
        assert relative_error(got, want) < fp32_bound(v["dtype"]), what


@contextlib.contextmanager
def _poisoned_empty(monkeypatch):
    """torch.empty inside metal.backward returns NaN-filled tensors: every gradient
    element must be written by the kernels."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        return real_empty(*args, **kwargs).fill_(float("nan"))

    with monkeypatch.context() as patch:
        patch.setattr(metal.torch, "empty", poisoned)
        yield


# --- (c) the runtime path, through the public API -----------------------------------------


@pytest.mark.parametrize(
    "layout, name",
    [("dense", "maxsim_dense_qdmask_fp32_metal_norm_lowmem"),
     ("kd", "maxsim_kd_dmask_fp16_metal_lowmem"),
     ("pairs", "maxsim_pairs_qdmask_bf16_metal_norm_lowmem")],
)  # fmt: skip
def test_training_through_the_api_runs_the_metal_kernels(fake_mps, monkeypatch, layout, name):
    calls, compiled = fake_mps
    monkeypatch.setenv(metal.FORCE_ENV, "metal")  # pairs of this size would be "tiny"
    v = parse(name)
    Q, D, q_mask, d_mask = make_inputs(layout, v["dtype"], 4, 5, 16, 20, 24,
                                       v["has_q_mask"], v["has_d_mask"], seed=2)  # fmt: skip
    Q.requires_grad_()
    D.requires_grad_()
    call = api.maxsim_pairs if layout == "pairs" else api.maxsim
    scores = call(Q, D, q_mask, d_mask, normalize=v["normalize"], backward="unified")
    grad_out = torch.randn(scores.shape)
    scores.backward(grad_out)
    assert compiled == [name], "Metal has one backward strategy: unified runs it too"
    kernel = kernel_of(name)
    assert [c[0] for c in calls] == [f"{kernel}_forward", f"{kernel}_grad_q", f"{kernel}_grad_d"]
    Q64, D64 = Q.detach().double().requires_grad_(), D.detach().double().requires_grad_()
    fn = maxsim_pairs_reference if layout == "pairs" else maxsim_reference
    ref = fn(Q64, D64, q_mask, d_mask, normalize=v["normalize"])
    ref.backward(grad_out.double())
    assert relative_error(scores.detach(), ref.detach()) < fp32_bound(v["dtype"])
    assert relative_error(Q.grad, Q64.grad) < fp32_bound(v["dtype"])
    assert relative_error(D.grad, D64.grad) < fp32_bound(v["dtype"])


# --- padding and non-finite values (the rule of lik.runtime.reference's docstring) --------

# An executed lowmem variant with a mask per layout (the call's masks, dtype and normalize
# pick it).
PADDED_TRAINING = {
    "dense": "maxsim_dense_qdmask_fp32_metal_norm_lowmem",
    "kd": "maxsim_kd_dmask_fp16_metal_lowmem",
    "pairs": "maxsim_pairs_qdmask_bf16_metal_norm_lowmem",
}


def _filled(X, mask, value):
    """X with its masked tokens set to value."""
    if mask is None:
        return X
    return torch.where(mask[..., None], X, torch.tensor(value, dtype=X.dtype))


@pytest.mark.parametrize("poison", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("layout", list(PADDED_TRAINING))
def test_padding_never_reaches_scores_or_gradients(fake_mps, monkeypatch, layout, poison):
    """Masked tokens holding NaN or inf give the scores and gradients of zeros there,
    exactly, and the gradient at a masked position is exactly 0 (through normalize's
    backward too)."""
    _, compiled = fake_mps
    monkeypatch.setenv(metal.FORCE_ENV, "metal")
    name = PADDED_TRAINING[layout]
    v = parse(name)
    Q, D, q_mask, d_mask = make_inputs(layout, v["dtype"], 3, 4, 11, 13, 16,
                                       v["has_q_mask"], v["has_d_mask"], seed=4)  # fmt: skip
    call = api.maxsim_pairs if layout == "pairs" else api.maxsim

    def run(Q, D):
        Q, D = Q.clone().requires_grad_(), D.clone().requires_grad_()
        out = call(Q, D, q_mask, d_mask, normalize=v["normalize"], backward="lowmem")
        out.backward(torch.linspace(0.5, 1.5, out.numel()).view(out.shape))
        return out.detach(), Q.grad, D.grad

    poisoned = run(_filled(Q, q_mask, poison), _filled(D, d_mask, poison))
    clean = run(_filled(Q, q_mask, 0.0), _filled(D, d_mask, 0.0))
    assert set(compiled) == {name}
    assert poisoned[0].isfinite().all() and torch.equal(poisoned[0], clean[0])
    for got, want, mask in zip(poisoned[1:], clean[1:], (q_mask, d_mask), strict=True):
        assert got.isfinite().all() and torch.equal(got, want)
        assert mask is None or (got[~mask] == 0).all()


def _neg_inf_rows(layout, dtype, masked):
    """Q [2, 3, 8] whose token (0, 0) has -inf similarity to every doc token (their first
    coordinate is positive); with `masked`, doc 1 is fully masked, doc 2 valid past its
    first tile only and doc 3 at its last token only, masked tokens holding NaN."""
    g = torch.Generator().manual_seed(12)
    Q = torch.randn(2, 3, 8, generator=g)
    Q[0, 0] = torch.tensor([float("-inf")] + [0.0] * 7)
    doc_axes = {"dense": (4,), "kd": (2, 4)}[layout]
    D = torch.randn(*doc_axes, 13, 8, generator=g)
    D[..., 0] = D[..., 0].abs() + 0.5
    d_mask = None
    if masked:
        d_mask = torch.ones(*doc_axes, 13, dtype=torch.bool)
        d_mask[..., 1, :] = False
        d_mask[..., 2, :8] = False
        d_mask[..., 3, :-1] = False
        D = _filled(D, d_mask, float("nan"))
    return Q.to(dtype), D.to(dtype), d_mask


@pytest.mark.parametrize(
    "name", ["maxsim_dense_nomask_fp32_metal", "maxsim_kd_dmask_fp16_metal_lowmem"]
)
def test_a_valid_row_of_neg_inf_similarities_is_a_real_neg_inf(fake_mps, monkeypatch, name):
    """A query token whose valid similarities are all -inf adds -inf; one with no valid
    doc token (a fully masked doc) adds 0: the mask decides, never the value."""
    _, compiled = fake_mps
    monkeypatch.setenv(metal.FORCE_ENV, "metal")
    v = parse(name)
    Q, D, d_mask = _neg_inf_rows(v["layout"], v["dtype"], v["has_d_mask"])
    if v["train"]:
        Q.requires_grad_()
    out = api.maxsim(Q, D, None, d_mask, backward="lowmem" if v["train"] else None).detach()
    want = maxsim_reference(Q.detach().double(), D.double(), None, d_mask).float()
    assert compiled == [name]
    assert want.isinf().any() and torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out[want.isinf()], want[want.isinf()])
    finite = want.isfinite()
    assert relative_error(out[finite], want[finite]) < 1e-5
    if v["has_d_mask"]:
        assert (out[..., 1] == 0).all(), "a fully masked doc adds 0"


def test_launch_grid_and_scalar_arguments(fake_mps):
    calls, _ = fake_mps
    Q, D, _, _ = make_inputs("dense", torch.float32, 5, 7, 16, 20, 24, False, False)
    api.maxsim(Q, D)
    ((kernel, args, threads, group_size),) = calls
    assert kernel == "maxsim_dense_metal_forward"
    assert threads == 5 * 7 * 32 and group_size == 128  # one simdgroup per (query, doc) pair
    # No masks: their slots take Q and D (with their strides), which the kernel never reads.
    assert args[0] is Q and args[1] is D and args[2] is Q and args[3] is D
    out = args[4]
    assert out.shape == (5, 7)
    assert args[5:9] == (5, 16, 20, 24)  # Nq, Lq, Ld, dim
    assert args[9:] == Q.stride() + D.stride() + Q.stride()[:2] + D.stride()[:2] + out.stride()


def test_grad_launch_grids(fake_mps):
    calls, _ = fake_mps
    Q, D, _, d_mask = make_inputs("kd", torch.float16, 3, 2, 16, 48, 24, False, True)
    Q.requires_grad_()
    api.maxsim(Q, D, None, d_mask).sum().backward()
    grids = {kernel: (threads, group_size) for kernel, _, threads, group_size in calls}
    name = kernel_of(variant_name("kd", False, True, False, torch.float16, target="metal",
                                  backward="lowmem"))  # fmt: skip
    assert name == "maxsim_kd_metal_lowmem"
    assert grids[f"{name}_forward"] == (3 * 2 * 32, 128)  # one simdgroup per (query, doc)
    assert grids[f"{name}_grad_q"] == (3 * 16 * 32, 128)  # one per query token
    assert grids[f"{name}_grad_d"] == (3 * 2 * 48 * 32, 128)  # one per doc token


def test_variant_compiles_once_per_process_under_a_lock(fake_mps):
    _, compiled = fake_mps
    name = "maxsim_dense_nomask_fp32_metal"
    threads = [threading.Thread(target=metal._compile, args=(name,)) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    metal._compile(name)
    assert compiled == [name]


def test_compile_failure_is_reported_once_then_falls_back(fake_mps, monkeypatch):
    attempts, compiles = [], []

    def failing(source):
        attempts.append(source)
        raise RuntimeError("program_source:12:5: error: use of undeclared identifier")

    def spy_compile(fn, **kwargs):
        compiles.append(kwargs)
        return fn

    monkeypatch.setattr(metal, "compile_shader", failing)
    monkeypatch.setattr(metal.torch, "compile", spy_compile)
    Q, D, _, _ = make_inputs("dense", torch.float32, 4, 5, 16, 20, 24, False, False)
    with pytest.warns(RuntimeWarning, match="did not compile.*undeclared identifier"):
        first = api.maxsim(Q, D)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = api.maxsim(Q, D)
    assert len(attempts) == 1 and compiles == [{"dynamic": True}]
    ref = maxsim_reference(Q.double(), D.double())
    assert relative_error(first, ref) < 1e-5 and torch.equal(first, second)
    monkeypatch.setenv(metal.FORCE_ENV, "metal")
    with pytest.raises(metal.MetalCompileError, match="undeclared identifier"):
        api.maxsim(Q, D)


@pytest.mark.parametrize(
    "dim, Lq, Ld, expected",
    [(24, 16, 20, "metal"), (12, 16, 20, "compile"), (136, 16, 20, "compile"),
     (24, 16, 2**15, "compile"), (24, 2, 3, "reference"), (24, 0, 20, "reference")],
)  # fmt: skip
def test_envelope_picks_the_path(fake_mps, dim, Lq, Ld, expected):
    Q, D = torch.zeros(4, Lq, dim), torch.zeros(5, Ld, dim)
    assert metal.choose_backend("dense", Q, D) == expected


@pytest.mark.parametrize("forced", metal.BACKENDS)
def test_forced_backend(fake_mps, monkeypatch, forced):
    calls, _ = fake_mps
    monkeypatch.setenv(metal.FORCE_ENV, forced)
    monkeypatch.setattr(metal.torch, "compile", lambda fn, **kwargs: fn)
    Q, D, _, _ = make_inputs("pairs", torch.float16, 2, 2, 3, 5, 8, False, False)
    out = api.maxsim_pairs(Q, D)  # tiny: the reference unless forced otherwise
    assert relative_error(out, reference("pairs", Q, D, None, None, False)) < 1e-5
    assert bool(calls) == (forced == "metal")
    assert forced in backends.describe_backend("cpu")


def test_forced_metal_outside_its_envelope_and_bad_values_raise(fake_mps, monkeypatch):
    Q, D = torch.randn(2, 4, 12), torch.randn(3, 5, 12)
    monkeypatch.setenv(metal.FORCE_ENV, "metal")
    with pytest.raises(ValueError, match="head dim 12 is not a multiple of 8"):
        api.maxsim(Q, D)
    monkeypatch.setenv(metal.FORCE_ENV, "fast")
    with pytest.raises(ValueError, match="LIK_FORCE_MPS_BACKEND must be one of"):
        api.maxsim(Q, D)


def test_kernels_refuse_an_int32_argmax(fake_mps):
    Q, D, _, _ = make_inputs("dense", torch.float32, 2, 2, 8, 8, 8, False, False)
    out, argmax = torch.empty(2, 2), torch.empty(2, 2, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="int16 argmax"):
        metal.forward("dense", Q, D, None, None, False, out, backward="lowmem", argmax=argmax)
    assert autograd._argmax_dtype(D) == torch.int16  # what the autograd glue hands Metal


def test_mps_devices_route_to_metal():
    assert metal.handles(torch.device("mps")) and not metal.handles(torch.device("cpu"))
    assert "Metal" in backends.describe_backend("mps")


def test_hand_edited_metal_source_is_refused(monkeypatch, tmp_path):
    name = METAL_NAMES[0]
    path = registry.kernel_file(name)
    (tmp_path / "metal").mkdir()
    text = (GENERATED / path).read_text()
    (tmp_path / path).write_text(text.replace("total", "sum", 1))
    monkeypatch.setattr(registry.importlib.resources, "files", lambda package: tmp_path)
    with pytest.raises(registry.GeneratedFileError, match="edited by hand"):
        metal.source(name)
