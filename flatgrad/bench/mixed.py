"""The mixed-precision row: one LM trained on the ranks three ways, each step
`MICRO_BATCHES` forward-backward micro-batches (no gradient sync on all but the last),
gradient clipping and an AdamW step:

- ``ddp_autocast``: stock DDP (``gradient_as_bucket_view=True``) over float32 parameters,
  forward under ``torch.autocast(device_type, dtype=torch.bfloat16)``;
- ``ddp_bf16``: stock DDP over bfloat16 parameters, torch's AdamW on them (bfloat16
  gradients and moments);
- ``flatgrad_main_grads``: bfloat16 parameters, ``FlatGrad(..., grad_dtype="float32")``
  under `flatgrad.DataParallel`, `flatgrad.ShardedOptimizer` stepping float32 masters of
  this rank's shards.

Each variant trains its own copy of one model on the same batches; steps are interleaved
(who goes first rotates) and timed as in `flatgrad.bench.suite` (`flatgrad.bench.timing`).
Memory is counted per rank after a step (before the next one zeroes the gradients): the
distinct storages behind the parameters, the gradients (`.grad`, views of DDP's buckets
here; flatgrad's gradient buffers, which hold the main grads), a ShardedOptimizer's float32
masters and the optimizer state, each storage once.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import flatgrad
from flatgrad._flatgrad import settled_buffers
from flatgrad.bench.counters import storage_bytes
from flatgrad.bench.models import Batch, BenchModel
from flatgrad.bench.timing import max_over_ranks, rank_records, rank_timer, rotate

MIXED_VARIANTS = ("ddp_autocast", "ddp_bf16", "flatgrad_main_grads")
MICRO_BATCHES = 4
MAX_NORM = 1.0
LR, WEIGHT_DECAY = 1e-3, 0.1  # AdamW's, for every variant
# What each variant's per-rank memory is made of (`MixedRunner.held_bytes`), in the order a
# storage met twice is counted (once, in the first).
ROLES = ("params", "grads", "masters", "optimizer_state")
BASES = {"ddp_autocast": "ratio_to_ddp_autocast", "ddp_bf16": "ratio_to_ddp_bf16"}


@dataclass
class MixedRunner:
    """One variant: `module` runs the micro-batches, `no_sync` keeps all but the last from
    synchronising, `clip` clips the averaged gradients, `optimizer` steps."""

    name: str
    module: nn.Module
    optimizer: torch.optim.Optimizer
    no_sync: Callable[[], contextlib.AbstractContextManager[Any]]
    clip: Callable[[], object]
    autocast: bool
    dtype: torch.dtype  # of the parameters: floating inputs are cast to it

    def step(self, micro_batches: list[Batch]) -> torch.Tensor:
        """One training step; returns the step's loss (the mean over its micro-batches)."""
        self.optimizer.zero_grad()  # set_to_none=True, torch's default, for every variant
        losses = []
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            inputs = [t.to(self.dtype) if t.is_floating_point() else t for t in batch]
            with contextlib.nullcontext() if last else self.no_sync():  # (forward and backward)
                with torch.autocast(inputs[0].device.type, dtype=torch.bfloat16, enabled=self.autocast):
                    loss = self.module(*inputs) / len(micro_batches)
                loss.backward()
            losses.append(loss.detach().float())
        self.clip()
        self.optimizer.step()
        return torch.stack(losses).sum()

    def held_bytes(self) -> dict[str, int]:
        """Bytes this rank holds per role of `ROLES` (see the module docstring)."""
        params = list(self.module.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        # flatgrad's gradient buffers: the main grads, which no `.grad` views (DDP's buckets
        # need no such line: with gradient_as_bucket_view every `.grad` views its bucket)
        for module in self.module.modules():
            if isinstance(module, flatgrad.FlatGrad):
                grads += settled_buffers(module).values()  # (reduce-scattered too: only sizes read)
        optimizer = self.optimizer
        masters: list[torch.Tensor] = []
        if isinstance(optimizer, flatgrad.ShardedOptimizer):
            optimizer = optimizer.optimizer  # steps this rank's shards (masters, with main grads)
            masters = [p for group in optimizer.param_groups for p in group["params"]]
            grads += [p.grad for p in masters if p.grad is not None]
        state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        return storage_bytes({"params": params, "grads": grads, "masters": masters, "optimizer_state": state})


def build_mixed(
    name: str, model: nn.Module, device: torch.device, unused_parameters: bool = False
) -> MixedRunner:
    """A fresh copy of `model` set up as variant `name` of `MIXED_VARIANTS`."""
    if name not in MIXED_VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(MIXED_VARIANTS)}, got {name!r}")
    autocast = name == "ddp_autocast"
    dtype = torch.float32 if autocast else torch.bfloat16
    module = copy.deepcopy(model).to(device, dtype)
    if name == "flatgrad_main_grads":
        dp = flatgrad.replicate(flatgrad.FlatGrad(module, config={"grad_dtype": "float32"}))
        sharded = flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY)
        clip = lambda: sharded.clip_grad_norm_(MAX_NORM)  # noqa: E731
        return MixedRunner(name, dp, sharded, dp.no_sync, clip, autocast=False, dtype=dtype)
    ids = [device.index or 0] if device.type == "cuda" else None
    ddp = DDP(module, device_ids=ids, gradient_as_bucket_view=True, find_unused_parameters=unused_parameters)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    clip = lambda: torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM)  # noqa: E731
    return MixedRunner(name, ddp, optimizer, ddp.no_sync, clip, autocast=autocast, dtype=dtype)


def bench_mixed(
    spec: BenchModel, variants: Iterable[str], steps: int, warmup: int, device: torch.device
) -> dict[str, Any]:
    """Interleaved steps of every variant on the same micro-batches; a step's time is the
    slowest rank's. Then each variant's memory per parameter, the largest over ranks."""
    torch.manual_seed(0)
    model = spec.build()
    runners = [build_mixed(name, model, device, spec.unused_parameters) for name in variants]
    gen = torch.Generator().manual_seed(2000 + dist.get_rank())
    batches = ([spec.batch(gen, device) for _ in range(MICRO_BATCHES)] for _ in range(warmup + steps))
    measured = rotate([rank_timer(r.step, device) for r in runners], batches)
    records = rank_records({r.name: m for r, m in zip(runners, measured)}, warmup, device, BASES)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    held = [list(r.held_bytes().values()) for r in runners]  # per role, in ROLES' order
    # the most a rank holds, per role and in all
    for runner, (*by_role, total) in zip(runners, max_over_ranks([[*h, sum(h)] for h in held], device)):
        records[runner.name].update(
            bytes_per_parameter=total / numel, bytes=dict(zip(ROLES, map(int, by_role)))
        )
    return {
        "num_parameters": numel,
        "micro_batches": MICRO_BATCHES,
        "max_norm": MAX_NORM,
        "optimizer": {"name": "AdamW", "lr": LR, "weight_decay": WEIGHT_DECAY},
        "variants": records,
    }
