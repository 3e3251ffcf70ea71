"""Speed and memory on the device, flatgrad against stock PyTorch in one process.

Ratios: median times of flatgrad and stock measured interleaved (which goes first rotates),
and the median of the per-repeat ratios flatgrad / stock. Memory: the peak bytes a training
configuration allocates, from building it through its AdamW steps (CUDA: the caching
allocator's peak; CPU: the peak of the running sum of the profiler's allocation records).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import flatgrad
from flatgrad.bench.device_base import (
    DeviceRun,
    MemoryRecord,
    Outcome,
    RatioRecord,
    peak_bytes,
    profiled,
    single_rank_group,
    sync,
)
from flatgrad.bench.device_comm import Builder, flat_dp, flat_hook, stock_ddp, stock_plain
from flatgrad.bench.local import _median_ratio
from flatgrad.bench.models import LOCAL_MODELS, BenchModel, LargeMLP, LlamaLike

Timed = Callable[[], float]  # runs one repeat, returns its seconds


def interleaved(ours: Timed, stock: Timed, repeats: int, warmup: int) -> tuple[list[float], list[float]]:
    """Seconds of `repeats` runs of each after `warmup` untimed ones; which runs first alternates."""
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(warmup + repeats):
        pair = ((ours, times[0]), (stock, times[1]))
        for fn, out in pair if i % 2 == 0 else pair[::-1]:
            seconds = fn()
            if i >= warmup:
                out.append(seconds)
    return times


def ratio_row(name: str, ours: list[float], stock: list[float]) -> RatioRecord:
    return RatioRecord(
        name=name,
        flatgrad_ms=statistics.median(ours) * 1e3,
        stock_ms=statistics.median(stock) * 1e3,
        ratio=_median_ratio(ours, stock),
    )


@dataclass
class _Stepper:
    """Training steps of one side: micro-batches, optional clipping, AdamW."""

    module: nn.Module
    clip: Callable[[], object] | None
    micro_batches: int
    autocast: bool
    batches: Sequence[tuple[torch.Tensor, ...]]
    device: torch.device

    def __post_init__(self) -> None:
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=1e-4)
        self.count = 0

    def __call__(self) -> float:
        sync(self.device)
        start = time.perf_counter()
        self.optimizer.zero_grad()
        for _ in range(self.micro_batches):
            batch = self.batches[self.count % len(self.batches)]
            self.count += 1
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                loss = self.module(*batch)
            loss.backward()
        if self.clip is not None:
            self.clip()
        self.optimizer.step()
        sync(self.device)
        return time.perf_counter() - start


def step_ratio(
    run: DeviceRun,
    name: str,
    model: nn.Module,
    spec: BenchModel,
    micro: int,
    clip: bool,
    autocast: bool = False,
    repeats: tuple[int, int] | None = None,
) -> RatioRecord:
    """flatgrad/stock of a training step of `model` (stock: a deep copy of it), over
    `repeats` (timed, warm-up) steps of each (default: 8, 2 with --quick, else 10, 3)."""
    timed, warmup = repeats or ((8, 2) if run.quick else (10, 3))
    batches = [spec.batch(torch.Generator().manual_seed(i), run.device) for i in range(micro * 2)]
    stock = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model)
    stock_clip = (lambda: torch.nn.utils.clip_grad_norm_(stock.parameters(), 1.0)) if clip else None
    ours = _Stepper(
        flat, (lambda: flat.clip_grad_norm_(1.0)) if clip else None, micro, autocast, batches, run.device
    )
    theirs = _Stepper(stock, stock_clip, micro, autocast, batches, run.device)
    return ratio_row(name, *interleaved(ours, theirs, timed, warmup))


def check_step_ratios(run: DeviceRun) -> Outcome:
    """The bench's one-process step models (`LOCAL_MODELS`), fresh and accumulating."""
    names = ["small_layers_64", "linear_1024"] if run.quick else list(LOCAL_MODELS)
    rows = []
    for name in names:
        spec = LOCAL_MODELS[name]
        for micro, clip in ((1, True), (4, False)):
            torch.manual_seed(0)
            with torch.device(run.device):
                model = spec.build()
            label = f"step {name}, {micro} micro-batch{'es' if micro > 1 else ''}{', clip' if clip else ''}"
            rows.append(step_ratio(run, label, model, spec, micro, clip))
    return Outcome(True, f"{len(rows)} one-process training-step rows (AdamW)", ratios=rows)


