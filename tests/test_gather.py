"""`flatgrad.gather`: torch.gather's forward, a scatter-add backward into the flat buffer.

Oracle: `torch.gather`'s own gradient on a clone, float64, with heavily repeated indices.
Both sides sum the same products, possibly in another order: 1e-12 covers the round-off.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable

import pytest
import torch
from conftest import assert_same_grads, grad_in_buffers
from test_functional import _COPY_OPS, _weight_sized_ops
from torch import nn

import flatgrad
from flatgrad._torch_compat import GATHER_TAKES_INT32

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
    assert grad_in_buffers(flat, flat.table.grad)


def test_autograd_grad_leaves_dot_grad_untouched():
    flat, oracle = _pair()
    (ours,) = torch.autograd.grad(flat(_index(0)), [flat.table])
    (ref,) = torch.autograd.grad(_reference(oracle, _index(0)), [oracle.table])
    torch.testing.assert_close(ours, ref, **TOL)
    assert flat.table.grad is None


def test_double_backward_equals_stock():
    flat, oracle = _pair()
    for model, loss in ((flat, flat(_index(1))), (oracle, _reference(oracle, _index(1)))):
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


def _weight_sized_allocations(prof: torch.profiler.profile, numel_bytes: int) -> list[str]:
    """Ops that allocated at least a weight's bytes (`profile_memory=True`): a temporary
    gradient. The shapes of `aten::empty`/`aten::new_zeros` are arguments, not tensors, so
    `_weight_sized_ops` cannot see them; their memory can."""
    return [f"{e.name}: {e.cpu_memory_usage} B" for e in prof.events() if e.cpu_memory_usage >= numel_bytes]


def _profiled_backward(loss: torch.Tensor) -> torch.profiler.profile:
    with torch.profiler.profile(record_shapes=True, profile_memory=True) as prof:
        loss.backward()
    return prof


class _Wide(nn.Module):
    """A float32 table read along dim 1. From SEAT_MAX_NUMEL elements on the wrapper does not seat
    its slot before backward: the gather's own "out" path writes it."""

    def __init__(self, rows: int, span: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(rows, span))

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return flatgrad.gather(self.table, 1, index).square().sum()


@pytest.mark.parametrize(
    ("rows", "through_wrapper"),
    [(64, False), (64, True), (3072, True)],  # 3072 x 48: at least SEAT_MAX_NUMEL
    ids=["direct-call", "wrapper-seated-slot", "wrapper-large-table"],
)
def test_no_weight_sized_temporary_copy_or_add_in_backward(rows, through_wrapper):
    torch.manual_seed(0)
    model = _Wide(rows, 48)
    flat = flatgrad.FlatGrad(model)
    index = torch.randint(0, 48, (rows, 16))  # no activation has the table's shape
    shape, numel_bytes = (rows, 48), rows * 48 * 4
    for set_to_none in (True, False):  # an empty slot, then accumulating into it
        flat.zero_grad(set_to_none=set_to_none)
        prof = _profiled_backward(flat(index) if through_wrapper else model(index))
        assert _weight_sized_ops(prof, {shape}, _COPY_OPS) == []
        assert _weight_sized_allocations(prof, numel_bytes) == []
        assert "aten::scatter_add_" in {e.name for e in prof.events()}
        assert grad_in_buffers(flat, model.table.grad)


def test_stock_gather_backward_does_allocate_and_add_what_we_avoid():
    """The checks above can fail: stock allocates a zeroed gradient and, accumulating, adds it."""
    torch.manual_seed(0)
    model = _Wide(64, 48)
    index = torch.randint(0, 48, (64, 16))
    model.table.grad = torch.zeros_like(model.table)
    loss = torch.gather(model.table, 1, index).square().sum()
    prof = _profiled_backward(loss)
    assert _weight_sized_allocations(prof, 64 * 48 * 4)
    assert _weight_sized_ops(prof, {(64, 48)}, _COPY_OPS)


def test_large_wrapped_table_equals_stock_fresh_and_accumulating():
    torch.manual_seed(0)
    model = _Wide(3072, 48).double()
    oracle = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model)
    for step in range(4):
        if step == 2:
            flat.zero_grad()
            oracle.zero_grad()
        index = torch.randint(0, 48, (1024, 60))  # 60 > 48: every row repeats positions
        flat(index).backward()
        (torch.gather(oracle.table, 1, index).square().sum()).backward()
        assert_same_grads(flat, oracle)


