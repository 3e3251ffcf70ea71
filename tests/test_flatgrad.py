"""FlatGrad against stock autograd (the oracle) in the hard cases, float64."""

from __future__ import annotations

import copy
import gc
import logging
import pickle
import re
import weakref
from unittest import mock

import pytest
import torch
import torch.utils.checkpoint
from conftest import ROUTE_ALL, TiedLM, assert_same_grads, grad_in_buffers, total_norm
from dist_utils import run_ranks
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import flatgrad
from flatgrad._buffer import owner_of
from flatgrad._flatgrad import engine_of


def _tokens(seed: int, shape: tuple[int, int] = (4, 6), vocab: int = 13) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def test_forward_and_module(tied_pair):
    flat, oracle = tied_pair
    tokens = _tokens(0)
    assert flat is not oracle and isinstance(flat, type(oracle)) and isinstance(flat, flatgrad.FlatGrad)
    assert type(flat).__name__ == type(oracle).__name__
    torch.testing.assert_close(flat(tokens), oracle(tokens), rtol=0, atol=0)


def test_accumulation_with_different_inputs(tied_pair):
    flat, oracle = tied_pair
    for seed in range(3):
        flat(_tokens(seed)).backward()
        oracle(_tokens(seed)).backward()
    assert_same_grads(flat, oracle)


def test_tied_weight_is_one_slot(tied_pair):
    flat, oracle = tied_pair
    assert flat.head.weight is flat.emb.weight
    num_elements = sum(p.numel() for p in flat.parameters())
    (buffer,) = flat.grad_buffers.values()
    assert buffer.numel() < num_elements + 5 * 64  # one slot per distinct parameter, plus padding
    flat(_tokens(1)).backward()
    oracle(_tokens(1)).backward()
    assert_same_grads(flat, oracle)


def test_optimizer_zero_grad_behind_the_wrappers_back(tied_pair):
    flat, oracle = tied_pair
    opt = torch.optim.SGD(flat.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()  # set_to_none=True: every .grad becomes None
        ref_opt.zero_grad()
        for micro in range(2):
            flat(_tokens(10 * step + micro)).backward()
            oracle(_tokens(10 * step + micro)).backward()
        assert_same_grads(flat, oracle)
        opt.step()
        ref_opt.step()
    for p, q in zip(flat.parameters(), oracle.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)


def test_zero_grad_keeps_views_when_not_setting_none(tied_pair):
    flat, oracle = tied_pair
    flat(_tokens(0)).backward()
    oracle(_tokens(0)).backward()
    flat.zero_grad(set_to_none=False)
    oracle.zero_grad(set_to_none=False)
    assert all(float(buf.abs().sum()) == 0 for buf in flat.grad_buffers.values())
    flat(_tokens(1)).backward()
    oracle(_tokens(1)).backward()
    assert_same_grads(flat, oracle)
    flat.zero_grad()
    assert all(p.grad is None for p in flat.parameters())


def test_zero_grad_set_to_none_false_is_one_fill_per_buffer(tied_pair):
    flat, _ = tied_pair
    flat(_tokens(0)).backward()
    with torch.profiler.profile() as prof:
        flat.zero_grad(set_to_none=False)
    fills = [e for e in prof.events() if e.name in ("aten::zero_", "aten::fill_")]
    assert len([e for e in fills if e.name == "aten::zero_"]) == len(flat.grad_buffers)


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 5)
        self.b = nn.Linear(5, 5)
        self.frozen = nn.Linear(5, 5)
        self.frozen.requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(5))

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        y = self.frozen(self.a(x)) * self.scale
        return (self.b(y) if use_b else y).pow(2).sum()


def test_unused_branch_and_frozen_parameters():
    torch.manual_seed(0)
    model = _Branchy().double()
    oracle = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    assert all(p not in engine_of(flat).store for p in model.frozen.parameters())
    x = torch.randn(3, 5, dtype=torch.float64)
    flat(x, False).backward()
    oracle(x, False).backward()
    assert_same_grads(flat, oracle)  # b's grads stay None
    flat(2 * x, True).backward()
    oracle(2 * x, True).backward()
    assert_same_grads(flat, oracle)


def test_autograd_grad_leaves_dot_grad_untouched(tied_pair):
    flat, oracle = tied_pair
    flat(_tokens(0)).backward()
    oracle(_tokens(0)).backward()
    before = {n: p.grad.clone() for n, p in flat.named_parameters()}
    params = list(flat.parameters())
    ours = torch.autograd.grad(flat(_tokens(1)), params)
    ref = torch.autograd.grad(oracle(_tokens(1)), list(oracle.parameters()))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        assert not grad_in_buffers(flat, a), "a captured gradient must not alias the buffer"
    for n, p in flat.named_parameters():
        torch.testing.assert_close(p.grad, before[n], rtol=0, atol=0)
    assert_same_grads(flat, oracle)


def test_autograd_grad_with_respect_to_input_only(tied_pair):
    flat, _ = tied_pair
    flat.zero_grad()
    hidden = flat.emb(_tokens(0)).detach().requires_grad_()
    (g,) = torch.autograd.grad(flat.head(flat.proj(hidden)).sum(), [hidden])
    assert g.shape == hidden.shape
    assert all(p.grad is None for p in flat.parameters())


def test_backward_with_inputs(tied_pair):
    flat, oracle = tied_pair
    flat(_tokens(0)).backward(inputs=[flat.proj.weight])
    oracle(_tokens(0)).backward(inputs=[oracle.proj.weight])
    assert_same_grads(flat, oracle)
    assert flat.emb.weight.grad is None


