"""The flat gradient buffers and the table that maps each parameter to its slot."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flatgrad.layout import GroupKey, SlotSpec, plan_layout


@dataclass(frozen=True)
class _Entry:
    key: GroupKey
    slot: SlotSpec
    view: torch.Tensor  # the slot, shaped and strided like the parameter; becomes its .grad


class GradStore:
    """One zero-initialised 1-D tensor per (dtype, device) group, and each parameter's slot.

    Each slot has one view, made once: it is what `.grad` is set to, so "is `.grad` the
    slot?" is an identity test on the hot path. Nothing relies on AccumulateGrad stealing a
    tensor (which would need the view to have no other reference): flatgrad sets `.grad`.
    """

    # Which live store owns each parameter, by id, so that a backward given only the weight
    # finds its slot. A store keeps its parameters alive, so their ids are not reused while
    # its entries stand; they go with `release()` or when the store is collected. No weak
    # reference to a parameter (that would block torch.utils.swap_tensors).
    _owners: dict[int, weakref.ref[GradStore]] = {}

    def __init__(self, params: Sequence[torch.nn.Parameter], align_bytes: int) -> None:
        self.params = tuple(params)
        for param in self.params:
            if GradStore.owner_of(param) is not None:
                raise ValueError(
                    f"a parameter of shape {tuple(param.shape)} is already wrapped by another "
                    "FlatGrad; a parameter's gradient can live in one flat buffer only"
                )
        self.buffers: dict[GroupKey, torch.Tensor] = {}
        self._entries: dict[torch.Tensor, _Entry] = {}
        for key, group in plan_layout(self.params, align_bytes).items():
            self.buffers[key] = _aligned_zeros(group.numel, key, align_bytes)
            for index, slot in zip(group.param_indices, group.slots):
                self._set_slot(self.params[index], key, slot)
        me = weakref.ref(self)
        ids = [id(param) for param in self.params]
        for param_id in ids:
            GradStore._owners[param_id] = me
        weakref.finalize(self, _forget, me, ids)

    def _set_slot(self, param: torch.Tensor, key: GroupKey, slot: SlotSpec) -> None:
        buffer = self.buffers[key]
        view = buffer.as_strided(slot.shape, slot.stride, buffer.storage_offset() + slot.offset)
        self._entries[param] = _Entry(key, slot, view)

    @staticmethod
    def owner_of(param: torch.Tensor) -> GradStore | None:
        """The live store holding `param`'s slot, if any."""
        ref = GradStore._owners.get(id(param))
        store = ref() if ref is not None else None
        return store if store is not None and param in store._entries else None

    def release(self) -> None:
        """Stop owning the parameters (before a rebuild replaces this store)."""
        _forget(weakref.ref(self), [id(param) for param in self.params])

    def __contains__(self, param: object) -> bool:
        return isinstance(param, torch.Tensor) and param in self._entries

    def view(self, param: torch.Tensor) -> torch.Tensor:
        """`param`'s slot, shaped and strided like the parameter (always the same tensor)."""
        return self._entries[param].view

    def slot(self, param: torch.Tensor) -> tuple[GroupKey, SlotSpec]:
        """`param`'s group key and slot (offset and size in elements within that buffer)."""
        entry = self._entries[param]
        return entry.key, entry.slot

    def flat_view(self, param: torch.Tensor) -> torch.Tensor:
        """`param`'s slot as a 1-D view."""
        entry = self._entries[param]
        return self.buffers[entry.key].narrow(0, entry.slot.offset, entry.slot.numel)

    def holds(self, param: torch.Tensor, grad: torch.Tensor | None) -> bool:
        """Whether `grad` is exactly `param`'s slot (same memory, shape and strides)."""
        if grad is None:
            return False
        view = self._entries[param].view
        return grad is view or (
            grad.device == view.device
            and grad.dtype == view.dtype
            and grad.data_ptr() == view.data_ptr()
            and grad.shape == view.shape
            and grad.stride() == view.stride()
        )

    def place(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """Copy `grad` into `param`'s slot and make the slot its `.grad`; returns the slot."""
        slot = self._entries[param].view
        slot.copy_(grad.to_dense() if grad.is_sparse else grad.detach())
        param.grad = slot
        return slot

    def adopt(
        self, buffer: torch.Tensor, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
    ) -> bool:
        """Make `buffer` (a DDP bucket) the flat buffer of its group, with `grads[i]` (views
        of it) as the slot of `params[i]`. Refused (False) unless the bucket holds exactly
        the group's parameters: a group split over several buckets is not one buffer."""
        key = (buffer.dtype, buffer.device)
        group = [p for p in self.params if self._entries[p].key == key]
        if len(params) != len(group) or {id(p) for p in params} != {id(p) for p in group}:
            return False
        self.buffers[key] = buffer
        base = int(buffer.storage_offset())
        for param, grad in zip(params, grads):
            slot = SlotSpec(int(grad.storage_offset()) - base, grad.numel(), tuple(grad.shape), grad.stride())
            self._set_slot(param, key, slot)
            if param.grad is not None:
                param.grad = self._entries[param].view  # same memory, now our view object
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
                self.place(param, grad)


def _forget(store: weakref.ref[GradStore], ids: list[int]) -> None:
    for param_id in ids:
        if GradStore._owners.get(param_id) == store:
            del GradStore._owners[param_id]


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
