"""torch's own module database (``module_db`` of ``torch.testing._internal.common_modules``)
through `flatgrad.FlatGrad`, against stock autograd on a deep copy.

Every module of module_db, in training mode on the CPU in float64 (its
``module_inputs_func(training=True)`` samples), once with the default configuration and once
with ``linear_min_numel=0`` (every Linear routed). Per sample, ours and the stock copy run
in lockstep: the same inputs (deep copies), the same loss (each floating-point output
times fixed random weights, summed; other weights in every pass), the same RNG seed before
each forward (dropout, RReLU and fractional pooling draw alike). The passes (`_PASSES`):

1. a fresh backward;
2. an SGD step on both, ``optimizer.zero_grad(set_to_none=True)``, a fresh backward;
3. a second backward without zeroing (accumulation);
4. ``model.zero_grad()`` on the inner model (torch's `nn.Module.zero_grad`, behind the
   wrapper), a fresh backward;
5. ``flat.zero_grad(set_to_none=False)`` against stock's, then a backward into the zeros.

After each pass every `.grad` must be bit for bit stock's (bytes compared: a -0.0 counts,
see docs/semantics.md), None where stock's is None, and so must the parameters and the
leaf inputs' gradients. One exception, where flatgrad adds differently by design
(docs/semantics.md): a backward into a defined `.grad` (passes 3 and 5) of a routed
layer's weight, which accumulates inside its kernel (``addmm_`` into the slot for a Linear,
``index_add_`` of the rows into the slot for an Embedding) where stock computes the fresh
gradient and adds it. That sum is rounded in another order, so each element is held to
``|ours - stock| <= ACCUMULATE_ULPS * eps * (|a| + |b|)`` (16), with `a` and `b` the two
backwards' gradients (stock's, elementwise): a sum of n terms reordered is off by at most
about ``n * eps`` times the sum of the terms' magnitudes, n is small in these samples (the
batch for a Linear, an index's repeats for an Embedding), and the terms' magnitudes can
exceed ``|b|`` where they cancel. Seen (full run): an Embedding's discontiguous sample 8.6,
a Linear 0.93, everything else bitwise.

Parameterless modules run inside a host with one parameter that scales the first
floating-point input (its gradient flows through the module's backward).

Lazy modules: FlatGrad refuses them before their first forward (a ValueError that says to run
a dummy forward); the test checks that, runs one forward under no_grad and goes on.

The default run takes the first training sample of each module: ``python -m pytest -q
tests/test_module_db.py``, 228 cases (114 modules, 2 configurations), 30 s of CPU (221 s of
wall time at a load of 9 on 2 shared cores). ``FLATGRAD_FULL_DB=1 python -m pytest -q
tests/test_module_db.py`` runs every sample: 3,626 (1,813 per configuration), 631 s of CPU,
a third of it nn.LinearCrossEntropyLoss's.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

import flatgrad
from flatgrad._flatgrad import engine_of

pytest.importorskip("expecttest")  # torch.testing._internal.common_modules imports it
from torch.testing._internal.common_modules import module_db  # noqa: E402

FULL = os.environ.get("FLATGRAD_FULL_DB") == "1"
CONFIGS = {"default": flatgrad.FlatGradConfig(), "route_all": flatgrad.FlatGradConfig(linear_min_numel=0)}
ACCUMULATE_ULPS = 16
EPS = torch.finfo(torch.float64).eps
LR = 0.1
_PASSES = ("fresh", "after step", "accumulated", "after model.zero_grad", "into zeros")
_ACCUMULATING = {"accumulated", "into zeros"}


class _Host(nn.Module):
    """A parameterless module with one parameter around it, scaling its first floating-point
    input (or its outputs, when it takes none)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.scale = nn.Parameter(torch.tensor(1.25, dtype=torch.float64))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args_list = list(args)
        for i, arg in enumerate(args_list):
            if isinstance(arg, torch.Tensor) and arg.is_floating_point():
                args_list[i] = arg * self.scale
                return self.inner(*args_list, **kwargs)
        out = self.inner(*args, **kwargs)
        return [t * self.scale for t in _floats(out)]


def _floats(output: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _loss(output: Any, seed: int) -> torch.Tensor | None:
    """Each floating-point output that needs a gradient times fixed random weights, summed."""
    terms = []
    for i, out in enumerate(o for o in _floats(output) if o.requires_grad):
        weights = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed + i))
        terms.append((out * weights).sum())
    return torch.stack(terms).sum() if terms else None


def _copied(inputs: Any) -> Any:
    """A copy of a sample's inputs for one side: each tensor a new leaf with the same values
    (some samples' inputs are made by operations: not deep-copyable)."""
    return tree_map_only(torch.Tensor, lambda t: t.detach().clone().requires_grad_(t.requires_grad), inputs)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    dense = tensor.detach().coalesce().to_dense() if tensor.is_sparse else tensor.detach()
    return dense.contiguous().reshape(-1).view(torch.uint8)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bytes(a), _bytes(b))


def _build(info: Any, sample: Any) -> tuple[nn.Module, bool]:
    """The sample's module, float64, in training mode; a lazy one materialised by one forward
    after FlatGrad refused it. Whether it sits in a `_Host`."""
    torch.manual_seed(0)
    module = info.module_cls(*sample.constructor_input.args, **sample.constructor_input.kwargs)
    module = module.to(torch.float64).train()
    if info.is_lazy and any(isinstance(p, nn.UninitializedParameter) for p in module.parameters()):
        with pytest.raises(ValueError, match="run one dummy forward pass to initialise them"):
            flatgrad.FlatGrad(module)
        args, kwargs = _copied((sample.forward_input.args, sample.forward_input.kwargs))
        with torch.no_grad():
            module(*args, **kwargs)
    if not any(p.requires_grad for p in module.parameters()):
        return _Host(module), True
    return module, False


