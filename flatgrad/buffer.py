"""The flat gradient buffers and the table that maps each parameter to its slot."""

from __future__ import annotations

from collections.abc import Sequence

import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from flatgrad.layout import GroupKey, SlotSpec, plan_layout


class GradStore:
    """One zero-initialised 1-D tensor per (dtype, device) group, and each parameter's slot.

    Views are created fresh on every request and never cached: AccumulateGrad only steals
    a gradient (instead of cloning it) when nothing else holds a reference to it.
    """

    # Which live store owns each parameter, so that a Function given only the weight
    # (`gather_with_index_add`, a routed layer) finds its slot. Weak both ways: a dropped
    # wrapper leaves nothing behind.
    _owners: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __init__(self, params: Sequence[torch.nn.Parameter], align_bytes: int) -> None:
        self.params = tuple(params)
        for param in self.params:
            if GradStore.owner_of(param) is not None:
                raise ValueError(
                    f"a parameter of shape {tuple(param.shape)} is already wrapped by another "
                    "FlatGrad; a parameter's gradient can live in one flat buffer only"
                )
        self.buffers: dict[GroupKey, torch.Tensor] = {}
        self._slots: dict[torch.Tensor, tuple[GroupKey, SlotSpec]] = {}
        for key, group in plan_layout(self.params, align_bytes).items():
            self.buffers[key] = _aligned_zeros(group.numel, key, align_bytes)
            for index, slot in zip(group.param_indices, group.slots):
                self._slots[self.params[index]] = (key, slot)
        for param in self.params:
            GradStore._owners[param] = weakref.ref(self)

    @staticmethod
    def owner_of(param: torch.Tensor) -> GradStore | None:
        """The store holding `param`'s slot, if any."""
        ref = GradStore._owners.get(param)
        return ref() if ref is not None else None

    def release(self) -> None:
        """Stop owning the parameters (before a rebuild replaces this store)."""
        for param in self.params:
            if GradStore.owner_of(param) is self:
                del GradStore._owners[param]

    def __contains__(self, param: object) -> bool:
        return isinstance(param, torch.Tensor) and param in self._slots

    def view(self, param: torch.Tensor) -> torch.Tensor:
        """A fresh view of `param`'s slot, shaped and strided like the parameter."""
        key, slot = self._slots[param]
        buffer = self.buffers[key]
        return buffer.as_strided(slot.shape, slot.stride, buffer.storage_offset() + slot.offset)

    def flat_view(self, param: torch.Tensor) -> torch.Tensor:
        """`param`'s slot as a 1-D view."""
        key, slot = self._slots[param]
        return self.buffers[key].narrow(0, slot.offset, slot.numel)

    def holds(self, param: torch.Tensor, grad: torch.Tensor | None) -> bool:
        """Whether `grad` is exactly `param`'s slot (same memory, shape and strides)."""
        if grad is None:
            return False
        key, slot = self._slots[param]
        buffer = self.buffers[key]
        return (
            grad.device == buffer.device
            and grad.dtype == buffer.dtype
            and grad.data_ptr() == buffer.data_ptr() + slot.offset * buffer.element_size()
            and grad.shape == slot.shape
            and grad.stride() == slot.stride
        )

    def adopt(self, buffer: torch.Tensor, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> bool:
        """Make `buffer` (a DDP bucket) the flat buffer of its group, with `grads[i]` (views
        of it) as the slot of `params[i]`. Refused (False) unless the bucket holds exactly
        the group's parameters: a group split over several buckets is not one buffer."""
        key = (buffer.dtype, buffer.device)
        group = [p for p in self.params if self._slots[p][0] == key]
        if len(params) != len(group) or {id(p) for p in params} != {id(p) for p in group}:
            return False
        base = buffer.storage_offset()
        for param, grad in zip(params, grads):
            slot = SlotSpec(grad.storage_offset() - base, grad.numel(), tuple(grad.shape), grad.stride())
            self._slots[param] = (key, slot)
        self.buffers[key] = buffer
        return True

    def settle(self) -> None:
        """Make the buffers the truth: zero the slots of parameters whose `.grad` is None
        (stale values must not reach a norm or a sync) and move any `.grad` that lives
        elsewhere (assigned by the user, or produced with create_graph=True) into its slot."""
        for param in self.params:
            grad = param.grad
            if grad is None:
                self.flat_view(param).zero_()
            elif not self.holds(param, grad):
                view = self.view(param)
                view.copy_(grad.detach())
                param.grad = view


def _aligned_zeros(numel: int, key: GroupKey, align_bytes: int) -> torch.Tensor:
    """A zeroed 1-D tensor whose first element sits on an `align_bytes` boundary."""
    dtype, device = key
    buffer = torch.zeros(numel, dtype=dtype, device=device)
    misalignment = buffer.data_ptr() % align_bytes
    if misalignment == 0:
        return buffer
    itemsize = buffer.element_size()
    raw = torch.zeros(numel + align_bytes // itemsize, dtype=dtype, device=device)
    start = (-raw.data_ptr() % align_bytes) // itemsize
    return raw.narrow(0, start, numel)
