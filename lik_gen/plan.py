"""Variant -> RenderContext: every value a template needs, computed once, here.

Templates never compute: type spellings come from the lookup tables below, argument
lists are built per layout, and the launch-grid and shared-memory formulas are sympy
expressions, simplified once and printed as Python.
"""

from __future__ import annotations

import dataclasses
import functools

import sympy
from sympy.printing.pycode import PythonCodePrinter

from lik_gen import plan_fp8
from lik_gen.ir import Backward, Decompression, DType, Layout, Op, Score, Target, Variant
from lik_gen.plan_score import (
    HOOKED_LAYOUTS,
    RECOMPUTE_LAUNCH_TEMPLATE,
    RECOMPUTE_SIZES,
    RECOMPUTE_TEMPLATE,
    ScorePlan,
    score_plan,
)

# One lookup table per spelling: never format a type inline.
TORCH_DTYPE = {
    DType.FP32: "torch.float32",
    DType.FP16: "torch.float16",
    DType.BF16: "torch.bfloat16",
    DType.FP8E4M3: "torch.float8_e4m3fn",
}
# Shared memory per element of a tl.dot operand tile on a GPU: fp32's tf32x3 dots keep a
# high and a low tf32 part of each operand, twice its bytes (H200: a 128-token query tile
# at head dim 256 with one 16-token doc tile took 288 KB, the element model said 144).
SMEM_OPERAND_BYTES = {DType.FP32: 8, DType.FP16: 2, DType.BF16: 2, DType.FP8E4M3: 1}
# Operand dtype of tl.dot on a GPU. fp32 inputs use three tf32 passes ("tf32x3", about
# fp32 accuracy): a single tf32 pass (~3e-4 error) flips near-tied argmaxes, which moves
# gradients to another doc token (seen on an H200: grad_Q error 0.08-0.2 vs float64).
DOT_DTYPE_DEVICE = {
    DType.FP32: "tl.float32",
    DType.FP16: "tl.float16",
    DType.BF16: "tl.bfloat16",
    DType.FP8E4M3: "tl.float8e4nv",
}
INPUT_PRECISION_DEVICE = {
    DType.FP32: "tf32x3",
    DType.FP16: "ieee",
    DType.BF16: "ieee",
    DType.FP8E4M3: "ieee",
}
# The Triton interpreter multiplies the raw bit patterns of bf16 dot operands, so under
# it every dot runs in fp32 ("ieee"); tensors stay in their dtype in memory, so loads
# and stores are still exercised.
DOT_DTYPE_INTERPRETER = "tl.float32"
INPUT_PRECISION_INTERPRETER = "ieee"

# The decompression hook: one partial per scheme, all with the same signature.
DOC_TILE_HOOK = {Decompression.NONE: "triton/load_doc_tile/none.py.j2"}
# PLAID residual schemes share one hook (triton/load_doc_tile/residual.py.j2), planned by
# lik_gen.plan_plaid.
_RESIDUAL = (Decompression.RESIDUAL2, Decompression.RESIDUAL4, Decompression.RESIDUAL8)

MODULE_TEMPLATE = {Target.TRITON: "triton/maxsim.py.j2"}
LAUNCH_TEMPLATE = {Target.TRITON: "glue/launch_triton.py.j2"}
BACKWARD_TEMPLATE = {
    Backward.UNIFIED: "triton/backward/unified.py.j2",
    Backward.LOWMEM: "triton/backward/lowmem.py.j2",
}
BACKWARD_LAUNCH_TEMPLATE = {
    Backward.UNIFIED: "glue/backward_unified.py.j2",
    Backward.LOWMEM: "glue/backward_lowmem.py.j2",
}
NO_TEMPLATE = ""


@dataclasses.dataclass(frozen=True)
class KernelArg:
    """One runtime argument of a kernel and the launcher expression that supplies it."""

    name: str
    expr: str


@dataclasses.dataclass(frozen=True)
class Formula:
    """A derived launch quantity, printed as a Python function into the glue."""

    name: str
    params: tuple[str, ...]
    expr: str
    doc: str


# Constexprs a doc-tile hook may take (named among its doc_tile_params), each with the
# launcher expression that sets it per call: evict-first loads of uncompressed docs
# (dispatch.loads_docs_once), PLAID residuals read as int32 words (plaid._residual_words),
# a head dim that fills BLOCK_K (no dims past it to zero).
DOC_TILE_CONSTEXPRS = {
    "EVICT_DOCS": "config.evict_docs",
    "RESIDUAL_WORDS": "residuals.dtype == torch.int32",
    "EVEN_K": "Q.shape[-1] == config.block_k",
}


# Layouts whose forward stacks QUERY_GROUP queries' tokens into one query tile (every
# query scores every doc): in-batch padded (dense) and in-batch packed (varlen).
STACKED_LAYOUTS = ("dense", "varlen")


