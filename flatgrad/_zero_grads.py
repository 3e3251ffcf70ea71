"""The collectives over a ShardedOptimizer's gradient shards (see `flatgrad.sharded`), as
free functions over this rank's shard tensors: the clip to a global norm and a loss
scaler's unscale with its inf check. Every element's average lives in exactly one rank's
shard, so one scalar all-reduce over the shards' results covers every gradient."""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from flatgrad import _norms
from flatgrad._torch_compat import non_finite_check_and_unscale


def clip_shards(
    grads: list[torch.Tensor], max_norm: float, norm_type: float, process_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Scale `grads` (every rank's shards together) to a global norm of at most `max_norm`;
    returns the global norm before, in at least float32 (one scalar all-reduce)."""
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
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coef.to(grad.dtype))
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