def _gpt(run: DeviceRun) -> tuple[str, BenchModel]:
    """~350M parameters on CUDA (d 1024, 24 blocks, vocab 50304, 8 x 1024 tokens per
    micro-batch; ~60M with --quick); small ones on CPU."""
    sizes = {  # (cuda, quick): vocab, dim, depth, heads, batch, sequence
        (True, False): (50304, 1024, 24, 16, 8, 1024),
        (True, True): (32000, 512, 8, 8, 8, 512),
        (False, False): (4096, 256, 2, 4, 8, 64),
        (False, True): (512, 64, 2, 4, 4, 32),
    }
    vocab, dim, depth, heads, batch, seq = sizes[run.cuda, run.quick]

    def tokens(gen: torch.Generator, device: torch.device) -> tuple[torch.Tensor, ...]:
        idx = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        return idx[:, :-1].to(device), idx[:, 1:].to(device)

    spec = BenchModel(lambda: LlamaLike(vocab=vocab, dim=dim, depth=depth, heads=heads), tokens)
    return f"d{dim}x{depth}, vocab {vocab}, {batch}x{seq} tokens", spec


def check_gpt_ratio(run: DeviceRun) -> Outcome:
    shape, spec = _gpt(run)
    torch.manual_seed(0)
    with torch.device(run.device):
        model = spec.build()
    num = sum(p.numel() for p in model.parameters())
    name = f"GPT {num / 1e6:.1f}M ({shape}), bf16 autocast, 4 micro-batches, clip"
    # 8 timed steps of ~0.4 s each on an H100 at full size (docs/gpu.md): the median is
    # steady, and 2 warm-up steps are past cuBLAS's and the allocator's first-call costs.
    row = step_ratio(run, name, model, spec, micro=4, clip=True, autocast=True, repeats=(8, 2))
    del model
    gc.collect()
    return Outcome(True, f"{name}: AdamW step", ratios=[row])


def _backward_timer(
    forward: Callable[[], torch.Tensor], zero: Callable[[], None], device: torch.device
) -> Timed:
    def timed() -> float:
        zero()
        out = forward()  # outside the timed region: only backward is measured
        grad = torch.ones_like(out)
        sync(device)
        start = time.perf_counter()
        out.backward(grad)
        sync(device)
        return time.perf_counter() - start

    return timed


def _leaf(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor.clone())


def _embedding_rows(run: DeviceRun, rows: int, dim: int, tokens: int, repeats: int) -> list[RatioRecord]:
    gen = torch.Generator(run.device).manual_seed(0)  # made on the device: GiBs on CUDA
    table = torch.randn(rows, dim, generator=gen, device=run.device)
    idx = torch.randint(0, rows, (tokens,), generator=gen, device=run.device)
    flat = flatgrad.FlatGrad(nn.Embedding.from_pretrained(table, freeze=False))
    plain = _leaf(table)

    def zero() -> None:
        flat.zero_grad(set_to_none=True)
        plain.grad = None

    ours = _backward_timer(lambda: flat(idx), zero, run.device)
    size = f"{rows // 1000}k x {dim}, {tokens // 1024}k tokens"
    out = []
    for label, forward in (
        ("F.embedding", lambda: F.embedding(idx, plain)),
        ("weight[idx]", lambda: plain[idx]),
    ):
        times = interleaved(ours, _backward_timer(forward, zero, run.device), repeats, 2)
        out.append(ratio_row(f"embedding backward {size}: routed nn.Embedding / {label}", *times))
    return out


def check_embedding_ratios(run: DeviceRun) -> Outcome:
    if run.cuda:
        sizes = [(r, 4096, t) for r in (50_000, 128_000) for t in (8192, 65536)][: 2 if run.quick else 4]
    else:
        sizes = [(r, 64, t) for r in (5_000, 20_000) for t in (1024, 8192)]
    rows = []
    for size in sizes:
        rows += _embedding_rows(run, *size, repeats=15 if run.quick else 25)
        gc.collect()
    return Outcome(True, f"{len(rows)} embedding backward rows", ratios=rows)