def test_activation_checkpointing(tied_pair):
    flat, oracle = tied_pair

    def run(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        hidden = torch.utils.checkpoint.checkpoint(
            lambda t: model.norm(torch.tanh(model.proj(model.emb(t)))), tokens, use_reentrant=False
        )
        return model.head(hidden).pow(2).mean()

    for seed in range(2):
        run(flat, _tokens(seed)).backward()
        run(oracle, _tokens(seed)).backward()
    assert_same_grads(flat, oracle)


def test_cpu_autocast_bfloat16():
    torch.manual_seed(0)
    model = TiedLM()
    oracle = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    for seed in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = flat(_tokens(seed))
            ref = oracle(_tokens(seed))
        loss.backward()
        ref.backward()
    # Both compute the matmuls in bfloat16 (8 mantissa bits); the same bf16 products may be
    # summed in another order, so allow a few bf16 ulps relative to the gradient scale.
    assert_same_grads(flat, oracle, rtol=2e-2, atol=2e-3)
    assert all(p.grad.dtype == torch.float32 for p in flat.parameters())


def test_double_backward_create_graph(tied_pair):
    flat, oracle = tied_pair

    def grad_penalty(model: nn.Module) -> torch.Tensor:
        loss = model(_tokens(3))
        grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
        return loss + sum(g.pow(2).sum() for g in grads)

    grad_penalty(flat).backward()
    grad_penalty(oracle).backward()
    for p, q in zip(flat.parameters(), oracle.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
    # create_graph leaves differentiable grads outside the buffer; norms settle them back.
    torch.testing.assert_close(flat.grad_norm(), total_norm([q.grad for q in oracle.parameters()]))
    assert all(grad_in_buffers(flat, p.grad) for p in flat.parameters())


@pytest.mark.parametrize(
    "convert, dtype",
    [
        (lambda m: m.to(torch.float64), torch.float64),
        (lambda m: m.double(), torch.float64),
        (lambda m: m.half(), torch.float16),
        (lambda m: m.to("cpu"), torch.float32),
    ],
)
def test_conversion_after_wrapping_rebuilds_buffers(convert, dtype):
    torch.manual_seed(0)
    model = TiedLM()
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    flat(_tokens(0)).backward()
    assert convert(flat) is flat
    assert list(flat.grad_buffers) == [(dtype, torch.device("cpu"))]
    assert all(grad_in_buffers(flat, p.grad) for p in flat.parameters())  # old grads moved in
    oracle = copy.deepcopy(model)
    for p in oracle.parameters():
        p.grad = None
    flat.zero_grad()
    flat(_tokens(1)).backward()
    oracle(_tokens(1)).backward()
    tol = 1e-3 if dtype == torch.float16 else 1e-6
    assert_same_grads(flat, oracle, rtol=tol, atol=tol)


def test_eval_and_no_grad_match_and_leave_grads(tied_pair):
    flat, oracle = tied_pair
    flat.eval()
    oracle.eval()
    with torch.no_grad():
        torch.testing.assert_close(flat(_tokens(0)), oracle(_tokens(0)), rtol=0, atol=0)
    assert all(p.grad is None for p in flat.parameters())
    flat(_tokens(1)).backward()
    oracle(_tokens(1)).backward()
    assert_same_grads(flat, oracle)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, 0.5, 0.0, -1.0, float("inf"), float("-inf")])
def test_grad_norm_and_clip_match_torch(tied_pair, norm_type):
    flat, oracle = tied_pair
    flat(_tokens(0)).backward()
    oracle(_tokens(0)).backward()
    torch.testing.assert_close(
        flat.grad_norm(norm_type),
        total_norm([p.grad for p in oracle.parameters()], norm_type),
        rtol=1e-12,
        atol=0,
    )
    total = flat.clip_grad_norm_(0.01, norm_type)
    ref_total = torch.nn.utils.clip_grad_norm_(oracle.parameters(), 0.01, norm_type)
    torch.testing.assert_close(total, ref_total, rtol=1e-12, atol=0)
    assert_same_grads(flat, oracle)


@pytest.mark.parametrize("max_norm", [1e6, 0.01])
def test_clip_under_max_norm_skips_the_scale_on_cpu(tied_pair, max_norm):
    # Oracle: stock clip_grad_norm_, which always multiplies, by exactly 1.0 when the norm is
    # under max_norm: skipping that multiply must leave every gradient bitwise as it was.
    flat, oracle = tied_pair
    flat(_tokens(0)).backward()
    oracle(_tokens(0)).backward()
    before = {name: p.grad.clone() for name, p in flat.named_parameters()}
    with _OpNames() as ops:
        total = flat.clip_grad_norm_(max_norm)
    ref_total = torch.nn.utils.clip_grad_norm_(oracle.parameters(), max_norm)
    torch.testing.assert_close(total, ref_total, rtol=1e-12, atol=0)
    assert_same_grads(flat, oracle)
    scales = [op for op in ops.names if "mul_" in op]  # the in-place scale, not max_norm / total
    if max_norm > total:
        assert scales == [], ops.names
        for name, p in flat.named_parameters():
            assert torch.equal(p.grad, before[name]), name
    else:
        assert scales, ops.names


