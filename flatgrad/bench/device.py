"""The device report: flatgrad's speed and memory against stock PyTorch on the device at
hand, in one command (whether flatgrad is right there is `pytest -m gpu`'s to say).

python -m flatgrad.bench.device --out DIR [--budget-s 360]  # CUDA when available, else CPU
python -m flatgrad.bench.device --device cpu --quick --out DIR [--threads 1]

The checks run the bench's own rows (`local`, `ops`, `suite`, `mixed`) on the device, so a
GPU's numbers line up with the CPU's A/B runs, and add the peak bytes each training
configuration allocates in a step (`memory.peak_in_step`). Ratios are flatgrad / stock
(below 1: flatgrad is faster), medians of steps interleaved with stock's; the data-parallel
and mixed-precision rows run on one rank in this process (NCCL on CUDA, gloo on CPU).

Writes DIR/report.json and DIR/report.md after every check (a run cut short leaves what it
did, the checks still to come listed as not yet run) and exits 1 if any check failed. Every
check runs isolated: an exception inside one is that check failing (with its traceback's
tail), and the run goes on. Each check left when --budget-s seconds are spent is reported
skipped, saying so.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import logging
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict

from flatgrad.bench.cli import command_line, cpu_name, positive_float, positive_int
from flatgrad.bench.local import local_rows
from flatgrad.bench.memory import peak_in_step
from flatgrad.bench.mixed import BASES, MICRO_BATCHES, MIXED_VARIANTS, bench_mixed, build_mixed
from flatgrad.bench.models import LOCAL_MODELS, BenchModel, LargeMLP, LlamaLike, tokens
from flatgrad.bench.ops import op_ratios
from flatgrad.bench.runners import build_runner
from flatgrad.bench.suite import bench_model, single_rank_group

logger = logging.getLogger("flatgrad.bench.device")  # also under python -m
TRACEBACK_LINES = 12


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


class CheckRecord(BaseModel):
    """One check: passed is None when it was not run (`detail` says why)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    passed: bool | None
    detail: str
    seconds: float


class DeviceReport(BaseModel):
    """report.json: written after every check, so a run cut short leaves what it did."""

    model_config = ConfigDict(extra="forbid")
    device: str
    torch: str
    date: str
    quick: bool
    budget_s: float | None  # --budget-s: no check starts once this many seconds are spent
    seconds: float = 0.0
    checks: list[CheckRecord] = []
    pending: list[str] = []  # checks not yet decided: empty once the run has finished
    ratios: list[RatioRecord] = []
    memory: list[MemoryRecord] = []

    @property
    def failed(self) -> list[CheckRecord]:
        return [c for c in self.checks if c.passed is False]


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
            configs = bench_model(model, DP_CONFIGS, steps, warmup, run.device)["configs"]
            ratios += [
                _against(f"data-parallel step {model}", configs, name, base, key)
                for name in DP_CONFIGS
                if name.startswith("flatgrad")
                for base, key in DP_BASES.items()
            ]
    detail = f"world size 1, SGD (momentum), {steps} timed steps after {warmup}, on {', '.join(models)}"
    return Outcome(True, detail, ratios=ratios)


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
    return "|".join(dict.fromkeys(f"{v / 2**20:.1f}" for v in values))  # one figure when the repeats agree


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
                    peak_in_step(run.device, functools.partial(_built, name, build_runner, model, batch, run))
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
            name: peak_in_step(run.device, functools.partial(_built, name, build_mixed, model, micro, run))
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


Check = Callable[[DeviceRun], Outcome]
# In the order of what they tell, so that a run cut short has said the most it could.
CHECKS: dict[str, Check] = {
    "ratios: one-process training steps": check_step_ratios,
    "ratios: data-parallel world size 1": check_data_parallel,
    "memory: peak allocated in a training step": check_memory,
    "ratios and memory: mixed precision": check_mixed_precision,
    "ratios: single-op backwards": check_op_ratios,
}


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    threads = torch.get_num_threads()
    return f"CPU: {cpu_name()}, {threads} thread{'s' if threads != 1 else ''}"


def run_check(name: str, check: Check, run: DeviceRun) -> Outcome:
    """`check(run)`, an exception turned into a failed outcome with the traceback's tail."""
    try:
        return check(run)
    except Exception as error:  # isolation: one check failing must not stop the others
        logger.warning("check %r failed: %s: %s", name, type(error).__name__, error)
        lines = "".join(traceback.format_exception(error)).strip().splitlines()
        return Outcome(False, "\n".join(lines[-TRACEBACK_LINES:]))
    finally:  # what a failed check may leave behind: a process group, memory
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()
        if run.cuda:
            torch.cuda.empty_cache()


