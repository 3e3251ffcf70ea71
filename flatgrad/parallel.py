"""`DataParallel`: overlapped, bucketed gradient averaging on FlatGrad's one flat buffer.

Buckets are `narrow` views of the flat buffer, cut at slot boundaries in the buffer's order
(the reverse of registration, roughly the order backward produces gradients), about
`bucket_mb` each and a small first one (not on a CPU host whose cores the ranks' threads
already fill: there gloo's thread overlaps nothing, see `flatgrad._bucket_sync.plan_buckets`).
A post hook on the AccumulateGrad node of every parameter (it fires also for the routed
layers, whose Functions hand AccumulateGrad None) counts the parameter ready; when every
parameter of a bucket is ready and every bucket
before it in the launch order has been launched, the bucket's collective starts
asynchronously, while backward goes on. The launch order is the buffer's until the first
synchronised backward ends; from then on it is the order in which rank 0's buckets became
complete in that backward (broadcast; buckets that never did go last), learned again after
each layout change, as DDP rebuilds its buckets in gradient-ready order; from then on the
hooks of the last bucket in that order count nothing (the final callback launches it, its
gradients the backward's last anyway; they only open a backward, see below). Buckets
therefore launch in the same order on every rank, and a model that runs its modules in
another order than it registers them still overlaps. Once a synchronised backward has left parameters
unused (no gradient final before its end), each later one asks the autograd engine, when it
starts, which of those it will not reach, and counts them ready then (DDP with
``find_unused_parameters=True`` marks unused parameters ready as backward starts), so their
buckets do not wait for the end. An autograd final callback launches what is left
(parameters unused and not counted so; slots are zeroed where `.grad` is None), waits for
everything, and settles `.grad` as stock DDP with ``find_unused_parameters=True`` does, so
`loss.backward()` returns with averaged gradients. The used flags ride in the all-reduce of
a buffer's last bucket when that bucket also launches last of its buffer's; otherwise they
go in one small all-reduce of their own.

Which backwards average, as under DDP, whose hooks sit on the parameters: a backward through
the output of a forward averages when that forward synchronised (grad enabled, outside
`no_sync()`); FlatGrad's one pre hook on the nodes that made the output (the backward
coordinator, `flatgrad._backward`, which this forward's sync flag is bound into) opens it
before any gradient is final, after the seater, and runs that callback after the seater's.
Any other backward that accumulates into a parameter averages
when a synchronising forward came since the last averaged backward, whichever graph it goes
through: a loss kept on the module during forward (an auxiliary loss), an output dp cannot
look into (a plain object, a dict subclass); the first AccumulateGrad hook it reaches opens
it (and counts no parameter ready before its AccumulateGrad runs). A backward after a
forward that did not synchronise (``dp.module(x)`` called directly, a forward under
no_sync()) that goes through no synchronising output stays local.
A backward that opens while a training forward of dp runs (inside it: a LightningModule's
``manual_backward`` in the training_step that dp's forward runs) averages unless no_sync()
holds as it opens, whatever earlier forwards armed, as Lightning's DDPStrategy prepares
DDP's reducer in ``pre_backward`` (`BucketSync.begin_forward`).
A nested backward (reentrant activation checkpointing) counts toward the backward it runs
in; a parameter only it reaches is not counted ready early unless it was unused in an
earlier step (then a gradient that comes after its bucket launched raises).
`torch.autograd.grad` (which accumulates nothing) is left alone; a create_graph backward
that should average is refused.

On CUDA with NCCL the collectives run on the process group's own communication stream,
which waits (through an event) for the stream current at the launch: an AccumulateGrad
hook's (the stream its node was made on, which DataParallel keeps from its construction)
or the final callback's. That stream first waits for the one the backward opened on (the
forward's, where the routed layers write their slots) when they differ: a model trained on
another stream than it was wrapped on. `Work.wait()` in the final callback makes the
current stream wait for the communication in turn. Nothing writes a bucket (the next micro-batch, `zero_grad`,
the optimizer) before its collective is done, because backward does not return before.
"""

from __future__ import annotations

import contextlib
import logging
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.distributed.device_mesh import DeviceMesh

from flatgrad._bucket_sync import BucketSync
from flatgrad._dtensor import local_of
from flatgrad._module_proxy import PlainNames, add_prefix
from flatgrad._torch_compat import broadcast_coalesced, join_state, preserve_version_counter
from flatgrad.comm import check_wire_dtype
from flatgrad.wrapper import FlatGrad, engine_of

logger = logging.getLogger(__name__)

