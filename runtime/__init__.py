"""lik.runtime: MaxSim scoring through generated kernels, picked per call.

Public entries (API.md): maxsim, maxsim_pairs; describe_backend says which path a
device takes. lik.runtime.reference holds the plain-PyTorch ground truth.
"""

from lik.runtime.api import maxsim, maxsim_pairs
from lik.runtime.dispatch import describe_backend

__all__ = ["maxsim", "maxsim_pairs", "describe_backend"]
