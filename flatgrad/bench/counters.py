"""What a training step costs besides time: the ops it dispatches, counted as they run
(printing nothing), and the tensors it holds."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch < 2.5: the private module only
    from torch.distributed._tensor import DTensor  # type: ignore[no-redef]
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that move a whole gradient from one tensor into another: AccumulateGrad's clone or
# add, DDP's copy into its bucket (mul_out, or copy_ under a comm hook) and back out.
COPY_OPS = frozenset(
    {"aten::copy_", "aten::clone", "aten::mul", "aten::mul_", "aten::add_", "aten::add", "aten::_to_copy"}
)
# Dispatcher namespaces of collectives: ProcessGroup's ops and the functional collectives.
COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional"})


@dataclass(frozen=True)
class StepCounts:
    """Per-step counts from one counted step."""

    collectives: int
    grad_copies: int


class OpCounter(TorchDispatchMode):
    """While active, counts collectives and gradient-sized copies as the dispatcher runs them.

    It sees every op below autograd, the backward's included: on CPU the engine runs a
    backward on the thread that called it, and its device threads (CUDA) take the calling
    thread's dispatch modes from the graph task. Unlike `torch.profiler` it prints nothing
    (torch 2.13's profiler prints two ``USDT`` lines per profiled region).

    A copy is a call of an op in `COPY_OPS` with a tensor argument shaped like one of
    `weight_shapes`; a ``_foreach_`` form of such an op counts once per list position holding
    such a tensor (the per-tensor calls its CPU fallback makes, which the profiler lists).
    Only calls from outside an op are seen: a clone or ``_to_copy`` counts once, where the
    profiler also lists the ``copy_`` it runs inside (and, in the CPU fallback of
    ``_foreach_mul_`` by scalars, a ``mul`` beside each ``mul_``).
    A collective is an op of `COLLECTIVE_NAMESPACES` other than a barrier or a wait.
    """

    def __init__(self, weight_shapes: Iterable[tuple[int, ...]]) -> None:
        super().__init__()
        self.weight_shapes = frozenset(tuple(s) for s in weight_shapes)
        self.collectives = 0
        self.grad_copies = 0
        self._lock = threading.Lock()  # backward may run on autograd's device threads

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Collection[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        collectives, copies = self._classify(func, args, kwargs)
        if collectives or copies:
            with self._lock:
                self.collectives += collectives
                self.grad_copies += copies
        return func(*args, **kwargs)

    def _classify(
        self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[int, int]:
        """(collectives, copies) one call adds."""
        name = func.name().split(".", 1)[0]
        namespace, _, op = name.partition("::")
        if namespace in COLLECTIVE_NAMESPACES:
            return int("barrier" not in op and "wait" not in op), 0
        inputs = [*args, *kwargs.values()]
        if name in COPY_OPS:
            return 0, int(any(self._weight_sized(t) for t in inputs))
        if op.startswith("_foreach_") and f"{namespace}::{op[len('_foreach_') :]}" in COPY_OPS:
            lists = [a for a in inputs if isinstance(a, (list, tuple)) and a]
            per_position = zip(*(a for a in lists if all(isinstance(t, torch.Tensor) for t in a)))
            return 0, sum(any(self._weight_sized(t) for t in tensors) for tensors in per_position)
        return 0, 0

    def _weight_sized(self, value: object) -> bool:
        return isinstance(value, torch.Tensor) and tuple(value.shape) in self.weight_shapes


def weight_shapes(params: Iterable[nn.Parameter]) -> set[tuple[int, ...]]:
    """Shapes of the trainable weights (dim >= 2): elementwise work on activations and
    biases does not count as a gradient copy (the benchmark models keep activations from
    sharing a weight's shape)."""
    return {tuple(p.shape) for p in params if p.requires_grad and p.dim() >= 2}


def count_step(step: Callable[[], object], params: Iterable[nn.Parameter]) -> StepCounts:
    """Run `step` once under an `OpCounter` for the weights of `params` and return its
    collectives and gradient-sized copies."""
    with OpCounter(weight_shapes(params)) as counter:
        step()
    return StepCounts(counter.collectives, counter.grad_copies)


def grad_bytes(params: Iterable[nn.Parameter], extra_buffers: Iterable[torch.Tensor] = ()) -> int:
    """Bytes this rank holds for gradients: the distinct storages behind `.grad` (a DTensor's:
    its local shard's, as FSDP2 keeps them after its reduce-scatter), plus buffers that
    hold gradients elsewhere (DDP's buckets when `.grad` is not a view of them)."""
    grads = [p.grad for p in params if p.grad is not None]
    return storage_bytes({"grads": grads})["grads"] + sum(b.numel() * b.element_size() for b in extra_buffers)


def storage_bytes(roles: Mapping[str, Iterable[torch.Tensor]]) -> dict[str, int]:
    """Bytes of the distinct storages behind each role's tensors (whole storages: a view
    counts what it keeps alive), each storage once, in the first role that holds it (so
    that a gradient that views its bucket, or a shard that views its parameter buffer, is
    not counted twice). A DTensor counts its local shard.
    """
    seen: set[int] = set()
    held = {}
    for role, tensors in roles.items():
        held[role] = 0
        for tensor in tensors:
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            storage = local.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                held[role] += storage.nbytes()
    return held
