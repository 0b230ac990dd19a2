"""lik-gen: the compiler that turns MaxSim variant specs into committed kernel sources.

Data flows one way: spec file -> Variant IR -> RenderContext (plan) -> text (render)
-> generated/ (write / check).
"""

from lik_gen.ir import Variant

__all__ = ["Variant"]
