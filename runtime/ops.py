"""Op families as torch.library custom ops: one mechanism for every entry's kernels.

An op family is a forward `(inputs, params) -> (outputs, saved)`, a fake forward that
gives their shapes and dtypes, and, where the family trains, a backward. `Family`
registers `lik::<name>_forward` and `lik::<name>_backward`, with fake implementations and
the autograd formula, so that under torch.compile each call is one opaque node of known
shapes (no graph break) that CUDA graphs capture. Eager calls skip the custom-op
dispatcher, which costs ~150 us of host time per call (more than a whole rerank kernel):
they run the same forward and backward through a plain torch.autograd.Function, or the
forward alone when nothing needs a gradient.

Conventions:
- inputs: a tuple of tensors (None where a call lacks one); the first `slots` of them
  may take a gradient (at most MAX_SLOTS), the rest never do.
- params: a frozen dataclass (the family's `params` class) of the call's plain values
  (ints, floats, bools, strings, None); the custom ops take it as a string (_key).
- outputs: the `outputs` tensors the entry returns, then `saved`: what the backward needs
  (tensors, never None on a call that trains).
- backward(grads, inputs, saved, params, needs) -> one gradient per slot, None where
  `needs` is False; a gradient in another dtype than its input is cast to it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import operator
from collections.abc import Callable, Sequence
from typing import Optional

import torch
from torch import Tensor

MAX_SLOTS = 4  # the fused head's Q, H_d, W and b
_PARAM_TYPES: dict[str, type] = {}  # each family's params class, by name


def _key(params) -> str:
    """params as the custom ops take them: its class name and field values, a string that
    _params parses back (built without dataclasses' repr, which torch.compile cannot
    trace, and without a side effect, which a traced call would defer)."""
    values = tuple(_plain(getattr(params, name)) for name in params.__dataclass_fields__)
    return type(params).__name__ + repr(values)


def _plain(value):
    """A value as _key writes it: an int that torch.compile made symbolic (an argument
    that changed between calls) specializes back to its value, one graph per value."""
    if isinstance(value, int) and not isinstance(value, bool):
        return operator.index(value)  # dynamo traces this, not int() or repr, of a SymInt
    return value


@functools.lru_cache(maxsize=1024)
def _params(key: str):
    name, _, values = key.partition("(")
    return _PARAM_TYPES[name](*ast.literal_eval("(" + values))


def _slots(inputs: Sequence, count: int) -> list:
    return list(inputs[:count]) + [None] * (MAX_SLOTS - count)


@dataclasses.dataclass(eq=False)
class Family:
    """One op family; calling it runs a call through the path its context needs."""

    name: str
    params: type
    forward: Callable
    fake: Callable
    backward: Callable | None = None
    slots: int = 0
    outputs: int = 1

    def __post_init__(self):
        _PARAM_TYPES[self.params.__name__] = self.params
        self._forward_op = self._register_forward()
        if self.backward is not None:
            self._backward_op = self._register_backward()
            self._forward_op.register_autograd(self._op_backward, setup_context=self._setup)

    def __call__(self, inputs: tuple, params, *, training: bool = False):
        """The family's outputs (one tensor when `outputs` is 1)."""
        if torch.compiler.is_compiling():
            values = self._forward_op(*_slots(inputs, self.slots), list(inputs[self.slots:]),
                                      _key(params))  # fmt: skip
            outputs = tuple(values[: self.outputs])
        elif training:
            outputs = _Autograd.apply(self, params, *inputs)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        else:
            outputs = self.forward(inputs, params)[0]
        return outputs[0] if self.outputs == 1 else outputs

    # -- the custom ops -------------------------------------------------------------

    def _inputs(self, slots, rest) -> tuple:
        return (*slots[: self.slots], *rest)

    def _register_forward(self):
        family = self

        @torch.library.custom_op(f"lik::{self.name}_forward", mutates_args=())
        def forward_op(
            slot0: Optional[Tensor],  # noqa: UP007 (the schema needs Optional)
            slot1: Optional[Tensor],  # noqa: UP007 (the schema needs Optional)
            slot2: Optional[Tensor],  # noqa: UP007 (the schema needs Optional)
            slot3: Optional[Tensor],  # noqa: UP007 (the schema needs Optional)
            rest: Sequence[Optional[Tensor]],  # noqa: UP007
            params: str,
        ) -> list[Tensor]:
            inputs = family._inputs((slot0, slot1, slot2, slot3), rest)
            outputs, saved = family.forward(inputs, _params(params))
            return [*outputs, *_present(saved, inputs)]

        @forward_op.register_fake
        def _(slot0, slot1, slot2, slot3, rest, params):
            inputs = family._inputs((slot0, slot1, slot2, slot3), rest)
            outputs, saved = family.fake(inputs, _params(params))
            return [*outputs, *_present(saved, inputs)]

        return forward_op

    def _register_backward(self):
        family = self

        @torch.library.custom_op(f"lik::{self.name}_backward", mutates_args=())
        def backward_op(
            grads: Sequence[Tensor],
            inputs: Sequence[Optional[Tensor]],  # noqa: UP007
            saved: Sequence[Tensor],
            params: str,
            needs: Sequence[bool],
        ) -> list[Tensor]:
            slot_grads = family.backward(tuple(grads), tuple(inputs), tuple(saved),
                                         _params(params), tuple(needs))  # fmt: skip
            return [g.to(inputs[i].dtype) for i, g in enumerate(slot_grads) if needs[i]]

        @backward_op.register_fake
        def _(grads, inputs, saved, params, needs):
            return [torch.empty_like(inputs[i]) for i in range(len(needs)) if needs[i]]

        return backward_op

    def _setup(self, ctx, inputs, output):
        *slots, rest, key = inputs
        ctx.key, ctx.rest = key, len(rest)
        # Autograd matches the gradients' structure to the inputs': `rest` is a list when
        # it holds tensors only, else a single leaf.
        ctx.rest_grad = [None] * len(rest) if all(t is not None for t in rest) else None
        ctx.scores = [(o.shape, o.dtype, o.device) for o in output[: self.outputs]]
        ctx.save_for_backward(*slots[: self.slots], *rest, *output[self.outputs :])

    def _op_backward(self, ctx, grads):
        tensors = ctx.saved_tensors
        count = self.slots + ctx.rest
        inputs, saved = tensors[:count], tensors[count:]
        needs = [bool(n) for n in ctx.needs_input_grad[: self.slots]]
        grads = [torch.zeros(shape, dtype=dtype, device=device) if g is None else g
                 for g, (shape, dtype, device) in zip(grads, ctx.scores, strict=False)]  # fmt: skip
        computed = iter(self._backward_op(grads, list(inputs), list(saved), ctx.key, needs))
        slot_grads = [next(computed) if need else None for need in needs]
        return (*slot_grads, *[None] * (MAX_SLOTS - self.slots), ctx.rest_grad, None)


def _present(saved: tuple, inputs: tuple) -> list[Tensor]:
    """Saved tensors as the custom op returns them: an absent one (a call that does not
    train) as an empty tensor."""
    device = next(t.device for t in inputs if t is not None)
    return [torch.empty(0, device=device) if t is None else t for t in saved]


class _Autograd(torch.autograd.Function):
    """Eager training calls: a family's forward and backward without the dispatcher."""

    @staticmethod
    def forward(ctx, family, params, *inputs):
        outputs, saved = family.forward(inputs, params)
        ctx.family, ctx.params, ctx.count = family, params, len(inputs)
        ctx.save_for_backward(*inputs, *saved)
        return outputs[0] if family.outputs == 1 else tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        family = ctx.family
        tensors = ctx.saved_tensors
        inputs, saved = tensors[: ctx.count], tensors[ctx.count :]
        needs = tuple(ctx.needs_input_grad[2 : 2 + family.slots])
        slot_grads = family.backward(grads, inputs, saved, ctx.params, needs)
        rest = ctx.count - family.slots
        return (None, None, *slot_grads, *[None] * rest)
