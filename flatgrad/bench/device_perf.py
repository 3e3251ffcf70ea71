"""What the device report measures: the bench's own rows (`local`, `ops`, `suite`, `mixed`)
run on the device at hand, and the peak bytes each training configuration allocates in a
step. One measuring code for both: a GPU's numbers line up with the CPU's A/B runs.

Whether flatgrad is right on the device is the tests' job (`pytest -m gpu`): this module
only measures. Ratios are flatgrad / stock (below 1: flatgrad is faster), medians of steps
interleaved with stock's; the data-parallel and mixed-precision rows run on one rank in this
process (NCCL on CUDA, gloo on CPU).
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict

from flatgrad.bench.local import local_rows
from flatgrad.bench.memory import sync
from flatgrad.bench.mixed import BASES, MICRO_BATCHES, MIXED_VARIANTS, bench_mixed, build_mixed
from flatgrad.bench.models import LOCAL_MODELS, BenchModel, LargeMLP, LlamaLike, tokens
from flatgrad.bench.ops import op_ratios
from flatgrad.bench.runners import build_runner
from flatgrad.bench.suite import bench_model


class RatioRecord(BaseModel):
    """Median milliseconds of flatgrad and of stock, measured interleaved in one process, and
    the ratio flatgrad / stock (below 1: flatgrad is faster)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    flatgrad_ms: float
    stock_ms: float
    ratio: float


class MemoryRecord(BaseModel):
    """Peak bytes allocated in a training step of each side (`peak_in_step`), and the
    parameters of the model both train, for bytes per parameter."""

    model_config = ConfigDict(extra="forbid")
    name: str
    flatgrad_bytes: int
    stock_bytes: int
    num_params: int


@dataclass(frozen=True)
class DeviceRun:
    """Where the rows are measured and how big: `quick` scales every workload down."""

    device: torch.device
    quick: bool

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


@dataclass
class Outcome:
    """What a check returns: passed (None: not run on this device), a detail for the
    report, and the measurements it made."""

    passed: bool | None
    detail: str
    ratios: list[RatioRecord] = field(default_factory=list)
    memory: list[MemoryRecord] = field(default_factory=list)


@contextlib.contextmanager
def single_rank_group(backend: str, device: torch.device) -> Iterator[None]:
    """A default process group of world size 1 in this process (an in-memory store: no port)."""
    if dist.is_initialized():
        raise RuntimeError("a default process group is already initialised; the check needs its own")
    kwargs: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    try:
        yield
    finally:
        gc.collect()  # free DDP reducers (reference cycles) while the group exists
        dist.destroy_process_group()


def _group(run: DeviceRun) -> contextlib.AbstractContextManager[None]:
    return single_rank_group("nccl" if run.cuda else "gloo", run.device)


def _steps(run: DeviceRun) -> tuple[int, int]:
    """(timed, warm-up) steps of each side."""
    return (3, 1) if run.quick else (20, 3)


def _measured(name: str, row: dict[str, Any]) -> RatioRecord:
    """A bench row that holds ``flatgrad_ms``, ``stock_ms`` and ``ratio``, named `name`."""
    return RatioRecord(name=name, **{key: float(row[key]) for key in ("flatgrad_ms", "stock_ms", "ratio")})


def _against(label: str, records: dict[str, Any], name: str, base: str, key: str) -> RatioRecord:
    """Record `name` of a bench table against record `base`: their median steps, and the
    median per-step ratio held at `key`."""
    ours, stock_ms = records[name], records[base]["median_ms"]
    return RatioRecord(
        name=f"{label}: {name} / {base}", flatgrad_ms=ours["median_ms"], stock_ms=stock_ms, ratio=ours[key]
    )


def check_step_ratios(run: DeviceRun) -> Outcome:
    """The bench's one-process rows (`local.local_rows`): stock, a stock control and
    flatgrad, each a deep copy of one model, SGD steps rotated."""
    names = ["small_layers_64", "linear_1024"] if run.quick else list(LOCAL_MODELS)
    steps, warmup = _steps(run)
    rows = local_rows(steps, warmup, {n: LOCAL_MODELS[n] for n in names}, 4, run.device)
    ratios = [
        _measured(
            f"step {r['model']}, {r['micro_batches']} micro-batch(es){', clip' if r['clip'] else ''}", r
        )
        for r in rows
    ]
    controls = ", ".join(f"{r['control_ratio']:.2f}" for r in rows)
    detail = f"SGD, {steps} timed steps after {warmup}; the control's ratio to stock per row: {controls}"
    return Outcome(True, detail, ratios=ratios)


