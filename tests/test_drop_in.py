"""Everyday training-loop paths around the core, each against stock PyTorch on a deep copy.

The oracle is the same loop run on the plain model; float64, so equal sums agree to
round-off (1e-12) and anything else is a real difference.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from conftest import ROUTE_ALL, CompileLM, TiedLM, assert_same_grads, grad_in_buffers, tiny_llama, total_norm
from oracle import assert_params_like
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.utils import parametrizations

import flatgrad
from flatgrad._backward import SEAT_MAX_NUMEL
from flatgrad._flatgrad import engine_of


def _tokens(seed: int, shape: tuple[int, int] = (4, 6), vocab: int = 13) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _pair(model: nn.Module | None = None, config=ROUTE_ALL) -> tuple[flatgrad.FlatGrad, nn.Module]:
    torch.manual_seed(0)
    model = TiedLM().double() if model is None else model
    oracle = copy.deepcopy(model)
    return flatgrad.FlatGrad(model, config=config), oracle


def _assert_params_equal(ours: nn.Module, ref: nn.Module) -> None:
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


def _stock_norm(model: nn.Module, norm_type: float = 2.0) -> torch.Tensor:
    return total_norm([p.grad for p in model.parameters() if p.grad is not None], norm_type)


# --- 1. non-finite steps: padding stays zero, the AMP recipe recovers -----------------------


class _Odd(nn.Module):
    """Slot sizes that are not multiples of the alignment, so the buffer has padding."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 3)
        self.b = nn.Linear(3, 7)
        self.norm = nn.LayerNorm(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.b(torch.tanh(self.a(x)))).square().mean()


def test_non_finite_step_leaves_padding_zero_and_next_steps_clean():
    flat, oracle = _pair(_Odd().double())
    (buffer,) = flat.grad_buffers.values()
    used = sum(p.numel() for p in flat.parameters())
    assert buffer.numel() > used  # there is padding to protect
    x = torch.randn(4, 5, dtype=torch.float64)
    for model in (flat, oracle):
        (model(x) * float("inf")).backward()
    flat.clip_grad_norm_(1.0)
    torch.nn.utils.clip_grad_norm_(oracle.parameters(), 1.0)
    for model in (flat, oracle):
        model.zero_grad()
        model(x).backward()
    torch.testing.assert_close(flat.grad_norm(), _stock_norm(oracle), rtol=1e-12, atol=0)
    assert torch.isfinite(flat.grad_norm())
    flat.clip_grad_norm_(1e-3)
    torch.nn.utils.clip_grad_norm_(oracle.parameters(), 1e-3)
    assert_same_grads(flat, oracle)


def test_grad_scaler_overflow_step_is_skipped_and_training_recovers():
    torch.manual_seed(0)
    model = _Odd()  # float32: GradScaler unscales float32 gradients
    oracle = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    runs = []
    for module, clip in ((flat, flat.clip_grad_norm_), (oracle, None)):
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for step in range(4):
            opt.zero_grad()
            x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step))
            loss = module(x) * (float("inf") if step == 1 else 1.0)  # step 1 overflows
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            if clip is not None:
                clip(1.0)
            else:
                torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        runs.append(scaler.get_scale())
    assert runs[0] == runs[1] < 1024.0  # one skipped step halved the scale on both sides
    assert all(torch.isfinite(p).all() for p in flat.parameters())
    for p, q in zip(flat.parameters(), oracle.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)  # float32 round-off


# --- 2. complex Linear -----------------------------------------------------------------------


def test_complex_linear_gradients_match_stock():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, dtype=torch.cdouble), nn.Linear(4, 2, dtype=torch.cdouble))
    flat, oracle = _pair(model)
    x = torch.randn(3, 4, dtype=torch.cdouble)
    for module in (flat, oracle):
        module(x).abs().sum().backward()
    assert_same_grads(flat, oracle)


# --- 3 and 8. freezing -------------------------------------------------------------------------


def test_zero_grad_clears_layers_frozen_after_wrapping_and_before():
    torch.manual_seed(0)
    model = TiedLM().double()
    model.norm.weight.grad = torch.ones_like(model.norm.weight)  # frozen before wrapping, with a grad
    model.norm.weight.requires_grad_(False)
    flat, oracle = _pair(model)
    for module in (flat, oracle):
        module(_tokens(0)).backward()
        module.proj.requires_grad_(False)
        module.zero_grad()
    assert all(p.grad is None for p in flat.parameters())
    assert all(p.grad is None for p in oracle.parameters())


def test_zero_grad_set_to_none_false_zeroes_frozen_grads_like_stock():
    flat, oracle = _pair()
    for module in (flat, oracle):
        module(_tokens(0)).backward()
    flat.proj.requires_grad_(False)
    oracle.proj.requires_grad_(False)
    flat.zero_grad(set_to_none=False)
    oracle.zero_grad(set_to_none=False)
    assert_same_grads(flat, oracle)


def test_freezing_between_backward_and_clip_still_counts_and_scales():
    flat, oracle = _pair()
    for module in (flat, oracle):
        module(_tokens(0)).backward()
    flat.proj.requires_grad_(False)
    oracle.proj.requires_grad_(False)
    total = flat.clip_grad_norm_(1e-3)
    ref = torch.nn.utils.clip_grad_norm_(oracle.parameters(), 1e-3)
    torch.testing.assert_close(total, ref, rtol=1e-12, atol=0)
    for p, q in zip(flat.parameters(), oracle.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)


# --- 4. parameters added or replaced after wrapping ----------------------------------------------


class _Lora(nn.Module):
    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base
        self.down = nn.Parameter(torch.randn(rank, base.in_features, dtype=base.weight.dtype))
        self.up = nn.Parameter(torch.randn(base.out_features, rank, dtype=base.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.down), self.up)


def _grow(case: str, model: nn.Module) -> None:
    torch.manual_seed(1)
    if case == "register_parameter":
        model.proj.register_parameter("extra", nn.Parameter(torch.ones(8, dtype=torch.float64)))
        model.proj.forward = lambda x, m=model.proj: F.linear(x, m.weight, m.bias) * m.extra
    elif case == "lora":
        model.proj = _Lora(model.proj)
    elif case == "replace_submodule":
        model.proj = nn.Linear(8, 8).double()
    elif case == "add_module":
        model.norm = nn.Sequential(model.norm, nn.Linear(8, 8).double())


