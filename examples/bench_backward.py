"""Backward-pass benchmark: FlatGrad's layer backwards against stock PyTorch, one process.

Stock PyTorch and flatgrad run each case side by side, interleaved; it prints the median
backward time of each and their ratio (flatgrad / stock; below 1.0 means flatgrad is faster):

    python examples/bench_backward.py                       # all cases, 30 repeats each
    python examples/bench_backward.py --repeats 50 --cases embedding

The same cases are part of the full suite, `python -m flatgrad.bench`.
"""

from __future__ import annotations

import argparse

import torch

from flatgrad.bench.ops import format_ops, op_ratios


def main() -> None:
    parser = argparse.ArgumentParser(description="FlatGrad layer backwards vs stock PyTorch")
    parser.add_argument("--repeats", type=int, default=30, help="timed backward passes per side")
    parser.add_argument("--cases", default="", help="only the cases whose name contains this")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, medians of {args.repeats}")
    print(format_ops(op_ratios(args.repeats, args.cases)))


if __name__ == "__main__":
    main()
