"""A `replicate`'s overlapped bucket averaging (see `flatgrad._parallel`), static parts apart from `Round`s:

- `BucketPlan`: the static side, the same on every rank: the buckets cut from a store's flat buffers
  (`plan_buckets`; each a `Bucket` record), their launch order and the buckets that carry the used flags.
- `Round`: a synchronised backward (readiness, plan-order launches, wait, settling `.grad`), made on opening.
- `ReadyHooks`, `Deferrals`: the autograd hooks that count parameters ready (those a synchronised backward
  left unused: at the start of a later one not reaching them) and carry a nested backward's end outward.
- `BucketSync`: the plan over a `GradEngine`'s store (its order learned in the first synchronised backward),
  which backwards average, and the final callback: launch the rest, wait, settle `.grad` as DDP."""

from __future__ import annotations

import contextlib
import functools
import operator
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import Node

from flatgrad._backward import Grads, Seater
from flatgrad._buffer import GradStore, host_tensor, read_here
from flatgrad._comm import average_op, backend_policy, launch_average, settle_unused
from flatgrad._engine import GradEngine
from flatgrad._layout import GroupKey
from flatgrad._prescale import scale_incoming
from flatgrad._scattered_grad import (
    carry_scattered,
    holds_scattered,
    mark_scattered,
    refuse_adding_onto_scattered,
    unmark_scattered,
)
from flatgrad._torch_compat import (
    accumulate_grad_node,
    current_autograd_node,
    graph_task_id,
    in_compiled_autograd,
    queue_callback,
    will_execute,
)

_FIRST_BUCKET_MB = 1.0  # a small first bucket starts communication early, as in DDP
_SUMMED = (torch.float32, torch.float64)  # summed whole and divided after (see `Round`)


@dataclass
class Bucket:
    """One contiguous piece of a flat buffer and the parameters whose slots it holds (cut by `BucketPlan`)."""

    index: int  # its position in `BucketPlan.buckets` (buffer order)
    buffer: torch.Tensor  # a narrow view of the flat buffer
    params: tuple[nn.Parameter, ...]
    key: GroupKey
    # Whether it ends its buffer: its all-reduce may carry the used flags after it (`GradStore.flagged`).
    ends_buffer: bool = False
    # The prescaled parameters of its last launch, and its other slots' spans (`_prescale`).
    unscaled: tuple[frozenset[int], list[torch.Tensor]] | None = None


@dataclass(frozen=True)
class BucketPlan:
    """The static side of one store's averaging, the same on every rank: the buckets (`plan_buckets`), their
    launch order (collectives run in one order everywhere), and the buckets carrying their group's used flags.

    Buffer order until a synchronised backward has been seen (`learned` False); then rank 0's order of
    completion in that backward (`agree_order`, `learn`), so a model whose gradients become final out of
    buffer order, or whose early buckets wait for an unused parameter, still overlaps."""

    buckets: tuple[Bucket, ...]  # in buffer order
    order: tuple[int, ...]  # the launch order, as indices into `buckets`
    # A group's flags ride on its last bucket to launch (every gradient of the group final then) when it also
    # ends the buffer; otherwise `Round.sync_all` sends them in a small all-reduce of their own.
    carriers: frozenset[int]
    learned: bool = False

    def learn(self, order: Sequence[int]) -> BucketPlan:
        """The same buckets launched in `order` (rank 0's, agreed by every rank) from now on."""
        return _ordered(self.buckets, tuple(order), learned=True)

    @property
    def last(self) -> Bucket | None:
        """The last bucket to launch once the order is learned (its hooks count nothing); None before."""
        return self.buckets[self.order[-1]] if self.learned else None


def _ordered(buckets: tuple[Bucket, ...], order: tuple[int, ...], learned: bool) -> BucketPlan:
    """The plan that launches `buckets` in `order`, with the carriers that order gives."""
    last: dict[GroupKey, Bucket] = {}
    for index in order:
        last[buckets[index].key] = buckets[index]
    carriers = frozenset(bucket.index for bucket in last.values() if bucket.ends_buffer)
    return BucketPlan(buckets, order, carriers, learned)


def agree_order(
    completed: Sequence[int], num_buckets: int, device: torch.device, process_group: dist.ProcessGroup | None
) -> list[int]:
    """Rank 0's order of bucket completion in its last backward, on every rank (one small broadcast): the
    buckets in the order they completed, then those that never did (an unused parameter) in buffer order."""
    seen = set(completed)
    order = [*completed, *(index for index in range(num_buckets) if index not in seen)]
    agreed = host_tensor(order, torch.int64, device)  # (pinned on CUDA: no pageable copy)
    source = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    dist.broadcast(agreed, src=source, group=process_group)
    return [int(index) for index in agreed.tolist()]