class _OpNames(TorchDispatchMode):
    """Records the name of every op dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


def test_stale_slots_do_not_leak_into_norms(tied_pair):
    flat, oracle = tied_pair
    flat(_tokens(0)).backward()
    oracle(_tokens(0)).backward()
    for model in (flat, oracle):
        for p in model.proj.parameters():  # flatgrad's slots still hold the old values
            p.grad = None
    ref = total_norm([p.grad for p in oracle.parameters() if p.grad is not None])
    torch.testing.assert_close(flat.grad_norm(), ref, rtol=1e-12, atol=0)
    assert all(p.grad is None for p in flat.proj.parameters())


def test_clip_error_if_nonfinite(tied_pair):
    flat, _ = tied_pair
    flat(_tokens(0)).backward()
    flat.proj.weight.grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        flat.clip_grad_norm_(1.0, error_if_nonfinite=True)


def test_bad_norm_type(tied_pair):
    flat, _ = tied_pair
    with pytest.raises(ValueError, match=r"norm_type must be a number or \+-inf, got nan"):
        flat.grad_norm(float("nan"))


def test_state_dict_keys_both_directions(tied_pair):
    flat, oracle = tied_pair
    assert list(flat.state_dict()) == list(oracle.state_dict())
    fresh = TiedLM().double()
    flat.load_state_dict(fresh.state_dict())
    for (n, p), q in zip(flat.named_parameters(), fresh.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)
    oracle.load_state_dict(flat.state_dict())
    flat(_tokens(0)).backward()
    oracle(_tokens(0)).backward()
    assert_same_grads(flat, oracle)


def test_load_state_dict_assign_rebuilds(tied_pair):
    flat, oracle = tied_pair
    before = list(flat.grad_buffers.values())
    state = copy.deepcopy(oracle.state_dict())
    flat.load_state_dict(copy.deepcopy(state), assign=True)  # replaces the Parameters
    oracle.load_state_dict(copy.deepcopy(state), assign=True)
    assert all(b is not a for a in before for b in flat.grad_buffers.values())
    flat(_tokens(0)).backward()
    oracle(_tokens(0)).backward()
    assert_same_grads(flat, oracle)


def test_summary_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="flatgrad"):
        flatgrad.FlatGrad(nn.Linear(3, 4), config=ROUTE_ALL)
    (record,) = [r for r in caplog.records if r.name.startswith("flatgrad")]
    assert "1 buffer(s) for 2 parameters" in record.getMessage()
    assert "bytes" in record.getMessage()


def test_not_a_module():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got int"):
        flatgrad.FlatGrad(42)  # type: ignore[arg-type]


def test_no_trainable_parameters():
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="at least one parameter with requires_grad=True"):
        flatgrad.FlatGrad(frozen)
    with pytest.raises(ValueError, match="at least one parameter"):
        flatgrad.FlatGrad(nn.ReLU())


class _Recommender(nn.Module):
    """Sparse-gradient tables (an EmbeddingBag and an Embedding) feeding a dense MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(20, 4, mode="sum", sparse=True)
        self.emb = nn.Embedding(20, 4, sparse=True)
        self.mlp = nn.Linear(8, 1)
        self.double()

    def forward(self, idx: torch.Tensor, offsets: torch.Tensor, idx2: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([self.bag(idx, offsets), self.emb(idx2).sum(1)], 1)).square().mean()


def _recommender_batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return (
        torch.randint(0, 20, (12,), generator=gen),
        torch.tensor([0, 5, 9]),
        torch.randint(0, 20, (3, 2), generator=gen),
    )


def test_sparse_embeddings_keep_stock_sparse_gradients_outside_the_buffers():
    """Oracle: the same model unwrapped, SparseAdam on the tables and AdamW on the rest."""
    torch.manual_seed(0)
    model = _Recommender()
    ref = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model)

    def optimizers(m: _Recommender) -> list[torch.optim.Optimizer]:
        tables = [m.bag.weight, m.emb.weight]
        return [torch.optim.SparseAdam(tables, lr=0.1), torch.optim.AdamW(m.mlp.parameters(), lr=0.1)]

    ours, stock = optimizers(model), optimizers(ref)
    for step in range(3):
        batch = _recommender_batch(step)
        flat(*batch).backward()
        ref(*batch).backward()
        assert model.bag.weight.grad.is_sparse and model.emb.weight.grad.is_sparse
        assert grad_in_buffers(flat, model.mlp.weight.grad)
        dense = [p.grad.to_dense() for p in ref.parameters()]
        expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in dense]))
        torch.testing.assert_close(flat.grad_norm(), expected, rtol=1e-12, atol=0)
        for opt in ours + stock:
            opt.step()
        flat.zero_grad(set_to_none=step % 2 == 0)
        ref.zero_grad(set_to_none=step % 2 == 0)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)
    assert flat.emb.forward.__func__ is nn.Embedding.forward  # not routed


def test_a_model_of_sparse_embeddings_only_is_refused():
    with pytest.raises(ValueError, match="at least one parameter with requires_grad=True .*sparse"):
        flatgrad.FlatGrad(nn.ModuleDict({"emb": nn.Embedding(4, 2, sparse=True)}))


def test_a_frozen_tied_parameter_that_holds_a_grad_counts_once_in_the_norm():
    """Oracle: torch.nn.utils.clip_grad_norm_(model.parameters()) on a deep copy, which sees
    the tied embedding/head weight once."""
    torch.manual_seed(0)
    model = TiedLM().double()
    ref = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    tokens = torch.randint(0, 13, (3, 5), generator=torch.Generator().manual_seed(1))
    flat(tokens).backward()
    ref(tokens).backward()
    model.emb.weight.requires_grad_(False)  # frozen after the backward: its .grad stays
    ref.emb.weight.requires_grad_(False)
    torch.testing.assert_close(
        flat.grad_norm(),
        total_norm([p.grad for p in ref.parameters() if p.grad is not None]),
        rtol=1e-12,
        atol=0,
    )
    ours = flat.clip_grad_norm_(0.1)
    stock = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    torch.testing.assert_close(ours, stock, rtol=1e-12, atol=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-15)


