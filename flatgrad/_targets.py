"""Where a weight's gradient goes in one backward: the decision every Function in
`flatgrad.functional` makes per weight before it computes anything.

A weight's gradient goes, by mode:

- ``"out"``:   `.grad` is None: compute into a fresh view of the slot with ``out=``, make
  that view the `.grad`, and return None.
- ``"add"``:   `.grad` already is the slot: accumulate in place and return None.
- ``"fresh"``: plain out-of-place autograd: `torch.autograd.grad` captures this weight,
  ``create_graph=True`` needs a differentiable result, the weight has tensor hooks that
  must see its gradient, or it has no slot.
- ``"skip"``:  no gradient is wanted for the weight in this backward.
- ``"main"``:  the slot is the weight's float32 main grad (a bfloat16/float16 weight with
  ``grad_dtype="float32"``): accumulate into it in float32, leave `.grad` None, return None.

Why "out" sets `.grad` instead of returning the view for AccumulateGrad to steal: a weight
used more than once in a backward (tied embedding and LM head, or a layer called twice)
reaches AccumulateGrad once, after autograd summed all its contributions. A returned view
may be summed out of place with another contribution before a later writer adds into the
slot, and that later addition would be lost. Once `.grad` is the slot every later writer
adds into it, and AccumulateGrad adds any other (unrouted) contribution into it in place.
Returning None still runs AccumulateGrad's post hooks (DDP's reducer hooks).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from flatgrad._torch_compat import will_execute
from flatgrad.buffer import REGISTRY

Mode = Literal["skip", "fresh", "out", "add", "main"]
# Compiled autograd traces a Function's backward with Dynamo (no graph or `.grad` to look
# at): the gradient is returned to the traced AccumulateGrad, as for stock.
TRACED: tuple[Mode, None, None] = ("fresh", None, None)


def weight_target(
    ctx: Any, index: int, next_functions: Any = None
) -> tuple[Mode, torch.Tensor | None, torch.Tensor | None]:
    """Where the gradient of input `index` goes in this backward: (mode, slot, parameter).

    The parameter is taken from the graph (its AccumulateGrad node), not from saved
    tensors, which checkpointing and saved-tensor hooks hand back as other objects.
    `next_functions` may be passed by a caller that needs several inputs (it costs a
    tuple of node objects per access).
    """
    if not ctx.needs_input_grad[index]:
        return "skip", None, None
    if torch.compiler.is_compiling():
        return TRACED
    return node_target((next_functions or ctx.next_functions)[index][0])


def node_target(node: Any) -> tuple[Mode, torch.Tensor | None, torch.Tensor | None]:
    """`weight_target` for an input known to need a gradient, given its graph node."""
    param = getattr(node, "variable", None)  # None unless the input is a leaf (AccumulateGrad)
    found = REGISTRY.find(param) if param is not None else None
    if found is None or torch.is_grad_enabled():
        return "fresh", None, param
    if not param.requires_grad:  # type: ignore[union-attr]
        return "skip", None, param  # frozen since the forward: AccumulateGrad skips it too
    try:
        if not will_execute(node):
            return "skip", None, param  # backward(inputs=...) without this weight
    except RuntimeError:
        return "fresh", None, param  # torch.autograd.grad captures this leaf: leave .grad alone
    store, view = found
    if view.dtype != param.dtype or view.shape != param.shape:  # type: ignore[union-attr]
        if view.shape == param.shape and store.is_main(param):  # type: ignore[union-attr,arg-type]
            # A main grad: hooked gradients are returned, and AccumulateGrad's hook adds them in.
            return ("fresh", None, param) if param._backward_hooks else ("main", view, param)  # type: ignore[union-attr]
        store.stale = True  # param.data replaced or converted behind the wrapper: lay out again
        return "fresh", None, param
    grad = param.grad  # type: ignore[union-attr]
    if param._backward_hooks:  # type: ignore[union-attr]
        # Tensor hooks must see the gradient: return it, and let AccumulateGrad add the
        # hooked result into the slot (seated here when empty).
        if grad is None:
            param.grad = view.zero_()  # type: ignore[union-attr]
        return "fresh", None, param
    if grad is None:
        return "out", view, param
    if grad is view:
        return "add", view, param
    return ("add", grad, param) if store.holds(param, grad) else ("fresh", None, param)  # type: ignore[arg-type]