class Round:
    """One synchronised backward's averaging: which parameters are ready, which bucket launches next (in the
    plan's order), each bucket's collective, and the used flags that travel with them. Made when such a
    backward opens (and at a rebuild), replaced by the next (its timings: the last one's)."""

    def __init__(self, sync: BucketSync, divisor: int | None = None) -> None:
        """A round over `sync`'s bucket plan and store, with its settings as they are now."""
        plan = self.plan = sync._plan
        self.store, self.process_group, self.reduce_dtype = sync.store, sync.process_group, sync.reduce_dtype
        self.scatter = sync.reduce_scatter
        # The ranks a `Join` averages over when not the world size (joined ranks send zeros:
        # `BucketSync.shadow`), and the ShardedOptimizer steps before this backward (`_check_round`).
        self.divisor, self.step_count = divisor, sync.step_count
        # The used flags may ride with a bucket unless it is reduce-scattered (each rank would get only its
        # part of them), or a step count must ride with them (bytes compared by MAX: see `_check_round`).
        self.reduce_scatters = self.scatter and sync.policy.reduce_scatter  # (gloo all-reduces instead)
        self.carries_flags = not self.reduce_scatters and self.step_count is None
        self.world_size = dist.get_world_size(self.process_group)
        summed = _sums_then_divides(self, not sync.check_finite)
        self.divide_after = [s for s in sync.shards if s.dtype in _SUMMED] if summed else []
        # With `check_finite` (parameter names, for errors): per launched bucket, a device flag: all finite.
        self.check_finite = sync._parameter_names if sync.check_finite else None
        self.finite: list[torch.Tensor] = []
        # The backward's current stream per CUDA device of the buckets (a round opens on the forward's, in an
        # output's pre hook): `_follow_backward`.
        cuda = {bucket.buffer.device for bucket in plan.buckets if bucket.buffer.is_cuda}
        self.streams = {device: torch.cuda.current_stream(device) for device in cuda}
        self.pending = [len(bucket.params) for bucket in plan.buckets]
        self.work: list[Any] = [None] * len(plan.buckets)
        self.wire: list[torch.Tensor | None] = [None] * len(plan.buckets)
        self.sent: list[torch.Tensor | None] = [None] * len(plan.buckets)  # what each collective ran on
        self.ready: set[int] = set()  # the parameters whose AccumulateGrad ran
        # Those this backward will not reach (`skip`): ready at its start, unused unless a rank used them.
        self.unreached: set[int] = set()
        # Whether every gradient final in this backward is counted (not so in a round made in the middle of
        # one: `BucketSync._upgrade`); only such a round tells which parameters the model leaves unused.
        self.counts_all = True
        self.completed: list[int] = []  # the buckets, in the order they became complete
        # (flags, their parameters): carried by the plan's carriers, or by a small all-reduce (`sync_all`).
        self.flagged: list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = []
        self.next = 0  # the position in the plan's order of the next bucket to launch
        self.launched_in_backward = 0  # launched before the final callback flushed the rest
        # perf_counter seconds (host time; about 0 exposed on NCCL, whose waits do not block the host): each
        # launch after the backward's start; the final callback's waits; the backward's start to its end.
        self.started = time.perf_counter()
        self.launch_offsets_s: list[float] = []
        self.exposed_s = 0.0
        self.backward_s = 0.0

    def mark_ready(self, param: nn.Parameter, bucket: Bucket) -> None:
        key = id(param)
        if key in self.ready:
            raise RuntimeError(
                "a parameter's gradient became final twice in one backward (a reentrant "
                "activation checkpoint using it both inside and outside the checkpointed "
                "function); use torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
            )
        self.ready.add(key)
        if self.unreached and key in self.unreached:  # counted at the start (see below)
            self._reached_late(key, bucket)
            return
        pending, index = self.pending, bucket.index  # (locals: once per parameter)
        pending[index] -= 1
        if not pending[index]:
            self.completed.append(index)
            self.launch_ready()

    def skip(self, unreached: Sequence[tuple[nn.Parameter, Bucket]]) -> None:
        """At the backward's start: count ready the parameters it will not reach (their AccumulateGrad does
        not run), as DDP with find_unused_parameters=True does, so their buckets launch once the rest is."""
        for param, bucket in unreached:
            self.unreached.add(id(param))
            self.pending[bucket.index] -= 1
            if not self.pending[bucket.index]:
                self.completed.append(bucket.index)
        self.launch_ready()

    def _reached_late(self, key: int, bucket: Bucket) -> None:
        # Said unreached, but a nested backward (reentrant checkpoint) got it: fine while its bucket waits.
        self.unreached.discard(key)
        if self.sent[bucket.index] is not None:
            raise RuntimeError(
                "replicate: a parameter unused in an earlier step got its gradient from a "
                "nested backward (a reentrant activation checkpoint) after its bucket was "
                "averaged; use torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
            )

    def launch_ready(self, flush: bool = False) -> None:
        """Launch buckets in the plan's order while the next one is complete (or, on flush, all)."""
        buckets, order = self.plan.buckets, self.plan.order
        while self.next < len(order):
            bucket = buckets[order[self.next]]
            if self.pending[bucket.index] and not flush:
                return
            if bucket.buffer.is_cuda:
                self._follow_backward(bucket.buffer.device)
            # Zero the slots of parameters without a `.grad` (unused, or whose AccumulateGrad ran with an
            # undefined gradient: still seated, on their -0.0 fill, until now): the slot may still hold an
            # earlier step's values. Move in any `.grad` that lives outside its slot.
            self.store.unseat_final(bucket.params)
            self.store.take_in(bucket.params, zero_empty=True)
            self._launch(bucket)
            self.launch_offsets_s.append(time.perf_counter() - self.started)
            self.next += 1

    def _follow_backward(self, device: torch.device) -> bool:
        """Make the current stream wait for the backward's on `device`; whether it had to. A routed layer
        writes its slot on its forward's stream and hands AccumulateGrad no gradient, so the engine orders
        nothing after that write, and the hooks that launch most buckets run on the stream their nodes were
        made on: trained on another stream than built on, a launch would otherwise read slots in writing."""
        stream = self.streams.get(device)
        current = torch.cuda.current_stream(device)
        if stream is None or stream == current:
            return False
        current.wait_stream(stream)
        return True

    def _launch(self, bucket: Bucket) -> None:
        sent = bucket.buffer
        if bucket.index in self.plan.carriers and self.carries_flags:
            # Every parameter of the group is final now: its buckets launch in the plan's order, this is the
            # last, and one before it with a parameter not ready waits for the flush.
            found = self.store.flagged(bucket.key)
            if found is not None:
                raw, flags, members = found
                start = bucket.buffer.storage_offset() - raw.storage_offset()
                sent = raw.narrow(0, start, raw.numel() - start)
                self.flagged.append((flags, members))
        if self.check_finite is not None:
            self.finite.append(torch.isfinite(bucket.buffer).all())
        i, divide = bucket.index, not (self.divide_after and sent.dtype in _SUMMED)
        if divide_unscaled(bucket, self.store, self.world_size):
            divide = False  # (the routed slots were written divided: `flatgrad._prescale`)
        group, reduce_dtype, scatter = self.process_group, self.reduce_dtype, self.reduce_scatters
        self.work[i], self.wire[i] = launch_average(sent, group, reduce_dtype, scatter, divide, self.divisor)
        self.sent[i] = sent

    def wait_launched(self) -> None:
        for work in self.work:
            if work is not None:
                work.wait()

    def sync_all(self) -> None:
        """Launch the rest, wait, settle `.grad` as DDP with find_unused_parameters=True does."""
        store = self.store
        compute_done = time.perf_counter()
        self.backward_s = compute_done - self.started
        self.launched_in_backward = self.next
        self.launch_ready(flush=True)  # first: the flags below are made while it runs
        # Groups whose flags did not travel with a bucket (reduce-scatter, a buffer without room for them, a
        # last bucket to launch that does not end the buffer): one small all-reduce of theirs.
        carried = {id(p) for _, members in self.flagged for p in members}
        rest = tuple(p for p in store.params if id(p) not in carried)
        used_work = None
        if rest or self.step_count is not None:
            # Used as a bucket's flags say it (`GradStore.flagged`): a `.grad` (DDP counts an AccumulateGrad
            # run with none as unused), or a main grad.
            flags = [p.grad is not None or store.has_main(p) for p in rest]
            count = [] if self.step_count is None else _round_bytes(self.step_count)
            device = next(iter(store.buffers.values())).device
            used = host_tensor([*flags, *count], torch.uint8, device)
            used_work = dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.process_group, async_op=True)
            self.flagged.append((used[: len(rest)], rest))
        nonfinite = self._launch_finite_check(store) if self.check_finite is not None else None
        for work, wire, sent in zip(self.work, self.wire, self.sent):
            work.wait()
            if wire is not None:
                sent.copy_(read_here(wire))  # type: ignore[union-attr]
        if used_work is not None:
            used_work.wait()
            if self.step_count is not None:
                self._check_round(used[len(rest) :], self.step_count)
        if self.divide_after:
            torch._foreach_div_(self.divide_after, self.world_size)
            self.divide_after = []  # (once)
        self.exposed_s = time.perf_counter() - compute_done
        store.prescale.factor = None
        settle_unused(store, self.flagged)
        if nonfinite is not None:
            self._raise_if_nonfinite(*nonfinite)

    def _check_round(self, seen: torch.Tensor, step_count: int) -> None:
        """Raise on every rank unless all took as many optimizer steps before this backward (`_round_bytes`,
        reduced by MAX: all equal exactly when max equals min). A rank that skipped forward and backward on an
        empty batch but stepped pairs this backward with the others' previous one; its next collectives (the
        gathers of their step) would mismatch in size, and gloo aborts the process from its thread."""
        high, low = (int(v) for v in seen.tolist())
        if high == 255 - low:
            return
        rank = dist.get_rank(self.process_group)
        raise RuntimeError(
            f"replicate: the ranks disagree on the round: rank {rank} runs the backward after "
            f"{step_count % 256} optimizer steps, while the ranks' counts range from {255 - low} "
            f"to {high} (modulo 256): a rank stepped without the forward and backward of the others "
            "(an empty batch?). Every rank must run the same synchronised backwards and steps; for "
            "uneven data per rank, wrap the loop in "
            "`with torch.distributed.algorithms.Join([dp, opt]):`"
        )

    def _launch_finite_check(self, store: GradStore) -> tuple[torch.Tensor, dist.Work]:
        """Which ranks had a non-finite local gradient: one small all-reduce of a flag per rank, launched with
        the buckets', so every rank raises together."""
        device = next(iter(store.buffers.values())).device
        ranks = torch.zeros(dist.get_world_size(self.process_group), dtype=torch.int32, device=device)
        if self.finite:
            finite = torch.stack([read_here(flag) for flag in self.finite])
            ranks[dist.get_rank(self.process_group)] = (~finite).any().to(torch.int32)
        return ranks, dist.all_reduce(ranks, group=self.process_group, async_op=True)

    def _raise_if_nonfinite(self, ranks: torch.Tensor, work: dist.Work) -> None:
        work.wait()
        bad = [rank for rank, flag in enumerate(ranks.tolist()) if flag]
        if not bad:
            return
        rank = dist.get_rank(self.process_group)
        where = f"rank(s) {bad} (each names its own parameters)"
        if rank in bad:
            names = self.check_finite() if self.check_finite is not None else {}
            local = [
                names.get(id(p), f"<parameter of shape {tuple(p.shape)}>")
                for bucket, finite in zip([self.plan.buckets[i] for i in self.plan.order], self.finite)
                if not bool(finite)
                for p in bucket.params
                if not _finite(self.store, p)
            ]
            where = f"rank {rank} (this rank) in {local[:8]}" + (
                f", and rank(s) {bad}" if len(bad) > 1 else ""
            )
        raise RuntimeError(
            f"replicate(check_finite=True): a non-finite gradient (NaN or inf) before averaging on "
            f"{where}; this step's gradients are not usable: skip it (zero_grad) or stop"
        )


