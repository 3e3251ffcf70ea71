"""`replicate`: overlapped, bucketed gradient averaging on FlatGrad's one flat buffer, applied to the model in
place (`ReplicateModule`, `ReplicateState`).

Buckets are `narrow` views of the flat buffer cut at slot boundaries (`flatgrad._bucket_sync.plan_buckets`).
A post hook on each parameter's AccumulateGrad node counts it ready; a bucket whose parameters are all ready
starts its collective during backward once every bucket before it in the launch order (the same on every
rank) has, and an autograd final callback launches the rest, waits and settles `.grad` as DDP with
``find_unused_parameters=True`` does. As under DDP, the forward decides which backwards average. The launch
order, unused parameters, which backwards average and nested backwards: docs/design.md, "replicate's
buckets" and "Under `flatgrad.replicate`"; docs/data-parallel.md, "replicate"; docs/integrations.md, "Manual
optimization".

On CUDA with NCCL the collectives run on the process group's stream, which waits via an event for the launch's
current stream (an AccumulateGrad hook's, kept from the application, or the final callback's), and that one
first for the stream the backward opened on where they differ; the final callback's `Work.wait()` makes the
current stream wait. Nothing writes a bucket before its collective is done: backward returns after."""

from __future__ import annotations

import contextlib
import logging
import weakref
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, JoinHook
from torch.distributed.device_mesh import DeviceMesh

from flatgrad._bucket_sync import BucketSync
from flatgrad._comm import check_wire_dtype
from flatgrad._dtensor import local_of
from flatgrad._flatgrad import FlatGrad, engine_of, flat_class, original_class, settled_buffers, wait_gathers
from flatgrad._torch_compat import (
    active_ddp,
    broadcast_coalesced,
    join_state,
    leave_join,
    preserve_version_counter,
)

logger = logging.getLogger(__name__)


class ReplicateModule(FlatGrad):
    """What `replicate` adds to a model (besides `FlatGrad`'s): the calls that average, and
    DDP's and FSDP2's control surface. `replicate_state` gives the rest (buckets, timings).

    ``model(*args)`` runs as before; after ``loss.backward()`` returns every `.grad` is averaged over the
    ranks (as under DDP), also when the loss does not come out of the model's output (an auxiliary loss kept
    on the module). ``with model.no_sync():`` (or ``model.set_requires_gradient_sync(False)``) accumulates
    locally. With ``broadcast_buffers`` (DDP's flag and default) rank 0's buffers (BatchNorm statistics) are
    broadcast before each forward that follows a synchronised training forward.

    The model is a `torch.distributed.algorithms.Joinable`, as DDP: for uneven data per rank, train inside
    ``with Join([model, opt]):`` (docs/data-parallel.md, "Uneven data per rank"). A deep copy or an unpickled
    model is FlatGrad's alone: `replicate` it again to average (docs/design.md, "Names and state")."""

    # Eager even under torch.compile(model), as FlatGrad.__call__ (the frame only: its bookkeeping must see
    # the real output); the model is still compiled (FlatGrad's `_flatgrad_call` hands it to Dynamo).
    @torch.compiler.disable(recursive=False)
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if active_ddp() is not None and torch.is_grad_enabled():  # (the same on every rank DDP runs)
            raise ValueError(
                "a DistributedDataParallel runs this replicated model (transformers' Trainer and "
                "Accelerate's prepare wrap a model in DDP): both would average every gradient. Under DDP "
                "give it FlatGrad alone and flatgrad's DDP hook (flatgrad.accelerate.attach, or DDP(model, "
                "**model.ddp_kwargs()) and register_comm_hook: docs/integrations.md); or drop the DDP"
            )
        state = replicate_state(self)
        training = state.before_forward()
        context = state._engine.forward_context or contextlib.nullcontext  # (`ForwardWaits.learning`)
        finished = False
        try:
            with context():
                output = super().__call__(*args, **kwargs)
            finished = True
        finally:  # (a forward that raised ends too: a later backward is outside it)
            state.after_forward(training, finished)
        return output

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """`nn.Module.named_parameters` (and so `parameters()`); outside a training forward, after the gathers
        still in flight (`overlap_param_gather`: an EMA's `update_parameters(model)` right after the step)."""
        state = self.__dict__.get(_STATE)
        if state is not None and not state._engine.in_forward:
            wait_gathers(self)
        return super().named_parameters(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        # Copies are FlatGrad's alone (the data-parallel state holds the process group, autograd hooks).
        state = super().__getstate__()
        state.pop(_STATE, None)
        state.pop("_join_config", None)
        return state

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forwards inside (and backwards through their outputs) accumulate in the flat buffer without
        communicating, as under DDP's ``no_sync()``; the first backward of a forward outside averages it all.

        Returns:
            A context manager (``with model.no_sync():``), which binds nothing."""
        state = replicate_state(self)
        previous, state.sync = state.sync, False
        try:
            yield
        finally:
            state.sync = previous

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """FSDP2's switch: whether the backwards of the next forwards average (False: they accumulate locally,
        as inside `no_sync`, until set True again).

        Args:
            requires_gradient_sync: Whether to average."""
        replicate_state(self).sync = bool(requires_gradient_sync)

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's flag, toggled by `no_sync()`: whether the next forward's backward averages. nanoGPT's
        train.py sets it (``model.require_backward_grad_sync = micro_step == last``), which works here too.

        Returns:
            True unless inside `no_sync()` or set to False."""
        return replicate_state(self).sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        replicate_state(self).sync = bool(value)

    # --- Join (the model is the Joinable: ``with Join([model, opt]):``) ---------------------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook by which a rank out of data shadows the others' iterations under ``Join([model, ...])``.

        Args:
            **kwargs: The Join's: ``divide_by_initial_world_size`` (default True, as DDP's) divides each
                average by the world size, False by the ranks not joined yet; others are for other joinables.

        Returns:
            The join hook."""
        state = replicate_state(self)
        return _ReplicateJoinHook(state, bool(kwargs.get("divide_by_initial_world_size", True)))

    @property
    def join_device(self) -> torch.device:
        """Where the Join's own all-reduces run: the device of the model's gradients.

        Returns:
            The first flat buffer's device (CPU for a model without one)."""
        return replicate_state(self).join_device

    @property
    def join_process_group(self) -> Any:
        """The group the Join's all-reduces run over: the one `replicate` averages over.

        Returns:
            That process group (None: the default group)."""
        return replicate_state(self).process_group