_BROADCAST_BUCKET_BYTES = 250 * 2**20  # DDP's broadcast_bucket_size


class DataParallel(PlainNames, Joinable):
    """Averages the gradients of `flat` over `process_group` during backward, bucket by
    bucket, overlapping communication with the rest of the backward.

    ``dp(*args)`` is ``flat(*args)``; after ``loss.backward()`` returns every `.grad` is
    averaged over the ranks (as under DDP), also when the loss does not come out of dp's
    output (an auxiliary loss kept on the module). ``with dp.no_sync():`` accumulates locally.
    Rank 0's parameters and buffers are broadcast at construction, and with
    `broadcast_buffers` (DDP's flag and default) its buffers (BatchNorm statistics) again
    before each forward that follows a synchronised training forward, as DDP does.

    A `torch.distributed.algorithms.Joinable`, as DDP: for uneven data per rank, train inside
    ``with Join([dp, opt]):`` (dp first; `opt` a plain torch optimizer, which Join leaves
    alone, or a `ShardedOptimizer`). A rank that ran out of data shadows each iteration of
    the others: the buffer broadcast, and each synchronised backward's averaging with zeros
    for its gradients (`join_hook`); gradients are divided by the world size, as DDP's by
    default, or by the ranks not joined yet with ``Join(..., divide_by_initial_world_size=False)``.
    When every rank has joined, the last to join broadcasts its parameters and buffers.

    Args:
        flat: The `FlatGrad`-wrapped model; every rank must wrap the same model.
        process_group: The group to average over; None for the default group. For a
            tensor-parallel model (DTensor parameters), the data-parallel dimension's group,
            which holds one rank of each tensor-parallel group (``mesh["dp"].get_group()``).
        bucket_mb: The approximate size of a bucket in MiB (the first one is smaller, 1 MiB
            as DDP's, but for CPU buffers on a host without a core to spare).
        wire_dtype: ``torch.bfloat16`` or ``torch.float16`` to average a compressed copy of
            each floating-point bucket (decompressed into it); None sends the buckets as they are.
        broadcast_buffers: Whether rank 0's buffers are broadcast again before a forward that
            follows a synchronised training forward, as DDP's flag of that name.
        check_finite: Whether a non-finite local gradient on any rank makes
            ``loss.backward()`` raise `RuntimeError` on every rank, the rank that made it
            naming itself and the parameters (one flag all-reduce and one host sync per
            synchronised backward); off, a NaN is averaged into every rank, as under DDP.
        device_mesh: A 1-D `DeviceMesh` to average over instead of `process_group` (DDP's
            argument of that name; ``mesh["dp"]`` of a 2-D mesh).

    Raises:
        TypeError: `flat` is not a `FlatGrad`, or `check_finite` is not a bool.
        RuntimeError: No process group is initialised (``dist.init_process_group``).
        ValueError: `bucket_mb` is not positive; `wire_dtype` is not one of the above; the
            model has sparse embeddings (``sparse=True``), whose gradients live outside the
            flat buffers; or
            the ranks' models differ in their parameters' and buffers'
            shapes, dtypes, trainability or order (raised on every rank); `device_mesh` is
            not 1-D or comes with a `process_group`; or the group crosses the mesh of the
            model's DTensor parameters.
    """

    def __init__(
        self,
        flat: FlatGrad,
        process_group: dist.ProcessGroup | None = None,
        bucket_mb: float = 25.0,
        wire_dtype: torch.dtype | None = None,
        broadcast_buffers: bool = True,
        check_finite: bool = False,
        device_mesh: DeviceMesh | None = None,
    ) -> None:
        if not isinstance(flat, FlatGrad):
            raise TypeError(f"flat must be a flatgrad.FlatGrad, got {type(flat).__name__}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DataParallel needs an initialised process group (dist.init_process_group)")
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        check_wire_dtype(wire_dtype)
        if not isinstance(check_finite, bool):
            raise TypeError(f"check_finite must be a bool, got {type(check_finite).__name__}")
        engine_of(flat).refuse_sparse("DataParallel")
        process_group = _mesh_group(device_mesh, process_group)
        tensor_parallel = engine_of(flat).refresh().tensor_parallel
        if tensor_parallel is not None:
            tensor_parallel.check_data_parallel(process_group, "DataParallel")
        super().__init__()
        Joinable.__init__(self)  # (not joined: Join configures it)
        self.module = flat
        self._share_root()
        self.process_group = process_group
        self.bucket_mb = float(bucket_mb)
        self.wire_dtype = wire_dtype
        self.world_size = dist.get_world_size(process_group)
        self.broadcast_buffers = bool(broadcast_buffers)
        # DDP's require_forward_param_sync: whether the last forward trained and synchronised
        # (True before the first), which is when the next forward broadcasts the buffers.
        self._sync_buffers_next = True
        self._divide_by_initial_world_size = True  # (the running Join's, as DDP's)
        _check_same_model(flat, process_group)
        _check_same_settings(
            flat, self.bucket_mb, wire_dtype, check_finite, self.broadcast_buffers, process_group
        )
        _broadcast_from_rank0(flat, process_group)
        self._engine = BucketSync(engine_of(flat), process_group, self.bucket_mb, wire_dtype, check_finite)

    # --- public -------------------------------------------------------------------------

    # Eager even under torch.compile(dp), as FlatGrad.forward (the frame only): its
    # bookkeeping (the hooks on the output's nodes that open each backward) must see the
    # real output, not a traced one, and is disabled as a whole so that Dynamo sees none of
    # it; the wrapped model is still compiled (FlatGrad's forward hands it to Dynamo).
    @torch.compiler.disable(recursive=False)
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``flat(*args, **kwargs)``; a backward through the output averages when this
        forward synchronises (grad enabled, outside `no_sync()`).

        Args:
            *args: Positional arguments, passed to the wrapped model unchanged.
            **kwargs: Keyword arguments, passed to the wrapped model unchanged.

        Returns:
            The wrapped model's output, unchanged.

        Raises:
            ValueError: A sparse embedding (``sparse=True``) was added to the model since
                construction.
        """
        training = self._before_forward()
        learning = self._engine.forward_context  # (ShardedOptimizer's `ForwardWaits.learning`)
        finished = False
        try:
            if learning is None:
                output = self.module(*args, **kwargs)
            else:
                with learning():
                    output = self.module(*args, **kwargs)
            finished = True
        finally:  # (a forward that raised ends too: a later backward is outside it)
            self._after_forward(training, finished)
        return output

    @torch.compiler.disable
    def _before_forward(self) -> bool:
        """Before the wrapped model's forward; whether it trains (grad enabled)."""
        engine = self._engine
        if engine.in_backward:
            engine.drain()  # a backward that raised never finished
        if engine_of(self.module).steady() is not engine.store:
            engine.rebuild()
        joined, first = join_state(self)
        if joined:
            self._notify_join(first)
        elif self._sync_buffers_next and self.broadcast_buffers and engine.has_buffers:
            self._broadcast_buffers()
        # The backward through the output of the forward about to run is this one's too
        # (bound into that forward's plan: see flatgrad._backward).
        engine_of(self.module).expect_sync(engine, self._sync)
        training = torch.is_grad_enabled()
        if training:  # a backward inside it (Lightning's manual_backward) averages unless no_sync
            engine.begin_forward()
        return training

    @torch.compiler.disable
    def _after_forward(self, training: bool, finished: bool) -> None:
        if finished:
            self._sync_buffers_next = training and self._sync
        if training:
            self._engine.end_forward(finished)

    def _broadcast_buffers(self, source: int = 0) -> None:
        """The buffers of rank `source` (of the group) to every rank, as DDP's forward does:
        the buffers found now (a buffer may have been re-assigned), coalesced into few
        broadcasts (`dist._broadcast_coalesced`, DDP's own, 250 MiB pieces), without bumping
        their version counters (a buffer saved for a backward stays usable, as under DDP)."""
        buffers = list(self.module.buffers())
        if not buffers:
            return
        with torch.no_grad(), preserve_version_counter(tuple(buffers)):
            broadcast_coalesced(self.process_group, buffers, _BROADCAST_BUCKET_BYTES, source)  # (group rank)

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.process_group, rank) if self.process_group is not None else rank

    # --- Join -----------------------------------------------------------------------------

    def _notify_join(self, first: bool) -> None:
        """Before a forward inside a `Join`, what DDP's forward does there, in its order: tell
        the joined ranks that this one has not joined (`Join.notify_join_context`); broadcast
        the buffers from the highest rank not joined (rank 0 may have joined with stale
        ones); and all-reduce (sync, 1), which the joined ranks match with zeros
        (`_DataParallelJoinHook`): whether this forward's backward averages, and the ranks
        not joined, which it divides by under ``divide_by_initial_world_size=False``. One
        small all-reduce per forward more than outside a Join, as DDP's."""
        if not first:
            raise ValueError(
                "DataParallel must be the first joinable of its Join, as DDP is: "
                "Join([dp, opt]) (its forward's all-reduce tells the joined ranks that this "
                f"rank has not joined), got it at another place on rank {dist.get_rank(self.process_group)}"
            )
        Join.notify_join_context(self)
        if self._sync_buffers_next and self.broadcast_buffers and self._engine.has_buffers:
            self._broadcast_buffers(self._common_rank(True))
        sync = torch.is_grad_enabled() and self._sync
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

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook through which a rank that ran out of data shadows the others' iterations
        inside ``with Join([dp, ...]):`` (`torch.distributed.algorithms.Join` calls it).

        Args:
            **kwargs: The Join's keyword arguments: ``divide_by_initial_world_size`` (default
                True, as DDP's) divides each average by the world size; False by the ranks
                not joined yet. Others are for other joinables.

        Returns:
            The join hook.
        """
        return _DataParallelJoinHook(self, bool(kwargs.get("divide_by_initial_world_size", True)))

    @property
    def join_device(self) -> torch.device:
        """Where the Join's own all-reduces run: the device of the model's gradients.

        Returns:
            The first flat buffer's device (CPU for a model without one).
        """
        buffers = self.module.grad_buffers
        return next(iter(buffers.values())).device if buffers else torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        """The group the Join's all-reduces run over: this DataParallel's.

        Returns:
            `process_group` (None: the default group).
        """
        return self.process_group

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forwards inside (and the backwards through their outputs) accumulate into the
        flat buffer without communicating, as under DDP; the first backward of a forward
        outside averages everything accumulated.

        Returns:
            A context manager (``with dp.no_sync():``), which binds nothing.
        """
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    @property
    def _sync(self) -> bool:
        # The flag lives in the engine: a backward that opens inside a forward reads it then.
        return self._engine.sync

    @_sync.setter
    def _sync(self, value: bool) -> None:
        self._engine.sync = value

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's flag, which `no_sync()` toggles: whether the next forward's backward
        averages. nanoGPT's train.py sets it directly instead of entering `no_sync()`
        (``model.require_backward_grad_sync = micro_step == last``); that works here too.

        Returns:
            True unless inside `no_sync()` or set to False.
        """
        return self._sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._sync = bool(value)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's state dict, under the plain model's keys (no ``module.`` prefix).

        Args:
            *args: Passed to `nn.Module.state_dict` unchanged.
            **kwargs: Passed to `nn.Module.state_dict` unchanged (``destination``, ``prefix``,
                ``keep_vars``).

        Returns:
            The plain model's state dict.
        """
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """`FlatGrad.load_state_dict` (the plain model's keys, no ``module.`` prefix).

        Args:
            state_dict: The plain model's state dict (or one with ``module.`` prefixes).
            strict: As `nn.Module.load_state_dict`'s: every key must match.
            assign: As `nn.Module.load_state_dict`'s: assign the tensors instead of copying.

        Returns:
            The missing and unexpected keys, as `nn.Module.load_state_dict` returns them.
        """
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # Nested in a module, whose `state_dict` gets the plain model's keys under `prefix`
        # (`state_dict` above): the FlatGrad below takes them under ``prefix + "module."``.
        add_prefix(self, state_dict, prefix, args[0])
        super()._load_from_state_dict(state_dict, prefix, *args)

    @property
    def buckets(self) -> list[torch.Tensor]:
        """The bucket views of the flat buffers, in launch order.

        Returns:
            A new list of 1-D `narrow` views of the flat gradient buffers.
        """
        return self._engine.buckets

    @property
    def launch_offsets_s(self) -> list[float]:
        """Of the last synchronised backward: when each bucket was launched.

        Returns:
            Seconds from the backward's start, one per bucket in launch order (empty before
            the first synchronised backward).
        """
        return self._engine.last_round.launch_offsets_s

    @property
    def exposed_s(self) -> float:
        """Of the last synchronised backward: how long the final callback spent in the waits
        for communication after the backward's compute had ended.

        Host time, as are `launch_offsets_s` and `backward_s`: on CUDA with NCCL the waits
        order the current stream after the collectives without blocking the host, so this is
        about 0 there, and the GPU's own timeline needs CUDA events or the profiler.

        Returns:
            Seconds (0.0 before the first synchronised backward).
        """
        return self._engine.last_round.exposed_s

    @property
    def backward_s(self) -> float:
        """Of the last synchronised backward: its start to the end of its compute.

        Returns:
            Seconds (0.0 before the first synchronised backward).
        """
        return self._engine.last_round.backward_s


