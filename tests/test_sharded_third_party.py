"""`flatgrad.ShardedOptimizer` with every third-party class in flatgrad's registry
(`flatgrad._optim_kinds.REGISTRY`) whose package is installed (the ``optimizers`` extra).

The oracle is stock DDP + the same optimizer class on a deep copy (`oracle.stock`), stepped
in lockstep on the same per-rank batches on 2 gloo ranks, and taking the same state_dict
round trip into a fresh optimizer as ours. Each registered class is built
with its registry kind left to ShardedOptimizer (``shard_by=None``): an element or tensor
class must report that kind and its parameters must equal stock's after every step, through
a state_dict -> ``torch.save`` -> ``torch.load`` -> fresh ShardedOptimizer (and fresh model)
round trip after step 3 of 6; a refused class must raise its registry reason at
construction, on every rank. Each class runs in one group and in two groups (the second
holding the last bias alone: by tensor, one rank's inner group is empty). Schedule-free
classes go through ``train()``/``eval()`` as their README prescribes and are compared at
both points; the *Closure variants step with a closure.

The model's first weight has 5120 elements (20 blocks of 256, above 4096): bitsandbytes'
8-bit classes quantise it blockwise and torchao's low-bit ones do too, so the quantised
path is the one compared, not the 32-bit fallback for small tensors.

Tolerances: on 2 ranks the averaged gradient is (a + b) / 2 on both sides, the same bits,
and every parameter is updated by the same optimizer code from it, so float64 classes are
held to rtol = atol = 1e-12 (round-off of another summation order, which 2 ranks do not
even have). Classes that refuse float64 (FAdam, torchao's) run in float32 at rtol = atol =
1e-6, about 8 float32 ulps: the same updates, but a class may take a fused (foreach) path
over its group's tensor list on one side and a per-tensor one over the shard's on the
other, whose float32 results may differ in the last bits.

Every case runs in one call on the ranks (`_cases_worker`), which records each case's
outcome (and its seconds) in a file; the tests read those. ``time python -m pytest -q
tests/test_sharded_third_party.py``, 2 idle cores, all packages installed: 66 s (51 s of
cases per rank; bitsandbytes 16 s, pytorch-optimizer 24 s, torchao 9 s of it), 122 s the
first time on a machine (torchao's torch.compile with an empty inductor cache).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import io
import json
import time
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
import flatgrad._optim_kinds
from flatgrad._optim_kinds import REGISTRY, Registered

pytestmark = pytest.mark.distributed

CLOSE = {torch.float64: 1e-12, torch.float32: 1e-6}  # rtol = atol (the module docstring)
STEPS = 6  # the state_dict round trip after STEPS // 2
Setup = Literal["one", "two"]

# Where each package exports its classes.
MODULES = {"bitsandbytes": "bitsandbytes.optim", "torchao": "torchao.optim"}
# Classes that refuse float64 parameters.
FLOAT32_ONLY = {("pytorch_optimizer", "FAdam"), ("torchao", "AdamW8bit"), ("torchao", "AdamW4bit")}
FLOAT32_ONLY |= {("torchao", "AdamWFp8"), ("bitsandbytes", "PytorchLARS")}
# Options beyond lr=0.01 and weight_decay=0.01 (where the constructor takes them): momentum
# where a class refuses none; preconditioners that start within the 6 steps compared.
EXTRA: dict[tuple[str, str], dict[str, Any]] = {
    **{("bitsandbytes", n): {"momentum": 0.9} for n in ("SGD", "SGD32bit", "SGD8bit")},
    **{("bitsandbytes", n): {"momentum": 0.9} for n in ("LARS", "LARS32bit", "LARS8bit", "PytorchLARS")},
    ("pytorch_optimizer", "Ranger21"): {"num_iterations": 100},
    ("pytorch_optimizer", "SOAP"): {"precondition_frequency": 2},
    ("schedulefree", "AdamWScheduleFree"): {"warmup_steps": 2},
}


@dataclass(frozen=True)
class Case:
    """One optimizer class under ShardedOptimizer, in one setup.

    Attributes:
        package, name: the registry key (top-level package, class ``__qualname__``).
        setup: "one" group, or "two" (the last bias alone in the second).
        options: ShardedOptimizer's ``**kwargs`` beyond the generic ones.
        shard_by: ShardedOptimizer's ``shard_by``.
        expect: the kind ``opt.shard_by`` must be, or the start of the message a refused
            class raises (``"ValueError: ..."``).
    """

    package: str
    name: str
    setup: Setup = "one"
    options: dict[str, Any] = field(default_factory=dict)
    shard_by: Literal["element", "tensor"] | None = None
    expect: str = "tensor"


def _refusal(name: str, entry: Registered) -> str:
    return f"ValueError: ShardedOptimizer cannot shard {name}: {entry.reason}"


CASES: dict[str, Case] = {
    f"{package}.{name}-{setup}": Case(
        package,
        name,
        setup,
        EXTRA.get((package, name), {}),
        None,
        entry.kind if entry.kind is not None else _refusal(name, entry),
    )
    for (package, name), entry in sorted(REGISTRY.items())
    for setup in ("one", "two")
}
CASES |= {
    # registered per tensor: finer shards are refused
    "lamb-element": Case(
        "pytorch_optimizer",
        "Lamb",
        shard_by="element",
        expect="ValueError: Lamb updates each tensor as a whole (shard_by='tensor')",
    ),
    # registered per tensor, refuted by the probe for these options: pre_norm scales every
    # gradient by max_grad_norm / the global gradient norm
    "lamb-pre_norm": Case(
        "pytorch_optimizer",
        "Lamb",
        options={"pre_norm": True, "max_grad_norm": 1.0},
        expect="ValueError: ShardedOptimizer cannot shard Lamb by tensor: a probe compared",
    ),
    # element-wise: by tensor when asked
    "lion-tensor": Case("lion_pytorch", "Lion", shard_by="tensor", expect="tensor"),
}


def _installed(case: Case) -> bool:
    return importlib.util.find_spec(case.package) is not None


def _class(case: Case) -> type[torch.optim.Optimizer]:
    """The registered class (its registry key checked against what the class says it is)."""
    cls = getattr(importlib.import_module(MODULES.get(case.package, case.package)), case.name)
    assert (cls.__module__.split(".")[0], cls.__qualname__) == (case.package, case.name), cls
    return cls


def _options(case: Case, cls: type) -> dict[str, Any]:
    taken = inspect.signature(cls.__init__).parameters
    generic = {k: v for k, v in (("lr", 0.01), ("weight_decay", 0.01)) if k in taken}
    return generic | case.options


def _dtype(case: Case) -> torch.dtype:
    return torch.float32 if (case.package, case.name) in FLOAT32_ONLY else torch.float64


def _model(dtype: torch.dtype) -> tuple[nn.Module, flatgrad.ReplicateModule]:
    """A model whose first weight is 80 x 64 (5120 elements, above the block-quantisation
    size) and DataParallel over it (several buckets)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 80), nn.Tanh(), nn.Linear(80, 3)).to(dtype)
    return model, flatgrad.replicate(flatgrad.FlatGrad(model, config=ROUTE_ALL), bucket_cap_mb=0.02)


