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
(who goes first rotates) and timed as in `flatgrad.bench.suite`. Memory is counted per
rank after a step (before the next one zeroes the gradients): the distinct storages behind
the parameters, the gradients (`.grad`, views of DDP's buckets here; flatgrad's gradient
buffers, which hold the main grads), a ShardedOptimizer's float32 masters and the
optimizer state, each storage once.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import flatgrad
from flatgrad.bench.counters import storage_bytes
from flatgrad.bench.models import BenchModel
from flatgrad.bench.suite import Progress, timed_step

MIXED_VARIANTS = ("ddp_autocast", "ddp_bf16", "flatgrad_main_grads")
MICRO_BATCHES = 4
MAX_NORM = 1.0
LR, WEIGHT_DECAY = 1e-3, 0.1  # AdamW's, for every variant
# What each variant's per-rank memory is made of (`MixedRunner.held_bytes`), in the order a
# storage met twice is counted (once, in the first).
ROLES = ("params", "grads", "masters", "optimizer_state")

Batch = tuple[torch.Tensor, ...]


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
            with contextlib.nullcontext() if last else self.no_sync():  # (forward and backward)
                loss = self._loss(batch) / len(micro_batches)
                loss.backward()
            losses.append(loss.detach().float())
        self.clip()
        self.optimizer.step()
        return torch.stack(losses).sum()

    def _loss(self, batch: Batch) -> torch.Tensor:
        inputs = [t.to(self.dtype) if t.is_floating_point() else t for t in batch]
        device = inputs[0].device.type
        with torch.autocast(device, dtype=torch.bfloat16, enabled=self.autocast):
            return self.module(*inputs)

    def held_bytes(self) -> dict[str, int]:
        """Bytes this rank holds per role of `ROLES` (see the module docstring)."""
        params = list(self.module.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        # flatgrad's gradient buffers: the main grads, which no `.grad` views (DDP's buckets
        # need no such line: with gradient_as_bucket_view every `.grad` views its bucket)
        for module in self.module.modules():
            if isinstance(module, flatgrad.FlatGrad):
                grads += module.grad_buffers.values()
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
    module = copy.deepcopy(model).to(device)
    if name == "flatgrad_main_grads":
        flat = flatgrad.FlatGrad(module.to(torch.bfloat16), config={"grad_dtype": "float32"})
        dp = flatgrad.replicate(flat)
        sharded = flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY)
        clip = lambda: sharded.clip_grad_norm_(MAX_NORM)  # noqa: E731
        return MixedRunner(name, dp, sharded, dp.no_sync, clip, autocast=False, dtype=torch.bfloat16)
    autocast = name == "ddp_autocast"
    dtype = torch.float32 if autocast else torch.bfloat16
    ids = [device.index or 0] if device.type == "cuda" else None
    ddp = DDP(
        module.to(dtype),
        device_ids=ids,
        gradient_as_bucket_view=True,
        find_unused_parameters=unused_parameters,
    )
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    clip = lambda: torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM)  # noqa: E731
    return MixedRunner(name, ddp, optimizer, ddp.no_sync, clip, autocast=autocast, dtype=dtype)


def bench_mixed(
    spec: BenchModel,
    variants: Iterable[str],
    steps: int,
    warmup: int,
    device: torch.device,
    bar: Progress | None = None,
) -> dict[str, Any]:
    """Interleaved steps of every variant on the same micro-batches; a step's time is the
    slowest rank's. Then each variant's memory per parameter, the largest over ranks."""
    torch.manual_seed(0)
    model = spec.build()
    runners = [build_mixed(name, model, device, spec.unused_parameters) for name in variants]
    gen = torch.Generator().manual_seed(2000 + dist.get_rank())
    times: dict[str, list[float]] = {r.name: [] for r in runners}
    peaks = {r.name: 0.0 for r in runners}
    losses: dict[str, float] = {}
    for step in range(warmup + steps):
        micro = [spec.batch(gen, device) for _ in range(MICRO_BATCHES)]
        shift = step % len(runners)
        for runner in runners[shift:] + runners[:shift]:
            seconds, losses[runner.name], peak = timed_step(functools.partial(runner.step, micro), device)
            if step >= warmup:
                times[runner.name].append(seconds)
                peaks[runner.name] = max(peaks[runner.name], peak)
        if bar is not None:
            bar.update(1)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {
        "num_parameters": numel,
        "micro_batches": MICRO_BATCHES,
        "max_norm": MAX_NORM,
        "optimizer": {"name": "AdamW", "lr": LR, "weight_decay": WEIGHT_DECAY},
        "variants": _records(runners, times, peaks, losses, numel, device),
    }


def _records(
    runners: list[MixedRunner],
    times: dict[str, list[float]],
    peaks: dict[str, float],
    losses: dict[str, float],
    numel: int,
    device: torch.device,
) -> dict[str, dict[str, Any]]:
    """Per variant: step times (the slowest rank's), ratios to the stock variants, memory."""
    names = [r.name for r in runners]
    held = []
    for runner in runners:
        by_role = runner.held_bytes()
        held.append([by_role[role] for role in ROLES] + [sum(by_role.values())])
    table = torch.tensor(  # (on the device: NCCL reduces nothing else)
        [times[n] + [peaks[n]] + h for n, h in zip(names, held)], dtype=torch.float64, device=device
    )
    # the slowest rank's step; the most memory a rank holds, per role and in all
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    steps = len(times[names[0]])
    rows = {n: row[:steps] for n, row in zip(names, table.tolist())}
    records = {}
    for name, row in zip(names, table.tolist()):
        *by_role, total = row[steps + 1 :]
        records[name] = {
            "median_ms": statistics.median(rows[name]) * 1e3,
            "min_ms": min(rows[name]) * 1e3,
            "max_ms": max(rows[name]) * 1e3,
            "bytes_per_parameter": total / numel,
            "bytes": {role: int(value) for role, value in zip(ROLES, by_role)},
            "step_peak_extra_mb": row[steps],
            "final_loss": losses[name],
        }
        for base in ("ddp_autocast", "ddp_bf16"):
            if base in rows:  # median over steps of (this step / the base's same step)
                records[name][f"ratio_to_{base}"] = statistics.median(
                    a / b for a, b in zip(rows[name], rows[base])
                )
    return records
