"""The base of `DataParallel`, which is the plain model to whoever walks it: `PlainNames`,
a wrapper that holds one model as ``module`` and adds no name to it.

Every walk over the wrapper gives the plain model's names: `named_children` (which
transformers' `Trainer` recurses to name parameters for weight decay, and
torch.distributed.checkpoint to key state), `named_modules`, `named_parameters`,
`named_buffers`, `get_submodule` and ``state_dict``. A walker that recurses
`named_children` and reads each module's own ``_parameters`` finds the model's root-level
parameters on the wrapper: it shares the model's root ``_parameters``, ``_buffers`` and
``_non_persistent_buffers_set`` (the same dict objects, so a parameter registered on either
is on both), and has no state of its own.

nn.Module's own recursion (`train`, `apply`, `_apply`: ``.to()``, ``.double()``) goes
through ``children()``, which are the model's children here, so it would skip the model's
root: here it goes through the model instead, which is reached exactly once, with its own
overrides."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

_ROOT_STATE = ("_parameters", "_buffers", "_non_persistent_buffers_set")


def share_root(wrapper: nn.Module) -> None:
    """Take the model's root ``_parameters``, ``_buffers`` and non-persistent set as the
    wrapper's own (the same objects); called once ``module`` is set, and again whenever the
    model's root dicts were replaced."""
    inner = wrapper.__dict__["_modules"]["module"]
    wrapper.__dict__.update({key: inner.__dict__[key] for key in _ROOT_STATE})


class PlainNames(nn.Module):
    """Base of `DataParallel`: walked, they name everything as the plain model does."""

    def _share_root(self) -> None:
        share_root(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._share_root()  # one pickled before the wrapper shared the root shares it now

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            # A child of the model under its plain name (``dp.fc``), as the getattr walks of
            # `nn.Module.get_submodule` on a module holding the wrapper resolve it.
            inner = self.__dict__.get("_modules", {}).get("module")
            while isinstance(inner, PlainNames):
                inner = inner.__dict__["_modules"]["module"]
            if inner is None or name not in inner._modules:
                raise
            return inner._modules[name]

    @property
    def _inner(self) -> nn.Module:
        inner: nn.Module = self.__dict__["_modules"]["module"]
        return inner

    @property
    def _plain_model(self) -> nn.Module:
        """The model whose names this wrapper gives (through any wrappers in between)."""
        inner = self._inner
        return inner._plain_model if isinstance(inner, PlainNames) else inner

    # --- walking: the plain model's names --------------------------------------------------

    def named_children(self) -> Iterator[tuple[str, nn.Module]]:
        """The model's children under their own names (not ``module``)."""
        return self._plain_model.named_children()

    def named_modules(
        self, memo: set[nn.Module] | None = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Module]]:
        """The wrapper, then the model's modules under their own names (the model itself
        under the wrapper's name). A module holding the wrapper names its parameters as if it
        held the plain model (``DDP(flat).named_parameters()`` gives ``module.fc.weight``, as
        ``DDP(model)`` does), which is what torch.distributed.checkpoint keys optimizer state
        by, and what DDP's ``parameters_to_ignore`` names are matched against."""
        return named_modules_through(self, memo, prefix, remove_duplicate)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The model's parameters under their own names, as in `state_dict`; so optimizer
        checkpoints keyed by name (torch.distributed.checkpoint) match the plain model's, and
        ``flat.<name>`` resolves each of them. Not recursing: the model's root-level ones."""
        if not recurse:
            return super().named_parameters(prefix, recurse, remove_duplicate)
        return self._plain_model.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's buffers under their own names, like `named_parameters`."""
        if not recurse:
            return super().named_buffers(prefix, recurse, remove_duplicate)
        return self._plain_model.named_buffers(prefix, recurse, remove_duplicate)

    def get_submodule(self, target: str) -> nn.Module:
        """The model's submodule named `target` as in the plain model (peft finds the
        layers it replaces this way); failing that, the wrapper's own path
        (``module.<name>``, which `torch.func.functional_call` may be given)."""
        if not target:
            return self
        try:
            return self._plain_model.get_submodule(target)
        except AttributeError:
            return super().get_submodule(target)

    def add_module(self, name: str, module: nn.Module | None) -> None:
        """A child name of the model is replaced on the model: walkers that rebuild a model
        from `named_children` (`nn.SyncBatchNorm.convert_sync_batchnorm`) put it back there."""
        plain = self._plain_model
        if name in plain._modules:
            plain.add_module(name, module)
        else:
            super().add_module(name, module)

    def _fqn_modifiers(self) -> dict[str, str]:
        """For torch.distributed.checkpoint.state_dict: a plain-model name at the top is
        looked up on the model (even a child called ``module``), and the alias it goes
        through is no child name, so DCP's walk over `named_children` keeps every prefix."""
        plain = self._plain_model
        return dict.fromkeys([*plain._modules, *plain._parameters, *plain._buffers], "_plain_model")

    # --- nn.Module's recursion through children(): through the model instead -----------

    def train(self, mode: bool = True) -> PlainNames:
        if not isinstance(mode, bool):
            raise ValueError(f"training mode must be a bool, got {type(mode).__name__}")
        self.training = mode
        self._inner.train(mode)
        return self

    def apply(self, fn: Callable[[nn.Module], None]) -> PlainNames:
        """`fn` on every module of the model (each once, the model itself included), then on
        the wrapper, as `nn.Module.apply` on a wrapper holding the model as a child."""
        self._inner.apply(fn)
        fn(self)
        return self

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> PlainNames:
        # The shared root tensors are the model's: converted once, by the model.
        self._inner._apply(fn, recurse)
        return self

    # --- state_dict: the model's keys; the wrapper saves and loads nothing itself --------

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        pass  # the shared root entries are saved by the model

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # Only the pre-hooks (FlatGrad's renames the keys for the model below): the shared
        # root entries are loaded by the model, once.
        for hook in self._load_state_dict_pre_hooks.values():
            hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)


def named_modules_through(
    wrapper: PlainNames, memo: set[nn.Module] | None, prefix: str, remove_duplicate: bool
) -> Iterator[tuple[str, nn.Module]]:
    """`nn.Module.named_modules` of a wrapper that adds no name: the wrapper under
    `prefix`, then its ``module``'s modules under the same prefix."""
    if memo is None:
        memo = set()
    if remove_duplicate:
        if wrapper in memo:
            return
        memo.add(wrapper)
    yield prefix, wrapper
    yield from wrapper._inner.named_modules(memo, prefix, remove_duplicate)


# --- state_dict keys: the plain model's, in both directions --------------------------------

_PREFIX = "module."


def _rekey(mapping: dict[str, Any], old: str, new: str, root: str | None = None) -> None:
    """Rename keys starting with `old` to start with `new` (all at once: no clashes);
    `root`, if given, is a key equal to `old` without its dot, renamed to `new[:-1]`."""
    moved = {k: mapping.pop(k) for k in [k for k in mapping if k.startswith(old) or k == root]}
    for key, value in moved.items():
        mapping[new[:-1] if key == root else new + key[len(old) :]] = value


def add_prefix(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any], *args: Any
) -> None:
    """Before loading: ``<prefix>x`` -> ``<prefix>module.x`` (every key: FlatGrad has no
    state of its own, and a child of the model may itself be called "module")."""
    _rekey(state_dict, prefix, prefix + _PREFIX)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        _rekey(metadata, prefix, prefix + _PREFIX, root=prefix[:-1])
