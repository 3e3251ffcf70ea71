"""What the optim_db suites share (tests/test_sharded_optim_db.py through ShardedOptimizer,
tests/test_optim_db_plain.py through FlatGrad and DataParallel with the plain optimizer):
torch's configurations (`optim_db_configs`), the model and batches every configuration
trains on, a training loop that records where it raised, and how far two runs' parameters
are apart (`distance`)."""

from __future__ import annotations

import copy
import json
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

STEPS = 4  # parameters are compared after HALF and STEPS steps
HALF = STEPS // 2


@dataclass(frozen=True)
class Config:
    """One configuration of one optim_db class.

    Attributes:
        cls: the torch optimizer class.
        desc: optim_db's description of the configuration (with `` & foreach`` and the like
            for the implementation flags).
        kwargs: the constructor arguments.
        shard_by: ShardedOptimizer's ``shard_by`` (None: its default; the plain paths: None).
    """

    cls: type[torch.optim.Optimizer]
    desc: str
    kwargs: dict[str, Any]
    shard_by: str | None = None

    @property
    def key(self) -> str:
        by = "" if self.shard_by is None else f" shard_by={self.shard_by!r}"
        return f"{self.cls.__name__}[{self.desc}]{by}"


def optim_db_configs() -> list[Config]:
    """Every CPU configuration of every optim_db class: each of ``optim_inputs_func(device=
    "cpu")`` with the implementation flags the class supports (``supported_impls``) all
    False, then each True in turn (as torch's
    ``_get_optim_inputs_including_global_cliquey_kwargs``, except that ``foreach=True`` is
    kept: torch leaves it out on CPU because the fast foreach kernels are not there, but
    plain torch runs it) and ``fused=True`` only where ``supports_fused_on`` has "cpu";
    then each of ``optim_error_inputs_func(device="cpu")`` that takes no parameters of its
    own (invalid arguments: stock raises, so must ours). CUDA-only ones (``capturable=True``,
    fused where torch says it is not supported) are not yielded for CPU."""
    from torch.testing._internal.common_optimizers import optim_db  # (slow: only here, not on the ranks)

    configs = []
    for info in optim_db:
        name = info.optim_cls.__name__
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
        configs += [Config(info.optim_cls, desc, kwargs) for desc, kwargs in variants]
    return configs


def check_unique(configs: list[Config]) -> None:
    keys = Counter(config.key for config in configs)
    assert max(keys.values()) == 1, [key for key, count in keys.items() if count > 1]


_INITIAL: dict[bool, nn.Module] = {}


def two_d(config: Config) -> bool:
    """Whether `config`'s class takes 2-D parameters only (Muon)."""
    return config.cls.__name__ == "Muon"


def model(two_d: bool) -> nn.Module:
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


def reset(module: nn.Module, two_d: bool) -> None:
    """Give `module` (a `model(two_d)`, or its copy) the first values again, and no `.grad`."""
    with torch.no_grad():
        for p, q in zip(module.parameters(), _INITIAL[two_d].parameters()):
            p.copy_(q)
            p.grad = None


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(100 * rank + step))


def error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0][:300]


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def train(
    module: nn.Module,
    forward: Callable[[torch.Tensor], torch.Tensor],
    make_optimizer: Callable[[], torch.optim.Optimizer],
    rank: int,
    closure_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
    steps: int = STEPS,
    round_trip: bool = False,
) -> dict[str, Any]:
    """Build the optimizer and take `steps` steps (zero_grad, ``forward(batch).square().sum()``
    backward, step) on `rank`'s batches: `module`'s parameters after HALF and STEPS steps
    (``"points"``), or where it raised (``"raised"``: "construction" or "step <n>", and
    ``"error"``). With `closure_loss` every step is ``step(closure)`` (LBFGS needs one), the
    closure returning ``closure_loss(loss)`` (on several ranks: the loss averaged over them, so
    that LBFGS decides alike on every rank). With `round_trip`, before step HALF a fresh
    optimizer loads a deep copy of its ``state_dict()`` (as a resume from a file does: the
    class's own load casts and places the values) and carries on."""
    try:
        optimizer = make_optimizer()
    except Exception as error:  # noqa: BLE001  (a refusal, compared by the caller)
        return {"raised": "construction", "error": error_text(error)}
    points = {}
    for step in range(steps):
        data = batch(rank, step)

        def closure(data: torch.Tensor = data) -> torch.Tensor:
            optimizer.zero_grad()  # noqa: B023  (called in this iteration)
            loss = forward(data).square().sum()
            loss.backward()
            assert closure_loss is not None
            return closure_loss(loss.detach())

        try:
            if round_trip and step == HALF:
                saved = copy.deepcopy(optimizer.state_dict())
                optimizer = make_optimizer()
                optimizer.load_state_dict(saved)
            if closure_loss is not None:
                optimizer.step(closure)
            else:
                optimizer.zero_grad()
                forward(data).square().sum().backward()
                optimizer.step()
        except Exception as error:  # noqa: BLE001
            return {"raised": f"step {step}", "error": error_text(error)}
        if step + 1 in (HALF, STEPS):
            points[step + 1] = snapshot(module)
    return {"points": points}


def distance(
    ours: dict[str, torch.Tensor], points: dict[str, torch.Tensor], rtol: float, atol: float
) -> dict[str, Any]:
    """How far our parameters (a `snapshot`) are from stock's `points`: the largest
    ``|ours - stock| / (atol + rtol * |stock|)`` (at most 1 passes, as
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
        ratio = max(ratio, worst(diff, atol + rtol * ref.abs()))
        rel = max(rel, worst(diff, ref.abs()))
    return {"ratio": ratio, "rel": rel, "bitwise": bitwise}


def table(configs: list[Config], verdicts: dict[str, tuple[str, str | None]], columns: list[str]) -> str:
    """Configurations per class and verdict category (the others in a last column)."""
    counts: dict[str, Counter[str]] = {}
    for config in configs:
        counts.setdefault(config.cls.__name__, Counter())[verdicts[config.key][0]] += 1
    lines = [f"{'class':<10} {'configs':>7} " + " ".join(f"{c:>10}" for c in columns) + "  other"]
    for name, count in counts.items():
        other = {k: v for k, v in count.items() if k not in columns}
        lines.append(
            f"{name:<10} {sum(count.values()):>7} "
            + " ".join(f"{count[c]:>10}" for c in columns)
            + (f"  {other}" if other else "")
        )
    return "\n".join(lines)


def rank_records(folder: str, world_size: int) -> list[dict[str, dict[str, Any]]]:
    """Each rank's records by configuration key, from the ``rank<r>.jsonl`` files the
    multi-rank workers write into `folder` (one JSON line per configuration run)."""
    return [
        {
            line["key"]: line
            for line in map(json.loads, Path(folder, f"rank{rank}.jsonl").read_text().splitlines())
        }
        for rank in range(world_size)
    ]
