"""Where each gradient lives: grouping by (dtype, device), order, alignment and offsets.

Pure bookkeeping: reads shapes, strides and dtypes, allocates nothing."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

GroupKey = tuple[torch.dtype, torch.device]


@dataclass(frozen=True)
class SlotSpec:
    """One parameter's place in its group's buffer (offsets and sizes in elements)."""

    offset: int
    numel: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True)
class GroupLayout:
    """All slots of one (dtype, device) group; `slots[i]` belongs to `param_indices[i]`."""

    numel: int
    param_indices: tuple[int, ...]
    slots: tuple[SlotSpec, ...]


def dense_stride(param: torch.Tensor) -> tuple[int, ...]:
    """A gradient's strides (AccumulateGrad's layout contract): the parameter's if dense and non-overlapping,
    else contiguous. `empty_like` applies that rule, allocating nothing on the meta device."""
    return tuple(torch.empty_like(param, device="meta").stride())


_LOW_PRECISION = (torch.bfloat16, torch.float16)


def slot_dtype(dtype: torch.dtype, grad_dtype: str | None) -> torch.dtype:
    """The dtype of the gradient slot of a `dtype` parameter: float32 for a bfloat16 or
    float16 parameter when `grad_dtype` is ``"float32"`` (its main grad), else `dtype`."""
    if grad_dtype == "float32" and dtype in _LOW_PRECISION:
        return torch.float32
    return dtype


def align_elements(align_bytes: int, element_size: int) -> int:
    """Alignment in elements of a dtype (at least one element)."""
    return max(1, align_bytes // element_size)


def plan_layout(
    params: Sequence[torch.Tensor], align_bytes: int, multiple: int = 1, grad_dtype: str | None = None
) -> dict[GroupKey, GroupLayout]:
    """Group `params` by (dtype, device) and give each an aligned slot.

    Slots follow the reverse of `params`' order (registration order), roughly backward's gradient order, so a
    bucket fills front to back. Each slot starts on a multiple of `multiple` elements (a sharded optimizer
    passes the world size: any run of whole slots splits into equal shards). A parameter's group dtype is its
    slot's (`slot_dtype`: float32 main grads for bfloat16/float16 ones with `grad_dtype`)."""
    members: dict[GroupKey, list[int]] = {}
    for index in reversed(range(len(params))):
        param = params[index]
        members.setdefault((slot_dtype(param.dtype, grad_dtype), param.device), []).append(index)
    layouts = {}
    for key, indices in members.items():
        align = math.lcm(align_elements(align_bytes, key[0].itemsize), multiple)
        offset, slots = 0, []
        for index in indices:
            param = params[index]
            shape = tuple(param.shape)
            slots.append(SlotSpec(offset, param.numel(), shape, dense_stride(param)))
            offset += -(-param.numel() // align) * align
        layouts[key] = GroupLayout(offset, tuple(indices), tuple(slots))
    return layouts


def merge_touching(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """[start, end) intervals in order, each one that starts where the one before it ends
    merged into that one: the slot runs, spans and shard pieces over a buffer."""
    merged: list[tuple[int, int]] = []
    for start, end in intervals:
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def overlap(start: int, end: int, lo: int, hi: int) -> tuple[int, int] | None:
    """The part of [start, end) inside [lo, hi), or None where they do not overlap."""
    a, b = max(start, lo), min(end, hi)
    return (a, b) if a < b else None
