"""`TransparentWrapper`: a `PlainNames` wrapper that is also read, written and loaded as
the plain model: its attributes, its ``config`` and its `load_state_dict`.

Libraries handed the wrapped model (transformers' `Trainer`, accelerate, peft) read, call and
set its attributes as on the plain one: ``flat.generate``, ``flat.accepts_loss_kwargs``,
``flat.gradient_checkpointing_enable()``, ``flat.config``, ``flat.fc``. One rule
(`_forwarded`) decides reads and writes, so a value written through the wrapper is the one
read back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from flatgrad._names import PlainNames
from flatgrad.config import FlatGradConfig

# Model methods that generic per-module walkers call on every module they meet
# (``m.reset_parameters()`` if ``hasattr(m, "reset_parameters")``, as torch's meta-device
# materialisation does): through the wrapper they would reach the model twice.
_NOT_FORWARDED = frozenset({"reset_parameters"})
# Private attributes that libraries set on the model they are handed and read back from the
# module they give DDP: `DDP._set_params_and_buffers_to_ignore_for_model(model, names)`
# (names are the plain model's, which DDP(flat) walks).
_FORWARDED_PRIVATE = frozenset({"_ddp_params_and_buffers_to_ignore"})


def _forwarded(wrapper: nn.Module, model: nn.Module, name: str) -> bool:
    """Whether `name`, not the wrapper's own, is read and written on the wrapped `model`:
    a public attribute the model has and the wrapper's class does not."""
    return (
        not name.startswith("_")
        and name not in _NOT_FORWARDED
        and not hasattr(type(wrapper), name)
        and hasattr(model, name)
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

    def __setattr__(self, name: str, value: Any) -> None:
        inner = self.__dict__.get("_modules", {}).get("module")
        if (
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
