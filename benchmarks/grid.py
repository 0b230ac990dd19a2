"""The shape-class grid's inputs and baselines, shared by `bench_forward.py --grid` and
`bench_train.py --grid` (their cells: shapes.GRID_FORWARD and shapes.GRID_TRAIN).

Masks are built the way clients build them (shapes.Cell names the kinds): lengths drawn
at random and the batch padded to its longest; PyLate's skiplist masks a doc token
wherever its token id is one of the skiplist's (its `skiplist_mask` on random token
ids), and ST's MultiVectorMask adds query padding to the same doc mask. Ragged docs are
padded with their d_mask, or packed for the entries that take packed docs. Every doc
keeps at least its first token (PyLate's [D] marker, never punctuation), so no score
depends on what an implementation makes of a doc with no valid token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from common import normalized_tokens, pick
from shapes import Cell, Shape

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Random lengths run from this share of the padded length up to it (one sequence is as
# long as the padding, as a collator pads to the batch's longest): a padded batch's,
# and a ragged batch's docs.
SHORTEST = {"padded": 1 / 2, "ragged": 1 / 8}
# PyLate's default skiplist is string.punctuation, as the tokenizer's ids: 32 ids, which
# these stand for, drawn for one doc token in ten (an assumed share of punctuation).
SKIPLIST_IDS = tuple(range(1000, 1032))
VOCAB_SIZE = 30522
PUNCTUATION_SHARE = 0.1
# Memory-bound cells with at least this many bytes of docs are held to this share of the
# read-once ceiling (PERF.md).
CEILING_DOC_BYTES = 64e6
CEILING_TARGET_PCT = 90.0

# Why a peer cannot take a cell, by the code its table cell shows.
NOT_APPLICABLE = {
    "no holes": "flash-maxsim 0.3.0 takes query and doc lengths, not masks: no mask with holes",
    "one query packed": "flash-maxsim 0.3.0 scores packed docs against one query "
                        "(flash_maxsim_packed; flash_maxsim_varlen scores pairs)",
    "no packed autograd": "flash-maxsim 0.3.0 has no autograd entry for packed docs",
    "one varlen backward": "late-interaction-kernels 0.4.5's maxsim_varlen has one "
                           "backward, timed as LIK-unified",
}  # fmt: skip


@dataclass
class Packed:
    """Ragged tokens packed: [sum L, d] with int32 offsets and the longest length."""

    q: torch.Tensor
    docs: torch.Tensor
    cu_q: torch.Tensor
    cu_d: torch.Tensor
    max_q: int
    max_d: int

    @property
    def varlen_args(self) -> tuple:
        """maxsim_varlen's positional arguments (lik's and late-interaction-kernels')."""
        return self.q, self.docs, self.cu_q, self.cu_d, self.max_q, self.max_d


@dataclass
class Inputs:
    """One input set of a cell. docs: [Nd, Ld, d], [Nq, K, Ld, d] (kd) or [B, Ld, d]
    (pairs); each mask has its tokens' shape without d. The lengths are the masks as
    prefix lengths where the masks are prefixes, int32, the docs' flat (kd: query-major,
    as flash-maxsim takes them); packed: the same tokens packed (ragged "packed" cells)."""

    q: torch.Tensor
    docs: torch.Tensor
    q_mask: torch.Tensor | None = None
    d_mask: torch.Tensor | None = None
    q_lengths: torch.Tensor | None = None
    d_lengths: torch.Tensor | None = None
    packed: Packed | None = None


def _lengths(shape: tuple[int, ...], full: int, share: float, generator) -> torch.Tensor:
    lengths = torch.randint(max(1, int(full * share)), full + 1, shape, generator=generator)
    lengths.view(-1)[0] = full
    return lengths


def _prefix(lengths: torch.Tensor, full: int) -> torch.Tensor:
    return torch.arange(full) < lengths.unsqueeze(-1)


def skiplist_mask(input_ids: torch.Tensor) -> torch.Tensor:
    """PyLate's ColBERT.skiplist_mask: False where a token's id is in the skiplist."""
    return ~torch.isin(input_ids, torch.tensor(SKIPLIST_IDS))


def doc_token_ids(shape: tuple[int, ...], generator) -> torch.Tensor:
    """Random token ids, one in ten from the skiplist; the first of each doc is its
    marker (an id outside the skiplist)."""
    words = torch.randint(max(SKIPLIST_IDS) + 1, VOCAB_SIZE, shape, generator=generator)
    picks = torch.randint(len(SKIPLIST_IDS), shape, generator=generator)
    punctuation = torch.rand(shape, generator=generator) < PUNCTUATION_SHARE
    ids = torch.where(punctuation, torch.tensor(SKIPLIST_IDS)[picks], words)
    ids[..., 0] = 1  # the doc marker PyLate prepends: any id outside the skiplist
    return ids


