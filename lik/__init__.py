"""lik: generated kernels for late-interaction (MaxSim) scoring.

The public API lives in ``lik.runtime``; the names most callers need are re-exported here.
Kernels are loaded on first use; where a GPU launch can follow, importing ``lik`` imports
Triton in a background thread (``lik.runtime.prewarm``, off with LIK_PREWARM=0).
"""

from importlib.metadata import PackageNotFoundError, version

from lik.runtime import (
    MaxSimScorer,
    PackedBatch,
    describe_backend,
    maxsim,
    maxsim_padded,
    maxsim_pairs,
    maxsim_varlen,
    pack_padded,
    retrieve,
    retrieve_sharded,
    score_pairs_packed,
)

try:
    __version__ = version("lik")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "MaxSimScorer",
    "PackedBatch",
    "__version__",
    "describe_backend",
    "maxsim",
    "maxsim_padded",
    "maxsim_pairs",
    "maxsim_varlen",
    "pack_padded",
    "retrieve",
    "retrieve_sharded",
    "score_pairs_packed",
]
