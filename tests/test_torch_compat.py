"""`flatgrad._torch_compat`'s behaviour probes: each agrees with what this torch does where
flatgrad relies on it, and `run_post_accumulate_hooks` calls hooks as AccumulateGrad does.

Oracle: the same torch behaviour observed the long way (a whole backward, torch.gather
itself), on whichever torch runs the tests (2.4.1 and newer give opposite answers)."""

from __future__ import annotations

import pytest
import torch

from flatgrad import _torch_compat
from flatgrad._torch_compat import GATHER_TAKES_INT32, POST_ACCUMULATE_HOOKS_NEED_A_GRADIENT


class _NoGradientForTheLeaf(torch.autograd.Function):
    """``x * 1`` whose backward hands `x`'s AccumulateGrad no gradient, as flatgrad's
    Functions do after writing the slot themselves."""

    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        return None


def test_the_post_accumulate_hook_probe_agrees_with_a_backward():
    """The probe calls the AccumulateGrad node alone; a backward runs it through the engine."""
    ran: list[torch.Tensor] = []
    leaf = torch.zeros(2, requires_grad=True)
    leaf.register_post_accumulate_grad_hook(ran.append)
    (_NoGradientForTheLeaf.apply(leaf) + torch.ones(2, requires_grad=True)).sum().backward()
    assert (not ran) is POST_ACCUMULATE_HOOKS_NEED_A_GRADIENT
    assert leaf.grad is None


def test_post_accumulate_hooks_run_in_order_only_where_no_gradient_arrived():
    calls: list[str] = []
    leaf = torch.zeros(2, requires_grad=True)
    leaf.register_post_accumulate_grad_hook(lambda p: calls.append("first"))
    removed = leaf.register_post_accumulate_grad_hook(lambda p: calls.append("removed"))
    leaf.register_post_accumulate_grad_hook(lambda p: calls.append("last") if p is leaf else None)
    removed.remove()
    _torch_compat.run_post_accumulate_hooks(leaf, (), (torch.ones(2),))  # AccumulateGrad called them
    assert calls == []
    _torch_compat.run_post_accumulate_hooks(leaf, (), (None,))
    assert calls == ["first", "last"]
    _torch_compat.run_post_accumulate_hooks(torch.zeros(2, requires_grad=True), (), (None,))  # none


def test_a_post_accumulate_hook_returning_a_value_is_refused_as_torch_refuses_it():
    leaf = torch.zeros(2, requires_grad=True)
    leaf.register_post_accumulate_grad_hook(lambda p: p)
    with pytest.raises(RuntimeError, match="Tensor post accumulate grad hooks should return None"):
        _torch_compat.run_post_accumulate_hooks(leaf, (), (None,))


def test_the_int32_gather_probe_agrees_with_torch_gather():
    index = torch.tensor([[1, 0]], dtype=torch.int32)
    try:
        torch.gather(torch.arange(6.0).view(2, 3), 1, index)
        taken = True
    except RuntimeError:
        taken = False
    assert taken is GATHER_TAKES_INT32