def doc_leading_shape(cell: Cell) -> tuple[int, ...]:
    s = cell.shape
    return {"dense": (s.nd,), "kd": (s.nq, s.nd), "pairs": (s.nq,)}[cell.layout]


def masks(cell: Cell, seed: int) -> dict:
    """The cell's masks and, where they are prefixes, their lengths (on the CPU)."""
    s, generator = cell.shape, torch.Generator().manual_seed(seed)
    found = {"q_mask": None, "d_mask": None, "q_lengths": None, "d_lengths": None}
    if cell.mask in ("prefix", "multivector"):
        found["q_lengths"] = _lengths((s.nq,), s.lq, SHORTEST["padded"], generator)
        found["q_mask"] = _prefix(found["q_lengths"], s.lq)
    if cell.mask == "none" and not cell.ragged:
        return found
    share = SHORTEST["ragged" if cell.ragged else "padded"]
    lengths = _lengths(doc_leading_shape(cell), s.ld, share, generator)
    found["d_mask"] = _prefix(lengths, s.ld)
    if cell.holes:
        ids = doc_token_ids((*doc_leading_shape(cell), s.ld), generator)
        found["d_mask"] &= skiplist_mask(ids)
    else:
        found["d_lengths"] = lengths
    return found


def pack(q: torch.Tensor, docs: torch.Tensor, q_mask, d_mask) -> Packed:
    """The valid tokens of padded queries and docs, packed (dense layout)."""
    q_valid = torch.ones(q.shape[:-1], dtype=torch.bool) if q_mask is None else q_mask.cpu()
    d_valid = d_mask.cpu()

    def packed(tokens, valid):
        lengths = valid.sum(-1)
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
        offsets[1:] = lengths.cumsum(0)
        flat = tokens[valid.to(tokens.device)].contiguous()
        return flat, offsets.to(tokens.device), int(lengths.max())

    (q_flat, cu_q, max_q), (d_flat, cu_d, max_d) = packed(q, q_valid), packed(docs, d_valid)
    return Packed(q_flat, d_flat, cu_q, cu_d, max_q, max_d)


def input_sets(cell: Cell, device, count: int, *, seed: int = 0) -> list[Inputs]:
    """`count` sets of unit-norm tokens in the cell's dtype, sharing one set of masks."""
    s, dtype = cell.shape, DTYPES[cell.dtype]
    found = masks(cell, seed)
    on_device = {key: None if value is None else value.to(device) for key, value in found.items()}
    for key in ("q_lengths", "d_lengths"):
        if on_device[key] is not None:
            on_device[key] = on_device[key].reshape(-1).to(torch.int32)
    sets = []
    for index in range(count):
        base = seed + 2 * index
        q = normalized_tokens(s.nq, s.lq, s.d, device=device, seed=base, dtype=dtype)
        docs = normalized_tokens(cell.doc_rows, s.ld, s.d, device=device, seed=base + 1,
                                 dtype=dtype).view(*doc_leading_shape(cell), s.ld, s.d)  # fmt: skip
        inputs = Inputs(q, docs, **on_device)
        if cell.ragged == "packed":
            inputs.packed = pack(q, docs, on_device["q_mask"], on_device["d_mask"])
        sets.append(inputs)
    return sets


def given_docs(inputs: Inputs) -> torch.Tensor:
    """The doc tokens a cell hands in: packed ones where the cell hands them packed."""
    return inputs.packed.docs if inputs.packed is not None else inputs.docs


def read_once_docs(inputs: Inputs) -> torch.Tensor:
    """The doc tokens a call must read: with a doc mask, each doc's up to its last valid
    token (a kernel can skip a padded end, not the holes between valid tokens)."""
    if inputs.packed is not None or inputs.d_mask is None:
        return given_docs(inputs)
    positions = torch.arange(1, inputs.d_mask.shape[-1] + 1, device=inputs.d_mask.device)
    extent = (inputs.d_mask * positions).amax(-1, keepdim=True)
    return inputs.docs[positions <= extent]


