"""Variant -> RenderContext: every value a template needs, computed once, here.

Templates never compute: type spellings come from the lookup tables below, argument
lists are built per layout, and the launch-grid and shared-memory formulas are sympy
expressions, simplified once and printed as Python.
"""

from __future__ import annotations

import dataclasses

import sympy

from lik_gen import plan_fp8
from lik_gen.ir import Backward, Decompression, Kernel, Layout, Op, Score, Target, Variant
from lik_gen.plan_base import (
    BLOCK_K,
    BLOCK_L,
    BLOCK_N,
    BLOCK_Q,
    BLOCK_R,
    DOC_SPLITS,
    DOCS_PER_PROGRAM,
    GRAD_Q_TOKENS,
    KERNEL_SIZES,
    LAYOUT_SHAPES,
    QUERY_GROUP,
    RAGGED_SIZE_EXPR,
    STACKED_LAYOUTS,
    DocSource,
    Formula,
    KernelArg,
    Ld,
    Lq,
    Nd,
    PlanError,
    formula,
    has_even_tiles,
    kernel_args,
    layout_sizes,
    n_rows,
    num_stages,
    peels_tail,
    routes_grad_d,
    streams_docs,
    total_d,
    uncompressed_docs,
)
from lik_gen.plan_plaid import RESIDUAL_BITS, residual_docs
from lik_gen.plan_score import (
    HOOKED_LAYOUTS,
    RECOMPUTE_LAUNCH_TEMPLATE,
    RECOMPUTE_SIZES,
    RECOMPUTE_TEMPLATE,
    ScorePlan,
    score_plan,
)

# The doc source of each decompression: one load_doc_tile hook per scheme, all with the
# same signature. PLAID's residual schemes share one (lik_gen.plan_plaid).
DOC_SOURCES = {
    Decompression.NONE: lambda kernel: uncompressed_docs(
        kernel.widest(), LAYOUT_SHAPES[kernel.layout]["doc_axes"]
    ),
    **{scheme: residual_docs for scheme in RESIDUAL_BITS},
}

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


# Constexprs a doc-tile hook may take (named among its doc_tile_params), each with the
# launcher expression that sets it per call: evict-first loads of uncompressed docs
# (heuristics.loads_docs_once), PLAID residuals read as int32 words (plaid._residual_words),
# a head dim that fills BLOCK_K (no dims past it to zero).
DOC_TILE_CONSTEXPRS = {
    "EVICT_DOCS": "config.evict_docs",
    "RESIDUAL_WORDS": "residuals.dtype == torch.int32",
    "EVEN_K": "Q.shape[-1] == config.block_k",
}


