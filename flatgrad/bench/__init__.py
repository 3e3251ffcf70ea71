"""`python -m flatgrad.bench` / `flatgrad-bench`: FlatGrad against stock PyTorch and DDP,
side by side in one run, with a table, a JSON report and an optional PNG chart."""

from flatgrad.bench.cli import main

__all__ = ["main"]
