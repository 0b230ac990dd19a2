"""Command line: ``lik retrieve`` (also ``python -m lik retrieve``).

    lik retrieve --queries q.pt --corpus d.pt --top-k 10 [--chunk N]
                 [--normalize/--no-normalize] [--out results.pt] [--device DEV] [--show N]

Inputs are torch.save'd tensors ([Nq, Lq, d] queries, [Nd, Ld, d] corpus) or dicts with
key "embeddings" and an optional bool "mask" (True = valid token). The corpus is memory
mapped and moved to the device one chunk at a time, so it need not fit there whole.
Under torchrun (WORLD_SIZE > 1) every rank scores a contiguous share of the corpus and
rank 0 prints and writes the merged results. Bad input exits with status 2 and one line
that names the argument; the device, the output path and the GPU family are checked
before any file is read or anything is scored.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

EXIT_BAD_INPUT = 2
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class InputError(Exception):
    """Bad input the user can fix; printed without a traceback, exit status 2."""


@dataclass(frozen=True)
class Embeddings:
    tensor: torch.Tensor  # [N, L, d]
    mask: torch.Tensor | None  # [N, L] bool, True = valid token


# ---------------------------------------------------------------------------------------
# Loading and checking input files


def _torch_load(path: Path) -> object:
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    try:
        # Memory-mapped, so a large corpus is paged in chunk by chunk.
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - files in the old format cannot be mapped; retry
        pass
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure here means unreadable content
        raise InputError(
            f"{path}: expected a file written by torch.save, torch.load failed with "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def _unpack(path: Path, content: object) -> tuple[object, object]:
    if isinstance(content, torch.Tensor):
        return content, None
    if isinstance(content, dict) and "embeddings" in content:
        return content["embeddings"], content.get("mask")
    found = f"dict with keys {sorted(map(str, content))}" if isinstance(content, dict) else None
    raise InputError(
        f"{path}: expected a tensor or a dict with key 'embeddings' (and optional 'mask'), "
        f"got {found or type(content).__name__}"
    )


def _check_embeddings(path: Path, tensor: object, layout: str, ranks: tuple[int, ...]):
    if not isinstance(tensor, torch.Tensor):
        raise InputError(
            f"{path}: 'embeddings' must be a tensor {layout}, got {type(tensor).__name__}"
        )
    if tensor.dim() not in ranks:
        raise InputError(
            f"{path}: embeddings must be {layout}, got {tensor.dim()} dims "
            f"(shape {tuple(tensor.shape)})"
        )
    if tensor.dtype not in _FLOAT_DTYPES:
        raise InputError(
            f"{path}: embeddings must be float32, float16 or bfloat16, got {tensor.dtype}"
        )


def _check_mask(path: Path, mask: object, tensor: torch.Tensor) -> torch.Tensor | None:
    if mask is None:
        return None
    expected = tuple(tensor.shape[:-1])
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        found = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise InputError(f"{path}: 'mask' must be a bool tensor {list(expected)}, got {found}")
    if tuple(mask.shape) != expected:
        raise InputError(
            f"{path}: 'mask' must have shape {expected} (embeddings without d), "
            f"got {tuple(mask.shape)}"
        )
    return mask


def load_embeddings(path: Path, role: str) -> Embeddings:
    """Queries (role 'queries': [Nq, Lq, d] or one query [Lq, d]) or corpus ([Nd, Ld, d])."""
    try:
        return _load_embeddings(path, role)
    except InputError as error:
        raise InputError(f"argument --{role}: {error}") from None


def _load_embeddings(path: Path, role: str) -> Embeddings:
    tensor, mask = _unpack(path, _torch_load(path))
    if role == "queries":
        _check_embeddings(path, tensor, "[Nq, Lq, d] or [Lq, d]", (2, 3))
        mask = _check_mask(path, mask, tensor)
        if tensor.dim() == 2:
            tensor, mask = tensor[None], None if mask is None else mask[None]
    else:
        _check_embeddings(path, tensor, "[Nd, Ld, d]", (3,))
        mask = _check_mask(path, mask, tensor)
    return Embeddings(tensor, mask)


def _check_head_dims(queries_path, queries: Embeddings, corpus_path, corpus: Embeddings):
    q_dim, d_dim = queries.tensor.shape[-1], corpus.tensor.shape[-1]
    if q_dim != d_dim:
        raise InputError(
            f"arguments --queries and --corpus: d mismatch: {queries_path} has d={q_dim}, "
            f"{corpus_path} has d={d_dim}; "
            "queries and corpus must come from the same model"
        )


# ---------------------------------------------------------------------------------------
# Progress over corpus chunks


class _LineProgress:
    """Stand-in for tqdm: one stderr line, redrawn in place on a terminal."""

    def __init__(self, total: int, desc: str):
        self.total, self.done, self.desc = total, 0, desc
        self.live = sys.stderr.isatty()

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.live:
            print(f"\r{self.desc}: {self.done}/{self.total} chunks", end="", file=sys.stderr)

    def close(self) -> None:
        end = "\n" if self.live else f"{self.desc}: {self.done}/{self.total} chunks\n"
        print(end, end="", file=sys.stderr, flush=True)


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoProgress()
    try:
        from tqdm import tqdm  # optional: only for a nicer bar
    except ImportError:
        return _LineProgress(total, "scoring corpus")
    return tqdm(total=total, desc="scoring corpus", unit="chunk", file=sys.stderr)


# ---------------------------------------------------------------------------------------
# Retrieval


@dataclass(frozen=True)
class Shard:
    """This process's contiguous share [start, stop) of the corpus."""

    start: int
    stop: int
    rank: int = 0
    world_size: int = 1