@dataclasses.dataclass(frozen=True)
class RenderContext:
    name: str
    purpose: str
    layout: str
    takes_q_mask: bool  # the layout takes a query mask (HAS_Q_MASK chooses per call)
    takes_d_mask: bool  # the layout takes a doc mask (HAS_D_MASK chooses per call)
    backward: str
    save_argmax: bool
    # The launcher tensor whose dtype picks the dot dtype (dot_config).
    dot_dtype_of: str
    # Inputs a call may lack (None): their constexpr flags and strides follow from that.
    optional_inputs: tuple[str, ...]
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
    # Where the docs come from: uncompressed D, or PLAID's residual codes
    # (lik_gen.plan_plaid); its hook defines _load_doc_tile (templates/triton/load_doc_tile).
    doc: DocSource
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
    # The launcher's EVEN_LD: BLOCK_L divides Ld, for docs that all hold Ld tokens (padded,
    # uncompressed); "False" where docs end at their own lengths. Without a doc mask the
    # forward then masks no doc token.
    even_ld: str = "False"
    # The forward may score a doc's partial last tile after its whole ones (streamed dense
    # inference, and the dense training forward): it takes TAIL_L, that tile's width.
    peels_tail: bool = False
    # The lowmem grad_D multiplies only the query tokens a route pass listed per (doc,
    # tile) (dense: every query scores every doc); fp16 scales g per step of rows.
    routed_grad_d: bool = False
    bwd_route_args: tuple[KernelArg, ...] = ()
    bwd_route_dynamic: tuple[str, ...] = ()
    # The forward can read its doc mask as zeros (Kernel.takes_zero_mask): MASKED_AS_ZERO,
    # which the launcher takes as masked_as_zero (default False; the registry binds the
    # variant's).
    takes_zero_mask: bool = False

    @property
    def doc_tile_constexprs(self) -> tuple[str, ...]:
        """The constexprs the doc-tile hook takes (kernel parameters, set per call by the
        launcher from DOC_TILE_CONSTEXPRS)."""
        return tuple(name for name in self.doc.tile_params if name in DOC_TILE_CONSTEXPRS)

    def __post_init__(self):
        hooked = self.score is not None and self.score.hook != ""
        if self.doc.token_rows and (self.save_argmax or hooked):
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
        options += [
            f"HAS_{name[0].upper()}_MASK={name} is not None" for name in self.optional_inputs
        ]
        if self.takes_zero_mask:
            options.append("MASKED_AS_ZERO=masked_as_zero")
        options.append("NORMALIZE=normalize")
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
        options.append(f"EVEN_LD={self.even_ld}")
        if self.doc_stream:  # peels only when the call's config says so
            tail = "tail_tile(Ld, config.block_l) if config.peel_tail else config.block_l"
            options.append(f"TAIL_L={tail}")
        elif self.peels_tail:
            options.append("TAIL_L=tail_tile(Ld, config.block_l)")
        if self.scaled:
            options.append("D_SCALE_PER_TOKEN=scale_D.stride(-1) != 0 and Ld > 1")
        if self.save_argmax and self.peels_tail:  # masked docs have no whole tiles
            options.append("COLUMN_ARGMAX=config.column_argmax and d_mask is None")
        return (*options, *self.score.options)