def _gather_row(
    run: DeviceRun,
    name: str,
    stock_read: Callable[..., torch.Tensor],
    ours_read: Callable[..., torch.Tensor],
    table: torch.Tensor,
    *args: torch.Tensor,
) -> RatioRecord:
    ours, stock = _leaf(table), _leaf(table)

    def zero() -> None:
        ours.grad = stock.grad = None

    times = interleaved(
        _backward_timer(lambda: ours_read(ours, *args), zero, run.device),
        _backward_timer(lambda: stock_read(stock, *args), zero, run.device),
        repeats=10 if run.quick else 20,
        warmup=2,
    )
    return ratio_row(name, *times)


def check_gather_ratios(run: DeviceRun) -> Outcome:
    gen = torch.Generator(run.device).manual_seed(0)
    big, reads = (1 << 24, 1 << 22) if run.cuda else (1 << 20, 1 << 20)
    rows_, cols, picks = (8192, 4096, 1024) if run.cuda else (1024, 256, 64)
    small = torch.randn(20, generator=gen, device=run.device)
    bins = torch.randint(0, 20, (1_000_000,), generator=gen, device=run.device)
    large = torch.randn(big, generator=gen, device=run.device)
    large_idx = torch.randint(0, big, (reads,), generator=gen, device=run.device)
    matrix = torch.randn(rows_, cols, generator=gen, device=run.device)
    index = torch.randint(0, cols, (rows_, picks), generator=gen, device=run.device)
    index_read = flatgrad.gather_with_index_add
    rows = [
        _gather_row(
            run,
            "gather_with_index_add: 20-element table, 1M indices / log_scale[bins]",
            lambda t, i: t[i],
            index_read,
            small,
            bins,
        ),
        _gather_row(
            run,
            f"gather_with_index_add: {big >> 20}M table, {reads >> 20}M indices / table[idx]",
            lambda t, i: t[i],
            index_read,
            large,
            large_idx,
        ),
        _gather_row(
            run,
            f"flatgrad.gather dim 1 of {rows_}x{cols}, {rows_}x{picks} index / torch.gather",
            lambda t, i: torch.gather(t, 1, i),
            lambda t, i: flatgrad.gather(t, 1, i),
            matrix,
            index,
        ),
    ]
    return Outcome(True, f"{len(rows)} gather backward rows", ratios=rows)


def _memory_model(run: DeviceRun) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    width, depth, batch = (4096, 8, 64) if run.cuda else (512, 4, 32)
    torch.manual_seed(0)
    model = LargeMLP(width=width, depth=depth)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    return model, (x.to(run.device), y.to(run.device))


MEMORY_CONFIGS: dict[str, Builder] = {
    "stock": stock_plain,
    "stock DDP": lambda m, d: stock_ddp(m, d, find_unused=False),
    "stock DDP gradient_as_bucket_view": lambda m, d: stock_ddp(m, d, find_unused=False, bucket_view=True),
    "flatgrad DDP hook": flat_hook,
    "flatgrad DataParallel": lambda m, d: flat_dp(m, d, bucket_cap_mb=25.0),
}
MEMORY_PAIRS = (
    ("flatgrad DDP hook", "stock DDP"),
    ("flatgrad DDP hook", "stock DDP gradient_as_bucket_view"),
    ("flatgrad DataParallel", "stock DDP"),
    ("flatgrad DataParallel", "stock DDP gradient_as_bucket_view"),
    ("flatgrad DataParallel", "stock"),
)


STEP_RANGE = "flatgrad.bench.device: measured step"
STEPS = 3  # DDP rebuilds its buckets in the second step's forward: the third is measured


