"""Buckets and rounds: the static buckets cut from a store's flat buffers, the `LaunchPlan`
that orders their launches, and the `Round` of one synchronised backward over them
(readiness, launches in the plan's order, the wait and the settling of `.grad`).
`flatgrad._bucketing.BucketSync` decides which backwards average."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flatgrad.buffer import GradStore, host_tensor, read_here
from flatgrad.comm import average_op, launch_average, reduce_scatters, settle_unused
from flatgrad.layout import GroupKey

_FIRST_BUCKET_MB = 1.0  # a small first bucket starts communication early, as in DDP
_SUMMED = (torch.float32, torch.float64)  # summed whole and divided after (see `Round`)


@dataclass
class Bucket:
    """One contiguous piece of a flat buffer and the parameters whose slots it holds."""

    index: int
    buffer: torch.Tensor  # a narrow view of the flat buffer
    params: tuple[nn.Parameter, ...]
    key: GroupKey
    # Whether it ends its group's buffer: the group's used flags follow it in memory
    # (`GradStore.flagged`), so the all-reduce that averages it may carry them too.
    ends_buffer: bool = False
    # The prescaled parameters of its last launch, and its other slots' spans (`_prescale`).
    unscaled: tuple[frozenset[int], list[torch.Tensor]] | None = None


@dataclass(frozen=True)
class LaunchPlan:
    """The order the buckets launch in, the same on every rank (collectives must be issued
    in one order everywhere), and the buckets that carry their group's used flags.

    Buffer order until a synchronised backward has been seen (`learned` False); then rank
    0's order of completion in that backward (`agree_order`), so that a model whose
    gradients become final in another order than its buffer's, or whose early buckets wait
    for an unused parameter, still launches its buckets while backward goes on."""

    order: tuple[int, ...]
    # A group's flags ride on its last bucket to launch, which launches once every gradient
    # of the group is final, when that bucket also ends the buffer (the flags follow it in
    # memory); otherwise `Round.sync_all` sends them in a small all-reduce of their own.
    carriers: frozenset[int]
    learned: bool = False


def plan_launches(buckets: Sequence[Bucket], order: Sequence[int] | None = None) -> LaunchPlan:
    """The plan that launches `buckets` in `order` (buffer order when None, not learned)."""
    ordered = tuple(range(len(buckets)) if order is None else order)
    last: dict[GroupKey, Bucket] = {}
    for index in ordered:
        last[buckets[index].key] = buckets[index]
    carriers = frozenset(bucket.index for bucket in last.values() if bucket.ends_buffer)
    return LaunchPlan(ordered, carriers, learned=order is not None)


def agree_order(
    completed: Sequence[int], num_buckets: int, device: torch.device, process_group: dist.ProcessGroup | None
) -> list[int]:
    """Rank 0's order of bucket completion in its last backward, on every rank (one small
    broadcast): the buckets in the order they completed, then those that never did (a
    parameter unused there) in buffer order."""
    seen = set(completed)
    order = [*completed, *(index for index in range(num_buckets) if index not in seen)]
    agreed = host_tensor(order, torch.int64, device)  # (pinned on CUDA: no pageable copy)
    source = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    dist.broadcast(agreed, src=source, group=process_group)
    return [int(index) for index in agreed.tolist()]


def _current_streams(buckets: Sequence[Bucket]) -> dict[torch.device, Any]:
    """The current stream of each CUDA device the buckets live on (a round opens on the
    forward's: an output's pre hook runs there); empty off CUDA."""
    cuda = {bucket.buffer.device for bucket in buckets if bucket.buffer.is_cuda}
    return {device: torch.cuda.current_stream(device) for device in cuda}


class Round:
    """One synchronised backward's averaging: which parameters are ready, which bucket
    launches next (in the plan's order), each bucket's collective, and the used flags that
    travel with them. Made when such a backward opens (and at a rebuild), replaced by the
    next one; its timings are the last synchronised backward's."""

    def __init__(
        self,
        buckets: list[Bucket],
        plan: LaunchPlan,
        store: GradStore | None,
        process_group: dist.ProcessGroup | None,
        wire_dtype: torch.dtype | None,
        scatter: bool,
        check_finite: Callable[[], dict[int, str]] | None = None,
        shards: Sequence[torch.Tensor] = (),
        divisor: int | None = None,
        step_count: int | None = None,
    ) -> None:
        self.buckets, self.plan, self.store = buckets, plan, store
        self.process_group, self.wire_dtype, self.scatter = process_group, wire_dtype, scatter
        # The ranks a `Join` averages over when not the world size (its joined ranks send
        # zeros: `BucketSync.shadow`), and the steps a ShardedOptimizer took before this
        # backward, which every rank checks against the others' (`_check_round`).
        self.divisor, self.step_count = divisor, step_count
        # The used flags may ride with a bucket unless it is reduce-scattered (each rank
        # would get only its part of them), or a step count must ride with them (bytes
        # compared by MAX: see `_check_round`).
        self.carries_flags = not (scatter and reduce_scatters(process_group)) and step_count is None
        self.world_size = dist.get_world_size(process_group)
        summed = _sums_then_divides(self, check_finite is None)
        self.divide_after = [s for s in shards if s.dtype in _SUMMED] if summed else []
        # With `check_finite` (the parameters' names, asked for only to raise): per launched
        # bucket, whether its local gradients were all finite (a device tensor, no sync).
        self.check_finite = check_finite
        self.finite: list[torch.Tensor] = []
        self.streams = _current_streams(buckets)  # the backward's (see `_follow_backward`)
        self.pending = [len(bucket.params) for bucket in self.buckets]
        self.work: list[Any] = [None] * len(self.buckets)
        self.wire: list[torch.Tensor | None] = [None] * len(self.buckets)
        self.sent: list[torch.Tensor | None] = [None] * len(self.buckets)  # what each collective ran on
        self.ready: set[int] = set()  # the parameters whose AccumulateGrad ran
        # The parameters the engine said this backward will not reach (`skip`): ready from
        # its start, and unused unless some rank used them.
        self.unreached: set[int] = set()
        # Whether every gradient final in this backward is counted (not so in a round made
        # in the middle of one: `BucketSync._upgrade`); only such a round tells which
        # parameters the model leaves unused.
        self.counts_all = True
        self.completed: list[int] = []  # the buckets, in the order they became complete
        # (flags, their parameters): carried by the plan's carriers, or by one small
        # all-reduce of their own (see `sync_all`).
        self.flagged: list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = []
        self.next = 0  # the position in the plan's order of the next bucket to launch
        self.launched: list[Bucket] = []
        self.launched_in_backward = 0  # launched before the final callback flushed the rest
        # perf_counter seconds (host time): when each bucket was launched, relative to the
        # backward's start; how long the final callback spent in the waits after the
        # backward's compute had ended (exposed communication; about 0 on NCCL, whose waits
        # do not block the host); the backward's start to that end.
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
        pending, index = self.pending, bucket.index  # (`_count`, inline: once per parameter)
        pending[index] -= 1
        if not pending[index]:
            self.completed.append(index)
            self.launch_ready()

    def skip(self, unreached: Sequence[tuple[nn.Parameter, Bucket]]) -> None:
        """At the backward's start: count ready the parameters it will not reach (their
        AccumulateGrad does not run), as DDP with find_unused_parameters=True does, so that
        their buckets launch once their other gradients are final."""
        for param, bucket in unreached:
            self.unreached.add(id(param))
            self._count(bucket, launch=False)
        self.launch_ready()

    def _count(self, bucket: Bucket, launch: bool = True) -> None:
        self.pending[bucket.index] -= 1
        if not self.pending[bucket.index]:
            self.completed.append(bucket.index)
            if launch:
                self.launch_ready()

    def _reached_late(self, key: int, bucket: Bucket) -> None:
        # The engine said the backward would not reach this parameter, and a nested
        # backward (a reentrant activation checkpoint) did: fine while its bucket waits.
        self.unreached.discard(key)
        if self.sent[bucket.index] is not None:
            raise RuntimeError(
                "DataParallel: a parameter unused in an earlier step got its gradient from a "
                "nested backward (a reentrant activation checkpoint) after its bucket was "
                "averaged; use torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
            )

    def launch_ready(self, flush: bool = False) -> None:
        """Launch buckets in the plan's order while the next one is complete (or, on
        flush, all)."""
        order = self.plan.order
        while self.next < len(order):
            bucket = self.buckets[order[self.next]]
            if self.pending[bucket.index] and not flush:
                return
            if bucket.buffer.is_cuda:
                self._follow_backward(bucket.buffer.device)
            # Zero the slots of parameters without a `.grad` (unused, or whose AccumulateGrad
            # ran with an undefined gradient): the slot may still hold an earlier step's
            # values. Move in any `.grad` that lives outside its slot.
            self.store.take_in(bucket.params, zero_empty=True)  # type: ignore[union-attr]
            self._launch(bucket)
            self.launched.append(bucket)
            self.launch_offsets_s.append(time.perf_counter() - self.started)
            self.next += 1

    def _follow_backward(self, device: torch.device) -> bool:
        """Make the current stream wait for the backward's on `device`; whether it had to.
        A routed layer writes its slot on the stream of its forward and hands AccumulateGrad
        no gradient, so the engine orders nothing after that write; the AccumulateGrad hooks
        that launch most buckets run on the stream their nodes were made on (DataParallel
        keeps them from its construction). Trained on another stream than it was built on, a
        launch would otherwise read slots still being written."""
        stream = self.streams.get(device)
        current = torch.cuda.current_stream(device)
        if stream is None or stream == current:
            return False
        current.wait_stream(stream)
        return True

    def _launch(self, bucket: Bucket) -> None:
        sent = bucket.buffer
        if bucket.index in self.plan.carriers and self.carries_flags:
            # Every parameter of the group is final now: its buckets launch in the plan's
            # order, this is the last, and one before it with a parameter not ready waits
            # for the flush.
            found = self.store.flagged(bucket.key)  # type: ignore[union-attr]
            if found is not None:
                raw, flags, members = found
                start = bucket.buffer.storage_offset() - raw.storage_offset()
                sent = raw.narrow(0, start, raw.numel() - start)
                self.flagged.append((flags, members))
        if self.check_finite is not None:
            self.finite.append(torch.isfinite(bucket.buffer).all())
        i, divide = bucket.index, not (self.divide_after and sent.dtype in _SUMMED)
        if divide_unscaled(bucket, self.store, self.world_size):  # type: ignore[arg-type]
            divide = False  # (the routed slots were written divided: `flatgrad._prescale`)
        group, wire_dtype, scatter = self.process_group, self.wire_dtype, self.scatter
        self.work[i], self.wire[i] = launch_average(sent, group, wire_dtype, scatter, divide, self.divisor)
        self.sent[i] = sent

    def wait_launched(self) -> None:
        for work in self.work:
            if work is not None:
                work.wait()

    def sync_all(self) -> None:
        """Launch the rest, wait, and settle `.grad` like stock DDP with
        find_unused_parameters=True (a parameter no rank used keeps `.grad` None)."""
        store = self.store
        assert store is not None, "DataParallel is not built"
        compute_done = time.perf_counter()
        self.backward_s = compute_done - self.started
        self.launched_in_backward = self.next
        self.launch_ready(flush=True)  # first: the flags below are made while it runs
        # Groups whose flags did not travel with a bucket (reduce-scatter, a buffer without
        # room for them, a last bucket to launch that does not end the buffer): one small
        # all-reduce of theirs.
        carried = {id(p) for _, members in self.flagged for p in members}
        rest = tuple(p for p in store.params if id(p) not in carried)
        used_work = None
        if rest or self.step_count is not None:
            # Used as the flags riding with a bucket say it (`GradStore.flagged`): a `.grad` (an
            # AccumulateGrad run with no gradient leaves None; so DDP counts it), or a main grad.
            flags = [p.grad is not None or store.is_main(p) for p in rest]
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
        """Raise on every rank unless every rank took as many optimizer steps before this
        backward (the bytes of `_round_bytes`, reduced by MAX: equal exactly when the
        largest count equals the smallest). A rank that ran no forward and backward on an
        empty batch but stepped pairs this backward with the others' previous one; its next
        collectives (the parameter gathers of the others' step) would not match in size, and
        gloo aborts the process from its own thread."""
        high, low = (int(v) for v in seen.tolist())
        if high == 255 - low:
            return
        rank = dist.get_rank(self.process_group)
        raise RuntimeError(
            f"DataParallel: the ranks disagree on the round: rank {rank} runs the backward after "
            f"{step_count % 256} optimizer steps, while the ranks' counts range from {255 - low} "
            f"to {high} (modulo 256): a rank stepped without the forward and backward of the others "
            "(an empty batch?). Every rank must run the same synchronised backwards and steps; for "
            "uneven data per rank, wrap the loop in "
            "`with torch.distributed.algorithms.Join([dp, opt]):`"
        )

    def _launch_finite_check(self, store: GradStore) -> tuple[torch.Tensor, Any]:
        """Which ranks had a non-finite local gradient: one small all-reduce of a flag per
        rank, launched with the buckets', so every rank learns it (and raises) together."""
        device = next(iter(store.buffers.values())).device
        ranks = torch.zeros(dist.get_world_size(self.process_group), dtype=torch.int32, device=device)
        if self.finite:
            finite = torch.stack([read_here(flag) for flag in self.finite])
            ranks[dist.get_rank(self.process_group)] = (~finite).any().to(torch.int32)
        return ranks, dist.all_reduce(ranks, group=self.process_group, async_op=True)

    def _raise_if_nonfinite(self, ranks: torch.Tensor, work: Any) -> None:
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
                for bucket, finite in zip(self.launched, self.finite)
                if not bool(finite)
                for p in bucket.params
                if not _finite(self.store, p)  # type: ignore[arg-type]
            ]
            where = f"rank {rank} (this rank) in {local[:8]}" + (
                f", and rank(s) {bad}" if len(bad) > 1 else ""
            )
        raise RuntimeError(
            f"DataParallel(check_finite=True): a non-finite gradient (NaN or inf) before averaging on "
            f"{where}; this step's gradients are not usable: skip it (zero_grad) or stop"
        )