@pytest.mark.parametrize("case", ["register_parameter", "lora", "replace_submodule", "add_module"])
def test_parameters_added_after_wrapping_are_refused_then_count_after_relayout(case):
    """Each way of adding or replacing parameters is refused as the next backward starts,
    naming them; after ``relayout()`` they count in gradients, norms and clipping as stock's
    (the old layers' gradients that existed before the change kept)."""
    flat, oracle = _pair()
    for module in (flat, oracle):
        module(_tokens(0)).backward()  # the old layer's grad exists before the change
    _grow(case, flat)
    _grow(case, oracle)
    with pytest.raises(RuntimeError, match=r"\((added|replaced)\).*model.relayout\(\)"):
        flat(_tokens(1)).backward()
    flat.relayout()
    for module in (flat, oracle):
        module.zero_grad()
        module(_tokens(1)).backward()
    assert_same_grads(flat, oracle)
    torch.testing.assert_close(flat.grad_norm(), _stock_norm(oracle), rtol=1e-12, atol=0)
    flat.clip_grad_norm_(1e-3)
    torch.nn.utils.clip_grad_norm_(oracle.parameters(), 1e-3)
    assert_same_grads(flat, oracle)


# --- 5 and 11. torch.func ------------------------------------------------------------------------


def test_functional_call_with_fast_weights_then_backward():
    flat, oracle = _pair()
    for module, inner in ((flat, flat), (oracle, oracle)):
        params = dict(inner.named_parameters())
        inner_loss = functional_call(module, params, (_tokens(0),))
        grads = torch.autograd.grad(inner_loss, list(params.values()), create_graph=True)
        fast = {name: p - 0.1 * g for (name, p), g in zip(params.items(), grads)}
        functional_call(module, fast, (_tokens(1),)).backward()
    assert_same_grads(flat, oracle, rtol=1e-10, atol=1e-12)


def test_torch_func_grad_and_vmap_per_sample_gradients():
    flat, oracle = _pair()
    tokens = _tokens(0)

    def per_sample(module: nn.Module) -> dict[str, torch.Tensor]:
        params = {k: v.detach() for k, v in module.named_parameters()}

        def loss(p: dict[str, torch.Tensor], row: torch.Tensor) -> torch.Tensor:
            return functional_call(module, p, (row.unsqueeze(0),))

        return vmap(grad(loss), in_dims=(None, 0))(params, tokens)

    ours, ref = per_sample(flat), per_sample(oracle)
    assert ours.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-12, atol=1e-12)
    assert all(p.grad is None for p in flat.parameters())


# --- 6. norm orders with two buffers ----------------------------------------------------------------


@pytest.mark.parametrize("norm_type", [0.0, 0.5, 1.0, 2.0, -1.0, math.inf, -math.inf])
def test_norm_orders_with_two_buffers_match_stock(norm_type):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6).double(), nn.Linear(6, 3))
    flat, oracle = _pair(model)
    x = torch.randn(5, 4, dtype=torch.float64)
    for seq in (flat, oracle):  # float64 layer then float32 layer: two buffers
        seq[1](seq[0](x).float()).sum().backward()
    assert len(flat.grad_buffers) == 2
    torch.testing.assert_close(flat.grad_norm(norm_type), _stock_norm(oracle, norm_type), rtol=1e-6, atol=0)
    total = flat.clip_grad_norm_(0.5, norm_type)
    ref = torch.nn.utils.clip_grad_norm_(oracle.parameters(), 0.5, norm_type)
    torch.testing.assert_close(total, ref, rtol=1e-6, atol=0)
    for p, q in zip(flat.parameters(), oracle.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)  # float32 half


# --- 7. parametrized layers ---------------------------------------------------------------------


def test_wrapping_a_spectral_norm_model_runs_no_model_code():
    torch.manual_seed(0)
    model = nn.Sequential(parametrizations.spectral_norm(nn.Linear(6, 6).double()), nn.Linear(6, 2).double())
    oracle = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    x = torch.randn(3, 6, dtype=torch.float64)
    for _ in range(2):
        for module in (flat, oracle):
            module.zero_grad()
            module(x).sum().backward()
    torch.testing.assert_close(flat(x), oracle(x), rtol=0, atol=0)
    assert_same_grads(flat, oracle)


