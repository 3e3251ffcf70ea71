"""Device truth: flatgrad against stock PyTorch on the device at hand, in one command.

python -m flatgrad.bench.device --out DIR                 # CUDA when available, else CPU
python -m flatgrad.bench.device --device cpu --quick --out DIR [--threads 1]

Writes DIR/report.json and DIR/report.md and exits 1 if any check failed. Every check runs
isolated: an exception inside one is that check failing (with its traceback's tail), and the
run goes on. A check that does not apply to the device is reported as skipped, with why.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict

from flatgrad.bench import (
    device_checks,
    device_comm,
    device_cuda,
    device_mixed,
    device_mixed_comm,
    device_mixed_perf,
    device_perf,
)
from flatgrad.bench.cli import cpu_name, positive_int
from flatgrad.bench.device_base import CheckRecord, DeviceRun, MemoryRecord, Outcome, RatioRecord, now

logger = logging.getLogger("flatgrad.bench.device")  # also under python -m

Check = Callable[[DeviceRun], Outcome]
CHECKS: dict[str, Check] = {
    "exactness: float64 (tied LM, checkpoint, unused branch)": device_checks.check_exact_float64,
    "exactness: bf16 autocast (float32 parameters)": device_checks.check_exact_bf16_autocast,
    "exactness: main grads (bf16 tied LM, float64 oracles)": device_mixed.check_main_grad_exactness,
    "zero-copy backward: ops": device_checks.check_zero_copy_ops,
    "zero-copy backward: CUDA memcpy": device_checks.check_zero_copy_kernels,
    "main grads: no weight-sized temporary (routed bf16 Linear)": device_mixed.check_linear_no_temporary,
    "main grads: out_dtype GEMM on CUDA": device_mixed.check_out_dtype_gemm,
    "sort-free backward: ops": device_checks.check_sort_free_ops,
    "sort-free backward: CUDA kernels": device_checks.check_sort_free_kernels,
    "collectives: NCCL world size 1": device_cuda.check_nccl_single_rank,
    "collectives: gloo 2 ranks": device_comm.check_gloo_two_ranks,
    "mixed precision: ShardedOptimizer world size 1 against float32 masters": (
        device_mixed_comm.check_sharded_main_grads
    ),
    "cuda branches covered": device_cuda.check_cuda_branches,
    "ratios: training steps": device_perf.check_step_ratios,
    "ratios: GPT bf16": device_perf.check_gpt_ratio,
    "ratios: embedding backward": device_perf.check_embedding_ratios,
    "ratios: gathers": device_perf.check_gather_ratios,
    "memory: peak allocated": device_perf.check_memory,
    "ratios and memory: mixed precision": device_mixed_perf.check_mixed_precision,
}
TRACEBACK_LINES = 12


class DeviceReport(BaseModel):
    """report.json."""

    model_config = ConfigDict(extra="forbid")
    device: str
    torch: str
    date: str
    quick: bool
    seconds: float
    checks: list[CheckRecord]
    ratios: list[RatioRecord]
    memory: list[MemoryRecord]

    @property
    def failed(self) -> list[CheckRecord]:
        return [c for c in self.checks if c.passed is False]


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    threads = torch.get_num_threads()
    return f"CPU: {cpu_name()}, {threads} thread{'s' if threads != 1 else ''}"


def _tail(error: BaseException) -> str:
    lines = "".join(traceback.format_exception(type(error), error, error.__traceback__)).strip().splitlines()
    return "\n".join(lines[-TRACEBACK_LINES:])


def _clean_up(run: DeviceRun) -> None:
    """What a failed check may leave behind: a process group, deterministic mode, memory."""
    if dist.is_initialized():
        dist.destroy_process_group()
    torch.use_deterministic_algorithms(False)
    gc.collect()
    if run.cuda:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.empty_cache()


def run_check(name: str, check: Check, run: DeviceRun) -> Outcome:
    """`check(run)`, an exception turned into a failed outcome with the traceback's tail."""
    try:
        return check(run)
    except Exception as error:  # isolation: one check failing must not stop the others
        logger.warning("check %r failed: %s: %s", name, type(error).__name__, error)
        return Outcome(False, _tail(error))
    finally:
        _clean_up(run)


def run_all(run: DeviceRun, checks: dict[str, Check] | None = None) -> DeviceReport:
    started = time.perf_counter()
    records, ratios, memory = [], [], []
    for name, check in (CHECKS if checks is None else checks).items():
        logger.info("running %s", name)
        start = time.perf_counter()
        outcome = run_check(name, check, run)
        seconds = time.perf_counter() - start
        records.append(CheckRecord(name=name, passed=outcome.passed, detail=outcome.detail, seconds=seconds))
        ratios += outcome.ratios
        memory += outcome.memory
    return DeviceReport(
        device=describe(run.device),
        torch=torch.__version__,
        date=now(),
        quick=run.quick,
        seconds=time.perf_counter() - started,
        checks=records,
        ratios=ratios,
        memory=memory,
    )


def _cell(text: str) -> str:
    """`text` fit for one Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", "<br>")


def _status(passed: bool | None) -> str:
    return {True: "pass", False: "**FAIL**", None: "skipped"}[passed]


def format_markdown(report: DeviceReport) -> str:
    failed = len(report.failed)
    lines = [
        "# flatgrad device report",
        "",
        f"{report.device}; torch {report.torch}; {report.date}; {'--quick; ' if report.quick else ''}"
        f"{report.seconds:.0f} s; {failed} failed check{'s' if failed != 1 else ''}",
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
    lines += ["", "## Ratios (flatgrad / stock; below 1: flatgrad faster; medians, interleaved)", ""]
    lines += ["| measurement | flatgrad ms | stock ms | ratio |", "|---|---:|---:|---:|"]
    lines += [
        f"| {_cell(r.name)} | {r.flatgrad_ms:.3f} | {r.stock_ms:.3f} | {r.ratio:.2f} |" for r in report.ratios
    ]
    lines += ["", "## Memory (peak allocated in a training step: AdamW, zero_grad(set_to_none=True))", ""]
    lines += ["| flatgrad / stock | flatgrad MiB | stock MiB | ratio |", "|---|---:|---:|---:|"]
    lines += [
        f"| {_cell(m.name)} | {m.flatgrad_bytes / 2**20:.2f} | {m.stock_bytes / 2**20:.2f} | "
        f"{m.flatgrad_bytes / m.stock_bytes if m.stock_bytes else float('nan'):.2f} |"
        for m in report.memory
    ]
    return "\n".join(lines) + "\n"


def write_report(report: DeviceReport, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(report.model_dump_json(indent=2) + "\n")
    (out / "report.md").write_text(format_markdown(report))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m flatgrad.bench.device", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where to run (default: cuda when available, else cpu)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="scaled-down workloads (a minute on a small CPU)"
    )
    parser.add_argument("--out", type=Path, required=True, help="directory for report.json and report.md")
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="CPU threads of this process (torch.set_num_threads; default: torch's). On a CPU shared "
        "with other work, 1 keeps OpenMP's barriers from timing the scheduler instead of the kernels",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device, and torch.cuda.is_available() is False")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every check, write the reports; returns the exit status (1: a check failed)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = (
        torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    )
    report = run_all(DeviceRun(device, args.quick))
    write_report(report, args.out)
    for record in report.checks:
        print(f"{_status(record.passed):9s} {record.seconds:6.1f} s  {record.name}")
    print(f"{len(report.failed)} failed; reports in {args.out}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