@dataclasses.dataclass(frozen=True)
class RenderContext:
    name: str
    purpose: str
    layout: str
    has_q_mask: bool
    has_d_mask: bool
    normalize: bool
    backward: str
    save_argmax: bool
    elem_torch: str
    dot_dtype_device: str
    dot_dtype_interpreter: str
    input_precision_device: str
    input_precision_interpreter: str
    size_exprs: tuple[KernelArg, ...]
    launcher_args: tuple[str, ...]
    launcher_keywords: tuple[str, ...]
    backward_args: tuple[str, ...]
    fwd_args: tuple[KernelArg, ...]
    bwd_args: tuple[KernelArg, ...]
    bwd_q_args: tuple[KernelArg, ...]
    bwd_d_args: tuple[KernelArg, ...]
    # Size arguments Triton must not specialize on (it would compile one kernel per
    # divisibility class of Nq, Ld, max_seqlen_q, ...): sizes vary call to call.
    fwd_dynamic: tuple[str, ...]
    bwd_dynamic: tuple[str, ...]
    bwd_q_dynamic: tuple[str, ...]
    bwd_d_dynamic: tuple[str, ...]
    grid_params: tuple[str, ...]
    unified_grid_params: tuple[str, ...]
    unified_block_n: str
    lowmem_q_grid_params: tuple[str, ...]
    lowmem_d_grid_params: tuple[str, ...]
    formulas: tuple[Formula, ...]
    doc_tile_hook: str
    module_template: str
    launch_template: str
    backward_template: str
    backward_launch_template: str
    output_doc: str
    argmax_doc: str
    topk: bool
    # The token-score hook (lik_gen.plan_score); score "max" has no hook.
    score: ScorePlan | None = None
    # fp8 storage: per-token dequantization scales scale the similarities and maxima.
    scaled: bool = False
    # Each dense forward program walks DOCS_PER_PROGRAM docs in one flat (doc, tile) loop.
    doc_stream: bool = False
    # The doc-tile hook's call: _load_doc_tile(*doc_tile_inputs, offs_t, offs_k, d_len,
    # dim, *doc_tile_params). doc_bases names each doc tensor's first-token offset and its
    # stride prefix. Residual variants (lik_gen.plan_plaid) read PLAID's compressed tokens,
    # and dense ones a per-doc length (doc_lengths) instead of Ld.
    doc_tile_inputs: tuple[str, ...] = ("D", "d_base")
    doc_tile_params: tuple[str, ...] = ("stride_dt", "stride_dk")
    doc_bases: tuple[tuple[str, str], ...] = (("d_base", "d"),)
    doc_lengths: bool = False
    # Where not empty, the hook also defines _doc_tile_ahead(*doc_tile_ahead, offs_t, d_len):
    # a part of the tile that the forward's tile loops load one tile ahead and hand to
    # _load_doc_tile as its first argument.
    doc_tile_ahead: tuple[str, ...] = ()
    # The forward scores tile @ q^T, doc tokens as the rows of the similarities ([BLOCK_L,
    # query rows], the max over axis 0), instead of q @ tile^T: a decoded doc tile then
    # feeds the MMA as its left operand without a transpose. Not with a saved argmax or a
    # score hook, whose tile updates take [query rows, doc tokens] (__post_init__).
    doc_token_rows: bool = False
    nbits: int = 0
    # Every doc holds Ld tokens and no doc mask: the forward takes EVEN_LD (BLOCK_L divides
    # Ld, chosen per call) and then masks no doc token.
    even_tiles: bool = False
    # The forward may score a doc's partial last tile after its whole ones (streamed dense
    # inference, and the dense training forward): it takes TAIL_L, that tile's width.
    peels_tail: bool = False
    # The dense training forward may keep its argmax per tile column (COLUMN_ARGMAX).
    column_argmax: bool = False
    # The lowmem grad_D multiplies only the query tokens a route pass listed per (doc,
    # tile) (dense: every query scores every doc); fp16 scales g per step of rows.
    routed_grad_d: bool = False
    routed_g_scale: bool = False
    bwd_route_args: tuple[KernelArg, ...] = ()
    bwd_route_dynamic: tuple[str, ...] = ()

    @property
    def doc_tile_constexprs(self) -> tuple[str, ...]:
        """The constexprs the doc-tile hook takes (kernel parameters, set per call by the
        launcher from DOC_TILE_CONSTEXPRS)."""
        return tuple(name for name in self.doc_tile_params if name in DOC_TILE_CONSTEXPRS)

    def __post_init__(self):
        hooked = self.score is not None and self.score.hook != ""
        if self.doc_token_rows and (self.save_argmax or hooked):
            raise PlanError(f"{self.name}: doc_token_rows scores the plain max only (no saved "
                            "argmax, no score hook)")  # fmt: skip

    @property
    def evict_docs_option(self) -> bool:
        """Whether the forward's doc-tile hook takes EVICT_DOCS (config.evict_docs)."""
        return "EVICT_DOCS" in self.doc_tile_constexprs

    @property
    def fwd_options(self) -> tuple[str, ...]:
        """The forward launch's constexpr and launch options ("NAME=expr"), one per feature
        the kernel has. Derived from the final context, after any planner (PLAID, fp8)
        has replaced fields."""
        options = ["BLOCK_Q=config.block_q", "BLOCK_L=config.block_l", "BLOCK_K=config.block_k",
                   "DOT_DTYPE=dot_dtype", "INPUT_PRECISION=input_precision",
                   "num_warps=config.num_warps", "num_stages=config.num_stages"]  # fmt: skip
        if self.layout in STACKED_LAYOUTS:
            options.append("QUERY_GROUP=config.query_group")
        if self.topk:
            options.append("TOP_K=config.top_k")
        if self.topk or self.doc_stream:
            options.append("DOCS_PER_PROGRAM=config.docs_per_program")
        if self.doc_stream:
            options += [
                "FLAT_DOCS=config.flat_docs",
                "DOC_SPLITS=splits",
                "PEEL_TAIL=config.peel_tail",
            ]
        options += [f"{name}={DOC_TILE_CONSTEXPRS[name]}" for name in self.doc_tile_constexprs]
        if self.even_tiles:
            options.append("EVEN_LD=Ld % config.block_l == 0")
        if self.doc_stream:  # peels only when the call's config says so
            tail = "tail_tile(Ld, config.block_l) if config.peel_tail else config.block_l"
            options.append(f"TAIL_L={tail}")
        elif self.peels_tail:
            options.append("TAIL_L=tail_tile(Ld, config.block_l)")
        if self.scaled:
            options.append("D_SCALE_PER_TOKEN=scale_D.stride(-1) != 0 and Ld > 1")
        if self.column_argmax:
            options.append("COLUMN_ARGMAX=config.column_argmax")
        return (*options, *self.score.options)


