"""The flat-buffer autograd Functions: results against stock autograd, and zero-copy
checked with torch.profiler."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.utils.checkpoint
from conftest import ROUTE_ALL, TiedLM, assert_same_grads, grad_in_buffers
from torch import nn
from torch.nn import functional as F

import flatgrad
from flatgrad._functional import add_rows

_COPY_OPS = {"aten::copy_", "aten::clone", "aten::add_", "aten::add", "aten::mul_out", "aten::_to_copy"}
_SORT_OPS = {"aten::sort", "aten::index_put_", "aten::_index_put_impl_", "aten::embedding_dense_backward"}


class _ProfiledLM(nn.Module):
    """Shapes chosen so no activation has a weight's shape: 3x7 tokens, vocab 50, dim 24."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 24)
        self.mid = nn.Linear(24, 24)
        self.head = nn.Linear(24, 50, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.emb(tokens)))).square().mean()


def _weight_sized_ops(
    prof: torch.profiler.profile, shapes: set[tuple[int, ...]], names: set[str]
) -> list[str]:
    found = []
    for event in prof.events():
        if event.name == "aten::copy_" and len(event.input_shapes) > 1 and not event.input_shapes[1]:
            continue  # a copy from a 0-d scalar is a fill (a seated slot's -0.0), not a gradient's copy
        if event.name in names and any(tuple(s) in shapes for s in event.input_shapes if s):
            found.append(f"{event.name}{event.input_shapes}")
    return found


@pytest.mark.parametrize("tied", [False, True])
def test_backward_is_zero_copy_empty_and_accumulating(tied):
    """No weight-sized copy or add, but where a tied table accumulates: its two uses are
    summed before they are added in, as stock's (autograd's add and AccumulateGrad's), for
    stock's bits (see `test_weights_read_twice_sum_as_stock`)."""
    torch.manual_seed(0)
    flat = flatgrad.FlatGrad(_ProfiledLM(tied), config=ROUTE_ALL)
    shapes = {tuple(p.shape) for p in flat.parameters() if p.dim() == 2}
    tokens = torch.randint(0, 50, (3, 7))
    for set_to_none in (True, False, True):  # empty slots, accumulating into .grad, empty again
        flat.zero_grad(set_to_none=set_to_none)
        loss = flat(tokens)
        with torch.profiler.profile(record_shapes=True) as prof:
            loss.backward()
        summed = ["aten::add_[[50, 24], [50, 24], []]"] * 2 if tied and not set_to_none else []
        assert _weight_sized_ops(prof, shapes, _COPY_OPS) == summed
        names = {e.name for e in prof.events()}
        assert names.isdisjoint(_SORT_OPS), names & _SORT_OPS
        assert "aten::index_add_" in names
        for name, param in flat.named_parameters():
            assert grad_in_buffers(flat, param.grad), name