@pytest.mark.parametrize("relayout", [False, True])
def test_a_layer_parametrized_after_wrapping_gets_stocks_gradient_layout_and_bits(relayout):
    """`orthogonal` after FlatGrad: the Linear's weight is now computed (a transposed
    view), so its gradient is returned in the weight's layout, as stock's mm backward gives
    it, and the parametrization's backward gets stock's bits; `relayout()` unroutes it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    oracle = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    for module in (flat, oracle):
        torch.manual_seed(3)
        parametrizations.orthogonal(module[0])
    if relayout:
        flat.relayout()
    assert ("forward" in vars(flat[0])) != relayout  # (routed until laid out again)
    x = torch.randn(4, 16, dtype=torch.float64)
    seen: dict[str, torch.Tensor] = {}
    for name, module in (("flat", flat), ("stock", oracle)):
        with torch.nn.utils.parametrize.cached():
            module[0].weight.register_hook(lambda g, name=name: seen.setdefault(name, g))
            module(x).square().mean().backward()
    assert seen["flat"].stride() == seen["stock"].stride() == (1, 5)
    assert torch.equal(seen["flat"], seen["stock"])
    assert_same_grads(flat, oracle, rtol=0, atol=0)


# --- 9. rebuilds without grad mode --------------------------------------------------------------------


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_rebuilds_under_no_grad_and_inference_mode(mode):
    torch.manual_seed(0)
    model = TiedLM().double()
    oracle = copy.deepcopy(model)
    with mode():
        flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
        flat.proj.requires_grad_(False)
        oracle.proj.requires_grad_(False)
        flat.eval()(_tokens(9))  # first forward after the freeze rebuilds here
    with torch.no_grad():  # conversions and copies (under inference_mode they would make
        clone = copy.deepcopy(flat)  # inference-tensor parameters, for stock too)
        flat.float().double()
    assert isinstance(clone, flatgrad.FlatGrad)
    flat.train()
    flat(_tokens(0)).backward()
    oracle(_tokens(0)).backward()
    assert_same_grads(flat, oracle)


# --- 10. param.data of a new shape -----------------------------------------------------------------------


@pytest.mark.parametrize("found_by", ["norm", "backward"])
def test_growing_a_vocabulary_through_param_data(found_by):
    """``p.data = `` a tensor of another shape is refused as a re-pointed parameter, naming
    it (and its tied twin), by the next norm or as the next backward starts (not laid out
    again behind the caller's back), until ``relayout()``; then it trains as stock."""
    flat, oracle = _pair()
    for module in (flat, oracle):
        module(_tokens(0)).backward()
    torch.manual_seed(5)
    rows = torch.randn(4, 8, dtype=torch.float64)
    for inner in (flat, oracle):
        inner.zero_grad()
        inner.emb.weight.data = torch.cat([inner.emb.weight.data, rows])
        inner.emb.num_embeddings = 17
    with pytest.raises(RuntimeError, match=r"emb.weight \(re-pointed: shape \(13, 8\) -> \(17, 8\)\)"):
        flat.grad_norm() if found_by == "norm" else flat(_tokens(1, vocab=17)).backward()
    flat.relayout()
    for module in (flat, oracle):
        module(_tokens(1, vocab=17)).backward()
    assert_same_grads(flat, oracle)
    torch.testing.assert_close(flat.grad_norm(), _stock_norm(oracle), rtol=1e-12, atol=0)


# --- 11. a backward that raises --------------------------------------------------------------------------


class _Raise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise FloatingPointError("a check inside the backward")


@pytest.mark.parametrize("raised_by", ["function", "hook"])
@pytest.mark.parametrize("config", [None, ROUTE_ALL], ids=["default", "routed"])
def test_a_backward_that_raises_leaves_grad_none_where_stock_does(config, raised_by):
    """A backward that raises part-way (a check in a Function's backward, a tensor hook on a
    weight whose layer is routed) leaves `.grad` None on the parameters it did not reach, as
    stock's: the slots seated for it go back (not zero-filled `.grad` that AdamW's decay
    would step), on its very return, before the caller's next step; then training goes on
    as stock's."""
    torch.manual_seed(0)
    middle = _RaiseLayer() if raised_by == "function" else nn.Tanh()
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), middle, nn.Linear(16, 4)).double()
    oracle = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model, config=config)
    x = torch.randn(5, 8, dtype=torch.float64)
    for module in (flat, oracle):
        hook = None
        if raised_by == "hook":
            hook = module[0].weight.register_hook(_raise)
        with pytest.raises(FloatingPointError):
            module(x).square().sum().backward()
        if hook is not None:
            hook.remove()
    assert [p.grad is None for p in flat.parameters()] == [p.grad is None for p in oracle.parameters()]
    assert any(p.grad is None for p in oracle.parameters())
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1) for m in (flat, oracle)]
    for step in range(2):
        for optimizer in optimizers:
            optimizer.step()
        for (name, p), q in zip(flat.named_parameters(), oracle.parameters()):
            assert torch.equal(p, q), (step, name)
        if raised_by == "function":
            break
        for module, optimizer in zip((flat, oracle), optimizers):
            optimizer.zero_grad()
            module(x).square().sum().backward()
        assert_same_grads(flat, oracle, rtol=0, atol=0)


class _RaiseLayer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Raise.apply(x)


def _raise(grad: torch.Tensor) -> None:
    raise FloatingPointError("a check on the gradient")


# --- 12. torch.distributed.checkpoint state dicts --------------------------------------------------------


def test_distributed_checkpoint_state_dicts_have_the_plain_model_keys():
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    flat, oracle = _pair()
    opt = torch.optim.Adam(flat.parameters())
    ref_opt = torch.optim.Adam(oracle.parameters())
    for module, optimizer in ((flat, opt), (oracle, ref_opt)):
        module(_tokens(0)).backward()
        optimizer.step()
    assert get_model_state_dict(flat).keys() == get_model_state_dict(oracle).keys()
    model_sd, optim_sd = get_state_dict(flat, opt)
    ref_model_sd, ref_optim_sd = get_state_dict(oracle, ref_opt)
    assert model_sd.keys() == ref_model_sd.keys()
    assert optim_sd["state"].keys() == ref_optim_sd["state"].keys()
    assert get_optimizer_state_dict(flat, opt)["state"].keys() == ref_optim_sd["state"].keys()
    # a checkpoint of the plain model loads into the wrapper and back
    set_model_state_dict(flat, ref_model_sd)
    set_optimizer_state_dict(flat, opt, ref_optim_sd)
    _assert_params_equal(flat, oracle)


def test_named_parameters_are_the_plain_model_names_and_resolve():
    flat, oracle = _pair()
    assert [n for n, _ in flat.named_parameters()] == [n for n, _ in oracle.named_parameters()]
    for name, param in flat.named_parameters():
        assert flat.get_parameter(name) is param
    assert [n for n, _ in flat.named_modules()] == [n for n, _ in oracle.named_modules()]
    holder, plain_holder = nn.ModuleDict({"net": flat}), nn.ModuleDict({"net": oracle})
    assert [n for n, _ in holder.named_parameters()] == [n for n, _ in plain_holder.named_parameters()]
    assert list(holder.parameters()) == list(flat.parameters())


def test_grads_live_in_the_buffer_right_after_backward():
    flat, oracle = _pair()
    flat.zero_grad()
    flat(_tokens(0)).backward()
    grads = {name: p.grad for name, p in flat.named_parameters()}
    (buffer,) = engine_of(flat).store.buffers.values()  # no settling: as backward left them
    for name, g in grads.items():
        assert g.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr(), name
    assert grad_in_buffers(flat, flat.norm.weight.grad)


