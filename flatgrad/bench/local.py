"""One-process training steps, stock against FlatGrad.

A step is ``optimizer.zero_grad()``, forward, backward, optionally gradient clipping
(`torch.nn.utils.clip_grad_norm_` against `FlatGrad.clip_grad_norm_`), SGD step; each model
also gets a row with gradient accumulation (several forward-backward micro-batches per step,
no clipping), where stock adds every micro-batch after the first into `.grad` and flatgrad's
routed layers accumulate inside their GEMMs (`addmm_`). Stock and
FlatGrad train their own copies on the same batches (made before timing); steps are
interleaved (which goes first rotates) and the ratio is the median over steps of the
per-step ratio. Each step's minor page faults are counted too (see `memory.pin_malloc`).

Every row also times a second stock copy, the control, in the same rotation: its ratio to
stock is what two identical models measure apart on this machine (where each model's
tensors landed in memory, the order of the steps), the floor under which a flatgrad ratio
says nothing. All three are deep copies of one built model, so none is favoured by how its
memory was allocated.
"""

from __future__ import annotations

import copy
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import flatgrad
from flatgrad.bench.memory import minor_faults, sync
from flatgrad.bench.models import LOCAL_MODELS, Batch, BenchModel
from flatgrad.bench.timing import median_ratio, rotate

CPU = torch.device("cpu")
Step = Callable[[Batch], None]


def _step(module: nn.Module, clip: bool, micro_batches: int, device: torch.device) -> Step:
    """A training step of `module`, clipping (if `clip`) as a FlatGrad does or else as torch does."""
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)
    if isinstance(module, flatgrad.FlatGrad):
        clip_grads: Callable[[float], object] = module.clip_grad_norm_
    else:
        clip_grads = functools.partial(torch.nn.utils.clip_grad_norm_, list(module.parameters()))

    def step(batch: Batch) -> None:
        optimizer.zero_grad()
        for _ in range(micro_batches):
            module(*batch).backward()
        if clip:
            clip_grads(1.0)
        optimizer.step()
        sync(device)  # (a step's time is its work's, not its launches')

    return step


def _trio(spec: BenchModel, clip: bool, micro: int, device: torch.device) -> tuple[Step, Step, Step]:
    """(stock, the stock control, flatgrad) steps, each on its own deep copy of one model."""
    torch.manual_seed(0)
    model = spec.build().to(device)
    stock, control, flat = (copy.deepcopy(model) for _ in range(3))
    step = functools.partial(_step, clip=clip, micro_batches=micro, device=device)
    return step(stock), step(control), step(flatgrad.FlatGrad(flat))


def _timed(step: Step, batch: Batch) -> tuple[float, int]:
    """`step(batch)`'s seconds and the minor page faults it took."""
    before = minor_faults()
    start = time.perf_counter()
    step(batch)
    return time.perf_counter() - start, minor_faults() - before


def interleave(
    stock: Step, control: Step, ours: Step, batches: Sequence[Batch], warmup: int
) -> dict[str, float]:
    """Median step times, the median per-step ratios ours / stock and control / stock, and
    the mean minor page faults per step of stock and ours; the first `warmup` batches are
    not timed."""
    steps = (stock, control, ours)
    rotate(steps, batches[:warmup])  # (untimed)
    measured = rotate([functools.partial(_timed, s) for s in steps], batches[warmup:])
    (stock_s, stock_f), (control_s, _), (ours_s, ours_f) = (list(zip(*m)) for m in measured)
    return {
        "stock_ms": statistics.median(stock_s) * 1e3,
        "flatgrad_ms": statistics.median(ours_s) * 1e3,
        "ratio": median_ratio(ours_s, stock_s),
        "control_ratio": median_ratio(control_s, stock_s),
        "stock_faults": statistics.fmean(stock_f),
        "flatgrad_faults": statistics.fmean(ours_f),
    }


def local_rows(
    steps: int,
    warmup: int = 3,
    models: dict[str, BenchModel] | None = None,
    accumulate: int = 4,
    device: torch.device = CPU,
) -> list[dict[str, Any]]:
    """Per model, the rows the module docstring lists (`accumulate` < 2: no accumulation row),
    on `device` (the device report runs them on a GPU)."""
    variants = [(False, 1), (True, 1)] + ([(False, accumulate)] if accumulate > 1 else [])
    rows = []
    for name, spec in (models or LOCAL_MODELS).items():
        batches = [spec.batch(torch.Generator().manual_seed(i), device) for i in range(warmup + steps)]
        for clip, micro in variants:
            measured = interleave(*_trio(spec, clip, micro, device), batches, warmup)
            rows.append({"model": name, "clip": clip, "micro_batches": micro, **measured})
    return rows


def format_local(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'one process: model':22s} {'clip':>5s} {'micro':>5s} {'stock ms':>9s} {'flatgrad ms':>12s} "
        f"{'ratio':>6s} {'control':>7s} {'faults/step stock':>17s} {'flatgrad':>8s}"
    ]
    for r in rows:
        lines.append(
            f"{r['model']:22s} {('yes' if r['clip'] else 'no'):>5s} {r['micro_batches']:5d} "
            f"{r['stock_ms']:9.2f} {r['flatgrad_ms']:12.2f} {r['ratio']:6.3f} {r['control_ratio']:7.3f} "
            f"{r['stock_faults']:17.0f} {r['flatgrad_faults']:8.0f}"
        )
    return "\n".join(lines)