def test_applying_twice_returns_the_model_and_another_config_or_an_outer_model_is_refused():
    model = nn.Linear(2, 2)
    assert flatgrad.FlatGrad(model, config=ROUTE_ALL) is model
    buffers = model.grad_buffers
    assert flatgrad.FlatGrad(model) is model and flatgrad.FlatGrad(model, config=ROUTE_ALL) is model
    assert model.grad_buffers == buffers  # (the same layout: nothing applied again)
    with pytest.raises(ValueError, match=r"already applied to this model, with another config"):
        flatgrad.FlatGrad(model, config={"align_bytes": 512})
    with pytest.raises(ValueError, match="flat buffer of another module FlatGrad was applied to"):
        flatgrad.FlatGrad(nn.Sequential(model), config=ROUTE_ALL)


def test_a_model_with_an_attribute_named_as_flatgrads_is_refused():
    class Clashing(nn.Linear):
        def grad_norm(self) -> float:
            return 0.0

    with pytest.raises(ValueError, match=r"Clashing has attributes named as .* \(grad_norm\)"):
        flatgrad.FlatGrad(Clashing(2, 2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_to_cuda_after_wrapping_moves_buffers():
    torch.manual_seed(0)
    model = TiedLM()
    oracle = copy.deepcopy(model).cuda()
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL).cuda()
    assert list(flat.grad_buffers) == [(torch.float32, torch.device("cuda", torch.cuda.current_device()))]
    tokens = _tokens(0).cuda()
    flat(tokens).backward()
    oracle(tokens).backward()
    assert_same_grads(flat, oracle, rtol=1e-5, atol=1e-6)  # float32 on GPU: kernels may differ


def test_linear_min_numel_routes_only_large_linears():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 1024)).double()  # 256 and 16384 elements
    oracle = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model, config={"linear_min_numel": 1000})
    assert "forward" not in vars(model[0]) and "forward" in vars(model[1])
    x = torch.randn(3, 16, dtype=torch.float64)
    for _ in range(2):
        flat(x).square().sum().backward()
        oracle(x).square().sum().backward()
        assert_same_grads(flat, oracle)
        flat.zero_grad()
        oracle.zero_grad()


# --- the model changing behind the wrapper's back ----------------------------------------


def _changed_model_cases():
    def replace_param(model):
        model.proj.weight = nn.Parameter(torch.randn(8, 8, dtype=torch.float64))

    def load_assign(model):
        model.load_state_dict(copy.deepcopy(TiedLM().double().state_dict()), assign=True)

    def unfreeze(model):
        model.norm.weight.requires_grad_(True)

    def inner_double(model):
        model.double()

    return {
        "load_assign": load_assign,
        "unfreeze": unfreeze,
        "double": inner_double,
    }


@pytest.mark.parametrize("case", list(_changed_model_cases()))
def test_parameters_changed_after_wrapping_are_picked_up(case):
    torch.manual_seed(0)
    model = TiedLM()
    if case != "double":
        model.double()
    if case == "unfreeze":
        model.norm.weight.requires_grad_(False)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    _changed_model_cases()[case](model)
    oracle = copy.deepcopy(model)
    flat(_tokens(0)).backward()
    oracle(_tokens(0)).backward()
    assert_same_grads(flat, oracle)
    torch.testing.assert_close(
        flat.grad_norm(),
        total_norm([p.grad for p in oracle.parameters() if p.grad is not None]),
    )


@pytest.mark.parametrize("how", ["setattr", "whole_dict"])
@pytest.mark.parametrize("where", ["backward", "grad_norm", "all_reduce_grads"])
def test_a_parameter_replaced_after_wrapping_is_refused_naming_it_until_relayout(where, how):
    """A parameter replaced (or added) behind the layout's back would leave a stale slot: the
    next backward (as it starts), norm or sync raises, naming it and the fix; forwards are
    left alone; after ``relayout()`` the model trains as its copy does, into the buffers.
    Also when code assigns a module's ``_parameters`` dict whole."""
    torch.manual_seed(0)
    model = TiedLM().double()
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    new = nn.Parameter(torch.randn(8, 8, dtype=torch.float64))
    if how == "setattr":
        model.proj.weight = new
    else:
        model.proj._parameters = {**model.proj._parameters, "weight": new}
    actions = {
        "backward": lambda: flat(_tokens(0)).backward(),
        "grad_norm": flat.grad_norm,
        "all_reduce_grads": flat.all_reduce_grads,
    }
    with pytest.raises(RuntimeError, match=r"proj.weight \(replaced\).*model.relayout\(\)"):
        actions[where]()
    with torch.no_grad():
        flat(_tokens(0))
    flat.relayout()
    oracle = copy.deepcopy(model)
    flat(_tokens(0)).backward()
    oracle(_tokens(0)).backward()
    assert_same_grads(flat, oracle)
    assert all(grad_in_buffers(flat, p.grad) for p in flat.parameters())


