"""One-process training steps, stock against FlatGrad, and the torch.compile row.

A step is ``optimizer.zero_grad()``, forward, backward, optionally gradient clipping
(`torch.nn.utils.clip_grad_norm_` against `FlatGrad.clip_grad_norm_`), SGD step; each model
also gets a row with gradient accumulation (several forward-backward micro-batches per step,
no clipping), where stock adds every micro-batch after the first into `.grad` and flatgrad's
routed layers accumulate inside their GEMMs (`addmm_`). Stock and
FlatGrad train their own copies on the same batches (made before timing); steps are
interleaved (which goes first rotates) and the ratio is the median over steps of the
per-step ratio. Each step's minor page faults are counted too (see `memory.pin_malloc`).

Every row also times a second stock copy, the control, in the same rotation: its ratio to
stock is what two identical models measure apart on this machine (where each model's
tensors landed in memory, the order of the steps), the floor under which a flatgrad ratio
says nothing. All three are deep copies of one built model, so none is favoured by how its
memory was allocated.

The compile row: `torch._dynamo.explain` graph and graph-break counts, and compiled step
times, of ``torch.compile(model)`` (stock), ``torch.compile(FlatGrad(model))`` and
``FlatGrad(torch.compile(model))``. A variant that fails is reported, not raised.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import nn

import flatgrad
from flatgrad.bench.memory import minor_faults, sync
from flatgrad.bench.models import LOCAL_MODELS, BenchModel

CPU = torch.device("cpu")
Batch = tuple[torch.Tensor, ...]
Step = Callable[[Batch], None]
CompileBackend = Literal["inductor", "aot_eager", "eager"]
COMPILE_BACKENDS: tuple[CompileBackend, ...] = ("inductor", "aot_eager", "eager")
# The compiled variants, each against torch.compile of the plain model ("stock").
COMPILE_VARIANTS = {
    "stock": "torch.compile(model)",
    "compile_flat": "torch.compile(FlatGrad(model))",
    "flat_compiled": "FlatGrad(torch.compile(model))",
}


def _step(
    module: nn.Module,
    params: list[nn.Parameter],
    clip: Callable[[], Any] | None,
    micro_batches: int = 1,
    device: torch.device = CPU,
) -> Step:
    optimizer = torch.optim.SGD(params, lr=1e-3)

    def step(batch: Batch) -> None:
        optimizer.zero_grad()
        for _ in range(micro_batches):
            module(*batch).backward()
        if clip is not None:
            clip()
        optimizer.step()
        sync(device)  # (a step's time is its work's, not its launches')

    return step


def _stock_step(model: nn.Module, clip: bool, micro_batches: int, device: torch.device) -> Step:
    stock = copy.deepcopy(model)
    stock_clip = (lambda: torch.nn.utils.clip_grad_norm_(stock.parameters(), 1.0)) if clip else None
    return _step(stock, list(stock.parameters()), stock_clip, micro_batches, device)


def _trio(spec: BenchModel, clip: bool, micro_batches: int, device: torch.device) -> tuple[Step, Step, Step]:
    """(stock, the stock control, flatgrad) steps, each on its own deep copy of one model."""
    torch.manual_seed(0)
    model = spec.build().to(device)
    stock, control = (_stock_step(model, clip, micro_batches, device) for _ in range(2))
    flat = flatgrad.FlatGrad(copy.deepcopy(model))
    flat_clip = (lambda: flat.clip_grad_norm_(1.0)) if clip else None
    return stock, control, _step(flat, list(flat.parameters()), flat_clip, micro_batches, device)


def _batches(spec: BenchModel, count: int, device: torch.device = CPU) -> list[Batch]:
    return [spec.batch(torch.Generator().manual_seed(i), device) for i in range(count)]


def _times(
    steps: Sequence[Step], batches: Sequence[Batch], faults: list[list[int]] | None = None
) -> list[list[float]]:
    """Seconds of every step function on every batch; which goes first rotates. `faults`,
    if given, gets each step's minor page faults, per step function."""
    times: list[list[float]] = [[] for _ in steps]
    for i, batch in enumerate(batches):
        shift = i % len(steps)
        for j in [*range(shift, len(steps)), *range(shift)]:
            before = minor_faults()
            start = time.perf_counter()
            steps[j](batch)
            times[j].append(time.perf_counter() - start)
            if faults is not None:
                faults[j].append(minor_faults() - before)
    return times


def _median_ratio(ours: list[float], stock: list[float]) -> float:
    return statistics.median(b / a for a, b in zip(stock, ours))


