"""`BucketSync`: the overlapped bucket averaging of one `DataParallel` (see `flatgrad.parallel`
for how it works): buckets cut from the flat buffers, the launch order learned in the first
synchronised backward, AccumulateGrad hooks that count readiness and launch buckets in that
order, parameters the backward will not reach counted ready at its start, and the final
callback that launches the rest, waits, and settles `.grad` as stock DDP does."""

from __future__ import annotations

import operator
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flatgrad._buckets import (
    Bucket,
    LaunchPlan,
    Round,
    agree_order,
    cores_to_spare,
    cut_buckets,
    plan_launches,
    prescale_factor,
)
from flatgrad._scattered import (
    carry_scattered,
    mark_scattered,
    refuse_adding_onto_scattered,
    unmark_scattered,
)
from flatgrad._sync_hooks import Deferrals, ReadyHooks
from flatgrad._torch_compat import (
    current_autograd_node,
    graph_task_id,
    in_compiled_autograd,
    queue_callback,
)
from flatgrad.buffer import GradStore


class BucketSync:
    """Buckets over one `GradEngine`'s store, and the averaging of each backward."""

    def __init__(
        self,
        grads: Any,
        process_group: dist.ProcessGroup | None,
        bucket_mb: float,
        wire_dtype: torch.dtype | None,
        check_finite: bool = False,
    ) -> None:
        self._grads = grads  # the FlatGrad's GradEngine
        self.check_finite = check_finite
        self.process_group = process_group
        self.bucket_mb = bucket_mb
        self.wire_dtype = wire_dtype
        self.has_buffers = False  # whether the model had buffers at the last (re)build
        self.reduce_scatter = False  # ShardedOptimizer switches the buckets to reduce-scatter
        # The gradient shards that ShardedOptimizer reads, of this store (see `Round`).
        self.shards: list[torch.Tensor] = []
        # What the model's forward runs in, if anything (`flatgrad._gather_waits.ForwardWaits`).
        self.forward_context: Callable[[], AbstractContextManager[None]] | None = None
        self._scattered = False  # the last synchronised backward reduce-scattered (see _begin)
        # This rank's shards of the averages of the synchronised backwards since zero_grad,
        # which the running one adds onto its own (`carry_scattered`).
        self._carried: list[torch.Tensor] | None = None
        self._store: GradStore | None = None
        self._buckets: list[Bucket] = []
        self._plan = LaunchPlan((), frozenset())
        self._hooks = ReadyHooks()  # the AccumulateGrad hooks, and the parameters once unused
        self._round: Round | None = None  # the running or last synchronised backward's
        self._task: int | None = None  # the graph task of the running backward, if one is open
        self._task_sync = True  # whether the running backward averages
        # DDP's expect_autograd_hooks_: a synchronising training forward came since the last
        # averaged backward, so the next backward averages whichever graph it goes through.
        self._armed = False
        self._deferrals = Deferrals()  # hooks that carry a nested backward's end outward
        self._small_first_on_cpu = cores_to_spare(process_group)  # (see `cut_buckets`)
        # The optimizer steps a ShardedOptimizer took (None without one): each synchronised
        # backward checks that every rank took as many (`Round._check_round`).
        self.step_count: int | None = None
        # Under a `Join` that divides by the ranks not joined yet: the last forward's count
        # of them, in flight (its work and tensor: `DataParallel._notify_join`), read when
        # the backward opens; None otherwise.
        self.joined_count: tuple[Any, torch.Tensor] | None = None
        # On a joined rank: whether its last shadowed iteration averaged (`shadow`), which a
        # ShardedOptimizer's join hook steps after.
        self.shadowed_sync = False
        self.rebuild()

    def _new_round(self, divisor: int | None = None) -> Round:
        names = self._parameter_names if self.check_finite else None
        return Round(
            self._buckets,
            self._plan,
            self._store,
            self.process_group,
            self.wire_dtype,
            self.reduce_scatter,
            names,
            self.shards,
            divisor,
            self.step_count,
        )

    def _parameter_names(self) -> dict[int, str]:
        return {id(p): name for name, p in self._grads.model.named_parameters()}

    @property
    def last_round(self) -> Round:
        """The running or last synchronised backward's round (its timings)."""
        assert self._round is not None, "DataParallel is not built"
        return self._round

    @property
    def store(self) -> GradStore | None:
        """The store the buckets were cut from."""
        return self._store

    @property
    def buckets(self) -> list[torch.Tensor]:
        """The bucket views of the flat buffers, in launch order."""
        return [self._buckets[index].buffer for index in self._plan.order]

    @property
    def in_backward(self) -> bool:
        """Whether a backward is open (one that raised never closes: `drain` first)."""
        return self._task is not None

    def use_reduce_scatter(self, store: GradStore) -> list[tuple[torch.Tensor, int]]:
        """Switch to reduce-scatter (ZeRO-1) over `store`, laid out for it; returns each
        bucket's (view, offset in its flat buffer), in buffer order (whatever order they
        launch in)."""
        self.reduce_scatter = True
        self.rebuild()
        assert self._store is store, "the store changed while switching to reduce-scatter"
        offset = {key: int(buffer.storage_offset()) for key, buffer in store.buffers.items()}
        key = operator.attrgetter("dtype", "device")
        return [(b.buffer, int(b.buffer.storage_offset()) - offset[key(b.buffer)]) for b in self._buckets]

    def grads_cleared(self) -> None:
        """The reduce-scattered gradients were zeroed: the next backward may add again."""
        self._scattered = False
        self._carried = None

    def drain(self) -> None:
        """Wait for the collectives a backward that raised had launched, before this step
        writes any gradient: in flight, they would land on top of it. (That step's
        launched buckets hold averages of partial gradients, as DDP's bucket views would,
        or their sums where a ShardedOptimizer divides after (`Round.divide_after`);
        `zero_grad()` before the next backward, as after any failed step.)"""
        self._task = None
        self._deferrals.forget()
        self._carried = None
        if self._round is not None:
            self._round.wait_launched()
        if self._store is not None:
            self._store.prescale.factor = None
        self._round = self._new_round()

    def rebuild(self) -> None:
        """Cut the buckets of the current store, launched in buffer order until the next
        synchronised backward teaches an order, and hook every parameter's AccumulateGrad
        node to count it ready (and open a backward that reached none of dp's outputs): all
        of them while the order is learned, then all but the last bucket's (`_learn`)."""
        self._hooks.remove()
        store = self._grads.refresh()
        self._grads.refuse_sparse("DataParallel")  # (a sparse embedding added since)
        if store is not self._store:
            self.shards = []  # of the old buffers
            self._carried = None
        self._store = store
        self.has_buffers = any(True for _ in self._grads.model.buffers())
        self._buckets = cut_buckets(store, self.bucket_mb, self._small_first_on_cpu)
        self._plan = plan_launches(self._buckets)
        bucket_of = {id(p): b for b in self._buckets for p in b.params}
        self._hooks.hook(store.params, bucket_of, self._on_ready)
        self._hooks.scale_incoming(store, self._grads.seater)
        self._prescale = prescale_factor(store, self.process_group, self.reduce_scatter, self.wire_dtype)
        self._round = self._new_round()

    # --- backward -----------------------------------------------------------------------

    def arm(self, sync: bool) -> None:
        """After a training forward: a synchronising one makes the next backward average,
        whichever graph it goes through (see `_open`)."""
        self._armed = self._armed or sync

    def pre_backward(self, sync: bool) -> Callable[[], None] | None:
        """When a backward reaches the output of a forward this DataParallel made (from the
        coordinator, `flatgrad._backward`, after the seater), before any gradient of the
        model is final: open it, averaging when that forward synchronised (`sync`), and
        return the end of it (`_finish`, which the coordinator runs after the seater's);
        None when it is open already (another output: a synchronised one upgrades it to
        averaging) or accumulates into no parameter."""
        _refuse_compiled_autograd()
        if self._grads.store is not self._store:
            self.rebuild()  # the seater, just before, laid out again (a stale slot)
        if graph_task_id() != self._task:
            if self._hooks.will_accumulate() and self._begin(sync, queue=False):
                return self._finish
        elif sync and not self._task_sync:
            self._upgrade()
        return None

    def _upgrade(self) -> None:
        """One backward through the outputs of a forward under `no_sync()` and of one outside
        it, the first reached first: it averages, as under DDP (the synchronised forward
        prepared DDP's reducer for this backward). Gradients final before now count at the
        final callback, which launches every bucket not launched yet."""
        self._task_sync = True  # (a create_graph backward never opened a task: `_begin`)
        self._armed = False
        self._average().counts_all = False

    def _begin(self, sync: bool, from_output: bool = True, queue: bool = True) -> bool:
        """Open the running backward, averaging when `sync` (the no_sync state of the forward
        whose output it reached, or the arming: see `_open`), as DDP decides; False when it
        is a create_graph backward under no_sync (nothing to do). Opened `from_output` (no
        gradient final yet), the parameters it will not reach are counted ready now."""
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
        if self._scattered:  # (a second backward before zero_grad)
            if sync:
                self._carried = carry_scattered(self._store, self.shards)
            else:
                refuse_adding_onto_scattered(self._store)
            self._scattered = False
        self._task = graph_task_id()
        self._task_sync = sync
        if sync:
            round_ = self._average()
            if self._hooks.unused and from_output:
                self._hooks.skip_unreached(round_)
        if queue:  # (the coordinator queues it after the seater's end: `pre_backward`)
            queue_callback(self._finish)
        return True

    def _average(self) -> Round:
        divisor = self._ranks_not_joined()
        self._round = self._new_round(divisor)  # (and the routed layers write divided where it sums)
        self._store.prescale.start(self._prescale if divisor is None else None)  # type: ignore[union-attr]
        return self._round

    def _ranks_not_joined(self) -> int | None:
        """The ranks not joined yet, which this backward divides by, under a `Join` that
        says so (`joined_count`, waited for here); None otherwise, or when none has joined."""
        if self.joined_count is None:
            return None
        work, count = self.joined_count
        self.joined_count = None
        work.wait()
        ranks = int(count[1])
        return None if ranks == dist.get_world_size(self.process_group) else ranks

    def shadow(self, divisor: int | None) -> None:
        """On a rank that joined (`torch.distributed.algorithms.Join`): the averaging of the
        backward the ranks still training run, with zeros for this rank's gradients, as
        DDP's join hook does: the same round (every bucket in the plan's order, the used flags
        and step count, the finiteness check) and the order agreement after the first one.
        Unlike DDP's zero buckets, the buffers are this rank's own: it ends with the others'
        averages in `.grad` (and its shards), which a ShardedOptimizer's join hook steps."""
        store = self._store
        assert store is not None, "DataParallel is not built"
        self._scattered = False
        unmark_scattered(store, to_none=True)
        for param in store.params:
            param.grad = None  # (its slot is zeroed at its bucket's launch, as an unused one's)
        store.zero_mains()
        self._round = round_ = self._new_round(divisor)
        round_.sync_all()
        self._agree_order(round_)
        self._scattered = self.reduce_scatter
        if self._scattered:
            mark_scattered(store)

    def _open(self) -> bool:
        """From an AccumulateGrad hook, when no backward is open (this one reached none of
        dp's outputs): open it, averaging, when a synchronising forward armed it, as DDP's
        hooks on the parameters do. Its first final gradient is this hook's: FlatGrad seated
        no slot for it (no output pre hook ran), so the small parameters' gradients land in
        tensors of their own, which each bucket takes into its slots before it launches."""
        if not self._armed:
            return False
        _refuse_compiled_autograd()
        # From a hook, maybe of a nested backward (whose graph is not the one that ends the
        # step): no parameter is counted ready before its AccumulateGrad runs.
        return self._begin(True, from_output=False)

    def _on_last_ready(self, grad_inputs: Any, grad_outputs: Any) -> None:
        # A parameter of the last bucket to launch (once the order is learned): the final
        # callback launches that bucket, so there is nothing to count; only a backward that
        # reached none of dp's outputs to open.
        if self._task is None:
            self._open()

    def _on_ready(self, param: nn.Parameter, bucket: Bucket, grad_inputs: Any, grad_outputs: Any) -> None:
        # A nested backward (reentrant activation checkpointing) belongs to the open one:
        # same bookkeeping.
        if self._task is None and not self._open():
            return
        if self._task_sync:  # (a synchronising backward always has its round)
            self._round.mark_ready(param, bucket)  # type: ignore[union-attr]

    def _finish(self) -> None:
        """Final callback of the running backward."""
        outer = current_autograd_node()
        if outer is not None:  # a nested backward: the end of the one around it is this step's
            self._deferrals.defer(outer, self._resume)
            return
        self._task = None
        self._deferrals.forget()
        if self._task_sync:
            round_ = self.last_round
            round_.sync_all()
            if self._carried is not None:  # the averages of the backwards before, since zero_grad
                for shard, carried in zip(self.shards, self._carried):
                    shard.add_(carried)
                self._carried = None
            self._learn(round_)
            self._scattered = self.reduce_scatter
            if self._scattered:  # .grad refuses math until zeroed: see flatgrad._scattered
                mark_scattered(self._store)  # type: ignore[arg-type]

    def _learn(self, round_: Round) -> None:
        """After a synchronised backward: note the parameters it left unused; the first
        after a (re)build sets the launch order (rank 0's, on every rank), and from then on
        the hooks of the last bucket to launch count nothing (the final callback launches
        it, its gradients the backward's last but for unused ones)."""
        last = self._buckets[self._plan.order[-1]] if self._plan.learned else None
        self._hooks.note_unused(round_, last)
        self._agree_order(round_)

    def _agree_order(self, round_: Round) -> None:
        """After the first synchronised backward since a (re)build: rank 0's order of
        completion becomes the launch order on every rank (one broadcast)."""
        if not self._plan.learned and self._buckets:
            device = self._buckets[0].buffer.device
            order = agree_order(round_.completed, len(self._buckets), device, self.process_group)
            self._plan = plan_launches(self._buckets, order)
            self._hooks.stop_counting(self._buckets[order[-1]], self._on_last_ready)

    def _resume(self) -> None:
        # The node a nested backward ran in returned, inside the outer backward: finish there.
        self._task = graph_task_id()
        queue_callback(self._finish)


def _refuse_compiled_autograd() -> None:
    if in_compiled_autograd():
        raise RuntimeError(
            "DataParallel cannot run its bucket hooks under compiled autograd (it refuses "
            "the final callback that launches the last bucket); under compiled autograd use "
            "DDP with torch._dynamo.config.optimize_ddp = 'python_reducer' and "
            "flatgrad.allreduce_hook, or run this backward without compiled autograd"
        )
