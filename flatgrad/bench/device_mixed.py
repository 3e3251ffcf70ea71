"""Main grads on the device (``grad_dtype="float32"``): their exactness against float64
oracles, the routed Linear's weight-gradient GEMM profiled (no weight-sized temporary; on
CUDA the ``addmm(..., out_dtype=torch.float32)`` kernel writing into the main grad), and
`ShardedOptimizer` on one rank against a written-out float32-master reference.

The oracles follow tests/test_main_grad.py: the *stock oracle* sums stock's per-micro-batch
bfloat16 gradients in float64 (main grads must be at least twice closer to it than stock's
bfloat16 `.grad` accumulation); the *operand oracle* recomputes the weight gradients in
float64 from the very bfloat16 operands each backward multiplies (main grads must equal it
to float32 round-off).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import flatgrad
from flatgrad.bench.counters import COPY_OPS
from flatgrad.bench.device_base import (
    DeviceRun,
    Outcome,
    device_events,
    grad_in_buffers,
    profiled,
    single_rank_group,
    skipped,
)
from flatgrad.bench.device_checks import Profile
from flatgrad.functional import fused_accumulate

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


@contextlib.contextmanager
def quiet_main_grad_warning() -> Iterator[None]:
    """Without the wrap-time warning that a torch optimizer skips parameters with main grads:
    these checks read them with `flat.main_grad` or step them with ShardedOptimizer."""
    wrapper_logger = logging.getLogger("flatgrad.wrapper")
    level = wrapper_logger.level
    wrapper_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        wrapper_logger.setLevel(level)


def wrap_main_grads(model: nn.Module) -> flatgrad.FlatGrad:
    """`model` wrapped with `MAIN_GRADS`."""
    with quiet_main_grad_warning():
        return flatgrad.FlatGrad(model, config=MAIN_GRADS)


def main_grad_model(device: torch.device) -> MainGradLM:
    """The same bfloat16 `MainGradLM` at every call."""
    torch.manual_seed(0)
    return MainGradLM().to(device, torch.bfloat16)


def token_batches(count: int, device: torch.device, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator).to(device) for _ in range(count)]


def stock_oracle(model: nn.Module, batches: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stock's per-micro-batch bfloat16 gradients, summed in float64."""
    sums = {name: torch.zeros_like(p, dtype=torch.float64) for name, p in model.named_parameters()}
    for tokens in batches:
        model.zero_grad()
        model(tokens).backward()
        for name, param in model.named_parameters():
            sums[name] += param.grad.double()  # type: ignore[union-attr]
    return sums