def interleave(
    stock: Step, control: Step, ours: Step, batches: Sequence[Batch], warmup: int
) -> dict[str, float]:
    """Median step times, the median per-step ratios ours / stock and control / stock, and
    the mean minor page faults per step of stock and ours; the first `warmup` batches are
    not timed."""
    steps = (stock, control, ours)
    _times(steps, batches[:warmup])
    faults: list[list[int]] = [[], [], []]
    stock_s, control_s, ours_s = _times(steps, batches[warmup:], faults)
    return {
        "stock_ms": statistics.median(stock_s) * 1e3,
        "flatgrad_ms": statistics.median(ours_s) * 1e3,
        "ratio": _median_ratio(ours_s, stock_s),
        "control_ratio": _median_ratio(control_s, stock_s),
        "stock_faults": statistics.fmean(faults[0]),
        "flatgrad_faults": statistics.fmean(faults[2]),
    }


def local_rows(
    steps: int,
    warmup: int = 3,
    models: dict[str, BenchModel] | None = None,
    accumulate: int = 4,
    device: torch.device = CPU,
) -> list[dict[str, Any]]:
    """Per model: one record without and one with clipping (one micro-batch per step), and,
    if `accumulate` > 1, one with that many micro-batches per step (no clipping); on `device`
    (the device report runs them on a GPU)."""
    variants = [(False, 1), (True, 1)] + ([(False, accumulate)] if accumulate > 1 else [])
    rows = []
    for name, spec in (models or LOCAL_MODELS).items():
        batches = _batches(spec, warmup + steps, device)
        for clip, micro in variants:
            measured = interleave(*_trio(spec, clip, micro, device), batches, warmup)
            rows.append({"model": name, "clip": clip, "micro_batches": micro, **measured})
    return rows


def _compile(module: nn.Module, backend: CompileBackend = "inductor") -> nn.Module:
    compiled = torch.compile(module, backend=backend)
    assert isinstance(compiled, nn.Module)  # torch.compile of a Module is an OptimizedModule
    return compiled


def _compiled_variant(variant: str, model: nn.Module, backend: CompileBackend) -> Step:
    """A clipped training step of `variant` (a key of `COMPILE_VARIANTS`) on a copy of `model`."""
    module = copy.deepcopy(model)
    if variant == "stock":
        clip = lambda: torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)  # noqa: E731
        return _step(_compile(module, backend), list(module.parameters()), clip)
    if variant == "compile_flat":
        flat = flatgrad.FlatGrad(module)
        compiled = _compile(flat, backend)
    else:
        flat = compiled = flatgrad.FlatGrad(_compile(module, backend))
    return _step(compiled, list(flat.parameters()), lambda: flat.clip_grad_norm_(1.0))


def _explained(variant: str, model: nn.Module) -> nn.Module:
    """What `torch._dynamo.explain` runs for `variant`: the module whose forward is compiled
    (for ``FlatGrad(torch.compile(model))``, the model inside, with FlatGrad's routing)."""
    module = copy.deepcopy(model)
    if variant == "stock":
        return module
    if variant == "compile_flat":
        return flatgrad.FlatGrad(module)
    inner = flatgrad.FlatGrad(_compile(module))._orig_mod
    assert isinstance(inner, nn.Module)
    return inner


def _explain(module: nn.Module, batch: Batch) -> dict[str, Any]:
    torch._dynamo.reset()
    out = torch._dynamo.explain(module)(*batch)
    reasons = dict.fromkeys(_first_line(r.reason, 200) for r in out.break_reasons)
    return {"graphs": out.graph_count, "breaks": out.graph_break_count, "break_reasons": list(reasons)[:3]}


def _graphs_compiled() -> int:
    """Graphs Dynamo has compiled in this process (since the last reset of its counters)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _first_line(text: object, limit: int) -> str:
    return next(iter(str(text).strip().splitlines()), "")[:limit]


def _add_error(record: dict[str, Any], stage: str, error: Exception) -> None:
    """Append "stage: Type: first line of the message" to the record's ``error``."""
    text = f"{stage}: {type(error).__name__}: {_first_line(error, 300)}"
    record["error"] = f"{record['error']}; {text}" if record["error"] else text