class _Reused(nn.Module):
    """One table read twice (along dims 0 and 1) and once directly in the same loss."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(6, 5, dtype=torch.float64))
        self.scale = nn.Parameter(torch.randn(5, dtype=torch.float64))

    def forward(
        self, rows: torch.Tensor, cols: torch.Tensor, gather: Callable[..., torch.Tensor] = flatgrad.gather
    ) -> torch.Tensor:
        first = gather(self.table, 0, rows) * self.scale
        second = gather(self.table, 1, cols)
        return first.square().sum() + second.tanh().sum() + self.table.sin().sum()


def _reused_index(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 6, (9, 5), generator=gen), torch.randint(0, 5, (6, 11), generator=gen)


def test_table_read_twice_and_directly_in_one_backward_equals_stock():
    """Both gathers write the same slot in one backward (the first makes it the .grad, the
    second adds) and AccumulateGrad adds the direct use in place."""
    torch.manual_seed(0)
    model = _Reused()
    oracle = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model)
    for step in range(3):
        flat(*_reused_index(step)).backward()
        oracle(*_reused_index(step), gather=torch.gather).backward()
        assert_same_grads(flat, oracle)


def test_backward_with_inputs_leaves_the_table_without_a_gradient():
    flat, oracle = _pair()
    flat(_index(0)).backward(inputs=[flat.proj.weight])
    _reference(oracle, _index(0)).backward(inputs=[oracle.proj.weight])
    assert flat.table.grad is None
    assert_same_grads(flat, oracle)


def test_tensor_hook_sees_the_gradient_and_the_result_lands_in_the_buffer():
    flat, oracle = _pair()
    seen: list[torch.Tensor] = []
    for model in (flat, oracle):
        model.table.register_hook(lambda g: seen.append(g.clone()) or g * 3)
    for step in range(2):
        flat(_index(step)).backward()
        _reference(oracle, _index(step)).backward()
        torch.testing.assert_close(seen[-2], seen[-1], **TOL)
    assert_same_grads(flat, oracle)


def test_an_optimizer_stepping_inside_backward_matches_stock():
    """The optimizer-in-backward recipe on the gathered table: its post-accumulate-grad hook
    sees the gradient the gather wrote into the slot (AccumulateGrad got none; on torch 2.4,
    which then skips the hook, flatgrad runs it), once per backward, as stock's sees its own."""
    flat, oracle = _pair()
    seen: dict[str, list[torch.Tensor]] = {"flat": [], "stock": []}
    for key, model in (("flat", flat), ("stock", oracle)):
        steppers = {p: torch.optim.SGD([p], lr=0.1, momentum=0.9) for p in model.parameters()}

        def step(param: torch.Tensor, steppers=steppers, model=model, log=seen[key]) -> None:
            if param is model.table:
                log.append(param.grad.clone())
            steppers[param].step()
            steppers[param].zero_grad()

        for param in model.parameters():
            param.register_post_accumulate_grad_hook(step)
    for step_index in range(3):
        flat(_index(step_index)).backward()
        _reference(oracle, _index(step_index)).backward()
    assert len(seen["flat"]) == len(seen["stock"]) == 3
    for ours, ref in zip(seen["flat"], seen["stock"]):
        torch.testing.assert_close(ours, ref, **TOL)
    for ours, ref in zip(flat.parameters(), oracle.parameters()):
        torch.testing.assert_close(ours, ref, **TOL)
    assert all(p.grad is None for p in flat.parameters())


def test_grad_assigned_by_the_user_accumulates_like_stock():
    flat, oracle = _pair()
    for model in (flat, oracle):
        model.table.grad = torch.full_like(model.table, 0.5)
    flat(_index(0)).backward()
    _reference(oracle, _index(0)).backward()
    torch.testing.assert_close(flat.table.grad, oracle.table.grad, **TOL)


