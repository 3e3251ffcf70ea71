"""Shared by the framework recipes (lightning_train.py, accelerate_train.py): the tiny model,
each rank's batches, and `StepProbe`, which records per step what tests/test_frameworks.py
checks. Not a recipe itself: the recipes run the same without the probe.
"""

from __future__ import annotations

import contextlib
import gc
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import flatgrad
import flatgrad._functional

# Ops that would move a gradient: DDP's copies into and out of its buckets, AccumulateGrad's
# clone or add, a scaling pass.
_COPY_OPS = {"aten::copy_", "aten::clone", "aten::add_", "aten::mul", "aten::mul_", "aten::_to_copy"}


class TinyLM(nn.Module):
    """Embedding, two Linears and an LM head (what flatgrad routes) and a LayerNorm."""

    def __init__(self, vocab: int = 50, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.fc = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(torch.tanh(self.fc(self.emb(tokens)))))
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())


def batch(step: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s tokens for step `step`: different on every rank, the same in every run."""
    return torch.randint(0, 50, (8, 12), generator=torch.Generator().manual_seed(1000 * rank + step))


class StepProbe:
    """Wrap each backward in `probe.backward()` (or call `start`/`stop` around it). Records the
    comm hook's calls so far, gradient-sized copies seen by the profiler in backward, and,
    once FlatGrad is applied to `model` (or to a submodule of it), whether every `.grad` is a
    view of one of its `grad_buffers`."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.state: flatgrad.FlatGradCommState | None = None  # set once the hook is registered
        self._shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
        self._profile: torch.profiler.profile | None = None
        self.hook_calls: list[int] = []
        self.grad_copies: list[int] = []
        self.grads_in_buffers: list[bool] = []
        # Linear weights whose `.grad` sits off a fresh tensor's alignment in DDP's packed bucket:
        # flatgrad computes their product fresh and copies it in, for stock's bits (docs/ddp.md).
        self.off_alignment: list[int] = []

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        self.start()
        try:
            yield
        finally:
            self.stop()

    def start(self) -> None:
        self._profile = torch.profiler.profile(record_shapes=True)
        self._profile.__enter__()

    def stop(self) -> None:
        assert self._profile is not None
        self._profile.__exit__(None, None, None)
        events = self._profile.events()
        self.grad_copies.append(
            sum(e.name in _COPY_OPS and any(tuple(s) in self._shapes for s in e.input_shapes) for e in events)
        )
        self.hook_calls.append(self.state.num_calls if self.state is not None else 0)
        weights = [m.weight.grad for m in self.model.modules() if isinstance(m, nn.Linear)]
        self.off_alignment.append(sum(g is not None and not flatgrad._functional.aligned(g) for g in weights))
        applied = next((m for m in self.model.modules() if isinstance(m, flatgrad.FlatGrad)), None)
        if applied is not None:
            self.grads_in_buffers.append(all(_in_buffers(p.grad, applied) for p in self.model.parameters()))

    def report(self, world_size: int) -> dict[str, Any]:
        return {
            "world_size": world_size,
            "num_calls": self.state.num_calls if self.state is not None else 0,  # the hook's, in all
            "params": [p.detach().tolist() for p in self.model.parameters()],
            "hook_calls": self.hook_calls,
            "grad_copies": self.grad_copies,
            "grads_in_buffers": self.grads_in_buffers,
            "off_alignment": self.off_alignment,
        }


def _in_buffers(grad: torch.Tensor | None, model: flatgrad.FlatGrad) -> bool:
    if grad is None:
        return False
    for buf in model.grad_buffers.values():
        start, end = buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()
        if start <= grad.data_ptr() and grad.data_ptr() + grad.numel() * grad.element_size() <= end:
            return True
    return False


def summarise(reports: dict[str, dict[str, Any]], path: Path | None) -> None:
    """Rank 0: print each run's hook calls and, with both runs, the largest parameter
    difference between them; write the reports to `path` as JSON if given."""
    for run, report in reports.items():
        print(f"{run}: {report['world_size']} ranks, flatgrad.allreduce_hook calls: {report['num_calls']}")
    if len(reports) == 2:
        a, b = ([torch.tensor(p) for p in r["params"]] for r in reports.values())
        print(f"largest parameter difference: {max((p - q).abs().max().item() for p, q in zip(a, b)):.3g}")
    if path is not None:
        path.write_text(json.dumps(reports))


def run_and_summarise(
    stock: bool, compare: bool, train: Callable[[bool], dict[str, Any]], path: Path | None
) -> None:
    """Run the flatgrad recipe, the stock one or both (`train(stock)` returns a run's
    report); rank 0 summarises; the process group is destroyed at the end."""
    runs = ("flatgrad", "stock") if compare else ("stock",) if stock else ("flatgrad",)
    try:
        reports = {run: train(run == "stock") for run in runs}
        if dist.get_rank() == 0:
            summarise(reports, path)
    finally:
        gc.collect()  # free DDP while the process group exists (gloo can abort otherwise)
        if dist.is_initialized():
            dist.destroy_process_group()
