"""What the bench's two commands (`flatgrad-bench`, `python -m flatgrad.bench.device`) share:
argparse types and the CPU's name. Standard library only: the device report runs on machines
that have torch and pydantic but not the bench's other needs (tqdm)."""

from __future__ import annotations

import argparse
import platform
from pathlib import Path


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a number above 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value:g}")
    return value


def cpu_name() -> str:
    """The CPU's model name (Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