class PlanError(ValueError):
    pass


class _Printer(PythonCodePrinter):
    """Prints integer formulas without the math module: ceil(a/b) as cdiv(a, b)."""

    def _print_ceiling(self, expr):
        num, den = sympy.fraction(sympy.together(expr.args[0]))
        return f"cdiv({self._print(num)}, {self._print(den)})"


@functools.cache
def _pycode(expr: sympy.Expr) -> str:
    # Cached: the same few formulas recur across hundreds of variants, and simplify is slow.
    return _Printer().doprint(sympy.simplify(expr))


def _formula(name: str, expr: sympy.Expr, params: tuple[str, ...], doc: str) -> Formula:
    missing = {str(s) for s in expr.free_symbols} - set(params)
    if missing:
        raise PlanError(f"formula {name} uses symbols {sorted(missing)} it does not take")
    return Formula(name, params, _pycode(expr), doc)


# Sizes named as the launcher names them.
Nq, Nd, K, B, P, Lq, Ld, n_rows, total_d = sympy.symbols(
    "Nq Nd K B P Lq Ld n_rows total_d", integer=True, positive=True
)
BLOCK_Q, BLOCK_L, BLOCK_K, BLOCK_N, BLOCK_R, QUERY_GROUP, num_stages = sympy.symbols(
    "BLOCK_Q BLOCK_L BLOCK_K BLOCK_N BLOCK_R QUERY_GROUP num_stages", integer=True, positive=True
)
GRAD_Q_TOKENS = sympy.Symbol("GRAD_Q_TOKENS", integer=True, positive=True)
DOCS_PER_PROGRAM, DOC_SPLITS = sympy.symbols(
    "DOCS_PER_PROGRAM DOC_SPLITS", integer=True, positive=True
)
_PADDED_Q = (("Nq", "Q.shape[0]"), ("Lq", "Q.shape[1]"), ("dim", "Q.shape[2]"))
_RAGGED = (("Nq", "cu_seqlens_q.shape[0] - 1"), ("Nd", "cu_seqlens_d.shape[0] - 1"),
           ("dim", "Q.shape[1]"), ("total_q", "Q.shape[0]"), ("total_d", "D.shape[0]"))  # fmt: skip

# Per layout: the launcher's sizes (name, expression), the output and argmax shapes,
# queries and docs per query, the tensors that locate ragged sequences, and the stride
# axes of Q, D (and their gradients) and of the per-pair tensors (scores, grad, argmax).
_LAYOUT = {
    Layout.DENSE: dict(
        sizes=_PADDED_Q + (("Nd", "D.shape[0]"), ("Ld", "D.shape[1]")),
        queries=Nq, docs=Nd, doc_count=Nd, ragged=(),
        q_axes=("b", "s", "k"), doc_axes=("b", "t", "k"), pair_axes=("b", "c"),
        output="[Nq, Nd]", argmax="[Nq, Nd, Lq]",
    ),
    Layout.KD: dict(
        sizes=_PADDED_Q + (("K", "D.shape[1]"), ("Ld", "D.shape[2]")),
        queries=Nq, docs=K, doc_count=Nq * K, ragged=(),
        q_axes=("b", "s", "k"), doc_axes=("b", "c", "t", "k"), pair_axes=("b", "c"),
        output="[Nq, K]", argmax="[Nq, K, Lq]",
    ),
    Layout.PAIRS: dict(
        sizes=(("B", "Q.shape[0]"), ("Lq", "Q.shape[1]"), ("dim", "Q.shape[2]"),
               ("Ld", "D.shape[1]")),
        queries=B, docs=sympy.Integer(1), doc_count=B, ragged=(),
        q_axes=("b", "s", "k"), doc_axes=("b", "t", "k"), pair_axes=("b",),
        output="[B]", argmax="[B, Lq]",
    ),
    Layout.VARLEN: dict(
        sizes=_RAGGED, queries=Nq, docs=Nd, doc_count=Nd,
        ragged=("cu_seqlens_q", "cu_seqlens_d"),
        q_axes=("s", "k"), doc_axes=("t", "k"), pair_axes=("b", "c"),
        output="[Nq, Nd]", argmax="[Nq, Nd, max_seqlen_q]",
    ),
    Layout.PACKED_PAIRS: dict(
        sizes=(("P", "pair_q_idx.shape[0]"),) + _RAGGED,
        queries=P, docs=sympy.Integer(1), doc_count=P,
        ragged=("cu_seqlens_q", "cu_seqlens_d", "pair_q_idx", "pair_d_idx"),
        q_axes=("s", "k"), doc_axes=("t", "k"), pair_axes=("b",),
        output="[P]", argmax="[P, max_seqlen_q]",
    ),
}  # fmt: skip


