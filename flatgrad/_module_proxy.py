"""The bases of flatgrad's wrappers, which are the plain model to whoever walks, reads or
loads them: `PlainNames` (names) and `TransparentWrapper` (attributes, ``config``, loading).

`PlainNames`: a wrapper that holds one model as ``module`` and adds no name to it.

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
overrides.

`TransparentWrapper`: a `PlainNames` wrapper that is also read, written and loaded as
the plain model: its attributes, its ``config`` and its `load_state_dict`.

Libraries handed the wrapped model (transformers' `Trainer`, accelerate, peft) read, call and
set its attributes as on the plain one: ``flat.generate``, ``flat.accepts_loss_kwargs``,
``flat.gradient_checkpointing_enable()``, ``flat.config``, ``flat.fc``. One rule
(`_forwarded`) decides reads and writes, so a value written through the wrapper is the one
read back."""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from flatgrad.config import FlatGradConfig

_ROOT_STATE = ("_parameters", "_buffers", "_non_persistent_buffers_set")


def share_root(wrapper: nn.Module) -> None:
    """Take the model's root ``_parameters``, ``_buffers`` and non-persistent set as the
    wrapper's own (the same objects); called once ``module`` is set, and again whenever the
    model's root dicts were replaced (`flatgrad._watch` swaps them)."""
    inner = wrapper.__dict__["_modules"]["module"]
    wrapper.__dict__.update({key: inner.__dict__[key] for key in _ROOT_STATE})


class PlainNames(nn.Module):
    """Base of `FlatGrad` and `DataParallel`: walked, they name everything as the plain model does."""

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


def strip_prefix(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any]
) -> None:
    """After `state_dict()`: ``<prefix>module.x`` -> ``<prefix>x``, so the keys (and the
    version metadata) are the plain model's, also under ``DDP(flat)``."""
    _rekey(state_dict, prefix + _PREFIX, prefix)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        metadata.pop(prefix[:-1], None)  # FlatGrad's own entry; the model's root takes its key
        _rekey(metadata, prefix + _PREFIX, prefix, root=prefix + _PREFIX[:-1])


def add_prefix(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any], *args: Any
) -> None:
    """Before loading: ``<prefix>x`` -> ``<prefix>module.x`` (every key: FlatGrad has no
    state of its own, and a child of the model may itself be called "module")."""
    _rekey(state_dict, prefix, prefix + _PREFIX)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        _rekey(metadata, prefix, prefix + _PREFIX, root=prefix[:-1])


# Model methods that generic per-module walkers call on every module they meet
# (``m.reset_parameters()`` if ``hasattr(m, "reset_parameters")``, as torch's meta-device
# materialisation does): through the wrapper they would reach the model twice.
_NOT_FORWARDED = frozenset({"reset_parameters"})
# Private attributes that libraries read or set on the model they are handed: DDP reads
# `_ddp_params_and_buffers_to_ignore` back from the module it is given
# (`DDP._set_params_and_buffers_to_ignore_for_model(model, names)`, names that DDP(flat) walks
# as the plain model's); transformers' `Trainer` reads `_keys_to_ignore_on_save` when a
# checkpoint it resumes from lacks keys (a tied LM head, which `save_pretrained` leaves out).
_FORWARDED_PRIVATE = frozenset({"_ddp_params_and_buffers_to_ignore", "_keys_to_ignore_on_save"})


def _forwarded(wrapper: nn.Module, model: nn.Module, name: str) -> bool:
    """Whether `name`, not the wrapper's own, is read and written on the wrapped `model`:
    a public attribute the model has and the wrapper's class does not."""
    return (
        not name.startswith("_")
        and name not in _NOT_FORWARDED
        and not hasattr(type(wrapper), name)
        and hasattr(model, name)
    )


def sign_forward(wrapper: nn.Module) -> None:
    """Make ``wrapper.forward`` report the wrapped model's forward signature to `inspect`.

    ``wrapper.forward`` becomes a ``functools.partial`` in the instance ``__dict__`` (as a
    routed layer's forward is) that calls the class's forward on `wrapper`, with
    ``__signature__`` set to ``inspect.signature(model.forward)``, taken now (and again when
    ``module`` is set or the wrapper is unpickled): callers that choose arguments by the
    forward's signature (transformers' `Trainer` keeps only the dataset columns it names)
    see the plain model's. Calls are unchanged: nn.Module's hooks around the wrapper's
    forward; its ``__func__`` is the class's forward, as a bound method's. The partial
    holds the wrapper by weak reference, so dropping the wrapper frees it at once, as
    before. A model forward without a signature (a C function) leaves the class's
    ``(*args, **kwargs)``. Code that rewraps ``forward.__func__`` (Accelerate's mixed
    precision) gets the class's signature from then on; Trainer reads it before that.
    """
    wrapper.__dict__.pop("forward", None)
    try:
        signature = inspect.signature(wrapper.__dict__["_modules"]["module"].forward)
    except (TypeError, ValueError):  # no signature to give
        return
    forward = functools.partial(_forward_of, weakref.ref(wrapper))
    forward.__signature__ = signature  # type: ignore[attr-defined]
    # As a bound method's: code that rewraps a module's forward takes ``forward.__func__``
    # and binds its wrapper to the module again (Accelerate's mixed precision does, and
    # `unwrap_model(..., keep_fp32_wrapper=False)` undoes it so); the function is the class's.
    forward.__func__ = type(wrapper).forward  # type: ignore[attr-defined]
    wrapper.__dict__["forward"] = forward


