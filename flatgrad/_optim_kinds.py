"""Which way `ShardedOptimizer` may shard an optimizer class, decided before anything moves.

A class is sharded *by element* (flat shards of every parameter: each element's update reads that element
only) or *by tensor* (whole parameters per rank: each tensor's update reads that whole tensor and no other),
or refused (its update of a parameter reads other parameters).

[Note: a probe refutes, never grants] A kind comes from knowledge: torch's classes (`ELEMENTWISE`,
`PER_TENSOR`), the third-party ones in `REGISTRY` (verified against DDP by
tests/test_sharded_third_party.py), or the user's ``shard_by``. A probe (`check_kind`) can only refuse it.
What it runs, what it refuses and what it cannot show: docs/data-parallel.md, "Which optimizers shard how"."""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from flatgrad._buffer import GradStore
from flatgrad._torch_compat import collectives_run
from flatgrad._zero_state import OptimizerRecipe

logger = logging.getLogger(__name__)

ShardBy = Literal["element", "tensor"]

# torch's optimizers whose update of an element reads only it (and scalars): shards update as whole.
ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop, torch.optim.Rprop,
    torch.optim.ASGD,
)  # fmt: skip
# torch's optimizers whose update of a tensor reads all of it and no other (Muon: 2.9 on; Adafactor: 2.5 on).
PER_TENSOR: tuple[type[torch.optim.Optimizer], ...] = tuple(
    cls
    for cls in (getattr(torch.optim, "Muon", None), getattr(torch.optim, "Adafactor", None))
    if cls is not None
)
# Whose update of any parameter reads every parameter (LBFGS's line search and history).
CROSS_TENSOR: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.LBFGS,)


@dataclasses.dataclass(frozen=True)
class Registered:
    """What is known of a third-party class: its kind, or (`kind` None) why it is refused."""

    kind: ShardBy | None
    reason: str = ""


_ONE_STEP_SIZE = (
    "it estimates one step size from every parameter's gradients and values together, which "
    "no rank holding a part of them can compute"
)
_GLOBAL_RNG = (
    "its step draws random numbers for each tensor from the global RNG, in the order of the "
    "tensors it holds: ranks holding other tensors draw other numbers"
)


def _same_kind(package: str, kind: ShardBy, names: str) -> dict[tuple[str, str], Registered]:
    return {(package, name): Registered(kind) for name in names.split()}