class _Side:
    """One side of the lockstep: a model (ours: the FlatGrad), its SGD and its inputs."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], sample: Any) -> None:
        self.model = model
        self.optimizer = torch.optim.SGD(params, lr=LR)
        self.args, self.kwargs = _copied((sample.forward_input.args, sample.forward_input.kwargs))

    def backward(self, seed: int) -> bool:
        torch.manual_seed(seed)
        loss = _loss(self.model(*self.args, **self.kwargs), seed)
        if loss is None:
            return False
        loss.backward()
        return True

    def inputs(self) -> list[torch.Tensor]:
        leaves = tree_leaves((self.args, self.kwargs))
        return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def _routed(flat: flatgrad.FlatGrad) -> set[str]:
    seater = engine_of(flat).seater
    assert seater is not None
    ids = {id(p) for p in seater.routed}
    return {name for name, p in flat.named_parameters() if id(p) in ids}


def _compare(
    flat: flatgrad.FlatGrad,
    ours: _Side,
    stock: _Side,
    what: str,
    before: dict[str, torch.Tensor | None],
    worst: dict[str, float],
) -> list[str]:
    """Every difference between the two sides after pass `what`; `before` holds stock's
    gradients before an accumulating pass (for its bound), `worst` gets the largest
    accumulation error seen, in units of ``eps * (|a| + |b|)``."""
    problems = []
    routed = _routed(flat)
    refs = dict(stock.model.named_parameters())
    for name, param in flat.named_parameters():
        ref = refs[name]
        if not _same_bits(param, ref):
            problems.append(f"{what}: parameter {name} differs")
        if ref.grad is None or param.grad is None:
            if (ref.grad is None) != (param.grad is None):
                problems.append(
                    f"{what}: {name}.grad is {param.grad is None and 'None' or 'set'}, stock's not"
                )
            continue
        if _same_bits(param.grad, ref.grad):
            continue
        earlier = before.get(name)
        if what in _ACCUMULATING and name in routed and earlier is not None:
            a, total = earlier.to_dense(), ref.grad.detach().to_dense()
            scale = EPS * (a.abs() + (total - a).abs())
            error = (param.grad.detach().to_dense() - total).abs()
            ratio = torch.where(error == 0, 0.0, error / scale).max().item()
            worst[name] = max(worst.get(name, 0.0), ratio)
            if ratio <= ACCUMULATE_ULPS:
                continue
            problems.append(f"{what}: {name}.grad off by {ratio:.1f} eps * (|a| + |b|)")
        else:
            diff = (param.grad.detach().to_dense() - ref.grad.detach().to_dense()).abs().max().item()
            problems.append(f"{what}: {name}.grad not bitwise (max difference {diff:.3e})")
    for i, (x, y) in enumerate(zip(ours.inputs(), stock.inputs())):
        if (x.grad is None) != (y.grad is None) or (x.grad is not None and not _same_bits(x.grad, y.grad)):
            problems.append(f"{what}: input {i}'s grad differs")
    return problems


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def _zeroings(flat: flatgrad.FlatGrad, ours: _Side, stock: _Side) -> list[Callable[[], None]]:
    """What comes before each pass of `_PASSES`, on both sides."""

    def step() -> None:
        for side in (ours, stock):
            side.optimizer.step()
            side.optimizer.zero_grad(set_to_none=True)

    def module_zero() -> None:
        flat.zero_grad()
        stock.model.zero_grad()

    def zero_fill() -> None:
        flat.zero_grad(set_to_none=False)
        stock.model.zero_grad(set_to_none=False)

    nothing = lambda: None  # noqa: E731
    return [nothing, step, nothing, module_zero, zero_fill]


def _run_sample(
    info: Any, sample: Any, config: flatgrad.FlatGradConfig, worst: dict[str, float]
) -> list[str]:
    model, _ = _build(info, sample)
    reference = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model, config=config)
    ours = _Side(flat, list(flat.parameters()), sample)
    stock = _Side(reference, list(reference.parameters()), sample)
    problems = []
    for index, (what, before_pass) in enumerate(zip(_PASSES, _zeroings(flat, ours, stock))):
        before_pass()
        before = _grads(stock.model)
        seed = 1000 + index
        try:
            stock_ran = stock.backward(seed)
        except Exception as error:  # noqa: BLE001  (stock's refusal: ours must refuse too)
            with pytest.raises(type(error)):
                ours.backward(seed)
            return problems
        ours_ran = ours.backward(seed)
        assert ours_ran == stock_ran
        problems += _compare(flat, ours, stock, what, before, worst)
    return problems


def _samples(info: Any) -> list[Any]:
    samples = info.module_inputs_func(
        info, device="cpu", dtype=torch.float64, requires_grad=True, training=True
    )
    return samples if FULL else samples[:1]


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("info", module_db, ids=lambda info: info.formatted_name)
def test_module_db_equals_stock(info, config):
    worst: dict[str, float] = {}
    problems = []
    for index, sample in enumerate(_samples(info)):
        found = _run_sample(info, sample, CONFIGS[config], worst)
        problems += [f"sample {index} ({sample.desc}): {p}" for p in found]
    assert not problems, "\n".join(problems[:30])