def _strides(prefix: str, tensor: str, axes: tuple[str, ...]) -> list[KernelArg]:
    return [
        KernelArg(f"stride_{prefix}{axis}", f"{tensor}.stride({i})") for i, axis in enumerate(axes)
    ]


# The sizes each kernel reads, per layout: the count it splits program ids by or loops
# over, then the token counts and the head dim. Anything else would be a dead argument.
_KERNEL_SIZES = {
    "fwd": {Layout.DENSE: ("Nq", "Lq", "Ld"), Layout.KD: ("K", "Lq", "Ld"),
            Layout.PAIRS: ("Lq", "Ld"),
            Layout.VARLEN: ("Nq", "Nd", "max_seqlen_q", "total_q", "total_d"),
            Layout.PACKED_PAIRS: ("Nq", "Nd", "max_seqlen_q", "total_q", "total_d")},
    "bwd": {Layout.DENSE: ("Nq", "Nd", "Lq"), Layout.KD: ("K", "Lq"), Layout.PAIRS: ("Lq",),
            Layout.VARLEN: ("Nq", "Nd", "total_q"),
            Layout.PACKED_PAIRS: ("Nq", "Nd", "total_q")},
    "bwd_q": {Layout.DENSE: ("Nd", "Lq"), Layout.KD: ("K", "Lq"), Layout.PAIRS: ("Lq",),
              Layout.VARLEN: ("Nd", "Lq", "total_q")},
    "bwd_d": {Layout.DENSE: ("Nq", "Lq", "Ld"), Layout.KD: ("K", "Lq", "Ld"),
              Layout.PAIRS: ("Lq", "Ld"), Layout.VARLEN: ("Nq", "Nd", "Lq")},
    "bwd_route": {Layout.DENSE: ("Nq", "Lq", "Ld"), Layout.VARLEN: ("Nq", "Nd", "Lq", "total_d")},
}  # fmt: skip
# Ragged launchers have no Lq: the lowmem kernels' query-token bound is max_seqlen_q.
_RAGGED_SIZE_EXPR = {"Lq": "max_seqlen_q"}


