"""Hugging Face Accelerate with flatgrad's DDP comm hook, in one call after ``Accelerator()``.

    accelerator = Accelerator()
    flat = flatgrad.FlatGrad(model)
    flatgrad.accelerate.attach(accelerator, flat)
    ddp, optimizer = accelerator.prepare(flat, optimizer)

`attach` replaces ``accelerator.ddp_handler``, from which ``accelerator.prepare`` builds its DDP, with a
`FlatGradDDPKwargs` that keeps its settings, adds `FlatGrad.ddp_kwargs` and registers
`flatgrad.allreduce_hook` on the DDP of ``flat`` (why this way: docs/integrations.md, "Accelerate").
``import flatgrad`` imports neither this module nor Accelerate."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs
from torch.nn.parallel import DistributedDataParallel

from flatgrad._comm import FlatGradCommState, allreduce_hook
from flatgrad._flatgrad import FlatGrad

__all__ = ["FlatGradDDPKwargs", "attach"]

_STATE = "flatgrad_comm_state"  # the handler's own attribute, not a DDP argument
_NOT_DDP_ARGUMENTS = ("comm_hook", "comm_wrapper", "comm_state_option")  # as Accelerate's to_dict


@dataclasses.dataclass
class FlatGradDDPKwargs(DistributedDataParallelKwargs):
    """Accelerate's DDP handler with flatgrad's hook: the DDP that ``accelerator.prepare`` builds around
    ``flatgrad_comm_state.model`` gets `flatgrad.allreduce_hook` with that state; any other DDP it builds gets
    Accelerate's own hook choice (``comm_hook``). Built by `attach`."""

    flatgrad_comm_state: FlatGradCommState | None = None

    def to_dict(self, ignore_keys: tuple[str, ...] = _NOT_DDP_ARGUMENTS) -> Any:
        """DDP arguments without the comm state (no DDP argument; never deep-copied: it holds the model)."""
        fields = {k: v for k, v in self.__dict__.items() if k != _STATE and k not in ignore_keys}
        return copy.deepcopy(fields)

    def register_comm_hook(self, model: Any) -> None:
        """Called by ``accelerator.prepare`` on each DDP it builds.

        Args:
            model: The DDP just built."""
        state = self.flatgrad_comm_state
        if state is not None and isinstance(model, DistributedDataParallel) and model.module is state.model:
            model.register_comm_hook(state, allreduce_hook)
        else:
            super().register_comm_hook(model)


def attach(
    accelerator: Accelerator, flat: FlatGrad, reduce_dtype: torch.dtype | None = None
) -> FlatGradCommState:
    """Make ``accelerator.prepare(model, ...)`` build ``DDP(model, **model.ddp_kwargs())`` with
    `flatgrad.allreduce_hook` registered, as the hand-written recipe does. Call it after ``Accelerator(...)``
    and before ``accelerator.prepare`` (after it is too late: that DDP was built without the hook, and
    flatgrad warns after two steps that the hook has not run). On one process (no DDP) it changes nothing.

    The accelerator's DDP handler (the `DistributedDataParallelKwargs` given in ``kwargs_handlers``, or the
    defaults) is replaced by a `FlatGradDDPKwargs` with the same settings plus
    ``gradient_as_bucket_view=True`` and a ``bucket_cap_mb`` above the largest flat buffer; a DDP it builds
    around another model gets those two as well (harmless: one bucket) and the handler's own hook choice.

    Args:
        accelerator: The Accelerator that will prepare `flat`.
        flat: The model with FlatGrad applied, to be passed to ``accelerator.prepare`` as it is.
        reduce_dtype: As in `FlatGrad.comm_state`: ``torch.bfloat16`` or ``torch.float16`` all-reduces a
            compressed copy (in place of Accelerate's ``comm_hook="bf16"``).

    Returns:
        The hook's state (its ``num_calls`` counts the all-reduces).

    Raises:
        TypeError: `accelerator` is not an Accelerator or `flat` is not a FlatGrad.
        ValueError: The handler already asks for one of Accelerate's comm hooks
            (``comm_hook``/``comm_wrapper``), which flatgrad's replaces; or as `FlatGrad.ddp_kwargs` and
            `FlatGrad.comm_state` raise (main grads)."""
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}")
    if not isinstance(flat, FlatGrad):
        raise TypeError(f"flat must be a flatgrad.FlatGrad, got {type(flat).__name__}")
    handler = accelerator.ddp_handler or DistributedDataParallelKwargs()
    hooks = (handler.comm_hook, handler.comm_wrapper)
    if any(hook != DDPCommunicationHookType.NO for hook in hooks):
        raise ValueError(
            "DistributedDataParallelKwargs comm_hook and comm_wrapper must be 'no' with flatgrad's hook "
            f"(compress with attach(..., reduce_dtype=torch.bfloat16) instead), got {hooks[0]!s}, "
            f"{hooks[1]!s}"
        )
    settings = {f.name: getattr(handler, f.name) for f in dataclasses.fields(DistributedDataParallelKwargs)}
    state = flat.comm_state(reduce_dtype=reduce_dtype)
    accelerator.ddp_handler = FlatGradDDPKwargs(
        **{**settings, **flat.ddp_kwargs()}, flatgrad_comm_state=state
    )
    return state