class _SkipsForward(nn.Module):
    """Uses a Linear's weight without calling the Linear (as `nn.MultiheadAttention` does
    with its out_proj): a routed layer whose gradient comes through plain autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.out = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(F.linear(x, self.lin.weight, self.lin.bias))).square().mean()


class _Mean(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.square().mean()


def _attention() -> nn.Module:
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), _Mean())


@pytest.mark.parametrize("build", [_SkipsForward, _attention], ids=["functional", "attention"])
def test_a_layer_whose_owner_skips_its_forward_lands_in_the_buffer_from_the_first_backward(build):
    torch.manual_seed(0)
    flat, oracle = _pair(build().double(), config=ROUTE_ALL)
    width = 6 if build is _SkipsForward else 16
    mha = [m for m in flat.modules() if isinstance(m, nn.MultiheadAttention)]
    assert all("forward" not in m.out_proj.__dict__ for m in mha)  # never called: not routed
    for step in range(4):
        if step != 1:  # step 1 accumulates onto step 0
            flat.zero_grad()
            oracle.zero_grad()
        x = torch.randn(3, 5, width, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        for model in (flat, oracle):
            model(x).backward()
        (buffer,) = engine_of(flat).store.buffers.values()  # as backward left them, before any settling
        for name, param in flat.named_parameters():
            assert param.grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr(), name
        assert_same_grads(flat, oracle)


# --- torch.compile --------------------------------------------------------------------------------


def test_dynamo_explain_counts_equal_stock():
    torch._dynamo.reset()
    flat, oracle = _pair(CompileLM().double())
    tokens = _tokens(0, vocab=64)
    stock = torch._dynamo.explain(oracle)(tokens)
    torch._dynamo.reset()
    ours = torch._dynamo.explain(flat)(tokens)
    torch._dynamo.reset()
    inner = torch._dynamo.explain(flatgrad.FlatGrad(copy.deepcopy(oracle), config=ROUTE_ALL))(tokens)
    assert (stock.graph_count, stock.graph_break_count) == (1, 0)
    assert (ours.graph_count, ours.graph_break_count) == (1, 0)
    assert (inner.graph_count, inner.graph_break_count) == (1, 0)
    torch._dynamo.reset()
    seq = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).double()  # a torch container root
    x = torch.randn(3, 8, dtype=torch.float64)
    stock = torch._dynamo.explain(seq)(x)
    torch._dynamo.reset()
    ours = torch._dynamo.explain(flatgrad.FlatGrad(copy.deepcopy(seq), config=ROUTE_ALL))(x)
    counts = (ours.graph_count, ours.graph_break_count)
    assert counts == (stock.graph_count, stock.graph_break_count) == (1, 0)
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("where", ["outside", "inside"])
def test_compiled_gradients_equal_stock_and_live_in_the_buffer(backend, where):
    torch._dynamo.reset()
    model = CompileLM().double()
    oracle = copy.deepcopy(model)
    if where == "outside":  # torch.compile(FlatGrad(model))
        flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
        run = torch.compile(flat, backend=backend)
    else:  # FlatGrad(torch.compile(model))
        flat = run = flatgrad.FlatGrad(torch.compile(model, backend=backend), config=ROUTE_ALL)
    ref = torch.compile(oracle, backend=backend)
    for step in range(3):
        flat.zero_grad()
        oracle.zero_grad()
        run(_tokens(step, vocab=64)).backward()
        ref(_tokens(step, vocab=64)).backward()
        # from the first step on, as backward left them (before any settling)
        (buffer,) = engine_of(flat).store.buffers.values()
        storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
        assert storages == {buffer.untyped_storage().data_ptr()}, step
        for p, q in zip(model.parameters(), oracle.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
    torch._dynamo.reset()


@pytest.mark.parametrize("config", [None, ROUTE_ALL], ids=["default", "route-all"])
def test_compiled_autograd_gradients_equal_stock(config):
    """Compiled autograd traces backward (the routed Functions' and the seating hook) with
    Dynamo: routed layers hand their gradients to the traced AccumulateGrad as stock's do,
    and the next norm moves them into the buffer."""
    from torch._dynamo import compiled_autograd

    # (`_enable` on newer torches; torch 2.4 has the same context manager as `enable`)
    enable = getattr(compiled_autograd, "_enable", None) or compiled_autograd.enable
    torch._dynamo.reset()
    flat, oracle = _pair(CompileLM().double(), config=config)
    opt = torch.optim.AdamW(flat.parameters(), lr=0.01, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(oracle.parameters(), lr=0.01, weight_decay=0.1)
    for step in range(2):
        for model in (flat, oracle):
            with enable(torch.compile(backend="aot_eager")):
                for micro in range(2):  # accumulation: the second backward adds
                    model(_tokens(10 * step + micro, vocab=64)).backward()
        flat.grad_buffers  # noqa: B018 (moves gradients that landed outside into their slots)
        assert_same_grads(flat, oracle)
        torch.testing.assert_close(
            flat.clip_grad_norm_(0.1), torch.nn.utils.clip_grad_norm_(oracle.parameters(), 0.1)
        )
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    _assert_params_equal(flat, oracle)
    torch._dynamo.reset()


class _AssignsGrad(TiedLM):
    """A tensor hook that sets a parameter's `.grad` during backward, before that
    parameter's AccumulateGrad runs (which then adds into that tensor)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        normed = self.norm(torch.tanh(self.proj(self.emb(tokens))))
        weight = self.norm.weight

        def assign(grad: torch.Tensor) -> None:  # runs before the norm's backward
            weight.grad = torch.ones_like(weight)

        normed.register_hook(assign)
        return self.head(normed).square().mean()


@pytest.mark.parametrize("config", [None, ROUTE_ALL], ids=["default", "route-all"])
def test_a_grad_assigned_by_a_hook_during_backward_is_kept_like_stock(config):
    flat, oracle = _pair(_AssignsGrad().double(), config=config)
    for model in (flat, oracle):
        model(_tokens(0)).backward()
    assert flat.norm.weight.grad is not None
    assert_same_grads(flat, oracle)


def test_load_state_dict_errors_name_the_plain_keys():
    flat, oracle = _pair()
    state = oracle.state_dict()
    state["bogus.weight"] = torch.zeros(1)
    del state["proj.bias"]
    with pytest.raises(RuntimeError, match='Missing key\\(s\\) in state_dict: "proj.bias"') as info:
        flat.load_state_dict(state)
    assert "module." not in str(info.value)
    result = flat.load_state_dict(state, strict=False)
    assert result.missing_keys == ["proj.bias"] and result.unexpected_keys == ["bogus.weight"]


class _BigRaw(nn.Module):
    """A large unrouted parameter (copied in by a pre-hook) next to small seated ones."""

    def __init__(self) -> None:
        super().__init__()
        # 163840 elements: at least SEAT_MAX_NUMEL (checked in the first test below)
        self.big = nn.Parameter(torch.randn(256, 640, dtype=torch.float64) / 16)
        self.unused_big = nn.Parameter(torch.randn(256, 640, dtype=torch.float64))
        self.norm = nn.LayerNorm(640).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x @ self.big).square().mean()