# Skipped by Dynamo as the wrapper's own forward is (the frame only): under
# torch.compile(wrapper) tracing starts where that forward hands the model to Dynamo.
@torch.compiler.disable(recursive=False)
def _forward_of(ref: weakref.ReferenceType[nn.Module], *args: Any, **kwargs: Any) -> Any:
    wrapper = ref()
    assert wrapper is not None  # called through the wrapper, which is alive
    return type(wrapper).forward(wrapper, *args, **kwargs)


def _is_signed_forward(wrapper: nn.Module, forward: object) -> bool:
    return (
        isinstance(forward, functools.partial)
        and forward.func is _forward_of
        and forward.args[0]() is wrapper
    )


class TransparentWrapper(PlainNames):
    """Base of `FlatGrad`: ``flat.<name>`` is ``flat.module.<name>`` for the model's
    parameters, buffers, children and the public attributes the wrapper has none of its
    own, and `load_state_dict` is the model's."""

    flatgrad_config: FlatGradConfig  # the wrapper's own config, set by the subclass

    @property
    def config(self) -> Any:
        """The wrapped model's ``config`` where it has one (a transformers model's, which
        `Trainer`, accelerate and peft read and write through the model they are given);
        otherwise this wrapper's `FlatGradConfig`, which `flatgrad_config` always is."""
        inner = self.__dict__.get("_modules", {}).get("module")
        if inner is not None and hasattr(inner, "config"):
            return inner.config
        return self.flatgrad_config

    @config.setter
    def config(self, value: Any) -> None:
        inner = self.__dict__.get("_modules", {}).get("module")
        if inner is None or not hasattr(inner, "config"):
            raise AttributeError(
                "FlatGrad's own config is fixed when wrapping (flatgrad_config); "
                "wrap the model again to change it"
            )
        inner.config = value

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is None or not (
                name in _FORWARDED_PRIVATE
                or name in inner._modules
                or name in inner._parameters
                or name in inner._buffers
                or _forwarded(self, inner, name)
            ):
                raise
            # A plain-model name (``flat.fc`` is ``flat.module.fc``), or a public attribute
            # of the model (see `_forwarded`).
            return getattr(inner, name)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if _is_signed_forward(self, state.get("forward")):
            del state["forward"]  # a partial of this wrapper: made again by `__setstate__`
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if "forward" not in self.__dict__:
            sign_forward(self)

    def __setattr__(self, name: str, value: Any) -> None:
        inner = self.__dict__.get("_modules", {}).get("module")
        if name == "module" and isinstance(value, nn.Module):
            super().__setattr__(name, value)
            sign_forward(self)
        elif (
            inner is None
            or name in self.__dict__
            or name.startswith("_")
            or hasattr(type(self), name)
            or not (
                name in inner._parameters
                or name in inner._buffers
                or name in inner._modules
                or _forwarded(self, inner, name)
            )
        ):
            super().__setattr__(name, value)
        elif (
            name in inner._parameters
            and isinstance(value, torch.Tensor)
            and not isinstance(value, nn.Parameter)
        ):
            # torch.func.functional_call(flat, {"<top-level name>": tensor}) swaps a plain tensor
            # in for the model's parameter, as it does on the plain model
            inner._parameters[name] = value  # type: ignore[assignment]
        else:
            setattr(inner, name, value)  # a plain-model name: ``flat.w = ...`` is ``flat.module.w = ...``

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """The wrapped model's `load_state_dict`: same keys, and errors that name them as
        the plain model does. (Nested in another module, e.g. ``DDP(flat)``, the keys go
        through a pre-hook that adds the ``module.`` prefix.)

        Args:
            state_dict: The plain model's keys (no ``module.`` prefix) and values.
            strict: Whether the keys must match the model's exactly, as in torch.
            assign: Whether to assign the given tensors instead of copying into the existing
                ones, as in torch.

        Returns:
            torch's ``(missing_keys, unexpected_keys)`` named tuple.

        Raises:
            RuntimeError: As torch's own: a key is missing or unexpected (with
                ``strict=True``), or a tensor's shape differs from the parameter's or buffer's.
        """
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