@pytest.mark.parametrize("first", ["zero_grad", "relayout"])
def test_a_table_resized_with_its_gradient_left_on_it_recovers_as_the_messages_say(first):
    """HF's ``resize_token_embeddings`` re-points ``.data`` and leaves the old ``.grad``. The backward is
    refused (call relayout()), and relayout() with that ``.grad`` too (set it to None first). Before,
    ``model.zero_grad()`` was refused with the backward's message, and a refused relayout() had already
    laid out half: the messages sent the user round in a loop. Now zero_grad() sets every ``.grad`` to None
    whatever the layout, a refused relayout() moves nothing, and after both the model trains as its copy."""
    torch.manual_seed(0)
    model = TiedLM().double()
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    flat(_tokens(0)).backward()
    store = flatgrad._flatgrad.engine_of(flat).store
    with torch.no_grad():
        model.emb.weight.data = torch.cat([model.emb.weight, torch.randn(3, 8, dtype=torch.float64)])
    with pytest.raises(RuntimeError, match=r"emb.weight \(re-pointed.*model.relayout\(\)"):
        flat(_tokens(1, vocab=16)).backward()
    if first == "relayout":
        with pytest.raises(RuntimeError, match=r"holds a .grad of shape \(13, 8\).*set it to None first"):
            flat.relayout()
        assert flatgrad._flatgrad.engine_of(flat).store is store  # (refused before anything moved)
    flat.zero_grad()
    assert all(p.grad is None for p in flat.parameters())
    flat.relayout()
    oracle = copy.deepcopy(model)
    flat(_tokens(1, vocab=16)).backward()
    oracle(_tokens(1, vocab=16)).backward()
    assert_same_grads(flat, oracle)
    assert all(grad_in_buffers(flat, p.grad) for p in flat.parameters())


def test_a_resized_table_with_main_grads_recovers_and_keeps_no_stale_main_grad():
    """The same recovery on a bfloat16 model with float32 main grads: before, zero_grad() left the main grads
    (relayout() then carried proj's old gradient, 0.1, into the new layout) and relayout() crashed copying
    the table's main grad of the old shape, after releasing the buffers. Now the main grads equal a fresh
    FlatGrad's after one backward."""

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj, self.emb, self.head = (
                nn.Linear(8, 8),
                nn.Embedding(13, 8),
                nn.Linear(8, 16, bias=False),
            )

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            logits = self.head(torch.tanh(self.proj(self.emb(t)))).float()
            return nn.functional.cross_entropy(logits.flatten(0, 1), t.flatten())

    torch.manual_seed(0)
    config = {"grad_dtype": "float32", "linear_min_numel": 0}
    model = LM().bfloat16()
    flat = flatgrad.FlatGrad(model, config=config)
    flat(_tokens(0)).backward()
    with torch.no_grad():
        model.emb.weight.data = torch.cat([model.emb.weight, torch.zeros(3, 8, dtype=torch.bfloat16)])
    with pytest.raises(RuntimeError, match="re-pointed"):
        flat(_tokens(1, vocab=16)).backward()
    flat.zero_grad()
    flat.relayout()
    flat(_tokens(1, vocab=16)).backward()
    fresh = copy.deepcopy(model)
    fresh.zero_grad()
    oracle = flatgrad.FlatGrad(fresh, config=config)
    oracle(_tokens(1, vocab=16)).backward()
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(flat.main_grad(p), oracle.main_grad(q))


@pytest.mark.parametrize("layer", ["proj.bias", "proj.weight", "emb.weight"])
def test_a_parameter_re_pointed_at_another_shape_is_refused_where_the_models_call_is_bypassed(layer):
    """``param.data = t`` of another shape, then a backward through a graph the model's own call did not
    make (a submodule called directly: no layout check as it starts). Before, a routed bias re-pointed at a
    broadcastable shape got a `.grad` of its old shape, unsummed ([5, 5, 5] where stock's is [15]), and a
    grown weight or table crashed in autograd's shape check naming neither; now the routed backward raises,
    naming the shapes and `relayout()`. A `.grad` of the old shape left on the parameter makes
    `relayout()` say to zero it first (it crashed copying it in); then the model trains as its copy (a
    Linear whose bias is broadcast is left unrouted: its bias's gradient is summed)."""
    torch.manual_seed(0)
    model = TiedLM().double()
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    flat(_tokens(0)).backward()
    param = model.get_parameter(layer)
    grown = {"proj.bias": (1,), "proj.weight": (8, 10), "emb.weight": (15, 8)}[layer]
    param.data = torch.randn(grown, dtype=torch.float64)
    x = torch.randn(3, 10 if layer == "proj.weight" else 8, dtype=torch.float64)
    call = {"proj": lambda m: m.proj(x), "emb": lambda m: m.emb(_tokens(0))}[layer.split(".")[0]]
    shapes = re.escape(f"{tuple(param.grad.shape)} was re-pointed at a tensor of shape {grown}")
    with pytest.raises(RuntimeError, match=rf"shape {shapes} .*relayout"):
        call(model).sum().backward()
    with pytest.raises(
        RuntimeError, match=r"holds a \.grad of shape .* set it to None first \(model.zero_grad"
    ):
        flat.relayout()
    flat.zero_grad()
    flat.relayout()
    oracle = copy.deepcopy(model)
    for m in (flat, oracle):
        call(m).sum().backward()
    flat.grad_buffers  # noqa: B018  (a gradient past the model's call lands outside; the buffers take it in)
    assert_same_grads(flat, oracle)


def test_a_parameter_removed_after_wrapping_is_named_by_its_path():
    """`layer.bias = None` (or ``del``) on one of several Linears: the refusal names ``1.bias``, where it
    said "bias of a Linear", which does not tell them apart; a parameter whose module left the model is
    still named by that module's class."""
    flat = flatgrad.FlatGrad(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)))
    flat[1].bias = None
    with pytest.raises(RuntimeError, match=r"changed after FlatGrad laid out .*: 1\.bias \(removed\);"):
        flat(torch.randn(2, 4)).sum().backward()
    flat[1].bias = nn.Parameter(torch.zeros(4))
    flat.relayout()
    flat[2] = nn.Linear(4, 1)
    with pytest.raises(
        RuntimeError, match=r"2\.weight \(added\), 2\.bias \(added\), weight of a Linear \(removed\)"
    ):
        flat(torch.randn(2, 4)).sum().backward()