def ceiling_applies(cell: Cell, inputs: Inputs, floor: dict) -> bool:
    """Whether the read-once ceiling bounds the cell: memory-bound, 64 MB of docs or more
    handed in."""
    docs = given_docs(inputs)
    return floor["bound"] == "memory" and docs.numel() * docs.element_size() >= CEILING_DOC_BYTES


def pick_cells(cells: list[Cell], names: str | None, axes: str | None) -> list[Cell]:
    """The cells named (comma-separated; all when none) on the axes named (all when none)."""
    by_name = {cell.name: cell for cell in cells}
    chosen = [by_name[name] for name in pick(names, list(by_name), "cell")]
    all_axes = list(dict.fromkeys(axis for cell in cells for axis in cell.axes))
    wanted = set(pick(axes, all_axes, "axis"))
    return [cell for cell in chosen if wanted.intersection(cell.axes)]


def tiny(cell: Cell) -> Cell:
    """A CPU-sized stand-in with the cell's name, head dim, dtype, masks and layout."""
    s = cell.shape
    nd = 1 if cell.layout == "pairs" else min(s.nd, 3 if cell.layout == "kd" else 6)
    small = Shape(s.name, min(s.nq, 6 if cell.layout == "pairs" else 2), nd, min(s.lq, 8),
                  min(s.ld, 16), s.d)  # fmt: skip
    return replace(cell, shape=small)


# ---------------------------------------------------------------------------------------
# Eager PyTorch and the float64 reference


def eager_scores(q, docs, q_mask=None, d_mask=None) -> torch.Tensor:
    """PyTorch's composition, in the inputs' dtype: einsum, the max over valid doc tokens,
    the sum over valid query tokens (accumulated and returned in fp32). docs [Nd, Ld, d]
    scores every query against every doc; [Nq, K, Ld, d] each query against its own."""
    kd = docs.dim() == 4
    similarities = torch.einsum("qsd,qntd->qnst" if kd else "qsd,ntd->qnst", q, docs)
    if d_mask is not None:
        valid = d_mask[:, :, None, :] if kd else d_mask[None, :, None, :]
        similarities = similarities.masked_fill(~valid, float("-inf"))
    best = similarities.amax(dim=-1)
    if d_mask is not None:  # a doc with no valid token adds 0
        best = best.masked_fill(best == float("-inf"), 0)
    if q_mask is not None:
        best = best * q_mask[:, None, :]
    return best.sum(dim=-1, dtype=torch.float32)


def as_kd(cell: Cell, q, docs, q_mask, d_mask):
    """(q, docs, q_mask, d_mask) for maxsim's dense or kd layouts: pairs become kd with one
    doc per query."""
    if cell.layout != "pairs":
        return q, docs, q_mask, d_mask
    return q, docs.unsqueeze(1), q_mask, None if d_mask is None else d_mask.unsqueeze(1)


def padded_call(cell: Cell, score: Callable) -> Callable[[Inputs], torch.Tensor]:
    """score(q, docs, q_mask, d_mask) (eager_scores, or it compiled) on a cell's padded
    inputs, [Nq, Nd] out (pairs: [B, 1])."""
    return lambda x: score(*as_kd(cell, x.q, x.docs, x.q_mask, x.d_mask))


def _reference(q, docs, q_mask, d_mask) -> torch.Tensor:
    try:
        from lik.runtime.reference import maxsim_reference
    except ImportError:  # a dry run may precede lik's runtime
        return eager_scores(q, docs, q_mask, d_mask).double()
    return maxsim_reference(q, docs, q_mask, d_mask).double()


REFERENCE_NAME = "lik.runtime.reference (float64)"


def parity_indices(cell: Cell, device, each_end: int = 32, queries: int = 2):
    """The queries and docs (for kd and pairs, each query's docs) whose scores parity
    compares: the first queries (the first and last pairs), the first and last docs."""
    s = cell.shape

    def ends(count, n):
        if count <= 2 * n:
            return torch.arange(count, device=device)
        head = torch.arange(n, device=device)
        return torch.cat([head, head + count - n])

    if cell.layout == "pairs":
        return ends(s.nq, each_end), torch.zeros(1, dtype=torch.long, device=device)
    return torch.arange(min(queries, s.nq), device=device), ends(s.nd, each_end)


def reference_scores(cell: Cell, x: Inputs, indices) -> torch.Tensor:
    """float64 scores of the parity slice (sliced first: the docs can be GBs)."""
    q_idx, d_idx = indices
    q, docs, q_mask, d_mask = as_kd(cell, x.q, x.docs, x.q_mask, x.d_mask)

    def of_queries(t):
        return None if t is None else t[q_idx]

    def of_docs(t):
        if t is None:
            return None
        return t[q_idx][:, d_idx] if docs.dim() == 4 else t[d_idx]

    return _reference(of_queries(q).double(), of_docs(docs).double(), of_queries(q_mask),
                      of_docs(d_mask))  # fmt: skip


