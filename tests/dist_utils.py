"""Spawning gloo ranks on 127.0.0.1 from pytest, with a hard deadline so nothing hangs."""

from __future__ import annotations

import datetime
import gc
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(
    rank: int, fn: Callable[..., None], world_size: int, port: int, backend: str, args: tuple[Any, ...]
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        gc.collect()  # free DDP reducers (reference cycles) while the group exists: gloo can abort otherwise
        dist.destroy_process_group()


@contextmanager
def rank_profile(**kwargs: Any) -> Iterator[torch.profiler.profile]:
    """`torch.profiler.profile` for a gloo rank: waits for the rank's collectives to finish
    before the profiler stops.

    A gloo work marks its future complete (what DDP's reducer and comm hooks wait on) and
    only then, in `Work::finish` on the gloo worker thread, ends its profiler event. A
    profiler stopped in between has that thread writing an event while the results are
    taken apart, which corrupts the heap now and then (about 1 run in 40 here). A
    `barrier()` waits, through `Work::wait`, for every earlier work's `finish`.
    """
    with torch.profiler.profile(**kwargs) as prof:
        yield prof
        if dist.is_initialized():
            dist.barrier()


def run_ranks(
    fn: Callable[..., None], *args: Any, world_size: int = 2, timeout: float = 120.0, backend: str = "gloo"
) -> None:
    """Run ``fn(rank, world_size, *args)`` on `world_size` gloo ranks; an exception in any
    rank fails the test (the others are killed), and so does passing `timeout` seconds."""
    context = mp.start_processes(
        _entry,
        args=(fn, world_size, free_port(), backend, args),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"ranks did not finish within {timeout} s")
