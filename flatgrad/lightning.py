"""PyTorch Lightning strategies for flatgrad's three paths, chosen by name once this module is imported (it
registers them in Lightning's ``StrategyRegistry``; ``import flatgrad`` never imports Lightning):

    import flatgrad.lightning  # noqa: F401  (registers the names)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="flatgrad")

``"flatgrad"`` is `FlatGradDDPStrategy`, ``"flatgrad_data_parallel"`` `FlatGradDataParallelStrategy` and
``"flatgrad_sharded"`` `FlatGradShardedStrategy`. Each is a `DDPStrategy` subclass that applies FlatGrad to
the LightningModule in place when ``fit`` sets up; clipping by norm goes through flatgrad where the optimizer
holds every parameter with a gradient (`_clip_through_flatgrad`), and a ``"flatgrad_sharded"`` checkpoint
holds the optimizer state in a plain torch optimizer's form (`plain_optimizer_state`). What each strategy
does, and why: docs/integrations.md, "PyTorch Lightning", "Manual optimization" and "Lightning checkpoints
across strategies"."""

from __future__ import annotations

import inspect
import logging
import types
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from flatgrad._amp import GradScaler
from flatgrad._comm import FlatGradCommState, allreduce_hook
from flatgrad._config import FlatGradConfig
from flatgrad._flatgrad import FlatGrad
from flatgrad._optim_kinds import ShardBy
from flatgrad._parallel import ReplicateModule, replicate, replicate_state, unreplicate
from flatgrad._sharded import ShardedOptimizer
from flatgrad._zero import options
from flatgrad._zero_state import CLASS_STATE, MASTER, never_stepped, whole_state, without_stepped_options

logger = logging.getLogger(__name__)

Config = FlatGradConfig | dict[str, Any] | str | Path | None

# DDPStrategy's own arguments (everything else it takes goes to DDP's constructor).
_STRATEGY_ARGUMENTS = (
    "accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin",
    "process_group_backend", "timeout", "start_method",
)  # fmt: skip


