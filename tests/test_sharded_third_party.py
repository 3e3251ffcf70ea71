"""`flatgrad.ShardedOptimizer` with third-party optimizers (the ``optimizers`` extra):
lion-pytorch's Lion, pytorch-optimizer's Lamb, LARS and Adan, schedule-free AdamW.

The oracle is stock DDP + the same optimizer class on a deep copy (`oracle.stock`), stepped
in lockstep on the same per-rank batches; 2 and 3 gloo ranks, float64. Each case checks
which kind the probe gave (``opt.shard_by``) or that the class is refused, and compares
the parameters after several steps, through a state_dict round trip into a fresh
ShardedOptimizer (and a fresh model) half-way; schedule-free AdamW goes through its
``train()``/``eval()`` calls as its README prescribes (``train()`` before training steps,
``eval()`` before evaluation and the checkpoint) and is compared at both points. Every
parameter is updated by the same optimizer code from the same averaged gradient, so the
only difference from stock is the gradient average's summation order: rtol = atol = 1e-12.

All cases of a world size run in one call on the ranks (`_cases_worker`), which records
each case's outcome in a file; the tests read those. ``time python -m pytest -q
tests/test_sharded_third_party.py``: 26 to 46 s on 2 cores shared with other jobs (load 4 to
5.5), about 35 s of CPU, most of it the five ranks' start (importing torch) and closing.
A library that is not installed skips its cases (`pytest.importorskip`).
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import json
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from conftest import ROUTE_ALL
from dist_utils import run_ranks
from oracle import Lockstep, stock
from torch import nn

import flatgrad

pytestmark = pytest.mark.distributed

RTOL = ATOL = 1e-12
STEPS = 6  # the state_dict round trip after STEPS // 2


@dataclass(frozen=True)
class Case:
    """One optimizer under ShardedOptimizer.

    Attributes:
        module, name: where the class is (``importlib.import_module(module).<name>``).
        options: its constructor arguments (ShardedOptimizer's ``**kwargs``).
        shard_by: ShardedOptimizer's ``shard_by``.
        expect: the kind ``opt.shard_by`` must be, or the start of the message a refused
            class raises (``"ValueError: ..."``).
        schedule_free: whether it needs ``train()``/``eval()`` calls.
    """

    module: str
    name: str
    options: dict[str, Any] = field(default_factory=dict)
    shard_by: Literal["element", "tensor"] | None = None
    expect: str = "tensor"
    schedule_free: bool = False


ADAN = {"lr": 0.01, "weight_decay": 0.02}
SCHEDULE_FREE = {"lr": 0.01, "warmup_steps": 2, "weight_decay": 0.01}
CASES = {
    # element-wise (flatgrad's registry), also by tensor when asked
    "lion": Case("lion_pytorch", "Lion", {"lr": 0.01, "weight_decay": 0.1}, None, "element"),
    "lion-tensor": Case("lion_pytorch", "Lion", {"lr": 0.01, "weight_decay": 0.1}, "tensor", "tensor"),
    "adan": Case("pytorch_optimizer", "Adan", ADAN, None, "element"),
    # per tensor: a trust ratio ||p|| / ||update|| per parameter
    "lamb": Case("pytorch_optimizer", "Lamb", {"lr": 0.01, "weight_decay": 0.01}),
    "lamb-element": Case(
        "pytorch_optimizer",
        "Lamb",
        {"lr": 0.01},
        "element",
        "ValueError: Lamb updates each tensor as a whole (shard_by='tensor')",
    ),
    "lars": Case("pytorch_optimizer", "LARS", {"lr": 0.01, "weight_decay": 0.01}),
    # registered per tensor, refuted by the probe for these options: pre_norm scales every
    # gradient by max_grad_norm / the global gradient norm
    "lamb-pre_norm": Case(
        "pytorch_optimizer",
        "Lamb",
        {"lr": 0.01, "pre_norm": True, "max_grad_norm": 1.0},
        None,
        "ValueError: ShardedOptimizer cannot shard Lamb by tensor: a probe compared",
    ),
    # element-wise, with train()/eval() of its own
    "schedulefree": Case(
        "schedulefree", "AdamWScheduleFree", SCHEDULE_FREE, None, "element", schedule_free=True
    ),
    "schedulefree-tensor": Case(
        "schedulefree", "AdamWScheduleFree", SCHEDULE_FREE, "tensor", "tensor", schedule_free=True
    ),
}


def _installed(case: Case) -> bool:
    return importlib.util.find_spec(case.module) is not None


def _small() -> tuple[nn.Module, flatgrad.DataParallel]:
    """A float64 model of several slots (tests/test_sharded.py's `_small`) and DataParallel
    over it (several buckets)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    return model, flatgrad.DataParallel(flatgrad.FlatGrad(model, config=ROUTE_ALL), bucket_mb=0.0002)


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(100 * rank + step))


def _sum_of_squares(output: torch.Tensor) -> torch.Tensor:
    return output.square().sum()


def _worst(pair: Lockstep) -> dict[str, float]:
    """How far our parameters are from stock's: the largest ``|ours - stock|`` over
    ``atol + rtol * |stock|`` (at most 1 passes, as `torch.testing.assert_close`), and the
    largest relative difference."""
    ours = dict(pair.model.named_parameters())
    ratio = rel = 0.0
    for name, ref in pair.ref.module.named_parameters():
        diff = (ours[name].detach() - ref.detach()).abs()
        ratio = max(ratio, (diff / (ATOL + RTOL * ref.detach().abs())).max().item())
        rel = max(rel, (diff / ref.detach().abs().clamp_min(1e-300)).max().item())
    return {"ratio": ratio, "rel": rel}


def _saved_and_loaded(state_dict: dict[str, Any]) -> dict[str, Any]:
    """`state_dict` through ``torch.save`` and ``torch.load(weights_only=True)``, as a
    checkpoint file would bring it back."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _run_case(rank: int, case: Case) -> dict[str, Any]:
    """Build ours (or find it refused), step it in lockstep with stock, round-trip its
    state_dict into a fresh ShardedOptimizer half-way: `_worst` at each compared point."""
    cls = getattr(importlib.import_module(case.module), case.name)
    model, dp = _small()
    ref, ref_opt = stock(model, cls, **case.options)
    try:
        opt = flatgrad.ShardedOptimizer(dp, cls, shard_by=case.shard_by, **case.options)
    except ValueError as error:
        return {"raised": f"ValueError: {error}"}
    record: dict[str, Any] = {"shard_by": opt.shard_by, "points": {}}
    pair = Lockstep(model, dp, opt, ref, ref_opt, loss=_sum_of_squares)
    if case.schedule_free:
        pair.opt.train()  # type: ignore[attr-defined]
        pair.ref_opt.train()  # type: ignore[attr-defined]
    for step in range(STEPS):
        if step == STEPS // 2:
            if case.schedule_free:  # checkpoints are taken at the evaluation point
                record["points"][f"train {step}"] = _worst(pair)
                pair.opt.eval()  # type: ignore[attr-defined]
                pair.ref_opt.eval()  # type: ignore[attr-defined]
                record["points"][f"eval {step}"] = _worst(pair)
            saved = _saved_and_loaded(pair.opt.state_dict())
            model2, dp2 = _small()
            with torch.no_grad():
                for p, q in zip(model2.parameters(), model.parameters()):
                    p.copy_(q)
            opt2 = flatgrad.ShardedOptimizer(dp2, cls, shard_by=case.shard_by, **case.options)
            opt2.load_state_dict(saved)
            pair = Lockstep(model2, dp2, opt2, ref, ref_opt, loss=_sum_of_squares)
            if case.schedule_free:
                pair.opt.train()  # type: ignore[attr-defined]
                pair.ref_opt.train()  # type: ignore[attr-defined]
        pair.train_step(_batch(rank, step))
    record["points"][f"train {STEPS}"] = _worst(pair)
    if case.schedule_free:
        pair.opt.eval()  # type: ignore[attr-defined]
        pair.ref_opt.eval()  # type: ignore[attr-defined]
        record["points"][f"eval {STEPS}"] = _worst(pair)
    return record


def _cases_worker(rank: int, world_size: int, names: list[str], out: str) -> None:
    """Every case in `names`, in turn; each one's record (or the traceback it raised) goes
    to `out`/rank<rank>.json. Ranks raise alike (the same classes, probes and data), so a
    case that raises leaves the ranks in step for the next one (one that raised on some
    ranks only leaves the others in a collective: gloo's timeout or run_ranks' ends it)."""
    records = {}
    for name in names:
        try:
            records[name] = _run_case(rank, CASES[name])
        except Exception:  # noqa: BLE001  (recorded: the case's test fails with it)
            records[name] = {"error": traceback.format_exc()}
    Path(out, f"rank{rank}.json").write_text(json.dumps(records))


_RESULTS: dict[int, list[dict[str, Any]] | str] = {}


def _results(world_size: int, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The records of every rank for `world_size`: one call on the ranks runs every
    installed library's cases, the first time a test asks (a call that failed as a whole
    fails every test of its world size, without running again)."""
    if world_size not in _RESULTS:
        names = [name for name, case in CASES.items() if _installed(case)]
        out = tmp_path_factory.mktemp(f"third_party_{world_size}")
        try:
            run_ranks(_cases_worker, names, str(out), world_size=world_size)
        except BaseException as error:
            _RESULTS[world_size] = f"the ranks' call failed: {error}"
            raise
        _RESULTS[world_size] = [
            json.loads(Path(out, f"rank{rank}.json").read_text()) for rank in range(world_size)
        ]
    results = _RESULTS[world_size]
    if isinstance(results, str):
        pytest.fail(results)
    return results


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_third_party_optimizer_equals_stock_ddp(name, world_size, tmp_path_factory):
    case = CASES[name]
    pytest.importorskip(case.module)
    for rank, records in enumerate(_results(world_size, tmp_path_factory)):
        record = records[name]
        assert "error" not in record, f"rank {rank} raised:\n{record['error']}"
        if case.expect.startswith("ValueError"):
            assert "raised" in record, f"rank {rank}: not refused, shard_by={record.get('shard_by')!r}"
            assert record["raised"].startswith(case.expect), f"rank {rank}: {record['raised']}"
            continue
        assert "raised" not in record, f"rank {rank}: {record['raised']}"
        assert record["shard_by"] == case.expect, f"rank {rank}: probed {record['shard_by']!r}"
        for point, worst in record["points"].items():
            assert worst["ratio"] <= 1.0, f"rank {rank} at {point}: {worst} (rtol = atol = {RTOL})"
