"""Main grads on the device (``grad_dtype="float32"``): their exactness against float64
oracles, and the routed Linear's weight-gradient GEMM profiled (no weight-sized temporary;
on CUDA the ``addmm(..., out_dtype=torch.float32)`` kernel writing into the main grad).
`device_mixed_comm` steps them with `ShardedOptimizer`.

The oracles follow tests/test_main_grad.py: the *stock oracle* sums stock's per-micro-batch
bfloat16 gradients in float64 (main grads must be at least twice closer to it than stock's
bfloat16 `.grad` accumulation); the *operand oracle* recomputes the weight gradients in
float64 from the very bfloat16 operands each backward multiplies (main grads must equal it
to float32 round-off).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import flatgrad
from flatgrad._functional import fused_accumulate
from flatgrad.bench.counters import COPY_OPS
from flatgrad.bench.device_base import (
    DeviceRun,
    Outcome,
    device_events,
    grad_in_buffers,
    profiled,
    skipped,
)
from flatgrad.bench.device_checks import Profile

# Every Linear routed, however small: the checks are about the routed backwards.
MAIN_GRADS = flatgrad.FlatGradConfig(grad_dtype="float32", linear_min_numel=0)
VOCAB, DIM, BATCH, SEQ, MICRO_BATCHES = 96, 64, 4, 16, 16
# float32 sums of 16 micro-batches of 64-row GEMMs: measured <= 1.3e-7 of the largest
# element on CPU (tests/test_main_grad.py); a CUDA GEMM may split K and sum in another order
# (the CUDA test there allows 1e-5). A product rounded to bfloat16 is 2^-9 off.
OPERAND_RTOL = {"cpu": 1e-6, "cuda": 1e-5}


class MainGradLM(nn.Module):
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


def wrap_main_grads(model: nn.Module) -> flatgrad.FlatGrad:
    """`model` wrapped with `MAIN_GRADS`."""
    return flatgrad.FlatGrad(model, config=MAIN_GRADS)


def main_grad_model(device: torch.device) -> MainGradLM:
    """The same bfloat16 `MainGradLM` at every call."""
    torch.manual_seed(0)
    return MainGradLM().to(device, torch.bfloat16)


def token_batches(count: int, device: torch.device, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator).to(device) for _ in range(count)]


def oracles(
    model: MainGradLM, batches: Sequence[torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Both oracles from stock backwards of `model`, one per micro-batch: the stock oracle
    (each micro-batch's bfloat16 `.grad`, summed in float64) and the operand oracle (float64
    products of the bfloat16 operands each routed backward multiplies, captured by hooks,
    plus the unrouted LayerNorm's per-micro-batch gradient, which its AccumulateGrad gets)."""
    names = {id(p): name for name, p in model.named_parameters()}
    summed = {name: torch.zeros_like(p, dtype=torch.float64) for name, p in model.named_parameters()}
    exact = {name: torch.zeros_like(p, dtype=torch.float64) for name, p in model.named_parameters()}
    seen: list[tuple[nn.Module, torch.Tensor, torch.Tensor]] = []

    def capture(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        out.register_hook(lambda g: seen.append((module, args[0].detach(), g.detach())))

    handles = [m.register_forward_hook(capture) for m in (model.emb, model.up, model.down, model.head)]
    for tokens in batches:
        model.zero_grad()
        seen.clear()
        model(tokens).backward()
        for name, param in model.named_parameters():
            summed[name] += param.grad.double()  # type: ignore[union-attr]
        for module, x, g in seen:
            if isinstance(module, nn.Embedding):
                exact["emb.weight"].index_add_(0, x.reshape(-1), g.reshape(-1, DIM).double())
                continue
            assert isinstance(module, nn.Linear)
            rows, inputs = g.reshape(-1, g.shape[-1]).double(), x.reshape(-1, x.shape[-1]).double()
            exact[names[id(module.weight)]] += rows.t() @ inputs
            if module.bias is not None:
                exact[names[id(module.bias)]] += rows.sum(0)
        for name in ("norm.weight", "norm.bias"):
            exact[name] += model.get_parameter(name).grad.double()  # type: ignore[union-attr]
    for handle in handles:
        handle.remove()
    return summed, exact


def _distances(
    main: torch.Tensor, stock: torch.Tensor, summed: torch.Tensor, exact: torch.Tensor
) -> tuple[float, float]:
    """How many times closer `main` is to the stock oracle `summed` than `stock` (stock's
    bfloat16 accumulation; inf where `main` equals it), and `main`'s largest difference from
    the operand oracle `exact` over its largest element."""
    ours = float((main.double() - summed).abs().max())
    theirs = float((stock.double() - summed).abs().max())
    error = float((main.double() - exact).abs().max()) / (float(exact.abs().max()) or 1.0)
    return (theirs / ours if ours else float("inf")), error


def check_main_grad_exactness(run: DeviceRun) -> Outcome:
    """16 micro-batches of a bfloat16 tied LM: every main grad is float32, inside
    `grad_buffers`, `.grad` None; at least 2x closer than stock's bfloat16 accumulation to
    the stock oracle, and within float32 round-off of the operand oracle."""
    model, stock = main_grad_model(run.device), main_grad_model(run.device)
    flat = wrap_main_grads(model)
    batches = token_batches(MICRO_BATCHES, run.device)
    for tokens in batches:
        flat(tokens).backward()
        stock(tokens).backward()  # stock: .grad accumulated in bfloat16
    summed, exact = oracles(main_grad_model(run.device), batches)
    rtol = OPERAND_RTOL[run.device.type]
    problems, gains, worst = [], [], 0.0
    for (name, param), ref in zip(model.named_parameters(), stock.parameters()):
        main = flat.main_grad(param)
        if param.grad is not None or main.dtype != torch.float32 or not grad_in_buffers(flat, main):
            problems.append(f"{name}: .grad {param.grad is None and 'None' or 'set'}, main grad {main.dtype}")
        assert ref.grad is not None
        gain, error = _distances(main, ref.grad, summed[name], exact[name])
        gains.append(gain)
        worst = max(worst, error)
        if gain < 2:
            problems.append(f"{name}: only {gain:.2f}x closer to the stock oracle than stock's accumulation")
        if error > rtol:
            problems.append(f"{name}: {error:.3g} of the largest element from the operand oracle > {rtol:g}")
    finite = [g for g in gains if g != float("inf")] or [float("inf")]
    detail = (
        f"bf16 tied LM, {MICRO_BATCHES} micro-batches, {len(gains)} parameters, float32 main grads "
        f"inside grad_buffers, .grad None: against the float64 sum of stock's per-micro-batch bf16 "
        f"grads, {min(finite):.1f}x to {max(finite):.1f}x closer than stock's bf16 accumulation "
        f"(required >= 2x; {gains.count(float('inf'))} equal to it); against the float64 products of "
        f"the same bf16 operands, largest relative difference {worst:.2g} (tolerance {rtol:g})"
    )
    return Outcome(not problems, "; ".join(problems) or detail)


# A routed Linear whose weight's bytes (bfloat16 and float32) differ from every activation's
# and are multiples of 512 (CUDA's allocator rounds to those: the records show exact sizes).
IN, OUT, ROWS = 256, 512, 96
BF16, FP32 = "c10::BFloat16", "float"


@dataclass
class LinearProfile:
    """One profiled accumulating backward of a routed bfloat16 Linear."""

    profile: Profile
    dtypes: list[list[str]]  # per op of `profile.ops`
    allocations: list[int]  # bytes of every allocation the backward made
    weight: tuple[int, int]
    error: float  # the main grad's largest difference from float64 over its largest element

    def weight_sized(self) -> list[int]:
        """Allocations of the weight's size in bfloat16 or float32."""
        numel = self.weight[0] * self.weight[1]
        return [nbytes for nbytes in self.allocations if nbytes in (2 * numel, 4 * numel)]

    def weight_copies(self) -> int:
        return self.profile.count(COPY_OPS | {"aten::to"}, {self.weight})

    def gemms(self, name: str, dtypes: tuple[str, str, str]) -> int:
        """Ops `name` on the weight's shape (the main grad) with these (self, mat1, mat2) dtypes."""
        return sum(
            n == name and bool(shapes) and shapes[0] == self.weight and tuple(types[:3]) == dtypes
            for (n, shapes), types in zip(self.profile.ops, self.dtypes)
        )


def profile_linear(run: DeviceRun, main_grads: bool) -> LinearProfile:
    """The second backward of a routed bfloat16 `Linear(IN, OUT)` (flatgrad with a main grad,
    or stock's bfloat16 `.grad`), profiled with shapes, dtypes and memory; the gradient
    compared with the float64 products of the same operands."""
    torch.manual_seed(0)
    layer = nn.Linear(IN, OUT).to(run.device, torch.bfloat16)
    module: nn.Module = wrap_main_grads(layer) if main_grads else layer
    x = torch.randn(ROWS, IN, dtype=torch.bfloat16, device=run.device)
    module(x).float().sum().backward()
    loss = module(x).float().sum()
    with profiled(run.device, record_shapes=True, profile_memory=True) as prof:
        loss.backward()
    assert prof.profiler is not None and prof.profiler.kineto_results is not None
    events: list[Any] = list(prof.profiler.kineto_results.events())
    ops = [e for e in events if e.name() != "[memory]"]
    expected = 2 * (torch.ones(ROWS, OUT, dtype=torch.float64, device=run.device).t() @ x.double())
    grad = module.main_grad(layer.weight) if isinstance(module, flatgrad.FlatGrad) else layer.weight.grad
    assert grad is not None
    error = float((grad.double() - expected).abs().max() / expected.abs().max())
    return LinearProfile(
        Profile(
            [(e.name(), [tuple(s) for s in e.shapes()]) for e in ops],
            device_events(prof) if run.cuda else [],
        ),
        [list(e.dtypes()) for e in ops],
        [e.nbytes() for e in events if e.name() == "[memory]" and e.nbytes() > 0],
        (OUT, IN),
        error,
    )


def check_linear_no_temporary(run: DeviceRun) -> Outcome:
    """An accumulating backward of a routed bfloat16 Linear with a main grad allocates and
    copies nothing of the weight's size (stock's bfloat16 `.grad` accumulation, profiled
    beside it, allocates its weight-sized gradient)."""
    ours, stock = profile_linear(run, main_grads=True), profile_linear(run, main_grads=False)
    rtol = OPERAND_RTOL[run.device.type]
    fused = run.cuda and fused_accumulate(run.device.type)
    path = (
        "addmm(out_dtype=float32) into the main grad"
        if fused
        else "float32 fallback: operands upcast, addmm_ into the main grad"
    )
    gemm = ours.gemms("aten::addmm", (FP32, BF16, BF16)) if fused else ours.gemms("aten::addmm_", (FP32,) * 3)
    detail = (
        f"Linear({IN}, {OUT}), {ROWS} rows, second backward ({path}: {gemm} seen): weight-sized "
        f"(bf16 or float32) allocations flatgrad {len(ours.weight_sized())}, stock bf16 .grad "
        f"{len(stock.weight_sized())}; copy/cast/add ops on the weight's shape flatgrad "
        f"{ours.weight_copies()}, stock {stock.weight_copies()}; relative difference from the float64 "
        f"products flatgrad {ours.error:.2g} (<= {rtol:g}), stock {stock.error:.2g}"
    )
    clean = not ours.weight_sized() and ours.weight_copies() == 0
    return Outcome(gemm == 1 and clean and ours.error <= rtol, detail)


def _probe_error(device: torch.device) -> str:
    """What this torch's CUDA addmm says to a float32 input with out_dtype (the probe's call)."""
    main = torch.ones(2, 2, device=device)
    ones = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
    try:
        torch.addmm(main, ones, ones, out_dtype=torch.float32, out=main)  # type: ignore[call-overload]
    except (RuntimeError, TypeError, NotImplementedError) as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return f"accepted, result {main.tolist()} (expected all 3)"


def check_out_dtype_gemm(run: DeviceRun) -> Outcome:
    """On CUDA: `fused_accumulate("cuda")` holds, and the routed Linear's backward runs one
    aten::addmm with a float32 input and bfloat16 operands on the main grad's shape (the
    out_dtype GEMM), with no weight-sized allocation and no weight-sized device copy."""
    if not run.cuda:
        return skipped(
            "CUDA only: the CPU has no addmm kernel with out_dtype (fused_accumulate('cpu') is False); "
            "the no-temporary check covers the CPU's float32 fallback"
        )
    if not fused_accumulate(run.device.type):
        # Not a failure of flatgrad's: older CUDA builds of addmm with out_dtype refuse a float32
        # input beside bfloat16 operands. The fallback is what the no-temporary check measures.
        return skipped(
            f"fused_accumulate('cuda') is False on torch {torch.__version__}: the routed Linear takes "
            f"the float32 fallback (upcast operands, addmm_); the probe's addmm: {_probe_error(run.device)}"
        )
    ours, rtol = profile_linear(run, main_grads=True), OPERAND_RTOL["cuda"]
    gemm = ours.gemms("aten::addmm", (FP32, BF16, BF16))
    fallback = ours.gemms("aten::addmm_", (FP32,) * 3)
    copies = ours.profile.device_copies(2 * IN * OUT)
    kernels = sorted({k["name"][:80] for k in ours.profile.kernels if k.get("cat") == "kernel"})
    detail = (
        f"fused_accumulate('cuda') True: aten::addmm(float32 main grad, bf16, bf16, out_dtype=float32) "
        f"{gemm}, float32 fallback addmm_ {fallback}; weight-sized allocations "
        f"{len(ours.weight_sized())}, DtoD copies >= the bf16 weight's bytes {copies}; relative "
        f"difference from the float64 products {ours.error:.2g} (<= {rtol:g}); kernels: " + ", ".join(kernels)
    )
    clean = not ours.weight_sized() and copies == 0 and ours.error <= rtol
    return Outcome(gemm == 1 and fallback == 0 and clean, detail)
