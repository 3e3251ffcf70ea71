"""torch's own optimizer database (``optim_db`` of ``torch.testing._internal.common_optimizers``)
through `flatgrad.ShardedOptimizer`, on 2 and 3 gloo ranks.

Every class in optim_db, every configuration it has for CPU (`_configs`): each of
``optim_inputs_func(device="cpu")``, with each implementation flag the class supports
(``foreach``, ``differentiable``, ``fused`` where torch fuses on CPU) on in turn, and each
of ``optim_error_inputs_func(device="cpu")`` that brings no parameters of its own; the
CUDA-only ones (``capturable=True``, fused where torch says it is not supported) are not
yielded for CPU. Element-wise classes run twice: by flat element shards (the default)
and with ``shard_by="tensor"``; Muon and Adafactor by whole tensors (their default).

The oracle is stock DDP + the same torch optimizer with the same arguments on a copy of
the model (`_run_stock`), trained on the same batches (different on every rank), float64,
a small model of parameters of several shapes (all 2-D for Muon); ours is a
ShardedOptimizer over flatgrad.DataParallel of several small buckets (`_run_ours`), whose
``state_dict()`` is loaded into a fresh ShardedOptimizer over a fresh DataParallel of a
copy of the model before the third step. Parameters are compared after 2 and 4 steps.
What each configuration must do (`_verdict`):

- stock steps: ours equals it within rtol = 1e-12 (atol = 0). Every parameter is updated
  by the same torch optimizer code from the same averaged gradient; what differs is the
  order of the gradient average's sum (3 ranks: about 1e-13 relative) and, for fused
  kernels stepping flat shards, which elements take the vectorised path (1e-16): on 2
  ranks all but a few fused configurations are bitwise;
- stock raises at construction (a bad argument, LBFGS and SparseAdam included): ours
  raises too, on every rank;
- otherwise LBFGS (cross-tensor), SparseAdam (sparse gradients) and
  ``differentiable=True`` (stock raises at the step there): ours refuses at construction
  with a ValueError that says so;
- stock raises at a step: ours raises too, on every rank;
- every rank has the same outcome.

All configurations of a world size run in one call on the ranks (`_configs_worker`: a
rank costs more to start than dozens of configurations), which appends each one's record
to a file as it ends; the test fails with the list of every failing configuration and
prints a table of the outcomes per class (``-s``). 574 configurations per world size,
about 50 collectives each. ``time python -m pytest -q tests/test_sharded_optim_db.py``:
96 to 120 s on 2 cores shared with other jobs (load 2.5 to 6; 2 ranks 31 to 38 s, 3 ranks
62 to 72 s), 105 to 140 s of CPU.
"""

from __future__ import annotations

import copy
import json
import math
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ROUTE_ALL
from dist_utils import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import flatgrad

pytest.importorskip("expecttest")  # torch.testing._internal.common_optimizers imports it

pytestmark = pytest.mark.distributed

RTOL = 1e-12
ATOL = 0.0
STEPS = 4  # the state_dict round trip before step STEPS // 2
HALF = STEPS // 2

# torch's classes whose update of an element reads only that element's state: flat element
# shards by default, and by whole tensors with shard_by="tensor".
ELEMENTWISE = {
    "SGD",
    "Adam",
    "AdamW",
    "Adamax",
    "NAdam",
    "RAdam",
    "Adagrad",
    "Adadelta",
    "RMSprop",
    "Rprop",
    "ASGD",
}
# Whole tensors only (Muon's Newton-Schulz of a matrix, Adafactor's row and column factors).
PER_TENSOR = {"Muon", "Adafactor"}
# Refused at construction, with what the ValueError says.
REFUSED = {"LBFGS": ("cannot shard LBFGS",), "SparseAdam": ("SparseAdam", "sparse gradients")}


@dataclass(frozen=True)
class Config:
    """One configuration of one optim_db class under ShardedOptimizer.

    Attributes:
        cls: the torch optimizer class.
        desc: optim_db's description of the configuration (with `` & foreach`` and the like
            for the implementation flags).
        kwargs: the constructor arguments (also ShardedOptimizer's ``**kwargs``).
        shard_by: ShardedOptimizer's ``shard_by`` (None: its default).
    """

    cls: type[torch.optim.Optimizer]
    desc: str
    kwargs: dict[str, Any]
    shard_by: str | None = None

    @property
    def key(self) -> str:
        by = "" if self.shard_by is None else f" shard_by={self.shard_by!r}"
        return f"{self.cls.__name__}[{self.desc}]{by}"


