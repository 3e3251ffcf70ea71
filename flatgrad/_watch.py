"""`LayoutWatch`: tells in O(1) whether a parameter or submodule was registered, replaced or
removed anywhere in the modules one wrapper owns, with no process-wide hook.

Each owned module's ``_parameters`` and ``_modules`` dict is swapped for a `_WatchedDict`,
a `dict` whose writes count a generation on the watches that cover it. Every way
`nn.Module` changes those (``module.weight = p``, `register_parameter`, `add_module`,
``del module.fc``, `torch.nn.utils.parametrize`, ``_apply``'s replacements) writes the dict,
so a forward compares one integer instead of walking the model. Modules the wrapper does
not own keep plain dicts: models built or sliced inside a forward (``self.layers[:n]`` makes
a new `nn.ModuleList`), and every other model in the process, run and compile exactly as
without flatgrad (`torch.nn.modules.module`'s global registration hooks would be traced,
guarded on and re-run by Dynamo in every compiled model).

When the last watch on a module is closed (its wrapper was collected), the module gets a
plain dict back and its routed layers torch's own forward (`unroute`).
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from flatgrad._torch_compat import swap_tensor_code

_WATCHED = ("_parameters", "_modules")
# `torch.func.functional_call` swaps its temporaries into ``_parameters`` for one call
# (`torch.nn.utils.stateless._reparametrize_module`, through `swap_tensor`) and back: not a
# change of the model (its gradients stay local, as under DDP), so not counted.
_TEMPORARY_WRITERS = swap_tensor_code


class LayoutWatch:
    """The registration generation of the modules one wrapper owns (see the module doc)."""

    def __init__(self) -> None:
        self.generation = 0
        self._covered: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        # Containers whose `__delitem__` replaces ``_modules`` as a whole (`nn.Sequential`,
        # `nn.ModuleList`): ``del seq[n:]`` with nothing to delete writes no key, so that
        # replacement is checked for at every forward (a few containers per model).
        self._containers: tuple[nn.Module, ...] = ()

    def changed(self, generation: int) -> bool:
        """Whether something was registered since `generation` (O(containers))."""
        if self.generation != generation:
            return True
        return bool(self._containers) and any(
            type(m.__dict__["_modules"]) is not _WatchedDict for m in self._containers
        )

    def cover(self, model: nn.Module) -> None:
        """Watch every module of `model` (after a registration: the new ones, and those whose
        dict was replaced as a whole, as ``del module_list[i]`` does)."""
        for module in model.modules():
            for attr in _WATCHED:
                watches = _watched_dict(module, attr).watches
                if not any(watch is self for watch in watches):
                    watches.append(self)
            self._covered.add(module)
        self._containers = tuple(m for m in self._covered if hasattr(type(m), "__delitem__"))

    def close(self, unroute: Callable[[nn.Module], None]) -> None:
        """Stop watching; a module no other watch covers gets plain dicts back and is
        handed to `unroute`."""
        for module in list(self._covered):
            alone = True
            for attr in _WATCHED:
                current = module.__dict__.get(attr)
                if isinstance(current, _WatchedDict):
                    current.watches[:] = [w for w in current.watches if w is not self]
                    if current.watches:
                        alone = False
                    else:
                        module.__dict__[attr] = dict(current)
            if alone:
                unroute(module)
        self._covered = weakref.WeakSet()


class _WatchedDict(dict[str, Any]):
    """A module's ``_parameters`` or ``_modules``: every write bumps its watches' generation.
    Copies, deep copies and pickles are plain dicts (nothing of flatgrad's is saved)."""

    __slots__ = ("watches",)
    watches: list[LayoutWatch]

    def _bump(self) -> None:
        for watch in self.watches:
            watch.generation += 1

    def __setitem__(self, key: str, value: Any) -> None:
        if _counted():
            self._bump()
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        if _counted():
            self._bump()
        super().__delitem__(key)

    def __ior__(self, other: Any) -> _WatchedDict:  # type: ignore[misc,override]
        self._bump()
        return super().__ior__(other)  # type: ignore[no-any-return]

    def __reduce__(self) -> tuple[type[dict[Any, Any]], tuple[dict[Any, Any]]]:
        return (dict, (dict(self),))


def _counted() -> bool:
    """Whether the write calling `_WatchedDict` is a change of the model: not one of
    `_TEMPORARY_WRITERS`, and not inside code Dynamo traces (`torch.func.functional_call`
    under torch.compile; a frame read would break the graph)."""
    return not torch.compiler.is_compiling() and sys._getframe(2).f_code not in _TEMPORARY_WRITERS


def _bumping(name: str) -> Any:
    method = getattr(dict, name)

    @functools.wraps(method)
    def bumped(self: _WatchedDict, *args: Any, **kwargs: Any) -> Any:
        self._bump()
        return method(self, *args, **kwargs)

    return bumped


for _name in ("pop", "popitem", "clear", "update", "setdefault"):
    setattr(_WatchedDict, _name, _bumping(_name))


def _watched_dict(module: nn.Module, attr: str) -> _WatchedDict:
    """The module's `attr` dict as a `_WatchedDict` (swapped in once, the same items)."""
    current = module.__dict__[attr]
    if isinstance(current, _WatchedDict):
        return current
    watched = _WatchedDict(current)
    watched.watches = []
    module.__dict__[attr] = watched
    return watched


def is_watched(modules: Iterable[nn.Module]) -> bool:
    """Whether any of `modules` still has a watched dict (for tests)."""
    return any(isinstance(m.__dict__.get(attr), _WatchedDict) for m in modules for attr in _WATCHED)