def _sums_then_divides(round_: Round, no_finite_check: bool) -> bool:
    """Whether a ShardedOptimizer's all-reduced (gloo) float32/float64 buckets are summed and only its shards
    divided last (docs/performance.md, "Dividing on gloo"): a power-of-two world size (exact division) and no
    Join divisor. Half precision divides first, so its sums stay finite; so does `check_finite`."""
    world_size = round_.world_size
    exact = world_size > 1 and world_size & (world_size - 1) == 0  # (1: no division)
    exact = exact and round_.divisor is None  # (never the world size: `_ranks_not_joined`)
    all_reduced = round_.scatter and not round_.reduce_scatters  # (gloo: `BackendPolicy.reduce_scatter`)
    return all_reduced and round_.reduce_dtype is None and exact and no_finite_check


def _round_bytes(count: int) -> list[int]:
    """`count` modulo 256 and its complement to 255, as bytes (MAX: the largest count, 255 - the smallest)."""
    low = count % 256
    return [low, 255 - low]


def _finite(store: GradStore, param: nn.Parameter) -> bool:
    """Whether `param`'s gradient as the sync left it is finite: its main grad, else `.grad` (None: fine)."""
    grad = store.view(param) if store.is_main(param) else param.grad
    return grad is None or bool(torch.isfinite(grad).all())