def operand_oracle(model: MainGradLM, batches: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Float64 products of the bfloat16 operands each routed backward multiplies (captured
    by hooks), plus the unrouted LayerNorm's per-micro-batch stock gradient."""
    names = {id(p): name for name, p in model.named_parameters()}
    sums = {name: torch.zeros_like(p, dtype=torch.float64) for name, p in model.named_parameters()}
    seen: list[tuple[nn.Module, torch.Tensor, torch.Tensor]] = []

    def capture(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        out.register_hook(lambda g: seen.append((module, args[0].detach(), g.detach())))

    handles = [m.register_forward_hook(capture) for m in (model.emb, model.up, model.down, model.head)]
    for tokens in batches:
        model.zero_grad()
        seen.clear()
        model(tokens).backward()
        for module, x, g in seen:
            if isinstance(module, nn.Embedding):
                sums["emb.weight"].index_add_(0, x.reshape(-1), g.reshape(-1, DIM).double())
                continue
            assert isinstance(module, nn.Linear)
            rows, inputs = g.reshape(-1, g.shape[-1]).double(), x.reshape(-1, x.shape[-1]).double()
            sums[names[id(module.weight)]] += rows.t() @ inputs
            if module.bias is not None:
                sums[names[id(module.bias)]] += rows.sum(0)
        for name in ("norm.weight", "norm.bias"):
            sums[name] += model.get_parameter(name).grad.double()  # type: ignore[union-attr]
    for handle in handles:
        handle.remove()
    return sums


def check_main_grad_exactness(run: DeviceRun) -> Outcome:
    """16 micro-batches of a bfloat16 tied LM: every main grad is float32, inside
    `grad_buffers`, `.grad` None; at least 2x closer than stock's bfloat16 accumulation to
    the stock oracle, and within float32 round-off of the operand oracle."""
    model = main_grad_model(run.device)
    flat = wrap_main_grads(model)
    stock = main_grad_model(run.device)
    batches = token_batches(MICRO_BATCHES, run.device)
    for tokens in batches:
        flat(tokens).backward()
        stock(tokens).backward()  # stock: .grad accumulated in bfloat16
    summed = stock_oracle(main_grad_model(run.device), batches)
    exact = operand_oracle(main_grad_model(run.device), batches)
    rtol = OPERAND_RTOL[run.device.type]
    problems, gains, worst = [], [], 0.0
    for (name, param), ref in zip(model.named_parameters(), stock.parameters()):
        main = flat.main_grad(param)
        if param.grad is not None or main.dtype != torch.float32 or not grad_in_buffers(flat, main):
            problems.append(f"{name}: .grad {param.grad is None and 'None' or 'set'}, main grad {main.dtype}")
        ours = float((main.double() - summed[name]).abs().max())
        theirs = float((ref.grad.double() - summed[name]).abs().max())  # type: ignore[union-attr]
        gains.append(theirs / ours if ours else float("inf"))
        if ours > 0.5 * theirs:
            problems.append(f"{name}: {ours:.3g} from the stock oracle against stock's {theirs:.3g}")
        error = float((main.double() - exact[name]).abs().max()) / (float(exact[name].abs().max()) or 1.0)
        worst = max(worst, error)
        if error > rtol:
            problems.append(f"{name}: {error:.3g} of the largest element from the operand oracle > {rtol:g}")
    finite = [g for g in gains if g != float("inf")]
    detail = (
        f"bf16 tied LM, {MICRO_BATCHES} micro-batches, {len(gains)} parameters, float32 main grads "
        f"inside grad_buffers, .grad None: against the float64 sum of stock's per-micro-batch bf16 "
        f"grads, {min(finite, default=float('inf')):.1f}x to {max(finite, default=float('inf')):.1f}x "
        f"closer than stock's bf16 accumulation ({len(gains) - len(finite)} exact; required >= 2x); "
        f"against the float64 products of the same bf16 operands, largest relative difference "
        f"{worst:.2g} (tolerance {rtol:g})"
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
        return Outcome(
            False,
            f"fused_accumulate('cuda') is False on torch {torch.__version__}: the routed Linear takes "
            f"the float32 fallback (upcast operands, addmm_); the probe's addmm: {_probe_error(run.device)}",
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


STEPS, MICRO, MAX_NORM, LR, WEIGHT_DECAY = 3, 4, 2.0, 1e-2, 0.1  # norms ~7: every step clips


def _clip(masters: list[torch.Tensor]) -> None:
    """torch's `clip_grad_norm_` with its total norm taken in float64, as flatgrad's is:
    ``min(1, max_norm / (norm + 1e-6))``, rounded to float32, multiplies every gradient.
    torch's own norm is float32 round-off away from it, which can move the coefficient by a
    float32 ulp; AdamW magnifies that where a clipped gradient is near its eps (measured on
    CPU, torch's clip as the reference: 1 seed of 4 left 1% of the elements unequal and one
    4.6 bf16 ulps off; with this one, 10 seeds of 10 at least 99.99% equal, within 1 ulp)."""
    grads = [m.grad for m in masters if m.grad is not None]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads]))
    coef = torch.clamp(MAX_NORM / (total + 1e-6), max=1.0).float()
    torch._foreach_mul_(grads, coef)


def _reference_step(
    flat: flatgrad.FlatGrad, masters: list[torch.Tensor], optimizer: torch.optim.Optimizer, batches: list
) -> None:
    """One step written out: each micro-batch's main grad alone, summed in float32, averaged
    over the ranks, clipped (`_clip`), AdamW on float32 masters, cast back to bfloat16."""
    sums = [torch.zeros_like(m) for m in masters]
    for tokens in batches:
        flat.zero_grad()
        flat(tokens).backward()
        for total, param in zip(sums, flat.module.parameters()):
            total += flat.main_grad(param)
    for master, total in zip(masters, sums):
        total /= dist.get_world_size()
        dist.all_reduce(total)
        master.grad = total
    _clip(masters)
    optimizer.step()
    with torch.no_grad():
        for param, master in zip(flat.module.parameters(), masters):
            param.copy_(master)


def _train_sharded(model: nn.Module, batches: list[torch.Tensor]) -> list[float]:
    """`STEPS` steps of DataParallel + ShardedOptimizer(AdamW) on `model`, micro-batches
    under no_sync but the last; the norm before clipping at each step."""
    dp = flatgrad.DataParallel(wrap_main_grads(model), bucket_mb=0.01)
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY)
    norms = []
    for step in range(STEPS):
        micro = batches[step * MICRO : (step + 1) * MICRO]
        with dp.no_sync():
            for tokens in micro[:-1]:
                dp(tokens).backward()
        dp(micro[-1]).backward()
        norms.append(float(opt.clip_grad_norm_(MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return norms


def _ulps_apart(params: list[nn.Parameter], reference: list[nn.Parameter]) -> tuple[float, float]:
    """Over all elements: the share equal, and the largest difference in bf16 ulps of the
    reference's value (of 1e-3 for an element near zero, which a step of lr = 1e-2 passes:
    it has no meaningful ulp of its own)."""
    ours = torch.cat([p.detach().float().flatten() for p in params])
    ref = torch.cat([p.detach().float().flatten() for p in reference])
    off = (ours - ref).abs()
    ulp = torch.finfo(torch.bfloat16).eps * ref.abs().clamp_min(1e-3)
    return float((off == 0).float().mean()), float((off / ulp).max())


def check_sharded_main_grads(run: DeviceRun) -> Outcome:
    """ShardedOptimizer over DataParallel with main grads, world size 1 (NCCL on CUDA, gloo
    on CPU), against the written-out float32-master reference of tests/test_mixed_precision.py
    (`_reference_step`): over all elements, >= 99% equal and every one within 2 bf16 ulps;
    the parameters stay bfloat16 with `.grad` None."""
    backend = "nccl" if run.cuda else "gloo"
    model = main_grad_model(run.device)
    reference = copy.deepcopy(model)
    masters = [p.detach().float().requires_grad_() for p in reference.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=LR, weight_decay=WEIGHT_DECAY)
    batches = token_batches(STEPS * MICRO, run.device, seed=10)
    with single_rank_group(backend, run.device):
        norms = _train_sharded(model, batches)
        ref_flat = wrap_main_grads(reference)
        for step in range(STEPS):
            _reference_step(ref_flat, masters, ref_opt, batches[step * MICRO : (step + 1) * MICRO])
    params = list(model.parameters())
    equal, ulps = _ulps_apart(params, list(reference.parameters()))
    kept = all(p.dtype == torch.bfloat16 and p.grad is None for p in params)
    detail = (
        f"{backend} world size 1, bf16 tied LM, {STEPS} AdamW steps of {MICRO} micro-batches, norms "
        f"{', '.join(f'{n:.2f}' for n in norms)} clipped to {MAX_NORM:g}: against float32 masters "
        f"stepped by torch from float32 sums and cast back, {equal:.2%} of elements equal (>= 99% "
        f"required), at most {ulps:.2f} bf16 ulps apart (<= 2); parameters "
        f"{'bf16 with .grad None' if kept else 'NOT all bf16 with .grad None'}"
    )
    return Outcome(equal >= 0.99 and ulps <= 2 and kept, detail)