def test_a_layer_converted_around_its_parameters_keeps_its_slots():
    """`convert_sync_batchnorm` rebuilds BatchNorm layers around the same parameters: no
    parameter changed, so nothing is refused and nothing laid out again."""
    flat = flatgrad.FlatGrad(_Rooted().double(), config=ROUTE_ALL)
    before = list(flat.grad_buffers.values())
    assert nn.SyncBatchNorm.convert_sync_batchnorm(flat) is flat
    assert isinstance(flat.body[2], nn.SyncBatchNorm)
    assert [b is a for a, b in zip(before, flat.grad_buffers.values())] == [True] * len(before)


def test_rebuild_while_a_graph_is_alive_uses_the_new_buffers():
    torch.manual_seed(0)
    flat = flatgrad.FlatGrad(TiedLM(), config=ROUTE_ALL)
    loss = flat(_tokens(0))
    flat.float()  # a no-op conversion, but a rebuild
    loss.backward()
    assert all(grad_in_buffers(flat, p.grad) for p in flat.parameters())


def test_swap_based_conversion_works():
    flat = flatgrad.FlatGrad(TiedLM(), config=ROUTE_ALL)
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        flat.double()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    flat(_tokens(0)).backward()
    assert list(flat.grad_buffers) == [(torch.float64, torch.device("cpu"))]
    assert all(grad_in_buffers(flat, p.grad) for p in flat.parameters())


def test_all_parameters_frozen_after_wrapping():
    flat = flatgrad.FlatGrad(nn.Linear(3, 3))
    flat.requires_grad_(False)
    flat.double()
    assert flat.grad_buffers == {}


def test_refused_wrap_leaves_the_model_untouched():
    model = nn.Sequential(nn.Linear(2, 2)).requires_grad_(False)
    with pytest.raises(ValueError):
        flatgrad.FlatGrad(model, config=ROUTE_ALL)
    assert "forward" not in vars(model[0])


def test_deepcopy_and_pickle_round_trip(tmp_path):
    torch.manual_seed(0)
    flat = flatgrad.FlatGrad(TiedLM().double(), config=ROUTE_ALL)
    flat(_tokens(0)).backward()
    for clone in (copy.deepcopy(flat), _pickled(flat, tmp_path)):
        assert clone.grad_buffers
        assert all(p.grad is None or grad_in_buffers(clone, p.grad) for p in clone.parameters())
        clone.zero_grad()
        flat.zero_grad()
        clone(_tokens(1)).backward()
        flat(_tokens(1)).backward()
        for p, q in zip(clone.parameters(), flat.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
            assert grad_in_buffers(clone, p.grad)


def test_copies_and_pickles_of_the_wrapped_model_own_no_slot(tmp_path):
    # Which store holds a parameter is flatgrad's table, not the parameter's: a copy or a
    # pickle of the model, or of the parameters alone (a plain torch.load with
    # weights_only=True too), is held by none: a second FlatGrad wraps it, and the original
    # keeps writing into its own buffers.
    torch.manual_seed(0)
    model = TiedLM().double()
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    path = tmp_path / "params.pt"
    torch.save(dict(model.named_parameters()), path)
    loaded = torch.load(path)  # (weights_only=True: the default)
    assert all(owner_of(p) is None for p in loaded.values())
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert isinstance(clone, flatgrad.FlatGrad) and isinstance(clone, TiedLM)
        assert all(owner_of(p) is not owner_of(q) for p, q in zip(clone.parameters(), model.parameters()))
        clone(_tokens(0)).backward()  # its own buffers
        assert all(grad_in_buffers(clone, p.grad) for p in clone.parameters())
    with pytest.raises(TypeError, match="use copy.deepcopy"):
        copy.copy(model)
    shallow = copy.copy(next(model.parameters()))  # (another object: not held)
    assert owner_of(shallow) is None and owner_of(next(model.parameters())) is not None
    flat(_tokens(0)).backward()
    assert all(grad_in_buffers(flat, p.grad) for p in model.parameters())


def _pickled(flat: flatgrad.FlatGrad, tmp_path) -> flatgrad.FlatGrad:
    path = tmp_path / "flat.pt"
    torch.save(flat, path)
    return torch.load(path, weights_only=False)


def test_state_dict_with_a_child_called_module():
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(3, 3)
            self.bn = nn.BatchNorm1d(3)

    model = Outer()
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    state = flat.state_dict()
    assert list(state) == list(model.state_dict())
    assert list(state._metadata) == list(model.state_dict()._metadata)
    flat.load_state_dict(state)
    flat.load_state_dict(Outer().state_dict())


def test_sparse_gradient_from_an_unrouted_op_lands_dense():
    class SparseLookup(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.randn(6, 2, dtype=torch.float64))

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return nn.functional.embedding(idx, self.table, sparse=True).sum()

    model = SparseLookup()
    oracle = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model)
    idx = torch.tensor([0, 3, 3])
    flat(idx).backward()
    oracle(idx).backward()
    torch.testing.assert_close(model.table.grad, oracle.table.grad.to_dense())
    assert grad_in_buffers(flat, model.table.grad)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
def test_linear_with_zero_features():
    layer = nn.Linear(0, 3)
    flat = flatgrad.FlatGrad(layer, config=ROUTE_ALL)
    flat(torch.randn(4, 0)).sum().backward()
    torch.testing.assert_close(layer.bias.grad, torch.full((3,), 4.0))


