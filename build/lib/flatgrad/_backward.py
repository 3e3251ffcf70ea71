"""The backward coordinator: one prehook per output node of a wrapped forward, and one
final callback per backward that calls its participants in a fixed order.

A training forward through `FlatGrad` ends with `watch(output, plan)`. The `ForwardPlan`
binds what that forward decided: the seater of the layout it ran on, whether a DDP
reducer places that backward's gradients (then nothing is seated), and,
when a `DataParallel` made the forward, its bucket sync and whether the forward
synchronised. When a backward first reaches one of the output's nodes the prehook asks
each participant, in this order, to open it: the seater (`Seater.pre_backward`), then
the bucket sync (`BucketSync.pre_backward`). Each answers with what to run at the end of
that backward, or None (a participant dedups by graph task itself: another output of
the same backward opens nothing new, and may upgrade a bucket sync to averaging). What
they return is queued as one final callback, run in the same order: the seater settles
`.grad` first, then the bucket sync launches what is left, waits and settles the used
flags.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flatgrad._seating import output_nodes
from flatgrad._torch_compat import queue_callback


@dataclass(frozen=True)
class ForwardPlan:
    """What one forward decided for the backward through its output."""

    seater: Any  # the `Seater` of the layout the forward ran on (None before any)
    alone: bool  # no DDP reducer places this backward's gradients: seat the unrouted slots
    bucket_sync: Any = None  # the `BucketSync` of the DataParallel that made the forward
    sync: bool = False  # whether that forward synchronised (outside no_sync)


def watch(output: Any, plan: ForwardPlan) -> None:
    """Hook the autograd nodes that made `output` (see `output_nodes`) with one prehook
    each, bound to `plan`."""
    hook = functools.partial(_on_backward, plan)
    for node in output_nodes(output):
        node.register_prehook(hook)


def _on_backward(plan: ForwardPlan, grad_outputs: Any) -> None:
    ends: list[Callable[[], None]] = []
    if plan.seater is not None:
        end = plan.seater.pre_backward(plan.alone)
        if end is not None:
            ends.append(end)
    if plan.bucket_sync is not None:
        end = plan.bucket_sync.pre_backward(plan.sync)
        if end is not None:
            ends.append(end)
    if ends:
        queue_callback(functools.partial(_finish, tuple(ends)))


def _finish(ends: tuple[Callable[[], None], ...]) -> None:
    for end in ends:
        end()