# Third-party classes by (top-level package, class __qualname__), their kind verified against DDP + the same
# class by tests/test_sharded_third_party.py (docs/data-parallel.md, "Which optimizers shard how", has the
# table). A subclass that keeps the registered class's `step` is known too; one with its own is not.
# Per-tensor classes read a norm, a trust ratio, a factored second moment of the whole tensor, or quantise
# state over blocks of it (bitsandbytes above 4096 elements, torchao in blocks of 256).
REGISTRY: dict[tuple[str, str], Registered] = {
    ("lion_pytorch", "Lion"): Registered("element"),
    # (the *Closure variants take a closure that ShardedOptimizer.step passes on)
    **_same_kind(
        "schedulefree",
        "element",
        "AdamWScheduleFree SGDScheduleFree RAdamScheduleFree "
        "AdamWScheduleFreeClosure SGDScheduleFreeClosure RAdamScheduleFreeClosure",
    ),
    ("came_pytorch", "CAME"): Registered("tensor"),
    **_same_kind(
        "pytorch_optimizer",
        "element",
        "AdaBelief AdaBound Adan RAdam Lion Tiger Yogi DiffGrad ADOPT AdEMAMix "
        "LaProp Kate SPAM ScheduleFreeAdamW ScheduleFreeSGD ScheduleFreeRAdam AdaMax QHM "
        "PAdam AccSGD SGDW SignSGD AdaDelta MSVAG PNM AdaPNM Grams EXAdam AdaMod",
    ),
    **_same_kind(
        "pytorch_optimizer",
        "tensor",
        "Lamb LARS AdamP SGDP CAME StableAdamW AdaNorm QHAdam SWATS NovoGrad Ranger SOAP Shampoo "
        "Nero Fromage MARS SM3 MADGRAD StableSPAM A2Grad AggMo",
    ),
    **_same_kind(
        "bitsandbytes",
        "tensor",
        "Adam Adam32bit Adam8bit AdamW AdamW32bit AdamW8bit PagedAdam PagedAdam32bit PagedAdam8bit "
        "PagedAdamW PagedAdamW32bit PagedAdamW8bit Lion Lion32bit Lion8bit PagedLion PagedLion32bit "
        "PagedLion8bit LAMB LAMB32bit LAMB8bit LARS LARS32bit LARS8bit PytorchLARS RMSprop "
        "RMSprop32bit RMSprop8bit SGD SGD32bit SGD8bit Adagrad Adagrad32bit Adagrad8bit AdEMAMix "
        "AdEMAMix8bit PagedAdEMAMix PagedAdEMAMix8bit",
    ),
    **_same_kind("torchao", "tensor", "AdamW8bit AdamW4bit AdamWFp8"),
    ("prodigyopt", "Prodigy"): Registered(None, _ONE_STEP_SIZE),
    **{
        (package, name): Registered(None, _ONE_STEP_SIZE)
        for package in ("dadaptation", "pytorch_optimizer")
        for name in ("DAdaptAdam", "DAdaptSGD", "DAdaptAdaGrad", "DAdaptAdan", "DAdaptLion")
    },
    ("pytorch_optimizer", "Prodigy"): Registered(None, _ONE_STEP_SIZE),
    ("pytorch_optimizer", "Gravity"): Registered(None, _GLOBAL_RNG),
    ("pytorch_optimizer", "Kron"): Registered(None, _GLOBAL_RNG),
    ("pytorch_optimizer", "Ranger21"): Registered(
        None, "its stable weight decay divides by a sum of second moments over every parameter"
    ),
    ("pytorch_optimizer", "AdaGC"): Registered(None, "it scales each gradient by the norm of all of them"),
    ("pytorch_optimizer", "Adai"): Registered(
        None, "its momentum of each element reads the mean second moment over every parameter"
    ),
    ("pytorch_optimizer", "AdamS"): Registered(None, "its weight decay reads all parameters' 2nd moments"),
    ("pytorch_optimizer", "AvaGrad"): Registered(
        None, "its step size is a norm over every parameter's adaptive learning rates"
    ),
}

HOW_TO_DECLARE = (
    "pass shard_by='element' if each element's update reads that element only, or shard_by='tensor' if each "
    "tensor's update reads that whole tensor and no other; ShardedOptimizer checks the declaration with a "
    "probe that can only refuse it (docs/data-parallel.md)"
)


def shard_kind(recipe: OptimizerRecipe, shard_by: object, like: torch.Tensor) -> ShardBy:
    """How `recipe`'s optimizer is sharded, before anything moves (every rank decides alike). torch's own
    classes and `REGISTRY`'s go their known way (``shard_by="tensor"`` is allowed for an element-wise one);
    any other class the way `shard_by` declares. A registered or declared kind is then checked by
    `check_kind`, which can only refuse it.

    Raises:
        ValueError: `shard_by` is not None, "element" or "tensor"; the class is cross-tensor (LBFGS, a refused
            registered class, or one whose probe updates a tensor by another), sparse (SparseAdam) or
            communicates in its step; `shard_by` asks for finer shards than the class allows or the probe
            shows exact; or a class ShardedOptimizer does not know, without `shard_by`.
    """
    cls = recipe.optimizer_class
    if shard_by not in (None, "element", "tensor"):
        raise ValueError(f"shard_by must be None, 'element' or 'tensor', got {shard_by!r}")
    declared: ShardBy | None = shard_by  # type: ignore[assignment]
    name = recipe.name
    if issubclass(cls, CROSS_TENSOR):
        raise ValueError(
            _cross(name, "its update of a parameter reads other parameters (line search, history)")
        )
    if issubclass(cls, torch.optim.SparseAdam):
        raise ValueError(
            f"ShardedOptimizer cannot step {name}: it takes sparse gradients, which flatgrad's "
            "flat buffers never hold (nn.Embedding(sparse=True) is refused by FlatGrad)"
        )
    known = _torch_kind(cls)
    if known is not None:
        _refuse_finer(name, declared, known)
        return declared or known
    registered = registered_kind(cls)
    if registered is not None:
        if registered.kind is None:
            raise ValueError(_cross(name, registered.reason))
        _refuse_finer(name, declared, registered.kind)
        kind = declared or registered.kind
        check_kind(recipe, kind, like, registered=True)
        return kind
    if declared is None:
        raise ValueError(
            f"ShardedOptimizer does not know how {name} may be sharded (it is neither one of "
            "torch's optimizers nor one whose kind flatgrad verifies): " + HOW_TO_DECLARE
        )
    check_kind(recipe, declared, like, registered=False)
    return declared