def run_all(run: DeviceRun, budget_s: float | None, out: Path) -> DeviceReport:
    """Run `CHECKS` within `budget_s`, writing the report to `out` after each (see the module docstring)."""
    started = time.perf_counter()
    report = DeviceReport(
        device=describe(run.device),
        torch=torch.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        quick=run.quick,
        budget_s=budget_s,
        pending=list(CHECKS),
    )
    write_report(report, out)  # (every check pending: what a run cut short in the first leaves)
    for name, check in CHECKS.items():
        elapsed = time.perf_counter() - started
        if budget_s is not None and elapsed >= budget_s:
            detail = f"not started: the budget of {budget_s:g} s was spent ({elapsed:.0f} s elapsed)"
            report.checks.append(CheckRecord(name=name, passed=None, detail=detail, seconds=0.0))
        else:
            logger.info("running %s (%.0f s elapsed)", name, elapsed)
            start = time.perf_counter()
            outcome = run_check(name, check, run)
            seconds = time.perf_counter() - start
            report.checks.append(
                CheckRecord(name=name, passed=outcome.passed, detail=outcome.detail, seconds=seconds)
            )
            report.ratios += outcome.ratios
            report.memory += outcome.memory
        report.pending.remove(name)
        report.seconds = time.perf_counter() - started
        write_report(report, out)
    return report


def _cell(text: str) -> str:
    """`text` fit for one Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", "<br>")


def _status(passed: bool | None) -> str:
    return {True: "pass", False: "**FAIL**", None: "skipped"}[passed]


def format_markdown(report: DeviceReport) -> str:
    failed = len(report.failed)
    budget = f"--budget-s {report.budget_s:g}; " if report.budget_s is not None else ""
    state = f"{len(report.pending)} not yet run; " if report.pending else ""
    lines = [
        "# flatgrad device report",
        "",
        f"{report.device}; torch {report.torch}; {report.date}; {'--quick; ' if report.quick else ''}"
        f"{budget}{report.seconds:.0f} s; {state}{failed} failed check{'s' if failed != 1 else ''}",
        "",
        "## Checks",
        "",
        "| check | result | seconds | detail |",
        "|---|---|---:|---|",
    ]
    lines += [
        f"| {_cell(c.name)} | {_status(c.passed)} | {c.seconds:.1f} | {_cell(c.detail)} |"
        for c in report.checks
    ]
    lines += [f"| {_cell(name)} | not yet run | | |" for name in report.pending]
    lines += ["", "## Ratios (flatgrad / stock; below 1: flatgrad faster; medians, interleaved)", ""]
    lines += ["| measurement | flatgrad ms | stock ms | ratio |", "|---|---:|---:|---:|"]
    lines += [
        f"| {_cell(r.name)} | {r.flatgrad_ms:.3f} | {r.stock_ms:.3f} | {r.ratio:.2f} |" for r in report.ratios
    ]
    lines += ["", "## Memory (peak allocated in a training step, counted from before its build)", ""]
    lines += [
        "| flatgrad / stock | flatgrad MiB | stock MiB | ratio | parameters "
        "| flatgrad B/param | stock B/param |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {_cell(m.name)} | {m.flatgrad_bytes / 2**20:.2f} | {m.stock_bytes / 2**20:.2f} | "
        f"{m.flatgrad_bytes / m.stock_bytes if m.stock_bytes else float('nan'):.2f} | "
        f"{m.num_params / 1e6:.2f}M | {m.flatgrad_bytes / m.num_params:.1f} | "
        f"{m.stock_bytes / m.num_params:.1f} |"
        for m in report.memory
    ]
    return "\n".join(lines) + "\n"


def write_report(report: DeviceReport, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(report.model_dump_json(indent=2) + "\n")
    (out / "report.md").write_text(format_markdown(report))


# The options: argparse's settings and the help of each.
OPTIONS: dict[str, tuple[dict[str, Any], str]] = {
    "--device": (
        {"choices": ("cuda", "cpu"), "default": "cuda" if torch.cuda.is_available() else "cpu"},
        "where to run (default: cuda when available, else cpu)",
    ),
    "--quick": ({"action": "store_true"}, "scaled-down workloads (a minute on a small CPU)"),
    "--out": ({"type": Path, "required": True}, "directory for report.json and report.md"),
    "--budget-s": (
        {"type": positive_float},
        "start no check once this many seconds are spent; the rest are reported skipped "
        "(a check already running finishes first: leave a minute above it)",
    ),
    "--threads": (
        {"type": positive_int},
        "CPU threads of this process (torch.set_num_threads; default: torch's). On a CPU shared "
        "with other work, 1 keeps OpenMP's barriers from timing the scheduler instead of the kernels",
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = command_line("python -m flatgrad.bench.device", __doc__, OPTIONS)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device, and torch.cuda.is_available() is False")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the checks (within --budget-s), writing the reports after each; returns the exit
    status (1: a check failed)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = (
        torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    )
    report = run_all(DeviceRun(device, args.quick), args.budget_s, args.out)
    for record in report.checks:
        print(f"{_status(record.passed):9s} {record.seconds:6.1f} s  {record.name}")
    print(f"{len(report.failed)} failed; reports in {args.out}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
