"""`FlatGrad`'s operations on the gradients its engine holds: zeroing, main grads, norms,
clipping and the all-reduce without DDP.

Each function takes the wrapper's `GradEngine` (``flat._engine``) and first takes its store
from `GradEngine.refresh`, which lays the buffers out again if the model changed, as stock's
``clip_grad_norm_(model.parameters())`` walks the model (`zero_grad` setting None: from
`GradEngine.current`, O(1)). The norm arithmetic is
`flatgrad._norms`', the collectives are `flatgrad.comm`'s.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from flatgrad import _norms, comm
from flatgrad._engine import GradEngine
from flatgrad._scattered import is_scattered, refuse_scattered, scattered_main_grad, unmark_scattered
from flatgrad.buffer import GradStore, scale_
from flatgrad.layout import GroupKey


def settled_buffers(engine: GradEngine) -> dict[GroupKey, torch.Tensor]:
    """The flat buffers as the truth (`GradStore.settle`), by (dtype, device)."""
    store = engine.refresh()
    store.settle()
    return dict(store.buffers)


def zero_grad(engine: GradEngine, set_to_none: bool) -> None:
    """`FlatGrad.zero_grad`: every `.grad` of the model None, or zeroed with one fill per
    buffer; main grads zeroed either way. Setting None needs no walk over the model (it runs
    every step): whatever `GradEngine.current` does not see (a held parameter frozen or
    converted in place) still has its `.grad` set to None, and is found by the next norm,
    sync or backward."""
    store = engine.current() if set_to_none else engine.refresh()
    unmark_scattered(store, to_none=set_to_none)  # (zeroed: right on every rank again)
    if set_to_none:
        for param in store.params + engine.others:
            param.grad = None
        store.zero_mains()  # a main grad is the gradient itself: zeroed either way
        return
    for param in store.params:  # (a ScatteredGrad, or a `.grad` outside its slot)
        if param.grad is not None and param.grad is not store.view(param):
            param.grad = None if store.is_main(param) else store.view(param)
    for buffer in store.buffers.values():
        buffer.zero_()
    for param in engine.others:
        _zero_stock(param)


def _zero_stock(param: nn.Parameter) -> None:
    """What `nn.Module.zero_grad(set_to_none=False)` does to one parameter."""
    grad = param.grad
    if grad is None:
        return
    if grad.grad_fn is not None:
        grad.detach_()
    else:
        grad.requires_grad_(False)
    grad.zero_()


def main_grad(engine: GradEngine, param: torch.Tensor) -> torch.Tensor:
    """`FlatGrad.main_grad`: `param`'s slot (its ScatteredGrad while reduce-scattered)."""
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"param must be a parameter of the wrapped model, got {type(param).__name__}")
    store = engine.refresh()
    if param not in store:
        raise ValueError(
            f"param must be a trainable parameter of the wrapped model with a gradient slot, "
            f"got a tensor of shape {tuple(param.shape)} that has none (frozen, sparse, "
            "another model's, or not a parameter)"
        )
    store.take_in([param], zero_empty=True)  # the buffer as the truth, as `settle` makes it
    if is_scattered(store):  # (a ShardedOptimizer's backward: averaged in its shards only)
        return scattered_main_grad(store, param)
    return store.view(param)


def grad_norm(engine: GradEngine, norm_type: float) -> torch.Tensor:
    """`FlatGrad.grad_norm`: the total norm of every gradient, in float64 chunks."""
    norm_type = _check_norm_type(norm_type)
    refuse_scattered(engine.store, "flat.grad_norm()")
    _, _, norms, dtype = _grads_and_norms(engine, norm_type)
    return _norms.total_norm(norms, norm_type, dtype)


def clip_grad_norm_(
    engine: GradEngine, max_norm: float, norm_type: float, error_if_nonfinite: bool
) -> torch.Tensor:
    """`FlatGrad.clip_grad_norm_`: scale the runs and the gradients outside the buffers in
    place by ``min(1, max_norm / (total + 1e-6))``; the total norm before clipping."""
    norm_type = _check_norm_type(norm_type)
    refuse_scattered(engine.store, "flat.clip_grad_norm_()")
    store, others, norms, dtype = _grads_and_norms(engine, norm_type)
    total = _norms.total_norm(norms, norm_type, dtype)
    if not norms:
        return total
    if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite, so it "
            "cannot be clipped; pass error_if_nonfinite=False to clip anyway"
        )
    scale_(store.runs + others, torch.clamp(float(max_norm) / (total + 1e-6), max=1.0))
    return total


def _grads_and_norms(
    engine: GradEngine, norm_type: float
) -> tuple[GradStore, list[torch.Tensor], list[torch.Tensor], torch.dtype]:
    """(store, gradients outside it, per-piece float64 norms, the total's dtype)."""
    store = engine.refresh()
    store.settle()
    others = [p.grad for p in engine.others if p.grad is not None]
    return (store, others, *_norms.piece_norms(store, others, norm_type))


def _check_norm_type(norm_type: float) -> float:
    norm_type = float(norm_type)
    if math.isnan(norm_type):
        raise ValueError(f"norm_type must be a number or +-inf, got {norm_type}")
    return norm_type


def all_reduce_grads(engine: GradEngine, process_group: Any, wire_dtype: torch.dtype | None) -> None:
    """`FlatGrad.all_reduce_grads`: `comm.all_reduce_grads` over the refreshed store, which
    must hold every trainable parameter (no sparse embedding)."""
    store = engine.refresh()
    engine.refuse_sparse("all_reduce_grads")
    comm.all_reduce_grads(store, process_group, wire_dtype)