def _cross(name: str, why: str) -> str:
    return (
        f"ShardedOptimizer cannot shard {name}: {why}; use flatgrad.replicate with a plain "
        f"{name} over the model's parameters"
    )


def _refuse_finer(name: str, declared: ShardBy | None, known: ShardBy) -> None:
    if declared == "element" and known == "tensor":
        raise ValueError(
            f"{name} updates each tensor as a whole (shard_by='tensor'), so its flat shards "
            "would not update as the whole tensor does: shard_by='element' cannot hold; "
            "leave shard_by out"
        )


def _torch_kind(cls: type[torch.optim.Optimizer]) -> ShardBy | None:
    """The kind of torch's own class that `cls` is, or subclasses without its own `step`."""
    for kind, known in (("element", ELEMENTWISE), ("tensor", PER_TENSOR)):
        for base in known:
            if issubclass(cls, base) and cls.step is base.step:
                return kind  # type: ignore[return-value]
    return None


def registered_kind(cls: type[torch.optim.Optimizer]) -> Registered | None:
    """`REGISTRY`'s entry for `cls`, or the registered class it subclasses without its own `step`; or None."""
    for base in cls.__mro__:
        entry = REGISTRY.get((base.__module__.split(".")[0], base.__qualname__))
        if entry is not None:
            return entry if cls.step is getattr(base, "step", None) else None
    return None


def agreed_kind(kind: ShardBy, store: GradStore, process_group: dist.ProcessGroup | None) -> ShardBy:
    """`kind` after checking that every rank chose it (one small all-reduce): ranks that differ (a probe step
    failed on one: memory, a kernel) would run other collectives and hang: all raise one ValueError."""
    device = next(iter(store.buffers.values())).device
    codes = torch.tensor([int(kind == "tensor"), -int(kind == "tensor")], device=device)
    dist.all_reduce(codes, op=dist.ReduceOp.MAX, group=process_group)
    if int(codes[0]) != -int(codes[1]):
        raise ValueError(
            f"ranks chose different shard_by for the same optimizer (this rank: {kind!r}): "
            "pass shard_by explicitly, the same on every rank"
        )
    return kind


# --- the probe -------------------------------------------------------------------------------

# Two tensors above 4096 elements (bitsandbytes quantises blockwise from there, torchao in blocks of 256),
# same-shaped (classes that stack a group's tensors need that) and mixed.
_SAME = ((80, 64), (80, 64))
_MIXED = ((80, 64), (33, 7), (13,))
_STEP_SCALES = (1.0, 0.3, 2.0, 0.05, 1.0, 4.0, 0.1, 0.5, 3.0, 0.02)  # ten steps
# Equal means: float64 within round-off of another summation order; float32 within its own.
_CLOSE = {torch.float64: (1e-9, 1e-12), torch.float32: (1e-5, 1e-7)}
Split = Literal["whole", "pieces", "alone"]