class _ReadTwice(nn.Module):
    """A tied LM whose weights are read more than once in a forward: "tied" the table by
    the lookup and the head, "reused" also a Linear applied twice, "three" also the table
    looked up twice (its head the third read), "outside" the table's second read and the
    Linear's by plain ops, not their modules (OLMo's tied head: ``F.linear(h, wte.weight)``).
    512 rows a batch: enough that adding a product inside the GEMM and adding it rounded
    give other bits."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(300, 48)
        self.mid = nn.Linear(48, 48)
        self.head = nn.Linear(48, 300, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.emb(tokens)
        if self.kind == "three":
            hidden = hidden + self.emb(tokens.flip(-1))
        if self.kind == "outside":
            hidden = torch.tanh(self.mid(hidden) + hidden @ self.mid.weight.T)
            return F.linear(hidden, self.emb.weight).square().mean()
        if self.kind != "tied":
            hidden = torch.tanh(self.mid(torch.relu(self.mid(hidden))))
        return self.head(hidden).square().mean()


@pytest.mark.parametrize("micro_batches", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["tied", "reused", "three", "outside"])
@pytest.mark.parametrize("linears", ["routed", "unrouted"])
def test_weights_read_twice_sum_as_stock(linears, kind, dtype, micro_batches):
    """A weight read more than once in a forward gets stock's bits: its uses summed first
    where writing them into the slot one by one would round otherwise (three uses, an
    earlier micro-batch's gradient in the slot, a Linear adding second, or a use autograd
    adds: the tied head left unrouted, a read by a plain op, seen as it reaches
    AccumulateGrad), and in place where they would not (a tied LM's first backward: the
    head writes, the lookup adds rounded)."""
    torch.manual_seed(0)
    model = _ReadTwice(kind).to(dtype)
    oracle = copy.deepcopy(model)
    config = ROUTE_ALL if linears == "routed" else flatgrad.FlatGradConfig(linear_min_numel=20_000)
    flat = flatgrad.FlatGrad(model, config=config)
    for step in range(2):
        for micro in range(micro_batches):
            generator = torch.Generator().manual_seed(10 * step + micro)
            tokens = torch.randint(0, 300, (8, 64), generator=generator)
            flat(tokens).backward()
            oracle(tokens).backward()
        for (name, param), ref in zip(flat.named_parameters(), oracle.parameters()):
            if ref.grad is None:
                assert param.grad is None, name
                continue
            assert torch.equal(param.grad, ref.grad), (step, name, (param.grad - ref.grad).abs().max())
            assert torch.equal(param.grad.signbit(), ref.grad.signbit()), (step, name)
            assert grad_in_buffers(flat, param.grad), name
        flat.zero_grad()
        oracle.zero_grad()


def test_a_second_backward_through_one_forward_sums_as_the_first():
    """`torch.autograd.grad` through a forward's output, then `.backward()` through it: the
    second backward decides from that forward's reads too (no forward came between)."""
    torch.manual_seed(0)
    model = _ReadTwice("reused")
    oracle = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    for micro in range(3):
        tokens = torch.randint(0, 300, (8, 64), generator=torch.Generator().manual_seed(micro))
        for module in (flat, oracle):
            loss = module(tokens)
            torch.autograd.grad(loss, module.head.weight, retain_graph=True)
            loss.backward()
    for (name, param), ref in zip(flat.named_parameters(), oracle.parameters()):
        assert torch.equal(param.grad, ref.grad), name
        assert grad_in_buffers(flat, param.grad), name


def test_stock_backward_does_copy_what_we_avoid():
    """The profiler check can fail: stock autograd accumulating issues weight-sized add_."""
    torch.manual_seed(0)
    model = _ProfiledLM(tied=True)
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    tokens = torch.randint(0, 50, (3, 7))
    model(tokens).backward()
    loss = model(tokens)
    with torch.profiler.profile(record_shapes=True) as prof:
        loss.backward()
    assert _weight_sized_ops(prof, shapes, _COPY_OPS)
    assert {e.name for e in prof.events()} & _SORT_OPS


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("batch_shape", [(), (5,), (2, 3), (2, 1, 4)])
def test_linear_any_leading_dims(bias, batch_shape):
    torch.manual_seed(0)
    layer = nn.Linear(6, 4, bias=bias).double()
    oracle = copy.deepcopy(layer)
    flat = flatgrad.FlatGrad(layer, config=ROUTE_ALL)
    for seed in range(2):
        x = torch.randn(*batch_shape, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        _backward_both(flat, oracle, x, lambda out: out.sin().sum())
    assert_same_grads(flat, oracle)


def test_linear_non_contiguous_output_gradient():
    # The output goes through a transpose (as a fused qkv projection's does through a
    # permute), so the gradient reaching the layer's backward is not contiguous.
    torch.manual_seed(0)
    layer = nn.Linear(6, 4).double()
    oracle = copy.deepcopy(layer)
    flat = flatgrad.FlatGrad(layer, config=ROUTE_ALL)
    x = torch.randn(2, 3, 6, dtype=torch.float64)
    scale = torch.randn(3, 2, 4, dtype=torch.float64)
    _backward_both(flat, oracle, x, lambda out: (out.transpose(0, 1) * scale).sum())
    assert_same_grads(flat, oracle)


def _backward_both(flat: nn.Module, oracle: nn.Module, x: torch.Tensor, loss: Callable) -> None:
    """Backward of ``loss(module(x))`` through both on copies of `x`; input gradients equal."""
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss(flat(xa)).backward()
    loss(oracle(xb)).backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"padding_idx": 0},
        {"padding_idx": -1},
        {"scale_grad_by_freq": True},
        {"scale_grad_by_freq": True, "padding_idx": 2},
        {"max_norm": 1.0},
        {"max_norm": 0.5, "norm_type": 1.0},
    ],
)
def test_embedding_options_match_stock(kwargs):
    torch.manual_seed(0)
    emb = nn.Embedding(9, 5, **kwargs).double()
    oracle = copy.deepcopy(emb)
    flat = flatgrad.FlatGrad(emb, config=ROUTE_ALL)
    for seed in range(3):
        idx = torch.randint(0, 9, (4, 6), generator=torch.Generator().manual_seed(seed))
        flat(idx).pow(3).sum().backward()
        oracle(idx).pow(3).sum().backward()
    torch.testing.assert_close(emb.weight, oracle.weight, rtol=0, atol=0)  # max_norm renorm
    assert_same_grads(flat, oracle)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kwargs", [{}, {"padding_idx": 1}, {"scale_grad_by_freq": True}])
