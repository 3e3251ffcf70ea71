"""How the bench times steps, one process or on ranks: the compared step functions take turns
on every batch (which goes first rotates, so that none is always the warm one), and a
comparison is the median over steps of the per-step ratio. On ranks a step is timed from a
barrier and a step's time is the slowest rank's."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from flatgrad.bench.memory import step_peak, step_start, sync

T = TypeVar("T")
B = TypeVar("B")
# A rank's measurement of one step: (seconds, loss, MB the step added at its peak).
Measured = tuple[float, float, float]


def rotate(steps: Sequence[Callable[[B], T]], batches: Iterable[B]) -> list[list[T]]:
    """What every step function returns on every batch, per function; which goes first
    rotates from batch to batch."""
    results: list[list[T]] = [[] for _ in steps]
    for i, batch in enumerate(batches):
        shift = i % len(steps)
        for j in [*range(shift, len(steps)), *range(shift)]:
            results[j].append(steps[j](batch))
    return results


def median_ratio(ours: Sequence[float], base: Sequence[float]) -> float:
    """The median over steps of ours / base, step by step."""
    return statistics.median(a / b for a, b in zip(ours, base))


def rank_timer(step: Callable[[B], torch.Tensor], device: torch.device) -> Callable[[B], Measured]:
    """`step(batch)`, a training step that returns its loss, timed on a rank: every rank
    starts it together (the wait is not timed) and the device's work is waited for."""

    def timed(batch: B) -> Measured:
        dist.barrier()
        sync(device)
        baseline = step_start(device)
        start = time.perf_counter()
        loss = step(batch)
        sync(device)
        seconds = time.perf_counter() - start
        return seconds, float(loss.detach()), step_peak(device, baseline)

    return timed


def max_over_ranks(rows: list[list[float]], device: torch.device) -> list[list[float]]:
    """Each value's largest over the ranks (reduced on `device`: NCCL reduces nothing else)."""
    table = torch.tensor(rows, dtype=torch.float64, device=device)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    return table.tolist()


def rank_records(
    measured: dict[str, list[Measured]], warmup: int, device: torch.device, bases: dict[str, str]
) -> dict[str, dict[str, Any]]:
    """Per step function: median, min and max ms of its steps after `warmup` (each the slowest
    rank's), the most a step added at its peak (MB, over steps and ranks), the last step's
    loss, and, per base of `bases` (its name: the record's key) that ran, the median per-step
    ratio to it."""
    timed = {name: m[warmup:] for name, m in measured.items()}
    table = [[s for s, _, _ in m] + [max([0.0] + [p for *_, p in m])] for m in timed.values()]
    rows = dict(zip(timed, max_over_ranks(table, device)))
    records = {}
    for name, row in rows.items():
        seconds = row[:-1]
        records[name] = {
            "median_ms": statistics.median(seconds) * 1e3,
            "min_ms": min(seconds) * 1e3,
            "max_ms": max(seconds) * 1e3,
            "step_peak_extra_mb": row[-1],
            "final_loss": measured[name][-1][1],
        }
        for base, key in bases.items():
            if base in rows:
                records[name][key] = median_ratio(seconds, rows[base][:-1])
    return records