class _DataParallelJoinHook(JoinHook):
    """What a rank that ran out of data does in place of each iteration of the ranks still
    training, as DDP's join hook (`_DDPJoinHook`) does for DDP."""

    def __init__(self, dp: DataParallel, divide_by_initial_world_size: bool) -> None:
        self.dp = dp
        dp._divide_by_initial_world_size = divide_by_initial_world_size
        super().__init__()

    def main_hook(self) -> None:
        """Match one forward of the others (`DataParallel._notify_join`) and, when it
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
        """Every rank takes the parameters and buffers of the last rank to join (the highest
        of them), as DDP's: a joined rank kept its own since it joined. With a
        ShardedOptimizer the parameters are every rank's already (a joined rank steps its
        shards and gathers along: its join hook), and only the buffers move."""
        dp = self.dp
        source = dp._common_rank(is_last_joiner)
        if not dp._engine.reduce_scatter:
            with torch.no_grad():
                for param in dp.module.parameters():
                    dist.broadcast(local_of(param), src=dp._global(source), group=dp.process_group)
        if dp.broadcast_buffers:
            dp._broadcast_buffers(source)


def _check_same_model(module: nn.Module, process_group: dist.ProcessGroup | None) -> None:
    """Raise on every rank unless all ranks hold parameters and buffers of the same shapes,
    dtypes and trainability, in the same order (DDP's constructor checks this too): the
    broadcast and the buckets would otherwise hang or mix unrelated slots. One all-reduce
    (MAX) of a digest and its negation: equal on all ranks exactly when min equals max."""
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
            f"{len(described)} parameters and buffers): every rank must wrap the same model, "
            "with the same parameter and buffer shapes, dtypes and requires_grad, in the same order"
        )


_WIRE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)


def _check_same_settings(
    flat: FlatGrad,
    bucket_mb: float,
    wire_dtype: torch.dtype | None,
    check_finite: bool,
    broadcast_buffers: bool,
    process_group: dist.ProcessGroup | None,
) -> None:
    """Raise on every rank, naming each setting and every rank's value, unless all ranks
    agree on what shapes the collectives: ``bucket_mb`` (the buckets), ``wire_dtype`` (what
    each all-reduce sends), ``check_finite`` (an all-reduce per backward more),
    ``broadcast_buffers`` (a broadcast per forward), and the layout of the gradient buffers
    (``align_bytes``, ``grad_dtype``: the elements every collective covers). A rank that differs would
    otherwise be killed inside the backend with no Python error, or hang. One small
    all-gather."""
    buffers = flat.grad_buffers
    wire = _WIRE_DTYPES.index(wire_dtype) if wire_dtype in _WIRE_DTYPES else len(_WIRE_DTYPES)
    config = flat.flatgrad_config
    mine = [
        ("bucket_mb", bucket_mb),
        ("wire_dtype", wire),
        ("check_finite", int(check_finite)),
        ("broadcast_buffers", int(broadcast_buffers)),
        ("align_bytes", config.align_bytes),
        ("grad_dtype", 0 if config.grad_dtype is None else 1),
        ("buffer elements", sum(b.numel() for b in buffers.values())),
    ]
    device = next(iter(buffers.values())).device
    values = torch.tensor([float(v) for _, v in mine], dtype=torch.float64, device=device)
    gathered = [torch.empty_like(values) for _ in range(dist.get_world_size(process_group))]
    dist.all_gather(gathered, values, group=process_group)
    rows = [g.tolist() for g in gathered]
    named = {
        "wire_dtype": [str(d) for d in _WIRE_DTYPES],
        "grad_dtype": ["None", "float32"],
        "check_finite": ["False", "True"],
        "broadcast_buffers": ["False", "True"],
    }
    differ = []
    for index, (name, _) in enumerate(mine):
        seen = [row[index] for row in rows]
        if len(set(seen)) > 1:
            shown = [
                named[name][int(v)] if name in named and int(v) < len(named[name]) else f"{v:g}" for v in seen
            ]
            differ.append(f"{name}: " + ", ".join(f"rank {r} {v}" for r, v in enumerate(shown)))
    if differ:
        raise ValueError(
            "DataParallel's settings differ across ranks (" + "; ".join(differ) + "): every "
            "rank must build FlatGrad and DataParallel with the same settings"
        )


def _broadcast_from_rank0(module: nn.Module, process_group: dist.ProcessGroup | None) -> None:
    """What DDP's constructor does: every rank starts from rank 0's parameters and buffers."""
    source = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(local_of(tensor), src=source, group=process_group)  # (a DTensor's shard)


def _mesh_group(
    device_mesh: DeviceMesh | None, process_group: dist.ProcessGroup | None
) -> dist.ProcessGroup | None:
    """The group DataParallel averages over: `device_mesh`'s (1-D) where one is given."""
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