def test_large_unrouted_parameter_lands_in_the_buffer_like_stock():
    flat, oracle = _pair(_BigRaw())
    assert flat.big.numel() >= SEAT_MAX_NUMEL  # placed, not seated
    for step in range(3):
        if step != 1:  # step 1 accumulates onto step 0
            flat.zero_grad()
            oracle.zero_grad()
        x = torch.randn(8, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        flat(x).backward()
        oracle(x).backward()
        assert flat.unused_big.grad is None
        assert_same_grads(flat, oracle)
    grads = torch.autograd.grad(flat(x), [flat.big])
    torch.testing.assert_close(grads[0], torch.autograd.grad(oracle(x), [oracle.big])[0], rtol=1e-12, atol=0)
    assert_same_grads(flat, oracle)  # torch.autograd.grad left .grad alone


@pytest.mark.parametrize("case", ["routed", "default", "placed"])
def test_an_optimizer_stepping_inside_backward_matches_stock(case):
    """The optimizer-in-backward recipe: a post-accumulate-grad hook per parameter steps
    that parameter's own AdamW and drops its `.grad`, whether the gradient was written by a
    routed layer, added into a seated slot or copied in by a placed parameter's pre-hook."""
    if case == "placed":
        flat, oracle = _pair(_BigRaw(), config=None)
        inputs = [
            torch.randn(8, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
            for i in range(4)
        ]
    else:
        flat, oracle = _pair(config=ROUTE_ALL if case == "routed" else None)
        inputs = [_tokens(i) for i in range(4)]
    for model in (flat, oracle):
        steppers = {p: torch.optim.AdamW([p], lr=0.01, weight_decay=0.1) for p in model.parameters()}

        def step(param: torch.Tensor, steppers=steppers) -> None:
            steppers[param].step()
            steppers[param].zero_grad()

        for param in model.parameters():
            param.register_post_accumulate_grad_hook(step)
        for x in inputs:
            model(x).backward()
    _assert_params_equal(flat, oracle)
    assert all(p.grad is None for p in flat.parameters())


@pytest.mark.parametrize("config", [None, ROUTE_ALL], ids=["default", "routed"])
def test_post_accumulate_grad_hooks_run_in_stocks_order(config):
    """Hooks that see each parameter's final gradient (a user's own bucketing, an optimizer
    in backward) run in stock's order: a routed Linear's bias before its weight, as addmm's
    AccumulateGrad nodes run; on a tied LM, 2-D and 3-D inputs, with and without a bias."""
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {"lm": TiedLM(), "mlp": nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3, bias=False))}
    )
    model = model.double()
    oracle = copy.deepcopy(model)
    flatgrad.FlatGrad(model, config=config)
    orders = []
    for module in (model, oracle):
        order: list[str] = []
        for name, param in module.named_parameters():
            param.register_post_accumulate_grad_hook(lambda p, name=name, order=order: order.append(name))
        x = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        for inputs in (x, x[0]):
            (module["lm"](_tokens(0)) + module["mlp"](inputs).square().sum()).backward()
        orders.append(order)
    assert orders[0] == orders[1]


def test_ddp_kwargs_never_ask_for_ddps_default_bucket_size():
    """Accelerate drops a DDP kwarg equal to DDP's default (25 MB): several buckets again."""
    model = nn.Module()
    model.table = nn.Parameter(torch.zeros(6_200_000))  # 23.65 MiB: ceil + 1 would be 25
    flat = flatgrad.FlatGrad(model)
    kwargs = flat.ddp_kwargs()
    assert kwargs["bucket_cap_mb"] == 26
    assert kwargs["bucket_cap_mb"] * 2**20 > 6_200_000 * 4


def test_functional_call_with_top_level_parameter_names():
    """A parameter registered on the model's root: torch.func swaps it through the wrapper."""
    torch.manual_seed(0)
    model = _BigRaw()
    flat, oracle = _pair(model)
    x = torch.randn(4, 256, dtype=torch.float64)
    for module in (flat, oracle):
        params = {name: p.detach() * 2 for name, p in oracle.named_parameters()}
        out = functional_call(module, params, (x,))
        torch.testing.assert_close(out, functional_call(oracle, params, (x,)), rtol=0, atol=0)
    assert flat.big is model.big and "big" not in flat.__dict__  # restored, nothing left over
    assert isinstance(flat.big, nn.Parameter)


# --- 9. paths that reach the slot views themselves, and outputs, modes and sizes ------------


@pytest.mark.parametrize("config", [None, ROUTE_ALL], ids=["default", "route-all"])
def test_grad_data_assignment_is_followed_like_stock(config):
    """``p.grad.data = ...`` (older training code) re-points the `.grad` object, which is
    the slot view, at other memory: the next backward, norm and clip still give stock's."""
    flat, oracle = _pair(config=config)
    for step in range(3):
        for module in (flat, oracle):
            for param in module.parameters():
                param.grad = None
        flat(_tokens(step)).backward()
        oracle(_tokens(step)).backward()
        for module in (flat, oracle):
            for param in module.parameters():
                param.grad.data = param.grad.data.clamp(-0.01, 0.01)
        flat.grad_buffers  # noqa: B018 (reading it moves the re-pointed gradients in)
        assert_same_grads(flat, oracle)
        flat(_tokens(step + 7)).backward()  # accumulates onto the clamped values
        oracle(_tokens(step + 7)).backward()
        assert_same_grads(flat, oracle)
        for module in (flat, oracle):
            for param in module.parameters():
                param.grad.data = param.grad.data * 3
        total = flat.clip_grad_norm_(0.05)
        torch.testing.assert_close(total, torch.nn.utils.clip_grad_norm_(oracle.parameters(), 0.05))
        assert_same_grads(flat, oracle)


