"""Main grads (``grad_dtype="float32"``): float32 gradient slots for bfloat16/float16
parameters, in one process and through `flat.all_reduce_grads()`.

Two oracles, both built from stock autograd on the same bfloat16 model fed the same inputs:

- the *stock oracle*: each micro-batch's gradient alone (stock bfloat16 `.grad`, cast to
  float64), summed in float64. It is the issue's criterion: flatgrad's main grads must be at
  least twice closer to it than stock's bfloat16 `.grad` accumulation. For routed weights
  flatgrad is more exact than each stock term (its weight-gradient GEMM accumulates in
  float32 and never rounds to bfloat16), so the distance left is the oracle's own rounding.
- the *operand oracle*: the weight gradients recomputed in float64 from the very bfloat16
  operands each backward multiplies (a Linear's input and output gradient, an Embedding's
  indices and output gradient, captured by hooks), plus the unrouted LayerNorm's stock
  per-micro-batch gradient (what its AccumulateGrad receives). flatgrad's main grads must
  equal it to float32 round-off of a 16-term sum.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import grad_in_buffers
from dist_utils import run_ranks
from torch import nn

import flatgrad
from flatgrad._functional import fused_accumulate

MAIN = {"grad_dtype": "float32", "linear_min_numel": 0}
VOCAB, DIM, BATCH, SEQ, MICRO_BATCHES = 96, 64, 4, 16, 16


class TiedLM(nn.Module):
    """Tied embedding and LM head (routed), routed Linears (one with a bias), an unrouted
    LayerNorm; initialised as LMs are (std 0.02), so the softmax is not saturated."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM, bias=False)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        nn.init.normal_(self.emb.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        h = self.norm(h + self.down(F.gelu(self.up(h))))
        return F.cross_entropy(self.head(h).flatten(0, 1).float(), tokens.flatten())


def _model(dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> TiedLM:
    torch.manual_seed(0)
    return TiedLM().to(device, dtype)


def _batches(seed: int = 1, device: str = "cpu") -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator).to(device) for _ in range(MICRO_BATCHES)
    ]