def divide_unscaled(bucket: Bucket, store: GradStore, world_size: int) -> bool:
    """Before `bucket`'s sum: divide its slots the routed layers did not write scaled (`flatgrad._prescale`),
    in few fills (the rest's spans cached per scaled set); False when none was (the whole bucket divided as
    usual). (Used flags after it need no division: a sum of 0s and 1s is 0 only if all are.)"""
    written = store.prescale.written
    if not written:  # (a model with nothing routed: no pass over the bucket's parameters)
        return False
    scaled = frozenset(id(p) for p in bucket.params if id(p) in written)
    if not scaled:
        return False
    if bucket.unscaled is None or bucket.unscaled[0] != scaled:
        bucket.unscaled = (scaled, store.spans([p for p in bucket.params if id(p) not in scaled]))
    if bucket.unscaled[1]:
        torch._foreach_div_(bucket.unscaled[1], world_size)
    return True


def prescale_factor(
    store: GradStore, process_group: dist.ProcessGroup | None, scatter: bool, reduce_dtype: torch.dtype | None
) -> float | None:
    """1 / world size where `store`'s buckets are averaged by a sum the routed layers may divide for
    (`flatgrad._prescale`): every buffer summed (gloo), a power-of-two world size (exact), no wire dtype,
    all-reduced (unsharded); else None."""
    world = dist.get_world_size(process_group)
    if scatter or reduce_dtype is not None or world < 2 or world & (world - 1):
        return None
    return 1 / world if all(average_op(b, process_group)[1] for b in store.buffers.values()) else None


def plan_buckets(store: GradStore, bucket_cap_mb: float, small_first_on_cpu: bool = True) -> BucketPlan:
    """The bucket plan of `store`, launched in buffer order (not learned): buckets per buffer, cut at slot
    boundaries in buffer order, the first about `_FIRST_BUCKET_MB`, the others about `bucket_cap_mb`.
    With `small_first_on_cpu` False (no spare core: `BackendPolicy.spare_core`) a CPU buffer's first bucket is
    half a bucket, never below 1 MiB, as gloo's collective there costs more than an early small bucket hides
    (docs/performance.md, "No small first bucket on a CPU host without a spare core")."""
    buckets: list[Bucket] = []
    for key, buffer in store.buffers.items():
        slots = sorted(
            ((store.slot(p)[1].offset, p) for p in store.params if store.slot(p)[0] == key),
            key=lambda item: item[0],
        )
        busy_cpu = not small_first_on_cpu and buffer.device.type == "cpu"
        first_mb = max(_FIRST_BUCKET_MB, bucket_cap_mb / 2) if busy_cpu else _FIRST_BUCKET_MB
        cap = int(min(first_mb, bucket_cap_mb) * 2**20) // buffer.element_size()
        start, members = 0, []
        for i, (_, param) in enumerate(slots):
            members.append(param)
            end = slots[i + 1][0] if i + 1 < len(slots) else buffer.numel()
            if end - start >= cap or i + 1 == len(slots):
                view = buffer.narrow(0, start, end - start)
                buckets.append(
                    Bucket(len(buckets), view, tuple(members), key, ends_buffer=i + 1 == len(slots))
                )
                start, members = end, []
                cap = int(bucket_cap_mb * 2**20) // buffer.element_size()
    return _ordered(tuple(buckets), tuple(range(len(buckets))), learned=False)


# What a hook on a parameter's AccumulateGrad calls: (param, bucket, grad_inputs, grad_outputs).
OnReady = Callable[[nn.Parameter, Bucket, Grads, Grads], None]