@pytest.mark.parametrize("convert", ["double", "channels_last"])
def test_converting_the_inner_model_while_grads_exist(convert):
    """`nn.Module._apply` converts each `.grad` through ``grad.data = fn(grad)``: the slot
    views themselves change, behind the wrapper; the next backward must still be stock's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(64, 300), nn.Linear(300, 2))
    flat, oracle = _pair(model, config=None)  # the Linear(64, 300) is routed, the rest seated
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    flat(x).square().sum().backward()
    oracle(x).square().sum().backward()
    for module in (flat, oracle):
        if convert == "double":
            module.double()
        else:
            module.to(memory_format=torch.channels_last)
    x = x.double() if convert == "double" else x
    for zero in (True, False):  # empty slots, then accumulating onto the converted grads
        if zero:
            for module in (flat, oracle):
                module.zero_grad()
        flat(x).square().sum().backward()
        oracle(x).square().sum().backward()
        assert_same_grads(flat, oracle, rtol=1e-6 if convert != "double" else 1e-12, atol=1e-6)
    assert {key[0] for key in flat.grad_buffers} == {next(oracle.parameters()).dtype}


def test_freezing_between_forward_and_backward_leaves_grad_none_like_stock():
    """AccumulateGrad skips a parameter that stopped requiring grad after the forward; so
    do the routed backwards and the pre-hook of large unrouted parameters."""
    for model, x in (
        (TiedLM().double(), _tokens(0)),
        (_BigRaw(), torch.randn(4, 256, dtype=torch.float64)),
    ):
        flat, oracle = _pair(model)
        losses = flat(x), oracle(x)
        for module in (flat, oracle):
            for name, param in module.named_parameters():
                if name in ("emb.weight", "proj.weight", "big", "norm.weight"):
                    param.requires_grad_(False)
        for loss in losses:
            loss.backward()
        flat.grad_buffers  # noqa: B018 (the frozen ones leave the buffers: laid out again)
        assert_same_grads(flat, oracle)


def test_forward_mode_ad_through_routed_layers():
    """The routed Functions have no jvp: inside a forward-AD level the layers are plain
    torch, as under torch.func."""
    import torch.autograd.forward_ad as fwad

    flat, oracle = _pair()
    for module in (flat, oracle):
        module.emb.weight.requires_grad_(False)  # a dual input of the head instead
    hidden = torch.randn(4, 6, 8, dtype=torch.float64)
    tangent = torch.randn_like(hidden)
    results = []
    for module in (flat, oracle):
        with fwad.dual_level():
            out = module.head(module.proj(fwad.make_dual(hidden, tangent)))
            results.append(fwad.unpack_dual(out))
    torch.testing.assert_close(results[0].primal, results[1].primal, rtol=0, atol=0)
    torch.testing.assert_close(results[0].tangent, results[1].tangent, rtol=1e-12, atol=1e-12)
    table = torch.randn(13, 8, dtype=torch.float64)
    with fwad.dual_level():
        dual = fwad.make_dual(table, torch.ones_like(table))
        rows = flatgrad.gather_with_index_add(dual, _tokens(1))
        torch.testing.assert_close(fwad.unpack_dual(rows).tangent, torch.ones(4, 6, 8, dtype=torch.float64))


class _EmptySeated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3).double()
        self.empty = nn.Parameter(torch.zeros(0, 4, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum() + self.empty.sum()


def test_zero_element_parameters_seated_alone():
    """Every seated parameter has zero elements: nothing to zero, no error."""
    flat, oracle = _pair(_EmptySeated())
    x = torch.randn(2, 4, dtype=torch.float64)
    flat(x).backward()
    oracle(x).backward()
    assert_same_grads(flat, oracle)


@dataclasses.dataclass
class _Output:
    loss: torch.Tensor
    extras: dict[str, torch.Tensor]


class _DataclassOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8).double()
        self.norm = nn.LayerNorm(8).double()

    def forward(self, x: torch.Tensor) -> _Output:
        hidden = self.norm(self.lin(x))
        return _Output(hidden.square().mean(), {"aux": hidden.sum()})


def test_a_dataclass_output_is_watched_like_a_pytree():
    """A model returning a dataclass (one opaque pytree leaf) still gets every `.grad` in
    the buffers right after backward, not only at the next norm or sync."""
    flat, oracle = _pair(_DataclassOut(), config=None)
    x = torch.randn(3, 4, dtype=torch.float64)
    flat(x).loss.backward()
    oracle(x).loss.backward()
    for name, param in flat.named_parameters():
        assert grad_in_buffers(flat, param.grad), name  # grad_in_buffers reads without settling
    assert_same_grads(flat, oracle)


def _tiny_llama_with_lora(checkpointing: bool) -> nn.Module:
    peft = pytest.importorskip("peft", reason="pip install -e '.[dev,frameworks]'")
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(tiny_llama(), lora)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # zero at init: nonzero, so lora_A's gradient is too
            nn.init.normal_(param, std=0.02)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    return model.train()


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers renaming its checkpointing API
@pytest.mark.parametrize("checkpointing", [False, True])
def test_peft_lora_on_a_transformers_llama_trains_as_stock(checkpointing):
    """LoRA through peft on a transformers Llama (built from a config): frozen base
    weights, adapters routed inside peft's wrapper Linears, a tied embedding, with and
    without transformers' activation checkpointing; then a second adapter added mid-run.
    AdamW with weight decay and clipping over two accumulated micro-batches per step: the
    parameters and `.grad` None-ness equal stock's, every gradient lies in the buffers,
    and the buffers hold the trainable parameters only."""
    flat, oracle = _pair(_tiny_llama_with_lora(checkpointing))
    assert isinstance(flat, type(oracle))  # a PeftModel still
    gen = torch.Generator().manual_seed(1)

    def train(steps: int) -> None:
        trainable = [[p for p in m.parameters() if p.requires_grad] for m in (flat, oracle)]
        ours, stock = (torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1) for ps in trainable)
        for _ in range(steps):
            ours.zero_grad()
            stock.zero_grad()
            for _ in range(2):
                ids = torch.randint(0, 97, (2, 8), generator=gen)
                flat(input_ids=ids, labels=ids).loss.backward()
                oracle(input_ids=ids, labels=ids).loss.backward()
            torch.testing.assert_close(
                flat.clip_grad_norm_(1.0), nn.utils.clip_grad_norm_(trainable[1], 1.0), rtol=1e-12, atol=0
            )
            ours.step()
            stock.step()
        assert_same_grads(flat, oracle)
        _assert_params_equal(flat, oracle)
        assert sum(b.numel() for b in flat.grad_buffers.values()) == sum(p.numel() for p in trainable[0])

    train(2)
    peft = pytest.importorskip("peft")
    for model in (flat, oracle):
        torch.manual_seed(5)
        extra = peft.LoraConfig(r=2, target_modules=["k_proj", "o_proj"], lora_dropout=0.0)
        model.add_adapter("extra", extra)
        model.base_model.set_adapter(["default", "extra"])
        torch.manual_seed(6)
        for name, param in model.named_parameters():
            if "lora_B.extra" in name:
                nn.init.normal_(param, std=0.02)
    flat.relayout()  # (the new adapter's layers: FlatGrad's layout is fixed until then)
    train(2)


def _hf_model(name: str) -> tuple[nn.Module, Callable[[torch.Generator], dict[str, torch.Tensor]]]:
    """A transformers model from a config (every Linear and Embedding routed) and its batches."""
    transformers = pytest.importorskip("transformers", reason="pip install -e '.[dev,frameworks]'")
    torch.manual_seed(0)
    small = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    if name == "bert":  # untied embeddings; every token reads token-type row 0
        config = transformers.BertConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
            vocab_size=97, num_labels=3, **small,
        )  # fmt: skip
        model = transformers.BertForSequenceClassification(config).double()
        return model, lambda g: {
            "input_ids": torch.randint(0, 97, (2, 12), generator=g),
            "labels": torch.randint(0, 3, (2,), generator=g),
        }
    if name == "vit":  # a root parameter (cls_token), a conv patch embedding
        config = transformers.ViTConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
            image_size=16, patch_size=4, num_labels=5, **small,
        )  # fmt: skip
        model = transformers.ViTForImageClassification(config).double()
        return model, lambda g: {
            "pixel_values": torch.randn(2, 3, 16, 16, generator=g, dtype=torch.float64),
            "labels": torch.randint(0, 5, (2,), generator=g),
        }
    if name == "gpt2":  # Conv1D layers (unrouted), an LM head tied to the routed embedding
        config = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=97, n_positions=32,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config).double()
    else:  # mixtral: a router that leaves experts unused (grouped GEMMs: float32 only)
        config = transformers.MixtralConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=48, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=97, num_local_experts=8, num_experts_per_tok=1,
        )  # fmt: skip
        model = transformers.MixtralForCausalLM(config)

    def tokens(g: torch.Generator) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 97, (2, 12), generator=g)
        return {"input_ids": ids, "labels": ids}

    return model, tokens


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("name", ["bert", "vit", "gpt2", "mixtral"])
def test_transformers_architectures_accumulate_as_stock(name):
    """Models nobody here wrote, from configs, two micro-batches a step, clipping and AdamW:
    the norms and parameters equal stock's to round-off (`.grad` None where stock's is:
    Mixtral's unused experts). From the second micro-batch a routed Linear adds its product
    inside the GEMM (`addmm_`), whose last bits depend on the CPU's BLAS kernel (equal to
    stock's on an AVX2 host, not on an AVX-512 one), and GPT-2's tied table meets three terms
    (docs/semantics.md, "Accumulation order")."""
    model, batch = _hf_model(name)
    flat, oracle = _pair(model)
    gen = torch.Generator().manual_seed(1)
    ours, stock = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (flat, oracle))
    tol = 1e-6 if name == "mixtral" else 1e-12  # (float32 / float64 round-off)
    for _ in range(3):
        for _ in range(2):
            inputs = batch(gen)
            flat(**inputs).loss.backward()
            oracle(**inputs).loss.backward()
        # (torch's clipping on both: `flat.clip_grad_norm_` sums per buffer, another order)
        norms = [nn.utils.clip_grad_norm_(m.parameters(), 1.0) for m in (flat, oracle)]
        torch.testing.assert_close(*norms, rtol=tol, atol=0.0)
        ours.step()
        stock.step()
        assert_same_grads(flat, oracle, rtol=tol, atol=tol)
        ours.zero_grad()
        stock.zero_grad()
    assert_params_like(flat, oracle, rtol=tol, atol=tol)


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids.clone()}


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize(
    "options",
    [{}, {"gradient_checkpointing": True, "neftune_noise_alpha": 5.0}],
    ids=["plain", "checkpointing_neftune"],
)
def test_transformers_trainer_trains_a_wrapped_model_as_stock(tmp_path, options):
    """`transformers.Trainer` given ``FlatGrad(model)`` (a tied Llama in float64): two
    accumulated micro-batches per step, clipping, AdamW and a schedule; also with Trainer's
    activation checkpointing and NEFTune (which it turns on by calling model methods).
    Losses, gradient norms, the counted FLOPs and parameters equal a Trainer on the plain
    model, and before every optimizer step every `.grad` lies in the buffers."""
    transformers = pytest.importorskip("transformers", reason="pip install -e '.[dev,frameworks]'")
    pytest.importorskip("accelerate", reason="pip install -e '.[dev,frameworks]'")
    flat, oracle = _pair(tiny_llama())
    misplaced: list[str] = []

    class _InBuffers(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            named = flat.named_parameters()
            misplaced.extend(name for name, p in named if not grad_in_buffers(flat, p.grad))

    def train(model: nn.Module, name: str) -> list[dict[str, float]]:
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / name), per_device_train_batch_size=4, gradient_accumulation_steps=2,
            max_steps=3, learning_rate=1e-3, max_grad_norm=1.0, logging_steps=1, report_to=[],
            save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
            **options,
        )  # fmt: skip
        callbacks = [_InBuffers()] if model is flat else []
        trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=callbacks)
        trainer.train()
        logs = trainer.state.log_history
        flops.append(trainer.state.total_flos)
        return [{k: v for k, v in log.items() if k in ("loss", "grad_norm")} for log in logs]

    flops: list[float] = []

    ours, stock = train(flat, "flat"), train(oracle, "stock")
    assert len(ours) == 4 and all("loss" in log for log in ours[:3])
    for mine, theirs in zip(ours, stock):
        assert mine.keys() == theirs.keys()
        for key in mine:
            assert mine[key] == pytest.approx(theirs[key], rel=1e-12, abs=0), key
    assert flops[0] == flops[1] > 0
    _assert_params_equal(flat, oracle)
    assert not misplaced


class _DropFirst(torch.autograd.Function):
    """``b`` in the forward; `a` gets no gradient (None) in the backward."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return b + 0 * a.sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor]:  # type: ignore[override]
        return None, grad