# What ReplicateModule adds to FlatGrad's names, refused where the model has one already.
_ADDED = (
    "no_sync", "set_requires_gradient_sync", "require_backward_grad_sync", "join_hook", "join_device",
    "join_process_group",
)  # fmt: skip
_STATE = "_flatgrad_replicate"  # the model's `__dict__` key of its `ReplicateState`


def replicate_state(model: nn.Module) -> ReplicateState:
    """The `ReplicateState` of a model `replicate` was applied to.

    Args:
        model: The model.

    Returns:
        Its state: the process group, the bucket views and the last backward's timings.

    Raises:
        TypeError: `replicate` was not applied to `model`."""
    state = model.__dict__.get(_STATE) if isinstance(model, nn.Module) else None
    if state is None:
        raise TypeError(
            f"model must be one flatgrad.replicate was applied to, got a {type(model).__name__} "
            "(model = flatgrad.replicate(model, ...) changes it in place)"
        )
    return state  # type: ignore[no-any-return]


def replicate(
    model: nn.Module,
    *,
    process_group: dist.ProcessGroup | None = None,
    device_mesh: DeviceMesh | None = None,
    bucket_cap_mb: float = 25.0,
    reduce_dtype: torch.dtype | None = None,
    broadcast_buffers: bool = True,
    check_finite: bool = False,
) -> ReplicateModule:
    """Average `model`'s gradients over `process_group` bucket by bucket, overlapped with the backward; in
    place, as torch's composable ``replicate`` and FSDP2's ``fully_shard``: returns `model`, now also a
    `ReplicateModule` (and a `FlatGrad`, applied with the defaults first where it is not yet). Rank 0's
    parameters and buffers are broadcast now. What the model does from then on: `ReplicateModule`.

    Args:
        model: The model; every rank must pass the same model.
        process_group: The group to average over; None for the default group. For a tensor-parallel model, the
            data-parallel dimension's (``mesh["dp"].get_group()``).
        device_mesh: A 1-D `DeviceMesh` to average over instead of `process_group`.
        bucket_cap_mb: The approximate size of a bucket in MiB, DDP's argument (the first is smaller, 1 MiB as
            DDP's, but for CPU buffers on a host without a core to spare).
        reduce_dtype: ``torch.bfloat16`` or ``torch.float16`` to average a compressed copy of each
            floating-point bucket (FSDP2's MixedPrecisionPolicy name); None: as it is.
        broadcast_buffers: Whether rank 0's buffers are broadcast again before a forward that follows a
            synchronised training forward, as DDP's flag of that name.
        check_finite: Whether a non-finite local gradient on any rank makes ``loss.backward()`` raise on every
            rank, naming the rank and the parameters.

    Returns:
        `model`.

    Raises:
        TypeError: `model` is not an `nn.Module`, or `check_finite` is not a bool.
        RuntimeError: No process group is initialised (``dist.init_process_group``).
        ValueError: `replicate` was applied already; a bad `bucket_cap_mb` or `reduce_dtype`; sparse
            embeddings, an attribute named as one `ReplicateModule` adds; the ranks' models or settings differ
            (on every rank); a bad `device_mesh`; or the group crosses the DTensor parameters' mesh."""
    _check_arguments(model, bucket_cap_mb, reduce_dtype, check_finite)
    flat = model if isinstance(model, FlatGrad) else FlatGrad(model)
    engine_of(flat).refuse_sparse("replicate")
    process_group = _mesh_group(device_mesh, process_group)
    tensor_parallel = engine_of(flat).refresh().tensor_parallel
    if tensor_parallel is not None:
        tensor_parallel.check_data_parallel(process_group, "replicate")
    _check_same_model(flat, process_group)
    _check_same_settings(
        flat, float(bucket_cap_mb), reduce_dtype, check_finite, bool(broadcast_buffers), process_group
    )
    _broadcast([*flat.parameters(), *flat.buffers()], process_group, 0)  # (as DDP's constructor)
    state = ReplicateState(
        flat, process_group, float(bucket_cap_mb), reduce_dtype, bool(broadcast_buffers), check_finite
    )
    flat.__class__ = flat_class(original_class(type(flat)), ReplicateModule)
    flat.__dict__[_STATE] = state
    leave_join(flat)  # (not joined: Join configures it)
    return flat  # type: ignore[return-value]  # (its class is a ReplicateModule now)


