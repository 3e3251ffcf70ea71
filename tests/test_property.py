"""Property test: on random small models, FlatGrad's gradients equal stock autograd's.

Oracle: a deep copy of the model taken before wrapping, trained with plain PyTorch on the
same micro-batches. The models mix routed layers (nn.Linear with/without bias, nn.Embedding
with an optional padding_idx) and hooked ones (nn.LayerNorm, nn.Conv1d, a raw parameter),
with random weight tying, frozen parameters, a branch used only on some micro-batches, a
layer applied twice, a routed weight also used by a plain op (an L2 penalty), and
zero_grad between micro-batches in both of its forms.

A second property runs random training loops on both sides (SGD with momentum or AdamW,
float64 or float32): plain, gradient-accumulating, non-finite, GradScaler (overflowing or
not) and functional_call meta-learning steps, with clipping in every norm order, and
between any two calls layers frozen or unfrozen, a LoRA adapter, a new root parameter or a
replaced layer added to the model and the optimizer, and zero_grad in every form.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from conftest import ROUTE_ALL
from torch import nn

import flatgrad

# (a machine with torch and pytest alone, a lent GPU's, still collects the suite)
pytest.importorskip("hypothesis", reason="pip install -e '.[dev]'")
from hypothesis import assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# Same math in float64 on both sides; only the summation order may differ (index_add_ vs
# the embedding backward's sort-and-sum, addmm_ accumulation vs AccumulateGrad's add),
# which moves results by a few ulps of values of order one: far below 1e-12.
TOLERANCE = {"rtol": 1e-12, "atol": 1e-12}

ZERO_GRAD_CHOICES = ("keep", "set_to_none", "zeros")


@dataclass(frozen=True)
class Spec:
    vocab: int
    dim: int
    padding_idx: int | None
    hidden_bias: bool
    hidden_twice: bool
    head_bias: bool
    branch_bias: bool
    tie: bool
    use_norm: bool
    use_conv: bool
    use_scale: bool
    penalty: bool


class RandomModel(nn.Module):
    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab, spec.dim, padding_idx=spec.padding_idx)
        self.hidden = nn.Linear(spec.dim, spec.dim, bias=spec.hidden_bias)
        self.norm = nn.LayerNorm(spec.dim) if spec.use_norm else None
        self.conv = nn.Conv1d(spec.dim, spec.dim, kernel_size=3, padding=1) if spec.use_conv else None
        self.scale = nn.Parameter(torch.randn(spec.dim, dtype=torch.float64)) if spec.use_scale else None
        self.branch = nn.Linear(spec.dim, spec.dim, bias=spec.branch_bias)
        self.head = nn.Linear(spec.dim, spec.vocab, bias=spec.head_bias)
        if spec.tie:
            self.head.weight = self.embed.weight
        self.register_parameter("gain", None)  # a training loop may add it mid-run

    def forward(self, tokens: torch.Tensor, use_branch: bool) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(tokens)  # (batch, time, dim)
        h = torch.tanh(self.hidden(h))
        if self.spec.hidden_twice:
            h = torch.tanh(self.hidden(h))
        if self.gain is not None:
            h = h * self.gain
        if self.norm is not None:
            h = self.norm(h)
        if self.conv is not None:
            h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        if self.scale is not None:
            h = h * self.scale
        if use_branch:
            h = h + self.branch(h)
        # A plain (unrouted) use of a routed weight, summed with the routed use's gradient.
        penalty = 0.01 * self.head.weight.pow(2).sum() if self.spec.penalty else torch.zeros(())
        return self.head(h), penalty


specs = st.builds(
    Spec,
    vocab=st.integers(2, 7),
    dim=st.integers(1, 6),
    padding_idx=st.none() | st.integers(0, 1),
    hidden_bias=st.booleans(),
    hidden_twice=st.booleans(),
    head_bias=st.booleans(),
    branch_bias=st.booleans(),
    tie=st.booleans(),
    use_norm=st.booleans(),
    use_conv=st.booleans(),
    use_scale=st.booleans(),
    penalty=st.booleans(),
)


def _micro_batch(seed: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    batch, time = 1 + seed % 3, 1 + (seed // 3) % 4
    tokens = torch.randint(vocab, (batch, time), generator=generator)  # repeats and padding_idx likely
    targets = torch.randint(vocab, (batch * time,), generator=generator)
    return tokens, targets


Forward = Callable[[torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor]]


def _loss(model: Forward, tokens: torch.Tensor, targets: torch.Tensor, use_branch: bool) -> torch.Tensor:
    logits, penalty = model(tokens, use_branch)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets) + penalty


def _zero_grad(flat: flatgrad.FlatGrad, oracle: nn.Module, choice: str) -> None:
    if choice == "set_to_none":
        flat.zero_grad(set_to_none=True)
        oracle.zero_grad(set_to_none=True)
    elif choice == "zeros":
        flat.zero_grad(set_to_none=False)
        oracle.zero_grad(set_to_none=False)


def _inside_a_buffer(grad: torch.Tensor, buffers: dict) -> bool:
    for buffer in buffers.values():
        start = buffer.data_ptr()
        end = start + buffer.numel() * buffer.element_size()
        if (
            grad.dtype == buffer.dtype
            and grad.device == buffer.device
            and grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
            and start <= grad.data_ptr()
            and grad.data_ptr() + grad.numel() * grad.element_size() <= end
        ):
            return True
    return False


def _check_grads(flat: flatgrad.FlatGrad, oracle: nn.Module, frozen: set[str], step: int) -> None:
    buffers = flat.grad_buffers
    expected = dict(oracle.named_parameters())
    for name, param in flat.named_parameters():
        want = expected[name].grad
        got = param.grad
        where = f"{name} after micro-batch {step}"
        if name in frozen:
            assert got is None and want is None, f"frozen {where} has a gradient"
            continue
        if want is None:
            # Never used since the last set_to_none: stock keeps None, so must flatgrad.
            assert got is None, f"{where}: stock grad is None, flatgrad's is not"
            continue
        assert got is not None, f"{where}: flatgrad grad is None, stock's is not"
        torch.testing.assert_close(got, want, **TOLERANCE, msg=lambda m, w=where: f"{w}: {m}")
        assert got.stride() == want.stride(), where
        assert _inside_a_buffer(got, buffers), f"{where}: .grad does not live in a flat buffer"


# The same examples on every run and machine: CI failures reproduce without a database.
@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(
    spec=specs,
    init_seed=st.integers(0, 2**16),
    freeze=st.lists(st.booleans(), min_size=16, max_size=16),
    batch_seeds=st.lists(st.integers(0, 2**16), min_size=2, max_size=3),
    use_branch=st.lists(st.booleans(), min_size=3, max_size=3),
    zero_choices=st.lists(st.sampled_from(ZERO_GRAD_CHOICES), min_size=3, max_size=3),
)
def test_grads_match_stock_autograd(
    spec: Spec,
    init_seed: int,
    freeze: list[bool],
    batch_seeds: list[int],
    use_branch: list[bool],
    zero_choices: list[str],
) -> None:
    with torch.random.fork_rng():
        torch.manual_seed(init_seed)
        model = RandomModel(spec).double()
    # named_parameters() lists a tied parameter once, under its first name.
    named = list(model.named_parameters())
    frozen = {name for (name, param), flag in zip(named, freeze, strict=False) if flag}
    assume(len(frozen) < len(named))  # FlatGrad needs one trainable parameter
    for name, param in named:
        if name in frozen:
            param.requires_grad_(False)
    if spec.tie:  # the head's weight is the embedding's: frozen with it
        assert model.head.weight is model.embed.weight

    oracle = copy.deepcopy(model)  # before wrapping: FlatGrad patches layer forwards
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)

    for step, seed in enumerate(batch_seeds):
        if step > 0:
            _zero_grad(flat, oracle, zero_choices[step])
        tokens, targets = _micro_batch(seed, spec.vocab)
        loss = _loss(flat, tokens, targets, use_branch[step])
        oracle_loss = _loss(oracle, tokens, targets, use_branch[step])
        # Only frozen or unused parameters on this path: nothing to differentiate.
        assert loss.requires_grad == oracle_loss.requires_grad
        if loss.requires_grad:
            loss.backward()
            oracle_loss.backward()
        _check_grads(flat, oracle, frozen, step)


# --- random training loops: the events a real loop throws at the wrapper -------------------

KINDS = ("plain", "nonfinite", "scaler", "scaler_overflow", "meta")
LAYERS = ("embed", "hidden", "norm", "conv", "branch", "head", "gain")
NORM_ORDERS = (0.0, 0.5, 1.0, 2.0, math.inf, -math.inf)
ZERO_GRAD_WAYS = ("module_none", "module_zeros", "optimizer_none", "optimizer_zeros", "keep")
# ("freeze" | "unfreeze", layer name) or ("lora" | "gain" | "replace_branch", seed)
Event = tuple[str, str | int]

events = st.tuples(st.sampled_from(("freeze", "unfreeze")), st.sampled_from(LAYERS)) | st.tuples(
    st.sampled_from(("lora", "gain", "replace_branch")), st.integers(0, 2**16)
)
event_lists = st.lists(events, max_size=2).map(tuple)


@dataclass(frozen=True)
class Step:
    """One optimizer step of a random loop, and the events around its calls."""

    kind: str  # one of KINDS
    zero_grad: str  # how the step starts: one of ZERO_GRAD_WAYS
    batches: tuple[tuple[int, bool], ...]  # (seed, use_branch): one or two accumulated micro-batches
    before: tuple[Event, ...]  # after zero_grad, before the first forward
    between: tuple[Event, ...]  # between the two micro-batches' backwards
    after: tuple[Event, ...]  # after the last backward, before unscale_ and clipping
    norm_type: float | None  # clip_grad_norm_'s order; None: no clipping
    max_norm: float


train_steps = st.builds(
    Step,
    kind=st.sampled_from(KINDS),
    zero_grad=st.sampled_from(ZERO_GRAD_WAYS),
    batches=st.lists(st.tuples(st.integers(0, 2**16), st.booleans()), min_size=1, max_size=2).map(tuple),
    before=event_lists,
    between=event_lists,
    after=event_lists,
    norm_type=st.none() | st.sampled_from(NORM_ORDERS),
    max_norm=st.sampled_from((0.05, 1.0, 1e3)),
)


class _LoraHidden(nn.Module):
    """The hidden Linear with a low-rank adapter: new parameters mid-run."""

    def __init__(self, base: nn.Linear, seed: int) -> None:
        super().__init__()
        self.base = base
        gen = torch.Generator().manual_seed(seed)
        rank, dtype = 1 + seed % 2, base.weight.dtype
        self.down = nn.Parameter(torch.randn(rank, base.in_features, generator=gen, dtype=dtype))
        self.up = nn.Parameter(torch.randn(base.out_features, rank, generator=gen, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.down), self.up)


@dataclass
class _Side:
    """One side of the comparison: the model inside FlatGrad, or its plain deep copy."""

    model: RandomModel
    call: nn.Module  # what forward and functional_call go through: the wrapper, or the model
    opt: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    flat: flatgrad.FlatGrad | None

    def clip(self, max_norm: float, norm_type: float) -> torch.Tensor:
        if self.flat is not None:
            return self.flat.clip_grad_norm_(max_norm, norm_type)
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, norm_type)

    def zero_grad(self, way: str) -> None:
        if way != "keep":
            owner, form = way.split("_")
            target = self.opt if owner == "optimizer" else self.call
            target.zero_grad(set_to_none=form == "none")


def _make_side(model: RandomModel, flat: flatgrad.FlatGrad | None, optimizer: str) -> _Side:
    params = list(model.parameters())  # frozen ones too: torch's optimizers skip grad None
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)
    # A power-of-two scale: scale and unscale_ are exact, so they add no round-off.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    return _Side(model, flat if flat is not None else model, opt, scaler, flat)


def _freeze(model: RandomModel, layer: nn.Module | nn.Parameter) -> None:
    """Freeze `layer` unless that would freeze the whole head (every loss needs a gradient)."""
    leaving = {id(p) for p in layer.parameters()} if isinstance(layer, nn.Module) else {id(layer)}
    if any(id(p) not in leaving and p.requires_grad for p in model.head.parameters()):
        layer.requires_grad_(False)


def _grow(model: RandomModel, name: str, seed: int) -> list[nn.Parameter]:
    """Add parameters mid-run (the same values on both sides); returns the new ones."""
    gen = torch.Generator().manual_seed(seed)
    dim, dtype = model.spec.dim, model.head.weight.dtype
    if name == "lora":
        if isinstance(model.hidden, _LoraHidden):
            return []
        model.hidden = _LoraHidden(model.hidden, seed)
        return [model.hidden.down, model.hidden.up]
    if name == "gain":
        if model.gain is not None:
            return []
        model.gain = nn.Parameter(1 + 0.1 * torch.randn(dim, generator=gen, dtype=dtype))
        return [model.gain]
    # replace_branch: a fresh layer; the old one's parameters stay in the optimizer
    model.branch = nn.Linear(dim, dim, bias=model.branch.bias is not None, dtype=dtype)
    with torch.no_grad():
        for param in model.branch.parameters():
            param.copy_(torch.randn(param.shape, generator=gen, dtype=dtype) / 3)
    return list(model.branch.parameters())


def _apply(event: Event, side: _Side) -> None:
    """Apply one event to one side; both sides get the same events with the same seeds."""
    name, arg = event
    if name in ("freeze", "unfreeze"):
        layer = getattr(side.model, str(arg))
        if layer is not None and name == "freeze":
            _freeze(side.model, layer)
        elif layer is not None:
            layer.requires_grad_(True)
        return
    new = _grow(side.model, name, int(arg))
    if new and side.flat is not None:
        side.flat.relayout()  # (FlatGrad's layout is fixed until then)
    if new:
        side.opt.add_param_group({"params": new})


def _meta_backward(side: _Side, batches: tuple[tuple[int, bool], ...], vocab: int) -> None:
    """One meta-learning step: fast = p - lr * grad (create_graph), then the outer backward."""
    params = {name: p for name, p in side.model.named_parameters() if p.requires_grad}

    def loss_with(weights: dict[str, torch.Tensor], seed: int, use_branch: bool) -> torch.Tensor:
        def forward(tokens: torch.Tensor, branch: bool) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.func.functional_call(side.call, weights, (tokens, branch))

        return _loss(forward, *_micro_batch(seed, vocab), use_branch)

    inner = loss_with(params, *batches[0])
    grads = torch.autograd.grad(inner, list(params.values()), create_graph=True, allow_unused=True)
    fast = {name: p if g is None else p - 0.1 * g for (name, p), g in zip(params.items(), grads)}
    loss_with(fast, *batches[-1]).backward()


def _train_step(side: _Side, step: Step, vocab: int) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Run `step` on one side, pausing after backward, after clipping and after the step."""
    side.zero_grad(step.zero_grad)
    for event in step.before:
        _apply(event, side)
    scaled = step.kind.startswith("scaler")
    if step.kind == "meta":
        _meta_backward(side, step.batches, vocab)
    for index, (seed, use_branch) in enumerate(step.batches if step.kind != "meta" else ()):
        for event in step.between if index else ():
            _apply(event, side)
        loss = _loss(side.call, *_micro_batch(seed, vocab), use_branch)
        if step.kind == "nonfinite" or (step.kind == "scaler_overflow" and index == len(step.batches) - 1):
            loss = loss * math.inf
        (side.scaler.scale(loss) if scaled else loss).backward()
    for event in step.after:
        _apply(event, side)
    yield "backward", None
    if scaled:
        side.scaler.unscale_(side.opt)
    yield "clip", None if step.norm_type is None else side.clip(step.max_norm, step.norm_type)
    if scaled:
        side.scaler.step(side.opt)  # skipped after an overflow, as the scale halves
        side.scaler.update()
    elif step.kind != "nonfinite":  # the user notices the inf loss and drops the step
        side.opt.step()
    if step.kind in ("nonfinite", "scaler_overflow"):  # no NaN gradients carried into later steps
        side.zero_grad(step.zero_grad if step.zero_grad != "keep" else "module_none")
    yield "step", None


