"""The collectives over a ShardedOptimizer's gradient shards (see `flatgrad.sharded`), as
free functions over this rank's shard tensors: the clip to a global norm and a loss
scaler's unscale with its inf check. Every element's average lives in exactly one rank's
shard, so one scalar all-reduce over the shards' results covers every gradient."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from flatgrad import _norms
from flatgrad._torch_compat import non_finite_check_and_unscale
from flatgrad.buffer import GradStore, scale_
from flatgrad.layout import GroupKey


def runs_in_shards(store: GradStore, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The gradient elements inside `shards` (this rank's gradient shards, views of the
    store's buffers) without the alignment padding between slots: `GradStore.runs` cut at
    the shards' edges. What a scale may touch: padding is zero by construction and nothing
    zeroes it again, so a NaN clip coefficient multiplied into it would stay in every later
    norm."""

    def span(view: torch.Tensor) -> tuple[GroupKey, int, int]:  # (buffer, [start, end))
        key = (view.dtype, view.device)
        start = int(view.storage_offset() - store.buffers[key].storage_offset())
        return key, start, start + view.numel()

    edges = [span(shard) for shard in shards]
    runs = []
    for run in store.runs:
        key, first, end = span(run)
        for shard_key, lo, hi in edges:
            a, b = max(first, lo), min(end, hi)
            if shard_key == key and a < b:
                runs.append(store.buffers[key].narrow(0, a, b - a))
    return runs


def clip_shards(
    grads: list[torch.Tensor],
    max_norm: float,
    norm_type: float,
    process_group: dist.ProcessGroup | None,
    runs: Sequence[torch.Tensor],
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Scale the gradients of `grads` (every rank's shards together) to a global norm of at
    most `max_norm`, multiplying only their `runs` (`runs_in_shards`); returns the global
    norm before, in at least float32 (one scalar all-reduce). With `error_if_nonfinite` a
    NaN or infinite global norm raises instead, on every rank alike (they share the norm)."""
    device = grads[0].device
    # float64 partial norms, accumulated in chunks (see flatgrad._norms)
    norms = torch.stack([_norms.vector_norm(g, norm_type).to(device) for g in grads])
    if math.isinf(norm_type):
        total = norms.max()
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=process_group)
    else:
        total = norms.pow(norm_type).sum()
        dist.all_reduce(total, group=process_group)
        total = total.pow(1.0 / norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite, so it "
            "cannot be clipped; pass error_if_nonfinite=False to clip anyway"
        )
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for run in runs:
        by_dtype.setdefault(run.dtype, []).append(run)
    for dtype, same in by_dtype.items():
        scale_(same, coef.to(dtype))  # (the coefficient in each gradient's dtype, as before)
    dtype = functools.reduce(torch.promote_types, [_norms.norm_dtype(g.dtype) for g in grads])
    return total.to(dtype)


def unscale_shards(
    shards: list[torch.Tensor],
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor | None,
    allow_fp16: bool,
    process_group: dist.ProcessGroup | None,
) -> None:
    """Multiply `shards` by `inv_scale` (a loss scaler's 1/scale); with `found_inf`, set it
    to 1.0 where any rank's shard holds an inf or NaN (one scalar all-reduce, so every rank
    skips the same steps)."""
    grads: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in shards:
        grads.setdefault(grad.dtype, []).append(grad)
    if torch.float16 in grads and not allow_fp16:
        raise ValueError(
            "Attempting to unscale FP16 gradients (float16 parameters without main grads): "
            "wrap the model with grad_dtype='float32', whose float32 main grads a loss "
            "scaler can unscale"
        )
    device = shards[0].device
    found = None if found_inf is None else found_inf.to(device)
    inv = inv_scale.to(device)
    with torch.no_grad():
        for same in grads.values():
            if found is None:
                torch._foreach_mul_(same, inv)
            else:
                non_finite_check_and_unscale(same, found, inv)
    if found is not None:  # (so is found_inf)
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=process_group)
        found_inf.copy_(found)  # type: ignore[union-attr]