def _shard_of(total: int, rank: int, world_size: int) -> Shard:
    # Like torch.tensor_split: the first total % world_size ranks get one doc more.
    base, extra = divmod(total, world_size)
    start = rank * base + min(rank, extra)
    return Shard(start, start + base + (rank < extra), rank, world_size)


def _local_top_k(queries, corpus, shard, top_k, chunk, normalize, device):
    """(scores, indices within the shard) of this shard, moving one chunk at a time."""
    from lik.runtime.retrieval import merge_top_k, retrieve

    Q = queries.tensor.to(device)
    q_mask = None if queries.mask is None else queries.mask.to(device)
    size = shard.stop - shard.start
    step = max(1, chunk or size)
    bounds = [(s, min(size, s + step)) for s in range(0, size, step)] or [(0, 0)]
    progress = _progress(len(bounds), enabled=shard.rank == 0)
    best = None
    for start, stop in bounds:
        part = slice(shard.start + start, shard.start + stop)
        D = corpus.tensor[part].to(device)
        d_mask = None if corpus.mask is None else corpus.mask[part].to(device)
        scores, ids = retrieve(Q, D, top_k, q_mask, d_mask, normalize=normalize, sorted=False)
        candidates = [(scores, ids + start)] + ([best] if best is not None else [])
        best = merge_top_k(candidates, top_k, sorted=False)
        progress.update(1)
    progress.close()
    return best


# Devices the command can score on; anything else (meta, xpu on a build without it, ...)
# is refused up front rather than failing inside the first chunk.
_DEVICE_TYPES = ("cpu", "cuda", "mps")


