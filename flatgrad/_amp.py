"""`GradScaler`: torch's dynamic loss scaling for a `ShardedOptimizer` (float16 training).

``torch.amp.GradScaler`` unscales and checks every `.grad` of the optimizer's parameters. Under a
ShardedOptimizer a `.grad` holds the average over the ranks only inside this rank's shards (and a main grad's
parameter has no `.grad` at all), so its checks would read the wrong values, or none. This subclass reads the
gradient shards instead and agrees on the inf check over the ranks (one scalar all-reduce, as FSDP's
``ShardedGradScaler`` does), so an overflow on any rank skips the step on every rank and backs the scale off
alike. For every other optimizer it is torch's scaler, unchanged."""

from __future__ import annotations

import torch

from flatgrad._sharded import ShardedOptimizer
from flatgrad._torch_compat import GradScalerBase


class GradScaler(GradScalerBase):
    """``torch.amp.GradScaler`` (same arguments, same calls: ``scaler.scale(loss).backward()``,
    ``scaler.unscale_(opt)``, ``scaler.step(opt)``, ``scaler.update()``) that also serves a
    `ShardedOptimizer`: it unscales that optimizer's gradient shards and sets the inf flag from every rank's
    (each rank must call ``unscale_``/``step`` together, as it calls ``step``)."""

    def unscale_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor] | None:
        """A ShardedOptimizer's gradient shards, unscaled and checked over every rank; None
        (torch's own walk) for any other optimizer.

        Args:
            optimizer: The optimizer `unscale_` or `step` was given.
            inv_scale: One over the current scale (a 1-element float32 tensor).
            found_inf: Set to 1 where a gradient is not finite on some rank.
            allow_fp16: Whether float16 gradients may be unscaled (torch's argument).

        Returns:
            ``{device: found_inf}`` for a ShardedOptimizer; None for any other optimizer.
        """
        if not isinstance(optimizer, ShardedOptimizer):
            return None
        optimizer.unscale_shards_(inv_scale, found_inf, allow_fp16)
        return {found_inf.device: found_inf}
