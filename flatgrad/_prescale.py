"""Prescaling: inside a `replicate` backward that averages by a sum (gloo, a power-of-two
world size, no wire dtype), the routed layers write their weight gradients already divided
by the world size, so that the buckets need not divide those slots afterwards. Dividing by a
power of two is exact, so the result is the divided-then-summed one to the bit (but for
subnormals). Only routed parameters' slots without post-accumulate-grad hooks are written so;
which writers scale and which leave a slot to the bucket's division: docs/design.md,
"replicate's buckets".

The state lives on the store (`flatgrad._buffer.Prescale`, which the layer backwards find
through `find_slot`); the factor is chosen and the rest of a bucket divided where the
buckets are (`flatgrad._bucket_sync.prescale_factor`, `divide_unscaled`)."""

from __future__ import annotations

from typing import Any

import torch

from flatgrad._buffer import Prescale, find_slot


def write_scale(param: torch.Tensor, mode: str) -> float:
    """The factor a routed layer writes `param`'s gradient with in mode "out" or "add" (see
    `flatgrad._functional.weight_target`): 1 but inside such a backward; "out" notes the slot, "add" scales
    only into a slot so noted."""
    found = find_slot(param)
    state = found[0].prescale if found is not None else None
    if state is None or state.factor is None:
        return 1.0
    if mode == "out":
        # Not where nothing would scale a gradient arriving through plain autograd, nor where
        # a post-accumulate-grad hook must see the local gradient (as under DDP).
        if id(param) not in state.hooked or param._post_accumulate_grad_hooks:
            return 1.0
        state.written.add(id(param))
        return state.factor
    return state.factor if id(param) in state.written else 1.0


def scale_incoming(state: Prescale, param: torch.Tensor, grads: tuple[torch.Tensor | None, ...]) -> Any:
    """AccumulateGrad pre hook of a routed parameter: scale what plain autograd brings into
    a slot its layer wrote scaled in this backward."""
    grad, factor = grads[0], state.factor
    if grad is None or factor is None or id(param) not in state.written:
        return None
    return (grad * factor,)