def _sums_then_divides(round_: Round, no_finite_check: bool) -> bool:
    """Whether a ShardedOptimizer's all-reduced (gloo) float32/float64 buckets are summed and
    only its shards (all it reads) divided once everything arrived: 1/world_size of a pass.
    Only for a power-of-two world size (dividing by it is exact: DDP's result to the bit, but
    for sums beyond the float range and subnormal addends) and no Join divisor. Half
    precision divides first, so that its sums stay finite; so does `check_finite` (`.grad`
    stays readable)."""
    world_size = round_.world_size
    exact = world_size > 1 and world_size & (world_size - 1) == 0  # (1: no division)
    exact = exact and round_.divisor in (None, world_size)
    scatter, group = round_.scatter, round_.process_group
    return scatter and round_.wire_dtype is None and exact and no_finite_check and not reduce_scatters(group)


def _round_bytes(count: int) -> list[int]:
    """`count` modulo 256 and its complement to 255, as bytes: a MAX all-reduce of them gives
    the largest count and 255 minus the smallest."""
    low = count % 256
    return [low, 255 - low]


def _finite(store: GradStore, param: nn.Parameter) -> bool:
    """Whether `param`'s gradient as the sync left it is finite: its main grad (`.grad` stays
    None for those), else its `.grad` (None: nothing to blame)."""
    grad = store.view(param) if store.is_main(param) else param.grad
    return grad is None or bool(torch.isfinite(grad).all())