def check_op_ratios(run: DeviceRun) -> Outcome:
    """The bench's single-op backwards (`ops.op_ratios`): embedding, gathers, Linear stack."""
    repeats = 5 if run.quick else 30
    ratios = [_measured(f"backward {r['case']}", r) for r in op_ratios(repeats, device=run.device)]
    return Outcome(True, f"medians of {repeats} backwards each, interleaved", ratios=ratios)


DP_MODELS = ("small_layers", "gpt")  # (with --quick, gpt alone)
DP_CONFIGS = ["ddp_default", "ddp_bucket_view", "flatgrad_ddp_hook", "flatgrad_dp", "flatgrad_zero"]
DP_BASES = {"ddp_default": "ratio_to_ddp_default", "ddp_bucket_view": "pair_ratio_to_ddp_bucket_view"}


def check_data_parallel(run: DeviceRun) -> Outcome:
    """The bench's data-parallel configurations (`suite.bench_model`) at world size 1:
    flatgrad's against stock DDP, with and without gradient_as_bucket_view."""
    steps, warmup = _steps(run)
    models, ratios = DP_MODELS[-1:] if run.quick else DP_MODELS, []
    with _group(run):
        for model in models:
            configs = bench_model(model, DP_CONFIGS, steps, warmup, run.device, None)["configs"]
            ratios += [
                _against(f"data-parallel step {model}", configs, name, base, key)
                for name in DP_CONFIGS
                if name.startswith("flatgrad")
                for base, key in DP_BASES.items()
            ]
    detail = f"world size 1, SGD (momentum), {steps} timed steps after {warmup}, on {', '.join(models)}"
    return Outcome(True, detail, ratios=ratios)


STEP_RANGE = "flatgrad.bench.device: measured step"
MEASURED_STEP = 3  # DDP rebuilds its buckets in the second step's forward: the third is measured


def peak_in_step(run: DeviceRun, make_step: Callable[[], Callable[[], object]]) -> int:
    """Peak bytes allocated during the third training step of what `make_step` builds,
    counted from before it was built (its parameters, gradients and optimizer state count).
    CUDA: the caching allocator's peak; CPU: the peak of the running sum of the profiler's
    allocation records. Needs a process group (a barrier after each step: a gloo work holds
    its tensors until its thread is done with them)."""
    gc.collect()
    if run.cuda:
        torch.cuda.empty_cache()
        sync(run.device)
    base = torch.cuda.memory_allocated(run.device) if run.cuda else 0
    cpu = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with contextlib.nullcontext() if run.cuda else cpu:
        step = make_step()
        for number in range(1, MEASURED_STEP + 1):
            last = number == MEASURED_STEP
            if last and run.cuda:
                sync(run.device)
                torch.cuda.reset_peak_memory_stats(run.device)
            with torch.profiler.record_function(STEP_RANGE) if last else contextlib.nullcontext():
                step()
            dist.barrier()
        sync(run.device)
        del step
        gc.collect()  # DDP reducers sit in reference cycles
    if run.cuda:
        return torch.cuda.max_memory_allocated(run.device) - base
    return peak_bytes(cpu, within=STEP_RANGE)


