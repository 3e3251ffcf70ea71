"""How much memory one configuration's step adds on top of what is already resident, inside
a process that runs several configurations.

CUDA: the caching allocator's peak during the step minus what was allocated before it.
Linux CPU: the resident set's high-water mark (VmHWM, reset by writing "5" to
/proc/self/clear_refs) minus the resident set before the step: the step's transient
allocations that reached RAM (the allocator may also reuse pages already resident, so
this is a lower bound). Elsewhere: 0 (not measurable per step). `peak_in_step`, the device
report's, counts from before the configuration was built instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import platform
import resource
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
# mallopt parameters (glibc's malloc.h), and the largest mmap threshold glibc accepts on
# 64-bit: 32 MiB, half its 64 MiB heap size.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20
STEP_RANGE = "flatgrad.bench.device: measured step"
MEASURED_STEP = 3  # DDP rebuilds its buckets in the second step's forward: the third is measured


def _status_mb(field: str) -> float | None:
    with contextlib.suppress(OSError):
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) / 1024  # kB
    return None


def sync(device: torch.device) -> None:
    """Wait for the device's queued work: what a timing or an allocator peak reads must be done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_start(device: torch.device) -> float:
    """Reset the peak and return the baseline (MB) a later `step_peak` is measured against."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device) / 2**20
    with contextlib.suppress(OSError):
        _CLEAR_REFS.write_text("5")
    return _status_mb("VmRSS:") or 0.0


def step_peak(device: torch.device, baseline: float) -> float:
    """MB the step added at its peak over `baseline`."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20 - baseline
    peak = _status_mb("VmHWM:")
    return max(0.0, peak - baseline) if peak is not None and baseline else 0.0


def pin_malloc() -> bool:
    """Fix glibc's heap thresholds for this process: never trim the heap's top, and mmap only
    single allocations over 32 MiB. By default glibc raises both thresholds as large blocks
    are freed and gives the heap's top back to the OS once more than the trim threshold is
    free, so a step whose transient tensors outgrow it takes them back page by page in the
    next step (minor faults, each page zeroed by the kernel). Which side of an interleaved
    comparison pays that depends on the order of frees in the shared heap, not on the code
    being measured. Returns whether it took effect (False off glibc)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)) and bool(
            libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
        )
    return False


def minor_faults() -> int:
    """Minor page faults of this process so far (first touches of fresh pages)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def peak_in_step(device: torch.device, make_step: Callable[[], Callable[[], object]]) -> int:
    """Peak bytes allocated during the third training step of what `make_step` builds,
    counted from before it was built (its parameters, gradients and optimizer state count).
    CUDA: the caching allocator's peak; CPU: the peak of the running sum of the profiler's
    allocation records. Needs a process group (a barrier after each step: a gloo work holds
    its tensors until its thread is done with them)."""
    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        sync(device)
    base = torch.cuda.memory_allocated(device) if cuda else 0
    cpu = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with contextlib.nullcontext() if cuda else cpu:
        step = make_step()
        for number in range(1, MEASURED_STEP + 1):
            last = number == MEASURED_STEP
            if last and cuda:
                sync(device)
                torch.cuda.reset_peak_memory_stats(device)
            with torch.profiler.record_function(STEP_RANGE) if last else contextlib.nullcontext():
                step()
            dist.barrier()
        sync(device)
        del step
        gc.collect()  # DDP reducers sit in reference cycles
    if cuda:
        return torch.cuda.max_memory_allocated(device) - base
    return peak_bytes(cpu, within=STEP_RANGE)


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