class ReadyHooks:
    """One hook per parameter on its AccumulateGrad node (kept alive here: a parameter holds it weakly), and
    the parameters once unused, with node and bucket."""

    def __init__(self) -> None:
        self.unused: dict[int, tuple[nn.Parameter, Any, Bucket]] = {}
        self._params: tuple[nn.Parameter, ...] = ()
        self._bucket_of: Mapping[int, Bucket] = {}
        self._handles: list[Any] = []  # per parameter, in `_params`' order
        self._scaling: list[Any] = []  # the routed parameters' (`scale_incoming`)
        self._nodes: list[Any] = []

    def remove(self) -> None:
        """Remove every hook (from outside any hook dispatch)."""
        for handle in self._handles + self._scaling:
            handle.remove()
        self._handles, self._nodes, self._scaling = [], [], []

    def scale_incoming(self, store: GradStore, seater: Seater | None) -> None:
        """Hook the AccumulateGrad of each parameter `seater` routes (of `store`; none without one) to scale a
        gradient reaching it through plain autograd (the weight also used outside its layer) by the prescale
        factor where its layer wrote the slot scaled in this backward (`_prescale.scale_incoming`)."""
        routed = [p for p in seater.routed if p.requires_grad] if seater is not None else []  # (as `hook`)
        store.prescale.hooked = {id(param) for param in routed}
        for param in routed:
            node = accumulate_grad_node(param)
            hook = functools.partial(scale_incoming, store.prescale, param)
            self._scaling.append(node.register_prehook(hook))  # (its node kept alive by `hook`, first)

    def hook(
        self, params: Sequence[nn.Parameter], bucket_of: Mapping[int, Bucket], on_ready: OnReady
    ) -> None:
        """After `remove`: hook each of `params` (a new store's) to call ``on_ready(param, bucket, ...)``.

        Args:
            params: the store's parameters, in its order.
            bucket_of: each one's bucket, by ``id(param)``.
            on_ready: what each hook calls, with the parameter and its bucket first."""
        # (a frozen one gets no gradient: one a reduce-scattered store keeps, `_keeps_frozen`, has no node)
        self._params = tuple(p for p in params if p.requires_grad)
        self._bucket_of, self.unused = bucket_of, {}
        for param in self._params:
            node = accumulate_grad_node(param)
            self._handles.append(node.register_hook(functools.partial(on_ready, param, bucket_of[id(param)])))
            self._nodes.append(node)

    def will_accumulate(self) -> bool:
        """Whether this backward accumulates into a parameter (not autograd.grad; not inputs= naming none)."""
        try:
            return any(will_execute(node) for node in self._nodes)
        except RuntimeError:  # asked during torch.autograd.grad, which never accumulates
            return False

    def note_unused(self, round_: Round, last: Bucket | None) -> None:
        """After `round_`, a synchronised backward: note the parameters it left unused (no AccumulateGrad ran
        before its final callback) but those of `last` (`BucketPlan.last`)."""
        counted = len(self._params) - (len(last.params) if last is not None else 0)
        if round_.counts_all and len(round_.ready) < counted:
            ready, unused = round_.ready, self.unused
            for param, node in zip(self._params, self._nodes):
                bucket = self._bucket_of[id(param)]
                if id(param) not in ready and id(param) not in unused and bucket is not last:
                    unused[id(param)] = (param, node, bucket)

    def skip_unreached(self, round_: Round) -> None:
        """Count ready the parameters once unused that this backward will not reach (the engine will not run
        their AccumulateGrad), so their buckets need not wait for the final callback. Only those once unused
        are asked: the engine cannot see one that only a nested backward reaches (a reentrant checkpoint)."""
        unused = self.unused.values()
        unreached = [(param, bucket) for param, node, bucket in unused if not will_execute(node)]
        if unreached:
            round_.skip(unreached)

    def stop_counting(self, last: Bucket, on_last_ready: Callable[[Grads, Grads], None]) -> None:
        """Hook the parameters of `last` (the last bucket to launch) with `on_last_ready`, which counts
        nothing, nor asks about a parameter once unused there (from a final callback: safe to remove)."""
        for i, param in enumerate(self._params):
            if self._bucket_of[id(param)] is last:
                self._handles[i].remove()
                self._handles[i] = self._nodes[i].register_hook(on_last_ready)
                self.unused.pop(id(param), None)