def _kernel_args(variant: Variant) -> dict[str, tuple[KernelArg, ...]]:
    """Exactly the arguments each kernel reads, in order, with their launcher expressions."""
    layout, normalize = variant.layout, variant.normalize
    shape = _LAYOUT[layout]
    doc_axes, pair_axes, q_axes = shape["doc_axes"], shape["pair_axes"], shape["q_axes"]
    ragged = [KernelArg(name, name) for name in shape["ragged"]]
    size_expr = _RAGGED_SIZE_EXPR if ragged else {}

    def sizes(kernel: str) -> list[KernelArg]:
        names = _KERNEL_SIZES[kernel].get(layout, ())
        if kernel == "fwd" and (variant.op is Op.TOPK or streams_docs(variant)):
            names = ("Nq", "Nd", "Lq", "Ld")  # blocks of docs end at Nd
        return [KernelArg(s, size_expr.get(s, s)) for s in names + ("dim",)]

    q, q_strides = [KernelArg("Q", "Q")], _strides("q", "Q", q_axes)
    d, d_strides = [KernelArg("D", "D")], _strides("d", "D", doc_axes)
    grad, grad_strides = [KernelArg("Grad", "grad_out")], _strides("g", "grad_out", pair_axes)
    argmax = [KernelArg("Argmax", "argmax")]
    argmax_strides = _strides("a", "argmax", pair_axes + ("s",))
    gq, gq_strides = [KernelArg("GQ", "GQ")], _strides("gq", "GQ", q_axes)
    gd, gd_strides = [KernelArg("GD", "GD")], _strides("gd", "GD", doc_axes)

    fwd = q + d
    fwd_strides = q_strides + d_strides
    if plan_fp8.is_scaled(variant):  # dequantization scales, read through their strides
        for name, expr, prefix, axes in plan_fp8.SCALE_TENSORS:
            fwd += [KernelArg(name, expr)]
            fwd_strides += _strides(prefix, expr, axes)
    if variant.mask.has_q:
        fwd += [KernelArg("q_mask", "q_mask")]
    if variant.mask.has_d:
        fwd += [KernelArg("d_mask", "d_mask")]
    if variant.mask.has_q:
        fwd_strides += _strides("qm", "q_mask", ("b", "s"))
    if variant.mask.has_d:
        fwd_strides += _strides("dm", "d_mask", doc_axes[:-1])
    if variant.op is Op.TOPK:
        # Each program writes its doc block's best TOP_K (score, doc) per query.
        fwd += [KernelArg("CandScores", "out"), KernelArg("CandDocs", "cand_docs")]
        fwd_strides += _strides("cs", "out", ("b", "c", "k")) + _strides(
            "cd", "cand_docs", ("b", "c", "k")
        )
    else:
        fwd += ragged + [KernelArg("Out", "out")]
        fwd_strides += _strides("o", "out", pair_axes)
    if streams_docs(variant):  # long docs split: each token range's row maxima, and
        # per (doc, query group) the ranges done (the last one reduces them)
        fwd += [KernelArg("Partial", "partial"), KernelArg("Arrivals", "arrivals")]
    # Hooked token scores: weights w[query, s] (weighted), a temperature (smooth), and
    # what the backward needs instead of an argmax.
    weighted, smooth = variant.score is Score.WEIGHTED, variant.score is Score.SMOOTH
    weights = [KernelArg("W", "W")] if weighted else []
    w_strides = _strides("w", "W", ("b", "s")) if weighted else []
    tau = [KernelArg("tau", "tau")] if smooth else []
    saved_axes = pair_axes + ("s",) + (("k",) if variant.score is Score.TOPK_MEAN else ())
    saved, saved_strides = [KernelArg("Saved", "saved")], _strides("sv", "saved", saved_axes)
    fwd = fwd[:2] + weights + fwd[2:] + tau
    fwd_strides = fwd_strides + w_strides
    if variant.backward is not Backward.NONE and variant.score is Score.MAX:
        fwd += argmax
        fwd_strides += argmax_strides
    elif variant.backward is not Backward.NONE:
        fwd += saved
        fwd_strides += saved_strides
    # grad_Q reads the raw queries only for the normalization Jacobian; grad_D likewise
    # reads the raw doc tokens only then.
    if variant.score is not Score.MAX:
        return {
            "fwd": tuple(fwd + sizes("fwd") + fwd_strides),
            **_recompute_args(variant, weights, tau, saved, saved_strides),
        }
    bwd_q_inputs = (q if normalize else []) + d + ragged + grad + argmax
    bwd_q_strides = (q_strides if normalize else []) + d_strides
    bwd_d_inputs = q + (d if normalize else []) + ragged + grad + argmax
    bwd_d_strides = q_strides + (d_strides if normalize else [])
    # Dense and varlen grad_D read the winner lists a route pass writes (lowmem.py.j2);
    # varlen's route pass also finds each program's doc and first token (tile_doc,
    # tile_first) from the doc offsets.
    route, route_args = [], ()
    if routes_grad_d(variant):
        tile_map = [KernelArg("TileDoc", "tile_doc"), KernelArg("TileFirst", "tile_first")]
        route = [KernelArg("Route", "route"), KernelArg("RouteStart", "route_start"),
                 KernelArg("RouteCount", "route_count")] + (tile_map if ragged else [])  # fmt: skip
        route_names = _KERNEL_SIZES["bwd_route"][layout]
        route_sizes = [KernelArg(s, size_expr.get(s, s)) for s in route_names]
        doc_offsets = [KernelArg("cu_seqlens_d", "cu_seqlens_d")] if ragged else []
        route_args = tuple(argmax + doc_offsets + route + route_sizes + argmax_strides)
    return {
        "bwd_route": route_args,
        "fwd": tuple(fwd + sizes("fwd") + fwd_strides),
        "bwd": tuple(q + d + ragged + grad + argmax + gq + gd + sizes("bwd") + q_strides + d_strides
                     + grad_strides + argmax_strides + gq_strides + gd_strides),
        "bwd_q": tuple(bwd_q_inputs + gq + sizes("bwd_q") + bwd_q_strides + grad_strides
                       + argmax_strides + gq_strides),
        "bwd_d": tuple(bwd_d_inputs + route + gd + sizes("bwd_d") + bwd_d_strides + grad_strides
                       + argmax_strides + gd_strides),
    }  # fmt: skip


def _recompute_args(variant, weights, tau, saved, saved_strides):
    """The recompute backward's kernels: both re-read Q, D, the masks and the weights."""
    layout, mask = variant.layout, variant.mask
    shape = _LAYOUT[layout]
    masks = [KernelArg(m, m) for m, has in (("q_mask", mask.has_q), ("d_mask", mask.has_d)) if has]
    input_strides = (
        _strides("q", "Q", shape["q_axes"])
        + _strides("d", "D", shape["doc_axes"])
        + (_strides("qm", "q_mask", ("b", "s")) if mask.has_q else [])
        + (_strides("dm", "d_mask", shape["doc_axes"][:-1]) if mask.has_d else [])
        + (_strides("w", "W", ("b", "s")) if weights else [])
    )
    grad_strides = _strides("g", "grad_out", shape["pair_axes"])
    inputs = [KernelArg("Q", "Q"), KernelArg("D", "D")] + masks + weights
    per_pair = [KernelArg("Grad", "grad_out"), *saved]

    def sizes(kernel: str) -> list[KernelArg]:
        return [KernelArg(s, s) for s in RECOMPUTE_SIZES[kernel][layout] + ("dim",)]

    gq = [KernelArg("GQ", "GQ")] + ([KernelArg("GW", "GW")] if weights else [])
    gq_strides = _strides("gq", "GQ", ("b", "s", "k")) + (
        _strides("gw", "GW", ("b", "s")) if weights else []
    )
    gd_strides = _strides("gd", "GD", shape["doc_axes"])
    return {
        "bwd": (),
        "bwd_q": tuple(inputs + per_pair + gq + tau + sizes("bwd_q") + input_strides
                       + grad_strides + saved_strides + gq_strides),
        "bwd_d": tuple(inputs + per_pair + [KernelArg("GD", "GD")] + tau + sizes("bwd_d")
                       + input_strides + grad_strides + saved_strides + gd_strides),
    }  # fmt: skip