def _formulas(variant: Variant) -> tuple[Formula, ...]:
    shape = LAYOUT_SHAPES[variant.layout]
    queries, docs = shape["queries"], shape["docs"]
    pair_params = tuple(str(s) for s in (queries, docs) if isinstance(s, sympy.Symbol))
    operand = sympy.Symbol("operand_bytes", integer=True, positive=True)
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
        formula("forward_grid", sympy.Tuple(forward_programs), grid_params,
                 f"Programs of the forward: one per {grid_doc}."),
        formula("smem_bytes", (num_stages * BLOCK_L + BLOCK_Q) * BLOCK_K * operand,
                 ("BLOCK_Q", "BLOCK_L", "BLOCK_K", "num_stages", "operand_bytes"),
                 "Shared memory of the forward: pipelined doc tiles plus the query tile "
                 "(operand_bytes per element: the registry binds the variant's)."),
    ]  # fmt: skip
    if variant.backward is Backward.UNIFIED:
        blocks = sympy.ceiling(docs / BLOCK_N) if docs != 1 else sympy.Integer(1)
        params = pair_params + (("BLOCK_N",) if docs != 1 else ())
        formulas.append(
            formula(
                "unified_grid",
                sympy.Tuple(queries * blocks),
                params,
                "Programs of the unified backward: (query, block of docs).",
            )
        )
        if variant.normalize:
            formulas.append(
                formula(
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
        return formula(
            "lowmem_d_grid",
            sympy.Tuple(sympy.ceiling(total_d / BLOCK_L) + Nd),
            ("Nd", "total_d", "BLOCK_L"),
            "Programs of grad_D: one per (doc, block of its tokens), and a few to spare.",
        )
    params = tuple(sorted(str(s) for s in doc_count.free_symbols)) + ("Ld", "BLOCK_L")
    return formula(
        "lowmem_d_grid",
        sympy.Tuple(doc_count * sympy.ceiling(Ld / BLOCK_L)),
        params,
        "Programs of grad_D: one per (doc, block of doc tokens).",
    )


def _lowmem_q_grid(variant: Variant, queries: sympy.Expr) -> Formula:
    """grad_Q's grid: the argmax backward splits each query's tokens over programs (rows
    are gathered, each on its own); the recompute backward multiplies whole query tiles."""
    if variant.score is Score.MAX:
        return formula(
            "lowmem_q_grid",
            sympy.Tuple(queries * sympy.ceiling(Lq / GRAD_Q_TOKENS)),
            (str(queries), "Lq", "GRAD_Q_TOKENS"),
            "Programs of grad_Q: one per (query, block of query tokens), owning its rows.",
        )
    return formula(
        "lowmem_q_grid",
        sympy.Tuple(queries),
        (str(queries),),
        "Programs of grad_Q: one per query, owning its rows.",
    )


def _grid_call_params(
    formulas: tuple[Formula, ...], name: str, blocks: dict[str, str]
) -> tuple[str, ...]:
    """The launcher's arguments for a grid formula: sizes by name, tiles from the config."""
    for candidate in formulas:
        if candidate.name == name:
            return tuple(blocks.get(p, p) for p in candidate.params)
    return ()


def _purpose(variant: Variant) -> str:
    if variant.decompression is not Decompression.NONE:
        return "forward over PLAID residual-compressed documents"
    if variant.op is Op.TOPK:
        return "top-k candidates (retrieval)"
    if variant.backward is Backward.NONE:
        return "forward"
    return f"training ({variant.backward.value} backward)"


def plan_triton(kernel: Kernel) -> RenderContext:
    """The render context of a Triton MaxSim or top-k kernel. It is planned for the
    kernel's widest variant (Kernel.widest): argument lists hold every input any value
    needs, and the kernels branch on the values as constexprs."""
    variant = kernel.widest()
    if variant.target not in MODULE_TEMPLATE:
        raise PlanError(f"{variant.name}: target {variant.target.value!r} has no templates yet")
    if variant.decompression not in DOC_SOURCES:
        raise PlanError(
            f"{kernel.name}: decompression {variant.decompression.value!r} has no "
            "load_doc_tile hook yet"
        )
    fp8_problem = plan_fp8.unsupported(variant)
    if fp8_problem is not None:
        raise PlanError(f"{variant.name}: {fp8_problem}")
    if variant.layout not in LAYOUT_SHAPES:
        raise PlanError(f"{variant.name}: layout {variant.layout.value!r} has no template yet")
    shape = LAYOUT_SHAPES[variant.layout]
    hooked = variant.score is not Score.MAX
    if hooked and variant.layout not in HOOKED_LAYOUTS:
        raise PlanError(f"{variant.name}: the score hook has no {variant.layout.value} template")
    if variant.backward is Backward.LOWMEM and variant.layout not in KERNEL_SIZES["bwd_q"]:
        layout = variant.layout.value
        raise PlanError(f"{variant.name}: the lowmem backward has no {layout} template")
    docs = DOC_SOURCES[variant.decompression](kernel)
    args = kernel_args(variant, docs)
    routed = routes_grad_d(variant)
    formulas = _formulas(variant)
    blocks = {"BLOCK_N": "config.block_n", "BLOCK_L": "config.block_l",
              "QUERY_GROUP": "config.query_group",
              "DOCS_PER_PROGRAM": "config.docs_per_program",
              "DOC_SPLITS": "config.doc_splits"}  # fmt: skip
    # Tensors the runtime hands to launch() and backward() by keyword, after Q and D.
    ragged = shape["ragged"]
    if ragged:
        blocks.update(RAGGED_SIZE_EXPR)
    launcher_args = ["Q", *docs.launcher, *ragged]
    if plan_fp8.is_scaled(variant):
        launcher_args += [expr for _, expr, _, _ in plan_fp8.SCALE_TENSORS]
    keywords = ("max_seqlen_q",) if ragged else ()
    if variant.op is Op.TOPK:
        keywords = ("cand_docs",)
    backward = variant.backward
    score = score_plan(variant)
    keywords += score.keywords
    backward_args = ("Q", "D", *ragged)
    backward_template = BACKWARD_TEMPLATE.get(backward, NO_TEMPLATE)
    backward_launch_template = BACKWARD_LAUNCH_TEMPLATE.get(backward, NO_TEMPLATE)
    bwd_sizes = {k: KERNEL_SIZES[k] for k in ("bwd_q", "bwd_d")}
    if score.weighted:
        launcher_args.insert(2, "W")
    # Inputs a call may lack come last, None by default (the kernels specialize on it).
    optional = tuple(name for name, has in (("q_mask", variant.mask.has_q),
                                            ("d_mask", variant.mask.has_d)) if has)  # fmt: skip
    launcher_args += [f"{name}=None" for name in optional]
    if hooked:
        backward_args = tuple(launcher_args)
        backward_template, backward_launch_template = RECOMPUTE_TEMPLATE, RECOMPUTE_LAUNCH_TEMPLATE
        bwd_sizes = RECOMPUTE_SIZES
    return RenderContext(
        name=kernel.name,
        purpose=_purpose(variant),
        topk=variant.op is Op.TOPK,
        layout=variant.layout.value,
        takes_q_mask=variant.mask.has_q,
        takes_d_mask=variant.mask.has_d,
        backward=backward.value,
        save_argmax=backward is not Backward.NONE and not hooked,
        size_exprs=layout_sizes(variant.layout, docs.shape_of) + docs.sizes,
        dot_dtype_of=docs.dot_dtype_of,
        optional_inputs=optional,
        launcher_args=tuple(launcher_args),
        launcher_keywords=keywords,
        backward_args=backward_args,
        fwd_args=args["fwd"],
        bwd_args=args["bwd"] if backward is Backward.UNIFIED else (),
        bwd_q_args=args["bwd_q"] if backward is Backward.LOWMEM else (),
        bwd_d_args=args["bwd_d"] if backward is Backward.LOWMEM else (),
        fwd_dynamic=(
            ("Nq", "Nd", "Lq", "Ld")
            if variant.op is Op.TOPK or streams_docs(variant)
            else KERNEL_SIZES["fwd"][variant.layout]
        )
        + tuple(a.name for a in docs.sizes),
        bwd_dynamic=KERNEL_SIZES["bwd"][variant.layout],
        bwd_q_dynamic=bwd_sizes["bwd_q"].get(variant.layout, ()),
        bwd_d_dynamic=bwd_sizes["bwd_d"].get(variant.layout, ()),
        grid_params=_grid_call_params(formulas, "forward_grid", blocks),
        unified_grid_params=_grid_call_params(formulas, "unified_grid", blocks),
        unified_block_n="config.block_n" if shape["docs"] != 1 else "1",
        lowmem_q_grid_params=_grid_call_params(formulas, "lowmem_q_grid", blocks),
        lowmem_d_grid_params=_grid_call_params(formulas, "lowmem_d_grid", blocks),
        formulas=formulas,
        doc=docs,
        module_template=MODULE_TEMPLATE[variant.target],
        launch_template=LAUNCH_TEMPLATE[variant.target],
        backward_template=backward_template,
        backward_launch_template=backward_launch_template,
        output_doc=shape["output"],
        argmax_doc=shape["argmax"],
        score=score,
        scaled=plan_fp8.is_scaled(variant),
        doc_stream=streams_docs(variant),
        even_ld="Ld % config.block_l == 0" if has_even_tiles(variant) else "False",
        peels_tail=peels_tail(variant),
        routed_grad_d=routed,
        bwd_route_args=args["bwd_route"] if routed else (),
        bwd_route_dynamic=KERNEL_SIZES["bwd_route"][variant.layout] if routed else (),
        takes_zero_mask=kernel.takes_zero_mask,
    )
