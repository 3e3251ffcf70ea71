"""Property test: on random small models, FlatGrad's gradients equal stock autograd's.

Oracle: a deep copy of the model taken before wrapping, trained with plain PyTorch on the
same micro-batches. The models mix routed layers (nn.Linear with/without bias, nn.Embedding
with an optional padding_idx) and hooked ones (nn.LayerNorm, nn.Conv1d, a raw parameter),
with random weight tying, frozen parameters, a branch used only on some micro-batches, a
layer applied twice, a routed weight also used by a plain op (an L2 penalty), and
zero_grad between micro-batches in both of its forms.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from conftest import ROUTE_ALL
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

import flatgrad

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

    def forward(self, tokens: torch.Tensor, use_branch: bool) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(tokens)  # (batch, time, dim)
        h = torch.tanh(self.hidden(h))
        if self.spec.hidden_twice:
            h = torch.tanh(self.hidden(h))
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


def _loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, use_branch: bool) -> torch.Tensor:
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
    for name, param in flat.module.named_parameters():
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


@settings(max_examples=25, deadline=None)
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

EVENTS = ("step", "nonfinite", "scaler", "freeze", "unfreeze", "add_layer", "functional_call")
NORM_ORDERS = (0.0, 0.5, 1.0, 2.0, float("inf"), float("-inf"))


class _LoraHidden(nn.Module):
    """The hidden Linear with a low-rank adapter: new parameters mid-run."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base
        gen = torch.Generator().manual_seed(7)
        dtype = base.weight.dtype
        self.down = nn.Parameter(torch.randn(1, base.in_features, generator=gen).to(dtype))
        self.up = nn.Parameter(torch.randn(base.out_features, 1, generator=gen).to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.down), self.up)


def _event(name: str, model: nn.Module, flat: flatgrad.FlatGrad | None, seed: int, norm: float) -> None:
    """Apply one event to `model` (wrapped by `flat`, or the oracle when `flat` is None)."""
    module = flat if flat is not None else model
    opt = module._test_opt  # type: ignore[union-attr]
    if name == "freeze":
        model.hidden.requires_grad_(False)
        return
    if name == "unfreeze":
        model.hidden.requires_grad_(True)
        return
    if name == "add_layer":
        if not isinstance(model.hidden, _LoraHidden):
            model.hidden = _LoraHidden(model.hidden)
            opt.add_param_group({"params": [model.hidden.down, model.hidden.up]})
        return
    tokens, targets = _micro_batch(seed, model.spec.vocab)
    opt.zero_grad()
    if name == "functional_call":  # one meta-learning step with fast weights
        params = {k: v for k, v in model.named_parameters() if v.requires_grad}
        inner = torch.func.functional_call(module, params, (tokens, True))
        grads = torch.autograd.grad(
            F.cross_entropy(inner[0].reshape(-1, inner[0].shape[-1]), targets),
            list(params.values()),
            create_graph=True,
        )
        fast = {k: p - 0.1 * g for (k, p), g in zip(params.items(), grads)}
        logits, _ = torch.func.functional_call(module, fast, (tokens, True))
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets).backward()
        opt.step()
        return
    loss = _loss(module, tokens, targets, True)
    if name == "nonfinite":
        loss = loss * float("inf")
    if name == "scaler":
        scaler = module._test_scaler  # type: ignore[union-attr]
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
    else:
        loss.backward()
    total = (
        flat.clip_grad_norm_(1.0, norm)
        if flat is not None
        else torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm)
    )
    module._test_totals.append(total)  # type: ignore[union-attr]
    if name == "scaler":
        scaler.step(opt)
        scaler.update()
    elif name != "nonfinite":
        opt.step()
    else:
        opt.zero_grad()


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(
    spec=specs,
    optimizer=st.sampled_from(["sgd", "adamw"]),
    events=st.lists(st.sampled_from(EVENTS), min_size=3, max_size=7),
    norms=st.lists(st.sampled_from(NORM_ORDERS), min_size=7, max_size=7),
)
def test_random_training_loops_match_stock(spec, optimizer, events, norms):
    torch.manual_seed(0)
    model = RandomModel(spec).double()
    oracle = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    for module, params in ((flat, model.parameters()), (oracle, oracle.parameters())):
        if optimizer == "sgd":
            module._test_opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        else:
            module._test_opt = torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)
        module._test_scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
        module._test_totals = []
    for index, (event, norm) in enumerate(zip(events, norms)):
        _event(event, model, flat, seed=index, norm=norm)
        _event(event, oracle, None, seed=index, norm=norm)
        for (name, p), q in zip(model.named_parameters(), oracle.parameters()):
            # float64 and the same sums; a few optimizer steps amplify round-off a little
            torch.testing.assert_close(
                p, q, rtol=1e-10, atol=1e-10, msg=lambda m, n=name, e=event: f"{e}: {n}: {m}"
            )
            assert (p.grad is None) == (q.grad is None), f"after {event}: {name} grad presence"
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-10, equal_nan=True)
    for ours, ref in zip(flat._test_totals, oracle._test_totals):
        torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10, equal_nan=True)