def _stock_oracle(model: nn.Module, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    sums = {name: torch.zeros_like(p, dtype=torch.float64) for name, p in model.named_parameters()}
    for tokens in batches:
        model.zero_grad()
        model(tokens).backward()
        for name, param in model.named_parameters():
            sums[name] += param.grad.double()
    return sums


def _operand_oracle(model: TiedLM, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    names = {id(p): name for name, p in model.named_parameters()}
    sums = {name: torch.zeros_like(p, dtype=torch.float64) for name, p in model.named_parameters()}
    seen: list[tuple[nn.Module, torch.Tensor, torch.Tensor]] = []

    def capture(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        out.register_hook(lambda g: seen.append((module, args[0].detach(), g.detach())))

    for module in (model.emb, model.up, model.down, model.head):
        module.register_forward_hook(capture)
    for tokens in batches:
        model.zero_grad()
        seen.clear()
        model(tokens).backward()
        for module, x, g in seen:
            if isinstance(module, nn.Embedding):
                sums["emb.weight"].index_add_(0, x.reshape(-1), g.reshape(-1, DIM).double())
                continue
            rows, inputs = g.reshape(-1, g.shape[-1]).double(), x.reshape(-1, x.shape[-1]).double()
            sums[names[id(module.weight)]] += rows.t() @ inputs
            if module.bias is not None:
                sums[names[id(module.bias)]] += rows.sum(0)
        for name in ("norm.weight", "norm.bias"):
            sums[name] += model.get_parameter(name).grad.double()
    return sums


def _accumulated(
    config: dict[str, object] | None = MAIN, device: str = "cpu"
) -> tuple[flatgrad.FlatGrad, TiedLM, list[torch.Tensor]]:
    model = _model(device=device)
    flat = flatgrad.FlatGrad(model, config=config)
    batches = _batches(device=device)
    for tokens in batches:
        flat(tokens).backward()
    return flat, model, batches


class Mixed(nn.Module):
    """A low-precision LM and a float32 head on top of its loss (one float32 buffer for all)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.lm = _model(dtype)
        self.out = nn.Linear(4, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.lm(tokens).float().expand(4)).sum()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_parameters_get_float32_slots_and_no_grad(dtype):
    model = Mixed(dtype)
    flat = flatgrad.FlatGrad(model, config=MAIN)
    assert list(flat.grad_buffers) == [(torch.float32, torch.device("cpu"))]
    flat(_batches()[0]).backward()
    for name, param in model.named_parameters():
        main = flat.main_grad(param)
        assert main.dtype == torch.float32 and main.shape == param.shape, name
        if param.dtype == torch.float32:
            assert param.grad is main, f"{name}: a float32 parameter's main grad is its .grad"
        else:
            assert param.grad is None, f"{name}: a main grad's parameter keeps .grad None"
        assert bool(main.ne(0).any()), name


def test_a_torch_optimizer_over_main_grad_parameters_refuses_to_skip_them():
    """`.grad` stays None for them, so the optimizer a script already has would step nothing
    there without a word: its step raises instead, naming how many and what to do. A
    `.grad` set by hand (from the main grad), a float32 parameter's, or an optimizer that
    has no main-grad parameter steps as usual."""
    model = Mixed(torch.bfloat16)
    flat = flatgrad.FlatGrad(model, config=MAIN)
    flat(_batches()[0]).backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        RuntimeError, match=r"SGD.step\(\) would skip \d+ bfloat16/float16 .*ShardedOptimizer"
    ):
        opt.step()
    for param in model.parameters():
        param.grad = flat.main_grad(param).to(param.dtype)
    opt.step()  # every .grad set: stock behaviour
    masters = [p.detach().float().requires_grad_() for p in model.parameters()]
    torch.optim.SGD(masters, lr=0.1).step()  # no main-grad parameter in it


def test_the_refusal_follows_an_optimizer_whose_groups_or_wrappers_change():
    """The step hook finds once per optimizer which of its parameters have main grads
    (an optimizer with none then pays one look at its groups per step): a group added since,
    or a wrapper with main grads built after the optimizer's first step, is seen at the next."""
    flat = flatgrad.FlatGrad(Mixed(torch.bfloat16), config=MAIN)
    head = nn.Parameter(torch.zeros(3))
    head.grad = torch.ones(3)
    opt = torch.optim.SGD([head], lr=0.1)
    opt.step()  # no main-grad parameter in it
    flat(_batches()[0]).backward()
    opt.add_param_group({"params": list(flat.parameters())})
    with pytest.raises(RuntimeError, match=r"SGD.step\(\) would skip \d+ bfloat16/float16"):
        opt.step()
    later = Mixed(torch.bfloat16)
    plain = torch.optim.SGD(later.parameters(), lr=0.1)
    plain.step()  # not wrapped yet: stock's silent skip
    other = flatgrad.FlatGrad(later, config=MAIN)
    other(_batches()[0]).backward()
    with pytest.raises(RuntimeError, match=r"SGD.step\(\) would skip \d+ bfloat16/float16"):
        plain.step()


def test_frozen_main_grad_parameters_are_not_counted_as_skipped():
    """A bfloat16 part frozen after wrapping has no gradient, as stock's: a torch optimizer
    over the model (its float32 head the only trainable part) steps without the main-grad
    refusal, whether or not the buffers were laid out again since (``zero_grad()`` setting
    None does not walk the model)."""
    model = Mixed(torch.bfloat16)
    flat = flatgrad.FlatGrad(model, config=MAIN)
    model.lm.requires_grad_(False)
    flat.zero_grad()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.out.weight.detach().clone()
    flat(_batches()[0]).backward()
    opt.step()
    assert all(p.grad is None for p in model.lm.parameters())
    assert not torch.equal(model.out.weight, before)


def test_without_grad_dtype_nothing_changes():
    model = _model()
    flat = flatgrad.FlatGrad(model, config={"linear_min_numel": 0})
    assert list(flat.grad_buffers) == [(torch.bfloat16, torch.device("cpu"))]
    flat(_batches()[0]).backward()
    for param in model.parameters():
        assert param.grad is flat.main_grad(param) and param.grad.dtype == torch.bfloat16


# float32 sums of 16 micro-batches of 64-row GEMMs: measured <= 1.3e-7 of the largest element
# on CPU; a CUDA GEMM may split K and sum in another order. A bfloat16 product is 2^-9 off.
OPERAND_RTOL = {"cpu": 1e-6, "cuda": 1e-5}
CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_sixteen_micro_batches_beat_stock_bfloat16_accumulation(device):
    flat, model, batches = _accumulated(device=device)
    stock = _model(device=device)
    for tokens in batches:
        stock(tokens).backward()  # stock: .grad accumulated in bfloat16
    oracle = _stock_oracle(_model(device=device), batches)
    exact = _operand_oracle(_model(device=device), batches)
    stock_grads = dict(stock.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad is None and flat.main_grad(param).dtype == torch.float32, name
        assert grad_in_buffers(flat, flat.main_grad(param)), name
        main = flat.main_grad(param).double()
        ours = (main - oracle[name]).abs().max()
        theirs = (stock_grads[name].grad.double() - oracle[name]).abs().max()
        assert ours <= 0.5 * theirs, f"{name}: {ours:.3e} against stock's {theirs:.3e}"
        atol = OPERAND_RTOL[device] * float(exact[name].abs().max())
        torch.testing.assert_close(main, exact[name], rtol=0, atol=atol, msg=name)


def test_zero_grad_zeroes_the_main_grads():
    for set_to_none in (True, False):
        flat, model, _ = _accumulated()
        flat.zero_grad(set_to_none=set_to_none)
        for buffer in flat.grad_buffers.values():
            assert not bool(buffer.any())
        assert all(param.grad is None for param in model.parameters())
        flat(_batches(seed=2)[0]).backward()  # and the next step starts from zero
        fresh, fresh_model, _ = _accumulated(MAIN)
        fresh.zero_grad()
        fresh(_batches(seed=2)[0]).backward()
        for (name, param), other in zip(model.named_parameters(), fresh_model.parameters()):
            assert torch.equal(flat.main_grad(param), fresh.main_grad(other)), name


def test_clip_grad_norm_equals_torch_on_the_float64_oracle():
    flat, model, batches = _accumulated()
    exact = _operand_oracle(_model(), batches)
    reference = copy.deepcopy(_model()).double()
    for name, param in reference.named_parameters():
        param.grad = exact[name].clone()
    max_norm = 0.25
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    total = flat.clip_grad_norm_(max_norm)
    assert flat.grad_norm() == pytest.approx(max_norm, rel=1e-5)
    # float32 main grads against float64 sums: about 1e-7 relative apart
    assert float(total) == pytest.approx(float(expected), rel=1e-6)
    for name, param in model.named_parameters():
        ref = reference.get_parameter(name).grad
        torch.testing.assert_close(
            flat.main_grad(param).double(), ref, rtol=0, atol=1e-6 * float(ref.abs().max())
        )
    assert all(param.grad is None for param in model.parameters())


def test_a_gradient_through_plain_autograd_is_added_in():
    """An unrouted use of a routed weight (``model.head.weight`` read directly) reaches its
    AccumulateGrad as a bfloat16 gradient: the hook adds it into the main grad."""
    model = _model()
    flat = flatgrad.FlatGrad(model, config=MAIN)
    tokens = _batches()[0]
    (flat(tokens) + model.up.weight.float().square().sum()).backward()
    reference = _model()
    (reference(tokens) + reference.up.weight.float().square().sum()).backward()
    assert model.up.weight.grad is None
    torch.testing.assert_close(
        flat.main_grad(model.up.weight), reference.up.weight.grad.float(), rtol=1e-2, atol=1e-4
    )


def test_main_grad_refuses_what_is_not_a_wrapped_parameter():
    model = _model()
    model.norm.bias.requires_grad_(False)
    flat = flatgrad.FlatGrad(model, config=MAIN)
    with pytest.raises(TypeError, match="param must be a parameter of the model, got list"):
        flat.main_grad([1.0])  # type: ignore[arg-type]
    for tensor in (model.norm.bias, torch.zeros(3), nn.Parameter(torch.zeros(3))):
        with pytest.raises(ValueError, match="param must be a trainable parameter of the model"):
            flat.main_grad(tensor)


def test_the_ddp_hook_path_is_refused():
    flat = flatgrad.FlatGrad(_model(), config=MAIN)
    with pytest.raises(
        ValueError, match=r"DDP \(model.ddp_kwargs\(\)\) cannot carry main grads.*flatgrad.replicate"
    ):
        flat.ddp_kwargs()
    with pytest.raises(ValueError, match=r"allreduce_hook \(model.comm_state\(\)\) cannot carry main grads"):
        flat.comm_state()


def test_hooks_and_main_grads_go_with_a_relayout():
    flat, model, _ = _accumulated()
    before = {name: flat.main_grad(p).clone() for name, p in model.named_parameters()}
    hooked = [p for p in model.parameters() if p._post_accumulate_grad_hooks]
    assert len(hooked) == len(list(model.parameters()))  # one hook per parameter
    model.extra = nn.Linear(4, 4).to(torch.bfloat16)  # a new layer: refused until relayout()
    with pytest.raises(RuntimeError, match=r"extra.weight \(added\)"):
        flat.grad_norm()
    flat.relayout()
    for name, param in model.named_parameters():
        if name in before:  # the main grads moved to the new buffer
            assert torch.equal(flat.main_grad(param), before[name]), name
        assert len(param._post_accumulate_grad_hooks) == 1, name


def test_the_routed_weight_gradient_makes_no_weight_sized_copy():
    """Profiled backward of a routed bfloat16 Linear with a main grad: no copy, cast or add
    of the weight's size. On the CPU the float32 fallback upcasts the GEMM's operands, the
    output gradient (rows x 80) and the input (rows x 48): activation-sized, never (80, 48)."""
    torch.manual_seed(0)
    layer = nn.Linear(48, 80, bias=False).to(torch.bfloat16)
    flat = flatgrad.FlatGrad(layer, config=MAIN)
    x = torch.randn(24, 48, dtype=torch.bfloat16)
    flat(x).float().sum().backward()  # the first backward: nothing to warm up, but same path
    ops = ("aten::copy_", "aten::to", "aten::_to_copy", "aten::add_", "aten::clone")
    with torch.profiler.profile(record_shapes=True) as prof:
        flat(x).float().sum().backward()
    weight_sized = [
        (event.name, event.input_shapes)
        for event in prof.events()
        if event.name in ops and [80, 48] in event.input_shapes
    ]
    assert weight_sized == []
    # (the profile sees the GEMM itself: addmm_ into the (80, 48) main grad)
    assert any(e.name == "aten::addmm_" and e.input_shapes[0] == [80, 48] for e in prof.events())
    assert layer.weight.grad is None
    expected = 2 * (torch.ones(24, 80, dtype=torch.float64).t() @ x.double())
    torch.testing.assert_close(flat.main_grad(layer.weight).double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_main_grad_matches_the_operand_oracle():
    """The GEMM accumulates into the float32 main grad itself where this torch has
    ``addmm(..., out_dtype=torch.float32)`` (`fused_accumulate`), else the float32 fallback;
    either way the result is float32-exact."""
    torch.manual_seed(0)
    layer = nn.Linear(256, 512).to(torch.bfloat16).cuda()
    flat = flatgrad.FlatGrad(layer, config=MAIN)
    xs = [torch.randn(64, 256, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    grads = [torch.randn(64, 512, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    for x, g in zip(xs, grads):
        flat(x).backward(g)
    expected = sum(g.double().t() @ x.double() for x, g in zip(xs, grads))
    main = flat.main_grad(layer.weight)
    torch.testing.assert_close(main.double(), expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
    assert layer.weight.grad is None
    fused_accumulate("cuda")  # probed once, cached: answers without error either way


def _all_reduce_worker(rank: int, world_size: int) -> None:
    model = _model()
    flat = flatgrad.FlatGrad(model, config=MAIN)
    batches = _batches(seed=10 + rank)
    for tokens in batches[:4]:
        flat(tokens).backward()
    local = [flat.main_grad(p).clone() for p in model.parameters()]
    flat.all_reduce_grads()
    gathered = [torch.empty_like(t) for t in local for _ in range(world_size)]
    for index, tensor in enumerate(local):
        dist.all_gather(gathered[index * world_size : (index + 1) * world_size], tensor)
    for index, param in enumerate(model.parameters()):
        mean = torch.stack(gathered[index * world_size : (index + 1) * world_size]).mean(0)
        torch.testing.assert_close(flat.main_grad(param), mean, rtol=1e-6, atol=1e-7)
        assert param.grad is None


@pytest.mark.distributed
def test_all_reduce_grads_averages_the_main_grads_in_float32():
    run_ranks(_all_reduce_worker, world_size=2)


def test_converting_the_model_moves_the_gradients_along():
    """``flat.float()`` ends the main grads: they become float32 `.grad` slots; converting a
    float32 model with gradients to bfloat16 takes them into main grads."""
    flat, model, _ = _accumulated()
    before = {name: flat.main_grad(p).clone() for name, p in model.named_parameters()}
    flat.float()
    for name, param in model.named_parameters():
        assert param.grad is flat.main_grad(param) and torch.equal(param.grad, before[name]), name
    flat.to(torch.bfloat16)  # (the float32 .grad is cast to bfloat16 by the conversion)
    for name, param in model.named_parameters():
        assert param.grad is None, name
        torch.testing.assert_close(flat.main_grad(param), before[name].bfloat16().float(), rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:Using backward.. with create_graph=True")
def test_tensor_hooks_and_create_graph_keep_stock_behaviour():
    """A tensor hook on a routed bfloat16 weight sees its bfloat16 gradient and its result
    lands in the main grad; under create_graph=True `.grad` stays as stock makes it
    (differentiable) until `main_grad` takes it in."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)).to(torch.bfloat16)
    reference = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model, config=MAIN)
    seen: list[torch.dtype] = []
    model[0].weight.register_hook(lambda g: seen.append(g.dtype) or g * 2)
    reference[0].weight.register_hook(lambda g: g * 2)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    flat(x).float().square().sum().backward()
    reference(x).float().square().sum().backward()
    assert seen == [torch.bfloat16] and model[0].weight.grad is None
    # one micro-batch: stock's bfloat16 gradient, exactly or within its own rounding (the bias)
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(flat.main_grad(param), ref.grad.float(), rtol=1e-2, atol=1e-4)
    flat.zero_grad()
    flat(x).float().square().sum().backward(create_graph=True)
    assert all(param.grad is not None and param.grad.dtype == torch.bfloat16 for param in model.parameters())
    mains = [flat.main_grad(param) for param in model.parameters()]
    assert all(param.grad is None for param in model.parameters()) and all(bool(m.any()) for m in mains)