def compile_row(
    steps: int,
    warmup: int = 2,
    spec: BenchModel | None = None,
    name: str = "llama",
    backend: CompileBackend = "inductor",
) -> dict[str, Any]:
    """Per variant of `COMPILE_VARIANTS`: `torch._dynamo.explain` counts (graphs, breaks, the
    first break reasons), the median compiled step time (clipping on) after `warmup` steps,
    the median per-step ratio to the stock variant's, and the graphs Dynamo compiled during
    the timed steps (recompiles: 0 unless guards keep failing). A failure is recorded in that
    variant's ``error`` (a failing stock variant leaves no times)."""
    spec = spec or LOCAL_MODELS[name]
    warmup = max(warmup, 1)  # the first step compiles
    torch.manual_seed(0)
    model = spec.build()
    batches = _batches(spec, warmup + steps)
    keys = ("graphs", "breaks", "recompiles", "step_ms", "ratio", "error")
    records: dict[str, dict[str, Any]] = {
        v: {**dict.fromkeys(keys), "break_reasons": []} for v in COMPILE_VARIANTS
    }
    step_fns: dict[str, Step] = {}
    try:
        for variant, record in records.items():
            try:
                record.update(_explain(_explained(variant, model), batches[0]))
            except Exception as error:  # report, do not crash the run: compile support varies
                _add_error(record, "explain", error)
        torch._dynamo.reset()
        for variant, record in records.items():
            try:
                step_fns[variant] = _compiled_variant(variant, model, backend)
                for batch in batches[:warmup]:  # compiles
                    step_fns[variant](batch)
            except Exception as error:
                step_fns.pop(variant, None)
                _add_error(record, "warm-up step", error)
        if "stock" in step_fns:
            _time_compiled(step_fns, records, batches[warmup:])
    finally:
        torch._dynamo.reset()
    return {"model": name, "backend": backend, "clip": True, "variants": records}


class _StepFailed(Exception):
    def __init__(self, variant: str, error: Exception) -> None:
        super().__init__(variant)
        self.variant, self.error = variant, error


def _tagged(variant: str, step: Step, record: dict[str, Any]) -> Step:
    """`step`, adding the graphs Dynamo compiles in it to ``record["recompiles"]`` and naming
    the variant in an exception."""
    record["recompiles"] = 0

    def run(batch: Batch) -> None:
        before = _graphs_compiled()
        try:
            step(batch)
        except Exception as error:
            raise _StepFailed(variant, error) from error
        record["recompiles"] += _graphs_compiled() - before

    return run


def _time_compiled(
    step_fns: dict[str, Step], records: dict[str, dict[str, Any]], batches: Sequence[Batch]
) -> None:
    """Interleaved timed steps of the variants that warmed up; a failure leaves no times."""
    names = list(step_fns)  # "stock" first
    try:
        steps = [_tagged(n, step_fns[n], records[n]) for n in names]
        times = dict(zip(names, _times(steps, batches)))
    except _StepFailed as failed:
        _add_error(records[failed.variant], "timed step", failed.error)
        return
    for variant, seconds in times.items():
        records[variant]["step_ms"] = statistics.median(seconds) * 1e3
        records[variant]["ratio"] = _median_ratio(seconds, times["stock"])


def format_local(rows: list[dict[str, Any]], compiled: dict[str, Any] | None) -> str:
    lines = [
        f"{'one process: model':22s} {'clip':>5s} {'micro':>5s} {'stock ms':>9s} {'flatgrad ms':>12s} "
        f"{'ratio':>6s} {'control':>7s} {'faults/step stock':>17s} {'flatgrad':>8s}"
    ]
    for r in rows:
        lines.append(
            f"{r['model']:22s} {('yes' if r['clip'] else 'no'):>5s} {r['micro_batches']:5d} "
            f"{r['stock_ms']:9.2f} {r['flatgrad_ms']:12.2f} {r['ratio']:6.3f} {r['control_ratio']:7.3f} "
            f"{r['stock_faults']:17.0f} {r['flatgrad_faults']:8.0f}"
        )
    if compiled:
        lines.append(format_compile(compiled))
    return "\n".join(lines)


def _cell(value: float | int | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_compile(row: dict[str, Any]) -> str:
    """The compile row: one line per variant, then errors and graph-break reasons."""
    title = f"torch.compile ({row['backend']}), {row['model']}"
    lines = [f"{title:32s} {'graphs':>6s} {'breaks':>6s} {'step ms':>8s} {'ratio':>6s} {'recompiles':>10s}"]
    notes = []
    for variant, r in row["variants"].items():
        label = COMPILE_VARIANTS[variant]
        lines.append(
            f"{label:32s} {_cell(r['graphs'], '6d')} {_cell(r['breaks'], '6d')} "
            f"{_cell(r['step_ms'], '8.1f')} {_cell(r['ratio'], '6.3f')} {_cell(r['recompiles'], '10d')}"
        )
        notes += [f"  {label}: {r['error']}"] if r["error"] else []
        notes += [f"  {label} breaks: {reason}" for reason in r["break_reasons"]]
    lines.append(
        "graphs/breaks: torch._dynamo.explain of the compiled forward; step: zero_grad, forward, "
        "backward, clip, SGD\nratio: median per-step ratio to torch.compile(model); recompiles: graphs "
        "compiled during the timed steps (after the warm-up)"
    )
    return "\n".join(lines + notes)