def _train(
    build: Builder, model: nn.Module, batch: tuple[torch.Tensor, ...], device: torch.device
) -> dict[str, int]:
    """Build a configuration of `model` (`build` deep-copies it) and run `STEPS` steps of
    its optimizer, zeroing with zero_grad(set_to_none=True), torch's default. On CUDA
    returns the allocator's peaks (bytes above what was allocated before building): over
    the whole run and in the last step."""
    cuda = device.type == "cuda"
    base = torch.cuda.memory_allocated(device) if cuda else 0
    trainer = build(model, device)
    peaks = {}
    for step in range(STEPS):
        if cuda and step == STEPS - 1:
            sync(device)
            peaks["run"] = torch.cuda.max_memory_allocated(device) - base
            torch.cuda.reset_peak_memory_stats(device)
        with torch.profiler.record_function(STEP_RANGE) if step == STEPS - 1 else contextlib.nullcontext():
            trainer.optimizer.zero_grad(set_to_none=True)
            trainer.forward(*batch).backward()
            trainer.optimizer.step()
        # A gloo work holds its tensors until its worker thread finishes it: wait for that
        # here, or a bucket DDP has replaced may still count in the next step.
        dist.barrier()
    if cuda:
        sync(device)
        peaks["step"] = torch.cuda.max_memory_allocated(device) - base
        peaks["run"] = max(peaks["run"], peaks["step"])
    del trainer
    gc.collect()  # DDP reducers sit in reference cycles
    return peaks


def peaks_of(
    run: DeviceRun, build: Builder, model: nn.Module, batch: tuple[torch.Tensor, ...]
) -> dict[str, int]:
    """Peak bytes of the configuration `build` makes of `model`: over building it and all
    its steps ("run"), and during its last step ("step"), counted from before it was built.
    Needs a default process group (`_train` waits on a barrier after each step)."""
    gc.collect()
    if run.cuda:
        torch.cuda.empty_cache()
        sync(run.device)
        torch.cuda.reset_peak_memory_stats(run.device)
        return _train(build, model, batch, run.device)
    with profiled(run.device, profile_memory=True) as prof:
        _train(build, model, batch, run.device)
    return {"run": peak_bytes(prof), "step": peak_bytes(prof, within=STEP_RANGE)}


MEMORY_REPEATS = 2  # the peak is the largest seen; the detail shows repeats that differ


def mib(values: list[int]) -> str:
    shown = dict.fromkeys(f"{v / 2**20:.1f}" for v in values)  # one figure when the repeats agree
    return "|".join(shown)


def check_memory(run: DeviceRun) -> Outcome:
    """Peak bytes of each configuration of `MEMORY_CONFIGS` (one rank in this process:
    NCCL on CUDA, gloo on CPU), each built and trained `MEMORY_REPEATS` times, reported as
    the pairs of `MEMORY_PAIRS`."""
    width, depth, rows = (4096, 8, 64) if run.cuda else (512, 4, 32)
    torch.manual_seed(0)
    with torch.device(run.device):
        model = LargeMLP(width=width, depth=depth)
        batch = (torch.randn(rows, width), torch.randn(rows, width))
    peaks: dict[str, dict[str, list[int]]] = {c: {"step": [], "run": []} for c in MEMORY_CONFIGS}
    with single_rank_group("nccl" if run.cuda else "gloo", run.device):
        for _ in range(MEMORY_REPEATS):
            for config in MEMORY_CONFIGS:
                for key, value in peaks_of(run, MEMORY_CONFIGS[config], model, batch).items():
                    peaks[config][key].append(value)
    num = sum(p.numel() for p in model.parameters())
    memory = [
        MemoryRecord(
            name=f"{a} / {b}",
            flatgrad_bytes=max(peaks[a]["step"]),
            stock_bytes=max(peaks[b]["step"]),
            num_params=num,
        )
        for a, b in MEMORY_PAIRS
    ]
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    detail = (
        f"LargeMLP {width}x{depth} ({grads / 2**20:.1f} MiB of float32 gradients), AdamW, {STEPS} steps, "
        f"{MEMORY_REPEATS} repeats; peak MiB in the last step / over building and all steps "
        "(a|b: repeats differed): "
        + ", ".join(f"{name} {mib(p['step'])} / {mib(p['run'])}" for name, p in peaks.items())
    )
    return Outcome(True, detail, memory=memory)
