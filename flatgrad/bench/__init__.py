"""`python -m flatgrad.bench` / `flatgrad-bench`: FlatGrad against stock PyTorch and DDP,
side by side in one run, with tables and a JSON report."""

from flatgrad.bench.cli import main

__all__ = ["main"]
