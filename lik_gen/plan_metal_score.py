"""The token-score hook's share of a Metal plan: which hook file, how its parameters and
saved statistic are spelled, and the extra arguments Metal needs.

score = max is the built-in reduction (argmax saved, lowmem backward). Every other score
plugs in through one hook file in templates/metal/score/, all with the same functions
(see templates/metal/score/README.md), and trains with the recompute backward
(templates/metal/backward/recompute.metal.j2): destination-owned like lowmem, it
recomputes the similarities it needs and asks the hook for d token_score / d sim.

k is not a value of the variant (no axis declares it): top-k kernels take it as a
trailing runtime argument, token_k, and keep lik_gen.ir.MAX_TOKEN_K slots per lane.
"""

from __future__ import annotations

import dataclasses

from lik_gen.ir import MAX_TOKEN_K, Backward, Kernel, Score
from lik_gen.plan_base import KernelArg

SCORE_HOOK = {
    Score.WEIGHTED: "metal/score/weighted.metal.j2",
    Score.SMOOTH: "metal/score/smooth.metal.j2",
    Score.TOPK_MEAN: "metal/score/topk_mean.metal.j2",
}
RECOMPUTE_TEMPLATE = "metal/backward/recompute.metal.j2"
# What the forward saves per query token for the backward (one lookup per spelling): the
# winning doc token (weighted), the logsumexp (smooth), the k kept doc tokens (topk_mean).
# Token indices are int16 like the Metal argmax (docs shorter than 2**15 tokens).
SAVED_TYPE = {Score.WEIGHTED: "short", Score.SMOOTH: "float", Score.TOPK_MEAN: "short"}
SAVED_DOC = {Score.WEIGHTED: "int16", Score.SMOOTH: "fp32", Score.TOPK_MEAN: "int16, k per token"}
# The hook's parameters, built once per kernel from its arguments.
PARAMS = {
    Score.WEIGHTED: "ScoreParams{1.0f, 1}",
    Score.SMOOTH: "ScoreParams{tau, 1}",
    Score.TOPK_MEAN: "ScoreParams{1.0f, int(token_k)}",
}
# Scalar parameters of the kernels and their MSL declarations: torch.mps.compile_shader
# binds a Python float as a 32-bit float and a Python int as a 64-bit integer.
PARAM_DECL = {"tau": "constant float&", "token_k": "constant long&"}
# Metal-only trailing arguments, per score.
EXTRA_ARGS = {Score.TOPK_MEAN: (KernelArg("token_k", "token_k"),)}


@dataclasses.dataclass(frozen=True)
class MetalScorePlan:
    score: str
    hook: str  # "" for max
    weighted: bool
    save_stat: bool  # the forward writes Saved
    saved_type: str  # MSL element type of Saved ("" for max)
    saved_doc: str
    saved_stride_k: str  # the per-slot stride of Saved, "0" where it has no slot axis
    params: str  # MSL expression of the hook's ScoreParams
    max_token_k: int


def score_plan(kernel: Kernel) -> MetalScorePlan:
    score = kernel.score
    hooked = score is not Score.MAX
    return MetalScorePlan(
        score=score.value,
        hook=SCORE_HOOK.get(score, ""),
        weighted=score is Score.WEIGHTED,
        save_stat=hooked and kernel.backward is not Backward.NONE,
        saved_type=SAVED_TYPE.get(score, ""),
        saved_doc=SAVED_DOC.get(score, ""),
        saved_stride_k="stride_svk" if score is Score.TOPK_MEAN else "0",
        params=PARAMS.get(score, ""),
        max_token_k=MAX_TOKEN_K,
    )


def score_decl(kernel: Kernel, name: str, role: str) -> str | None:
    """The MSL type of a hooked score's tensor argument, None for the others. Weights
    travel as fp32 whatever their dtype (the runtime converts them; grad_W likewise)."""
    if kernel.score is Score.MAX:
        return None
    if name == "Saved":
        const = "" if role == "forward" else "const "
        return f"device {const}{SAVED_TYPE[kernel.score]}*"
    return {"W": "device const float*", "GW": "device float*"}.get(name)