class _FlatGradStrategy(DDPStrategy):
    """What the three strategies share: the `FlatGrad` config, the LightningModule with FlatGrad applied
    (`flat`, once fit has set up), norm clipping through it, and the name each is registered under."""

    strategy_name: ClassVar[str]
    _description: ClassVar[str]

    def __init__(self, config: Config = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.flatgrad_config = config
        self.flat: FlatGrad | None = None

    def setup_precision_plugin(self) -> None:
        """Lightning's, then norm clipping through `flat` (`_clip_through_flatgrad`)."""
        super().setup_precision_plugin()
        _clip_through_flatgrad(self.precision_plugin, lambda: self.flat)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register the strategy as `strategy_name` (Lightning calls this for its own modules only: this
        module calls it at import).

        Args:
            strategy_registry: Lightning's ``StrategyRegistry``.
        """
        strategy_registry.register(cls.strategy_name, cls, description=cls._description)


class FlatGradDDPStrategy(_FlatGradStrategy):
    """Lightning's DDPStrategy over ``FlatGrad(module)``: DDP with `FlatGrad.ddp_kwargs` (one bucket per
    (dtype, device), which is flatgrad's buffer) and `flatgrad.allreduce_hook` registered on every device.
    Registered as ``"flatgrad"``.

    Args:
        config: The `FlatGrad` config (a `FlatGradConfig`, a dict of its fields, a YAML/JSON path, or None for
            the defaults).
        **kwargs: DDPStrategy's arguments (``accelerator``, ``start_method``, ``process_group_backend``, ...)
            and DDP's (``find_unused_parameters``, ``static_graph``, ...), as ``DDPStrategy(**kwargs)`` takes
            them.

    Raises:
        TypeError: A comm hook argument is given (``ddp_comm_hook``, ``ddp_comm_state``, ``ddp_comm_wrapper``:
            the strategy registers flatgrad's; ``model_averaging_period``, which needs a post-local-SGD hook
            state).
        ValueError: ``gradient_as_bucket_view`` or ``bucket_cap_mb`` is given (`FlatGrad.ddp_kwargs` sets
            them).
    """

    strategy_name = "flatgrad"
    _description = "DDP with flatgrad's one-bucket comm hook, on every device"

    def __init__(self, config: Config = None, **kwargs: Any) -> None:
        for name in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period"):
            if name in kwargs:
                raise TypeError(
                    "FlatGradDDPStrategy registers flatgrad.allreduce_hook itself: "
                    f"{name} must not be given, got {kwargs[name]!r}"
                )
        for name in ("gradient_as_bucket_view", "bucket_cap_mb"):
            if name in kwargs:
                raise ValueError(
                    f"{name} must be left to FlatGrad.ddp_kwargs() (one bucket per buffer), "
                    f"got {kwargs[name]!r}"
                )
        super().__init__(config, **kwargs)
        self.comm_state: FlatGradCommState | None = None  # the hook's state, once registered

    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        """``DDP(FlatGrad(model), **model.ddp_kwargs())`` with flatgrad's hook registered."""
        flat = self.flat = FlatGrad(model, self.flatgrad_config)
        device_ids = self.determine_ddp_device_ids()
        # As DDPStrategy: build DDP on a side stream on CUDA (torch's CUDA semantics notes).
        context = torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else nullcontext()
        with context:
            kwargs = {**flat.ddp_kwargs(), **self._ddp_kwargs}
            ddp = DistributedDataParallel(flat, device_ids=device_ids, **kwargs)
        self.comm_state = flat.comm_state()
        ddp.register_comm_hook(self.comm_state, allreduce_hook)
        return ddp


class FlatGradDataParallelStrategy(_FlatGradStrategy):
    """Lightning's DDPStrategy environment (processes, devices, process group) with
    ``flatgrad.replicate(FlatGrad(module))`` in place of DDP: buckets that are views of the flat buffer,
    averaged during backward; ``accumulate_grad_batches`` runs the micro-batches in the module's `no_sync`.
    Registered as ``"flatgrad_data_parallel"``.

    Args:
        config: The `FlatGrad` config (as `FlatGradDDPStrategy`'s).
        bucket_cap_mb: `replicate`'s bucket size in MiB.
        reduce_dtype: `replicate`'s compressed wire (``torch.bfloat16``/``torch.float16``), or None.
        broadcast_buffers: `replicate`'s flag (rank 0's buffers before each forward that follows a
            synchronised training forward).
        check_finite: `replicate`'s flag (a non-finite gradient raises on every rank).
        **kwargs: DDPStrategy's own arguments only (``accelerator``, ``parallel_devices``,
            ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``, ``process_group_backend``,
            ``timeout``, ``start_method``).

    Raises:
        TypeError: Another keyword argument is given (DDP's arguments have no DDP here).
    """

    strategy_name = "flatgrad_data_parallel"
    _description = "flatgrad.replicate: overlapped buckets of the flat buffer"

    def __init__(
        self,
        config: Config = None,
        bucket_cap_mb: float = 25.0,
        reduce_dtype: torch.dtype | None = None,
        broadcast_buffers: bool = True,
        check_finite: bool = False,
        **kwargs: Any,
    ) -> None:
        unknown = sorted(set(kwargs) - set(_STRATEGY_ARGUMENTS))
        if unknown:
            raise TypeError(
                f"{type(self).__name__}'s keyword arguments must be DDPStrategy's own "
                f"({', '.join(_STRATEGY_ARGUMENTS)}), got {unknown}"
            )
        super().__init__(config, **kwargs)
        self.data_parallel_options: dict[str, Any] = dict(
            bucket_cap_mb=bucket_cap_mb,
            reduce_dtype=reduce_dtype,
            broadcast_buffers=broadcast_buffers,
            check_finite=check_finite,
        )

    def _setup_model(self, model: torch.nn.Module) -> ReplicateModule:  # type: ignore[override]
        """``flatgrad.replicate(FlatGrad(model), ...)``, in place (it broadcasts rank 0's parameters and
        buffers, as DDP's constructor); a module an earlier fit replicated is replicated afresh."""
        if isinstance(model, ReplicateModule):  # (an earlier fit's: its process group may be gone)
            unreplicate(model)
        self.flat = FlatGrad(model, self.flatgrad_config)
        return replicate(self.flat, **self.data_parallel_options)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's, always through the module's call (Lightning calls ``training_step`` directly where
        the strategy's model is the LightningModule, skipping the bookkeeping that decides the averaging)."""
        return self._through_call(self.precision_plugin.train_step_context(), "training_step", args, kwargs)

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        """Before each backward: onto reduce-scattered gradients (a second `manual_backward` before
        `zero_grad`), their averages set aside (`BucketSync.before_backward`)."""
        if isinstance(self.model, ReplicateModule):
            replicate_state(self.model).before_backward()

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's, through the module's call too: rank 0's buffers, as DDP's forward broadcasts them."""
        return self._through_call(self.precision_plugin.val_step_context(), "validation_step", args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """As `validation_step`."""
        return self._through_call(self.precision_plugin.test_step_context(), "test_step", args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """As `validation_step`."""
        return self._through_call(self.precision_plugin.predict_step_context(), "predict_step", args, kwargs)

    def _through_call(self, context: Any, method: str, args: Any, kwargs: Any) -> Any:
        assert self.lightning_module is not None and self.model is not None
        with context:
            return self._forward_redirection(self.model, self.lightning_module, method, *args, **kwargs)

    def configure_ddp(self) -> None:
        """Apply flatgrad to the LightningModule (DDPStrategy's also registers DDP comm hooks: none here)."""
        assert isinstance(self.model, pl.LightningModule)
        self.model = self._setup_model(self.model)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """The model's `no_sync` while Lightning accumulates (``accumulate_grad_batches``)."""
        with self.model.no_sync() if isinstance(self.model, ReplicateModule) else nullcontext():
            yield None


class FlatGradShardedStrategy(FlatGradDataParallelStrategy):
    """`FlatGradDataParallelStrategy` with ZeRO-1: the optimizer ``configure_optimizers`` returns (a plain
    torch optimizer, with its schedulers) is rebuilt as ``flatgrad.ShardedOptimizer(dp, type(optimizer),
    optimizer.param_groups, **optimizer.defaults)``: the same class, groups and arguments, each rank keeping
    its shards' state; its schedulers step the ShardedOptimizer. Registered as ``"flatgrad_sharded"``.

    Clipping is by norm only; several optimizers are sharded by tensor (so they share the replicated module).

    Args:
        config: The `FlatGrad` config (as `FlatGradDDPStrategy`'s).
        overlap_param_gather: `ShardedOptimizer`'s flag.
        shard_by: `ShardedOptimizer`'s ``shard_by`` (None: the class's own way, or ``"tensor"`` where
            ``configure_optimizers`` returns several optimizers).
        **kwargs: `FlatGradDataParallelStrategy`'s arguments.

    Raises:
        TypeError: As `FlatGradDataParallelStrategy`.
        ValueError: At setup, ``shard_by="element"`` with several optimizers.
    """

    strategy_name = "flatgrad_sharded"
    _description = "flatgrad.replicate with ShardedOptimizer (ZeRO-1)"

    def __init__(
        self,
        config: Config = None,
        overlap_param_gather: bool = False,
        shard_by: ShardBy | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(config, **kwargs)
        self.sharded_options: dict[str, Any] = dict(
            overlap_param_gather=overlap_param_gather, shard_by=shard_by
        )

    def setup_precision_plugin(self) -> None:
        """``"16-mixed"``: the plugin's ``torch.amp.GradScaler`` (which a ShardedOptimizer refuses at
        `step`) replaced by a `flatgrad.GradScaler` with the same settings (it unscales this rank's gradient
        shards and agrees on overflows over the ranks); then the replicate strategy's."""
        plugin = self.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        if isinstance(scaler, torch.amp.GradScaler) and not isinstance(scaler, GradScaler):
            plugin.scaler = GradScaler(  # type: ignore[attr-defined]
                self.root_device.type,
                init_scale=scaler.get_scale(),
                growth_factor=scaler.get_growth_factor(),
                backoff_factor=scaler.get_backoff_factor(),
                growth_interval=scaler.get_growth_interval(),
                enabled=scaler.is_enabled(),
            )
        super().setup_precision_plugin()

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """``configure_optimizers``' optimizers, each rebuilt as a ShardedOptimizer over the module;
        schedulers are pointed at it."""
        super().setup_optimizers(trainer)
        assert isinstance(self.model, ReplicateModule)
        shard_by = _shard_by(self.sharded_options["shard_by"], len(self.optimizers))
        sharded: list[torch.optim.Optimizer] = [
            self._sharded(self.model, opt, shard_by) for opt in self.optimizers
        ]
        for old, new in zip(self.optimizers, sharded):
            schedulers = [
                s for c in self.lr_scheduler_configs for s in _chained(c.scheduler) if s.optimizer is old
            ]
            for scheduler in schedulers:
                scheduler.optimizer = new  # (its lr writes reach the new groups)
            if schedulers:
                _track_scheduler_steps(new)
        self.optimizers = sharded

    def teardown(self) -> None:
        """Drop the gradients (a reduce-scattered `.grad` refuses Lightning's teardown move to the CPU, and
        holds no averaged value to read afterwards), then `FlatGradDataParallelStrategy`'s."""
        for optimizer in self.optimizers:
            if isinstance(optimizer, ShardedOptimizer):
                optimizer.zero_grad(set_to_none=True)
        super().teardown()

    def _sharded(
        self, model: ReplicateModule, optimizer: torch.optim.Optimizer, shard_by: ShardBy | None
    ) -> ShardedOptimizer:
        if isinstance(optimizer, ShardedOptimizer):
            return optimizer
        groups = [dict(group) for group in optimizer.param_groups]
        defaults = _rebuilt_arguments(optimizer)
        options = {**self.sharded_options, "shard_by": shard_by}
        return ShardedOptimizer(model, type(optimizer), groups, **options, **defaults)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The ShardedOptimizer's state made whole (a collective: Lightning calls this on every rank) in the
        form a plain torch optimizer of the same class and groups saves (`plain_optimizer_state`), on rank 0;
        ``{}`` on the others, whose dict Lightning does not write. Any other optimizer's as Lightning's.

        Args:
            optimizer: One of the trainer's optimizers.

        Returns:
            ``{"state": {index: {key: tensor}}, "param_groups": [{..., "params": [index]}]}``.
        """
        inner = _unwrapped(optimizer)
        if not isinstance(inner, ShardedOptimizer):
            return super().optimizer_state(optimizer)
        state = plain_optimizer_state(inner)
        return state if self.is_global_zero else {}

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Lightning's, with each plain torch optimizer state (by index: what this strategy, "ddp" and the
        other flatgrad strategies save) given to a ShardedOptimizer by parameter name
        (`named_optimizer_state`); a ShardedOptimizer's own (by name) as it is.

        Args:
            checkpoint: The checkpoint Lightning resumes from.
        """
        states = [
            named_optimizer_state(inner, saved)
            if isinstance(inner := _unwrapped(optimizer), ShardedOptimizer) and _by_index(saved)
            else saved
            for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"])
        ]
        super().load_optimizer_state_dict({**checkpoint, "optimizer_states": states})


def whole_optimizer_state(optimizer: ShardedOptimizer) -> dict[str, Any]:
    """`optimizer`'s state dict with every parameter's state whole on every rank (a collective): by element,
    each per-element ShardedTensor summed from every rank's shards (`flatgrad._zero_state.whole_state`); by
    tensor, every rank's owned parameters' entries gathered. `ShardedOptimizer.load_state_dict` loads it on
    any world size.

    Args:
        optimizer: The ShardedOptimizer (every rank of its group calls this together).

    Returns:
        ``{"state": {name: {key: value}}, "param_groups": [...]}``, as `state_dict`'s.
    """
    saved = optimizer.state_dict()
    saved["param_groups"] = without_stepped_options(saved["param_groups"])
    group = optimizer.dp.process_group
    if optimizer.shard_by == "element":
        return {**saved, "state": whole_state(saved["state"], group)}
    parts: list[Any] = [None] * optimizer.world_size
    dist.all_gather_object(parts, saved["state"], group=group)
    return {**saved, "state": {name: entry for part in parts for name, entry in part.items()}}


def plain_optimizer_state(optimizer: ShardedOptimizer) -> dict[str, Any]:
    """What a plain torch optimizer of `optimizer`'s class and groups would save (a collective:
    `whole_optimizer_state`), so that ``torch.optim.<Class>.load_state_dict``, Lightning's "ddp" and every
    flatgrad strategy resume from it; float32 master weights are left out (warned). The form, and why:
    docs/integrations.md, "Lightning checkpoints across strategies".

    Args:
        optimizer: The ShardedOptimizer (every rank of its group calls this together).

    Returns:
        ``{"state": {index: {key: tensor}}, "param_groups": [{**options, "params": [index]}]}``, as
        `torch.optim.Optimizer.state_dict` returns it.
    """
    saved = whole_optimizer_state(optimizer)
    state: dict[int, dict[str, Any]] = {}
    param_groups = []
    index = 0
    masters: set[torch.dtype] = set()  # the dtypes of parameters whose masters are dropped
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        indices = []
        for param, name in zip(group["params"], saved_group["params"]):
            entry = saved["state"].get(name)
            if entry and not never_stepped(entry):  # (torch keeps no state then)
                if MASTER in entry:
                    masters.add(param.dtype)
                state[index] = {
                    key: _plain_value(value, param) for key, value in entry.items() if key != MASTER
                }
            indices.append(index)
            index += 1
        param_groups.append({**options(saved_group), "params": indices})
    if masters:  # (once per save)
        logger.warning(
            "flatgrad_sharded: the float32 master weights are not saved in the plain optimizer "
            "state; a resumed run starts from the %s parameters",
            "/".join(sorted(str(dtype) for dtype in masters)),
        )
    rest = saved.get(CLASS_STATE) or {}  # (the class's state not of a parameter, as it saves it)
    state.update(rest.get("state") or {})
    return {**{k: v for k, v in rest.items() if k != "state"}, "state": state, "param_groups": param_groups}


def named_optimizer_state(optimizer: ShardedOptimizer, plain: dict[str, Any]) -> dict[str, Any]:
    """`plain` (a torch optimizer's state dict, by index: `plain_optimizer_state`'s, or a plain optimizer's
    of the same class and groups) keyed by `optimizer`'s parameter names, which
    `ShardedOptimizer.load_state_dict` loads (whole tensors, shaped as the parameters).

    Args:
        optimizer: The ShardedOptimizer to load into.
        plain: The torch optimizer state dict.

    Returns:
        ``{"state": {name: {key: value}}, "param_groups": [{**options, "params": [names]}]}``.

    Raises:
        ValueError: `plain`'s groups do not hold as many parameters as `optimizer`'s.
    """
    names = [list(group["params"]) for group in optimizer.state_dict()["param_groups"]]
    counts = [len(group["params"]) for group in plain["param_groups"]]
    if counts != [len(group) for group in names]:
        raise ValueError(
            f"the checkpoint's optimizer groups must hold as many parameters as the optimizer's "
            f"(configure_optimizers: the same model and grouping), got {counts} for "
            f"{[len(group) for group in names]}"
        )
    name_of = {
        index: name
        for group, group_names in zip(plain["param_groups"], names)
        for index, name in zip(group["params"], group_names)
    }
    state = {name_of[index]: dict(entry) for index, entry in plain["state"].items() if index in name_of}
    param_groups = [
        {**options(group), "params": group_names} for group, group_names in zip(plain["param_groups"], names)
    ]
    rest = {key: value for key, value in plain.items() if key not in ("state", "param_groups")}
    rest["state"] = {key: value for key, value in plain["state"].items() if key not in name_of}
    return {"state": state, "param_groups": param_groups, CLASS_STATE: rest}


def _by_index(saved: object) -> bool:
    """Whether `saved` is a plain torch optimizer state dict (parameters by index)."""
    groups = saved.get("param_groups", []) if isinstance(saved, dict) else []
    return any(isinstance(p, int) for group in groups for p in group.get("params", ()))


def _plain_value(value: object, param: torch.Tensor) -> object:
    """A saved state value as a torch optimizer keeps it: a tensor of its own (a step count cloned out of
    the group's shared one), per-element state shaped and typed as `param`."""
    if not isinstance(value, torch.Tensor):
        return value
    value = value.detach().clone()
    if value.numel() == param.numel() and value.dim() > 0:  # per element (a step count is 0-d)
        value = value.reshape(param.shape)
        if value.is_floating_point() and param.is_floating_point():
            value = value.to(param.dtype)
    return value


def _shard_by(shard_by: ShardBy | None, num_optimizers: int) -> ShardBy | None:
    """How each of `num_optimizers` ShardedOptimizers shards: several share the one replicated module only
    by tensor (by element, its buckets reduce-scatter for one optimizer's shards), so by tensor."""
    if num_optimizers < 2:
        return shard_by
    if shard_by == "element":
        raise ValueError(
            f"shard_by must be 'tensor' or None under flatgrad_sharded with {num_optimizers} "
            "optimizers (by element, the module's buckets reduce-scatter for one "
            "optimizer's shards), got 'element'"
        )
    logger.info("flatgrad_sharded: %d optimizers, each sharded by tensor", num_optimizers)
    return "tensor"


def _track_scheduler_steps(optimizer: torch.optim.Optimizer) -> None:
    """Have `optimizer.step` tracked as a scheduler built on it tracks it (torch's schedulers warn at their
    first step when the optimizer they were built on was not stepped through that tracking), through torch's
    public API: a throwaway LambdaLR of factor 1, whose initial step rewrites each group's ``lr`` from
    ``initial_lr``; the groups' ``lr`` the user's schedulers set are put back."""
    lrs = [group["lr"] for group in optimizer.param_groups]
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr


def _chained(scheduler: object) -> list[Any]:
    """`scheduler` and those it steps (torch's SequentialLR and ChainedScheduler keep theirs in a list)."""
    inner = [s for value in vars(scheduler).values() if isinstance(value, list) for s in value]
    return [scheduler, *(c for s in inner if hasattr(s, "optimizer") for c in _chained(s))]


def _rebuilt_arguments(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The entries of `optimizer`'s `defaults` its constructor takes (torch's AdamW keeps more), checked: one
    of its class built with them must keep the attributes `optimizer` keeps beside its groups and state (Lion
    keeps ``decoupled_weight_decay`` as one only). Raises ValueError where it does not."""
    cls = type(optimizer)
    parameters = inspect.signature(cls.__init__).parameters
    arguments = dict(optimizer.defaults)
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        arguments = {key: value for key, value in arguments.items() if key in parameters}
    like = next(p for group in optimizer.param_groups for p in group["params"])
    base = {*vars(torch.optim.Optimizer([torch.zeros(1)], {})), "defaults", "step"}  # (step: a scheduler's)
    try:
        kept = vars(cls([nn.Parameter(like.new_zeros((2,) * like.dim()))], **arguments))
        lost = [k for k in vars(optimizer).keys() - base if not _same(vars(optimizer)[k], kept.get(k, base))]
    except Exception as error:  # (the class refuses its own defaults: magma's AdamW base)
        lost = [repr(error)]
    if lost:
        raise ValueError(
            f"flatgrad_sharded rebuilds the {cls.__name__} configure_optimizers returned from its param "
            f"groups and defaults, which do not give back {sorted(lost)}: return flatgrad.ShardedOptimizer("
            f"self, {cls.__name__}, ..., <its arguments>) from configure_optimizers instead (the module is "
            "replicated by then)"
        )
    return arguments


def _same(a: object, b: object, depth: int = 3) -> bool:
    """Whether optimizer attributes `a` and `b` are one setting (functions by code, objects by attributes,
    `depth` objects down; optimizers inside by their options: a scheduler over one wraps its step)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, types.FunctionType) and isinstance(b, types.FunctionType):
        return (
            a.__code__ is b.__code__
            and a.__defaults__ == b.__defaults__
            and not (a.__closure__ or b.__closure__)
        )
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (
            a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a.detach().cpu(), b.detach().cpu()))
        )
    if isinstance(a, torch.optim.Optimizer) and isinstance(b, torch.optim.Optimizer):  # (SPAM's warm-up)
        x, y = ([{**g, "params": None} for g in (o.defaults, *o.param_groups)] for o in (a, b))
        return _same(x, y, 0)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], depth) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y, depth) for x, y in zip(a, b))
    if hasattr(a, "__dict__") and not isinstance(a, type):
        return depth > 0 and _same(vars(a), vars(b), depth - 1)
    try:
        return bool(a == b)
    except Exception:  # (an object whose == does not give a bool)
        return False


