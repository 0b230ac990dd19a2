"""The token-score hook's share of a Triton plan: which hook file, which extra kernel
arguments, and the recompute backward's argument lists.

score = max is the built-in reduction (argmax saved, lowmem/unified backwards). Every
other score plugs in through one hook file in templates/triton/score/, all with the same
four functions (see templates/triton/score/README.md), and trains with the recompute
backward: destination-owned like lowmem, it recomputes each similarity tile and asks
the hook for d token_score / d sim, so a new score needs no backward of its own.
"""

from __future__ import annotations

import dataclasses

from lik_gen.ir import Backward, Layout, Score, Variant

SCORE_HOOK = {
    Score.WEIGHTED: "triton/score/weighted.py.j2",
    Score.SMOOTH: "triton/score/smooth.py.j2",
    Score.TOPK_MEAN: "triton/score/topk_mean.py.j2",
}
RECOMPUTE_TEMPLATE = "triton/backward/recompute.py.j2"
RECOMPUTE_LAUNCH_TEMPLATE = "glue/backward_recompute.py.j2"

# What the forward saves for the backward, per score: the winning token (weighted), the
# logsumexp (smooth), the TOKEN_K winning tokens (topk_mean). Index kinds are int16 or
# int32 as the runtime picks (like the argmax); "float" is fp32.
SAVED_KIND = {Score.WEIGHTED: "index", Score.SMOOTH: "float", Score.TOPK_MEAN: "index"}

# Sizes the recompute kernels read: both walk doc tokens, so both take Ld.
RECOMPUTE_SIZES = {
    "bwd_q": {Layout.DENSE: ("Nd", "Lq", "Ld"), Layout.PAIRS: ("Lq", "Ld")},
    "bwd_d": {Layout.DENSE: ("Nq", "Lq", "Ld"), Layout.PAIRS: ("Lq", "Ld")},
}
HOOKED_LAYOUTS = tuple(RECOMPUTE_SIZES["bwd_q"])


@dataclasses.dataclass(frozen=True)
class ScorePlan:
    score: str
    hook: str  # "" for max
    weighted: bool
    save_stat: bool
    stat_per_slot: bool  # saved tensor has a trailing TOKEN_SLOTS axis
    # The hook functions' trailing arguments, as the kernels spell them: init_args for
    # _score_init, call_args (tau first) for the others.
    init_args: str
    call_args: str
    # Launcher keywords and the constexpr options they feed.
    keywords: tuple[str, ...]
    options: tuple[str, ...]


def score_plan(variant: Variant) -> ScorePlan:
    score = variant.score
    hooked = score is not Score.MAX
    tau = "tau" if score is Score.SMOOTH else "1.0"
    token_k = "TOKEN_K, TOKEN_SLOTS" if score is Score.TOPK_MEAN else "1, 1"
    keywords: tuple[str, ...] = ()
    options: tuple[str, ...] = ()
    if score is Score.SMOOTH:
        keywords = ("tau",)
    if score is Score.TOPK_MEAN:
        keywords = ("token_k", "token_slots")
        options = ("TOKEN_K=token_k", "TOKEN_SLOTS=token_slots")
    return ScorePlan(
        score=score.value,
        hook=SCORE_HOOK.get(score, ""),
        weighted=score is Score.WEIGHTED,
        save_stat=hooked and variant.backward is not Backward.NONE,
        stat_per_slot=score is Score.TOPK_MEAN,
        init_args=token_k,
        call_args=f"{tau}, {token_k}",
        keywords=keywords,
        options=options,
    )
