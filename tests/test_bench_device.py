"""`python -m flatgrad.bench.device`: the CPU --quick run end to end (its report must hold
every figure, every check passed or skipped with a reason), a failing check reported as such
with a non-zero exit, the measuring helpers on cases whose answer is known, the main-grad
checks failing on a main grad made the wrong way, and on CUDA (marked gpu, skipped here) the
whole command and each CUDA-only branch of the library."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import run_ranks
from torch import nn

import flatgrad
from flatgrad.bench import (
    device,
    device_checks,
    device_cuda,
    device_headline,
    device_mixed,
    device_mixed_comm,
    device_mixed_perf,
)
from flatgrad.bench.device_base import DeviceRun, Outcome, peak_bytes, single_rank_group
from flatgrad.bench.device_comm import paths_outcome, run_paths, stock_plain

REPO = Path(__file__).resolve().parents[1]
CPU = DeviceRun(torch.device("cpu"), quick=True)
OUT_DTYPE_CHECK = "main grads: out_dtype GEMM on CUDA"
# Checks that must run for real on CPU (not be skipped).
CPU_CHECKS = {
    "exactness: float64 (tied LM, checkpoint, unused branch)",
    "exactness: bf16 autocast (float32 parameters)",
    "exactness: main grads (bf16 tied LM, float64 oracles)",
    "zero-copy backward: ops",
    "main grads: no weight-sized temporary (routed bf16 Linear)",
    "sort-free backward: ops",
    "collectives: gloo 2 ranks",
    "mixed precision: ShardedOptimizer world size 1 against float32 masters",
    "ratios: training steps",
    "ratios: GPT bf16",
    "ratios: embedding backward",
    "ratios: gathers",
    "memory: peak allocated",
    "ratios and memory: mixed precision",
    "ratios and memory: bench Llama and GPT, one process, bf16 autocast",
    "ratios and memory: data-parallel world size 1, bf16 autocast",
}
MIXED = device_mixed_perf.FLATGRAD


def _run_cli(out: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """The command in a fresh interpreter, importing flatgrad from this checkout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "flatgrad.bench.device", *args, "--out", str(out)]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _load(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


@pytest.mark.distributed
def test_quick_cpu_run_writes_a_complete_report(tmp_path: Path):
    # (one thread and 10 minutes: on the 2 shared cores here, under a load average of 6, the
    # run was still in its training-step ratios after 139 s and past 300 s at the end)
    proc = _run_cli(tmp_path, "--device", "cpu", "--quick", "--threads", "1", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = _load(tmp_path)
    assert isinstance(report["device"], str) and report["device"].startswith("CPU")
    assert report["torch"] == torch.__version__
    assert isinstance(report["date"], str) and report["date"][:2] == "20"
    assert [c["name"] for c in report["checks"]] == list(device.CHECKS)
    assert report["pending"] == [] and report["budget_s"] is None
    for check in report["checks"]:
        assert check["passed"] in (True, None), check
        assert isinstance(check["detail"], str) and check["detail"], check
    assert {c["name"] for c in report["checks"] if c["passed"] is True} == CPU_CHECKS
    assert len(report["ratios"]) >= 22
    for row in report["ratios"]:
        assert row["name"] and row["flatgrad_ms"] > 0 and row["stock_ms"] > 0 and row["ratio"] > 0, row
    assert any("20-element table" in row["name"] for row in report["ratios"])
    stock_sides = [f"{MIXED} / {device_mixed_perf.AUTOCAST}", f"{MIXED} / {device_mixed_perf.BF16}"]
    mixed = [row["name"] for row in report["ratios"] if row["name"].startswith("mixed precision GPT")]
    assert [name.split(": ", 1)[1] for name in mixed] == stock_sides
    assert len(report["memory"]) == 12
    for row in report["memory"]:
        assert row["name"] and row["flatgrad_bytes"] > 0 and row["stock_bytes"] > 0, row
        assert row["num_params"] > 0, row
    headline = [row["name"] for row in report["ratios"] if row["name"].startswith("step bench")]
    assert [name.split(": ", 1)[1] for name in headline] == [
        "flatgrad / stock",
        "flatgrad / stock",
        f"DDP(FlatGrad) + allreduce_hook / {device_headline.STOCK_DDP}",
        f"DataParallel / {device_headline.STOCK_DDP}",
        f"ShardedOptimizer / {device_headline.STOCK_DDP}",
    ]
    assert [row["name"].split(": ", 1)[1] for row in report["memory"][-2:]] == stock_sides
    checks = {c["name"]: c for c in report["checks"]}
    assert "fused_accumulate('cpu') is False" in checks["main grads: out_dtype GEMM on CUDA"]["detail"]
    markdown = (tmp_path / "report.md").read_text()
    for heading in ("## Checks", "## Ratios", "## Memory", "| check | result |", "| measurement |"):
        assert heading in markdown
    assert markdown.count("| skipped |") == len(device.CHECKS) - len(CPU_CHECKS)
    assert "B/param" in markdown and "not yet run" not in markdown


@pytest.mark.distributed
def test_quick_cpu_run_with_a_budget_brings_back_a_partial_report(tmp_path: Path):
    """--budget-s 5: the checks started within 5 s report, every one after is skipped as
    over budget (the mixed-precision one, last, among them), in both files. (20 s was
    within what the whole quick run takes on an idle machine: no check was over.)"""
    proc = _run_cli(tmp_path, "--device", "cpu", "--quick", "--threads", "1", "--budget-s", "5", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = _load(tmp_path)
    assert [c["name"] for c in report["checks"]] == list(device.CHECKS)
    assert report["pending"] == [] and report["budget_s"] == 5
    over = [c for c in report["checks"] if c["detail"].startswith("not started: the budget of 5 s")]
    assert over and over[-1]["name"] == "ratios and memory: mixed precision", report["checks"]
    first = report["checks"].index(over[0])
    assert report["checks"][first:] == over, "a check started after one was over budget"
    assert all(c["passed"] is None and c["seconds"] == 0 for c in over)
    assert report["checks"][0]["passed"] is True  # (the exactness checks come first)
    markdown = (tmp_path / "report.md").read_text()
    assert "--budget-s 5;" in markdown
    assert markdown.count("not started: the budget of 5 s") == len(over)


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


def test_the_zero_copy_check_fails_on_stock_backward(monkeypatch):
    """With FlatGrad replaced by the plain model, the check must see stock's copies."""
    assert device_checks.check_zero_copy_ops(CPU).passed is True
    monkeypatch.setattr(device_checks.flatgrad, "FlatGrad", lambda model, config=None: model)
    outcome = device_checks.check_zero_copy_ops(CPU)
    assert outcome.passed is False and "flatgrad [0, 0]" not in outcome.detail


def test_the_exactness_check_reports_a_wrong_gradient():
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    stock = nn.Linear(4, 3).double()
    stock.load_state_dict(model.state_dict())
    flat = flatgrad.FlatGrad(model, config=device_checks.ROUTE_ALL)
    x = torch.randn(5, 4, dtype=torch.float64)
    flat(x).sum().backward()
    stock(x).sum().backward()
    assert device_checks._grad_problems(flat, stock, 1e-12)[0] == []
    with torch.no_grad():
        model.weight.grad[0, 0] += 1e-6
    problems, worst = device_checks._grad_problems(flat, stock, 1e-12)
    assert len(problems) == 1 and problems[0].startswith("weight: max |flatgrad - stock|") and worst > 1e-12


def test_the_sort_counter_sees_index_put():
    """weight[idx] backward is index_put_(accumulate=True): the counter must find it."""
    weight = torch.randn(50, 4, requires_grad=True)
    prof = device_checks.profile_backward(CPU, weight[torch.randint(0, 50, (200,))])
    assert prof.count(device_checks.SORT_OPS) >= 1


def test_single_rank_paths_on_gloo_match_a_plain_stock_model():
    """What the NCCL world-size-1 check runs, here on an in-process gloo rank."""
    with single_rank_group("gloo", torch.device("cpu")):
        results = run_paths(torch.device("cpu"), oracle=stock_plain)
    outcome = paths_outcome(results, "gloo world size 1")
    assert outcome.passed, outcome.detail
    assert results["DDP + allreduce_hook"]["allreduces_per_step"] == [1, 1, 1]


def _bf16_product(main: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """A main grad made the wrong way: the product rounded to bfloat16 in a weight-sized
    temporary, then added."""
    main.add_(a @ b)


def test_the_main_grad_checks_fail_on_a_bfloat16_product(monkeypatch):
    """The operand oracle sees the product's bfloat16 rounding (about 2^-9 of an element, far
    above float32 round-off), and the profile sees its weight-sized temporary."""
    assert device_mixed.check_linear_no_temporary(CPU).passed is True
    monkeypatch.setattr(flatgrad._functional, "add_product", _bf16_product)
    outcome = device_mixed.check_main_grad_exactness(CPU)
    assert outcome.passed is False and "from the operand oracle" in outcome.detail
    profile = device_mixed.profile_linear(CPU, main_grads=True)
    assert 2 * device_mixed.IN * device_mixed.OUT in profile.weight_sized()  # (the bf16 product)
    assert device_mixed.check_linear_no_temporary(CPU).passed is False


def test_the_sharded_check_fails_against_a_reference_that_does_not_clip(monkeypatch):
    """Every step clips (norms about 7, clipped to 2): a reference that does not cannot match."""
    monkeypatch.setattr(device_mixed_comm, "_clip", lambda masters: None)
    outcome = device_mixed_comm.check_sharded_main_grads(CPU)
    assert outcome.passed is False and "gloo world size 1" in outcome.detail, outcome.detail


def test_rotated_timers_take_turns_going_first():
    calls: list[int] = []
    timers = [lambda k=k: calls.append(k) or float(k) for k in range(3)]
    times = device_mixed_perf.rotated(timers, repeats=2, warmup=1)
    assert calls == [0, 1, 2, 1, 2, 0, 2, 0, 1]
    assert times == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]


def test_cuda_only_checks_are_skipped_with_a_reason_on_cpu():
    for check in (
        device_cuda.check_nccl_single_rank,
        device_cuda.check_cuda_branches,
        device_mixed.check_out_dtype_gemm,
    ):
        outcome = check(CPU)
        assert outcome.passed is None and outcome.detail


# --- on CUDA (skipped here) ---------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# The prepared lease command (../shared/gpu/prepare.sh) runs the device report itself, then
# `pytest -m gpu` within 100 s: running the report again there would leave no time for the
# other GPU tests. FLATGRAD_DEVICE_COMMAND_TESTS=1 runs it from pytest too.
command_tests = pytest.mark.skipif(
    os.environ.get("FLATGRAD_DEVICE_COMMAND_TESTS") != "1",
    reason="the device command runs on its own (set FLATGRAD_DEVICE_COMMAND_TESTS=1 to run it here)",
)


@pytest.mark.gpu
@pytest.mark.distributed
@needs_cuda
@command_tests
@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
def test_device_command_on_cuda_passes_every_check(tmp_path: Path, quick: bool):
    """The full run must finish within 6 minutes on one H100 (docs/gpu.md: the estimate)."""
    proc = _run_cli(tmp_path, "--device", "cuda", *(["--quick"] if quick else []), timeout=900)
    report = _load(tmp_path)
    # (only the out_dtype GEMM check may skip on CUDA: a torch without that kernel says so)
    failed = [
        (c["name"], c["detail"])
        for c in report["checks"]
        if c["passed"] is not True and not (c["passed"] is None and c["name"] == OUT_DTYPE_CHECK)
    ]
    assert not failed, failed
    assert proc.returncode == 0
    assert quick or report["seconds"] < 360


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "check",
    [
        device_checks.check_exact_float64,
        device_checks.check_exact_bf16_autocast,
        device_checks.check_zero_copy_kernels,
        device_checks.check_sort_free_kernels,
        device_mixed.check_main_grad_exactness,
        device_mixed.check_linear_no_temporary,
        device_mixed.check_out_dtype_gemm,
        device_mixed_comm.check_sharded_main_grads,
    ],
    ids=lambda c: c.__name__,
)
def test_device_check_on_cuda(check):
    outcome = check(DeviceRun(torch.device("cuda", 0), quick=True))
    if outcome.passed is None and check is device_mixed.check_out_dtype_gemm:
        pytest.skip(outcome.detail)  # (this torch has no such kernel; the detail says so)
    assert outcome.passed is True, outcome.detail


def _branch_worker(rank: int, world_size: int, index: int) -> None:
    where, what, show = device_cuda.BRANCHES[index]
    show(DeviceRun(torch.device("cuda", 0), quick=True))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("index", range(len(device_cuda.BRANCHES)), ids=[b[0] for b in device_cuda.BRANCHES])
def test_cuda_branch_runs_and_matches_stock(index: int):
    """Each CUDA-only branch of the library, on one NCCL rank, with its evidence."""
    run_ranks(_branch_worker, index, world_size=1, backend="nccl")