# --- every walk gives the plain model's names ------------------------------------------------


class _Rooted(nn.Module):
    """Parameters and buffers at the root beside the children (as CLIP's ``logit_scale`` or a
    ViT's ``cls_token``), a LayerNorm, a tied weight and a BatchNorm."""

    def __init__(self, body: str = "body") -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.register_buffer("shift", torch.zeros(4))
        self.register_buffer("scratch", torch.zeros(1), persistent=False)
        self.emb = nn.Embedding(11, 4)
        self.body_name = body
        self.add_module(body, nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.BatchNorm1d(5)))
        self.head = nn.Linear(4, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.get_submodule(self.body_name)(self.emb(tokens) * self.scale + self.shift)
        return nn.functional.cross_entropy(self.head(hidden).flatten(0, 1), tokens.flatten())


def trainer_style_names(model: nn.Module) -> list[str]:
    """transformers' ``trainer_pt_utils.get_parameter_names`` without its filters: recurses
    `named_children` and reads each module's own ``_parameters`` (what Trainer's weight-decay
    grouping is built from)."""
    names = [f"{name}.{n}" for name, child in model.named_children() for n in trainer_style_names(child)]
    return names + list(model._parameters)


def mingpt_groups(model: nn.Module) -> tuple[list[str], list[str]]:
    """minGPT's ``configure_optimizers`` (as Lightning modules copy it): each module's own
    parameters by full name, weights of Linears decayed, biases and LayerNorm/Embedding
    weights not; checked and resolved through `named_parameters` as there."""
    decay, no_decay = set(), set()
    for mn, m in model.named_modules():
        for pn, _ in m.named_parameters(recurse=False):
            fpn = f"{mn}.{pn}" if mn else pn
            if pn.endswith("weight") and isinstance(m, nn.Linear):
                decay.add(fpn)
            else:
                no_decay.add(fpn)
    params = dict(model.named_parameters())
    decay &= params.keys()  # a tied weight is named once, by named_parameters
    no_decay = (no_decay & params.keys()) - decay
    assert params.keys() == decay | no_decay
    for name, param in params.items():
        assert model.get_parameter(name) is param, name
    return sorted(decay), sorted(no_decay)


def assert_walks_name_the_plain_model(wrapped: nn.Module, plain: nn.Module, wrappers: set[nn.Module]) -> None:
    """Every module-walking API on `wrapped` (a model holding `wrappers` where `plain` holds
    the plain model, or the outermost wrapper itself) gives `plain`'s names."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    def names(items) -> list[str]:  # type: ignore[no-untyped-def]
        return [name for name, _ in items]

    assert names(wrapped.named_children()) == names(plain.named_children())
    assert list(wrapped.children()) == [child for _, child in wrapped.named_children()]
    modules = [(n, m) for n, m in wrapped.named_modules() if m not in wrappers]
    assert names(modules) == names(plain.named_modules())
    for (name, module), (_, ref) in zip(modules, plain.named_modules()):
        assert isinstance(module, type(ref)) and type(module).__name__ == type(ref).__name__
        found = wrapped.get_submodule(name)  # a holder's child is the wrapper, standing for the model
        assert found is module or (found in wrappers and found._plain_model is module), name
    for recurse in (True, False):
        assert names(wrapped.named_parameters(recurse=recurse)) == names(
            plain.named_parameters(recurse=recurse)
        )
        assert names(wrapped.named_buffers(recurse=recurse)) == names(plain.named_buffers(recurse=recurse))
    for name, param in wrapped.named_parameters():
        assert wrapped.get_parameter(name) is param, name
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    assert list(get_model_state_dict(wrapped)) == list(get_model_state_dict(plain))
    assert trainer_style_names(wrapped) == trainer_style_names(plain)
    assert mingpt_groups(wrapped) == mingpt_groups(plain)


@pytest.mark.parametrize("model", [TiedLM, _Rooted])
def test_every_walk_names_the_model_as_the_plain_one(model):
    """`named_children` (which transformers' Trainer recurses to choose the parameters it
    decays), `children`, `named_modules`, `get_submodule`, `named_parameters`,
    `named_buffers` (recursing or not), ``state_dict`` and torch.distributed.checkpoint keys,
    and minGPT's weight-decay grouping: the plain model's names, on the model FlatGrad was
    applied to and on a module holding it (nothing is between them)."""
    torch.manual_seed(0)
    plain = model().double()
    flat = flatgrad.FlatGrad(copy.deepcopy(plain), config=ROUTE_ALL)
    assert_walks_name_the_plain_model(flat, plain, set())
    assert_walks_name_the_plain_model(nn.ModuleDict({"net": flat}), nn.ModuleDict({"net": plain}), set())


def test_a_child_called_module_is_its_own():
    """A model whose child is called ``module``: walks, `get_submodule` and
    torch.distributed.checkpoint name and find the model's child (a checkpoint of the plain
    model loads into it)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(0)
    plain = _Rooted(body="module").double()
    flat = flatgrad.FlatGrad(copy.deepcopy(plain), config=ROUTE_ALL)
    assert_walks_name_the_plain_model(flat, plain, set())
    assert flat.get_submodule("module") is flat.module
    opts = [torch.optim.Adam(m.parameters()) for m in (flat, plain)]
    for model, opt in zip((flat, plain), opts):
        model(_tokens(0, (3, 5), vocab=11)).backward()
        opt.step()
    (model_sd, optim_sd), (ref_model_sd, ref_optim_sd) = (
        get_state_dict(m, o) for m, o in zip((flat, plain), opts)
    )
    assert model_sd.keys() == ref_model_sd.keys() and optim_sd["state"].keys() == ref_optim_sd["state"].keys()
    set_state_dict(flat, opts[0], model_state_dict=ref_model_sd, optim_state_dict=ref_optim_sd)