def _configs() -> list[Config]:
    """Every CPU configuration of every optim_db class: each of ``optim_inputs_func(device=
    "cpu")`` with the implementation flags the class supports (``supported_impls``) all
    False, then each True in turn (as torch's
    ``_get_optim_inputs_including_global_cliquey_kwargs``, except that ``foreach=True`` is
    kept: torch leaves it out on CPU because the fast foreach kernels are not there, but
    plain torch runs it) and ``fused=True`` only where ``supports_fused_on`` has "cpu";
    then each of ``optim_error_inputs_func(device="cpu")`` that takes no parameters of its
    own (invalid arguments: stock raises, so must ours). Every element-wise class's
    configuration comes twice: by default and by tensor."""
    from torch.testing._internal.common_optimizers import optim_db  # (slow: only here, not on the ranks)

    configs = []
    for info in optim_db:
        name = info.optim_cls.__name__
        assert name in ELEMENTWISE | PER_TENSOR | REFUSED.keys(), (
            f"optim_db has {name}: say how it shards here"
        )
        impls = [flag for flag in info.supported_impls if flag != "fused" or "cpu" in info.supports_fused_on]
        variants = []
        for entry in info.optim_inputs_func(device="cpu", dtype=torch.float64):
            assert entry.params is None, (name, entry)  # the parameters are the model's
            base = {**entry.kwargs, **dict.fromkeys(impls, False)}
            variants += [(entry.desc, base)] + [
                (f"{entry.desc} & {flag}", {**base, flag: True}) for flag in impls
            ]
        errors = info.optim_error_inputs_func(device="cpu", dtype=torch.float64)
        for index, error in enumerate(errors):
            entry = error.optimizer_error_input
            if entry.params is None:
                variants.append((f"error input {index}: {entry.desc}", entry.kwargs))
        for desc, kwargs in variants:
            configs.append(Config(info.optim_cls, desc, kwargs))
            if name in ELEMENTWISE:
                configs.append(Config(info.optim_cls, desc, kwargs, "tensor"))
    keys = Counter(config.key for config in configs)
    assert max(keys.values()) == 1, [key for key, count in keys.items() if count > 1]
    return configs


_INITIAL: dict[bool, nn.Module] = {}


def _model(two_d: bool) -> nn.Module:
    """A float64 model of parameters of several shapes (all 2-D, for Muon, with `two_d`);
    the same values on every rank and in every configuration (copies of one)."""
    if two_d not in _INITIAL:
        torch.manual_seed(0)
        bias = not two_d
        _INITIAL[two_d] = nn.Sequential(
            nn.Linear(5, 7, bias=bias),
            nn.Tanh(),
            nn.Linear(7, 6, bias=bias),
            nn.Tanh(),
            nn.Linear(6, 3, bias=bias),
        ).double()
    return copy.deepcopy(_INITIAL[two_d])


def _ours(model: nn.Module) -> flatgrad.DataParallel:
    """flatgrad.DataParallel over `model` (every Linear routed), in several buckets."""
    return flatgrad.DataParallel(flatgrad.FlatGrad(model, config=ROUTE_ALL), bucket_mb=0.0002)


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(100 * rank + step))