def unreplicate(model: ReplicateModule) -> FlatGrad:
    """Take `replicate` off `model` (a second Lightning fit replicates it afresh): hooks removed, class and
    state FlatGrad's alone, the same object returned.

    Args:
        model: A model `replicate` was applied to, with no backward running.

    Returns:
        `model`, a `FlatGrad` of its own class again."""
    state = replicate_state(model)
    state._engine.drain()  # (a backward that raised never finished)
    state._engine.hooks.remove()
    del model.__dict__[_STATE]
    model.__class__ = flat_class(original_class(type(model)))  # type: ignore[assignment]
    return model


def _check_arguments(
    model: nn.Module, bucket_cap_mb: float, reduce_dtype: torch.dtype | None, check_finite: bool
) -> None:
    """`replicate`'s refusals that need no collective (the same on every rank)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, ReplicateModule):
        raise ValueError(
            "flatgrad.replicate is already applied to this model: it changes the model in place, "
            "once (its process group and buckets are fixed then)"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("replicate needs an initialised process group (dist.init_process_group)")
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
    check_wire_dtype(reduce_dtype)
    if not isinstance(check_finite, bool):
        raise TypeError(f"check_finite must be a bool, got {type(check_finite).__name__}")
    clashes = [name for name in _ADDED if hasattr(model, name)]
    if clashes:
        raise ValueError(
            f"the model's class {type(model).__name__} has attributes named as those replicate adds "
            f"({', '.join(clashes)}), which it would hide: rename them in the model"
        )


class ReplicateState:
    """One replicated model's data-parallel state: its process group and settings, the bucket sync (`_engine`,
    a `BucketSync` over the model's `GradEngine`), what forwards do around it (buffer broadcasts, Join), the
    buckets and the last synchronised backward's timings. Built by `replicate`; `replicate_state(model)`."""

    def __init__(
        self,
        model: FlatGrad,
        process_group: dist.ProcessGroup | None,
        bucket_cap_mb: float,
        reduce_dtype: torch.dtype | None,
        broadcast_buffers: bool,
        check_finite: bool,
    ) -> None:
        self._module = weakref.ref(model)  # (the model holds this state: weakly back)
        self.process_group = process_group
        self.bucket_cap_mb = bucket_cap_mb
        self.reduce_dtype = reduce_dtype
        self.world_size = dist.get_world_size(process_group)
        self.broadcast_buffers = broadcast_buffers
        # DDP's require_forward_param_sync: whether the last forward trained and synchronised
        # (True before the first), which is when the next forward broadcasts the buffers.
        self._sync_buffers_next = True
        self._divide_by_initial_world_size = True  # (the running Join's, as DDP's)
        self._engine = BucketSync(engine_of(model), process_group, bucket_cap_mb, reduce_dtype, check_finite)

    @property
    def alive(self) -> bool:
        """Whether the replicated model still exists (the state holds it weakly)."""
        return self._module() is not None

    @property
    def module(self) -> FlatGrad:
        """The replicated model."""
        model = self._module()
        assert model is not None, "the replicated model is gone"
        return model

    @property
    def sync(self) -> bool:
        """DDP's require_backward_grad_sync, in the bucket sync (a backward opening mid-forward reads it)."""
        return self._engine.sync

    @sync.setter
    def sync(self, value: bool) -> None:
        self._engine.sync = value

    @torch.compiler.disable
    def before_forward(self) -> bool:
        """Before the model's forward; whether it trains (grad enabled)."""
        engine = self._engine
        engine.drain()  # (a backward that raised never finished)
        if engine_of(self.module).steady() is not engine.store:
            engine.rebuild()
        joined, first = join_state(self.module)
        if joined:
            self._notify_join(first)
        elif self._sync_buffers_next and self.broadcast_buffers and engine.has_buffers:
            self._broadcast_buffers()
        # This forward's output's backward is this engine's too (bound into its plan: see flatgrad._backward).
        engine_of(self.module).expect_sync(engine, self.sync)
        training = torch.is_grad_enabled()
        if training:  # a backward inside it (Lightning's manual_backward) averages unless no_sync
            engine.begin_forward()
        return training

    def before_backward(self) -> None:
        """Before a backward that may open from a parameter's hook (inside the forward: Lightning's
        `manual_backward`, whose flatgrad strategies call this): `BucketSync.before_backward`."""
        self._engine.before_backward()

    @torch.compiler.disable
    def after_forward(self, training: bool, finished: bool) -> None:
        if finished:
            self._sync_buffers_next = training and self.sync
        if training:
            self._engine.end_forward(finished)

    def _broadcast_buffers(self, source: int = 0) -> None:
        """Rank `source`'s (group rank) buffers to every rank, as DDP's forward: those found now (one may be
        re-assigned), coalesced into few broadcasts (`dist._broadcast_coalesced`, DDP's own, 250 MiB pieces),
        without bumping their version counters (one saved for a backward stays usable, as under DDP)."""
        buffers = list(self.module.buffers())
        if not buffers:
            return
        with torch.no_grad(), preserve_version_counter(tuple(buffers)):
            broadcast_coalesced(self.process_group, buffers, source)  # (group rank)

    def _notify_join(self, first: bool) -> None:
        """Before a forward inside a `Join`, what DDP's forward does there, in its order: tell the joined
        ranks that this one has not joined (`Join.notify_join_context`); broadcast the buffers from the
        highest rank not joined (rank 0 may have joined with stale ones); and all-reduce (sync, 1), which the
        joined ranks match with zeros (`_ReplicateJoinHook`): whether this forward's backward averages, and
        the ranks not joined, which it divides by under ``divide_by_initial_world_size=False``. One small
        all-reduce per forward more than outside a Join, as DDP's."""
        if not first:
            raise ValueError(
                "the replicated model must be the first joinable of its Join, as DDP is: "
                "Join([model, opt]) (its forward's all-reduce tells the joined ranks that this "
                f"rank has not joined), got it at another place on rank {dist.get_rank(self.process_group)}"
            )
        Join.notify_join_context(self.module)  # type: ignore[arg-type]
        if self._sync_buffers_next and self.broadcast_buffers and self._engine.has_buffers:
            self._broadcast_buffers(self._common_rank(True))
        sync = torch.is_grad_enabled() and self.sync
        flags = torch.tensor([int(sync), 1], dtype=torch.int64, device=self.join_device)
        work = dist.all_reduce(flags, group=self.process_group, async_op=True)
        self._engine.joined_count = None if self._divide_by_initial_world_size else (work, flags)

    def _common_rank(self, candidate: bool) -> int:
        """The highest rank (of the group) for which `candidate` holds (DDP's
        `_find_common_rank`): every rank passes whether it is one; one small all-reduce."""
        rank = dist.get_rank(self.process_group)
        found = torch.tensor([rank if candidate else -1], dtype=torch.int64, device=self.join_device)
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.process_group)
        return int(found.item())

    @property
    def join_device(self) -> torch.device:
        """The first flat buffer's device (CPU for a model without one)."""
        buffers = settled_buffers(self.module)
        return next(iter(buffers.values())).device if buffers else torch.device("cpu")

    @property
    def buckets(self) -> list[torch.Tensor]:
        """The bucket views of the flat buffers, in launch order.

        Returns:
            A new list of 1-D `narrow` views of the flat gradient buffers."""
        return self._engine.buckets

    @property
    def launch_offsets_s(self) -> list[float]:
        """Of the last synchronised backward: when each bucket was launched.

        Returns:
            Seconds from the backward's start, one per bucket in launch order (empty before the first
            synchronised backward)."""
        return self._engine.last_round.launch_offsets_s

    @property
    def exposed_s(self) -> float:
        """Of the last synchronised backward: the final callback's wait for communication after compute ended.

        Host time (as `launch_offsets_s` and `backward_s`): on CUDA with NCCL the waits order the current
        stream after the collectives, not the host, so about 0 there (GPU time: CUDA events or the profiler).

        Returns:
            Seconds (0.0 before the first synchronised backward)."""
        return self._engine.last_round.exposed_s

    @property
    def backward_s(self) -> float:
        """Of the last synchronised backward: its start to the end of its compute.

        Returns:
            Seconds (0.0 before the first synchronised backward)."""
        return self._engine.last_round.backward_s


