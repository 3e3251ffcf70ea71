"""Backward-pass benchmark: FlatGrad's layer backwards against stock PyTorch, one process.

Runs stock and wrapped models side by side, interleaved, and reports the median backward
time of each and their ratio (wrapped / stock; below 1.0 means flatgrad is faster).

    python examples/bench_backward.py            # all cases
    python examples/bench_backward.py --repeats 50 --cases embedding
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import flatgrad


def _time(fn: Callable[[], torch.Tensor]) -> float:
    out = fn()  # forward outside the timed region: only backward is measured
    grad_out = torch.ones_like(out)
    start = time.perf_counter()
    out.backward(grad_out)
    return time.perf_counter() - start


def _compare(stock: Callable[[], torch.Tensor], ours: Callable[[], torch.Tensor], zero: Callable[[], None],
             repeats: int) -> tuple[float, float]:
    for _ in range(3):  # warm-up
        zero(), _time(stock), _time(ours)
    stock_times, our_times = [], []
    for i in range(repeats):
        zero()
        pair = [(stock, stock_times), (ours, our_times)]
        for fn, times in pair if i % 2 == 0 else pair[::-1]:
            times.append(_time(fn))
    return statistics.median(stock_times), statistics.median(our_times)


def _embedding_case(accumulate: bool) -> tuple[Callable, Callable, Callable]:
    stock = nn.Embedding(50000, 256)
    wrapped = copy.deepcopy(stock)
    flat = flatgrad.FlatGrad(wrapped)
    idx = torch.randint(0, 50000, (32768,))

    def zero() -> None:
        stock.weight.grad = torch.zeros_like(stock.weight) if accumulate else None
        flat.zero_grad(set_to_none=not accumulate)

    return (lambda: stock(idx)), (lambda: flat(idx)), zero


def _gather_case() -> tuple[Callable, Callable, Callable]:
    table = torch.randn(20, requires_grad=True)
    ours = torch.randn(20, requires_grad=True)
    idx = torch.randint(0, 20, (1_000_000,))

    def zero() -> None:
        table.grad = ours.grad = None

    return (
        (lambda: table[idx]),
        (lambda: flatgrad.gather_with_index_add(ours, idx)),
        zero,
    )


def _linear_case(accumulate: bool) -> tuple[Callable, Callable, Callable]:
    stock = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])
    wrapped = copy.deepcopy(stock)
    flat = flatgrad.FlatGrad(wrapped)
    x = torch.randn(256, 512)

    def zero() -> None:
        for p in stock.parameters():
            p.grad = torch.zeros_like(p) if accumulate else None
        flat.zero_grad(set_to_none=not accumulate)

    return (lambda: stock(x)), (lambda: flat(x)), zero


CASES: dict[str, Callable[[], tuple[Callable, Callable, Callable]]] = {
    "embedding 50000x256, 32768 idx, fresh .grad": lambda: _embedding_case(False),
    "embedding 50000x256, 32768 idx, accumulating": lambda: _embedding_case(True),
    "gather 20-elem table, 1M idx (vs table[idx])": _gather_case,
    "linear 8x(512x512), batch 256, fresh .grad": lambda: _linear_case(False),
    "linear 8x(512x512), batch 256, accumulating": lambda: _linear_case(True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30, help="timed backward passes per side")
    parser.add_argument("--cases", default="", help="only run cases whose name contains this")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, medians of {args.repeats}")
    print(f"{'case':48s} {'stock ms':>9s} {'flatgrad ms':>12s} {'ratio':>6s}")
    for name, build in CASES.items():
        if args.cases not in name:
            continue
        stock_s, ours_s = _compare(*build(), repeats=args.repeats)
        print(f"{name:48s} {stock_s * 1e3:9.2f} {ours_s * 1e3:12.2f} {ours_s / stock_s:6.2f}")


if __name__ == "__main__":
    main()