def check_device(text: str | None) -> torch.device:
    """The --device argument as a device this process can use (default: cuda if available,
    else cpu); InputError naming the argument otherwise."""
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise InputError(
            f"argument --device: {text!r} is not a device (expected one of "
            f"{', '.join(_DEVICE_TYPES)}, or cuda:N)"
        ) from None
    if device.type not in _DEVICE_TYPES:
        raise InputError(
            f"argument --device: cannot score on {device.type!r} (expected one of "
            f"{', '.join(_DEVICE_TYPES)}, or cuda:N)"
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"argument --device: {text!r}, but CUDA is not available here")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise InputError(f"argument --device: {text!r}, but this machine has {count} GPU(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise InputError(f"argument --device: {text!r}, but MPS is not available here")
    return device


def check_out(path: Path | None) -> None:
    """--out must name a file that can be written: not a directory, and under a directory
    (existing, or creatable from its nearest existing parent) this process may write."""
    if path is None:
        return
    if path.is_dir():
        raise InputError(f"argument --out: {path} is a directory; name a file in it")
    if path.exists() and not os.access(path, os.W_OK):
        raise InputError(f"argument --out: {path} cannot be written (permission denied)")
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise InputError(f"argument --out: {path} cannot be created: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(
            f"argument --out: {path} cannot be created in {parent} (permission denied)"
        )


def _distributed_setup(device: torch.device) -> tuple[int, int, torch.device]:
    """(rank, world_size, device); joins torchrun's process group when WORLD_SIZE > 1."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return 0, 1, device
    import torch.distributed as dist

    if device.type == "cuda":
        # One GPU per rank, as torchrun numbers them on this host.
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def run_retrieve(args: argparse.Namespace) -> int:
    device = check_device(args.device)
    check_out(args.out)
    queries = load_embeddings(args.queries, "queries")
    corpus = load_embeddings(args.corpus, "corpus")
    _check_head_dims(args.queries, queries, args.corpus, corpus)
    if queries.tensor.dtype != corpus.tensor.dtype:
        # The corpus is the big one: match it rather than converting it chunk by chunk.
        queries = Embeddings(queries.tensor.to(corpus.tensor.dtype), queries.mask)

    rank, world_size, device = _distributed_setup(device)
    shard = _shard_of(corpus.tensor.shape[0], rank, world_size)
    try:
        scores, indices = _local_top_k(
            queries, corpus, shard, args.top_k, args.chunk, args.normalize, device
        )
        if world_size > 1:
            from lik.runtime.retrieval import merge_shard_results

            scores, indices = merge_shard_results(
                scores, indices, shard.stop - shard.start, args.top_k
            )
        else:
            from lik.runtime.retrieval import merge_top_k

            scores, indices = merge_top_k([(scores, indices)], args.top_k)  # best first
    finally:
        if world_size > 1:
            torch.distributed.destroy_process_group()
    if rank == 0:
        _report(args, scores.cpu(), indices.cpu(), corpus.tensor.shape[0], device, world_size)
    return 0


# ---------------------------------------------------------------------------------------
# Output


def format_table(scores: torch.Tensor, indices: torch.Tensor, max_queries: int) -> str:
    """One row per (query, rank): query, rank (1 = best), document index, score."""
    lines = [f"{'query':>6}  {'rank':>4}  {'doc':>10}  {'score':>10}"]
    for q in range(min(max_queries, scores.shape[0])):
        for r in range(scores.shape[1]):
            label = str(q) if r == 0 else ""
            lines.append(
                f"{label:>6}  {r + 1:>4}  {int(indices[q, r]):>10}  {float(scores[q, r]):>10.4f}"
            )
    hidden = scores.shape[0] - max_queries
    if hidden > 0:
        lines.append(f"... {hidden} more queries not shown (--show, or --out for all)")
    return "\n".join(lines)


def _report(args, scores, indices, corpus_size, device, world_size) -> None:
    ranks = f", {world_size} ranks" if world_size > 1 else ""
    print(
        f"top-{scores.shape[1]} of {corpus_size} documents for {scores.shape[0]} queries "
        f"(normalize={args.normalize}, {device.type}{ranks})"
    )
    if args.show > 0:
        print(format_table(scores, indices, args.show))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        results = {
            "scores": scores,
            "indices": indices,
            "top_k": args.top_k,
            "normalize": args.normalize,
            "queries": str(args.queries),
            "corpus": str(args.corpus),
        }
        torch.save(results, args.out)
        print(f"wrote {args.out}")


# ---------------------------------------------------------------------------------------
# Argument parsing


def _int_at_least(minimum: int):
    """argparse type: an integer >= minimum (argparse names the option on failure)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= {minimum}, got {text!r}"
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


def _version() -> str:
    from lik import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lik", description="late-interaction (MaxSim) tools")
    parser.add_argument("--version", action="version", version=f"lik {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    retrieve = commands.add_parser(
        "retrieve",
        help="top-k documents of a corpus for each query",
        description="Top-k MaxSim retrieval of a saved corpus for saved queries. Files hold a "
        "tensor or a dict with 'embeddings' and an optional bool 'mask' (True = valid token). "
        "Queries are cast to the corpus dtype. Under torchrun, ranks split the corpus.",
    )
    retrieve.add_argument("--queries", type=Path, required=True, help="[Nq, Lq, d] or [Lq, d]")
    retrieve.add_argument("--corpus", type=Path, required=True, help="[Nd, Ld, d]")
    retrieve.add_argument("--top-k", type=_int_at_least(1), required=True, help="results per query")
    retrieve.add_argument(
        "--chunk", type=_int_at_least(1), help="docs scored (and moved to the device) per step"
    )
    retrieve.add_argument(
        "--normalize",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="L2-normalize tokens before scoring (default: on)",
    )
    retrieve.add_argument("--out", type=Path, help="torch.save the scores and indices here")
    retrieve.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    retrieve.add_argument(
        "--show", type=_int_at_least(0), default=10, help="queries in the table (default 10)"
    )
    retrieve.set_defaults(run=run_retrieve)
    explain = commands.add_parser(
        "explain",
        help="what a maxsim call of a given shape launches, and why",
        description="The generated kernel, tuning key and entry, launch config and strategy "
        "(query stacking, doc blocks, token ranges, docs loaded once) that maxsim(Q, D) takes "
        "for Q [Nq, Lq, d] and D [Nd, Ld, d], derived as a call derives them; with --backward, "
        "a training call's, its backward's too. Without a GPU of that family, planned for an "
        "H100's 132 SMs.",
    )
    explain.add_argument(
        "--shape", type=_shape, required=True, metavar="NQ,ND,LQ,LD,D",
        help="queries, docs, query tokens, doc tokens, head dim (e.g. 16,32,32,8192,128)",
    )  # fmt: skip
    explain.add_argument("--dtype", choices=sorted(EXPLAIN_DTYPES), default="bf16")
    explain.add_argument(
        "--masks", choices=sorted(EXPLAIN_MASKS), default="none",
        help="the call's masks: q_mask (q), d_mask (d), both (qd) or none (default)",
    )  # fmt: skip
    explain.add_argument(
        "--backward", choices=["auto", "unified", "lowmem"],
        help="plan a training call (inputs requiring grad) with this backward argument: its "
        "strategy, backward key and config too",
    )  # fmt: skip
    explain.add_argument(
        "--family", help="GPU family whose tuning table to read (default: this GPU's, else hopper)"
    )
    explain.add_argument(
        "--card",
        help="GPU name whose own tuning entries come first, e.g. 'NVIDIA H200' (default: "
        "this GPU's, where it is of that family)",
    )
    explain.set_defaults(run=run_explain)
    return parser


EXPLAIN_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# --masks: (q_mask given, d_mask given)
EXPLAIN_MASKS = {"none": (False, False), "q": (True, False), "d": (False, True), "qd": (True, True)}


def _shape(text: str) -> tuple[int, ...]:
    """argparse type: five positive integers separated by commas."""
    parts = text.split(",")
    if len(parts) != 5 or not all(part.strip().isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(
            f"expected five positive integers NQ,ND,LQ,LD,D, got {text!r}"
        )
    return tuple(int(part) for part in parts)


def known_families() -> list[str]:
    """GPU families lik can plan for: those whose shared memory it knows or that have a
    committed tuning table."""
    from lik.runtime import tuning

    tables = {r.name.removesuffix(".toml") for r in tuning.TABLES.iterdir()}
    tables = {name for name in tables if (tuning.TABLES / f"{name}.toml").is_file()}
    return sorted(set(tuning.SMEM_LIMIT) | tables)


def check_family(family: str | None) -> None:
    if family is not None and family not in known_families():
        raise InputError(
            f"argument --family: unknown GPU family {family!r} "
            f"(expected one of {', '.join(known_families())})"
        )


def run_explain(args) -> int:
    from lik.runtime.backends import TRITON_AVAILABLE
    from lik.runtime.explain import explain_forward, render

    check_family(args.family)
    if not TRITON_AVAILABLE:  # the plan reads the generated Triton modules
        raise InputError("explains Triton launches; install Triton first (pip install triton)")
    q_mask, d_mask = EXPLAIN_MASKS[args.masks]
    plan = explain_forward(
        args.shape, dtype=EXPLAIN_DTYPES[args.dtype], family=args.family, card=args.card,
        q_mask=q_mask, d_mask=d_mask, backward=args.backward,
    )  # fmt: skip
    print(render(plan))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (InputError, ValueError, TypeError) as exc:
        # ValueError/TypeError come from lik's own argument checks, which name the problem.
        print(f"lik {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