def check_kind(recipe: OptimizerRecipe, kind: ShardBy, like: torch.Tensor, registered: bool) -> None:
    """Refuse `kind` for `recipe`'s class where a probe shows it wrong: tensors stepped in flat pieces (by
    element) or alone (by tensor) end up other than stepped whole in one optimizer, the step communicates, or
    (by element) a parameter's state is `_unshardable`. On `like`'s device, alike on every rank, RNG restored.

    Raises:
        ValueError: The probe contradicts `kind`, or the step runs a collective.
    """
    name = recipe.name
    split: Split = "pieces" if kind == "element" else "alone"
    ran = []
    for dtype in (torch.float64, torch.float32):
        for shapes in (_SAME, _MIXED):
            case = _ProbeCase(recipe, shapes, dtype, like.device)
            before = collectives_run()
            try:
                whole = case.run("whole")
            except Exception:  # noqa: BLE001  (this dtype or these shapes: the class refuses them)
                whole = None
            if collectives_run() != before:
                raise ValueError(_communicates(name, collectives_run() - before))
            if whole is None:
                continue
            ran.append(f"{dtype}, shapes {shapes}")
            try:
                parts = case.run(split)
            except Exception as error:  # noqa: BLE001  (it refuses the split: Muon's 1-D pieces)
                raise ValueError(_refuted(name, kind, f"stepping them so raised {error!r}")) from None
            rtol, atol = _CLOSE[dtype]
            if not all(map(functools.partial(torch.allclose, rtol=rtol, atol=atol), whole, parts)):
                raise ValueError(_refuted(name, kind, f"they differ ({dtype}, shapes {shapes})"))
            if kind == "element" and case.unshardable:  # (flat shards are saved per name: one tensor per key)
                raise ValueError(_refuted(name, kind, f"its per-parameter state {case.unshardable}"))
    if not ran:
        say = logger.debug if registered else logger.warning
        say(
            "ShardedOptimizer could not probe %s (its step raised on every probe tensor); "
            "shard_by=%r is taken as %s",
            name,
            kind,
            "registered" if registered else "your statement, unchecked",
        )


def _communicates(name: str, count: int) -> str:
    return (
        f"ShardedOptimizer cannot step {name}: its step runs collectives ({count} in a probe's "
        "steps on every rank alike), "
        "which inside a sharded step would average across the wrong parameters or hang "
        "(each rank's instance holds other tensors); use flatgrad.replicate with a plain "
        f"{name}, or turn its own communication off"
    )


def _refuted(name: str, kind: ShardBy, what: str) -> str:
    if kind == "element":
        how = "a tensor stepped in flat pieces (as ranks hold them by element) with the whole tensor stepped"
        fix = (
            "its update reads more than each element; try shard_by='tensor' (probed as well: an update "
            f"that also reads other tensors, a global norm, needs flatgrad.replicate with a plain {name})"
        )
    else:
        how = (
            "each tensor stepped in an optimizer of its own (as ranks hold them by tensor) "
            "with all of them stepped in one"
        )
        fix = (
            "its update of a tensor reads other tensors (a statistic over several of them, "
            "or draws from the global RNG per tensor); use flatgrad.replicate with a "
            f"plain {name}"
        )
    return f"ShardedOptimizer cannot shard {name} by {kind}: a probe compared {how}, and {what}: {fix}"


