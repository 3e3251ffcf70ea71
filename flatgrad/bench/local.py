"""One-process training steps, stock against FlatGrad, and the torch.compile row.

A step is ``optimizer.zero_grad()``, forward, backward, optionally gradient clipping
(`torch.nn.utils.clip_grad_norm_` against `FlatGrad.clip_grad_norm_`), SGD step. Stock and
FlatGrad train their own copies on the same batches; steps are interleaved (which goes
first alternates) and the ratio is the median over steps of the per-step ratio.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import flatgrad
from flatgrad.bench.models import LOCAL_MODELS, BenchModel

Step = Callable[[int], None]


def _step(
    module: nn.Module, params: list[nn.Parameter], clip: Callable[[], Any] | None, spec: BenchModel
) -> Step:
    optimizer = torch.optim.SGD(params, lr=1e-3)
    device = torch.device("cpu")

    def step(i: int) -> None:
        optimizer.zero_grad()
        module(*spec.batch(torch.Generator().manual_seed(i), device)).backward()
        if clip is not None:
            clip()
        optimizer.step()

    return step


def _pair(spec: BenchModel, clip: bool, compile_: bool = False) -> tuple[Step, Step]:
    torch.manual_seed(0)
    model = spec.build()
    stock = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model)
    stock_run: nn.Module = torch.compile(stock) if compile_ else stock  # type: ignore[assignment]
    flat_run: nn.Module = torch.compile(flat) if compile_ else flat  # type: ignore[assignment]
    stock_clip = (lambda: torch.nn.utils.clip_grad_norm_(stock.parameters(), 1.0)) if clip else None
    flat_clip = (lambda: flat.clip_grad_norm_(1.0)) if clip else None
    return (
        _step(stock_run, list(stock.parameters()), stock_clip, spec),
        _step(flat_run, list(flat.parameters()), flat_clip, spec),
    )


def interleave(stock: Step, ours: Step, steps: int, warmup: int) -> dict[str, float]:
    """Median step times and the median per-step ratio ours / stock."""
    for i in range(warmup):
        stock(i)
        ours(i)
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(steps):
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for j in order:
            start = time.perf_counter()
            (stock, ours)[j](warmup + i)
            times[j].append(time.perf_counter() - start)
    ratios = [b / a for a, b in zip(*times)]
    return {
        "stock_ms": statistics.median(times[0]) * 1e3,
        "flatgrad_ms": statistics.median(times[1]) * 1e3,
        "ratio": statistics.median(ratios),
    }


def local_rows(
    steps: int, warmup: int = 3, models: dict[str, BenchModel] | None = None
) -> list[dict[str, Any]]:
    """One record per (model, clip) pair."""
    rows = []
    for name, spec in (models or LOCAL_MODELS).items():
        for clip in (False, True):
            rows.append({"model": name, "clip": clip, **interleave(*_pair(spec, clip), steps, warmup)})
    return rows


def compile_row(steps: int, warmup: int = 2, spec: BenchModel | None = None) -> dict[str, Any]:
    """`torch._dynamo.explain` graph and break counts of the plain model and of FlatGrad
    around it, and compiled step times (inductor, clipping on)."""
    spec = spec or LOCAL_MODELS["llama"]
    torch.manual_seed(0)
    model = spec.build()
    batch = spec.batch(torch.Generator().manual_seed(0), torch.device("cpu"))
    row: dict[str, Any] = {"model": "llama" if spec is LOCAL_MODELS["llama"] else "custom"}
    try:
        torch._dynamo.reset()
        stock = torch._dynamo.explain(model)(*batch)
        torch._dynamo.reset()
        ours = torch._dynamo.explain(flatgrad.FlatGrad(copy.deepcopy(model)))(*batch)
        row.update(
            stock_graphs=stock.graph_count,
            stock_breaks=stock.graph_break_count,
            flatgrad_graphs=ours.graph_count,
            flatgrad_breaks=ours.graph_break_count,
        )
        torch._dynamo.reset()
        row.update(interleave(*_pair(spec, clip=True, compile_=True), steps, warmup))
    except Exception as error:  # report, do not crash the run: compile support varies by platform
        row["error"] = f"{type(error).__name__}: {error}"
    finally:
        torch._dynamo.reset()
    return row


def format_local(rows: list[dict[str, Any]], compiled: dict[str, Any] | None) -> str:
    lines = [f"{'one process: model':22s} {'clip':>5s} {'stock ms':>9s} {'flatgrad ms':>12s} {'ratio':>6s}"]
    for r in rows:
        lines.append(
            f"{r['model']:22s} {('yes' if r['clip'] else 'no'):>5s} {r['stock_ms']:9.2f} "
            f"{r['flatgrad_ms']:12.2f} {r['ratio']:6.3f}"
        )
    if compiled:
        if "error" in compiled:
            lines.append(f"torch.compile: {compiled['error']}")
        else:
            lines.append(
                f"torch.compile {compiled['model']}: graphs/breaks stock {compiled['stock_graphs']}/"
                f"{compiled['stock_breaks']}, flatgrad {compiled['flatgrad_graphs']}/"
                f"{compiled['flatgrad_breaks']}; "
                f"compiled step (clip) stock {compiled['stock_ms']:.1f} ms, flatgrad "
                f"{compiled['flatgrad_ms']:.1f} ms, ratio {compiled['ratio']:.3f}"
            )
    return "\n".join(lines)