def divide_unscaled(bucket: Bucket, store: GradStore, world_size: int) -> bool:
    """Before `bucket`'s sum: divide its slots the routed layers did not write scaled
    (`flatgrad._prescale`), in few fills (the spans of the rest are kept on the bucket while
    the scaled set stays the same); False when none was, and the whole bucket is to be
    divided as usual. (The used flags after it need no division: a sum of 0s and 1s is 0
    only if all are.)"""
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
    store: GradStore, process_group: dist.ProcessGroup | None, scatter: bool, wire_dtype: torch.dtype | None
) -> float | None:
    """1 / world size where `store`'s buckets are averaged by a sum the routed layers may
    divide for (`flatgrad._prescale`): every buffer summed (gloo), a power-of-two world size
    (exact), no wire dtype, all-reduced (not a ShardedOptimizer's); None elsewhere."""
    world = dist.get_world_size(process_group)
    if scatter or wire_dtype is not None or world < 2 or world & (world - 1):
        return None
    return 1 / world if all(average_op(b, process_group)[1] for b in store.buffers.values()) else None


def cores_to_spare(process_group: dist.ProcessGroup | None) -> bool:
    """Whether this host has a core that the ranks' compute threads leave free: torch's
    intra-op threads times the ranks on the host (``LOCAL_WORLD_SIZE``, set by torchrun;
    without it, the group's size) below the cores this process may run on."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        cores = os.cpu_count() or 1
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    ranks = int(local) if local.isdigit() else dist.get_world_size(process_group)
    return torch.get_num_threads() * ranks < cores


def cut_buckets(store: GradStore, bucket_mb: float, small_first_on_cpu: bool = True) -> list[Bucket]:
    """Buckets per buffer, cut at slot boundaries in buffer order: the first about
    `_FIRST_BUCKET_MB`, the others about `bucket_mb`.

    A CPU buffer is averaged by gloo on a thread of its own, which competes with the
    backward for the cores when none is free (`small_first_on_cpu` False: see
    `cores_to_spare`; torchrun's default of one thread per rank on as many cores as ranks).
    There a collective costs about 0.7 ms of the step by itself (2 gloo ranks on 2 cores),
    more than an early 1 MiB bucket hides, while an early bucket of 12.9 MiB (recommender)
    hides more than it costs: its first bucket is half a bucket (12.5 MiB by default; never
    below 1 MiB), so a buffer up to that size is one bucket."""
    buckets: list[Bucket] = []
    for key, buffer in store.buffers.items():
        slots = sorted(
            ((store.slot(p)[1].offset, p) for p in store.params if store.slot(p)[0] == key),
            key=lambda item: item[0],
        )
        busy_cpu = not small_first_on_cpu and buffer.device.type == "cpu"
        first_mb = max(_FIRST_BUCKET_MB, bucket_mb / 2) if busy_cpu else _FIRST_BUCKET_MB
        cap = int(min(first_mb, bucket_mb) * 2**20) // buffer.element_size()
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
                cap = int(bucket_mb * 2**20) // buffer.element_size()
    return buckets
