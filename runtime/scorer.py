"""MaxSimScorer: lik's MaxSim as an nn.Module, for models and training loops."""

from __future__ import annotations

import torch
from torch import nn

from lik.runtime import validate
from lik.runtime.api import maxsim
from lik.runtime.retrieval import retrieve


def _ids_to_mask(name: str, ids: object, embeddings: torch.Tensor, pad_token: int):
    """ids [..., L] (the token ids behind embeddings [..., L, d]) -> bool mask, True = valid."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a tensor of token ids, got {type(ids).__name__}")
    # A non-tensor embeddings argument is left for maxsim to report.
    if isinstance(embeddings, torch.Tensor) and ids.shape != embeddings.shape[:-1]:
        raise ValueError(
            f"{name} must have shape {tuple(embeddings.shape[:-1])} (the embeddings' shape "
            f"without d), got {tuple(ids.shape)}"
        )
    return ids != pad_token


class MaxSimScorer(nn.Module):
    """Late-interaction scoring with fixed options; no parameters.

    forward(Q, D, q_mask=None, d_mask=None) is lik.runtime.maxsim under the caller's grad
    mode; score(...) is the same without grad; retrieve(Q, D, top_k, ...) is
    lik.runtime.retrieve; forward_with_ids(Q, D, q_ids, d_ids) derives the masks from
    token ids (ids != mask_pad_token).
    """

    def __init__(
        self, *, normalize: bool = True, backward: str | None = "auto", mask_pad_token=None
    ):
        super().__init__()
        validate.backward_choice(backward)
        if mask_pad_token is not None and (
            isinstance(mask_pad_token, bool) or not isinstance(mask_pad_token, int)
        ):
            raise TypeError(
                f"mask_pad_token must be None or an int token id, got {mask_pad_token!r}"
            )
        self.normalize = validate.flag("normalize", normalize)
        self.backward = backward
        self.mask_pad_token = mask_pad_token

    def forward(
        self,
        Q: torch.Tensor,
        D: torch.Tensor,
        q_mask: torch.Tensor | None = None,
        d_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return maxsim(Q, D, q_mask, d_mask, normalize=self.normalize, backward=self.backward)

    @torch.no_grad()
    def score(
        self,
        Q: torch.Tensor,
        D: torch.Tensor,
        q_mask: torch.Tensor | None = None,
        d_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.forward(Q, D, q_mask, d_mask)

    def retrieve(
        self,
        Q: torch.Tensor,
        D: torch.Tensor,
        top_k: int,
        q_mask: torch.Tensor | None = None,
        d_mask: torch.Tensor | None = None,
        *,
        chunk: int | None = None,
        largest: bool = True,
        sorted: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return retrieve(
            Q, D, top_k, q_mask, d_mask,
            normalize=self.normalize, chunk=chunk, largest=largest, sorted=sorted,
        )  # fmt: skip

    def forward_with_ids(
        self, Q: torch.Tensor, D: torch.Tensor, q_ids: torch.Tensor, d_ids: torch.Tensor
    ) -> torch.Tensor:
        """forward with q_mask = q_ids != mask_pad_token and d_mask = d_ids != mask_pad_token."""
        if self.mask_pad_token is None:
            raise ValueError(
                "forward_with_ids needs the padding token id: build the scorer with "
                "MaxSimScorer(mask_pad_token=<pad id>), or call forward with masks"
            )
        q_mask = _ids_to_mask("q_ids", q_ids, Q, self.mask_pad_token)
        d_mask = _ids_to_mask("d_ids", d_ids, D, self.mask_pad_token)
        return self.forward(Q, D, q_mask, d_mask)

    def extra_repr(self) -> str:
        return (
            f"normalize={self.normalize}, backward={self.backward!r}, "
            f"mask_pad_token={self.mask_pad_token!r}"
        )
