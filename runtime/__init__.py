"""lik.runtime: MaxSim scoring through generated kernels, picked per call.

Public entries (the README's "API in brief"): maxsim, maxsim_pairs (padded batches); maxsim_varlen,
score_pairs_packed, pack_padded, maxsim_padded (ragged batches); retrieve,
retrieve_sharded, MaxSimScorer (search); maxsim_weighted, maxsim_smooth,
maxsim_topk_mean (other token scores, lik.runtime.variants). Submodules: plaid
(residual-compressed documents), fp8, head (fused projection head), metal, reference
(the plain-PyTorch ground truth). describe_backend says which path a device takes.
Importing it starts lik.runtime.prewarm: Triton's once-per-process start cost, paid in a
background thread.
"""

from lik.runtime import prewarm
from lik.runtime.api import maxsim, maxsim_pairs
from lik.runtime.backends import describe_backend
from lik.runtime.ragged import (
    PackedBatch,
    maxsim_padded,
    maxsim_varlen,
    pack_padded,
    score_pairs_packed,
)
from lik.runtime.retrieval import retrieve, retrieve_sharded
from lik.runtime.scorer import MaxSimScorer
from lik.runtime.variants import maxsim_smooth, maxsim_topk_mean, maxsim_weighted

__all__ = [
    "MaxSimScorer",
    "PackedBatch",
    "describe_backend",
    "maxsim",
    "maxsim_padded",
    "maxsim_pairs",
    "maxsim_smooth",
    "maxsim_topk_mean",
    "maxsim_varlen",
    "maxsim_weighted",
    "pack_padded",
    "retrieve",
    "retrieve_sharded",
    "score_pairs_packed",
]

prewarm.start()