class _ReplicateJoinHook(JoinHook):
    """What a rank out of data does for each iteration of those still training, as DDP's `_DDPJoinHook`."""

    def __init__(self, dp: ReplicateState, divide_by_initial_world_size: bool) -> None:
        self.dp = dp
        dp._divide_by_initial_world_size = divide_by_initial_world_size
        super().__init__()

    def main_hook(self) -> None:
        """Match one forward of the others (`ReplicateState._notify_join`) and, when it
        averages, its backward (`BucketSync.shadow`, with zeros for this rank's gradients)."""
        dp = self.dp
        engine = dp._engine
        if dp._sync_buffers_next and dp.broadcast_buffers and engine.has_buffers:
            dp._broadcast_buffers(dp._common_rank(False))
        flags = torch.zeros(2, dtype=torch.int64, device=dp.join_device)
        dist.all_reduce(flags, group=dp.process_group)
        sync, ranks = int(flags[0]) > 0, int(flags[1])
        dp._sync_buffers_next = sync
        engine.shadowed_sync = sync
        if sync:
            engine.shadow(None if dp._divide_by_initial_world_size else ranks)

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank takes the parameters and buffers of the last rank to join (the highest of them), as
        DDP's: a joined rank kept its own since. With a ShardedOptimizer the parameters agree already (a
        joined rank steps its shards and gathers along: its join hook), and only the buffers move."""
        dp = self.dp
        source = dp._common_rank(is_last_joiner)
        if not dp._engine.reduce_scatter:
            _broadcast(dp.module.parameters(), dp.process_group, source)
        if dp.broadcast_buffers:
            dp._broadcast_buffers(source)


def _check_same_model(module: nn.Module, process_group: dist.ProcessGroup | None) -> None:
    """Raise on every rank unless all hold parameters and buffers of the same shapes, dtypes and trainability,
    in the same order (as DDP's constructor does): else the broadcast and buckets hang or mix unrelated slots.
    One MAX all-reduce of a digest and its negation: all equal exactly when min equals max."""
    tensors = [*module.parameters(), *module.buffers()]
    described = [(tuple(t.shape), str(t.dtype), t.requires_grad) for t in tensors]
    digest = zlib.crc32(repr(described).encode())
    device = tensors[0].device if tensors else torch.device("cpu")
    seen = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=process_group)
    high, low = int(seen[0]), -int(seen[1])
    if high != low:
        raise ValueError(
            f"the model differs across ranks (rank {dist.get_rank(process_group)}: "
            f"{len(described)} parameters and buffers): every rank must replicate the same model, "
            "with the same parameter and buffer shapes, dtypes and requires_grad, in the same order"
        )


# The settings `_check_same_settings` sends as the index of their value here.
_CHOICES: dict[str, tuple[object, ...]] = {
    "reduce_dtype": (None, torch.bfloat16, torch.float16),
    "check_finite": (False, True),
    "broadcast_buffers": (False, True),
    "grad_dtype": (None, "float32"),
}


def _check_same_settings(
    flat: FlatGrad,
    bucket_cap_mb: float,
    reduce_dtype: torch.dtype | None,
    check_finite: bool,
    broadcast_buffers: bool,
    process_group: dist.ProcessGroup | None,
) -> None:
    """Raise on every rank, naming each setting and every rank's value, unless all ranks agree on what shapes
    the collectives: ``bucket_cap_mb`` (the buckets), ``reduce_dtype`` (what each all-reduce sends),
    ``check_finite`` (an all-reduce per backward more), ``broadcast_buffers`` (a broadcast per forward), and
    the gradient buffers' layout (``align_bytes``, ``grad_dtype``: the elements every collective covers). A
    differing rank would otherwise die in the backend with no Python error, or hang. One small all-gather."""
    buffers = settled_buffers(flat)
    config = flat.flatgrad_config
    mine = [
        ("bucket_cap_mb", bucket_cap_mb),
        ("reduce_dtype", reduce_dtype),  # (checked already: one of `_CHOICES`)
        ("check_finite", check_finite),
        ("broadcast_buffers", broadcast_buffers),
        ("align_bytes", config.align_bytes),
        ("grad_dtype", config.grad_dtype),
        ("buffer elements", sum(b.numel() for b in buffers.values())),
    ]
    encoded = [_CHOICES[name].index(v) if name in _CHOICES else v for name, v in mine]
    values = torch.tensor(encoded, dtype=torch.float64, device=next(iter(buffers.values())).device)
    gathered = [torch.empty_like(values) for _ in range(dist.get_world_size(process_group))]
    dist.all_gather(gathered, values, group=process_group)
    rows = [g.tolist() for g in gathered]
    differ = []
    for index, (name, _) in enumerate(mine):
        seen = [row[index] for row in rows]
        if len(set(seen)) > 1:
            shown = [str(_CHOICES[name][int(v)]) if name in _CHOICES else f"{v:g}" for v in seen]
            differ.append(f"{name}: " + ", ".join(f"rank {r} {v}" for r, v in enumerate(shown)))
    if differ:
        raise ValueError(
            "replicate's settings differ across ranks (" + "; ".join(differ) + "): every "
            "rank must apply FlatGrad and replicate with the same settings"
        )


def _broadcast(tensors: Iterable[torch.Tensor], process_group: dist.ProcessGroup | None, rank: int) -> None:
    """Every rank takes rank `rank`'s (of the group) `tensors`, one broadcast each (DDP's
    constructor: rank 0's parameters and buffers)."""
    source = dist.get_global_rank(process_group, rank) if process_group is not None else rank
    with torch.no_grad():
        for tensor in tensors:
            dist.broadcast(local_of(tensor), src=source, group=process_group)  # (a DTensor's shard)


def _mesh_group(
    device_mesh: DeviceMesh | None, process_group: dist.ProcessGroup | None
) -> dist.ProcessGroup | None:
    """The group replicate averages over: `device_mesh`'s (1-D) where one is given."""
    if device_mesh is None:
        return process_group
    if process_group is not None:
        raise ValueError("pass process_group or device_mesh, not both")
    if device_mesh.ndim != 1:
        raise ValueError(
            f"device_mesh must be 1-D (the data-parallel dimension, e.g. mesh['dp']), got a mesh of "
            f"shape {tuple(device_mesh.shape)}"
        )
    return device_mesh.get_group()