def peak_bytes(prof: torch.profiler.profile, within: str | None = None) -> int:
    """The peak of the running sum of a `profile_memory=True` profile's allocations and frees
    (CPU memory records): the most the profiled code held at once beyond what it started
    with; with `within`, the peak while the `record_function` range of that name ran."""
    assert prof.profiler is not None and prof.profiler.kineto_results is not None, (
        "the profile is not finished"
    )
    events: list[Any] = list(prof.profiler.kineto_results.events())
    start, end = 0, 2**63
    if within is not None:
        # (start plus duration: the end of each event, and torch 2.4 has no end_ns())
        ranges = [(e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.name() == within]
        if len(ranges) != 1:
            raise ValueError(f"the profile must hold one {within!r} range, got {len(ranges)}")
        start, end = ranges[0]
    running = peak = 0
    for event in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        if event.start_ns() > end:
            break
        if event.start_ns() >= start:
            peak = max(peak, running)  # held when the range began, then each change inside it
        running += event.nbytes()
        if event.start_ns() >= start:
            peak = max(peak, running)
    return peak


def _built(
    name: str, build: Callable[..., Any], model: torch.nn.Module, batch: Any, run: DeviceRun
) -> Callable[[], object]:
    """A step on `batch` of the bench's configuration `name` as `build` makes it
    (`runners.build_runner`, `mixed.build_mixed`), built here."""
    return functools.partial(build(name, model, run.device).step, batch)


def _pair(label: str, peaks: dict[str, int], name: str, base: str, num_params: int) -> MemoryRecord:
    return MemoryRecord(
        name=f"{label}: {name} / {base}",
        flatgrad_bytes=peaks[name],
        stock_bytes=peaks[base],
        num_params=num_params,
    )


# flatgrad's configurations, each against the stock ones that do its job
MEMORY_PAIRS = (
    ("local_flatgrad", "local_stock"),
    ("flatgrad_ddp_hook", "ddp_default"),
    ("flatgrad_ddp_hook", "ddp_bucket_view"),
    ("flatgrad_dp", "ddp_default"),
    ("flatgrad_dp", "ddp_bucket_view"),
    ("flatgrad_zero", "zero_stock"),
)
MEMORY_REPEATS = 2  # the peak is the largest seen; the detail shows repeats that differ


def mib(values: list[int]) -> str:
    shown = dict.fromkeys(f"{v / 2**20:.1f}" for v in values)  # one figure when the repeats agree
    return "|".join(shown)


def check_memory(run: DeviceRun) -> Outcome:
    """Peak bytes of the bench's configurations in an SGD step of a LargeMLP, each built and
    trained `MEMORY_REPEATS` times, reported as the pairs of `MEMORY_PAIRS`."""
    width, depth, rows = (4096, 8, 64) if run.cuda else (512, 4, 32)
    torch.manual_seed(0)
    model = LargeMLP(width=width, depth=depth)
    batch = (torch.randn(rows, width, device=run.device), torch.randn(rows, width, device=run.device))
    peaks: dict[str, list[int]] = {name: [] for pair in MEMORY_PAIRS for name in pair}
    with _group(run):
        for _ in range(MEMORY_REPEATS):
            for name, found in peaks.items():
                found.append(
                    peak_in_step(run, functools.partial(_built, name, build_runner, model, batch, run))
                )
    num, largest = sum(p.numel() for p in model.parameters()), {n: max(v) for n, v in peaks.items()}
    memory = [_pair(f"LargeMLP {width}x{depth}", largest, a, b, num) for a, b in MEMORY_PAIRS]
    detail = (
        f"SGD (momentum), zero_grad(set_to_none=True), world size 1, {MEMORY_REPEATS} repeats; peak MiB "
        "in the third step (a|b: repeats differed): " + ", ".join(f"{n} {mib(v)}" for n, v in peaks.items())
    )
    return Outcome(True, detail, memory=memory)


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

    spec = BenchModel(
        lambda: LlamaLike(vocab=vocab, dim=dim, depth=depth, heads=heads), tokens(vocab, batch, seq)
    )
    return f"d{dim}x{depth}, vocab {vocab}, {batch}x{seq} tokens", spec


def check_mixed_precision(run: DeviceRun) -> Outcome:
    """The bench's mixed-precision row (`mixed.bench_mixed`) on a GPT: bfloat16 parameters
    with float32 main grads and ShardedOptimizer(AdamW) against stock DDP over float32
    parameters under bf16 autocast and over bfloat16 parameters; with each one's peak."""
    shape, spec = _gpt(run)
    steps, warmup = (3, 1) if run.quick else (8, 2)  # (a full step is ~0.5 s on an H100)
    torch.manual_seed(0)
    model = spec.build()
    micro = [spec.batch(torch.Generator().manual_seed(i), run.device) for i in range(MICRO_BATCHES)]
    with _group(run):
        row = bench_mixed(spec, MIXED_VARIANTS, steps, warmup, run.device)
        peaks = {
            name: peak_in_step(run, functools.partial(_built, name, build_mixed, model, micro, run))
            for name in MIXED_VARIANTS
        }
    num = row["num_parameters"]
    label = f"mixed precision GPT {num / 1e6:.1f}M ({shape}), {MICRO_BATCHES} micro-batches, clip"
    ratios = [
        _against(label, row["variants"], "flatgrad_main_grads", base, key) for base, key in BASES.items()
    ]
    memory = [_pair(f"GPT {num / 1e6:.1f}M", peaks, "flatgrad_main_grads", base, num) for base in BASES]
    held = ", ".join(f"{n} {r['bytes_per_parameter']:.1f}" for n, r in row["variants"].items())
    detail = f"{label}, AdamW, world size 1, {steps} timed steps after {warmup}; bytes/param held: {held}"
    return Outcome(True, detail, ratios=ratios, memory=memory)
