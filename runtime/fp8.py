"""FP8 (e4m3) inference: quantization helpers and MaxSim over fp8 queries and docs.

    Q8, scale_Q = quantize_fp8_per_tensor(Q)      # scale_Q: shape (), fp32
    D8, scale_D = quantize_fp8_per_token(D)       # scale_D: [Nd, Ld], fp32
    scores = maxsim_inference_fp8(Q8, D8, scale_Q=scale_Q, scale_D=scale_D)   # [Nq, Nd]

Conventions: values are stored as torch.float8_e4m3fn; the scale is amax / 448 (448 is
the largest e4m3 value), so X ~= X8.float() * scale. A per-tensor scale is one fp32
scalar tensor; per-token scales have the tensor's shape without the last axis. Scales
are positive (an all-zero tensor or token gets scale 1).

Paths: CUDA GPUs with fp8 tensor-core dots (compute capability >= 8.9) run the generated
fp8 kernel, which takes both scale granularities through strides (a per-tensor scale is
expanded with stride 0: no copy and no host sync); other CUDA GPUs dequantize to bf16 and
run lik's bf16 maxsim; CPU runs the reference (or the generated kernel under the Triton
interpreter when TRITON_INTERPRET=1); other devices run the reference.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from lik.runtime import api, backends, dispatch, ops, validate
from lik.runtime.keys import gpu_family, variant_name
from lik.runtime.reference import maxsim_fp8_reference

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# fp8 tensor-core dots (mma e4m3) exist from Ada (8.9) on; Hopper adds wgmma.
FP8_DOT_MIN_CAPABILITY = (8, 9)
# Triton's 8-bit dots need K >= 32; smaller head dims are zero-padded to it (the kernel
# masks the head-dim tail of every load).
FP8_MIN_BLOCK_K = 32
# Hopper's fp8 tensor-core instruction (wgmma) takes tiles of at least 64 rows; a 32-token
# query tile falls back to a slower path. Padding the tile to 64 masked rows measured
# 0.088 against 0.104 ms on an H200 (Nq 1, Nd 8192, Lq 32, Ld 256).
FP8_MIN_ROWS = {"hopper": 64, "blackwell": 64}
QUANTIZE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
SCALE_DTYPES = QUANTIZE_DTYPES
# The bf16 fallback dequantizes the docs this many elements at a time, so its fp32
# scratch stays bounded (256 MB) whatever the corpus size.
DEQUANTIZE_BLOCK_ELEMENTS = 1 << 26

_Q_DOC = "[Nq, Lq, d] or [Lq, d]"
_D_DOC = "[Nd, Ld, d] or [Ld, d]"


# ---------------------------------------------------------------------------------------
# Quantization


def _check_quantize_input(X: object) -> torch.Tensor:
    if not isinstance(X, torch.Tensor):
        raise TypeError(f"X must be a torch.Tensor, got {type(X).__name__}")
    if X.dtype not in QUANTIZE_DTYPES:
        allowed = ", ".join(str(d) for d in QUANTIZE_DTYPES)
        raise TypeError(f"X must have dtype in ({allowed}) to be quantized, got {X.dtype}")
    return X


def _scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    scale = amax.float() / FP8_MAX
    # A zero amax (all-zero input), or one so small the division underflows, would give
    # scale 0 and 0/0 = NaN values: any positive scale maps zeros to zeros, take 1.
    # NaN stays NaN here (NaN > 0 is False, but NaN inputs quantize to NaN anyway).
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _to_fp8(X: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # The clamp catches quotients a rounding step above 448, which e4m3fn (no infinity)
    # would turn into NaN.
    return (X.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_fp8_per_tensor(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """X (any shape, fp32/fp16/bf16/fp64) -> (X8 float8_e4m3fn, scale fp32 shape ()),
    with scale = amax(|X|) / 448 so that X ~= X8.float() * scale. No host sync."""
    X = _check_quantize_input(X)
    if X.numel() == 0:
        amax = torch.zeros((), dtype=torch.float32, device=X.device)
    else:
        amax = X.abs().amax()
    scale = _scale_from_amax(amax)
    return _to_fp8(X, scale), scale


def quantize_fp8_per_token(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """X [..., d] -> (X8 float8_e4m3fn [..., d], scale fp32 [...]): one scale per token
    (row of the last axis), amax(|row|) / 448. No host sync."""
    X = _check_quantize_input(X)
    if X.dim() == 0:
        raise ValueError("X must have at least one axis (tokens along the last), got a scalar")
    if X.shape[-1] == 0:
        amax = torch.zeros(X.shape[:-1], dtype=torch.float32, device=X.device)
    else:
        amax = X.abs().amax(dim=-1)
    scale = _scale_from_amax(amax)
    return _to_fp8(X, scale.unsqueeze(-1)), scale


def _check_fp8(name: str, X: object, doc: str = "") -> torch.Tensor:
    if not isinstance(X, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor{doc}, got {type(X).__name__}")
    if X.dtype != FP8_DTYPE:
        raise TypeError(
            f"{name} must have dtype {FP8_DTYPE} (quantize with quantize_fp8_per_tensor or "
            f"quantize_fp8_per_token), got {X.dtype}"
        )
    return X


def _check_scale(
    name: str, scale: object, X: torch.Tensor, x_name: str, per_token_shape: tuple[int, ...]
) -> torch.Tensor:
    """A validated scale: per tensor (shape () or (1,)) or per token (per_token_shape),
    on X's device, as fp32 (a no-op for fp32 scales)."""
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of fp32 scales, got {type(scale).__name__}")
    if scale.dtype not in SCALE_DTYPES:
        allowed = ", ".join(str(d) for d in SCALE_DTYPES)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {scale.dtype}")
    shape = tuple(scale.shape)
    if shape not in ((), (1,), per_token_shape):
        raise ValueError(
            f"{name} must be one scale per tensor (shape () or (1,)) or one per token of "
            f"{x_name} (shape {per_token_shape}), got shape {shape}"
        )
    if scale.device != X.device:
        raise ValueError(f"{name} must be on {X.device} like {x_name}, got {scale.device}")
    return scale.float()