def _error(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0][:300]


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _run_stock(rank: int, config: Config, refs: dict[bool, DDP], steps: int = STEPS) -> dict[str, Any]:
    """Stock DDP + ``config.cls`` on a copy of the model: its parameters after HALF and
    STEPS steps (``"points"``), or where it raised (``"raised"``: "construction" or "step
    <n>"); with ``steps=0`` only whether it builds. One DDP per model in `refs` serves
    every configuration (its parameters set back to the model's first: DDP's constructor is
    a good part of a configuration's time)."""
    two_d = config.cls.__name__ == "Muon"
    if two_d not in refs:
        refs[two_d] = DDP(_model(two_d))
    ref = refs[two_d]
    with torch.no_grad():
        for p, q in zip(ref.module.parameters(), _INITIAL[two_d].parameters()):
            p.copy_(q)
            p.grad = None
    try:
        ref_opt = config.cls(ref.parameters(), **copy.deepcopy(config.kwargs))
    except Exception as error:  # noqa: BLE001  (stock's refusal: ours must refuse too)
        return {"raised": "construction", "error": _error(error)}
    points = {}
    for step in range(steps):
        try:
            ref_opt.zero_grad()
            ref(_batch(rank, step)).square().sum().backward()
            ref_opt.step()
        except Exception as error:  # noqa: BLE001
            return {"raised": f"step {step}", "error": _error(error)}
        if step + 1 in (HALF, STEPS):
            points[step + 1] = _snapshot(ref.module)
    return {"points": points}


def _distance(ours: dict[str, torch.Tensor], points: dict[str, torch.Tensor]) -> dict[str, Any]:
    """How far our parameters (a `_snapshot`) are from stock's `points`: the largest
    ``|ours - stock| / (ATOL + RTOL * |stock|)`` (at most 1 passes, as
    `torch.testing.assert_close`), the largest relative difference and whether all are
    bitwise equal."""

    def worst(diff: torch.Tensor, scale: torch.Tensor) -> float:
        # 0 where equal; inf where only stock's is 0, and for a NaN on either side
        return torch.nan_to_num(torch.where(diff == 0, 0.0, diff / scale), nan=math.inf).max().item()

    ratio = rel = 0.0
    bitwise = True
    assert ours.keys() == points.keys(), (list(ours), list(points))
    for name, p in ours.items():
        ref = points[name]
        diff = (p - ref).abs()
        bitwise = bitwise and torch.equal(p, ref)
        ratio = max(ratio, worst(diff, ATOL + RTOL * ref.abs()))
        rel = max(rel, worst(diff, ref.abs()))
    return {"ratio": ratio, "rel": rel, "bitwise": bitwise}


def _run_ours(
    rank: int,
    config: Config,
    stock_points: dict[int, dict[str, torch.Tensor]] | None,
    spares: dict[bool, flatgrad.DataParallel] | None = None,
) -> dict[str, Any]:
    """ShardedOptimizer over DataParallel of the same model, stepped on the same batches,
    its state_dict loaded into a fresh one (over a fresh DataParallel of a copy of the
    model) before step HALF: its ``shard_by`` and `_distance` from `stock_points` after
    HALF and STEPS steps (none without them), or where it raised.

    With `spares` (where ours must refuse at construction) the first DataParallel is the
    spare one of that model, which earlier refusals left as it was (as ShardedOptimizer
    promises: its checks come before anything moves); one that builds takes it away."""
    two_d = config.cls.__name__ == "Muon"
    if spares is None:
        model = _model(two_d)
        dp = _ours(model)
    else:
        if two_d not in spares:
            spares[two_d] = _ours(_model(two_d))
        dp = spares[two_d]
        model = dp.module.module
    try:
        opt = flatgrad.ShardedOptimizer(
            dp, config.cls, shard_by=config.shard_by, **copy.deepcopy(config.kwargs)
        )
    except Exception as error:  # noqa: BLE001
        return {"raised": "construction", "error": _error(error)}
    if spares is not None:
        del spares[two_d]
    record: dict[str, Any] = {"shard_by": opt.shard_by, "points": {}}
    snapshots = {}
    where = "step 0"
    try:
        for step in range(STEPS):
            if step == HALF:
                where = "state_dict"
                saved = opt.state_dict()
                model2 = _model(two_d)
                with torch.no_grad():
                    for p, q in zip(model2.parameters(), model.parameters()):
                        p.copy_(q)
                model, dp = model2, _ours(model2)
                where = "load_state_dict"
                opt = flatgrad.ShardedOptimizer(
                    dp, config.cls, shard_by=config.shard_by, **copy.deepcopy(config.kwargs)
                )
                opt.load_state_dict(saved)
            where = f"step {step}"
            opt.zero_grad()
            dp(_batch(rank, step)).square().sum().backward()
            opt.step()
            if step + 1 in (HALF, STEPS):
                snapshots[step + 1] = _snapshot(model)
    except Exception as error:  # noqa: BLE001
        record.update(raised=where, error=_error(error), trace=traceback.format_exc()[-3000:])
        return record
    if stock_points is not None:
        record["points"] = {point: _distance(snapshots[point], stock_points[point]) for point in snapshots}
    return record


