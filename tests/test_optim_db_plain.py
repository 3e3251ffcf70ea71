"""torch's own optimizer database (``optim_db`` of ``torch.testing._internal.common_optimizers``)
through the plain paths: `flatgrad.FlatGrad` + the torch optimizer in one process, and
`flatgrad.ReplicateModule` + the torch optimizer on 2 gloo ranks.

Every class in optim_db, every configuration it has for CPU (`optim_db_harness.
optim_db_configs`: each ``optim_inputs_func(device="cpu")`` entry with each implementation
flag the class supports on in turn, and the error inputs that bring no parameters of their
own), on the harness's float64 model of Linears (every Linear routed: ``linear_min_numel=0``),
4 steps on fixed batches (different on each rank), parameters compared after 2 and 4 steps.
LBFGS steps with a closure (which returns the loss averaged over the ranks, so that it
decides alike on every rank), every other class with zero_grad, backward, step.

The oracle is the same torch optimizer with the same arguments on a deep copy of the model:
the plain model in one process, stock DDP on 2 ranks. What each configuration must do
(`_verdict`):

- stock steps: in one process ours is bit for bit stock's (the same optimizer code steps
  the same parameters from gradients that are bit for bit stock's: fresh backwards, see
  tests/test_module_db.py); on 2 ranks within rtol = 1e-12 (atol = 0), the float64 bound of
  two-rank runs (the average of two gradients is the same sum either way; the count of
  bitwise configurations is printed with ``-s``);
- stock raises (at construction: a bad argument; at a step: SparseAdam, whose gradients
  here are dense; ``differentiable=True``): ours raises the same exception type at the same
  point;
- on 2 ranks, both ranks have the same outcome.

The 2-rank configurations run in one call on one persistent pair of ranks
(`_configs_worker`), each one's record appended to a file as it ends.
``time python -m pytest -q tests/test_optim_db_plain.py``: see the README's test section
for the measured time.
"""

from __future__ import annotations

import copy
import json
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import ROUTE_ALL
from dist_utils import run_ranks
from optim_db_harness import (
    HALF,
    STEPS,
    Config,
    check_unique,
    distance,
    model,
    optim_db_configs,
    rank_records,
    reset,
    table,
    train,
    two_d,
)
from torch.nn.parallel import DistributedDataParallel as DDP

import flatgrad

pytest.importorskip("expecttest")  # torch.testing._internal.common_optimizers imports it

RTOL_RANKS = 1e-12
COLUMNS = ["bitwise", "close", "both raise"]


def _configs() -> list[Config]:
    configs = optim_db_configs()
    check_unique(configs)
    return configs


def _optimizer(config: Config, module: torch.nn.Module) -> Any:
    return lambda: config.cls(module.parameters(), **copy.deepcopy(config.kwargs))


