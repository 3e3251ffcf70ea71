"""Peak memory of one configuration's steps inside a process that runs several.

CUDA: the caching allocator's peak, reset before each step. Linux CPU: the resident set's
high-water mark (VmHWM), which writing "5" to /proc/self/clear_refs resets; it includes
everything resident (the other configurations' models too), so compare configurations by
their differences. Elsewhere: the process's lifetime peak (no reset).
"""

from __future__ import annotations

import contextlib
import resource
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):  # not Linux, or not allowed: the lifetime peak
        _CLEAR_REFS.write_text("5")


def peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