class Deferrals:
    """Post hooks carrying a nested backward's end outward: one run inside another's node (a reentrant
    checkpoint's recompute) ends before that one, which may have gradients to come; its end is the step's."""

    def __init__(self) -> None:
        self._handles: list[Any] = []

    def defer(self, outer: Node, resume: Callable[[], None]) -> None:
        """Call `resume` once from a post hook on `outer`, the node the nested backward ran in (it runs in the
        outer backward once the node returns); the node may run again (retain_graph) before its removal."""
        pending = [True]

        def finish_outside(grad_inputs: Grads, grad_outputs: Grads) -> None:
            if pending:
                pending.clear()
                resume()

        self._handles.append(outer.register_hook(finish_outside))

    def forget(self) -> None:
        """Remove every hook (outside any hook dispatch: a final callback, a forward)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


class BucketSync:
    """The bucket plan over one `GradEngine`'s store, and the averaging of each backward."""

    def __init__(
        self,
        grads: GradEngine,
        process_group: dist.ProcessGroup | None,
        bucket_cap_mb: float,
        reduce_dtype: torch.dtype | None,
        check_finite: bool = False,
    ) -> None:
        self._grads = grads  # the FlatGrad's GradEngine
        self.check_finite = check_finite
        self.process_group = process_group
        self.bucket_cap_mb = bucket_cap_mb
        self.reduce_dtype = reduce_dtype
        self.has_buffers = False  # whether the model had buffers at the last (re)build
        self.reduce_scatter = False  # ShardedOptimizer switches the buckets to reduce-scatter
        # ShardedOptimizer's gradient shards (`shard_plan`), divided last on gloo (`Round.divide_after`).
        self.shards: list[torch.Tensor] = []
        # What the model's forward runs in, if anything (`flatgrad._gather_waits.ForwardWaits`).
        self.forward_context: Callable[[], AbstractContextManager[None]] | None = None
        self._scattered = False  # the last synchronised backward reduce-scattered (see _begin)
        # This rank's shards of the averages since zero_grad, which the backward adds (`carry_scattered`).
        self._carried: list[torch.Tensor] | None = None
        self.store = grads.refresh()  # the store the buckets are cut from (`rebuild`)
        self._plan: BucketPlan  # the buckets of `store` and their launch order, from `rebuild`
        self.hooks = ReadyHooks()  # the AccumulateGrad hooks, and the parameters once unused
        self.last_round: Round  # the running or last synchronised backward's (its timings), from `rebuild`
        self._task: int | None = None  # the graph task of the running backward, if one is open
        self._task_sync = True  # whether the running backward averages
        # DDP's expect_autograd_hooks_: a synchronising training forward came since the last averaged
        # backward, so the next averages, whatever its graph.
        self._armed = False
        # Inside `averaging()`: a backward that opens averages whatever its forward decided.
        self._averaging = False
        # DDP's require_backward_grad_sync, which `replicate.no_sync()` clears: whether a training forward
        # synchronises, and (read when it opens) whether a backward inside one averages (`_open`).
        self.sync = True
        # The model's training forwards running now: a backward opening inside one (a LightningModule's
        # `manual_backward` in the training_step replicate's forward runs) is decided by `sync` (`_open`).
        self._forwards = 0
        self._deferrals = Deferrals()  # hooks that carry a nested backward's end outward
        self.policy = backend_policy(process_group)  # the gloo/CPU choices, read once
        # ShardedOptimizer's steps (or None): each backward checks the ranks agree (`Round._check_round`).
        self.step_count: int | None = None
        # Under a `Join` that divides by the ranks not joined yet: the last forward's count of them, in flight
        # (its work and tensor: `replicate._notify_join`), read when the backward opens; None otherwise.
        self.joined_count: tuple[Any, torch.Tensor] | None = None
        # On a joined rank: whether its last shadowed iteration averaged (`shadow`): a ShardedOptimizer steps.
        self.shadowed_sync = False
        # Synchronised backwards so far (shadowed ones on a joined rank too).
        self.num_syncs = 0
        self.rebuild()

    def _parameter_names(self) -> dict[int, str]:
        return {id(p): name for name, p in self._grads.model.named_parameters()}

    @property
    def buckets(self) -> list[torch.Tensor]:
        """The bucket views of the flat buffers, in launch order."""
        return [self._plan.buckets[index].buffer for index in self._plan.order]

    def shard_plan(self, store: GradStore, overlap_param_gather: bool) -> list[tuple[torch.Tensor, int]]:
        """The shard plan for a ShardedOptimizer over `store` (laid out for it): the gradient buffer pieces
        that split into equal shards, rank r owning the r-th, as (gradient view, offset in its flat buffer),
        in buffer order. From here on the buckets reduce-scatter (ZeRO-1).

        The pieces are the buckets where the backward reduce-scatters (NCCL) or the next forward waits for
        each bucket's gather (`overlap_param_gather`). Otherwise (gloo all-reduces every bucket) each whole
        buffer, gathered in one broadcast per rank, not one per rank and bucket (docs/performance.md, "ZeRO-1
        on gloo: all-reduce and broadcasts"); slots on multiples of the world size split it evenly."""
        self.reduce_scatter = True
        self.rebuild()
        assert self.store is store, "the store changed while switching to reduce-scatter"
        if not (overlap_param_gather or self.policy.reduce_scatter):
            return [(buffer, 0) for buffer in store.buffers.values()]
        offset = {key: int(buffer.storage_offset()) for key, buffer in store.buffers.items()}
        key = operator.attrgetter("dtype", "device")
        buckets = self._plan.buckets
        return [(b.buffer, int(b.buffer.storage_offset()) - offset[key(b.buffer)]) for b in buckets]

    def run_forwards_in(
        self, context: Callable[[], AbstractContextManager[None]] | None, replacing: object = None
    ) -> None:
        """Run replicate's forwards of the model inside `context` from now on (a ShardedOptimizer's
        `ForwardWaits.learning`, until a forward taught them); None: plainly; `replacing`: only if current."""
        if replacing is None or self.forward_context == replacing:
            self.forward_context = context

    def stepped(self) -> None:
        """The ShardedOptimizer stepped (with or without gradients)."""
        if self.step_count is not None:
            self.step_count += 1

    def grads_cleared(self) -> None:
        """The reduce-scattered gradients were zeroed: the next backward may add again."""
        self._scattered = False
        self._carried = None

    def drain(self) -> None:
        """When a backward is still open (one that raised never closes), wait for the collectives it had
        launched, before this step writes any gradient: in flight, they would land on top of it. (Its buckets
        hold averages of partial gradients, as DDP's would, or sums (`Round.divide_after`).)"""
        if self._task is None:
            return
        self._task = None
        self._deferrals.forget()
        self._carried = None
        self.last_round.wait_launched()
        self.store.prescale.factor = None
        self.last_round = Round(self)

    def rebuild(self) -> None:
        """Cut the buckets of the current store, launched in buffer order until the next synchronised backward
        teaches an order, and hook every parameter's AccumulateGrad node to count it ready (and open a
        backward that reached no dp output): all while the order is learned, then all but the last's."""
        self.hooks.remove()
        store = self._grads.refresh()
        self._grads.refuse_sparse("replicate")  # (a sparse embedding added since)
        if store is not self.store:
            self.shards = []  # of the old buffers
            self._carried = None
        self.store = store
        self.has_buffers = any(True for _ in self._grads.model.buffers())
        plan = self._plan = plan_buckets(store, self.bucket_cap_mb, self.policy.spare_core)
        self.hooks.hook(store.params, {id(p): b for b in plan.buckets for p in b.params}, self._on_ready)
        self.hooks.scale_incoming(store, self._grads.seater)
        self._prescale = prescale_factor(store, self.process_group, self.reduce_scatter, self.reduce_dtype)
        self.last_round = Round(self)

    # --- backward -----------------------------------------------------------------------

    def begin_forward(self) -> None:
        """A training forward starts (grad on): until `end_forward`, backwards inside average if `sync`."""
        self._forwards += 1
        if not self.sync:  # (its backward's gradients stay local: see `GradStore.unsynced`)
            self.store.unsynced = True

    @property
    def in_forward(self) -> bool:
        """Whether a training forward runs (between `begin_forward` and `end_forward`)."""
        return self._forwards > 0

    def end_forward(self, finished: bool = True) -> None:
        """The training forward `begin_forward` announced ended; one that `finished` (did not raise) and
        synchronised (`sync`) makes the next backward average, whatever its graph (see `_open`)."""
        self._forwards -= 1
        self._armed = self._armed or (finished and self.sync)

    @contextlib.contextmanager
    def averaging(self) -> Iterator[None]:
        """Backwards that open inside average, whatever the no_sync state of the forwards whose outputs they
        go through: the last micro-batch of a pipeline stage (`flatgrad.pipelining`), whose forwards ran under
        no_sync(); where torch's stage calls DDP's ``prepare_for_backward``, this opens replicate's round."""
        previous, self._averaging = self._averaging, True
        try:
            yield
        finally:
            self._averaging = previous

    def pre_backward(self, sync: bool) -> Callable[[], None] | None:
        """When a backward reaches an output of this replicate's forward (from `flatgrad._backward`'s
        coordinator, after the seater), before any gradient is final: open it, averaging if that forward
        synchronised (`sync`), returning its end (`_finish`, run by the coordinator after the seater's); None
        if already open (a synchronised other output upgrades it) or accumulating into no parameter."""
        _refuse_compiled_autograd()
        if self._grads.store is not self.store:
            self.rebuild()  # the seater, just before, laid out again (a stale slot)
        sync = sync or self._averaging
        if graph_task_id() != self._task:
            if self.hooks.will_accumulate() and self._begin(sync, queue=False):
                return self._finish
        elif sync and not self._task_sync:
            self._upgrade()
        return None

    def _upgrade(self) -> None:
        """One backward through the outputs of a forward under `no_sync()` and of one outside it, the first
        reached first: it averages, as under DDP (the synchronised forward prepared DDP's reducer for it).
        Gradients final before now count at the final callback, which launches the buckets left."""
        self._task_sync = True  # (a create_graph backward never opened a task: `_begin`)
        self._armed = False
        self._average().counts_all = False

    def _begin(self, sync: bool, from_output: bool = True, queue: bool = True) -> bool:
        """Open the running backward, averaging when `sync` (the no_sync state of the forward whose output it
        reached, or the arming: see `_open`), as DDP decides; False for a create_graph backward under no_sync
        (nothing to do). Opened `from_output` (no gradient final yet): what it will not reach counts ready."""
        if sync:
            self._armed = False  # this backward is the one the synchronising forward armed
        if torch.is_grad_enabled():  # create_graph=True: the gradients must stay differentiable
            if sync:
                raise RuntimeError(
                    "replicate cannot average the gradients of a backward with "
                    "create_graph=True (they must stay differentiable); run that forward and "
                    "backward under dp.no_sync()"
                )
            return False
        if self._scattered:  # (a second backward before zero_grad)
            self._set_aside(sync)
        self._task = graph_task_id()
        self._task_sync = sync
        if sync:
            round_ = self._average()
            if self.hooks.unused and from_output:
                self.hooks.skip_unreached(round_)
        if queue:  # (the coordinator queues it after the seater's end: `pre_backward`)
            queue_callback(self._finish)
        return True

    def _set_aside(self, sync: bool) -> None:
        """Before a backward onto reduce-scattered gradients: this rank's shards of their averages set aside,
        for one that averages (`carry_scattered`), else refused."""
        if sync:
            self._carried = carry_scattered(self.store, self.shards)
        else:
            refuse_adding_onto_scattered(self.store)
        self._scattered = False

    def before_backward(self) -> None:
        """Before a backward that may open from a parameter's hook, no output of the model reached (inside its
        forward: Lightning's `manual_backward`): onto reduce-scattered gradients, `_set_aside` now, as `_open`
        decides, before its first gradient lands on them (which `_open` finds too late, and refuses)."""
        if self._scattered and self._task is None:
            self._set_aside(self._hook_opens_averaging())

    def _hook_opens_averaging(self) -> bool:
        """Whether a backward opening from a hook averages: `sync` inside a training forward, else armed."""
        return (self.sync if self._forwards else self._armed) or self._averaging

    def _average(self) -> Round:
        divisor = self._ranks_not_joined()
        self.last_round = Round(self, divisor)  # (and the routed layers write divided where it sums)
        self.store.prescale.start(self._prescale if divisor is None else None)
        return self.last_round

    def _ranks_not_joined(self) -> int | None:
        """The ranks not joined yet, which this backward divides by, under a `Join` that says so
        (`joined_count`, waited for here); else None, or when none joined."""
        if self.joined_count is None:
            return None
        work, count = self.joined_count
        self.joined_count = None
        work.wait()
        ranks = int(count[1])
        return None if ranks == dist.get_world_size(self.process_group) else ranks

    def shadow(self, divisor: int | None) -> None:
        """On a rank that joined (`torch.distributed.algorithms.Join`): the averaging of the backward the
        ranks still training run, with zeros for this rank's gradients, as DDP's join hook does: the same
        round (every bucket in the plan's order, the used flags and step count, the finiteness check) and the
        order agreement after the first one. Unlike DDP's zero buckets, the buffers are this rank's own: it
        ends with the others' averages in `.grad` (and its shards) for a ShardedOptimizer's join hook."""
        store = self.store
        self._scattered = False
        unmark_scattered(store, to_none=True)
        for param in store.params:
            param.grad = None  # (its slot is zeroed at its bucket's launch, as an unused one's)
        store.zero_mains()
        self.last_round = round_ = Round(self, divisor)
        round_.sync_all()
        self._synced(round_)

    def _open(self) -> bool:
        """From an AccumulateGrad hook, when no backward is open (this one reached none of dp's outputs): open
        it, averaging, when a synchronising forward armed it, as DDP's hooks do; inside a training forward (a
        LightningModule's `manual_backward`), when `sync` holds now, as Lightning's DDPStrategy.pre_backward
        prepares DDP's reducer unless inside `no_sync()` (an earlier forward's arming does not count there).
        FlatGrad seated no slot for it (no output pre hook ran), so gradients land in tensors of their own,
        which each bucket takes into its slots before it launches."""
        if self._scattered and holds_scattered(self.store):
            raise RuntimeError(
                "ShardedOptimizer (by element): a backward after a synchronised one and before zero_grad() "
                "reached no output of the model (it runs inside the model's forward, as Lightning's "
                "manual_backward, or its loss is kept on the model), so its first gradients landed on the "
                "reduce-scattered ones before it could set them aside; call zero_grad() between them, run "
                "the earlier backwards under model.no_sync(), or shard by tensor (flatgrad's Lightning "
                "strategies set them aside before each backward)"
            )
        if not self._hook_opens_averaging():
            return False
        _refuse_compiled_autograd()
        # From a hook, maybe a nested backward's: no parameter counts ready before its AccumulateGrad runs.
        return self._begin(True, from_output=False)

    def _on_last_ready(self, grad_inputs: Grads, grad_outputs: Grads) -> None:
        # A parameter of `BucketPlan.last`: nothing to count; only a backward reaching no dp output to open.
        if self._task is None:
            self._open()

    def _on_ready(self, param: nn.Parameter, bucket: Bucket, grad_inputs: Grads, grad_outputs: Grads) -> None:
        # A nested backward (reentrant activation checkpointing) belongs to the open one: same bookkeeping.
        if self._task is None and not self._open():
            return
        if self._task_sync:  # (a synchronising backward always has its round)
            self.last_round.mark_ready(param, bucket)

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
            self.hooks.note_unused(round_, self._plan.last)  # (before the order is learned)
            self._synced(round_)

    def _synced(self, round_: Round) -> None:
        """After a synchronised backward's round (or its shadow on a joined rank), counted in `num_syncs`.
        After the first since a (re)build, rank 0's order of completion becomes the launch order on every rank
        (one broadcast), and the hooks of the last bucket to launch count nothing (the final callback launches
        it). Reduce-scattered, `.grad` refuses math until zeroed (flatgrad._scattered_grad)."""
        plan = self._plan
        if not plan.learned and plan.buckets:
            device = plan.buckets[0].buffer.device
            order = agree_order(round_.completed, len(plan.buckets), device, self.process_group)
            self._plan = plan.learn(order)
            self.hooks.stop_counting(plan.buckets[order[-1]], self._on_last_ready)
        self.num_syncs += 1
        self.store.unsynced = False
        self._scattered = self.reduce_scatter
        if self._scattered:
            mark_scattered(self.store)

    def _resume(self) -> None:
        # The node a nested backward ran in returned, inside the outer backward: finish there.
        self._task = graph_task_id()
        queue_callback(self._finish)


def _refuse_compiled_autograd() -> None:
    if in_compiled_autograd():
        raise RuntimeError(
            "replicate cannot run its bucket hooks under compiled autograd (it refuses "
            "the final callback that launches the last bucket); under compiled autograd use "
            "DDP with torch._dynamo.config.optimize_ddp = 'python_reducer' and "
            "flatgrad.allreduce_hook, or run this backward without compiled autograd"
        )