def _must_refuse(config: Config) -> bool:
    """Whether ShardedOptimizer must refuse the configuration (a ValueError at construction)."""
    return config.cls.__name__ in REFUSED or bool(config.kwargs.get("differentiable"))


def _run_config(
    rank: int,
    config: Config,
    stock_runs: dict[tuple[str, str], dict[str, Any]],
    refs: dict[bool, DDP],
    spares: dict[bool, flatgrad.DataParallel],
) -> dict[str, Any]:
    """Stock's run (once per class and configuration: both shard_by share it) and ours."""
    if config.cls.__name__ in REFUSED:  # only built (LBFGS's step needs a closure, SparseAdam's sparse grads)
        return {
            "stock": _run_stock(rank, config, refs, steps=0),
            "ours": _run_ours(rank, config, None, spares),
        }
    key = (config.cls.__name__, config.desc)
    if key not in stock_runs:
        stock_runs.clear()  # (the configurations of both shard_by are neighbours)
        stock_runs[key] = _run_stock(rank, config, refs)
    stock = stock_runs[key]
    record: dict[str, Any] = {"stock": {k: v for k, v in stock.items() if k != "points"}}
    if _must_refuse(config) or stock.get("raised") == "construction":
        record["ours"] = _run_ours(rank, config, stock.get("points"), spares)
    else:
        record["ours"] = _run_ours(rank, config, stock.get("points"))
    return record


def _configs_worker(rank: int, world_size: int, configs: list[Config], out: str) -> None:
    """Every configuration in turn; each one's record (or the traceback it raised) is
    appended to `out`/rank<rank>.jsonl as it ends (the last line names the configuration
    before one that hung). Every rank takes the same path: a configuration that raises is
    recorded and the next one runs."""
    stock_runs: dict[tuple[str, str], dict[str, Any]] = {}
    refs: dict[bool, DDP] = {}
    spares: dict[bool, flatgrad.DataParallel] = {}
    with open(Path(out, f"rank{rank}.jsonl"), "w") as file:
        for config in configs:
            try:
                record = _run_config(rank, config, stock_runs, refs, spares)
            except Exception:  # noqa: BLE001  (recorded: the test fails with it)
                record = {"error": traceback.format_exc()}
            line = json.dumps({"key": config.key, **record})
            file.write(line + "\n")
            file.flush()
            if "Timed out" in line:  # a collective that some rank never joined: the rest would hang too
                break


def _outcome(record: dict[str, Any]) -> tuple[Any, ...]:
    """What must be the same on every rank: where each side raised (if it did) and the kind."""
    if "error" in record and "ours" not in record:
        return ("harness error",)
    stock, ours = record["stock"], record["ours"]
    return (
        stock.get("raised"),
        ours.get("raised"),
        ours.get("error", "").split(":")[0],
        ours.get("shard_by"),
    )


