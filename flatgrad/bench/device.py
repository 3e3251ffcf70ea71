"""The device report: flatgrad's speed and memory against stock PyTorch on the device at
hand, in one command (whether flatgrad is right there is `pytest -m gpu`'s to say).

python -m flatgrad.bench.device --out DIR [--budget-s 360]  # CUDA when available, else CPU
python -m flatgrad.bench.device --device cpu --quick --out DIR [--threads 1]

Writes DIR/report.json and DIR/report.md after every check (a run cut short leaves what it
did, the checks still to come listed as not yet run) and exits 1 if any check failed. Every
check runs isolated: an exception inside one is that check failing (with its traceback's
tail), and the run goes on. Each check left when --budget-s seconds are spent is reported
skipped, saying so.
"""

from __future__ import annotations

import argparse
import datetime
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

from flatgrad.bench import device_perf
from flatgrad.bench.cli import cpu_name, positive_float, positive_int
from flatgrad.bench.device_perf import DeviceRun, MemoryRecord, Outcome, RatioRecord

logger = logging.getLogger("flatgrad.bench.device")  # also under python -m

Check = Callable[[DeviceRun], Outcome]
# In the order of what they tell, so that a run cut short has said the most it could.
CHECKS: dict[str, Check] = {
    "ratios: one-process training steps": device_perf.check_step_ratios,
    "ratios: data-parallel world size 1": device_perf.check_data_parallel,
    "memory: peak allocated in a training step": device_perf.check_memory,
    "ratios and memory: mixed precision": device_perf.check_mixed_precision,
    "ratios: single-op backwards": device_perf.check_op_ratios,
}
TRACEBACK_LINES = 12


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


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    threads = torch.get_num_threads()
    return f"CPU: {cpu_name()}, {threads} thread{'s' if threads != 1 else ''}"


def _tail(error: BaseException) -> str:
    lines = "".join(traceback.format_exception(type(error), error, error.__traceback__)).strip().splitlines()
    return "\n".join(lines[-TRACEBACK_LINES:])


def _clean_up(run: DeviceRun) -> None:
    """What a failed check may leave behind: a process group, memory."""
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    if run.cuda:
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


def run_all(run: DeviceRun, budget_s: float | None, out: Path) -> DeviceReport:
    """Run `CHECKS` in order, writing the report to `out` after each (the checks still to
    come listed as pending); none starts once `budget_s` seconds are spent (each is then
    recorded skipped, saying so)."""
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


def _per_param(num_bytes: int, num_params: int) -> str:
    return f"{num_bytes / num_params:.1f}"


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
        f"{m.num_params / 1e6:.2f}M | {_per_param(m.flatgrad_bytes, m.num_params)} | "
        f"{_per_param(m.stock_bytes, m.num_params)} |"
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
        "--budget-s",
        type=positive_float,
        default=None,
        help="start no check once this many seconds are spent; the rest are reported skipped "
        "(a check already running finishes first: leave a minute above it)",
    )
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
