"""Kernel -> render context: picks the planner of a structural kernel.

Each planner composes its context from the shared parts in lik_gen.plan_base (layout
shapes, argument lists, formulas) and its own feature parts (doc source, score,
backward); none calls another planner and rewrites its output.
"""

from __future__ import annotations

from lik_gen.ir import Kernel, Op, Target
from lik_gen.plan_base import PlanError
from lik_gen.plan_head import plan_head
from lik_gen.plan_metal import plan_metal
from lik_gen.plan_triton import plan_triton

__all__ = ["PlanError", "plan"]


def plan(kernel: Kernel):
    """The render context of a structural kernel (every value it serves is a constexpr)."""
    if kernel.op is Op.HEAD:
        return plan_head(kernel)
    if kernel.target is Target.METAL:
        return plan_metal(kernel)
    if kernel.target is Target.TRITON:
        return plan_triton(kernel)
    raise PlanError(f"{kernel.name}: target {kernel.target.value!r} has no templates yet")
