"""Gloo ranks on 127.0.0.1 for pytest: one persistent process group per test module and world
size serves that module's cases, each case bounded by a hard deadline so nothing hangs.

Spawning a rank (a Python interpreter importing torch, then a gloo rendezvous) costs far more
than most cases run, so `run_ranks` hands each case to a pool of ranks kept alive between
cases, as torch's ``MultiProcContinuousTest`` does. Each case builds its own models and
optimizers; between cases every rank resets what a fresh rank would start with (the RNG
seed, environment, thread count, default dtype, Dynamo's caches) and collects garbage while
the group exists. A rank that raises or a case that passes its deadline fails the case with
the rank's traceback, and the pool is killed, so the next case gets fresh ranks. Cases that
need their own group (another backend, a group they destroy or a Dynamo config they set) pass
``fresh=True`` and get newly spawned ranks as before.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import logging
import multiprocessing.connection
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_SPAWN = mp.get_context("spawn")


class RankError(Exception):
    """A rank raised: the message holds its traceback."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _init(rank: int, world_size: int, port: int, backend: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))


def _entry(
    rank: int, fn: Callable[..., None], world_size: int, port: int, backend: str, args: tuple[Any, ...]
) -> None:
    _init(rank, world_size, port, backend)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        gc.collect()  # free DDP reducers (reference cycles) while the group exists: gloo can abort otherwise
        dist.destroy_process_group()


def _reset(seed: int, environ: dict[str, str]) -> None:
    """Put back what a fresh rank starts with, so no case sees another's settings (a case's
    log handlers on flatgrad's loggers included: the library adds none)."""
    for name, log in logging.Logger.manager.loggerDict.items():
        if name.split(".")[0] == "flatgrad" and isinstance(log, logging.Logger):
            log.handlers.clear()
    os.environ.clear()
    os.environ.update(environ)
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()


def _serve(rank: int, world_size: int, port: int, backend: str, conn: Any) -> None:
    """A pool rank: run each case sent on `conn` and answer ``(error or None, reusable)``."""
    _init(rank, world_size, port, backend)
    seed, environ = torch.initial_seed(), dict(os.environ)
    group = dist.group.WORLD
    while True:
        case = conn.recv()
        if case is None:
            break
        fn, args = case
        _reset(seed, environ)
        error = None
        try:
            fn(rank, world_size, *args)
            dist.barrier()
        except BaseException:
            error = traceback.format_exc()
        gc.collect()  # free DDP reducers (reference cycles) while the group exists: gloo can abort otherwise
        reusable = error is None and dist.is_initialized() and dist.group.WORLD is group
        conn.send((error, reusable))
        if not reusable:
            return
    gc.collect()
    dist.destroy_process_group()


class RankPool:
    """`world_size` ranks in one process group, running one case at a time."""

    def __init__(self, world_size: int, backend: str) -> None:
        port = free_port()
        self.conns: list[Any] = []
        self.processes: list[Any] = []
        for rank in range(world_size):
            ours, theirs = _SPAWN.Pipe()
            process = _SPAWN.Process(
                target=_serve, args=(rank, world_size, port, backend, theirs), daemon=True
            )
            process.start()
            theirs.close()
            self.conns.append(ours)
            self.processes.append(process)

    def run(self, fn: Callable[..., None], args: tuple[Any, ...], timeout: float) -> bool:
        """Run ``fn(rank, world_size, *args)`` on every rank; raise `RankError` for the first
        rank that raised, fail the test after `timeout` seconds. Returns whether the ranks
        can serve another case."""
        for conn in self.conns:
            conn.send((fn, args))
        deadline = time.monotonic() + timeout
        pending = dict(enumerate(self.conns))
        reusable = True
        while pending:
            sentinels = {self.processes[rank].sentinel: rank for rank in pending}
            ready = multiprocessing.connection.wait(
                [*pending.values(), *sentinels], timeout=max(0.0, deadline - time.monotonic())
            )
            if not ready:
                pytest.fail(f"ranks {sorted(pending)} did not finish within {timeout} s")
            for item in ready:
                if item in sentinels and sentinels[item] in pending and not pending[sentinels[item]].poll():
                    rank = sentinels[item]
                    raise RankError(f"rank {rank} exited with code {self.processes[rank].exitcode}")
            for rank, conn in list(pending.items()):
                if conn in ready or conn.poll():
                    error, rank_reusable = conn.recv()
                    del pending[rank]
                    if error is not None:
                        raise RankError(f"rank {rank} raised:\n{error}")
                    reusable = reusable and rank_reusable
        return reusable

    def close(self) -> None:
        for conn, process in zip(self.conns, self.processes):
            try:
                if process.is_alive():
                    conn.send(None)
            except OSError:
                pass
        for process in self.processes:
            process.join(timeout=10)
        self.kill()

    def kill(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join()
        for conn in self.conns:
            conn.close()


_POOLS: dict[tuple[int, str], RankPool] = {}


def close_pools() -> None:
    """End every pool's ranks (at a test module's end, see conftest.py, and at exit)."""
    while _POOLS:
        _POOLS.popitem()[1].close()


atexit.register(close_pools)


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
    fn: Callable[..., None],
    *args: Any,
    world_size: int = 2,
    timeout: float = 120.0,
    backend: str = "gloo",
    fresh: bool = False,
) -> None:
    """Run ``fn(rank, world_size, *args)`` on `world_size` ranks; an exception in any rank
    fails the test with that rank's traceback (the others are killed), and so does passing
    `timeout` seconds. Gloo cases run on the module's persistent ranks (see the module
    docstring); ``fresh=True``, or another backend, spawns ranks for this case alone."""
    if fresh or backend != "gloo":
        _run_fresh(fn, args, world_size, timeout, backend)
        return
    key = (world_size, backend)
    pool = _POOLS.pop(key, None) or RankPool(world_size, backend)
    reusable = False
    try:
        reusable = pool.run(fn, args, timeout)
    finally:
        if reusable:
            _POOLS[key] = pool
        else:
            pool.kill()


def _run_fresh(
    fn: Callable[..., None], args: tuple[Any, ...], world_size: int, timeout: float, backend: str
) -> None:
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


def average_grads(models: list[torch.nn.Module], group: Any) -> None:
    """Data parallelism by hand, the oracle's for models no wrapper averages (pipeline
    stages under a split backward, a tensor-parallel model): every `.grad` (a DTensor's
    local tensor) summed over `group` and divided by its size (two float64 values halved:
    exact)."""
    with torch.no_grad():
        for model in models:
            for param in model.parameters():
                if param.grad is None:
                    continue
                grad = param.grad
                local = grad.to_local() if hasattr(grad, "to_local") else grad
                dist.all_reduce(local, group=group)
                local.div_(dist.get_world_size(group))