def routes_grad_d(variant: Variant) -> bool:
    """Whether the lowmem grad_D reads winner lists from a route pass (Triton, dense or
    varlen, max): every query scores every doc, so a one-hot tile over whole queries
    would be mostly zeros. Metal keeps its own one-query-at-a-time loop."""
    return (
        variant.target is Target.TRITON
        and variant.backward is Backward.LOWMEM
        and variant.score is Score.MAX
        and variant.layout in _KERNEL_SIZES["bwd_route"]
    )


# Layouts whose docs all hold Ld tokens (ragged ones end each doc at its own length).
_EVEN_TILE_LAYOUTS = (Layout.DENSE, Layout.KD, Layout.PAIRS)


def streams_docs(variant: Variant) -> bool:
    """Whether each forward program walks a block of docs: dense inference with the plain
    max (no argmax to save, no token-score hook).

    Short docs are one or two tiles (a 128-token corpus doc, a 256-token fp8 rerank doc):
    with one program per doc the load pipeline never fills and every program reloads its
    query tile. Streaming DOCS_PER_PROGRAM docs through one flat (doc, tile) loop keeps
    the next doc's tiles in flight. Longer docs under a stacked query tile walk a few docs
    each, one tile loop per doc, so the tall query tile is loaded once for all of them.
    """
    # fp8 docs do not gain: on an H200 (Nq 1, Nd 8192, Ld 256) one doc per program ran
    # 0.104 ms and blocks of 4-32 docs 0.108-0.124 ms; with the 64-row query tile, 0.088
    # against 0.094-0.103 ms for blocks of 2-16 docs.
    return (
        variant.op is Op.MAXSIM
        and not plan_fp8.is_scaled(variant)
        and variant.layout is Layout.DENSE
        and variant.backward is Backward.NONE
        and variant.score is Score.MAX
        and variant.decompression is Decompression.NONE
        and variant.target is Target.TRITON
    )


def has_even_tiles(variant: Variant) -> bool:
    """Whether every doc holds Ld tokens and none is masked (the forward takes EVEN_LD)."""
    return variant.layout in _EVEN_TILE_LAYOUTS and not variant.mask.has_d


def trains_dense(variant: Variant) -> bool:
    """The dense training forward with the argmax saved, whose docs all hold Ld tokens: it
    peels its partial last tile, and may keep its argmax per tile column (COLUMN_ARGMAX)."""
    return (
        variant.layout is Layout.DENSE
        and has_even_tiles(variant)
        and variant.backward is not Backward.NONE
        and variant.score is Score.MAX
    )


def peels_tail(variant: Variant) -> bool:
    """Whether the forward may score a doc's partial last tile after its whole ones, in a
    tile of TAIL_L tokens: streamed dense inference (where dispatch chooses per call),
    and the dense training forward."""
    return streams_docs(variant) or trains_dense(variant)


def _formulas(variant: Variant) -> tuple[Formula, ...]:
    shape = _LAYOUT[variant.layout]
    queries, docs = shape["queries"], shape["docs"]
    pair_params = tuple(str(s) for s in (queries, docs) if isinstance(s, sympy.Symbol))
    operand = SMEM_OPERAND_BYTES[variant.dtype]
    if variant.op is Op.TOPK:
        forward_programs = sympy.ceiling(queries / QUERY_GROUP) * sympy.ceiling(
            docs / DOCS_PER_PROGRAM
        )
        grid_params = pair_params + ("QUERY_GROUP", "DOCS_PER_PROGRAM")
        grid_doc = "(group of queries, block of documents)"
    elif streams_docs(variant):
        blocks = sympy.ceiling(docs / DOCS_PER_PROGRAM)
        forward_programs = sympy.ceiling(queries / QUERY_GROUP) * blocks * DOC_SPLITS
        grid_params = pair_params + ("QUERY_GROUP", "DOCS_PER_PROGRAM", "DOC_SPLITS")
        grid_doc = "(group of queries, block of documents or token range of one)"
    elif variant.layout.value in STACKED_LAYOUTS:
        forward_programs = sympy.ceiling(queries / QUERY_GROUP) * docs
        grid_params, grid_doc = pair_params + ("QUERY_GROUP",), "(group of queries, document)"
    else:
        forward_programs = queries * docs
        grid_params, grid_doc = pair_params, "scored (query, document) pair"
    formulas = [
        _formula("forward_grid", sympy.Tuple(forward_programs), grid_params,
                 f"Programs of the forward: one per {grid_doc}."),
        _formula("smem_bytes", (num_stages * BLOCK_L + BLOCK_Q) * BLOCK_K * operand,
                 ("BLOCK_Q", "BLOCK_L", "BLOCK_K", "num_stages"),
                 "Shared memory of the forward: pipelined doc tiles plus the query tile."),
    ]  # fmt: skip
    if variant.backward is Backward.UNIFIED:
        blocks = sympy.ceiling(docs / BLOCK_N) if docs != 1 else sympy.Integer(1)
        params = pair_params + (("BLOCK_N",) if docs != 1 else ())
        formulas.append(
            _formula(
                "unified_grid",
                sympy.Tuple(queries * blocks),
                params,
                "Programs of the unified backward: (query, block of docs).",
            )
        )
        if variant.normalize:
            formulas.append(
                _formula(
                    "normalize_grid",
                    sympy.Tuple(sympy.ceiling(n_rows / BLOCK_R)),
                    ("n_rows", "BLOCK_R"),
                    "Programs of the Jacobian pass.",
                )
            )
    if variant.backward is Backward.LOWMEM:
        formulas.append(_lowmem_q_grid(variant, queries))
        formulas.append(_lowmem_d_grid(variant, shape["doc_count"]))
    return tuple(formulas)


