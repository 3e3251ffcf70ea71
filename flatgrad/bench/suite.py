"""One rank's share of the benchmark: every configuration on every model, steps interleaved."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from flatgrad.bench.counters import count_step, grad_bytes
from flatgrad.bench.memory import step_peak, step_start, sync
from flatgrad.bench.models import resolve_model
from flatgrad.bench.runners import BASELINE, BEST_STOCK, MUON_BASE, Runner, build_runner


class Progress(Protocol):
    """A progress bar (tqdm's, from the ``bench`` extra): what the bench calls on it."""

    def update(self, n: float = 1) -> bool | None: ...

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None: ...

    def close(self) -> None: ...


def timed_step(step: Callable[[], torch.Tensor], device: torch.device) -> tuple[float, float, float]:
    """(seconds, loss, MB the step added at its peak) of one training step, `step()`, which
    returns its loss."""
    dist.barrier()  # every rank starts the step together; the wait is not timed
    sync(device)
    baseline = step_start(device)
    start = time.perf_counter()
    loss = step()
    sync(device)
    seconds = time.perf_counter() - start
    return seconds, float(loss.detach()), step_peak(device, baseline)


def _timed_step(
    runner: Runner, batch: tuple[torch.Tensor, ...], device: torch.device
) -> tuple[float, float, float]:
    def step() -> torch.Tensor:
        loss = runner.forward(batch)
        runner.backward(loss)
        runner.update()
        return loss

    return timed_step(step, device)


def bench_model(
    model_name: str, configs: list[str], steps: int, warmup: int, device: torch.device, bar: Progress | None
) -> dict[str, Any]:
    """Interleaved steps of every configuration on the same data; step time is the slowest
    rank's. Then one counted backward each for collectives, copies and gradient bytes (the
    parameter all-gathers of the sharded configurations, in their step or forward, are not
    in it), and every rank's optimizer state bytes."""
    spec = resolve_model(model_name)
    torch.manual_seed(0)
    model = spec.build()
    runners = [
        build_runner(name, model, device, unused_parameters=spec.unused_parameters) for name in configs
    ]
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    times: dict[str, list[float]] = {name: [] for name in configs}
    losses: dict[str, float] = {}
    peaks = dict.fromkeys(configs, 0.0)
    for step in range(warmup + steps):
        batch = spec.batch(gen, device)
        shift = step % len(runners)  # rotate who goes first, so no configuration is always warm
        for runner in runners[shift:] + runners[:shift]:
            seconds, losses[runner.name], peak = _timed_step(runner, batch, device)
            if step >= warmup:
                times[runner.name].append(seconds)
                peaks[runner.name] = max(peaks[runner.name], peak)
        if bar is not None:
            bar.update(1)
    # (on the device: NCCL reduces nothing else)
    table = torch.tensor(
        [times[name] + [peaks[name]] for name in configs], dtype=torch.float64, device=device
    )
    dist.all_reduce(table, op=dist.ReduceOp.MAX)  # the slowest rank's step, the largest peak
    batch = spec.batch(gen, device)
    results: dict[str, Any] = {}
    rows = {name: row[:-1] for name, row in zip(configs, table.tolist())}
    for runner, row in zip(runners, table.tolist()):
        loss = runner.forward(batch)
        counts = count_step(functools.partial(runner.backward, loss), runner.module.parameters())
        runner.update()
        results[runner.name] = {
            "median_ms": statistics.median(rows[runner.name]) * 1e3,
            "min_ms": min(rows[runner.name]) * 1e3,
            "max_ms": max(rows[runner.name]) * 1e3,
            "collectives_per_step": counts.collectives,
            "grad_copies_per_step": counts.grad_copies if runner.counts_grad_copies else None,
            "grad_bytes": grad_bytes(runner.module.parameters(), runner.bucket_buffers()),
            "step_peak_extra_mb": row[-1],
            "final_loss": losses[runner.name],
            "optimizer_state_bytes": runner.optimizer_state_bytes(),
            # (host time: on CUDA the waits do not block the host, so it would read about 0)
            "exposed_comm_ms": runner.engine.exposed_s * 1e3
            if runner.engine is not None and device.type != "cuda"
            else None,
            "bucket_launch_ms": [t * 1e3 for t in runner.engine.launch_offsets_s] if runner.engine else None,
            "backward_ms": runner.engine.backward_s * 1e3 if runner.engine is not None else None,
            "bucket_bytes": [b.numel() * b.element_size() for b in runner.engine.buckets]
            if runner.engine is not None
            else None,
        }
    mine = torch.tensor([r.optimizer_state_bytes() for r in runners], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    for index, runner in enumerate(runners):
        results[runner.name]["optimizer_state_bytes_by_rank"] = [int(t[index].item()) for t in every]
    bases = (
        (BASELINE, "ratio_to_ddp_default"),
        (BEST_STOCK, "pair_ratio_to_ddp_bucket_view"),
        (MUON_BASE, "pair_ratio_to_zero_stock_muon"),
    )
    for name, record in results.items():
        for base, key in bases:
            if base in rows:  # median over steps of (this step / the baseline's same step)
                record[key] = statistics.median(a / b for a, b in zip(rows[name], rows[base]))
    grad_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"num_parameters": grad_params, "configs": results}
