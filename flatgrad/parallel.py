"""`DataParallel`: overlapped, bucketed gradient averaging on FlatGrad's one flat buffer.

Buckets are `narrow` views of the flat buffer, cut at slot boundaries in the buffer's order
(the reverse of registration, roughly the order backward produces gradients), about
`bucket_mb` each and a small first one. A post hook on the AccumulateGrad node of every
parameter but those of the last bucket (it fires also for the routed layers, whose Functions
hand AccumulateGrad None) counts the parameter ready; when every parameter of a bucket is
ready and every earlier bucket has been launched, the bucket's collective starts
asynchronously, while backward goes on. Buckets therefore launch in the same order on every
rank. An autograd final callback launches what is left (the last bucket, whose gradients are
the backward's last anyway, so its parameters' hooks do not count; parameters unused in this
step, whose slots are zeroed when `.grad` is None), waits for everything, and settles `.grad`
as stock DDP with ``find_unused_parameters=True`` does, so `loss.backward()` returns with
averaged gradients.

Which backwards average, as under DDP, whose hooks sit on the parameters: a backward through
the output of a forward averages when that forward synchronised (grad enabled, outside
`no_sync()`); a pre hook on the nodes that made the output opens it (queues that callback)
before any gradient is final. Any other backward that accumulates into a parameter averages
when a synchronising forward came since the last averaged backward, whichever graph it goes
through: a loss kept on the module during forward (an auxiliary loss), an output dp cannot
look into (a plain object, a dict subclass); the first AccumulateGrad hook it reaches opens
it. So every parameter has a hook, those of the last bucket included (a Python call per
parameter per backward, about 0.1-0.2 us on a CPU, that returns at once when a backward is
open). A backward after a forward that did not synchronise (``dp.module(x)`` called
directly, a forward under no_sync()) that goes through no synchronising output stays local.
A nested backward (reentrant activation checkpointing) counts toward the backward it runs
in. `torch.autograd.grad` (which accumulates nothing) is left alone; a create_graph backward
that should average is refused.

On CUDA with NCCL the collectives run on the process group's own communication stream,
which waits (through an event) for the stream that produced the gradients when the
collective is launched; `Work.wait()` in the final callback makes the current stream wait
for the communication in turn. Nothing writes a bucket (the next micro-batch, `zero_grad`,
the optimizer) before its collective is done, because backward does not return before.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flatgrad._names import PlainNames
from flatgrad._scattered import mark_scattered, unmark_scattered
from flatgrad.buffer import GradStore, host_tensor
from flatgrad.comm import _check_wire_dtype, average_op, reduce_scatter_flat, settle_unused, to_wire
from flatgrad.layout import GroupKey
from flatgrad.wrapper import FlatGrad, _add_prefix, output_nodes

logger = logging.getLogger(__name__)

_FIRST_BUCKET_MB = 1.0  # a small first bucket starts communication early, as in DDP
_BROADCAST_BUCKET_BYTES = 250 * 2**20  # DDP's broadcast_bucket_size


@dataclass
class _Bucket:
    """One contiguous piece of a flat buffer and the parameters whose slots it holds."""

    index: int
    buffer: torch.Tensor  # a narrow view of the flat buffer
    params: tuple[nn.Parameter, ...]
    pending: int = 0
    work: Any = None
    wire: torch.Tensor | None = None
    # The last bucket of a group also carries the group's used flags (`GradStore.flagged`:
    # they follow the buffer in memory), so the all-reduce that averages it tells which
    # parameters some rank used; `sent` is what its collective ran on.
    flags_of: GroupKey | None = None
    sent: torch.Tensor | None = None


class DataParallel(PlainNames):
    """Averages the gradients of `flat` over `process_group` during backward, bucket by
    bucket, overlapping communication with the rest of the backward.

    ``dp(*args)`` is ``flat(*args)``; after ``loss.backward()`` returns every `.grad` is
    averaged over the ranks (as under DDP), also when the loss does not come out of dp's
    output (an auxiliary loss kept on the module). ``with dp.no_sync():`` accumulates locally.
    Rank 0's parameters and buffers are broadcast at construction, and with
    `broadcast_buffers` (DDP's flag and default) its buffers (BatchNorm statistics) again
    before each forward that follows a synchronised training forward, as DDP does.
    """

    def __init__(
        self,
        flat: FlatGrad,
        process_group: dist.ProcessGroup | None = None,
        bucket_mb: float = 25.0,
        wire_dtype: torch.dtype | None = None,
        broadcast_buffers: bool = True,
    ) -> None:
        if not isinstance(flat, FlatGrad):
            raise TypeError(f"flat must be a flatgrad.FlatGrad, got {type(flat).__name__}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DataParallel needs an initialised process group (dist.init_process_group)")
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        _check_wire_dtype(wire_dtype)
        flat._refuse_sparse("DataParallel")
        super().__init__()
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
        self._has_buffers = False  # whether the model had buffers at the last (re)build
        self._reduce_scatter = False  # ShardedOptimizer switches the buckets to reduce-scatter
        self._scattered = False  # the last synchronised backward reduce-scattered (see _begin)
        self._sync = True
        self._store: GradStore | None = None
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        self._ready: set[int] = set()
        # (flags, their parameters) of the running backward's sync: carried by the last
        # bucket of each group, or by one small all-reduce of their own (see `_sync_all`).
        self._flagged: list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = []
        self._next = 0  # the next bucket to launch
        self._task = -1  # the graph task of the running backward, -1 outside one
        self._task_sync = True  # whether the running backward averages
        # DDP's expect_autograd_hooks_: a synchronising training forward came since the last
        # averaged backward, so the next backward averages whichever graph it goes through.
        self._armed = False
        self._deferrals: list[Any] = []  # hooks that carry a nested backward's end outward
        self._hooks: list[Any] = []
        self._nodes: list[Any] = []
        # Of the last synced backward (perf_counter seconds): when each bucket was launched,
        # relative to the backward's start, and how long the final callback waited for
        # communication after the backward's compute had ended (exposed communication).
        self.launch_offsets_s: list[float] = []
        self.exposed_s = 0.0
        self.backward_s = 0.0  # the backward's start to the end of its compute
        self._started = 0.0
        _check_same_model(flat, process_group)
        _broadcast_from_rank0(flat, process_group)
        self._rebuild()

    # --- public -------------------------------------------------------------------------

    # Eager even under torch.compile(dp), as FlatGrad.forward (the frame only): its
    # bookkeeping (the hooks on the output's nodes that open each backward) must see the
    # real output, not a traced one, and is disabled as a whole so that Dynamo sees none of
    # it; the wrapped model is still compiled (FlatGrad's forward hands it to Dynamo).
    @torch.compiler.disable(recursive=False)
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._before_forward()
        output = self.module(*args, **kwargs)
        self._after_forward(output)
        return output

    @torch.compiler.disable
    def _before_forward(self) -> None:
        if self._task != -1:
            self._drain()  # a backward that raised never finished
        if self.module._steady_store() is not self._store:
            self._rebuild()
        if self._sync_buffers_next and self.broadcast_buffers and self._has_buffers:
            self._broadcast_buffers()

    @torch.compiler.disable
    def _after_forward(self, output: Any) -> None:
        training = torch.is_grad_enabled()
        self._sync_buffers_next = training and self._sync
        if training:
            self._armed = self._armed or self._sync
            self._watch(output, self._sync)

    def _drain(self) -> None:
        """Wait for the collectives a backward that raised had launched, before this step
        writes any gradient: in flight, they would land on top of it. (That step's
        launched buckets hold averages of partial gradients, as DDP's bucket views would;
        `zero_grad()` before the next backward, as after any failed step.)"""
        self._task = -1
        self._forget_deferrals()
        for bucket in self._buckets:
            if bucket.work is not None:
                bucket.work.wait()
        self._reset()

    def _broadcast_buffers(self) -> None:
        """Rank 0's buffers to every rank, as DDP's forward does: the buffers found now (a
        buffer may have been re-assigned), coalesced into few broadcasts
        (`dist._broadcast_coalesced`, DDP's own, 250 MiB pieces), without bumping their
        version counters (a buffer saved for a backward stays usable, as under DDP)."""
        buffers = list(self.module.buffers())
        if not buffers:
            return
        group = self.process_group or dist.distributed_c10d._get_default_group()
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
            dist._broadcast_coalesced(group, buffers, _BROADCAST_BUCKET_BYTES, 0)  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forwards inside (and the backwards through their outputs) accumulate into the
        flat buffer without communicating, as under DDP; the first backward of a forward
        outside averages everything accumulated."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's flag, which `no_sync()` toggles: whether the next forward's backward
        averages. nanoGPT's train.py sets it directly instead of entering `no_sync()`
        (``model.require_backward_grad_sync = micro_step == last``); that works here too."""
        return self._sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._sync = bool(value)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The plain model's keys (no ``module.`` prefix)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # Nested in a module, whose `state_dict` gets the plain model's keys under `prefix`
        # (`state_dict` above): the FlatGrad below takes them under ``prefix + "module."``.
        _add_prefix(self, state_dict, prefix, args[0])
        super()._load_from_state_dict(state_dict, prefix, *args)

    @property
    def buckets(self) -> list[torch.Tensor]:
        """The bucket views of the flat buffers, in launch order."""
        return [bucket.buffer for bucket in self._buckets]

    # --- buckets ------------------------------------------------------------------------

    def _rebuild(self) -> None:
        """Cut the buckets of the current store and hook every parameter's AccumulateGrad
        node: those of every bucket but the last count it ready, those of the last (which the
        final callback launches) only open a backward that reached none of dp's outputs."""
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._nodes = [], []
        store = self.module._checked_store()
        self.module._refuse_sparse("DataParallel")  # (a sparse embedding added since)
        self._store = store
        self._has_buffers = any(True for _ in self.module.buffers())
        self._buckets = _cut_buckets(store, self.bucket_mb)
        self._bucket_of = {id(p): b for b in self._buckets for p in b.params}
        hooked = {id(p) for bucket in self._buckets[:-1] for p in bucket.params}
        with torch.enable_grad():
            for param in store.params:
                node: Any = param.view_as(param).grad_fn.next_functions[0][0]  # type: ignore[union-attr]
                if id(param) in hooked:
                    self._hooks.append(node.register_hook(functools.partial(self._on_ready, param)))
                else:
                    self._hooks.append(node.register_hook(self._on_last_ready))
                self._nodes.append(node)  # a parameter holds its AccumulateGrad node only weakly
        self._reset()

    def _reset(self) -> None:
        self._ready = set()
        self._flagged = []
        self._next = 0
        self.launch_offsets_s = []
        for bucket in self._buckets:
            bucket.pending = len(bucket.params)
            bucket.work = bucket.wire = bucket.sent = None

    # --- backward -----------------------------------------------------------------------

    def _watch(self, output: Any, sync: bool) -> None:
        """Open the backward's bookkeeping when it reaches `output` (a pre hook on the nodes
        that made it), before any gradient of the model is final. Registered after
        FlatGrad's own pre hook, so this final callback runs after FlatGrad's."""
        for node in output_nodes(output):
            node.register_prehook(functools.partial(self._on_backward_start, sync))

    def _on_backward_start(self, sync: bool, grad_outputs: Any) -> None:
        _refuse_compiled_autograd()
        if self.module._store is not self._store:
            self._rebuild()  # FlatGrad's pre hook, just before, laid out again (a stale slot)
        if torch._C._current_graph_task_id() != self._task:
            if self._will_accumulate():
                self._begin(sync)
        elif sync and not self._task_sync:
            self._upgrade()

    def _upgrade(self) -> None:
        """One backward through the outputs of a forward under `no_sync()` and of one outside
        it, the first reached first: it averages, as under DDP (the synchronised forward
        prepared DDP's reducer for this backward). Gradients final before now count at the
        final callback, which launches every bucket not launched yet."""
        self._task_sync = True  # (a create_graph backward never opened a task: `_begin`)
        self._armed = False
        self._reset()
        self._started = time.perf_counter()

    def _will_accumulate(self) -> bool:
        """Whether the running backward accumulates into a parameter: not so for
        torch.autograd.grad, nor for backward(inputs=...) that names none of them."""
        try:
            return any(torch._C._will_engine_execute_node(node) for node in self._nodes)
        except RuntimeError:  # asked during torch.autograd.grad, which never accumulates
            return False

    def _begin(self, sync: bool) -> bool:
        """Open the running backward, averaging when `sync` (the no_sync state of the forward
        whose output it reached, or the arming: see `_open`), as DDP decides; False when it
        is a create_graph backward under no_sync (nothing to do)."""
        if sync:
            self._armed = False  # this backward is the one the synchronising forward armed
        if torch.is_grad_enabled():  # create_graph=True: the gradients must stay differentiable
            if sync:
                raise RuntimeError(
                    "DataParallel cannot average the gradients of a backward with "
                    "create_graph=True (they must stay differentiable); run that forward and "
                    "backward under dp.no_sync()"
                )
            return False
        if self._scattered:
            self._check_unscattered()
        self._task = torch._C._current_graph_task_id()
        self._task_sync = sync
        if sync:
            self._reset()
            self._started = time.perf_counter()
        Variable_engine().queue_callback(self._finish)
        return True

    def _open(self) -> bool:
        """From an AccumulateGrad hook, when no backward is open (this one reached none of
        dp's outputs): open it, averaging, when a synchronising forward armed it, as DDP's
        hooks on the parameters do. Its first final gradient is this hook's: FlatGrad seated
        no slot for it (no output pre hook ran), so the small parameters' gradients land in
        tensors of their own, which each bucket takes into its slots before it launches."""
        if not self._armed:
            return False
        _refuse_compiled_autograd()
        return self._begin(True)

    def _on_last_ready(self, grad_inputs: Any, grad_outputs: Any) -> None:
        # A parameter of the last bucket: the final callback launches that bucket, so there
        # is nothing to count; only a backward that reached none of dp's outputs to open.
        if self._task == -1:
            self._open()

    def _on_ready(self, param: nn.Parameter, grad_inputs: Any, grad_outputs: Any) -> None:
        # A nested backward (reentrant activation checkpointing) belongs to the open one:
        # same bookkeeping.
        if self._task == -1 and not self._open():
            return
        if not self._task_sync:
            return
        if id(param) in self._ready:
            raise RuntimeError(
                "a parameter's gradient became final twice in one backward (a reentrant "
                "activation checkpoint using it both inside and outside the checkpointed "
                "function); use torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
            )
        self._ready.add(id(param))
        bucket = self._bucket_of[id(param)]
        bucket.pending -= 1
        if not bucket.pending:
            self._launch_ready()

    def _launch_ready(self, flush: bool = False) -> None:
        """Launch buckets in order while the next one is complete (or, on flush, all)."""
        while self._next < len(self._buckets):
            bucket = self._buckets[self._next]
            if bucket.pending and not flush:
                return
            # Zero the slots of parameters without a `.grad` (unused, or whose AccumulateGrad
            # ran with an undefined gradient): the slot may still hold an earlier step's
            # values. Move in any `.grad` that lives outside its slot.
            self._store.take_in(bucket.params, zero_empty=True)  # type: ignore[union-attr]
            self._launch(bucket)
            self.launch_offsets_s.append(time.perf_counter() - self._started)
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        sent = bucket.buffer
        if bucket.flags_of is not None and not self._reduce_scatter:
            # Every parameter of the group is final now: its buckets launch in order, this
            # is the last, and an earlier one with a parameter not ready waits for the flush.
            found = self._store.flagged(bucket.flags_of)  # type: ignore[union-attr]
            if found is not None:
                raw, flags, members = found
                start = bucket.buffer.storage_offset() - raw.storage_offset()
                sent = raw.narrow(0, start, raw.numel() - start)
                self._flagged.append((flags, members))
        wire = to_wire(sent, self.wire_dtype)
        op, divide = average_op(wire, self.process_group)
        if divide:
            wire.div_(self.world_size)  # divide first, so sums stay finite (flags stay > 0)
        if self._reduce_scatter:
            out = wire.view(self.world_size, -1)[self._rank()]
            bucket.work = reduce_scatter_flat(out, wire, op=op, group=self.process_group, async_op=True)
        else:
            bucket.work = dist.all_reduce(wire, op=op, group=self.process_group, async_op=True)
        bucket.sent = sent
        bucket.wire = wire if wire is not sent else None

    def _rank(self) -> int:
        return dist.get_rank(self.process_group)

    def _finish(self) -> None:
        """Final callback of the running backward."""
        outer = torch._C._current_autograd_node()
        if outer is not None:
            self._defer(outer)
            return
        self._task = -1
        self._forget_deferrals()
        if self._task_sync:
            self._sync_all()
            self._scattered = self._reduce_scatter
            if self._scattered:  # .grad refuses math until zeroed: see flatgrad._scattered
                mark_scattered(self._store)  # type: ignore[arg-type]

    def _defer(self, outer: Any) -> None:
        """This backward ran inside a node of another one, `outer` (a reentrant activation
        checkpoint recomputing its part of the graph), which may have gradients still to
        come: that one's end is this step's. A post hook on `outer` (it runs in the outer
        backward once the node returns) queues the final callback there."""

        pending = [True]  # once: the node may run again (retain_graph) before it is removed

        def finish_outside(grad_inputs: Any, grad_outputs: Any) -> None:
            if pending:
                pending.clear()
                self._task = torch._C._current_graph_task_id()
                Variable_engine().queue_callback(self._finish)

        self._deferrals.append(outer.register_hook(finish_outside))

    def _forget_deferrals(self) -> None:
        # Outside any hook dispatch (a final callback, a forward), where removing is safe.
        for handle in self._deferrals:
            handle.remove()
        self._deferrals = []

    def _check_unscattered(self) -> None:
        """Before a backward that would add onto reduce-scattered gradients: refuse. After a
        reduce-scatter a rank holds the average of its own shard only; another backward's
        local gradients added onto that and reduce-scattered again are not the average of
        the two (stock DDP's all-reduced gradients are the same on every rank, so there it
        adds up). Every rank runs the same backwards, so every rank raises. Gradients set to
        None or zeroed (by any zero_grad) since are fine: a read of the buffers, only here."""
        store = self._store
        held = store is not None and any(p.grad is not None for p in store.params)
        if store is not None and held and any(bool(b.any()) for b in store.buffers.values()):
            raise RuntimeError(
                "ShardedOptimizer: a backward after a synchronised backward and before "
                "zero_grad(): the first one reduce-scattered the gradients, so this one "
                "cannot add to them; accumulate micro-batches under dp.no_sync() and "
                "synchronise only the last, then step() and zero_grad()"
            )
        self._scattered = False
        if store is not None:  # zeroed behind ShardedOptimizer's back (model.zero_grad)
            unmark_scattered(store)

    def _sync_all(self) -> None:
        """Launch the rest, wait, and settle `.grad` like stock DDP with
        find_unused_parameters=True (a parameter no rank used keeps `.grad` None)."""
        store = self._store
        assert store is not None, "DataParallel is not built"
        compute_done = time.perf_counter()
        self.backward_s = compute_done - self._started
        self._launch_ready(flush=True)  # first: the flags below are made while it runs
        # Groups whose flags did not travel with their last bucket (reduce-scatter, a buffer
        # without room for them): one small all-reduce of theirs.
        carried = {id(p) for _, members in self._flagged for p in members}
        rest = tuple(p for p in store.params if id(p) not in carried)
        used_work = None
        if rest:
            ready = self._ready
            used = host_tensor(
                [id(p) in ready or p.grad is not None for p in rest], torch.uint8, rest[0].device
            )
            used_work = dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.process_group, async_op=True)
            self._flagged.append((used, rest))
        for bucket in self._buckets:
            bucket.work.wait()
            if bucket.wire is not None:
                bucket.sent.copy_(bucket.wire)  # type: ignore[union-attr]
        if used_work is not None:
            used_work.wait()
        self.exposed_s = time.perf_counter() - compute_done
        settle_unused(store, self._flagged)


def _refuse_compiled_autograd() -> None:
    if _in_compiled_autograd():
        raise RuntimeError(
            "DataParallel cannot run its bucket hooks under compiled autograd (it refuses "
            "the final callback that launches the last bucket); under compiled autograd use "
            "DDP with torch._dynamo.config.optimize_ddp = 'python_reducer' and "
            "flatgrad.allreduce_hook, or run this backward without compiled autograd"
        )


def _in_compiled_autograd() -> bool:
    """Whether compiled autograd runs this backward (its hooks are traced into a graph, and
    an autograd final callback is refused there)."""
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(getattr(module, "in_compiled_autograd_region", False)) or torch.compiler.is_compiling()


def Variable_engine() -> Any:  # noqa: N802 (torch's own name)
    return torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]