class _ProbeCase:
    """Probe tensors of `shapes` in `dtype` and their gradients for ten steps."""

    def __init__(
        self,
        recipe: OptimizerRecipe,
        shapes: tuple[tuple[int, ...], ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.recipe = recipe
        self.device = device
        generator = torch.Generator().manual_seed(0)
        self.starts = [torch.randn(s, generator=generator, dtype=torch.float64).to(dtype) for s in shapes]
        # Per tensor and step another scale: shows a statistic over tensors or steps (a running norm).
        self.grads = [
            [
                (torch.randn(s, generator=generator, dtype=torch.float64) * 10.0**i * scale).to(dtype)
                for i, s in enumerate(shapes)
            ]
            for scale in _STEP_SCALES
        ]

    def run(self, how: Split) -> list[torch.Tensor]:
        """The tensors after the steps: all in one optimizer ("whole"); each cut in two unequal flat pieces,
        the first ones in one optimizer, the second in another ("pieces": two ranks' shards); or each in one
        of its own ("alone": ranks owning whole tensors). Each optimizer draws from its own RNG copy."""
        starts = self.starts
        if how == "pieces":
            cuts = [[(i, 0, t.numel() // 3) for i, t in enumerate(starts)]]
            cuts.append([(i, t.numel() // 3, t.numel()) for i, t in enumerate(starts)])
        else:
            every = [(i, 0, t.numel()) for i, t in enumerate(starts)]
            cuts = [every] if how == "whole" else [[cut] for cut in every]
        whole = how != "pieces"  # (whole tensors keep their shape: Muon-like classes need it)
        held = [
            [
                (i, lo, hi, self._leaf(starts[i] if whole else starts[i].reshape(-1)[lo:hi]))
                for i, lo, hi in part
            ]
            for part in cuts
        ]
        self._steps(held)
        values: list[list[tuple[int, torch.Tensor]]] = [[] for _ in starts]
        for leaves in held:
            for i, lo, _, leaf in leaves:
                values[i].append((lo, leaf.detach().cpu().reshape(-1)))
        return [
            torch.cat([v for _, v in sorted(parts, key=lambda p: p[0])]).view(t.shape)
            for parts, t in zip(values, starts)
        ]

    def _leaf(self, start: torch.Tensor) -> nn.Parameter:
        return nn.Parameter(start.clone().to(self.device))

    def _steps(self, held: list[list[tuple[int, int, int, nn.Parameter]]]) -> None:
        cuda = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(0)
            rngs = [_rng_state(cuda)] * len(held)  # (every simulated rank's own, seeded alike)
            optimizers = [
                self.recipe.build_to_step([{"params": [leaf for *_, leaf in leaves]}]) for leaves in held
            ]
            for step_grads in self.grads:
                for k, (optimizer, leaves) in enumerate(zip(optimizers, held)):
                    for i, lo, hi, leaf in leaves:
                        # (a copy each run: an optimizer may write into its .grad, as LARS does)
                        grad = step_grads[i].reshape(-1)[lo:hi].view(leaf.shape)
                        leaf.grad = grad.to(self.device, copy=True)
                    _set_rng_state(rngs[k], cuda)
                    self.recipe.step(optimizer)
                    rngs[k] = _rng_state(cuda)
        self.unshardable = next(filter(None, map(_unshardable, optimizers)), None)


# What a per-parameter state may hold besides tensors, by element: flags, counts, options.
_PLAIN = (bool, int, float, str, type(None))


def _unshardable(optimizer: torch.optim.Optimizer) -> str | None:
    """The first per-parameter state value of `optimizer` flat shards cannot hold, described: a container
    (AggMo's dict), another object (ScalableShampoo's preconditioner), or a tensor of more than one element
    shaped otherwise than its parameter (SaRA's). Flat shards save any non-tensor value once for every rank
    (`_zero_state.parameter_state`): one rank's object would reach every rank's pieces on load."""
    for param, entry in optimizer.state.items():
        if not isinstance(param, torch.Tensor):
            continue
        for key, value in entry.items():
            if isinstance(value, (dict, list, tuple)):
                return f"holds a container ({key!r}: a {type(value).__name__})"
            if not isinstance(value, (torch.Tensor, *_PLAIN)):
                return f"holds an object ({key!r}: a {type(value).__name__})"
            if isinstance(value, torch.Tensor) and value.shape != param.shape and value.numel() != 1:
                return (
                    f"holds a tensor shaped neither as its parameter nor as a scalar ({key!r}: "
                    f"{tuple(value.shape)} for a parameter of {tuple(param.shape)})"
                )
    return None


def _rng_state(cuda: list[int]) -> tuple[torch.Tensor, ...]:
    return (torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in cuda))


def _set_rng_state(state: tuple[torch.Tensor, ...], cuda: list[int]) -> None:
    torch.set_rng_state(state[0])
    for device, cuda_state in zip(cuda, state[1:]):
        torch.cuda.set_rng_state(cuda_state, device)
