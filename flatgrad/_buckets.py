"""Buckets and rounds: the static buckets cut from a store's flat buffers, and the `Round`
of one synchronised backward over them (readiness, in-order launches, the wait and the
settling of `.grad`). `flatgrad._bucketing.BucketSync` decides which backwards average."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flatgrad.buffer import GradStore, host_tensor
from flatgrad.comm import launch_average, settle_unused
from flatgrad.layout import GroupKey

_FIRST_BUCKET_MB = 1.0  # a small first bucket starts communication early, as in DDP


@dataclass
class Bucket:
    """One contiguous piece of a flat buffer and the parameters whose slots it holds."""

    index: int
    buffer: torch.Tensor  # a narrow view of the flat buffer
    params: tuple[nn.Parameter, ...]
    # The last bucket of a group also carries the group's used flags (`GradStore.flagged`:
    # they follow the buffer in memory), so the all-reduce that averages it tells which
    # parameters some rank used.
    flags_of: GroupKey | None = None


class Round:
    """One synchronised backward's averaging: which parameters are ready, which bucket
    launches next, each bucket's collective, and the used flags that travel with them. Made
    when such a backward opens (and at a rebuild), replaced by the next one; its timings are
    the last synchronised backward's."""

    def __init__(
        self,
        buckets: list[Bucket],
        store: GradStore | None,
        process_group: dist.ProcessGroup | None,
        wire_dtype: torch.dtype | None,
        scatter: bool,
        check_finite: Callable[[], dict[int, str]] | None = None,
    ) -> None:
        self.buckets = buckets
        self.store = store
        self.process_group, self.wire_dtype, self.scatter = process_group, wire_dtype, scatter
        # With `check_finite` (the parameters' names, asked for only to raise): per launched
        # bucket, whether its local gradients were all finite (a device tensor, no sync).
        self.check_finite = check_finite
        self.finite: list[torch.Tensor] = []
        self.pending = [len(bucket.params) for bucket in self.buckets]
        self.work: list[Any] = [None] * len(self.buckets)
        self.wire: list[torch.Tensor | None] = [None] * len(self.buckets)
        self.sent: list[torch.Tensor | None] = [None] * len(self.buckets)  # what each collective ran on
        self.ready: set[int] = set()
        # (flags, their parameters): carried by the last bucket of each group, or by one
        # small all-reduce of their own (see `sync_all`).
        self.flagged: list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = []
        self.next = 0  # the next bucket to launch
        # perf_counter seconds: when each bucket was launched, relative to the backward's
        # start; how long the final callback waited for communication after the backward's
        # compute had ended (exposed communication); the backward's start to that end.
        self.started = time.perf_counter()
        self.launch_offsets_s: list[float] = []
        self.exposed_s = 0.0
        self.backward_s = 0.0

    def mark_ready(self, param: nn.Parameter, bucket: Bucket) -> None:
        if id(param) in self.ready:
            raise RuntimeError(
                "a parameter's gradient became final twice in one backward (a reentrant "
                "activation checkpoint using it both inside and outside the checkpointed "
                "function); use torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
            )
        self.ready.add(id(param))
        self.pending[bucket.index] -= 1
        if not self.pending[bucket.index]:
            self.launch_ready()

    def launch_ready(self, flush: bool = False) -> None:
        """Launch buckets in order while the next one is complete (or, on flush, all)."""
        while self.next < len(self.buckets):
            bucket = self.buckets[self.next]
            if self.pending[bucket.index] and not flush:
                return
            # Zero the slots of parameters without a `.grad` (unused, or whose AccumulateGrad
            # ran with an undefined gradient): the slot may still hold an earlier step's
            # values. Move in any `.grad` that lives outside its slot.
            self.store.take_in(bucket.params, zero_empty=True)  # type: ignore[union-attr]
            self._launch(bucket)
            self.launch_offsets_s.append(time.perf_counter() - self.started)
            self.next += 1

    def _launch(self, bucket: Bucket) -> None:
        sent = bucket.buffer
        if bucket.flags_of is not None and not self.scatter:
            # Every parameter of the group is final now: its buckets launch in order, this
            # is the last, and an earlier one with a parameter not ready waits for the flush.
            found = self.store.flagged(bucket.flags_of)  # type: ignore[union-attr]
            if found is not None:
                raw, flags, members = found
                start = bucket.buffer.storage_offset() - raw.storage_offset()
                sent = raw.narrow(0, start, raw.numel() - start)
                self.flagged.append((flags, members))
        if self.check_finite is not None:
            self.finite.append(torch.isfinite(bucket.buffer).all())
        i = bucket.index
        self.work[i], self.wire[i] = launch_average(sent, self.process_group, self.wire_dtype, self.scatter)
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
        self.launch_ready(flush=True)  # first: the flags below are made while it runs
        # Groups whose flags did not travel with their last bucket (reduce-scatter, a buffer
        # without room for them): one small all-reduce of theirs.
        carried = {id(p) for _, members in self.flagged for p in members}
        rest = tuple(p for p in store.params if id(p) not in carried)
        used_work = None
        if rest:
            ready = self.ready
            used = host_tensor(
                [id(p) in ready or p.grad is not None for p in rest], torch.uint8, rest[0].device
            )
            used_work = dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.process_group, async_op=True)
            self.flagged.append((used, rest))
        nonfinite = self._launch_finite_check(store) if self.check_finite is not None else None
        for work, wire, sent in zip(self.work, self.wire, self.sent):
            work.wait()
            if wire is not None:
                sent.copy_(wire)  # type: ignore[union-attr]
        if used_work is not None:
            used_work.wait()
        self.exposed_s = time.perf_counter() - compute_done
        settle_unused(store, self.flagged)
        if nonfinite is not None:
            self._raise_if_nonfinite(*nonfinite)

    def _launch_finite_check(self, store: GradStore) -> tuple[torch.Tensor, Any]:
        """Which ranks had a non-finite local gradient: one small all-reduce of a flag per
        rank, launched with the buckets', so every rank learns it (and raises) together."""
        device = next(iter(store.buffers.values())).device
        ranks = torch.zeros(dist.get_world_size(self.process_group), dtype=torch.int32, device=device)
        if self.finite:
            ranks[dist.get_rank(self.process_group)] = (~torch.stack(self.finite)).any().to(torch.int32)
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
                for bucket, finite in zip(self.buckets, self.finite)
                if not bool(finite)
                for p in bucket.params
                if p.grad is not None and not bool(torch.isfinite(p.grad).all())
            ]
            where = f"rank {rank} (this rank) in {local[:8]}" + (
                f", and rank(s) {bad}" if len(bad) > 1 else ""
            )
        raise RuntimeError(
            f"DataParallel(check_finite=True): a non-finite gradient (NaN or inf) before averaging on "
            f"{where}; this step's gradients are not usable: skip it (zero_grad) or stop"
        )


def cut_buckets(store: GradStore, bucket_mb: float) -> list[Bucket]:
    """Buckets per buffer, cut at slot boundaries in buffer order: the first about
    `_FIRST_BUCKET_MB`, the others about `bucket_mb`."""
    buckets: list[Bucket] = []
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
                    Bucket(
                        len(buckets), buffer.narrow(0, start, end - start), tuple(members), flags_of=flags_of
                    )
                )
                start, members = end, []
                cap = int(bucket_mb * 2**20) // buffer.element_size()
    return buckets
