"""Routing: a supported layer that keeps torch's own forward (`nn.Linear`, `nn.Embedding`)
gets an instance forward that runs flatgrad's Functions, which write the weight gradient
straight into its slot; `unroute` gives torch's forward back when the engine is gone."""

from __future__ import annotations

import functools
from collections.abc import Callable
from itertools import chain

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from flatgrad import _dtensor, _functional
from flatgrad._config import FlatGradConfig
from flatgrad._torch_compat import unwrap_if_dead


def _linear_forward(module: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    weight = module.weight
    if torch.is_grad_enabled() and not weight.is_complex() and not _functional.plain_torch():
        return _functional.linear_into_slot(unwrap_if_dead(input), module.bias, weight)
    return F.linear(input, weight, module.bias)


def _embedding_forward(module: nn.Embedding, input: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and not module.sparse and not _functional.plain_torch():
        if module.max_norm is not None:
            with torch.no_grad():  # what F.embedding does: renormalise the looked-up rows in place
                torch.embedding_renorm_(module.weight, input.reshape(-1), module.max_norm, module.norm_type)
        indices = unwrap_if_dead(input)
        return _functional.gather_rows_into_slot(
            module.weight, indices, module.padding_idx, module.scale_grad_by_freq
        )
    return nn.Embedding.forward(module, input)  # (torch's own: `F.embedding` with the module's settings)


_ROUTES: dict[str, tuple[type[nn.Module], Callable[..., torch.Tensor]]] = {
    "linear": (nn.Linear, _linear_forward),
    "embedding": (nn.Embedding, _embedding_forward),
}


def route_layers(model: nn.Module, config: FlatGradConfig) -> tuple[set[int], frozenset[int]]:
    """Give every supported layer that keeps torch's own forward a flat-buffer forward; returns the ids of the
    parameters those layers' Functions write themselves, and of those a layer left unrouted also holds (a tied
    head too small to route: their uses are summed as stock's, `GradStore.begin_backward`).

    Left alone: tensor-parallel layers (a DTensor weight: `parallelize_module`'s), subclasses that override
    `forward` (LoRA layers, quantised layers...), parametrized layers (their weight is computed, never a leaf:
    nothing to write into, and reading it would run the parametrization) and complex Linears. Their parameters
    still get their gradients in the buffer. Never runs model code."""
    chosen: list[tuple[nn.Module, Callable[..., torch.Tensor]]] = []
    # nn.MultiheadAttention never calls its out_proj (its forward reads out_proj.weight):
    # routed, that Linear would only ever see its gradient arrive through plain autograd.
    uncalled = {id(m.out_proj) for m in model.modules() if isinstance(m, nn.MultiheadAttention)}
    for module in model.modules():
        if id(module) in uncalled:
            continue
        for kind in config.layers:
            cls, forward = _ROUTES[kind]
            if not isinstance(module, cls) or type(module).forward is not cls.forward:
                continue
            weight = module._parameters.get("weight")
            if _dtensor.is_dtensor(weight) or parametrize.is_parametrized(module):  # type: ignore[arg-type]
                unroute(module)  # (tensor-parallel: DTensor's dispatch and the plan's hooks run it)
                continue
            bias = module._parameters.get("bias")
            if bias is not None and weight is not None and bias.shape != weight.shape[:1]:
                unroute(module)  # a bias broadcast (re-pointed at shape (1,)): its gradient is summed
                continue
            own = module.__dict__.get("forward")
            if own is not None:  # routed by an earlier build, or a forward the user set: keep it
                if isinstance(own, functools.partial) and own.func is forward:
                    chosen.append((module, forward))
                continue
            if weight is None:
                continue
            if isinstance(module, nn.Linear) and (
                weight.numel() < config.linear_min_numel or weight.is_complex()
            ):
                continue
            if isinstance(module, nn.Embedding) and module.sparse:
                continue  # a sparse gradient stays outside the buffers (`_sparse_ids`)
            chosen.append((module, forward))
    routed: set[int] = set()
    for module, forward in chosen:  # after every check: a refusal changes nothing
        # A partial of a module-level function (not a bound method) pickles and deep-copies.
        module.forward = functools.partial(forward, module)  # type: ignore[method-assign]
        routed.update(id(p) for p in module._parameters.values() if p is not None)
    chosen_ids = {id(module) for module, _ in chosen}
    unrouted = (m._parameters.values() for m in model.modules() if id(m) not in chosen_ids)
    return routed, frozenset(id(p) for p in chain.from_iterable(unrouted) if id(p) in routed)


def unroute(module: nn.Module) -> None:
    """Give a routed layer torch's own forward back (its engine is gone)."""
    own = module.__dict__.get("forward")
    if isinstance(own, functools.partial) and any(own.func is route for _, route in _ROUTES.values()):
        del module.__dict__["forward"]