def test_nn_module_recursion_is_the_models_own():
    """`train`/`eval`, `apply` (each module once) and a conversion (each tensor once, through
    the model's own `_apply`, then the buffers laid out again) as on the plain model; the
    root's parameters are the model's own after a copy; state_dict round-trips, nested too."""
    torch.manual_seed(0)
    flat = flatgrad.FlatGrad(_Rooted().double(), config=ROUTE_ALL)
    plain = _Rooted().double()
    flat.eval()
    assert not flat.training and not flat.body[2].training
    flat.train()
    assert flat.training and flat.body[2].training
    calls: list[nn.Module] = []
    flat.apply(calls.append)
    plain_calls: list[nn.Module] = []
    plain.apply(plain_calls.append)
    assert [type(m).__name__ for m in calls] == [type(m).__name__ for m in plain_calls]
    assert len({id(m) for m in calls}) == len(calls) and calls[-1] is flat
    converted: list[int] = []

    def convert(tensor: torch.Tensor) -> torch.Tensor:
        converted.append(id(tensor))
        return tensor.float()

    copy.deepcopy(plain)._apply(convert)  # stock: each module converts its own (a tied one twice)
    num_stock = len(converted)
    converted.clear()
    tensors = {id(t) for t in [*flat.parameters(), *flat.buffers()]}
    with mock.patch.object(_Rooted, "_apply", autospec=True, side_effect=nn.Module._apply) as root_apply:
        flat._apply(convert)  # the model's own `_apply` (RNNs' does more), then the layout
    assert root_apply.call_count == 1
    assert len(converted) == num_stock and set(converted) == tensors
    assert flat.scale.dtype == torch.float32 and {key[0] for key in flat.grad_buffers} == {torch.float32}
    for clone in (copy.deepcopy(flat), pickle.loads(pickle.dumps(flat))):
        assert [n for n, _ in clone.named_parameters(recurse=False)] == ["scale"]
        assert {key[0] for key in clone.grad_buffers} == {torch.float32}
    holder = nn.ModuleDict({"net": flat})
    state = holder.state_dict()
    assert list(state) == ["net." + key for key in flat.state_dict()]
    holder.load_state_dict(state)
    flat.load_state_dict(plain.float().state_dict())


def _replicate_names_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    plain = _Rooted().double()
    model = copy.deepcopy(plain)
    assert flatgrad.replicate(model) is model
    assert isinstance(model, _Rooted) and isinstance(model, flatgrad.FlatGrad)
    assert isinstance(model, flatgrad.ReplicateModule) and type(model).__name__ == "_Rooted"
    assert_walks_name_the_plain_model(model, plain, set())
    holder, plain_holder = nn.ModuleDict({"net": model}), nn.ModuleDict({"net": plain})
    assert_walks_name_the_plain_model(holder, plain_holder, set())
    holder.load_state_dict(plain_holder.state_dict())  # nested: the plain keys, both directions
    model.float()  # lays the buffers out again; the buckets follow at the next forward
    assert {key[0] for key in model.grad_buffers} == {torch.float32}
    model(_tokens(rank, (3, 5), vocab=11)).backward()
    assert all(grad_in_buffers(model, p.grad) for p in model.parameters())
    with pytest.raises(ValueError, match="already applied"):
        flatgrad.replicate(model)


@pytest.mark.distributed
def test_replicate_keeps_the_models_class_and_names():
    """``flatgrad.replicate(model) is model``: still of its class (a FlatGrad and a
    ReplicateModule too), walked (children, modules, submodules, parameters and buffers,
    state_dict and torch.distributed.checkpoint keys, Trainer's and minGPT's weight-decay
    grouping) under its own names, alone and in a holder (2 gloo ranks)."""
    run_ranks(_replicate_names_worker)


@pytest.mark.parametrize(
    "make",
    [lambda: nn.LazyConv1d(4, 3), lambda: nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 2))],
    ids=["lazy_conv", "lazy_in_sequential"],
)
def test_a_lazy_module_before_its_first_forward_is_refused_with_what_to_do(make):
    """torch's module_db's lazy samples: a parameter with no shape has no slot; the message
    says to run a dummy forward first (DDP's advice), and after one the model wraps."""
    model = make()
    with pytest.raises(ValueError, match=r"not initialised yet \((weight|0.weight).*one dummy forward pass"):
        flatgrad.FlatGrad(model)
    model(torch.randn(2, 3, 5) if isinstance(model, nn.LazyConv1d) else torch.randn(2, 5))
    flat = flatgrad.FlatGrad(model)
    assert sum(b.numel() for b in flat.grad_buffers.values()) >= sum(p.numel() for p in model.parameters())


class _RootParameter(nn.Module):
    """A parameter of the model itself (a ViT's cls_token or pos_embed) beside a child's."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = nn.Parameter(torch.zeros(4))
        self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x + self.offset)


def _sequential() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


@pytest.mark.parametrize("make", [_sequential, _RootParameter])
def test_a_model_with_flatgrad_applied_is_freed_without_the_cycle_collector(make):
    """The engine holds its model weakly: dropping the model after a backward frees it (and
    its buffers) at once, as a plain model, with the cyclic collector off."""
    model = flatgrad.FlatGrad(make())
    model(torch.randn(3, 4)).sum().backward()
    model.clip_grad_norm_(1.0)
    gone = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert gone() is None
    finally:
        gc.enable()
