"""How much memory one configuration's step adds on top of what is already resident, inside
a process that runs several configurations.

CUDA: the caching allocator's peak during the step minus what was allocated before it.
Linux CPU: the resident set's high-water mark (VmHWM, reset by writing "5" to
/proc/self/clear_refs) minus the resident set before the step: the step's transient
allocations that reached RAM (the allocator may also reuse pages already resident, so
this is a lower bound). Elsewhere: 0 (not measurable per step).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_mb(field: str) -> float | None:
    with contextlib.suppress(OSError):
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) / 1024  # kB
    return None


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