@pytest.mark.parametrize(
    # summed as stock (a table no longer than the rows, or deterministic), or at first positions
    ("vocab", "deterministic"),
    [(64, False), (400, False), (400, True)],
)
def test_accumulating_embedding_rows_sums_repeats_first_as_stock(dtype, kwargs, vocab, deterministic):
    """An embedding accumulating over micro-batches whose indices repeat (every row read
    about 6 times a batch): stock adds the batch's summed rows to `.grad`, g + (r1 + r2), and
    so must the slot, to the bit (row by row it would be (g + r1) + r2). In bfloat16/float16
    stock's sum rounds after each row's add: `index_put_`'s, not `index_add_`'s. With
    ``scale_grad_by_freq`` stock adds each row times ``1 / count`` with its add kernel's
    multiply-add: the rows are scattered one count at a time with that scale, not divided."""
    torch.manual_seed(0)
    emb = nn.Embedding(vocab, 8, **kwargs).to(dtype)
    oracle = copy.deepcopy(emb)
    flat = flatgrad.FlatGrad(emb, config=ROUTE_ALL)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        tokens = torch.randint(0, 16, (4, 24), generator=gen)  # (rows 0-15: each read about 6 times)
        for model in (flat, oracle):
            torch.use_deterministic_algorithms(deterministic)
            try:
                model(tokens).sin().sum().backward()
            finally:
                torch.use_deterministic_algorithms(False)
    assert torch.equal(flat.weight.grad, oracle.weight.grad)  # the bits: values, and the signs of zeros
    assert torch.equal(flat.weight.grad.signbit(), oracle.weight.grad.signbit())
    assert grad_in_buffers(flat, flat.weight.grad)


