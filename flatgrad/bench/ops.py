"""Single-op backward benchmarks: FlatGrad's layer backwards against stock PyTorch.

Stock and wrapped run side by side, interleaved; each figure is a median backward time and
the ratio wrapped / stock (below 1.0: flatgrad is faster).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import flatgrad
from flatgrad.bench.memory import sync

CPU = torch.device("cpu")
Case = tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor], Callable[[], None]]


def _time_backward(forward: Callable[[], torch.Tensor], device: torch.device) -> float:
    out = forward()  # forward outside the timed region: only backward is measured
    grad_out = torch.ones_like(out)
    sync(device)
    start = time.perf_counter()
    out.backward(grad_out)
    sync(device)
    return time.perf_counter() - start


def compare(case: Case, repeats: int, device: torch.device = CPU) -> tuple[float, float]:
    """Median backward seconds of (stock, flatgrad), alternating which goes first."""
    stock, ours, zero = case
    for _ in range(2):
        zero(), _time_backward(stock, device), _time_backward(ours, device)
    stock_times: list[float] = []
    our_times: list[float] = []
    for i in range(repeats):
        zero()
        pair = [(stock, stock_times), (ours, our_times)]
        for forward, times in pair if i % 2 == 0 else pair[::-1]:
            times.append(_time_backward(forward, device))
    return statistics.median(stock_times), statistics.median(our_times)


def _pair(stock: nn.Module, flat: nn.Module, inputs: torch.Tensor, accumulate: bool) -> Case:
    """Stock `stock` and the FlatGrad `flat` on `inputs`; each repeat starts from fresh
    gradients, or with `accumulate` from zero gradients to add into."""

    def zero() -> None:
        for p in stock.parameters():
            p.grad = torch.zeros_like(p) if accumulate else None
        flat.zero_grad(set_to_none=not accumulate)

    return (lambda: stock(inputs)), (lambda: flat(inputs)), zero


def _embedding(accumulate: bool, device: torch.device) -> Case:
    stock = nn.Embedding(50000, 256, device=device)
    idx = torch.randint(0, 50000, (32768,), device=device)
    return _pair(stock, flatgrad.FlatGrad(copy.deepcopy(stock)), idx, accumulate)


def _gather(device: torch.device) -> Case:
    table = torch.randn(20, device=device, requires_grad=True)
    ours = table.detach().clone().requires_grad_()
    idx = torch.randint(0, 20, (1_000_000,), device=device)

    def zero() -> None:
        table.grad = ours.grad = None

    return (lambda: table[idx]), (lambda: flatgrad.gather_with_index_add(ours, idx)), zero


class _Table(nn.Module):
    """A (4096, 1024) parameter read along dim 1 with a (4096, 256) index."""

    def __init__(self, dim_gather: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4096, 1024))
        self.gather = dim_gather

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return self.gather(self.weight, 1, index)


def _dim_gather(accumulate: bool, device: torch.device) -> Case:
    stock = _Table(torch.gather).to(device)
    flat = flatgrad.FlatGrad(_Table(flatgrad.gather).to(device))
    index = torch.randint(0, 1024, (4096, 256), device=device)
    return _pair(stock, flat, index, accumulate)


def _linear_stack(accumulate: bool, device: torch.device) -> Case:
    stock = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)]).to(device)
    x = torch.randn(256, 512, device=device)
    return _pair(stock, flatgrad.FlatGrad(copy.deepcopy(stock)), x, accumulate)


CASES: dict[str, Callable[[torch.device], Case]] = {
    "embedding 50000x256, 32768 idx, fresh .grad": lambda d: _embedding(False, d),
    "embedding 50000x256, 32768 idx, accumulating": lambda d: _embedding(True, d),
    "gather 20-elem table, 1M idx (vs table[idx])": _gather,
    "gather dim 1 of 4096x1024, 4096x256 idx, fresh": lambda d: _dim_gather(False, d),
    "gather dim 1 of 4096x1024, 4096x256 idx, accum.": lambda d: _dim_gather(True, d),
    "linear 8x(512x512), batch 256, fresh .grad": lambda d: _linear_stack(False, d),
    "linear 8x(512x512), batch 256, accumulating": lambda d: _linear_stack(True, d),
}


def op_ratios(repeats: int = 30, only: str = "", device: torch.device = CPU) -> list[dict[str, float | str]]:
    """Run every case whose name contains `only` on `device`; one record per case."""
    rows: list[dict[str, float | str]] = []
    for name, build in CASES.items():
        if only in name:
            stock, ours = compare(build(device), repeats, device)
            rows.append(
                {"case": name, "stock_ms": stock * 1e3, "flatgrad_ms": ours * 1e3, "ratio": ours / stock}
            )
    return rows


def format_ops(rows: list[dict[str, float | str]]) -> str:
    lines = [f"{'backward of':48s} {'stock ms':>9s} {'flatgrad ms':>12s} {'ratio':>6s}"]
    for r in rows:
        lines.append(f"{r['case']:48s} {r['stock_ms']:9.2f} {r['flatgrad_ms']:12.2f} {r['ratio']:6.2f}")
    return "\n".join(lines)
