"""Single-process device checks: exact gradients against stock autograd, and profiles of one
backward showing no gradient copies and no sorts (CPU ops everywhere, kernels on CUDA)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import flatgrad
from flatgrad.bench.counters import COPY_OPS
from flatgrad.bench.device_base import (
    ROUTE_ALL,
    CheckLM,
    DeviceRun,
    Outcome,
    device_events,
    grad_in_buffers,
    lm_batches,
    profiled,
    skipped,
    weight_shapes,
)

# CPU ops of a sorting backward: index_put_(accumulate=True) (weight[idx]) and explicit sorts.
SORT_OPS = frozenset({"aten::sort", "aten::argsort", "aten::_index_put_impl_"})
MICRO_BATCHES = 3


def _accumulate(module: nn.Module, batches: Sequence[tuple[torch.Tensor, ...]], autocast: bool) -> None:
    """Forward and backward of every micro-batch, gradients accumulating in `.grad`."""
    device_type = batches[0][0].device.type
    for batch in batches:
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
            loss = module(*batch)
        loss.backward()


def _grad_problems(flat: flatgrad.FlatGrad, stock: nn.Module, rtol: float) -> tuple[list[str], float]:
    """Where FlatGrad's gradients differ from stock's by more than `rtol` (relative to each
    gradient's largest element), lie outside `grad_buffers`, or exist where stock has none;
    and the largest relative difference seen."""
    ours = dict(flat.named_parameters())
    problems, worst = [], 0.0
    for name, ref in stock.named_parameters():
        grad = ours[name].grad
        if ref.grad is None or grad is None:
            if (ref.grad is None) != (grad is None):
                problems.append(f"{name}: .grad is {grad is None and 'None' or 'set'}, stock's is not")
            continue
        scale = float(ref.grad.abs().max()) or 1.0
        error = float((grad - ref.grad).abs().max()) / scale
        worst = max(worst, error)
        if error > rtol:
            problems.append(f"{name}: max |flatgrad - stock| / max |stock| = {error:.3g} > {rtol:g}")
        if not grad_in_buffers(flat, grad):
            problems.append(f"{name}: .grad lies outside flat.grad_buffers")
    return problems, worst


def _exactness(run: DeviceRun, dtype: torch.dtype, autocast: bool, rtol: float) -> Outcome:
    torch.manual_seed(0)
    stock = CheckLM().to(run.device, dtype)
    flat = flatgrad.FlatGrad(copy.deepcopy(stock), config=ROUTE_ALL)
    batches = lm_batches(MICRO_BATCHES, run.device)
    if autocast:
        with torch.autocast(run.device.type, dtype=torch.bfloat16):
            computed = stock.mix(stock.tokens(batches[0][0])).dtype
        if computed != torch.bfloat16:
            raise AssertionError(
                f"a Linear under bf16 autocast on {run.device} must compute in bfloat16, got {computed}"
            )
    _accumulate(stock, batches, autocast)
    _accumulate(flat, batches, autocast)
    unused = [n for n, p in stock.named_parameters() if p.grad is None]
    if unused != ["unused.weight", "unused.bias"]:
        raise AssertionError(f"the check model's unused branch must get no gradient in stock, got {unused}")
    problems, worst = _grad_problems(flat, stock, rtol)
    num = sum(p.grad is not None for p in flat.parameters())
    detail = (
        f"{MICRO_BATCHES} micro-batches, {dtype}{' under bf16 autocast' if autocast else ''}: "
        f"largest relative difference {worst:.3g} (tolerance {rtol:g}); {num} grads inside "
        f"grad_buffers; {', '.join(unused)} keep .grad None as stock"
    )
    return Outcome(not problems, "; ".join(problems) or detail)


def check_exact_float64(run: DeviceRun) -> Outcome:
    """Float64: the same sums, possibly in another order: round-off of 1e-12 at most."""
    return _exactness(run, torch.float64, autocast=False, rtol=1e-12)


def check_exact_bf16_autocast(run: DeviceRun) -> Outcome:
    """Float32 parameters under bf16 autocast: both sides round GEMM inputs and outputs to
    bfloat16 (8 bits of mantissa, 2^-8 relative), flatgrad accumulating in other places; a
    few roundings over the 3 micro-batches stay under 2^-5 of the largest element."""
    return _exactness(run, torch.float32, autocast=True, rtol=2**-5)


@dataclass
class Profile:
    """One profiled backward: CPU ops as (name, input shapes), and on CUDA its device events."""

    ops: list[tuple[str, list[tuple[int, ...]]]]
    kernels: list[dict[str, Any]]

    def count(self, names: frozenset[str], shapes: set[tuple[int, ...]] | None = None) -> int:
        """Ops named in `names` (with an input of one of `shapes`, when given)."""
        return sum(n in names and (shapes is None or any(s in shapes for s in ss)) for n, ss in self.ops)

    def sort_kernels(self) -> int:
        return sum("radix" in k["name"].lower() or "sort" in k["name"].lower() for k in self.kernels)

    def device_copies(self, min_bytes: int) -> int:
        """Device-to-device memory copies of at least `min_bytes`."""
        return sum(
            k.get("cat") == "gpu_memcpy"
            and "DtoD" in k["name"]
            and k.get("args", {}).get("bytes", 0) >= min_bytes
            for k in self.kernels
        )


def profile_backward(run: DeviceRun, loss: torch.Tensor) -> Profile:
    """Profile ``loss.backward()`` (a scalar, or a tensor given a ones gradient)."""
    grad = torch.ones_like(loss)
    with profiled(run.device, record_shapes=True) as prof:
        loss.backward(grad)
    ops = [(e.name, [tuple(s) for s in e.input_shapes if s]) for e in prof.events()]
    return Profile(ops, device_events(prof) if run.cuda else [])


def _lm_profiles(run: DeviceRun, wrap: bool) -> tuple[list[Profile], set[tuple[int, ...]]]:
    """Backward profiles of two micro-batches (fresh, then accumulating) of the check LM."""
    torch.manual_seed(0)
    model = CheckLM().to(run.device)
    module: nn.Module = flatgrad.FlatGrad(model, config=ROUTE_ALL) if wrap else model
    profiles = [profile_backward(run, module(*batch)) for batch in lm_batches(2, run.device)]
    return profiles, weight_shapes(model.parameters())


def check_zero_copy_ops(run: DeviceRun) -> Outcome:
    """No op of `COPY_OPS` with a weight-shaped input in FlatGrad's backward."""
    counts = {}
    for label, wrap in (("flatgrad", True), ("stock", False)):
        profiles, shapes = _lm_profiles(run, wrap)
        counts[label] = [p.count(COPY_OPS, shapes) for p in profiles]
    detail = (
        "weight-sized copy/clone/add/mul ops in backward (fresh, accumulating micro-batch) of the "
        f"tied LM: flatgrad {counts['flatgrad']}, stock {counts['stock']}"
    )
    return Outcome(sum(counts["flatgrad"]) == 0, detail)


def check_zero_copy_kernels(run: DeviceRun) -> Outcome:
    """On CUDA: no device-to-device memcpy of a weight gradient's size in FlatGrad's backward."""
    if not run.cuda:
        return skipped("CUDA kernels (Memcpy DtoD) exist only on CUDA; the CPU ops check covers copies")
    counts = {}
    for label, wrap in (("flatgrad", True), ("stock", False)):
        profiles, shapes = _lm_profiles(run, wrap)
        smallest = min(torch.Size(s).numel() for s in shapes) * 4  # float32 bytes
        counts[label] = [p.device_copies(smallest) for p in profiles]
    detail = (
        "Memcpy DtoD of at least the smallest weight gradient's bytes in backward (fresh, "
        f"accumulating): flatgrad {counts['flatgrad']}, stock {counts['stock']}"
    )
    return Outcome(sum(counts["flatgrad"]) == 0, detail)


class _Rows(nn.Module):
    """A parameter read through `read(weight, index)`."""

    def __init__(self, weight: torch.Tensor, read: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        super().__init__()
        self.weight = nn.Parameter(weight.clone())
        self.read = read

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return self.read(self.weight, index)


def _gather_dim1(weight: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return flatgrad.gather(weight, 1, index)


def _sort_cases(run: DeviceRun) -> dict[str, dict[str, Callable[[], torch.Tensor]]]:
    """Per case: the flatgrad forward, then the stock ones; each builds its own parameter."""
    rows, dim, tokens = (4096, 64, 8192) if not run.cuda else (32768, 256, 16384)
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(rows, dim, generator=gen).to(run.device)
    idx = torch.randint(0, rows, (tokens,), generator=gen).to(run.device)
    flat_idx = torch.randint(0, rows * dim, (tokens * 4,), generator=gen).to(run.device)
    gather_idx = torch.randint(0, dim, (rows, dim // 4), generator=gen).to(run.device)

    def wrapped(read: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], weight: torch.Tensor, index):
        return lambda: flatgrad.FlatGrad(_Rows(weight, read), config=ROUTE_ALL)(index)

    def plain(read: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], weight: torch.Tensor, index):
        return lambda: _Rows(weight, read)(index)

    embedding = nn.Embedding.from_pretrained(table, freeze=False)
    return {
        "routed nn.Embedding": {
            "flatgrad": lambda: flatgrad.FlatGrad(copy.deepcopy(embedding), config=ROUTE_ALL)(idx),
            "F.embedding": plain(lambda w, i: F.embedding(i, w), table, idx),
            "weight[idx]": plain(lambda w, i: w[i], table, idx),
        },
        "gather_with_index_add": {
            "flatgrad": wrapped(flatgrad.gather_with_index_add, table.flatten(), flat_idx),
            "weight[idx]": plain(lambda w, i: w[i], table.flatten(), flat_idx),
        },
        "flatgrad.gather": {
            "flatgrad": wrapped(_gather_dim1, table, gather_idx),
            "torch.gather": plain(lambda w, i: torch.gather(w, 1, i), table, gather_idx),
        },
    }


def _sort_counts(run: DeviceRun, kernels: bool) -> tuple[bool, str]:
    """Whether no flatgrad backward sorts, and per case the counts of every variant."""
    ok, parts = True, []
    for case, variants in _sort_cases(run).items():
        counts = {}
        for label, forward in variants.items():
            prof = profile_backward(run, forward())
            counts[label] = prof.sort_kernels() if kernels else prof.count(SORT_OPS)
        ok = ok and counts["flatgrad"] == 0
        parts.append(f"{case}: " + ", ".join(f"{label} {n}" for label, n in counts.items()))
    return ok, "; ".join(parts)


def check_sort_free_ops(run: DeviceRun) -> Outcome:
    ok, counts = _sort_counts(run, kernels=False)
    return Outcome(ok, f"{'/'.join(sorted(SORT_OPS))} ops in one backward: {counts}")


def check_sort_free_kernels(run: DeviceRun) -> Outcome:
    if not run.cuda:
        return skipped("radix-sort kernels exist only on CUDA; the CPU ops check covers sorts")
    ok, counts = _sort_counts(run, kernels=True)
    return Outcome(ok, f"kernels named *radix* or *sort* in one backward: {counts}")