def _optimized(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def _check_side(ours: _Side, ref: _Side, where: str, tolerance: dict[str, float]) -> None:
    """Parameters and gradients (None where stock has None) equal the oracle's, for the
    model's parameters by name and for everything the optimizer holds (replaced layers)."""
    named, ref_named = list(ours.model.named_parameters()), list(ref.model.named_parameters())
    assert [name for name, _ in named] == [name for name, _ in ref_named], where
    pairs = [(name, p, q) for (name, p), (_, q) in zip(named, ref_named)]
    optimized = zip(_optimized(ours.opt), _optimized(ref.opt))
    pairs += [(f"optimizer's parameter {i}", p, q) for i, (p, q) in enumerate(optimized)]
    for name, p, q in pairs:
        label = f"{where}: {name}"
        torch.testing.assert_close(p, q, **tolerance, equal_nan=True, msg=lambda m, w=label: f"{w}: {m}")
        assert (p.grad is None) == (q.grad is None), f"{label}: grad is {p.grad} where stock's is {q.grad}"
        if q.grad is not None:
            torch.testing.assert_close(
                p.grad, q.grad, **tolerance, equal_nan=True, msg=lambda m, w=label: f"{w} grad: {m}"
            )
    assert ours.scaler.get_scale() == ref.scaler.get_scale(), where


def _check_in_buffers(flat: flatgrad.FlatGrad, where: str) -> None:
    """After clipping (which settles them): every trainable parameter's grad is in a buffer."""
    buffers = flat.grad_buffers
    for name, param in flat.named_parameters():
        if param.requires_grad and param.grad is not None:
            assert _inside_a_buffer(param.grad, buffers), f"{where}: {name}.grad is outside the buffers"


# float64: the same math on both sides, only summation orders differ (buffer-wide norms,
# accumulation into the slots), a few ulps of values of order one. Steps carry them on,
# and AdamW's m / (sqrt(v) + eps) turns an absolute gradient error d near g = 0 into a
# parameter error of up to lr * d / eps, so its eps is 1e-6 here (with torch's 1e-8 an
# error of 1e-16 in a gradient that cancels to ~0 would move a parameter by 5e-10).
# float32 (the GradScaler dtype; its power-of-two scale is exact): round-off is 6e-8
# relative, times the size of the summed terms, times the same amplification: 1e-5 with
# AdamW's eps 1e-3 for float32.
LOOP_TOLERANCE = {
    torch.float64: {"rtol": 1e-10, "atol": 1e-10},
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
}


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(
    spec=specs,
    dtype=st.sampled_from((torch.float64, torch.float32)),
    optimizer=st.sampled_from(("sgd", "adamw")),
    init_seed=st.integers(0, 2**16),
    steps=st.lists(train_steps, min_size=1, max_size=5),
)
def test_random_training_loops_match_stock(
    spec: Spec, dtype: torch.dtype, optimizer: str, init_seed: int, steps: list[Step]
) -> None:
    with torch.random.fork_rng():
        torch.manual_seed(init_seed)
        model = RandomModel(spec).to(dtype)
    oracle = copy.deepcopy(model)  # before wrapping: FlatGrad patches layer forwards
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    ours, ref = _make_side(model, flat, optimizer), _make_side(oracle, None, optimizer)
    tolerance = LOOP_TOLERANCE[dtype]
    for index, step in enumerate(steps):
        for (phase, total), (_, ref_total) in zip(
            _train_step(ours, step, spec.vocab), _train_step(ref, step, spec.vocab)
        ):
            where = f"step {index} ({step.kind}) after {phase}"
            # Before unscale_, gradients carry the loss scale: so does their round-off.
            scale = ref.scaler.get_scale() if phase == "backward" and step.kind.startswith("scaler") else 1.0
            _check_side(ours, ref, where, {"rtol": tolerance["rtol"], "atol": tolerance["atol"] * scale})
            if total is not None and ref_total is not None:
                torch.testing.assert_close(total, ref_total, **tolerance, equal_nan=True, msg=where)
                _check_in_buffers(flat, where)
            assert (total is None) == (ref_total is None), where