def _clip_through_flatgrad(plugin: Precision, flat_of: Callable[[], FlatGrad | None]) -> None:
    """Make `plugin` clip by norm with flatgrad's norm: a ShardedOptimizer's own `clip_grad_norm_`,
    `FlatGrad.clip_grad_norm_` where the optimizer holds every parameter with a slot, the plugin's own
    otherwise (by value: the plugin's own, element by element, which reduce-scattered `.grad`s take).
    (Instance attributes: this strategy's plugin only, nothing process-wide; once per plugin, though every
    fit's setup calls this.)"""
    if getattr(plugin, "_flatgrad_clips", False):
        return
    plugin._flatgrad_clips = True  # type: ignore[attr-defined]
    by_norm, clip = plugin.clip_grad_by_norm, plugin.clip_gradients

    def clip_grad_by_norm(optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        # (Lightning clips the optimizer's parameters: flatgrad's norm is the whole model's)
        inner, flat = _unwrapped(optimizer), flat_of()
        whole = flat is not None and _holds_every_slot(inner, flat)
        if isinstance(inner, ShardedOptimizer) and whole:
            inner.clip_grad_norm_(clip_val)
        elif isinstance(inner, ShardedOptimizer) and inner.shard_by == "element":
            raise ValueError(
                "flatgrad_sharded (by element) clips the gradients of every parameter of the model, and "
                "this optimizer does not hold every one that has a gradient, where Lightning clips the "
                "optimizer's own: freeze the parameters it does not step (requires_grad_(False)), or shard "
                "by tensor (FlatGradShardedStrategy(shard_by='tensor'))"
            )
        elif whole:
            flat.clip_grad_norm_(clip_val)  # type: ignore[union-attr]
        else:
            by_norm(optimizer, clip_val)

    def clip_gradients(
        optimizer: torch.optim.Optimizer, clip_val: float = 0.0, gradient_clip_algorithm: Any = "norm"
    ) -> None:
        # Lightning's mixed-precision plugin refuses to clip an optimizer that unscales inside its step, as
        # a ShardedOptimizer declares (for a GradScaler). With flatgrad.GradScaler ("16-mixed") unscale the
        # shards first, as torch's recipe does before clipping (the step does not again).
        inner = _unwrapped(optimizer)
        if not isinstance(inner, ShardedOptimizer):
            clip(optimizer, clip_val, gradient_clip_algorithm)
            return
        scaler = getattr(plugin, "scaler", None)
        if scaler is not None and clip_val > 0:
            scaler.unscale_(inner)
        Precision.clip_gradients(plugin, optimizer, clip_val, gradient_clip_algorithm)

    plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]
    plugin.clip_gradients = clip_gradients  # type: ignore[method-assign]


def _unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer a LightningOptimizer stands for (or `optimizer` itself)."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _holds_every_slot(optimizer: torch.optim.Optimizer, flat: FlatGrad) -> bool:
    """Whether `optimizer` holds parameters of `flat` only, every one with a `.grad` among them: then
    flatgrad's norm, over every `.grad` of the model, is the optimizer's."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    graded = {id(p) for p in flat.parameters() if p.grad is not None}
    return graded <= held <= {id(p) for p in flat.parameters()}


# Lightning finds strategies by name in StrategyRegistry only, filled from its own modules; it has no entry
# point for strategies (callbacks_factory is read after the strategy name was resolved), so the names exist
# once this module is imported.
for _strategy in (FlatGradDDPStrategy, FlatGradDataParallelStrategy, FlatGradShardedStrategy):
    _strategy.register_strategies(StrategyRegistry)