def _verdict(config: Config, records: list[dict[str, Any]]) -> tuple[str, str | None]:
    """The configuration's category ("bitwise", "close", "both raise", "refused") and its
    failure (None when it meets the module's expectations), from every rank's record."""
    name = config.cls.__name__
    outcomes = [_outcome(record) for record in records]
    if len(set(outcomes)) > 1:
        return "divergent", f"ranks disagree: {outcomes}"
    for rank, record in enumerate(records):
        if "error" in record and "ours" not in record:
            return "error", f"rank {rank} raised in the test itself:\n{record['error']}"
    stock, ours = records[0]["stock"], records[0]["ours"]
    if stock.get("raised") == "construction":  # (its error for a bad argument may come before a refusal)
        if "raised" not in ours:
            return "both raise", f"stock raised at construction ({stock['error']}), ours did not"
        return "both raise", None
    refusal = REFUSED.get(name) or (("differentiable=True",) if _must_refuse(config) else None)
    if refusal is not None:
        error = ours.get("error", "")
        if ours.get("raised") != "construction" or not error.startswith("ValueError"):
            return "refused", f"expected a ValueError at construction naming {refusal}, got {ours}"
        if not all(phrase in error for phrase in refusal):
            return "refused", f"the refusal does not say {refusal}: {error}"
        return "refused", None
    if "raised" in stock:
        if "raised" not in ours:
            return "both raise", f"stock raised at {stock['raised']} ({stock['error']}), ours did not"
        return "both raise", None
    if "raised" in ours:
        trace = ours.get("trace", "")
        return "raised", f"ours raised at {ours['raised']}: {ours['error']} (stock did not)\n{trace}"
    expected = config.shard_by or ("tensor" if name in PER_TENSOR else "element")
    if ours["shard_by"] != expected:
        return "shard_by", f"shard_by is {ours['shard_by']!r}, expected {expected!r}"
    if any(len(record["ours"]["points"]) != 2 for record in records):
        return "error", f"not compared after {HALF} and {STEPS} steps: {records[0]['ours']}"
    worst = {
        f"rank {rank} after {point} steps": distance
        for rank, record in enumerate(records)
        for point, distance in record["ours"]["points"].items()
        if distance["ratio"] > 1.0
    }
    if worst:
        return "differs", f"parameters differ from stock beyond rtol={RTOL}, atol={ATOL}: {worst}"
    bitwise = all(d["bitwise"] for record in records for d in record["ours"]["points"].values())
    return ("bitwise" if bitwise else "close"), None


# Configurations that fail for a reason in flatgrad still to be fixed (key: `Config.key`).
KNOWN_FAILURES: set[str] = set()


def _table(configs: list[Config], verdicts: dict[str, tuple[str, str | None]]) -> str:
    counts: dict[str, Counter[str]] = {}
    for config in configs:
        counts.setdefault(config.cls.__name__, Counter())[verdicts[config.key][0]] += 1
    columns = ["bitwise", "close", "both raise", "refused"]
    lines = [f"{'class':<10} {'configs':>7} " + " ".join(f"{c:>10}" for c in columns) + "  other"]
    for name, count in counts.items():
        other = {k: v for k, v in count.items() if k not in columns}
        lines.append(
            f"{name:<10} {sum(count.values()):>7} "
            + " ".join(f"{count[c]:>10}" for c in columns)
            + (f"  {other}" if other else "")
        )
    return "\n".join(lines)


@pytest.mark.parametrize("world_size", [2, 3])
def test_optim_db_equals_stock_ddp(world_size, tmp_path):
    configs = _configs()
    try:
        run_ranks(_configs_worker, configs, str(tmp_path), world_size=world_size, timeout=600)
    except BaseException:
        files = [Path(tmp_path, f"rank{rank}.jsonl") for rank in range(world_size)]
        done = [len(file.read_text().splitlines()) if file.exists() else 0 for file in files]
        hung = sorted({configs[n].key for n in done if n < len(configs)})
        print(f"configurations done per rank: {done}; in progress: {hung}")
        raise
    ranks = [
        {
            line["key"]: line
            for line in map(json.loads, Path(tmp_path, f"rank{rank}.jsonl").read_text().splitlines())
        }
        for rank in range(world_size)
    ]
    missing = {"error": "not run: the ranks stopped after a collective timed out"}
    verdicts = {
        config.key: _verdict(config, [records.get(config.key, missing) for records in ranks])
        for config in configs
    }
    print(f"\n{world_size} ranks:\n{_table(configs, verdicts)}")
    rels = {
        key: max(d["rel"] for records in ranks for d in records[key]["ours"]["points"].values())
        for key, (category, _) in verdicts.items()
        if category == "close"
    }
    if rels:
        shown = rels if len(rels) <= 20 else {}
        print(f"not bitwise: {len(rels)}, largest relative difference {max(rels.values()):.2e}; {shown}")
    failures = [
        f"{key}: {failure}"
        for key, (_, failure) in verdicts.items()
        if failure is not None and key not in KNOWN_FAILURES
    ]
    fixed = sorted(key for key in KNOWN_FAILURES if verdicts[key][1] is None)
    assert not failures, f"{len(failures)} of {len(configs)} configurations failed:\n" + "\n".join(failures)
    assert not fixed, f"KNOWN_FAILURES that pass now (remove them): {fixed}"
