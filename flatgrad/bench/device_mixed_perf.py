"""Mixed precision's time and memory on the device: flatgrad's bfloat16 parameters with
float32 main grads and `ShardedOptimizer` (float32 masters; `DataParallel` of world size 1)
against stock float32 parameters under bfloat16 autocast with AdamW (the usual setup), and
against stock bfloat16 parameters with a bfloat16 AdamW (no float32 copy at all: the floor).

The model is the GPT of the `ratios: GPT bf16` row (`device_perf._gpt`); the rows are
measured as the report's others: step medians interleaved (the order rotating through the
three), and the peak bytes allocated in a training step (`device_perf.peaks_of`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import time
from collections.abc import Sequence

import torch
from torch import nn

import flatgrad
from flatgrad.bench.device_base import DeviceRun, MemoryRecord, Outcome, RatioRecord, single_rank_group, sync
from flatgrad.bench.device_comm import LR, Builder, Trainer, stock_plain
from flatgrad.bench.device_perf import MEMORY_REPEATS, Timed, _gpt, mib, peaks_of, ratio_row

FLATGRAD = "flatgrad bf16 + float32 main grads + ShardedOptimizer"
AUTOCAST = "stock float32 under bf16 autocast, AdamW"
BF16 = "stock bf16, bf16 AdamW"
MICRO_BATCHES, MAX_NORM = 2, 1.0


def flat_mixed(model: nn.Module, device: torch.device) -> Trainer:
    """`model` (bfloat16) with main grads under DataParallel and ShardedOptimizer(AdamW),
    flatgrad's defaults otherwise (as a script would wrap it)."""
    flat = flatgrad.FlatGrad(copy.deepcopy(model), config={"grad_dtype": "float32"})
    dp = flatgrad.replicate(flat)
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, lr=LR, weight_decay=0.1)  # as stock_plain
    return Trainer(FLATGRAD, dp, opt, list(flat.parameters()), opt.clip_grad_norm_, dp.no_sync)


def stock_autocast(model: nn.Module, device: torch.device) -> Trainer:
    """Stock AdamW on `model` (float32), its forward under bfloat16 autocast."""
    trainer = stock_plain(model, device)
    inner = trainer.forward

    def forward(*batch: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return inner(*batch)

    return dataclasses.replace(trainer, name=AUTOCAST, forward=forward)


# The configurations, each with the dtype of the model it copies.
SIDES: dict[str, tuple[torch.dtype, Builder]] = {
    FLATGRAD: (torch.bfloat16, flat_mixed),
    AUTOCAST: (torch.float32, stock_autocast),
    BF16: (torch.bfloat16, stock_plain),
}


def step_timer(trainer: Trainer, batches: Sequence[tuple[torch.Tensor, ...]], device: torch.device) -> Timed:
    """One timed training step: `MICRO_BATCHES` micro-batches (all but the last under
    no_sync), clipping to `MAX_NORM`, the optimizer's step."""
    count = itertools.count()

    def timed() -> float:
        sync(device)
        start = time.perf_counter()
        trainer.optimizer.zero_grad()
        for micro in range(MICRO_BATCHES):
            last = micro == MICRO_BATCHES - 1
            with contextlib.nullcontext() if last else trainer.no_sync():
                trainer.forward(*batches[next(count) % len(batches)]).backward()
        trainer.clip(MAX_NORM)
        trainer.optimizer.step()
        sync(device)
        return time.perf_counter() - start

    return timed


def rotated(timers: Sequence[Timed], repeats: int, warmup: int) -> list[list[float]]:
    """Seconds of `repeats` runs of each timer after `warmup` untimed ones; which runs first
    rotates through them."""
    times: list[list[float]] = [[] for _ in timers]
    for i in range(warmup + repeats):
        for k in range(len(timers)):
            index = (i + k) % len(timers)
            seconds = timers[index]()
            if i >= warmup:
                times[index].append(seconds)
    return times


def _ratio_rows(
    run: DeviceRun, models: dict[torch.dtype, nn.Module], batches: list[tuple[torch.Tensor, ...]], name: str
) -> list[RatioRecord]:
    trainers = [build(models[dtype], run.device) for dtype, build in SIDES.values()]
    repeats, warmup = (6, 1) if run.quick else (8, 2)  # three sides of ~0.2 s steps on an H100
    ours, *stock = rotated([step_timer(t, batches, run.device) for t in trainers], repeats, warmup)
    return [
        ratio_row(f"{name}: {FLATGRAD} / {label}", ours, times)
        for label, times in zip(list(SIDES)[1:], stock)
    ]


def memory_repeats(run: DeviceRun) -> int:
    """The report's `MEMORY_REPEATS`; one on a CPU --quick run (the time is what matters there)."""
    return 1 if run.quick and not run.cuda else MEMORY_REPEATS


def _peaks(
    run: DeviceRun, models: dict[torch.dtype, nn.Module], batch: tuple[torch.Tensor, ...]
) -> dict[str, list[int]]:
    """Per side, its step peaks over `memory_repeats(run)` builds."""
    peaks: dict[str, list[int]] = {label: [] for label in SIDES}
    for _ in range(memory_repeats(run)):
        for label, (dtype, build) in SIDES.items():
            peaks[label].append(peaks_of(run, build, models[dtype], batch)["step"])
    return peaks


def check_mixed_precision(run: DeviceRun) -> Outcome:
    """Ratio rows (flatgrad's mixed-precision step against each stock setup) and memory rows
    (peak bytes allocated in a step, the same pairs), one rank in this process (NCCL on
    CUDA, gloo on CPU) for flatgrad's DataParallel."""
    shape, spec = _gpt(run)
    torch.manual_seed(0)
    with torch.device(run.device):
        model = spec.build()
    models = {torch.float32: model, torch.bfloat16: copy.deepcopy(model).to(torch.bfloat16)}
    batches = [spec.batch(torch.Generator().manual_seed(i), run.device) for i in range(2 * MICRO_BATCHES)]
    num = sum(p.numel() for p in model.parameters())
    name = f"mixed precision GPT {num / 1e6:.1f}M ({shape}), {MICRO_BATCHES} micro-batches, clip"
    with single_rank_group("nccl" if run.cuda else "gloo", run.device):
        ratios = _ratio_rows(run, models, batches, name)
        peaks = _peaks(run, models, batches[0])
    memory = [
        MemoryRecord(
            name=f"GPT {num / 1e6:.1f}M: {FLATGRAD} / {label}",
            flatgrad_bytes=max(peaks[FLATGRAD]),
            stock_bytes=max(values),
            num_params=num,
        )
        for label, values in peaks.items()
        if label != FLATGRAD
    ]
    detail = (
        f"{name}; world size 1; peak MiB in an AdamW step ({memory_repeats(run)} repeat(s), a|b: "
        "they differed): " + ", ".join(f"{label} {mib(values)}" for label, values in peaks.items())
    )
    return Outcome(True, detail, ratios=ratios, memory=memory)
