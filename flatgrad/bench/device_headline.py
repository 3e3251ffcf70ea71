"""The report's headline rows: the bench's Llama and GPT (`LOCAL_MODELS["llama"]`,
`MODELS["gpt"]`, at the bench's own sizes) under bfloat16 autocast, as one-process training
steps (FlatGrad against the plain model), and the Llama trained through each data-parallel
path against stock DDP: world size 1 in this process (NCCL on CUDA, gloo on CPU) and 2 gloo
ranks spawned to share the device (CUDA tensors on one GPU, or CPU tensors). Every row comes
with the peak bytes per parameter of both sides in a training step (`device_perf.peaks_of`).

flatgrad runs with its default config (what a user gets), DataParallel with its default
buckets; a step is `device_mixed_perf.step_timer`'s (2 micro-batches, all but the last under
no_sync, clipping, AdamW), the sides' order rotating from repeat to repeat.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any

import torch
from torch import nn

import flatgrad
from flatgrad.bench.device_base import (
    DeviceRun,
    MemoryRecord,
    Outcome,
    RatioRecord,
    single_rank_group,
    skipped,
)
from flatgrad.bench.device_comm import (
    Builder,
    Trainer,
    adamw,
    flat_dp,
    flat_hook,
    spawn_gloo,
    stock_ddp,
    stock_plain,
)
from flatgrad.bench.device_mixed_perf import MICRO_BATCHES, rotated, step_timer
from flatgrad.bench.device_perf import mib, peaks_of, ratio_row
from flatgrad.bench.models import LOCAL_MODELS, MODELS, BenchModel, LlamaLike, TiedGPT

DEFAULTS = flatgrad.FlatGradConfig()
VOCAB_CPU, SEQ_CPU = 512, 32


def _tokens_cpu(gen: torch.Generator, device: torch.device) -> tuple[torch.Tensor, ...]:
    idx = torch.randint(0, VOCAB_CPU, (4, SEQ_CPU + 1), generator=gen)
    return idx[:, :-1].to(device), idx[:, 1:].to(device)


def bench_models(run: DeviceRun) -> dict[str, BenchModel]:
    """The bench's Llama and GPT; on CPU scaled down to d64 x 2 blocks, vocab 512, 4 x 32
    tokens (bfloat16 GEMMs on a CPU without bf16 units take seconds at the bench's sizes)."""
    if run.cuda:
        return {"Llama": LOCAL_MODELS["llama"], "GPT": MODELS["gpt"]}
    return {
        "Llama": BenchModel(lambda: LlamaLike(vocab=VOCAB_CPU, dim=64, depth=2, heads=4), _tokens_cpu),
        "GPT": BenchModel(
            lambda: TiedGPT(vocab=VOCAB_CPU, dim=64, depth=2, heads=4, block=SEQ_CPU), _tokens_cpu
        ),
    }


STOCK_DDP = "stock DDP"
RANKS_TIMEOUT_S = 240.0  # two spawned ranks: imports, CUDA and gloo set-up, then the timed steps


def repeats(run: DeviceRun) -> tuple[int, int]:
    """(timed, warm-up) steps of each side: the bench's models take milliseconds on a GPU."""
    if run.cuda:
        return (6, 2) if run.quick else (10, 3)
    return (3, 1) if run.quick else (6, 2)


def under_autocast(build: Builder) -> Builder:
    """`build`, the trainer's forward run under bfloat16 autocast."""

    def wrapped(model: nn.Module, device: torch.device) -> Trainer:
        trainer = build(model, device)
        inner = trainer.forward

        def forward(*batch: torch.Tensor) -> torch.Tensor:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return inner(*batch)

        return dataclasses.replace(trainer, forward=forward)

    return wrapped


def flat_one_process(model: nn.Module, device: torch.device) -> Trainer:
    """`FlatGrad` with its default config and AdamW, no process group."""
    flat = flatgrad.FlatGrad(copy.deepcopy(model), config=DEFAULTS)
    params = list(flat.parameters())
    return Trainer("flatgrad", flat, adamw(params), params, flat.clip_grad_norm_)


ONE_PROCESS: dict[str, Builder] = {"stock": stock_plain, "flatgrad": flat_one_process}  # stock first
DATA_PARALLEL: dict[str, Builder] = {  # stock first: every other side is compared with it
    STOCK_DDP: lambda m, d: stock_ddp(m, d, find_unused=False),
    "DDP(FlatGrad) + allreduce_hook": lambda m, d: flat_hook(m, d, config=DEFAULTS),
    "DataParallel": lambda m, d: flat_dp(m, d, bucket_cap_mb=25.0, config=DEFAULTS),
    "ShardedOptimizer": lambda m, d: flat_dp(m, d, sharded=True, bucket_cap_mb=25.0, config=DEFAULTS),
}


def _model(spec: BenchModel, device: torch.device) -> tuple[nn.Module, int]:
    torch.manual_seed(0)
    with torch.device(device):
        model = spec.build()
    return model, sum(p.numel() for p in model.parameters())


def measure(
    run: DeviceRun, sides: dict[str, Builder], model: nn.Module, spec: BenchModel
) -> tuple[list[list[float]], dict[str, int]]:
    """Step seconds of each side of `sides` (bf16 autocast; `rotated`), then each side's
    peak bytes in a step. Needs a default process group (`peaks_of` waits on barriers)."""
    batches = [spec.batch(torch.Generator().manual_seed(i), run.device) for i in range(2 * MICRO_BATCHES)]
    builders = [under_autocast(build) for build in sides.values()]
    trainers = [build(model, run.device) for build in builders]
    timed, warmup = repeats(run)
    times = rotated([step_timer(t, batches, run.device) for t in trainers], timed, warmup)
    del trainers
    peaks = {name: peaks_of(run, build, model, batches[0])["step"] for name, build in zip(sides, builders)}
    return times, peaks


def rows(
    label: str, times: list[list[float]], peaks: dict[str, int], num_params: int
) -> tuple[list[RatioRecord], list[MemoryRecord]]:
    """Every side after the first against the first: its ratio row and its memory row."""
    (stock, *names), (stock_times, *others) = list(peaks), times
    ratios = [ratio_row(f"{label}: {name} / {stock}", t, stock_times) for name, t in zip(names, others)]
    memory = [
        MemoryRecord(
            name=f"{label}: {name} / {stock}",
            flatgrad_bytes=peaks[name],
            stock_bytes=peaks[stock],
            num_params=num_params,
        )
        for name in names
    ]
    return ratios, memory


def _peaks_detail(peaks: dict[str, int], num_params: int) -> str:
    return ", ".join(f"{name} {mib([b])} MiB ({b / num_params:.1f} B/param)" for name, b in peaks.items())


def check_one_process(run: DeviceRun) -> Outcome:
    """The bench's Llama and GPT, one process, bf16 autocast: flatgrad / stock."""
    ratios, memory, parts = [], [], []
    with single_rank_group("nccl" if run.cuda else "gloo", run.device):  # (peaks_of's barriers)
        for name, spec in bench_models(run).items():
            model, num = _model(spec, run.device)
            times, peaks = measure(run, ONE_PROCESS, model, spec)
            more = rows(f"step bench {name} {num / 1e6:.1f}M, one process, bf16 autocast", times, peaks, num)
            ratios += more[0]
            memory += more[1]
            parts.append(f"{name}: {_peaks_detail(peaks, num)}")
    detail = (
        f"{MICRO_BATCHES} micro-batches, clip, AdamW, {'/'.join(map(str, repeats(run)))} timed/warm-up "
        "steps; peak in a step: " + "; ".join(parts)
    )
    return Outcome(True, detail, ratios=ratios, memory=memory)


def _data_parallel(run: DeviceRun, setting: str) -> dict[str, Any]:
    """Every side of `DATA_PARALLEL` on the bench's Llama in the default group: the rows
    (as dicts: a spawned rank hands them back as JSON) and a detail."""
    spec = bench_models(run)["Llama"]
    model, num = _model(spec, run.device)
    times, peaks = measure(run, DATA_PARALLEL, model, spec)
    ratios, memory = rows(f"step bench Llama {num / 1e6:.1f}M, {setting}, bf16 autocast", times, peaks, num)
    detail = (
        f"{setting}: {MICRO_BATCHES} micro-batches (no_sync but the last), clip, AdamW, "
        f"{'/'.join(map(str, repeats(run)))} timed/warm-up steps; peak in a step: {_peaks_detail(peaks, num)}"
    )
    return {
        "ratios": [r.model_dump() for r in ratios],
        "memory": [m.model_dump() for m in memory],
        "detail": detail,
    }


def _outcome(result: dict[str, Any]) -> Outcome:
    return Outcome(
        True,
        result["detail"],
        ratios=[RatioRecord(**r) for r in result["ratios"]],
        memory=[MemoryRecord(**m) for m in result["memory"]],
    )


def check_world_size_one(run: DeviceRun) -> Outcome:
    """DDP with and without flatgrad's hook, DataParallel and ShardedOptimizer, one rank in
    this process (NCCL on CUDA, gloo on CPU), against stock DDP."""
    backend = "nccl" if run.cuda else "gloo"
    with single_rank_group(backend, run.device):
        return _outcome(_data_parallel(run, f"{backend} world size 1"))


def _rank_rows(device: torch.device, quick: bool) -> dict[str, Any]:
    """What each spawned rank runs (module level: pickled by the spawn)."""
    torch.manual_seed(0)
    tensors = "CUDA tensors, one GPU" if device.type == "cuda" else "CPU tensors"
    return _data_parallel(DeviceRun(device, quick), f"2 gloo ranks ({tensors})")


def check_two_ranks(run: DeviceRun) -> Outcome:
    """The world-size-1 rows again on 2 gloo ranks spawned here, sharing the device (rank
    0's times and peaks: each rank has its own caching allocator)."""
    if run.quick and not run.cuda:
        return skipped(
            "on CPU only without --quick: spawning the ranks takes 20-50 s of a 2-core CPU, and the "
            "collectives check's gloo ranks already run every path on CPU tensors"
        )
    device = torch.device("cuda", 0) if run.cuda else torch.device("cpu")
    job = functools.partial(_rank_rows, quick=run.quick)
    return _outcome(spawn_gloo(device, timeout=RANKS_TIMEOUT_S, job=job))
