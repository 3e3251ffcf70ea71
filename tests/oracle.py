"""The multi-rank oracle: stock DDP and a torch optimizer on a deep copy, stepped in lockstep
with ours on the same batches, compared by parameter name.

A worker builds both sides (`stock` makes the stock one) and hands them to `Lockstep`, which
zeroes, runs forward and backward, and steps both, and compares gradients (None where stock
has None) and parameters. What a test is about (no_sync, Join, freezing, a profiler) stays
in the worker, around these calls. Workers with no optimizer to step compare with
`assert_grads_like` and `assert_params_like`, which `conftest.assert_same_grads` uses too.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def stock(
    model: nn.Module,
    optimizer_class: Callable[..., torch.optim.Optimizer],
    ddp_kwargs: Mapping[str, Any] | None = None,
    **options: Any,
) -> tuple[DDP, torch.optim.Optimizer]:
    """The oracle for `model`: ``DDP(copy.deepcopy(model), **ddp_kwargs)`` and
    ``optimizer_class(its parameters, **options)``.

    Call it where the test copies the model (before or after ours wraps it, as the test
    says): the copy takes the values `model` holds then.
    """
    ref = DDP(copy.deepcopy(model), **(ddp_kwargs or {}))
    return ref, optimizer_class(ref.parameters(), **options)


def _labelled(label: str) -> Callable[[str], str]:
    """An `assert_close` message that opens with `label` (the parameter, the step)."""
    return lambda message: f"{label}: {message}"


def assert_grads_like(ours: nn.Module, oracle: nn.Module, rtol: float, atol: float, what: str = "") -> None:
    """Grads of `ours` equal the oracle's, matched by parameter name: None where it has None.

    `what` (a step, a phase) opens every failure message.
    """
    params = dict(ours.named_parameters())
    for name, ref in oracle.named_parameters():
        param, label = params[name], f"{what} {name}".lstrip()
        if ref.grad is None:
            assert param.grad is None, f"{label}: expected no grad"
            continue
        assert param.grad is not None, f"{label}: grad missing"
        torch.testing.assert_close(param.grad, ref.grad, rtol=rtol, atol=atol, msg=_labelled(label))


def assert_params_like(ours: nn.Module, oracle: nn.Module, rtol: float, atol: float, what: str = "") -> None:
    """Parameters of `ours` equal the oracle's, matched by name."""
    params = dict(ours.named_parameters())
    for name, ref in oracle.named_parameters():
        label = f"{what} {name}".lstrip()
        torch.testing.assert_close(params[name], ref, rtol=rtol, atol=atol, msg=_labelled(label))


def _itself(output: torch.Tensor) -> torch.Tensor:
    return output


@dataclass
class Lockstep:
    """Ours and the oracle, driven together.

    Attributes:
        model: our plain model, whose parameters are compared (by name) with `ref.module`'s.
        wrapper: what runs our forward (a flatgrad.ReplicateModule, a DDP around a FlatGrad).
        opt: our optimizer.
        ref: stock DDP on a deep copy of `model`.
        ref_opt: the stock optimizer over `ref`'s parameters.
        loss: turns a forward's output into the loss to backpropagate (the output itself
            unless the model returns something else).
    """

    model: nn.Module
    wrapper: Callable[..., Any]
    opt: torch.optim.Optimizer
    ref: DDP
    ref_opt: torch.optim.Optimizer
    loss: Callable[[Any], torch.Tensor] = _itself

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Both optimizers' `zero_grad(set_to_none)`."""
        self.opt.zero_grad(set_to_none=set_to_none)
        self.ref_opt.zero_grad(set_to_none=set_to_none)

    def backward(self, *args: Any, **kwargs: Any) -> None:
        """A forward on `args` and the loss's backward, ours then stock's."""
        self.loss(self.wrapper(*args, **kwargs)).backward()
        self.loss(self.ref(*args, **kwargs)).backward()

    def step(self, **kwargs: Any) -> None:
        """Both optimizers' `step(**kwargs)`."""
        self.opt.step(**kwargs)
        self.ref_opt.step(**kwargs)

    def train_step(self, *args: Any, **kwargs: Any) -> None:
        """One plain training step each on the same batch: zero_grad, backward, step."""
        self.zero_grad()
        self.backward(*args, **kwargs)
        self.step()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Both sides' `no_sync()`: backwards inside accumulate locally."""
        with self.wrapper.no_sync(), self.ref.no_sync():  # type: ignore[attr-defined]
            yield

    def assert_grads(self, rtol: float, atol: float, what: str = "") -> None:
        """Our `.grad` equal stock's by parameter name, None where stock's is None."""
        assert_grads_like(self.model, self.ref.module, rtol, atol, what)

    def assert_params(self, rtol: float, atol: float, what: str = "") -> None:
        """Our parameters equal stock's by name."""
        assert_params_like(self.model, self.ref.module, rtol, atol, what)