def dequantize_fp8_per_tensor(X_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """X_fp8 (float8_e4m3fn) times its per-tensor scale (shape () or (1,)) -> fp32."""
    X_fp8 = _check_fp8("X_fp8", X_fp8)
    scale = _check_scale("scale", scale, X_fp8, "X_fp8", ())
    return X_fp8.float() * scale


def dequantize_fp8_per_token(X_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """X_fp8 [..., d] (float8_e4m3fn) times its per-token scales [...] -> fp32 [..., d]."""
    X_fp8 = _check_fp8("X_fp8", X_fp8)
    if X_fp8.dim() == 0:
        raise ValueError("X_fp8 must have at least one axis (tokens along the last)")
    expected = tuple(X_fp8.shape[:-1])
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"scale must be a tensor of shape {expected}, got {type(scale).__name__}")
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"scale must have shape {expected} (X_fp8.shape[:-1]), got {tuple(scale.shape)}"
        )
    scale = _check_scale("scale", scale, X_fp8, "X_fp8", expected)
    return X_fp8.float() * scale.unsqueeze(-1)


# ---------------------------------------------------------------------------------------
# Scoring


@functools.cache
def _device_has_fp8_dots(index: int) -> bool:
    if torch.version.hip is not None:  # ROCm's fp8 formats are not e4m3fn dots here
        return False
    return torch.cuda.get_device_capability(index) >= FP8_DOT_MIN_CAPABILITY


def fp8_dots_available(device: torch.device | str) -> bool:
    """Whether the generated fp8 kernel runs on this device (cached per device)."""
    device = torch.device(device)
    if device.type != "cuda" or not backends.TRITON_AVAILABLE or not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_has_fp8_dots(index)