def _lowmem_d_grid(variant: Variant, doc_count: sympy.Expr) -> Formula:
    """grad_D's grid: a program per (doc, block of BLOCK_L tokens). Packed docs (varlen)
    take cdiv(n, BLOCK_L) programs each: at most this many for disjoint docs within the
    packed tokens; the programs past the last tile idle."""
    if variant.layout is Layout.VARLEN:
        return _formula(
            "lowmem_d_grid",
            sympy.Tuple(sympy.ceiling(total_d / BLOCK_L) + Nd),
            ("Nd", "total_d", "BLOCK_L"),
            "Programs of grad_D: one per (doc, block of its tokens), and a few to spare.",
        )
    params = tuple(sorted(str(s) for s in doc_count.free_symbols)) + ("Ld", "BLOCK_L")
    return _formula(
        "lowmem_d_grid",
        sympy.Tuple(doc_count * sympy.ceiling(Ld / BLOCK_L)),
        params,
        "Programs of grad_D: one per (doc, block of doc tokens).",
    )


def _lowmem_q_grid(variant: Variant, queries: sympy.Expr) -> Formula:
    """grad_Q's grid: the argmax backward splits each query's tokens over programs (rows
    are gathered, each on its own); the recompute backward multiplies whole query tiles."""
    if variant.score is Score.MAX:
        return _formula(
            "lowmem_q_grid",
            sympy.Tuple(queries * sympy.ceiling(Lq / GRAD_Q_TOKENS)),
            (str(queries), "Lq", "GRAD_Q_TOKENS"),
            "Programs of grad_Q: one per (query, block of query tokens), owning its rows.",
        )
    return _formula(
        "lowmem_q_grid",
        sympy.Tuple(queries),
        (str(queries),),
        "Programs of grad_Q: one per query, owning its rows.",
    )


def _grid_call_params(
    formulas: tuple[Formula, ...], name: str, blocks: dict[str, str]
) -> tuple[str, ...]:
    """The launcher's arguments for a grid formula: sizes by name, tiles from the config."""
    for formula in formulas:
        if formula.name == name:
            return tuple(blocks.get(p, p) for p in formula.params)
    return ()


def _purpose(variant: Variant) -> str:
    if variant.op is Op.TOPK:
        return "top-k candidates (retrieval)"
    if variant.backward is Backward.NONE:
        return "forward"
    return f"training ({variant.backward.value} backward)"