def parity_slice(cell: Cell, out: torch.Tensor, indices) -> torch.Tensor:
    q_idx, d_idx = indices
    return out.reshape(cell.shape.nq, cell.shape.nd).index_select(0, q_idx).index_select(1, d_idx)


def reference_gradients(cell: Cell, x: Inputs, weights: torch.Tensor):
    """float64 gradients of sum(weights * scores) to the padded Q and docs, and where the
    cell is packed, to the packed ones too: {"padded": (dQ, dD), "packed": (dQ, dD)}."""
    q64 = x.q.detach().double().requires_grad_()
    d64 = x.docs.detach().double().requires_grad_()
    scores = _reference(*as_kd(cell, q64, d64, x.q_mask, x.d_mask))
    (scores.reshape(weights.shape) * weights.double()).sum().backward()
    found = {"padded": (q64.grad, d64.grad)}
    if x.packed is not None:
        q_valid = torch.ones(x.q.shape[:-1], dtype=torch.bool, device=x.q.device)
        q_valid = q_valid if x.q_mask is None else x.q_mask
        found["packed"] = (q64.grad[q_valid], d64.grad[x.d_mask])
    return found


# ---------------------------------------------------------------------------------------
# Reporting


def best_peer(results: dict, peers, field: str) -> tuple[str | None, float | None]:
    """The peer with the lowest `field` among those timed on the cell (one that failed
    parity too: flagged, it still counts, so a wrong answer never flatters lik)."""
    timed = {p: results[p][field] for p in peers if results.get(p, {}).get(field)}
    if not timed:
        return None, None
    peer = min(timed, key=timed.get)
    return peer, timed[peer]


def ratio_line(report: dict, ratio: Callable[[dict], float | None]) -> str:
    """In how many of the cells a peer took lik is at least as fast as the best peer
    (ratio(record): the best peer's time over lik's), and where it is behind."""
    compared = {r["name"]: ratio(r) for r in report["cells"] if ratio(r) is not None}
    behind = [f"{name} ({value:.2f}x)" for name, value in compared.items() if value < 1]
    return (f"- lik at least as fast as the best peer: {len(compared) - len(behind)} of "
            f"{len(compared)} cells that a peer took"
            + (f"; behind in {', '.join(behind)}." if behind else "."))  # fmt: skip


def ratio_plot(report: dict, ratio: Callable[[dict], float | None], title: str):
    """The grid's plot (common.write_speedup_plot's categories, series, title): lik against
    the best peer in each cell a peer took."""
    compared = [r for r in report["cells"] if ratio(r) is not None]
    return [r["name"] for r in compared], {"vs the best peer": [ratio(r) for r in compared]}, title


def parity_line(report: dict, labels: dict[str, str], named: int = 6) -> str:
    """Each implementation that failed parity somewhere: its cells (up to `named` of them
    by name)."""
    failed: dict[str, list[str]] = {}
    for record in report["cells"]:
        for key, result in record["results"].items():
            if result.get("parity_ok") is False:
                failed.setdefault(labels[key], []).append(record["name"])
    if not failed:
        return "- parity failures: none."
    parts = []
    for label, names in failed.items():
        listed = f" ({', '.join(names)})" if len(names) <= named else ""
        parts.append(f"{label} in {len(names)} cells{listed}")
    return "- parity failures (FAIL in the table): " + "; ".join(parts) + "."


def result_cell(result: dict, field: str, format_value: Callable) -> str:
    """An implementation's table cell: its time, "n/a (why)", or that it failed."""
    if result.get("not_applicable"):
        return f"n/a ({result['not_applicable']})"
    if result.get(field) is None:
        return "error" if result.get("error") and result["error"] != "skipped in dry run" else "—"
    return format_value(result[field]) + ("" if result.get("parity_ok") else " FAIL")


def not_applicable_lines(report: dict) -> list[str]:
    """One line per reason a peer could not take a cell in this run."""
    used = {r["not_applicable"] for cell in report["cells"] for r in cell["results"].values()
            if r.get("not_applicable")}  # fmt: skip
    return [f"- n/a ({code}): {NOT_APPLICABLE[code]}." for code in NOT_APPLICABLE if code in used]