def _cut_buckets(store: GradStore, bucket_mb: float) -> list[_Bucket]:
    """Buckets per buffer, cut at slot boundaries in buffer order: the first about
    `_FIRST_BUCKET_MB`, the others about `bucket_mb`."""
    buckets: list[_Bucket] = []
    for key, buffer in store.buffers.items():
        slots = sorted(
            ((store.slot(p)[1].offset, p) for p in store.params if store.slot(p)[0] == key),
            key=lambda item: item[0],
        )
        cap = int(min(_FIRST_BUCKET_MB, bucket_mb) * 2**20) // buffer.element_size()
        start, members = 0, []
        for i, (_, param) in enumerate(slots):
            members.append(param)
            end = slots[i + 1][0] if i + 1 < len(slots) else buffer.numel()
            if end - start >= cap or i + 1 == len(slots):
                flags_of = key if i + 1 == len(slots) else None
                buckets.append(
                    _Bucket(
                        len(buckets), buffer.narrow(0, start, end - start), tuple(members), flags_of=flags_of
                    )
                )
                start, members = end, []
                cap = int(bucket_mb * 2**20) // buffer.element_size()
    return buckets


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


def _broadcast_from_rank0(module: nn.Module, process_group: dist.ProcessGroup | None) -> None:
    """What DDP's constructor does: every rank starts from rank 0's parameters and buffers."""
    source = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=source, group=process_group)