@pytest.mark.parametrize(
    "make_index",
    [
        lambda: torch.randint(0, 5, (6, 4), dtype=torch.int32),
        lambda: torch.randint(0, 5, (3, 4)).t(),  # non-contiguous: (4, 3) with strides (1, 4)
        lambda: torch.randint(0, 5, (1, 4)).expand(6, 4),  # stride 0: torch's expanded-index kernel
    ],
    ids=["int32", "non-contiguous", "expanded"],
)
def test_index_layouts_and_dtypes_equal_torch_gather(make_index):
    table, _ = _case((6, 5), 0, seed=5)
    index = make_index()
    # Stock with the same positions: as int64 where torch.gather takes no int32 (torch 2.4).
    stock_index = index if GATHER_TAKES_INT32 else index.long()
    ours = table.clone().requires_grad_(True)
    ref = table.clone().requires_grad_(True)
    weights = torch.randn(index.shape, dtype=torch.float64)
    for _ in range(2):
        (flatgrad.gather(ours, 0, index) * weights).sum().backward()
        (torch.gather(ref, 0, stock_index) * weights).sum().backward()
    torch.testing.assert_close(ours.grad, ref.grad, **TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_deterministic_mode_on_cuda_is_run_to_run_identical():
    """On CUDA a plain scatter_add_ sums repeated positions with atomics (order varies);
    deterministic mode must give the same bits every run, close to a float64 CPU sum."""
    gen = torch.Generator().manual_seed(6)
    model = nn.Module()
    model.table = nn.Parameter(torch.randn(256, 64, generator=gen).cuda())
    flat = flatgrad.FlatGrad(model)
    index = torch.randint(0, 4, (256, 512), generator=gen).cuda()  # ~128 repeats per position
    weights = torch.randn(256, 512, generator=gen).cuda()
    grads = []
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(3):
            flat.zero_grad()
            (flatgrad.gather(model.table, 1, index) * weights).sum().backward()
            assert grad_in_buffers(flat, model.table.grad)
            grads.append(model.table.grad.clone())
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(grads[0], g) for g in grads[1:])
    expected = torch.zeros(256, 64, dtype=torch.float64).scatter_add_(1, index.cpu(), weights.cpu().double())
    torch.testing.assert_close(grads[0].cpu().double(), expected, rtol=1e-5, atol=1e-4)


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
        (
            lambda t: flatgrad.gather(t, True, torch.zeros(2, 2, dtype=torch.long)),
            TypeError,
            "dim must be an int, got bool",
        ),
        (
            lambda t: flatgrad.gather(t, 1.0, torch.zeros(2, 2, dtype=torch.long)),
            TypeError,
            "dim must be an int, got float",
        ),
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


def test_a_valid_call_reads_no_index_value_beyond_what_it_needs():
    """The range checks cost nothing on a valid call: `flatgrad.gather` reads no value of
    its index (torch.gather's own check refuses a bad one, which is then named), and
    `gather_with_index_add` one min (to find negative indices), no max."""
    table = torch.randn(8, 6, requires_grad=True)
    index = torch.randint(0, 6, (8, 4))
    rows = torch.randint(-8, 8, (32,))
    reductions = {"aten::min", "aten::max", "aten::aminmax"}
    with torch.profiler.profile() as prof:
        flatgrad.gather(table, 1, index).sum().backward()
    assert [e.name for e in prof.events() if e.name in reductions] == []
    with torch.profiler.profile() as prof:
        flatgrad.gather_with_index_add(table, rows).sum().backward()
    assert [e.name for e in prof.events() if e.name in reductions] == ["aten::min"]
    with pytest.raises(IndexError, match=r"indices must lie in \[-8, 8\) for a buffer of 8 rows, got 8"):
        flatgrad.gather_with_index_add(table, torch.tensor([3, 8]))


def test_vmap_over_the_indices_of_both_gathers_equals_stock():
    """Per-sample indices under `torch.func.vmap` (with `grad` inside): the gathers cannot
    read batched index values, so negative ones are wrapped on the tensors as on
    accelerators; values and per-sample gradients equal stock's."""
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(7, 3, dtype=torch.float64, generator=gen)
    rows = torch.randint(-7, 7, (4, 5), generator=gen)  # 4 samples of 5 row indices
    index = torch.randint(0, 3, (4, 7, 2), generator=gen)

    def ours(t, r, i):
        return flatgrad.gather_with_index_add(t, r).square().sum() + flatgrad.gather(t, 1, i).sum()

    def stock(t, r, i):
        return t[r].square().sum() + torch.gather(t, 1, i).sum()

    torch.testing.assert_close(
        torch.func.vmap(ours, in_dims=(None, 0, 0))(table, rows, index),
        torch.func.vmap(stock, in_dims=(None, 0, 0))(table, rows, index),
        **TOL,
    )
    torch.testing.assert_close(
        torch.func.vmap(torch.func.grad(ours), in_dims=(None, 0, 0))(table, rows, index),
        torch.func.vmap(torch.func.grad(stock), in_dims=(None, 0, 0))(table, rows, index),
        **TOL,
    )
