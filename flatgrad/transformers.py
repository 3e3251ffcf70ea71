"""transformers' `Trainer` over ``FlatGrad(model)``: checkpoints that ``from_pretrained`` loads,
and flatgrad's DDP hook on more than one process.

    trainer = flatgrad.transformers.FlatGradTrainer(model=flatgrad.FlatGrad(model), args=args, ...)

A plain `transformers.Trainer` given ``FlatGrad(model)`` trains it as the plain model with
its default arguments (the wrapper's forward reports the model's signature, so
``remove_unused_columns=True`` keeps the model's columns). Three decisions inside Trainer
look at the class of ``trainer.model`` instead, and no wrapper can change them:

- ``Trainer._save`` calls ``save_pretrained`` only on a `PreTrainedModel` (or a peft
  ``PeftModel``), directly or after ``accelerator.unwrap_model``, which unwraps DDP,
  DataParallel, FSDP, DeepSpeed and compiled modules only; any other model's state dict goes
  to ``safetensors.torch.save_file``, which refuses tied weights ("Some tensors share
  memory") and writes no ``config.json``, so ``from_pretrained`` cannot load it.
- ``Trainer._build_accelerator_args`` gives DDP ``find_unused_parameters=True`` for a model
  that is not a `PreTrainedModel` (a `PreTrainedModel` gets False unless it checkpoints
  activations).
- Trainer builds its own ``Accelerator``, whose DDP has neither `FlatGrad.ddp_kwargs` nor
  `flatgrad.allreduce_hook` (every step then copies the gradients into DDP's buckets).

`FlatGradTrainerMixin` makes each of them as for the plain model: it saves through the
plain model's ``save_pretrained`` (tied weights left out as transformers does, with its
``config.json``) and decides ``find_unused_parameters`` from it, and it calls
`flatgrad.accelerate.attach` on Trainer's accelerator. Everything else, resuming included
(``trainer.train(resume_from_checkpoint=...)`` loads the weights into the wrapper, under the
plain model's names), is Trainer's own. This module is imported only by a user who asks for
it (``import flatgrad`` never imports transformers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import transformers

from flatgrad.accelerate import attach
from flatgrad.wrapper import FlatGrad

__all__ = ["FlatGradTrainer", "FlatGradTrainerMixin"]


class FlatGradTrainerMixin:
    """Mixed into a `transformers.Trainer` class (``class MyTrainer(FlatGradTrainerMixin,
    SFTTrainer)``) whose ``model`` is a `FlatGrad`: checkpoints through the plain model's
    ``save_pretrained``, the plain model's DDP arguments, and flatgrad's DDP hook. With any
    other model it changes nothing."""

    model: Any  # as Trainer's (a FlatGrad here)
    accelerator: Any

    @contextlib.contextmanager
    def _as_plain_model(self) -> Iterator[None]:
        """``self.model`` is the model inside the wrapper for the duration, where Trainer
        decides by its class; the wrapper is put back after."""
        wrapper = self.model
        if not isinstance(wrapper, FlatGrad):
            yield
            return
        self.model = wrapper.module
        try:
            yield
        finally:
            self.model = wrapper

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        with self._as_plain_model():
            args: dict[str, Any] = super()._build_accelerator_args(**kwargs)  # type: ignore[misc]
        return args

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()  # type: ignore[misc]
        if isinstance(self.model, FlatGrad):
            attach(self.accelerator, self.model)

    def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
        with self._as_plain_model():
            super()._save(output_dir, state_dict)  # type: ignore[misc]


class FlatGradTrainer(FlatGradTrainerMixin, transformers.Trainer):
    """`transformers.Trainer` with `FlatGradTrainerMixin`: give it ``model=FlatGrad(model)``
    and the arguments Trainer takes."""