class _Undefined(nn.Module):
    """A routed Linear and an embedding whose outputs get an undefined gradient on the
    steps `drop` says, beside a Linear that always gets one."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(10, 4)
        self.gated = nn.Linear(4, 4)
        self.main = nn.Linear(4, 4)

    def forward(self, idx: torch.Tensor, drop: bool) -> torch.Tensor:
        x = self.tokens(idx)
        gated = self.gated(x)
        out = self.main(x.detach())
        out = _DropFirst.apply(x + gated, out) if drop else out + gated
        return out.square().mean()


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_routed_layers_whose_output_gets_no_gradient_keep_grad_none_as_stock(checkpointed):
    """An undefined output gradient reaching a routed Linear or an embedding leaves its
    `.grad` None, as stock's, not a zero `.grad` that AdamW and weight decay would move
    (AdamW, two steps dropping, one not, then one dropping again with `.grad` held)."""
    flat, oracle = _pair(_Undefined().double())
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1) for m in (flat, oracle)]
    idx = torch.tensor([[1, 2, 3], [3, 4, 0]])

    def loss(model: nn.Module, drop: bool) -> torch.Tensor:
        if checkpointed:
            return torch.utils.checkpoint.checkpoint(model, idx, drop, use_reentrant=False)
        return model(idx, drop)

    for step, drop in enumerate([True, True, False]):
        for model, opt in zip((flat, oracle), opts):
            opt.zero_grad()
            loss(model, drop).backward()
        for (name, p), q in zip(flat.named_parameters(), oracle.parameters()):
            assert (p.grad is None) == (q.grad is None), f"step {step} {name}"
        for opt in opts:
            opt.step()
        _assert_params_equal(flat, oracle)
    for model in (flat, oracle):  # accumulating onto held gradients: unchanged by a drop
        loss(model, False).backward()
        loss(model, True).backward()
    assert_same_grads(flat, oracle)


class _SignedZeros(nn.Module):
    """Parameters whose gradient has -0.0 elements (``w * c`` with -0.0 in `c`): a seated
    one, a placed one, a routed Linear's weight with a tensor hook (AccumulateGrad adds the
    hooked gradient into its slot) and one this backward leaves without a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.seated = nn.Parameter(torch.randn(6, dtype=torch.float64))
        self.placed = nn.Parameter(torch.randn(SEAT_MAX_NUMEL, dtype=torch.float64))
        self.lin = nn.Linear(6, 1, bias=False).double()
        self.idle = nn.Parameter(torch.randn(3, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        signs = torch.tensor([-0.0, 0.0, 1.0, -0.0, -1.0, -0.0], dtype=torch.float64)
        lin = self.lin(x).sum()
        return (self.seated * signs).sum() + (self.placed[:6] * signs).sum() * x.sum() + lin


def test_a_minus_zero_gradient_keeps_its_sign_in_every_slot():
    """Stock's `.grad` keeps a -0.0 that AccumulateGrad stole from the backward; a seated slot
    starts at -0.0 (``-0.0 + x`` is ``x`` bit for bit), so it does too; a placed slot copies it.
    A second backward adds as stock does. Slots without a gradient and
    ``zero_grad(set_to_none=False)`` read +0.0, as stock's zeros. Oracle: stock on a deep copy,
    compared bit for bit (`torch.signbit` and `torch.equal`)."""
    flat, oracle = _pair(_SignedZeros())
    for model in (flat.lin.weight, oracle.lin.weight):
        model.register_hook(lambda grad: grad * -0.0)  # every element -0.0 or +0.0
    x = torch.tensor([[1.0, -2.0, 0.5, 3.0, -1.0, 2.0]], dtype=torch.float64)
    for step in range(2):
        flat(x).backward()
        oracle(x).backward()
        for (name, ours), ref in zip(flat.named_parameters(), oracle.parameters()):
            if ref.grad is None:
                assert ours.grad is None, name
                continue
            assert torch.signbit(ref.grad).any() or name == "lin.weight", name  # (the sample has -0.0)
            assert torch.equal(torch.signbit(ours.grad), torch.signbit(ref.grad)), f"{name}, backward {step}"
            assert torch.equal(ours.grad, ref.grad), name
    assert not any(torch.signbit(buf).any() for buf in flat.grad_buffers.values() if buf.numel() < 6)
    flat.zero_grad(set_to_none=False)
    oracle.zero_grad(set_to_none=False)
    for ours, ref in zip(flat.parameters(), oracle.parameters()):
        if ref.grad is not None:
            assert torch.equal(torch.signbit(ours.grad), torch.signbit(ref.grad))
    assert flat.idle.grad is None
    assert not torch.signbit(flat.main_grad(flat.idle)).any()  # its slot reads +0.0
