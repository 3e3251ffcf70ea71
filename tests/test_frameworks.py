"""The framework recipes (examples/lightning_train.py, examples/accelerate_train.py) on 2 CPU
processes under torchrun (gloo, 127.0.0.1).

Each recipe runs twice in the same 2 processes (``--compare``), with flatgrad and as the same
framework's stock DDP run, and reports per step (examples/recipe_probe.py): the comm hook's
calls so far (one bucket: one call per step), gradient-sized copy ops the profiler saw in
backward, and whether every `.grad` was a view of `flat.grad_buffers`. Oracle for the
result: the stock run's final parameters; float64 and two ranks, so both sides add the same
two halves and differ only by round-off in the layer backwards (1e-12).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
STEPS = 4
DEADLINE_S = 180  # a run takes 15-30 s; a hung rendezvous or collective must not hang the suite

pytestmark = pytest.mark.distributed


def _needs(package: str) -> None:
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed: pip install -e '.[dev,frameworks]'")


def _run(script: str, report: Path, *extra: str) -> tuple[dict[str, Any], str]:
    """torchrun the example on 2 processes; returns rank 0's reports (by run) and the output."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        f"examples/{script}", "--steps", str(STEPS), "--report", str(report), *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: on timeout the ranks die with torchrun
    )  # fmt: skip
    try:
        output, _ = process.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{script} did not finish within {DEADLINE_S} s:\n{output[-3000:]}")
    assert process.returncode == 0, output[-6000:]
    return json.loads(report.read_text()), output


def _assert_params_equal(ours: dict[str, Any], stock: dict[str, Any]) -> None:
    assert len(ours["params"]) == len(stock["params"])
    for p, q in zip(ours["params"], stock["params"]):
        torch.testing.assert_close(torch.tensor(p), torch.tensor(q), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("script", "package"), [("accelerate_train.py", "accelerate"), ("lightning_train.py", "lightning")]
)
def test_recipe_runs_the_hook_once_per_step_without_copies_and_matches_stock(
    tmp_path: Path, script: str, package: str
) -> None:
    _needs(package)
    reports, output = _run(script, tmp_path / "report.json", "--compare")
    ours, stock = reports["flatgrad"], reports["stock"]
    assert ours["world_size"] == stock["world_size"] == 2
    assert ours["hook_calls"] == list(range(1, STEPS + 1))  # one all-reduce of the one buffer per step
    assert stock["num_calls"] == 0
    assert ours["grads_in_buffers"] == [True] * STEPS
    # Steps 0 and 1 copy once into DDP's first buckets (allocated before the hook adopts them, and
    # again at DDP's bucket rebuild in iteration 2); from then on nothing is copied. Stock DDP
    # copies every weight matrix into its bucket and back every step: the counter sees copies.
    assert ours["grad_copies"][2:] == [0] * (STEPS - 2), ours["grad_copies"]
    assert all(n > 0 for n in stock["grad_copies"]), stock["grad_copies"]
    assert "allreduce_hook has not run" not in output
    assert "largest parameter difference" in output
    _assert_params_equal(ours, stock)


def test_lightning_hook_given_to_ddp_strategy_never_runs_on_cpu_and_flatgrad_says_so(tmp_path: Path) -> None:
    """The recipe Lightning's docs suggest, `DDPStrategy(ddp_comm_hook=...)`, registers the hook
    on CUDA only: on CPU it never runs, DDP copies, and flatgrad logs that once per rank."""
    _needs("lightning")
    reports, output = _run("lightning_train.py", tmp_path / "report.json", "--hook-via-lightning")
    report = reports["flatgrad"]
    assert report["hook_calls"] == [0] * STEPS
    assert all(n > 0 for n in report["grad_copies"]), report["grad_copies"]
    assert output.count("allreduce_hook has not run in 2 steps") == 2, output[-6000:]
    assert "register it yourself on CPU" in output
