"""`python -m flatgrad.bench.device`: the CPU --quick run end to end (its report must hold
every figure and every check passed), a failing check reported as such with a non-zero exit,
the budget, the report written after every check, the peak measurement on cases whose answer
is known, and on CUDA (marked gpu, run on request) the whole command. Whether flatgrad is
right on the device is tests/test_cuda.py's and the other gpu-marked tests'."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flatgrad.bench import device
from flatgrad.bench.device import DeviceRun, Outcome
from flatgrad.bench.memory import peak_bytes, peak_in_step
from flatgrad.bench.suite import single_rank_group

REPO = Path(__file__).resolve().parents[1]
CPU = DeviceRun(torch.device("cpu"), quick=True)


def _run_cli(out: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """The command in a fresh interpreter, importing flatgrad from this checkout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "flatgrad.bench.device", *args, "--out", str(out)]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _load(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


@pytest.mark.distributed
def test_quick_cpu_run_writes_a_complete_report(tmp_path: Path):
    # (one thread: on the 2 shared cores here OpenMP's barriers otherwise time the scheduler)
    proc = _run_cli(tmp_path, "--device", "cpu", "--quick", "--threads", "1", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = _load(tmp_path)
    assert isinstance(report["device"], str) and report["device"].startswith("CPU")
    assert report["torch"] == torch.__version__
    assert isinstance(report["date"], str) and report["date"][:2] == "20"
    assert [c["name"] for c in report["checks"]] == list(device.CHECKS)
    assert report["pending"] == [] and report["budget_s"] is None
    for check in report["checks"]:
        assert check["passed"] is True and check["detail"], check
    # 6 one-process steps, 6 data-parallel (gpt), 2 mixed precision, 7 single-op backwards
    assert len(report["ratios"]) == 21
    for row in report["ratios"]:
        assert row["name"] and row["flatgrad_ms"] > 0 and row["stock_ms"] > 0 and row["ratio"] > 0, row
    names = [row["name"] for row in report["ratios"]]
    assert "data-parallel step gpt: flatgrad_zero / ddp_bucket_view" in names
    assert [n.split(": ", 1)[1] for n in names if n.startswith("mixed precision")] == [
        "flatgrad_main_grads / ddp_autocast",
        "flatgrad_main_grads / ddp_bf16",
    ]
    assert len(report["memory"]) == len(device.MEMORY_PAIRS) + 2
    for row in report["memory"]:
        assert row["name"] and row["flatgrad_bytes"] > 0 and row["stock_bytes"] > 0, row
        assert row["num_params"] > 0, row
    markdown = (tmp_path / "report.md").read_text()
    for heading in ("## Checks", "## Ratios", "## Memory", "| check | result |", "| measurement |"):
        assert heading in markdown
    assert "| skipped |" not in markdown and "B/param" in markdown and "not yet run" not in markdown


@pytest.mark.distributed
def test_quick_cpu_run_with_a_budget_brings_back_a_partial_report(tmp_path: Path):
    """--budget-s 1: the checks started within 1 s report (the first), every one after is
    skipped as over budget (the last among them), in both files."""
    proc = _run_cli(tmp_path, "--device", "cpu", "--quick", "--threads", "1", "--budget-s", "1", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = _load(tmp_path)
    assert [c["name"] for c in report["checks"]] == list(device.CHECKS)
    assert report["pending"] == [] and report["budget_s"] == 1
    over = [c for c in report["checks"] if c["detail"].startswith("not started: the budget of 1 s")]
    assert over and over[-1]["name"] == list(device.CHECKS)[-1], report["checks"]
    first = report["checks"].index(over[0])
    assert report["checks"][first:] == over, "a check started after one was over budget"
    assert all(c["passed"] is None and c["seconds"] == 0 for c in over)
    assert report["checks"][0]["passed"] is True  # (started at 0 s)
    markdown = (tmp_path / "report.md").read_text()
    assert "--budget-s 1;" in markdown
    assert markdown.count("not started: the budget of 1 s") == len(over)


def _boom(run: DeviceRun) -> Outcome:
    raise RuntimeError("boom on purpose")


def _fine(run: DeviceRun) -> Outcome:
    return Outcome(True, "fine")


def test_a_raising_check_fails_the_run_and_the_others_still_run(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setattr(device, "CHECKS", {"raises": _boom, "after it": _fine})
    assert device.main(["--device", "cpu", "--out", str(tmp_path)]) == 1
    checks = {c["name"]: c for c in _load(tmp_path)["checks"]}
    assert checks["raises"]["passed"] is False
    assert "RuntimeError: boom on purpose" in checks["raises"]["detail"]
    assert "Traceback" in checks["raises"]["detail"] or "_boom" in checks["raises"]["detail"]
    assert checks["after it"]["passed"] is True
    markdown = (tmp_path / "report.md").read_text()
    assert "| raises | **FAIL** |" in markdown and "boom on purpose" in markdown
    assert "1 failed" in capsys.readouterr().out


def test_a_check_left_with_a_process_group_is_cleaned_up(tmp_path: Path, monkeypatch):
    def leaves_a_group(run: DeviceRun) -> Outcome:
        torch.distributed.init_process_group(
            "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
        )
        raise ValueError("left a group behind")

    monkeypatch.setattr(device, "CHECKS", {"leaves": leaves_a_group, "needs none": _fine})
    assert device.main(["--device", "cpu", "--out", str(tmp_path)]) == 1
    assert not torch.distributed.is_initialized()


class _Clock:
    """A stand-in for the `time` module in `device`: seconds pass only when a check says."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_the_budget_stops_starting_checks_and_skips_the_rest(tmp_path: Path, monkeypatch):
    """Checks of 1 s against a 1.5 s budget: the first two start (at 0 and 1 s), the others
    are skipped (at 2 s), in report.json and report.md."""
    clock = _Clock()

    def one_second(run: DeviceRun) -> Outcome:
        clock.now += 1.0
        return Outcome(True, "fine")

    checks = {"first": one_second, "second": one_second, "third": _fine, "fourth": _fine}
    monkeypatch.setattr(device, "CHECKS", checks)
    monkeypatch.setattr(device, "time", clock)
    assert device.main(["--device", "cpu", "--budget-s", "1.5", "--out", str(tmp_path)]) == 0
    report = _load(tmp_path)
    assert [(c["name"], c["passed"]) for c in report["checks"]] == [
        ("first", True),
        ("second", True),
        ("third", None),
        ("fourth", None),
    ]
    assert report["checks"][2]["detail"] == "not started: the budget of 1.5 s was spent (2 s elapsed)"
    markdown = (tmp_path / "report.md").read_text()
    assert "--budget-s 1.5;" in markdown and "| fourth | skipped | 0.0 | not started: the budget" in markdown


def test_the_report_is_written_after_every_check(tmp_path: Path, monkeypatch):
    """What a run cut short leaves: the second check reads the files the first left."""
    seen: dict = {}

    def reads_the_report(run: DeviceRun) -> Outcome:
        seen.update(_load(tmp_path))
        seen["markdown"] = (tmp_path / "report.md").read_text()
        return Outcome(True, "read it")

    checks = {"first": _fine, "reads the report": reads_the_report, "last": _fine}
    monkeypatch.setattr(device, "CHECKS", checks)
    assert device.main(["--device", "cpu", "--out", str(tmp_path)]) == 0
    assert [c["name"] for c in seen["checks"]] == ["first"]
    assert seen["pending"] == ["reads the report", "last"]
    assert "| last | not yet run |" in seen["markdown"] and "2 not yet run;" in seen["markdown"]
    final = _load(tmp_path)
    assert [c["name"] for c in final["checks"]] == list(checks) and final["pending"] == []


def test_a_budget_must_be_positive(tmp_path: Path, capsys):
    with pytest.raises(SystemExit):
        device.parse_args(["--device", "cpu", "--budget-s", "0", "--out", str(tmp_path)])
    assert "must be a positive number, got 0" in capsys.readouterr().err


def test_cuda_without_a_gpu_is_refused(tmp_path: Path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(SystemExit):
        device.parse_args(["--device", "cuda", "--out", str(tmp_path)])
    assert "--device cuda needs a CUDA device" in capsys.readouterr().err


def test_peak_bytes_of_a_known_allocation():
    """The oracle: a 4 MiB tensor held while a 1 MiB one comes and goes, inside a range."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        big = torch.ones(1 << 20)  # 4 MiB
        with torch.profiler.record_function("inside"):
            small = torch.ones(1 << 18)  # 1 MiB
            del small
        del big
    assert (5 << 20) <= peak_bytes(prof) < (5 << 20) + 4096
    assert (5 << 20) <= peak_bytes(prof, within="inside") < (5 << 20) + 4096
    with pytest.raises(ValueError, match="must hold one 'missing' range, got 0"):
        peak_bytes(prof, within="missing")


def _allocates(num_bytes: int):
    """A step that holds a tensor of `num_bytes` across steps and frees a temporary of the
    same size inside each."""
    held = torch.ones(num_bytes // 4)

    def step() -> None:
        temporary = torch.ones(num_bytes // 4)
        del temporary
        held.add_(1)

    return step


def test_the_peak_in_a_step_counts_what_was_built_and_what_the_step_adds():
    """The oracle: 1 MiB built with the step and held, 1 MiB more inside each step."""
    with single_rank_group("gloo", torch.device("cpu")):
        peak = peak_in_step(torch.device("cpu"), functools.partial(_allocates, 1 << 20))
    assert (2 << 20) <= peak < (2 << 20) + 4096


def test_memory_rows_pair_every_flatgrad_configuration_with_stock(monkeypatch):
    """Stand-in peaks (a configuration's name's length): each row carries its pair's."""
    monkeypatch.setattr(device, "peak_in_step", lambda where, make: len(make.args[0]))
    outcome = device.check_memory(CPU)
    assert [(m.flatgrad_bytes, m.stock_bytes) for m in outcome.memory] == [
        (len(a), len(b)) for a, b in device.MEMORY_PAIRS
    ]
    assert {m.num_params for m in outcome.memory} == {4 * (512 * 512 + 512)}  # (LargeMLP 512x4 on CPU)


# --- on CUDA (skipped here) ---------------------------------------------------------------

# The prepared lease command (../shared/gpu/prepare.sh) runs the device report itself, then
# `pytest -m gpu` within 100 s: running the report again there would leave no time for the
# other GPU tests. FLATGRAD_DEVICE_COMMAND_TESTS=1 runs it from pytest too.
command_tests = pytest.mark.skipif(
    os.environ.get("FLATGRAD_DEVICE_COMMAND_TESTS") != "1" or not torch.cuda.is_available(),
    reason="the device command runs on its own (set FLATGRAD_DEVICE_COMMAND_TESTS=1 on a GPU to run it here)",
)


@pytest.mark.gpu
@pytest.mark.distributed
@command_tests
@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
def test_device_command_on_cuda_passes_every_check(tmp_path: Path, quick: bool):
    """The full run must finish within the lease's 6 minutes on one H100."""
    proc = _run_cli(tmp_path, "--device", "cuda", *(["--quick"] if quick else []), timeout=900)
    report = _load(tmp_path)
    failed = [(c["name"], c["detail"]) for c in report["checks"] if c["passed"] is not True]
    assert not failed, failed
    assert proc.returncode == 0
    assert quick or report["seconds"] < 360
