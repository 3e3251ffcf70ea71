"""`SlotRegistry` (`REGISTRY`): which live `GradStore` owns each parameter, so that a layer
backward given only the weight finds its slot."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from flatgrad.buffer import GradStore


class SlotRegistry:
    """Which live store owns each parameter, by id, so that a backward given only the weight
    finds its slot. A store keeps its parameters alive, so their ids are not reused while
    its entries stand; they go with `GradStore.release` or when the store is collected. No
    weak reference to a parameter (that would block torch.utils.swap_tensors)."""

    def __init__(self) -> None:
        self._owners: dict[int, weakref.ref[GradStore]] = {}

    def check_free(self, params: Sequence[torch.Tensor]) -> None:
        for param in params:
            if self.owner_of(param) is not None:
                raise ValueError(
                    f"a parameter of shape {tuple(param.shape)} is already wrapped by another "
                    "FlatGrad; a parameter's gradient can live in one flat buffer only"
                )

    def claim(self, store: GradStore) -> None:
        me = weakref.ref(store)
        ids = [id(param) for param in store.params]
        for param_id in ids:
            self._owners[param_id] = me
        weakref.finalize(store, self.forget, me, ids)

    def forget(self, store: weakref.ref[GradStore], ids: list[int]) -> None:
        for param_id in ids:
            if self._owners.get(param_id) == store:
                del self._owners[param_id]

    def owner_of(self, param: torch.Tensor) -> GradStore | None:
        """The live store holding `param`'s slot, if any."""
        ref = self._owners.get(id(param))
        store = ref() if ref is not None else None
        return store if store is not None and param in store else None

    def find(self, param: torch.Tensor) -> tuple[GradStore, torch.Tensor] | None:
        """(live store, slot view) of `param`, if any: `owner_of` and the view in one lookup
        (for the layer backwards). A store keeps its parameters alive, so an id it holds
        is not reused while it stands."""
        ref = self._owners.get(id(param))
        store = ref() if ref is not None else None
        if store is None:
            return None
        view = store.views.get(id(param))
        return None if view is None else (store, view)


REGISTRY = SlotRegistry()