def _groups(params: list[nn.Parameter], setup: Setup) -> Any:
    return params if setup == "one" else [{"params": params[:-1]}, {"params": params[-1:]}]


def _batch(rank: int, step: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(4, 64, dtype=torch.float64, generator=generator).to(dtype)


def _sum_of_squares(output: torch.Tensor) -> torch.Tensor:
    return output.square().sum()


def _worst(pair: Lockstep, tol: float) -> float:
    """How far our parameters are from stock's: the largest ``|ours - stock|`` over
    ``tol + tol * |stock|`` (at most 1 passes, as `torch.testing.assert_close`)."""
    ours = dict(pair.model.named_parameters())
    ratio = 0.0
    for name, ref in pair.ref.module.named_parameters():
        diff = (ours[name].detach() - ref.detach()).abs()
        ratio = max(ratio, (diff / (tol + tol * ref.detach().abs())).max().item())
    return ratio


def _saved_and_loaded(state_dict: dict[str, Any]) -> dict[str, Any]:
    """`state_dict` through ``torch.save`` and ``torch.load(weights_only=True)``, as a
    checkpoint file would bring it back."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _step(pair: Lockstep, batch: torch.Tensor, closure: bool) -> None:
    """One training step on both sides: plain, or through a closure that zeroes, runs
    forward and backward (the *Closure classes call it inside their step)."""
    if not closure:
        pair.train_step(batch)
        return

    def ours() -> torch.Tensor:
        pair.opt.zero_grad()
        loss = _sum_of_squares(pair.wrapper(batch))
        loss.backward()
        return loss

    def theirs() -> torch.Tensor:
        pair.ref_opt.zero_grad()
        loss = _sum_of_squares(pair.ref(batch))
        loss.backward()
        return loss

    pair.opt.step(ours)
    pair.ref_opt.step(theirs)


def _call(pair: Lockstep, method: str) -> None:
    getattr(pair.opt, method)()
    getattr(pair.ref_opt, method)()


def _run_case(rank: int, case: Case) -> dict[str, Any]:
    """Build ours (or find it refused), step it in lockstep with stock, round-trip its
    state_dict into a fresh ShardedOptimizer half-way: `_worst` at each compared point."""
    cls = _class(case)
    options, dtype = _options(case, cls), _dtype(case)
    tol = CLOSE[dtype]
    schedule_free = hasattr(cls, "train") and hasattr(cls, "eval")
    closure = "closure" in inspect.signature(cls.step).parameters and (
        inspect.signature(cls.step).parameters["closure"].default is inspect.Parameter.empty
    )
    model, dp = _model(dtype)
    ref, ref_opt = stock(model, lambda params: cls(_groups(list(params), case.setup), **options))
    try:
        opt = flatgrad.ShardedOptimizer(
            dp, cls, _groups(list(model.parameters()), case.setup), shard_by=case.shard_by, **options
        )
    except ValueError as error:
        return {"raised": f"ValueError: {error}"}
    record: dict[str, Any] = {"shard_by": opt.shard_by, "points": {}}
    pair = Lockstep(model, dp, opt, ref, ref_opt, loss=_sum_of_squares)
    if schedule_free:
        _call(pair, "train")
    for step in range(STEPS):
        if step == STEPS // 2:
            record["points"][f"train {step}"] = _worst(pair, tol)
            if schedule_free:  # checkpoints are taken at the evaluation point
                _call(pair, "eval")
                record["points"][f"eval {step}"] = _worst(pair, tol)
            saved = _saved_and_loaded(pair.opt.state_dict())
            model2, dp2 = _model(dtype)
            with torch.no_grad():
                for p, q in zip(model2.parameters(), model.parameters()):
                    p.copy_(q)
            opt2 = flatgrad.ShardedOptimizer(
                dp2, cls, _groups(list(model2.parameters()), case.setup), shard_by=case.shard_by, **options
            )
            opt2.load_state_dict(saved)
            # (stock takes the same round trip: a class whose own state_dict is not exact,
            # QHAdam's float32 state, is so on both sides)
            ref_saved = _saved_and_loaded(ref_opt.state_dict())
            ref_opt = cls(_groups(list(ref.parameters()), case.setup), **options)
            ref_opt.load_state_dict(ref_saved)
            pair = Lockstep(model2, dp2, opt2, ref, ref_opt, loss=_sum_of_squares)
            if schedule_free:
                _call(pair, "train")
        _step(pair, _batch(rank, step, dtype), closure)
        if step > STEPS // 2:
            record["points"][f"train {step + 1} (after the round trip)"] = _worst(pair, tol)
    if schedule_free:
        _call(pair, "eval")
        record["points"][f"eval {STEPS} (after the round trip)"] = _worst(pair, tol)
    return record


def _cases_worker(rank: int, world_size: int, names: list[str], out: str) -> None:
    """Every case in `names`, in turn; each one's record (or the traceback it raised) and
    its seconds go to `out`/rank<rank>.json. Ranks raise alike (the same classes, probes and
    data), so a case that raises leaves the ranks in step for the next one (one that raised
    on some ranks only leaves the others in a collective: gloo's timeout or run_ranks' ends
    it)."""
    records = {}
    for name in names:
        start = time.perf_counter()
        try:
            records[name] = _run_case(rank, CASES[name])
        except Exception:  # noqa: BLE001  (recorded: the case's test fails with it)
            records[name] = {"error": traceback.format_exc()}
        records[name]["seconds"] = time.perf_counter() - start
    Path(out, f"rank{rank}.json").write_text(json.dumps(records))


_RESULTS: dict[int, list[dict[str, Any]] | str] = {}

ELEMENT_CLASSES = [
    *flatgrad._optim_kinds.ELEMENTWISE,
    *(
        getattr(importlib.import_module(MODULES.get(package, package)), name)
        for (package, name), entry in sorted(REGISTRY.items())
        if entry.kind == "element" and importlib.util.find_spec(package) is not None
    ),
]


def _results(world_size: int, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The records of every rank: one call on the ranks runs every installed package's
    cases, the first time a test asks (a call that failed as a whole fails every test,
    without running again)."""
    if world_size not in _RESULTS:
        names = [name for name, case in CASES.items() if _installed(case)]
        out = tmp_path_factory.mktemp(f"third_party_{world_size}")
        try:
            run_ranks(_cases_worker, names, str(out), world_size=world_size, timeout=300.0)
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


@pytest.mark.parametrize("name", list(CASES))
def test_registered_optimizer_equals_stock_ddp(name, tmp_path_factory):
    case = CASES[name]
    pytest.importorskip(case.package)
    tol = CLOSE[_dtype(case)]
    for rank, records in enumerate(_results(2, tmp_path_factory)):
        record = records[name]
        assert "error" not in record, f"rank {rank} raised:\n{record['error']}"
        if case.expect.startswith("ValueError"):
            assert "raised" in record, f"rank {rank}: not refused, shard_by={record.get('shard_by')!r}"
            assert record["raised"].startswith(case.expect), f"rank {rank}: {record['raised']}"
            continue
        assert "raised" not in record, f"rank {rank}: {record['raised']}"
        assert record["shard_by"] == case.expect, f"rank {rank}: shard_by {record['shard_by']!r}"
        for point, ratio in record["points"].items():
            assert ratio <= 1.0, f"rank {rank} at {point}: {ratio:.3g} x (rtol = atol = {tol})"


def test_a_per_parameter_state_holding_a_container_is_refused_by_element():
    """AggMo keeps a dict of momentum buffers per parameter; by element a checkpoint saves each name's state
    as flat shards, one tensor per key, and gave AggMo's whole dict to every name (DCP crashed; a rank's own
    file could load another piece's buffers). Registered by tensor now; declared by element, refused."""
    from flatgrad._optim_kinds import check_kind
    from flatgrad._zero_state import OptimizerRecipe

    recipe = OptimizerRecipe(pytest.importorskip("pytorch_optimizer").AggMo, {})
    with pytest.raises(ValueError, match="cannot shard AggMo by element.*holds a container"):
        check_kind(recipe, "element", torch.zeros(1), registered=False)
    check_kind(recipe, "tensor", torch.zeros(1), registered=True)


def test_a_per_parameter_state_holding_an_object_is_refused_by_element():
    """ScalableShampoo keeps a PreConditioner and a graft object per parameter, built from the tensor it
    steps: by element a flat piece (no Kronecker factors of the matrix) whose objects a checkpoint saved once
    for every rank (dcp.load into a fresh ShardedOptimizer gave rank 0 rank 1's: "shape '[1, 2752]' is invalid
    for input of size 2720" in its next step). Its preconditioner starts at step 25 and recomputes every 1000
    steps, past the probe's ten, so the values matched and the probe accepted it (0.048 from stock DDP at step
    30 with preconditioning_compute_steps=5). By tensor it stays accepted."""
    from flatgrad._optim_kinds import check_kind
    from flatgrad._zero_state import OptimizerRecipe

    recipe = OptimizerRecipe(pytest.importorskip("pytorch_optimizer").ScalableShampoo, {"lr": 0.01})
    with pytest.raises(ValueError, match="cannot shard ScalableShampoo by element.*holds an object"):
        check_kind(recipe, "element", torch.zeros(1), registered=False)
    check_kind(recipe, "tensor", torch.zeros(1), registered=False)


def test_a_per_parameter_state_shaped_otherwise_is_refused_by_element():
    """SaRA keeps its moments for the weights under its threshold only (`p[mask]`, a 1-D tensor of their
    count): element-wise math, but a state no flat shard of the parameter can be cut from. The probe accepted
    it, ShardedOptimizer stepped it as stock, and `state_dict()` raised ("start (0) + length (2752) exceeds
    dimension size (26)", flatgrad/_zero_state.py `_local_view`). By tensor it stays accepted."""
    from flatgrad._optim_kinds import check_kind
    from flatgrad._zero_state import OptimizerRecipe

    recipe = OptimizerRecipe(pytest.importorskip("pytorch_optimizer").SaRA, {"lr": 0.01})
    with pytest.raises(ValueError, match="cannot shard SaRA by element.*shaped neither as its parameter"):
        check_kind(recipe, "element", torch.zeros(1), registered=False)
    check_kind(recipe, "tensor", torch.zeros(1), registered=False)


@pytest.mark.parametrize("cls", ELEMENT_CLASSES, ids=lambda c: f"{c.__module__.split('.')[0]}.{c.__name__}")
def test_the_by_element_state_check_refuses_no_element_wise_class(cls):
    """torch's element-wise classes and every registered element class whose package is installed keep only
    tensors shaped as their parameter, one-element tensors and plain scalars per parameter."""
    from flatgrad._optim_kinds import check_kind
    from flatgrad._zero_state import OptimizerRecipe

    check_kind(OptimizerRecipe(cls, {"lr": 0.01}), "element", torch.zeros(1), registered=True)
