"""`flatgrad.gather`: torch.gather's forward, a scatter-add backward into the flat buffer.

Oracle: `torch.gather`'s own gradient on a clone, float64, with heavily repeated indices.
Both sides sum the same products, possibly in another order: 1e-12 covers the round-off.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from conftest import assert_same_grads, grad_in_buffers
from torch import nn

import flatgrad

TOL = {"rtol": 1e-12, "atol": 1e-12}


def _case(shape: tuple[int, ...], dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An input and an index that repeats positions (values from a range of 2) and is
    smaller than the input along the other dimensions."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(shape, dtype=torch.float64, generator=gen)
    index_shape = [max(1, n - 1) if d != dim % len(shape) else 2 * n for d, n in enumerate(shape)]
    index = torch.randint(0, min(2, shape[dim]), index_shape, generator=gen)
    return table, index


CASES = [
    (shape, dim)
    for shape in [(5,), (4, 3), (3, 4, 2), (2, 3, 2, 3)]
    for dim in range(-len(shape), len(shape))
]


@pytest.mark.parametrize(("shape", "dim"), CASES)
def test_forward_and_gradient_equal_torch_gather(shape, dim):
    table, index = _case(shape, dim, seed=len(shape) * 10 + dim)
    ours = table.clone().requires_grad_(True)
    ref = table.clone().requires_grad_(True)
    out = flatgrad.gather(ours, dim, index)
    expected = torch.gather(ref, dim, index)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    weights = torch.randn(out.shape, dtype=torch.float64)
    for _ in range(2):  # the second backward accumulates into the fresh .grad
        (flatgrad.gather(ours, dim, index) * weights).sum().backward()
        (torch.gather(ref, dim, index) * weights).sum().backward()
    torch.testing.assert_close(ours.grad, ref.grad, **TOL)


class _Bias(nn.Module):
    """A relative-position-bias-like table read per head with a dim-wise gather."""

    def __init__(self, heads: int = 4, span: int = 7) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(heads, span, dtype=torch.float64))
        self.proj = nn.Linear(20, 8).double()

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        bias = flatgrad.gather(self.table, 1, index)
        return (self.proj(bias.tanh()) ** 2).sum()


def _index(seed: int) -> torch.Tensor:
    return torch.randint(0, 7, (4, 20), generator=torch.Generator().manual_seed(seed))


def _reference(model: nn.Module, index: torch.Tensor) -> torch.Tensor:
    bias = torch.gather(model.table, 1, index)
    return (model.proj(bias.tanh()) ** 2).sum()


def _pair() -> tuple[flatgrad.FlatGrad, nn.Module]:
    torch.manual_seed(0)
    model = _Bias()
    return flatgrad.FlatGrad(model, config={"linear_min_numel": 0}), copy.deepcopy(model)


def test_wrapped_parameter_gradient_lands_in_the_buffer_and_accumulates():
    flat, oracle = _pair()
    for step in range(3):
        if step == 2:
            flat.zero_grad()
            oracle.zero_grad()
        flat(_index(step)).backward()
        _reference(oracle, _index(step)).backward()
        assert_same_grads(flat, oracle)
    assert grad_in_buffers(flat, flat.module.table.grad)


def test_autograd_grad_leaves_dot_grad_untouched():
    flat, oracle = _pair()
    (ours,) = torch.autograd.grad(flat(_index(0)), [flat.module.table])
    (ref,) = torch.autograd.grad(_reference(oracle, _index(0)), [oracle.table])
    torch.testing.assert_close(ours, ref, **TOL)
    assert flat.module.table.grad is None


def test_double_backward_equals_stock():
    flat, oracle = _pair()
    for model, loss in ((flat.module, flat(_index(1))), (oracle, _reference(oracle, _index(1)))):
        (g,) = torch.autograd.grad(loss, [model.table], create_graph=True)
        g.square().sum().backward()
    assert_same_grads(flat, oracle, rtol=1e-10, atol=1e-12)


def test_plain_tensor_without_flatgrad_gets_a_fresh_gradient():
    table, index = _case((6, 5), 0, seed=3)
    ours = table.clone().requires_grad_(True)
    flatgrad.gather(ours, 0, index).sum().backward()
    ref = table.clone().requires_grad_(True)
    torch.gather(ref, 0, index).sum().backward()
    torch.testing.assert_close(ours.grad, ref.grad, **TOL)


def test_deterministic_mode_is_run_to_run_identical():
    table, index = _case((64, 32), 1, seed=4)
    grads = []
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(2):
            leaf = table.float().clone().requires_grad_(True)
            flatgrad.gather(leaf, 1, index).sum().backward()
            grads.append(leaf.grad)
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(grads[0], grads[1])


def test_no_weight_sized_temporary_copy_or_add_in_backward():
    torch.manual_seed(0)
    model = nn.Module()
    model.table = nn.Parameter(torch.randn(64, 48))
    flat = flatgrad.FlatGrad(model)
    index = torch.randint(0, 48, (64, 16))
    weight_shape = [64, 48]
    for accumulate in (False, True):
        if not accumulate:
            flat.zero_grad()
        out = flatgrad.gather(model.table, 1, index).sum()
        with torch.profiler.profile(record_shapes=True) as prof:
            out.backward()
        ops = [(e.name, e.input_shapes) for e in prof.events()]
        bad = [
            name
            for name, shapes in ops
            if name in {"aten::copy_", "aten::add_", "aten::add", "aten::clone", "aten::zeros", "aten::empty"}
            and weight_shape in [list(s) for s in shapes if s]
        ]
        assert not bad, (accumulate, bad)
        assert any(name == "aten::scatter_add_" for name, _ in ops)
        assert grad_in_buffers(flat, model.table.grad)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (
            lambda t: flatgrad.gather(t, 1, torch.zeros(2, 2)),
            TypeError,
            "index must be an int32 or int64 tensor",
        ),
        (
            lambda t: flatgrad.gather(t, 2, torch.zeros(2, 2, dtype=torch.long)),
            IndexError,
            r"dim must lie in \[-2, 1\]",
        ),
        (
            lambda t: flatgrad.gather(t, 1, torch.zeros(5, 2, dtype=torch.long)),
            ValueError,
            "no larger than input along dimension 0",
        ),
        (
            lambda t: flatgrad.gather(t, 1, torch.tensor([[0, 3]])),
            IndexError,
            r"index values must lie in \[0, 3\) along dimension 1, got 3",
        ),
        (
            lambda t: flatgrad.gather(t, 0, torch.tensor([[-1, 0]])),
            IndexError,
            r"index values must lie in \[0, 4\) along dimension 0, got -1",
        ),
        (
            lambda t: flatgrad.gather(t, 1, torch.zeros(2, dtype=torch.long)),
            ValueError,
            r"index must have as many dimensions as input \(2\)",
        ),
        (lambda t: flatgrad.gather([1.0], 0, torch.zeros(1, dtype=torch.long)), TypeError, "must be tensors"),
    ],
)
def test_bad_input_is_refused_clearly(make, error, match):
    with pytest.raises(error, match=match):
        make(torch.randn(4, 3, requires_grad=True))


def test_compile_has_no_graph_break():
    torch._dynamo.reset()
    table = torch.randn(4, 5, requires_grad=True)
    index = torch.randint(0, 5, (4, 3))
    explained = torch._dynamo.explain(lambda t, i: flatgrad.gather(t, 1, i).sum())(table, index)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    torch._dynamo.reset()


def test_every_dim_and_rank_cover_the_table():
    """The parametrized cases above include every dim of every rank from 1 to 4."""
    covered = {(len(shape), dim % len(shape)) for shape, dim in CASES}
    assert covered == {(n, d) for n in range(1, 5) for d in range(n)}
    assert len(list(itertools.chain(CASES))) == 2 * (1 + 2 + 3 + 4)


def test_gather_with_index_add_compiles_without_a_graph_break():
    torch._dynamo.reset()
    table = torch.randn(6, 3, requires_grad=True)
    idx = torch.tensor([[-1, 0], [2, 5]])
    explained = torch._dynamo.explain(lambda t, i: flatgrad.gather_with_index_add(t, i).sum())(table, idx)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    compiled = torch.compile(lambda t, i: flatgrad.gather_with_index_add(t, i), backend="aot_eager")
    torch.testing.assert_close(compiled(table, idx), table[idx])
    torch._dynamo.reset()
