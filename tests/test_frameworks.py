"""The framework recipes (examples/lightning_train.py, examples/accelerate_train.py) on 2 CPU
processes under torchrun: the comm hook runs once per step, every `.grad` is a view of the
flat buffer after each backward, and the parameters equal the same framework's run without
flatgrad (float64; both sides sum the same two halves: equal to round-off, 1e-12)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.distributed


def _run(script: str, report: Path, *extra: str) -> dict:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        f"examples/{script}", "--steps", "4", "--report", str(report), *extra,
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(report.read_text())


@pytest.mark.parametrize(
    ("script", "package"), [("accelerate_train.py", "accelerate"), ("lightning_train.py", "lightning")]
)
def test_framework_recipe_uses_the_hook_zero_copy_and_matches_stock(
    tmp_path: Path, script: str, package: str
):
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed (pip install -e '.[frameworks]')")
    ours = _run(script, tmp_path / "ours.json")
    stock = _run(script, tmp_path / "stock.json", "--stock")
    assert ours["world_size"] == 2
    assert ours["hook_calls"] == ours["steps"] == 4  # one all-reduce of the one buffer per step
    assert ours["grads_in_buffers"] is True
    for p, q in zip(ours["params"], stock["params"]):
        torch.testing.assert_close(torch.tensor(p), torch.tensor(q), rtol=1e-12, atol=1e-12)