def fp8_path(device: torch.device | str) -> str:
    """How maxsim_inference_fp8 scores on this device: 'fp8' (generated kernel, fp8
    dots), 'bf16-fallback' (dequantized bf16 maxsim), 'interpreter' (generated kernel
    under the Triton interpreter) or 'reference'."""
    device = torch.device(device)
    backend = backends.device_backend(device)
    if backend == "triton":
        return "fp8" if fp8_dots_available(device) else "bf16-fallback"
    return backend if backend in backends.FAMILY_BACKENDS["fp8"] else "reference"


def _per_token(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A validated scale as a per-token view of `shape`, without a copy: a per-tensor
    scale expands with stride 0 (one kernel reads both granularities through strides)."""
    if scale.numel() == 1:  # per tensor, or per token of a single token: the same values
        return scale.reshape(()).expand(shape)
    return scale.reshape(shape)


def fp8_tiles(config, device: torch.device):
    """A launch config with the tile minimums of fp8 dots: K >= 32 everywhere, and on
    Hopper-class GPUs a query tile of at least 64 rows (masked padding)."""
    return _fp8_tiles(config, gpu_family(device))


@functools.lru_cache(maxsize=256)
def _fp8_tiles(config, family: str):
    # Cached per (config, family): a few configs recur, and rebuilding one per call was a
    # measurable part of a rerank's host time.
    if config.block_k < FP8_MIN_BLOCK_K:
        config = dataclasses.replace(config, block_k=FP8_MIN_BLOCK_K)
    min_rows = FP8_MIN_ROWS.get(family, 0)
    if config.block_q * config.query_group < min_rows:
        config = dataclasses.replace(config, block_q=min_rows // config.query_group)
    return config


def _kernel(out, Q, D, scale_Q, scale_D, q_mask, d_mask) -> torch.Tensor:
    """Scores into out [Nq, Nd] (fp32) with the generated fp8 kernel: Q [Nq, Lq, d],
    D [Nd, Ld, d] (Lq, Ld > 0), per-token scale views [Nq, Lq] and [Nd, Ld]."""
    name = variant_name("dense", q_mask is not None, d_mask is not None, False, FP8_DTYPE)
    Q, D = dispatch.unit_head_stride(Q), dispatch.unit_head_stride(D)
    shared = {"D": D, "scale_D": scale_D}
    if d_mask is not None:
        shared["d_mask"] = validate.byte_mask(d_mask)
    per_token = {"scale_Q": scale_Q, "q_mask": validate.byte_mask(q_mask)}
    return dispatch.launch_in_query_chunks(
        name, out, Q, per_token, shared, adjust=lambda config: fp8_tiles(config, Q.device)
    )


def _dequantize_bf16(X: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """X [N, L, d] fp8 times per-token scale [N, L] -> bf16, in blocks of rows so the fp32
    product never exists at full size."""
    out = torch.empty(X.shape, dtype=torch.bfloat16, device=X.device)
    rows = max(1, DEQUANTIZE_BLOCK_ELEMENTS // max(1, X.shape[1] * X.shape[2]))
    for start in range(0, X.shape[0], rows):
        stop = min(X.shape[0], start + rows)
        out[start:stop] = X[start:stop].float() * scale[start:stop].unsqueeze(-1)
    return out


@dataclasses.dataclass(frozen=True)
class _Fp8Call:
    path: str  # fp8_path: "fp8", "bf16-fallback" or "interpreter"


def _fp8_forward(inputs, call: _Fp8Call):
    Q, D, scale_Q, scale_D, q_mask, d_mask = inputs
    Nq, Lq, Nd, Ld = Q.shape[0], Q.shape[1], D.shape[0], D.shape[1]
    if Nq * Nd == 0 or Lq == 0 or Ld == 0:
        return (torch.zeros(Nq, Nd, dtype=torch.float32, device=Q.device),), ()
    if call.path == "bf16-fallback":
        scaled = _dequantize_bf16(Q, scale_Q), _dequantize_bf16(D, scale_D)
        return (api.maxsim(*scaled, q_mask, d_mask),), ()
    out = torch.empty(Nq, Nd, dtype=torch.float32, device=Q.device)
    return (_kernel(out, Q, D, scale_Q, scale_D, q_mask, d_mask),), ()


def _fp8_fake(inputs, call: _Fp8Call):
    Q, D = inputs[:2]
    return (Q.new_empty((Q.shape[0], D.shape[0]), dtype=torch.float32),), ()


FP8 = ops.Family("fp8", _Fp8Call, _fp8_forward, _fp8_fake)


def maxsim_inference_fp8(
    Q: torch.Tensor,
    D: torch.Tensor,
    *,
    scale_Q: torch.Tensor,
    scale_D: torch.Tensor,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """MaxSim scores of fp8 (float8_e4m3fn) queries against fp8 docs, fp32 out.

    Q [Nq, Lq, d] (or [Lq, d], squeezing the query axis of the result) against
    D [Nd, Ld, d] -> [Nq, Nd] (or D [Ld, d] -> [Nq]). scale_Q: one positive scale per
    tensor (shape () or (1,)) or per token (Q.shape[:-1]); scale_D likewise for D; the
    scores are those of the dequantized inputs Q.float() * scale_Q, D.float() * scale_D.
    Masks as in maxsim (bool, True = valid): q_mask Q.shape[:-1], d_mask D.shape[:-1].
    No host sync, so scale values are not read: a zero or negative scale scores as given
    (the quantize functions only make positive ones). Inference only (no autograd).
    """
    Q = _check_fp8("Q", Q, f" {_Q_DOC}")
    D = _check_fp8("D", D, f" {_D_DOC}")
    if Q.dim() not in (2, 3):
        raise ValueError(f"Q must be {_Q_DOC}, got {Q.dim()} dims (shape {tuple(Q.shape)})")
    if D.dim() not in (2, 3):
        raise ValueError(
            f"D must be {_D_DOC} (fp8 scores the in-batch layout), got {D.dim()} dims "
            f"(shape {tuple(D.shape)})"
        )
    if Q.device != D.device:
        raise ValueError(f"Q and D must be on one device: Q is on {Q.device}, D on {D.device}")
    validate.head_dims(Q, D)
    scale_Q = _check_scale("scale_Q", scale_Q, Q, "Q", tuple(Q.shape[:-1]))
    scale_D = _check_scale("scale_D", scale_D, D, "D", tuple(D.shape[:-1]))
    q_shape, d_shape = tuple(Q.shape[:-1]), tuple(D.shape[:-1])
    q_mask = validate.mask("q_mask", q_mask, q_shape, Q.device)
    d_mask = validate.mask("d_mask", d_mask, d_shape, D.device)

    squeeze_query, squeeze_doc = Q.dim() == 2, D.dim() == 2
    Q3 = Q.unsqueeze(0) if squeeze_query else Q
    D3 = D.unsqueeze(0) if squeeze_doc else D
    sq, sd = _per_token(scale_Q, Q3.shape[:-1]), _per_token(scale_D, D3.shape[:-1])
    if q_mask is not None and squeeze_query:
        q_mask = q_mask.unsqueeze(0)
    if d_mask is not None and squeeze_doc:
        d_mask = d_mask.unsqueeze(0)

    path = fp8_path(Q.device)
    if path == "reference":
        out = maxsim_fp8_reference(Q3, D3, scale_Q=sq, scale_D=sd, q_mask=q_mask, d_mask=d_mask)
    else:
        out = FP8((Q3, D3, sq, sd, q_mask, d_mask), _Fp8Call(path))
    if squeeze_doc:
        out = out[:, 0]
    return out[0] if squeeze_query else out
