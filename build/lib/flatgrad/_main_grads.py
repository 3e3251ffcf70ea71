"""Main grads: a float32 slot of a bfloat16/float16 parameter is its gradient while `.grad`
stays None. `MainGrads` holds one store's; `MainGradGuard` (`MAIN_GRAD_GUARD`) makes a
torch optimizer that would skip them raise."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from flatgrad._slot_registry import REGISTRY

if TYPE_CHECKING:
    from flatgrad.buffer import GradStore


class MainGrads:
    """The parameters of one store whose slot is a main grad, and their slots.

    Args:
        params: those parameters.
        views: the store's slot views by ``id(param)`` (shared: the store updates it).
        spans: 1-D views covering their slots (`GradStore.spans`), zeroed by `zero`.
    """

    def __init__(
        self, params: Sequence[torch.nn.Parameter], views: dict[int, torch.Tensor], spans: list[torch.Tensor]
    ) -> None:
        self.params = tuple(params)
        self.ids = frozenset(map(id, self.params))
        self._views = views
        self._spans = spans

    def zero(self) -> None:
        """Zero every main grad (a few fills: adjacent slots share one)."""
        if self._spans:
            torch._foreach_zero_(self._spans)

    def take_in(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Add the low-precision `.grad` of each main-grad parameter among `params` (one that
        arrived through AccumulateGrad) into its main grad and set that `.grad` back to None.

        Returns:
            The others among `params`, in order.
        """
        ids, views = self.ids, self._views
        for param in [p for p in params if id(p) in ids]:
            grad = param.grad
            if grad is not None:
                views[id(param)].add_(grad.to_dense() if grad.is_sparse else grad.detach())
                param.grad = None
        return [p for p in params if id(p) not in ids]


class MainGradGuard:
    """While a store with main grads lives: a torch optimizer step (a global step pre hook,
    `torch.optim.optimizer.register_optimizer_step_pre_hook`) over a parameter whose
    gradient is a main grad and whose `.grad` is None raises, instead of skipping it
    silently. Optimizers that step main grads themselves say so with a true class
    attribute ``steps_main_grads`` (ShardedOptimizer). The hook goes when the last such
    store does; it reads each parameter's `.grad` and, for a None one, the registry."""

    def __init__(self) -> None:
        self._stores: weakref.WeakSet[GradStore] = weakref.WeakSet()
        self._handle: Any = None

    def watch(self, store: GradStore) -> None:
        self._stores.add(store)
        if self._handle is None:
            self._handle = register_optimizer_step_pre_hook(self._check)
        weakref.finalize(store, self._release)

    def _release(self) -> None:
        if self._handle is not None and not self._stores:
            self._handle.remove()
            self._handle = None

    def _check(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if getattr(optimizer, "steps_main_grads", False):
            return
        skipped = 0
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None and param.requires_grad:  # (frozen: skipped, as by stock)
                    store = REGISTRY.owner_of(param)
                    skipped += store is not None and store.is_main(param)
        if skipped:
            raise RuntimeError(
                f"{type(optimizer).__name__}.step() would skip {skipped} bfloat16/float16 "
                "parameter(s) whose gradient is a float32 main grad (grad_dtype='float32': their "
                ".grad stays None): step them with flatgrad.ShardedOptimizer (float32 master "
                "shards, on any number of ranks), or give the optimizer float32 master copies "
                "whose .grad you take from flat.main_grad(param)"
            )


MAIN_GRAD_GUARD = MainGradGuard()