def _closure_loss(config: Config, world_size: int) -> Any:
    """LBFGS's closure returns the loss (averaged over the ranks); None for the others."""
    if config.cls.__name__ != "LBFGS":
        return None
    if world_size == 1:
        return lambda loss: loss

    def averaged(loss: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(loss)
        return loss / world_size

    return averaged


def _one_process(config: Config) -> dict[str, Any]:
    """Stock's run and ours (FlatGrad + the same optimizer), each on its own copy."""
    flat_2d = two_d(config)
    ref = model(flat_2d)
    flat = flatgrad.FlatGrad(model(flat_2d), config=ROUTE_ALL)
    loss = _closure_loss(config, 1)
    stock = train(ref, ref, _optimizer(config, ref), 0, loss)
    ours = train(flat, flat, _optimizer(config, flat), 0, loss)
    return {"stock": stock, "ours": ours}


def _compared(record: dict[str, Any], rtol: float) -> dict[str, Any]:
    """`record` with our points replaced by their `distance` from stock's."""
    stock, ours = record["stock"], dict(record["ours"])
    if "points" in stock and "points" in ours:
        ours["points"] = {
            point: distance(ours["points"][point], stock["points"][point], rtol, 0.0)
            for point in ours["points"]
        }
    return {"stock": {k: v for k, v in stock.items() if k != "points"}, "ours": ours}


def _verdict(records: list[dict[str, Any]], exact: bool) -> tuple[str, str | None]:
    """The configuration's category ("bitwise", "close", "both raise") and its failure
    (None when it meets the module's expectations), from every rank's `_compared` record."""
    if any("error" in record and "ours" not in record for record in records):
        return "error", f"the test itself raised:\n{[r.get('error') for r in records]}"
    outcomes = {
        (r["stock"].get("raised"), r["ours"].get("raised"), r["ours"].get("error", "").split(":")[0])
        for r in records
    }
    if len(outcomes) > 1:
        return "divergent", f"ranks disagree: {outcomes}"
    stock, ours = records[0]["stock"], records[0]["ours"]
    if "raised" in stock:
        same = (
            ours.get("raised") == stock["raised"]
            and ours.get("error", "").split(":")[0] == stock["error"].split(":")[0]
        )
        return (
            "both raise",
            None if same else f"stock raised at {stock['raised']} ({stock['error']}), ours: {ours}",
        )
    if "raised" in ours:
        return "raised", f"ours raised at {ours['raised']}: {ours['error']} (stock did not)"
    points = [d for record in records for d in record["ours"]["points"].values()]
    if len(points) != 2 * len(records):
        return "error", f"not compared after {HALF} and {STEPS} steps: {ours}"
    bitwise = all(d["bitwise"] for d in points)
    if exact and not bitwise:
        return "close", f"not bitwise in one process: {points}"
    if any(d["ratio"] > 1.0 for d in points):
        return "differs", f"parameters differ from stock beyond rtol={RTOL_RANKS}: {points}"
    return ("bitwise" if bitwise else "close"), None


def _report(
    configs: list[Config], verdicts: dict[str, tuple[str, str | None]], what: str, rels: dict[str, float]
) -> None:
    print(f"\n{what}:\n{table(configs, verdicts, COLUMNS)}")
    if rels:
        print(f"not bitwise: {len(rels)}, largest relative difference {max(rels.values()):.2e}")
    failures = [f"{key}: {failure}" for key, (_, failure) in verdicts.items() if failure is not None]
    assert not failures, f"{len(failures)} of {len(configs)} configurations failed:\n" + "\n".join(failures)


def test_optim_db_one_process_equals_stock():
    configs = _configs()
    verdicts = {}
    for config in configs:
        try:
            record = _compared(_one_process(config), 0.0)
        except Exception:  # noqa: BLE001  (recorded: the test fails with it)
            record = {"error": traceback.format_exc()}
        verdicts[config.key] = _verdict([record], exact=True)
    _report(configs, verdicts, "one process, FlatGrad + the torch optimizer", {})


def _run_ranks_config(rank: int, world_size: int, config: Config, refs: dict[bool, DDP]) -> dict[str, Any]:
    """Stock DDP + the optimizer (one DDP per model, set back to the first values: its
    constructor is a good part of a configuration's time) and ours, DataParallel over a
    FlatGrad of a fresh copy, in several small buckets."""
    flat_2d = two_d(config)
    if flat_2d not in refs:
        refs[flat_2d] = DDP(model(flat_2d))
    ref = refs[flat_2d]
    reset(ref.module, flat_2d)
    loss = _closure_loss(config, world_size)
    stock = train(ref.module, ref, _optimizer(config, ref), rank, loss)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model(flat_2d), config=ROUTE_ALL), bucket_cap_mb=0.0002)
    ours = train(dp, dp, _optimizer(config, dp), rank, loss)
    return _compared({"stock": stock, "ours": ours}, RTOL_RANKS)


def _configs_worker(rank: int, world_size: int, configs: list[Config], out: str) -> None:
    """Every configuration in turn, each one's record appended to `out`/rank<rank>.jsonl."""
    refs: dict[bool, DDP] = {}
    with open(Path(out, f"rank{rank}.jsonl"), "w") as file:
        for config in configs:
            try:
                record = _run_ranks_config(rank, world_size, config, refs)
            except Exception:  # noqa: BLE001  (recorded: the test fails with it)
                record = {"error": traceback.format_exc()}
            file.write(json.dumps({"key": config.key, **record}) + "\n")
            file.flush()


@pytest.mark.distributed
def test_optim_db_data_parallel_equals_stock_ddp(tmp_path):
    configs = _configs()
    world_size = 2
    run_ranks(_configs_worker, configs, str(tmp_path), world_size=world_size, timeout=600)
    ranks = rank_records(str(tmp_path), world_size)
    missing = {"error": "not run"}
    verdicts = {
        config.key: _verdict([records.get(config.key, missing) for records in ranks], exact=False)
        for config in configs
    }
    rels = {
        key: max(d["rel"] for records in ranks for d in records[key]["ours"]["points"].values())
        for key, (category, _) in verdicts.items()
        if category == "close"
    }
    _report(configs, verdicts, f"{world_size} ranks, DataParallel + the torch optimizer", rels)
