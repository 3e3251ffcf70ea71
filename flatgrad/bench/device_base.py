"""What the device checks share: the run's settings, the report's records, a one-rank process
group, profiler helpers and the check model (a tied-embedding LM with an activation-checkpointed
block and a branch that gets no gradient)."""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict
from torch import nn
from torch.utils.checkpoint import checkpoint

import flatgrad

# Route every Linear, however small: the checks are about the routed backwards.
ROUTE_ALL = flatgrad.FlatGradConfig(linear_min_numel=0)


class CheckRecord(BaseModel):
    """One check: passed is None when it does not apply to this device (`detail` says why)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    passed: bool | None
    detail: str
    seconds: float


class RatioRecord(BaseModel):
    """Median milliseconds of flatgrad and of stock, measured interleaved in one process, and
    the median of the per-repeat ratios flatgrad / stock (below 1: flatgrad is faster)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    flatgrad_ms: float
    stock_ms: float
    ratio: float


class MemoryRecord(BaseModel):
    """Peak bytes allocated in a training step of each side (the check's detail says from
    when they count), and the parameters of the model both train, for bytes per parameter."""

    model_config = ConfigDict(extra="forbid")
    name: str
    flatgrad_bytes: int
    stock_bytes: int
    num_params: int


@dataclass(frozen=True)
class DeviceRun:
    """Where the checks run and how big: `quick` scales every workload down."""

    device: torch.device
    quick: bool

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


@dataclass
class Outcome:
    """What a check returns: passed (None: skipped on this device), a detail for the
    report, and the measurements it made."""

    passed: bool | None
    detail: str
    ratios: list[RatioRecord] = field(default_factory=list)
    memory: list[MemoryRecord] = field(default_factory=list)


def skipped(reason: str) -> Outcome:
    return Outcome(None, reason)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


@contextlib.contextmanager
def single_rank_group(backend: str, device: torch.device) -> Iterator[None]:
    """A default process group of world size 1 in this process (an in-memory store: no port)."""
    if dist.is_initialized():
        raise RuntimeError("a default process group is already initialised; the check needs its own")
    kwargs: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    try:
        yield
    finally:
        gc.collect()  # free DDP reducers (reference cycles) while the group exists
        dist.destroy_process_group()


@contextlib.contextmanager
def profiled(device: torch.device, **kwargs: Any) -> Iterator[torch.profiler.profile]:
    """`torch.profiler.profile` of CPU ops (and CUDA kernels on CUDA), synchronised before it
    stops; with a process group, after a barrier (a gloo work ends its profiler event after
    completing its future: a profiler stopped in between can corrupt the heap)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, **kwargs) as prof:
        yield prof
        sync(device)
        if dist.is_initialized():
            dist.barrier()


def device_events(prof: torch.profiler.profile) -> list[dict[str, Any]]:
    """The kernels and memory copies of a CUDA profile (chrome trace events: name, cat, args)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return [e for e in trace.get("traceEvents", []) if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def peak_bytes(prof: torch.profiler.profile, within: str | None = None) -> int:
    """The peak of the running sum of a `profile_memory=True` profile's allocations and frees
    (CPU memory records): the most the profiled code held at once beyond what it started
    with; with `within`, the peak while the `record_function` range of that name ran."""
    assert prof.profiler is not None and prof.profiler.kineto_results is not None, (
        "the profile is not finished"
    )
    events: list[Any] = list(prof.profiler.kineto_results.events())
    start, end = 0, 2**63
    if within is not None:
        # (start plus duration: the end of each event, and torch 2.4 has no end_ns())
        ranges = [(e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.name() == within]
        if len(ranges) != 1:
            raise ValueError(f"the profile must hold one {within!r} range, got {len(ranges)}")
        start, end = ranges[0]
    running = peak = 0
    for event in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        if event.start_ns() > end:
            break
        if event.start_ns() >= start:
            peak = max(peak, running)  # held when the range began, then each change inside it
        running += event.nbytes()
        if event.start_ns() >= start:
            peak = max(peak, running)
    return peak


def weight_shapes(params: Iterable[nn.Parameter]) -> set[tuple[int, ...]]:
    return {tuple(p.shape) for p in params if p.requires_grad and p.dim() >= 2}


def grad_in_buffers(flat: flatgrad.FlatGrad, grad: torch.Tensor) -> bool:
    """Whether `grad` lies inside one of `flat.grad_buffers` (same storage, byte range inside)."""
    for buf in flat.grad_buffers.values():
        if grad.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr():
            continue
        start, end = buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()
        if start <= grad.data_ptr() and grad.data_ptr() + grad.numel() * grad.element_size() <= end:
            return True
    return False


class CheckLM(nn.Module):
    """A tied-embedding LM: the LM head shares the token embedding's weight, the MLP block is
    activation-checkpointed (use_reentrant=False), and `unused` is never called (its
    parameters get no gradient). Shapes keep activations from matching any weight's."""

    def __init__(self, vocab: int = 96, dim: int = 32) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.block = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.mix = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.unused = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx)
        x = x + checkpoint(self.block, x, use_reentrant=False)
        x = x + torch.tanh(self.mix(x))
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def lm_batches(count: int, device: torch.device, vocab: int = 96) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` different (tokens, targets) micro-batches of shape (3, 10)."""
    gen = torch.Generator().manual_seed(7)
    idx = [torch.randint(0, vocab, (3, 11), generator=gen) for _ in range(count)]
    return [(i[:, :-1].to(device), i[:, 1:].to(device)) for i in idx]
