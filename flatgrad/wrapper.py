"""`FlatGrad`: wraps a model so that all its gradients live in flat per-(dtype, device) buffers."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flatgrad import comm, functional
from flatgrad.buffer import GradStore
from flatgrad.config import FlatGradConfig, resolve_config
from flatgrad.layout import GroupKey

logger = logging.getLogger(__name__)

_PREFIX = "module."


class FlatGrad(nn.Module):
    """Wraps `model`; every trainable parameter's `.grad` lives in `grad_buffers`.

    Linear and Embedding layers (those that keep torch's own `forward`) run their backward
    through Functions that write weight gradients straight into the buffer; every other
    parameter's gradient is placed there by a pre-hook on its AccumulateGrad node.
    """

    def __init__(
        self,
        model: nn.Module,
        config: FlatGradConfig | dict[str, Any] | str | Path | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        super().__init__()
        self.config = resolve_config(config)
        self.module = model
        self._store: GradStore | None = None
        self._hooks: list[Any] = []  # handles of the AccumulateGrad pre-hooks
        self._grad_accumulators: list[Any] = []
        self._watched: tuple[tuple[nn.Module, str, nn.Parameter, bool, torch.dtype, torch.device], ...] = ()
        if not _trainable_parameters(model):
            raise ValueError("model must have at least one parameter with requires_grad=True, got none")
        self._build()
        _route_layers(model, self.config)  # after the checks above: a refused wrap changes nothing
        self.register_state_dict_post_hook(_strip_prefix)
        self.register_load_state_dict_pre_hook(_add_prefix)
        logger.info("flatgrad: %s", self._summary())

    def __getstate__(self) -> dict[str, Any]:
        # Autograd nodes and hook handles do not copy or pickle; `__setstate__` rebuilds them.
        state = self.__dict__.copy()
        state.update(_store=None, _hooks=[], _grad_accumulators=[], _watched=())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._build()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._checked_store()  # rebuilds if parameters changed since the last build
        return self.module(*args, **kwargs)

    @property
    def grad_buffers(self) -> dict[GroupKey, torch.Tensor]:
        """The flat gradient buffers, one per (dtype, device); every `.grad` is a view of one."""
        return dict(self._checked_store().buffers)

    # --- building and re-building ---------------------------------------------------------

    def _build(self) -> None:
        """Lay out the buffers for the current trainable parameters and hook them."""
        params = _trainable_parameters(self.module)
        if self._store is not None:
            self._store.release()
        for handle in self._hooks:  # a graph still alive must not write into old buffers
            handle.remove()
        self._store = store = GradStore(params, self.config.align_bytes)
        self._hooks = []
        self._grad_accumulators = []  # a parameter holds its AccumulateGrad node only weakly
        for param in params:
            accumulator: Any = param.view_as(param).grad_fn.next_functions[0][0]  # type: ignore[union-attr]
            self._hooks.append(accumulator.register_prehook(functools.partial(_place_incoming, store, param)))
            self._grad_accumulators.append(accumulator)
        self._watched = tuple(
            (module, name, param, param.requires_grad, param.dtype, param.device)
            for module in self.module.modules()
            for name, param in module._parameters.items()
            if param is not None
        )
        store.settle()  # move gradients that already exist into the buffers

    def _remove_placement_hooks(self) -> None:
        """Once DDP's bucket is the buffer, DDP's reducer copies a fresh gradient of an
        unrouted parameter into it (in C++) and rebinds `.grad`: the pre-hooks, which do the
        same in Python, only cost time. A rebuild registers them again."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _parameters_changed(self) -> bool:
        """Whether a parameter was replaced, converted or (un)frozen since the last build
        (e.g. `model.fc.weight = ...`, `model.load_state_dict(..., assign=True)`)."""
        for module, name, param, requires_grad, dtype, device in self._watched:
            current = module._parameters.get(name)
            if (
                current is not param
                or current.requires_grad != requires_grad
                or current.dtype != dtype
                or current.device != device
            ):
                return True
        return False

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> FlatGrad:
        # .to(), .double(), .half(), .cuda() ... convert parameters and their .grad out of
        # the buffers; lay the buffers out again for the new dtypes/devices.
        super()._apply(fn, recurse)
        if getattr(self, "_store", None) is not None:
            self._build()
        return self

    def _checked_store(self) -> GradStore:
        """The store, rebuilt first if the model's parameters changed behind the wrapper."""
        if self._parameters_changed():
            logger.info("flatgrad: parameters changed after wrapping; laying out the buffers again")
            self._build()
        assert self._store is not None, "FlatGrad is not built"
        return self._store

    def _summary(self) -> str:
        buffers = self._checked_store().buffers
        parts = [
            f"{key[0]}@{key[1]}: {buf.numel()} elements, {buf.numel() * buf.element_size()} bytes"
            for key, buf in buffers.items()
        ]
        num_params = len(self._checked_store().params)
        return f"{len(buffers)} buffer(s) for {num_params} parameters ({'; '.join(parts)})"

    # --- flat-buffer operations -----------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Like `nn.Module.zero_grad`; with set_to_none=False it is one fill per buffer."""
        store = self._checked_store()
        if set_to_none:
            for param in store.params:
                param.grad = None
            return
        for param in store.params:
            if param.grad is not None and not store.holds(param, param.grad):
                param.grad = store.view(param)
        for buffer in store.buffers.values():
            buffer.zero_()

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of all gradients together, as `torch.nn.utils.clip_grad_norm_` computes it:
        one `vector_norm` per buffer. Parameters whose `.grad` is None count as absent."""
        norm_type = _check_norm_type(norm_type)
        store = self._checked_store()
        store.settle()
        norms = [torch.linalg.vector_norm(buf, norm_type) for buf in store.buffers.values()]
        if not norms:  # every parameter frozen since wrapping
            return torch.zeros(())
        if len(norms) == 1:
            return norms[0]
        first = norms[0].device
        return torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), norm_type)

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Same result as `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`: scales
        every buffer in place by ``min(1, max_norm / (total_norm + 1e-6))``."""
        total = self.grad_norm(norm_type)
        if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
            raise RuntimeError(
                f"the total norm of order {norm_type} of the gradients is non-finite, so it "
                "cannot be clipped; pass error_if_nonfinite=False to clip anyway"
            )
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        for buffer in self._checked_store().buffers.values():
            buffer.mul_(coef.to(buffer.device))
        return total

    # --- synchronisation (the communication itself lives in flatgrad.comm) --------------

    def all_reduce_grads(self, process_group: Any = None, wire_dtype: torch.dtype | None = None) -> None:
        """Without DDP: average all gradients over `process_group` (default: the world),
        one all-reduce per buffer. Call it after backward, before the optimizer step."""
        comm.all_reduce_grads(self._checked_store(), process_group, wire_dtype)

    def ddp_kwargs(self) -> dict[str, Any]:
        """Constructor arguments for ``DDP(flat, **flat.ddp_kwargs())``: the zero-copy,
        one-all-reduce-per-buffer path together with `allreduce_hook`."""
        return comm.ddp_kwargs(self._checked_store())

    def comm_state(
        self, process_group: Any = None, wire_dtype: torch.dtype | None = None
    ) -> comm.FlatGradCommState:
        """State for ``ddp.register_comm_hook(flat.comm_state(), flatgrad.allreduce_hook)``.

        `wire_dtype` (torch.bfloat16 or torch.float16) all-reduces a compressed copy and
        decompresses into the buffer, like torch's bf16/fp16 compress hooks.
        """
        return comm.FlatGradCommState(self, process_group, wire_dtype)


def _trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    # parameters() yields a shared (tied) parameter once.
    return [param for param in model.parameters() if param.requires_grad]


def _check_norm_type(norm_type: float) -> float:
    norm_type = float(norm_type)
    if math.isnan(norm_type) or norm_type < 0:
        raise ValueError(f"norm_type must be a non-negative number or inf, got {norm_type}")
    return norm_type


def _place_incoming(
    store: GradStore, param: nn.Parameter, grads: tuple[torch.Tensor | None, ...]
) -> tuple[torch.Tensor | None, ...] | None:
    """AccumulateGrad pre-hook: when `.grad` is None, copy the incoming gradient into the
    slot, make the slot the `.grad`, and hand AccumulateGrad nothing to do (its post hooks,
    DDP's among them, still run).

    When `.grad` is defined AccumulateGrad adds in place into it, which is the slot.
    Under create_graph=True the gradient must stay differentiable: left alone.
    """
    grad = grads[0]
    if grad is None or param.grad is not None or torch.is_grad_enabled():
        return None
    store.place(param, grad)
    return (None,)


# --- routing supported layers through the flat-buffer Functions ----------------------------


def _linear_forward(module: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled():
        return functional.linear(input, module.weight, module.bias)
    return F.linear(input, module.weight, module.bias)


def _embedding_forward(module: nn.Embedding, input: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and not module.sparse:
        return functional.embedding(
            input,
            module.weight,
            module.padding_idx,
            module.max_norm,
            module.norm_type,
            module.scale_grad_by_freq,
        )
    return F.embedding(
        input,
        module.weight,
        module.padding_idx,
        module.max_norm,
        module.norm_type,
        module.scale_grad_by_freq,
        module.sparse,
    )


_ROUTES: dict[str, tuple[type[nn.Module], Callable[..., torch.Tensor]]] = {
    "linear": (nn.Linear, _linear_forward),
    "embedding": (nn.Embedding, _embedding_forward),
}


def _route_layers(model: nn.Module, config: FlatGradConfig) -> None:
    """Give every supported layer that keeps torch's own forward a flat-buffer forward.

    Subclasses that override `forward` (LoRA layers, quantised layers...) are left alone:
    their parameters still get their gradients in the buffer through the pre-hook.
    """
    for name, module in model.named_modules():
        for kind in config.layers:
            cls, forward = _ROUTES[kind]
            if not isinstance(module, cls) or type(module).forward is not cls.forward:
                continue
            if isinstance(module, nn.Linear) and module.weight.numel() < config.linear_min_numel:
                continue
            if isinstance(module, nn.Embedding) and module.sparse and module.weight.requires_grad:
                raise ValueError(
                    f"embedding {name or '<root>'!r} must have sparse=False: a sparse gradient "
                    "cannot live in a dense flat buffer"
                )
            # A partial of a module-level function (not a bound method) pickles and deep-copies.
            module.forward = functools.partial(forward, module)  # type: ignore[method-assign]


# --- state_dict keys: the plain model's, in both directions --------------------------------


def _rekey(mapping: dict[str, Any], old: str, new: str, root: str | None = None) -> None:
    """Rename keys starting with `old` to start with `new` (all at once: no clashes);
    `root`, if given, is a key equal to `old` without its dot, renamed to `new[:-1]`."""
    moved = {k: mapping.pop(k) for k in [k for k in mapping if k.startswith(old) or k == root]}
    for key, value in moved.items():
        mapping[new[:-1] if key == root else new + key[len(old) :]] = value


def _strip_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """After `state_dict()`: ``<prefix>module.x`` -> ``<prefix>x``, so the keys (and the
    version metadata) are the plain model's, also under ``DDP(flat)``."""
    _rekey(state_dict, prefix + _PREFIX, prefix)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        metadata.pop(prefix[:-1], None)  # FlatGrad's own entry; the model's root takes its key
        _rekey(metadata, prefix + _PREFIX, prefix, root=prefix + _PREFIX[:-1])


def _add_prefix(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any, *args: Any
) -> None:
    """Before loading: ``<prefix>x`` -> ``<prefix>module.x`` (every key: FlatGrad has no
    state of its own, and a child of the model may itself be called "module")."""
    _rekey(state_dict, prefix, prefix + _PREFIX)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        _rekey(metadata, prefix, prefix + _PREFIX, root=prefix[:-1])