def test_scale_grad_by_freq_divides_counts_past_half_precision_in_float32():
    """Where the rows are divided by their counts (``create_graph=True`` here; every backward
    on accelerators), the counts are float32: a float16 count of 70000 overflows to inf and
    would zero the row's gradient. (Stock's own float16 sum of 70000 such rows stalls far
    below the true 0.5: the value is checked, not stock's.)"""
    emb = nn.Embedding(4, 2, scale_grad_by_freq=True).half()
    flat = flatgrad.FlatGrad(emb, config=ROUTE_ALL)
    tokens = torch.zeros(70000, dtype=torch.long)  # row 0 read 70000 times
    flat(tokens).backward(torch.full((70000, 2), 0.5, dtype=torch.float16), create_graph=True)
    torch.testing.assert_close(emb.weight.grad[0].float(), torch.full((2,), 0.5), rtol=0.02, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("alpha", [1.0, 0.5])
@pytest.mark.parametrize(
    ("shape", "count", "index_dtype"),
    [((300, 4), 64, torch.int64), ((300, 4), 64, torch.int32), ((300, 2, 3), 64, torch.int64),
     ((20, 4), 64, torch.int64), ((300, 4), 0, torch.int64)],
)  # fmt: skip
def test_add_rows_is_the_gradient_plus_stocks_summed_rows(dtype, alpha, shape, count, index_dtype):
    """`add_rows` against its definition, ``g + alpha * zeros.index_add_(rows)`` (stock's
    dense sum, then AccumulateGrad's add), bit for bit: both of its paths (a table longer or
    shorter than the rows), int32 indices, an empty batch, a 3-D table, NaN and inf rows."""
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(shape, generator=gen, dtype=dtype)
    index = torch.randint(0, 12, (count,), generator=gen).to(index_dtype)  # (repeats: 12 rows read)
    rows = torch.randn((count, *shape[1:]), generator=gen, dtype=dtype)
    if count:
        rows[3], rows[7] = float("nan"), float("inf")
    expected = g + alpha * torch.zeros_like(g).index_add_(0, index, rows)
    add_rows(g, index, rows, alpha)
    bits = torch.int32 if dtype == torch.float32 else torch.int64
    assert torch.equal(g.view(bits), expected.view(bits))


def test_a_tied_lm_first_backward_is_stock_to_the_bit():
    """A tied table's two writers in one backward: the routed head writes the slot, then the
    lookup adds its rows, summed per index first (stock's input buffer adds the head's
    gradient and the lookup's summed rows): float32 bits equal, with every token repeated."""
    torch.manual_seed(0)
    model = TiedLM()
    oracle = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    tokens = torch.randint(0, 13, (8, 16), generator=torch.Generator().manual_seed(1))
    flat(tokens).backward()
    oracle(tokens).backward()
    for p, q in zip(flat.parameters(), oracle.parameters()):
        assert torch.equal(p.grad.view(torch.int32), q.grad.view(torch.int32))


def test_gather_with_index_add_matches_indexing():
    torch.manual_seed(0)
    table = torch.randn(20, dtype=torch.float64, requires_grad=True)
    ref = table.detach().clone().requires_grad_()
    idx = torch.randint(0, 20, (1000,))
    weights = torch.randn(1000, dtype=torch.float64)
    out = flatgrad.gather_with_index_add(table, idx)
    torch.testing.assert_close(out, ref[idx], rtol=0, atol=0)
    (out * weights).sum().backward()
    (ref[idx] * weights).sum().backward()
    torch.testing.assert_close(table.grad, ref.grad, rtol=1e-12, atol=1e-12)


def test_gather_with_index_add_multidim_indices_and_rows():
    table = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([[0, 6, 6], [1, 1, 1]])
    out = flatgrad.gather_with_index_add(table, idx)
    assert out.shape == (2, 3, 3)
    out.sum().backward()
    expected = torch.zeros(7, 3, dtype=torch.float64)
    expected[0], expected[6], expected[1] = 1, 2, 3
    torch.testing.assert_close(table.grad, expected, rtol=0, atol=0)


def test_gather_of_a_wrapped_parameter_writes_its_slot():
    class Scalars(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.randn(20, dtype=torch.float64))

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return flatgrad.gather_with_index_add(self.table, idx).square().sum()

    model = Scalars()
    oracle = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    idx = torch.randint(0, 20, (500,))
    for step in range(2):
        with torch.profiler.profile(record_shapes=True) as prof:
            flat(idx).backward()
        (oracle.table[idx]).square().sum().backward()
        # Accumulating, a table shorter than the indices is summed as stock sums it: the
        # rows into zeros of its size, then one add (`add_rows`, exact).
        expected = [] if step == 0 else ["aten::add_[[20], [20], []]"]
        assert _weight_sized_ops(prof, {(20,)}, _COPY_OPS) == expected
    assert_same_grads(flat, oracle)


@pytest.mark.parametrize("gather", ["rows", "dim"])
def test_a_seated_table_gathered_at_a_few_rows_reads_plus_zero_elsewhere(gather):
    """A raw parameter (seated: its slot filled with -0.0 for AccumulateGrad's add) gathered
    by a routed Function at a few positions: the slot is written as an empty `.grad`, so the
    positions nothing gathered read +0.0, the bits of stock's fresh gradient (a scatter into
    the -0.0 fill would leave -0.0 there)."""

    class Table(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.randn(4, 5, dtype=torch.float64))

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            if gather == "rows":
                return flatgrad.gather_with_index_add(self.table, idx).square().sum()
            return flatgrad.gather(self.table, 1, idx.expand(4, -1)).square().sum()

    model = Table()
    oracle = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    idx = torch.tensor([1, 1, 3])
    flat(idx).backward()
    if gather == "rows":
        oracle.table[idx].square().sum().backward()
    else:
        torch.gather(oracle.table, 1, idx.expand(4, -1)).square().sum().backward()
    assert torch.equal(torch.signbit(flat.table.grad), torch.signbit(oracle.table.grad))
    assert torch.equal(flat.table.grad, oracle.table.grad) and (oracle.table.grad == 0).any()
    assert grad_in_buffers(flat, flat.table.grad)


def test_gather_bad_input():
    with pytest.raises(TypeError, match="indices must be an int32 or int64 tensor, got torch.float32"):
        flatgrad.gather_with_index_add(torch.randn(3), torch.zeros(2))
    with pytest.raises(TypeError, match="buffer and indices must be tensors"):
        flatgrad.gather_with_index_add([1.0, 2.0], torch.zeros(2, dtype=torch.long))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="buffer must have at least one dimension"):
        flatgrad.gather_with_index_add(torch.tensor(1.0), torch.zeros(2, dtype=torch.long))


