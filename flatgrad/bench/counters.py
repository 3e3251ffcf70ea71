"""What a training step costs besides time, read off `torch.profiler` and the tensors."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

# Ops that move a whole gradient from one tensor into another: AccumulateGrad's clone or
# add, DDP's copy into its bucket (mul_out, or copy_ under a comm hook) and back out.
COPY_OPS = frozenset(
    {"aten::copy_", "aten::clone", "aten::mul", "aten::mul_", "aten::add_", "aten::add", "aten::_to_copy"}
)


@dataclass(frozen=True)
class StepCounts:
    """Per-step counts from one profiled step."""

    collectives: int
    grad_copies: int


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null for the block: torch's profiler (Kineto) prints
    two ``USDT ... profiler_start/stop`` lines per profiled region from C++, hundreds per
    bench run, with no setting to silence them. An exception still propagates and is
    reported after the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _is_collective(name: str) -> bool:
    return name.startswith("c10d::") and "barrier" not in name


def count_step(step: Callable[[], object], params: Iterable[nn.Parameter]) -> StepCounts:
    """Profile one call of `step` and count collectives and gradient-sized copies.

    A copy is an op from `COPY_OPS` whose inputs include a tensor shaped like a trainable
    weight (dim >= 2), so elementwise work on activations and biases is not counted;
    the benchmark models keep activations from sharing a weight's shape.
    """
    shapes = {tuple(p.shape) for p in params if p.requires_grad and p.dim() >= 2}
    with _quiet_stderr(), torch.profiler.profile(record_shapes=True) as prof:
        step()
    collectives = copies = 0
    for event in prof.events():
        if _is_collective(event.name):
            collectives += 1
        elif event.name in COPY_OPS and any(tuple(s) in shapes for s in event.input_shapes if s):
            copies += 1
    return StepCounts(collectives, copies)


def grad_bytes(params: Iterable[nn.Parameter], extra_buffers: Iterable[torch.Tensor] = ()) -> int:
    """Bytes held for gradients: the distinct storages behind `.grad`, plus buffers that
    hold gradients elsewhere (DDP's buckets when `.grad` is not a view of them)."""
    storages: dict[int, int] = {}
    for param in params:
        if param.grad is not None:
            storage = param.grad.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()) + sum(b.numel() * b.element_size() for b in extra_buffers)
