"""One warning per process when tokens scored with normalize=False look unnormalized.

ColBERT-style scores are sums of cosine similarities: models emit unit-norm tokens, and
a caller who forgets to normalize them (and passes normalize=False, the default of
maxsim) gets scores that rank by token length without an error. The first such call in
a process samples the first SAMPLED_TOKENS tokens of its first query and first doc; if
one of them has a norm off 1 by more than TOLERANCE (masked and zero tokens, padding,
are skipped), a UserWarning says so, once. LIK_SUPPRESS_NORM_WARN=1 turns the check off.

No host sync on CUDA: the sample's worst norm is copied to pinned host memory behind an
event, and a later call reads it once the event has passed (event.query() does not
wait); on MPS the first call reads it (one sync). A process whose only call is its
first is not warned. Calls traced by torch.compile or captured into a CUDA graph are not
sampled, nor calls made inside `quiet()` (the integrations: their callers cannot pass
normalize, and the decision stays open for the process's own lik calls).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import warnings
from collections.abc import Iterator

import torch

ENV = "LIK_SUPPRESS_NORM_WARN"
SAMPLED_TOKENS = 64
TOLERANCE = 1e-2  # bf16 rounding moves a unit token's norm by ~1e-3


class _Check:
    """The sample's worst norm, on its way to the host."""

    def __init__(self, worst: torch.Tensor):
        if worst.device.type == "cuda":
            self.host = torch.empty((), dtype=torch.float32, pin_memory=True)
            self.host.copy_(worst, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.host, self.ready = worst.to("cpu"), None

    def result(self) -> float | None:
        """The worst norm once it reached the host, else None (without waiting)."""
        if self.ready is not None and not self.ready.query():
            return None
        return float(self.host)


_lock = threading.Lock()
_done = False  # warned, found normalized, or suppressed: no more sampling
_pending: _Check | None = None
_quiet = contextvars.ContextVar("lik_norm_warning_quiet", default=False)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Calls inside the block are neither sampled nor warned (this thread or task only)."""
    token = _quiet.set(True)
    try:
        yield
    finally:
        _quiet.reset(token)


def check(Q: torch.Tensor, D: torch.Tensor, q_mask=None, d_mask=None) -> None:
    """Samples the first call's tokens, and warns on a later call (or this one, on a CPU)
    if they looked unnormalized. Costs one module-level test once decided."""
    global _done, _pending
    if _done or Q.numel() == 0 or D.numel() == 0:
        return
    if os.environ.get(ENV, "") not in ("", "0"):
        _done = True
        return
    if torch.compiler.is_compiling() or (Q.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    if _quiet.get():
        return
    with _lock:
        if _done:
            return
        if _pending is None:
            _pending = _Check(_worst_norm(Q, D, q_mask, d_mask))
        worst = _pending.result()
        if worst is None:
            return
        _done = True
    if abs(worst - 1.0) > TOLERANCE:
        warnings.warn(
            f"lik: tokens scored with normalize=False look unnormalized (a sampled token has "
            f"norm {worst:.4g}); MaxSim over raw dot products favours long tokens. Pass "
            f"normalize=True to normalize inside the kernel, or set {ENV}=1 if raw dot "
            "products are meant.",
            UserWarning,
            stacklevel=3,
        )


def _worst_norm(Q, D, q_mask=None, d_mask=None) -> torch.Tensor:
    """The norm furthest from 1 among the first SAMPLED_TOKENS tokens of the first query
    and of the first doc (views: nothing else is read), masked and zero tokens (padding)
    counted as 1."""
    sampled = torch.cat([_first_norms(Q, q_mask), _first_norms(D, d_mask)])
    furthest = (sampled - 1).abs().argmax().unsqueeze(0)  # a gather: indexing would sync
    return sampled.gather(0, furthest).squeeze(0)


def _first_norms(t: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    first = (0,) * (t.dim() - 2)  # the first query or doc; its mask's row likewise
    norms = t.detach()[first][:SAMPLED_TOKENS].float().norm(dim=-1)
    keep = norms > 0
    if mask is not None:
        keep &= mask[first][:SAMPLED_TOKENS].bool()
    return torch.where(keep, norms, torch.ones_like(norms))


def _reset() -> None:
    """Forgets the decision (for tests)."""
    global _done, _pending
    with _lock:
        _done, _pending = False, None