def test_deterministic_mode_takes_the_deterministic_path():
    torch.manual_seed(0)
    model = TiedLM().double()
    oracle = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    tokens = torch.randint(0, 13, (4, 6))
    torch.use_deterministic_algorithms(True)
    try:
        with torch.profiler.profile() as prof:
            flat(tokens).backward()
        first = flat.emb.weight.grad.clone()
        flat.zero_grad()
        flat(tokens).backward()
    finally:
        torch.use_deterministic_algorithms(False)
    names = {e.name for e in prof.events()}
    assert "aten::index_put_" in names and "aten::index_add_" not in names
    torch.testing.assert_close(flat.emb.weight.grad, first, rtol=0, atol=0)  # run to run
    oracle(tokens).backward()
    assert_same_grads(flat, oracle)


def test_user_tensor_hooks_see_the_gradient():
    torch.manual_seed(0)
    layer = nn.Linear(3, 3).double()
    oracle = copy.deepcopy(layer)
    flat = flatgrad.FlatGrad(layer, config=ROUTE_ALL)
    layer.weight.register_hook(lambda g: g * 3)
    oracle.weight.register_hook(lambda g: g * 3)
    x = torch.randn(4, 3, dtype=torch.float64)
    for _ in range(2):
        flat(x).sum().backward()
        oracle(x).sum().backward()
    assert_same_grads(flat, oracle)


def test_layer_used_twice_with_unrouted_use_of_same_weight():
    """A weight reached by two routed calls and one plain op in the same backward."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 4).double()
    oracle = copy.deepcopy(layer)
    flat = flatgrad.FlatGrad(layer, config=ROUTE_ALL)

    def run(mod: nn.Module) -> torch.Tensor:
        x = torch.ones(2, 4, dtype=torch.float64)
        return (mod(mod(x)) + x @ mod.weight).square().sum()

    for _ in range(2):
        run(flat).backward()
        run(oracle).backward()
        assert_same_grads(flat, oracle)
        flat.zero_grad()
        oracle.zero_grad()


def test_embedding_with_max_norm_used_twice_in_one_forward():
    torch.manual_seed(0)
    emb = nn.Embedding(9, 4, max_norm=0.5).double()
    oracle = copy.deepcopy(emb)
    flat = flatgrad.FlatGrad(emb)
    a, b = torch.tensor([[1, 2]]), torch.tensor([[2, 5]])
    (flat(a).sum() + flat(b).square().sum()).backward()
    (oracle(a).sum() + oracle(b).square().sum()).backward()
    assert_same_grads(flat, oracle)


def test_zero_copy_under_non_reentrant_checkpointing():
    torch.manual_seed(0)
    flat = flatgrad.FlatGrad(_ProfiledLM(tied=True), config=ROUTE_ALL)
    shapes = {tuple(p.shape) for p in flat.parameters() if p.dim() == 2}
    tokens = torch.randint(0, 50, (3, 7))
    for set_to_none in (True, True, False):  # (the recompute's reads are not counted as the next forward's)
        flat.zero_grad(set_to_none=set_to_none)
        loss = torch.utils.checkpoint.checkpoint(flat, tokens, use_reentrant=False)
        with torch.profiler.profile(record_shapes=True) as prof:
            loss.backward()
        summed = ["aten::add_[[50, 24], [50, 24], []]"] * 2 if not set_to_none else []  # (the tied table)
        assert _weight_sized_ops(prof, shapes, _COPY_OPS) == summed
        assert all(grad_in_buffers(flat, p.grad) for p in flat.parameters())


def test_gather_with_index_add_negative_indices_like_indexing():
    table = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    ref = table.detach().clone().requires_grad_(True)
    idx = torch.tensor([[-1, 0, -6], [5, -1, 2]])
    out = flatgrad.gather_with_index_add(table, idx)
    torch.testing.assert_close(out, ref[idx], rtol=0, atol=0)
    out.square().sum().backward()
    ref[idx].square().sum().backward()
    torch.testing.assert_close(table.grad, ref.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bad", [6, -7])
def test_gather_with_index_add_out_of_range_names_index_and_size(bad):
    table = torch.randn(6, 3)
    with pytest.raises(IndexError, match=rf"indices must lie in \[-6, 6\) for a buffer of 6 rows, got {bad}"):
        flatgrad.gather_with_index_add(table, torch.tensor([0, bad, 1]))