def plan(variant: Variant):
    """The render context of a variant: a RenderContext for Triton, or the Metal
    planner's context (lik_gen.plan_metal) for target = "metal"."""
    if variant.op is Op.HEAD:  # fused projection head: its own planner and templates
        from lik_gen.plan_head import plan_head

        return plan_head(variant)
    if variant.target is Target.TRITON and variant.decompression in _RESIDUAL:
        # PLAID residual docs: the uncompressed plan with its doc source swapped.
        from lik_gen.plan_plaid import plan_residual

        return plan_residual(variant)
    if variant.target is Target.METAL:
        from lik_gen.plan_metal import plan_metal

        return plan_metal(variant)
    if variant.target not in MODULE_TEMPLATE:
        raise PlanError(f"{variant.name}: target {variant.target.value!r} has no templates yet")
    if variant.decompression not in DOC_TILE_HOOK:
        raise PlanError(
            f"{variant.name}: decompression {variant.decompression.value!r} has no "
            "load_doc_tile hook yet"
        )
    fp8_problem = plan_fp8.unsupported(variant)
    if fp8_problem is not None:
        raise PlanError(f"{variant.name}: {fp8_problem}")
    if variant.layout not in _LAYOUT:
        raise PlanError(f"{variant.name}: layout {variant.layout.value!r} has no template yet")
    shape = _LAYOUT[variant.layout]
    hooked = variant.score is not Score.MAX
    if hooked and variant.layout not in HOOKED_LAYOUTS:
        raise PlanError(f"{variant.name}: the score hook has no {variant.layout.value} template")
    if variant.backward is Backward.LOWMEM and variant.layout not in _KERNEL_SIZES["bwd_q"]:
        layout = variant.layout.value
        raise PlanError(f"{variant.name}: the lowmem backward has no {layout} template")
    args = _kernel_args(variant)
    routed = routes_grad_d(variant)
    formulas = _formulas(variant)
    blocks = {"BLOCK_N": "config.block_n", "BLOCK_L": "config.block_l",
              "QUERY_GROUP": "config.query_group",
              "DOCS_PER_PROGRAM": "config.docs_per_program",
              "DOC_SPLITS": "config.doc_splits"}  # fmt: skip
    # Tensors the runtime hands to launch() and backward() by keyword, after Q and D.
    ragged = shape["ragged"]
    if ragged:
        blocks.update(_RAGGED_SIZE_EXPR)
    launcher_args = ["Q", "D", *ragged]
    if plan_fp8.is_scaled(variant):
        launcher_args += [expr for _, expr, _, _ in plan_fp8.SCALE_TENSORS]
    if variant.mask.has_q:
        launcher_args.append("q_mask")
    if variant.mask.has_d:
        launcher_args.append("d_mask")
    keywords = ("max_seqlen_q",) if ragged else ()
    if variant.op is Op.TOPK:
        keywords = ("cand_docs",)
    backward = variant.backward
    score = score_plan(variant)
    keywords += score.keywords
    backward_args = ("Q", "D", *ragged)
    backward_template = BACKWARD_TEMPLATE.get(backward, NO_TEMPLATE)
    backward_launch_template = BACKWARD_LAUNCH_TEMPLATE.get(backward, NO_TEMPLATE)
    bwd_sizes = {k: _KERNEL_SIZES[k] for k in ("bwd_q", "bwd_d")}
    if score.weighted:
        launcher_args.insert(2, "W")
    if hooked:
        backward_args = tuple(launcher_args)
        backward_template, backward_launch_template = RECOMPUTE_TEMPLATE, RECOMPUTE_LAUNCH_TEMPLATE
        bwd_sizes = RECOMPUTE_SIZES
    return RenderContext(
        name=variant.name,
        purpose=_purpose(variant),
        topk=variant.op is Op.TOPK,
        layout=variant.layout.value,
        has_q_mask=variant.mask.has_q,
        has_d_mask=variant.mask.has_d,
        normalize=variant.normalize,
        backward=backward.value,
        save_argmax=backward is not Backward.NONE and not hooked,
        elem_torch=TORCH_DTYPE[variant.dtype],
        dot_dtype_device=DOT_DTYPE_DEVICE[variant.dtype],
        dot_dtype_interpreter=DOT_DTYPE_INTERPRETER,
        input_precision_device=INPUT_PRECISION_DEVICE[variant.dtype],
        input_precision_interpreter=INPUT_PRECISION_INTERPRETER,
        size_exprs=tuple(KernelArg(name, expr) for name, expr in shape["sizes"]),
        launcher_args=tuple(launcher_args),
        launcher_keywords=keywords,
        backward_args=backward_args,
        fwd_args=args["fwd"],
        bwd_args=args["bwd"] if backward is Backward.UNIFIED else (),
        bwd_q_args=args["bwd_q"] if backward is Backward.LOWMEM else (),
        bwd_d_args=args["bwd_d"] if backward is Backward.LOWMEM else (),
        fwd_dynamic=("Nq", "Nd", "Lq", "Ld")
        if variant.op is Op.TOPK or streams_docs(variant)
        else _KERNEL_SIZES["fwd"][variant.layout],
        bwd_dynamic=_KERNEL_SIZES["bwd"][variant.layout],
        bwd_q_dynamic=bwd_sizes["bwd_q"].get(variant.layout, ()),
        bwd_d_dynamic=bwd_sizes["bwd_d"].get(variant.layout, ()),
        grid_params=_grid_call_params(formulas, "forward_grid", blocks),
        unified_grid_params=_grid_call_params(formulas, "unified_grid", blocks),
        unified_block_n="config.block_n" if shape["docs"] != 1 else "1",
        lowmem_q_grid_params=_grid_call_params(formulas, "lowmem_q_grid", blocks),
        lowmem_d_grid_params=_grid_call_params(formulas, "lowmem_d_grid", blocks),
        formulas=formulas,
        doc_tile_hook=DOC_TILE_HOOK[variant.decompression],
        module_template=MODULE_TEMPLATE[variant.target],
        launch_template=LAUNCH_TEMPLATE[variant.target],
        backward_template=backward_template,
        backward_launch_template=backward_launch_template,
        output_doc=shape["output"],
        argmax_doc=shape["argmax"],
        score=score,
        scaled=plan_fp8.is_scaled(variant),
        doc_stream=streams_docs(variant),
        # Uncompressed docs; streaming forwards' loads may carry an evict-first hint.
        doc_tile_params=(
            "stride_dt",
            "stride_dk",
            "EVICT_DOCS" if streams_docs(variant) else "False",
        ),  # fmt: skip
        even_tiles=has_even_tiles(variant),
        peels_tail=peels_tail(variant),
        column_argmax=trains_dense(variant),
        routed_grad_d=routed,
        routed_g_scale=routed and variant.dtype is DType.FP16,
        bwd_route_args=args["bwd_route"] if routed else (),
        bwd_route_dynamic=_KERNEL_SIZES["bwd_route"][variant.layout] if routed else (),
    )
