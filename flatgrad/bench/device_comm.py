"""Collectives: flatgrad's synchronised paths (DDP comm hook, DataParallel, ShardedOptimizer,
``all_reduce_grads``) trained side by side with stock PyTorch for a few steps, parameters
compared. Two gloo ranks spawned here (CPU tensors, or CUDA tensors of one GPU); on CUDA also
one NCCL rank in this process (see `device_cuda`)."""

from __future__ import annotations

import contextlib
import copy
import datetime
import gc
import json
import os
import socket
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import flatgrad
from flatgrad.bench.device_base import ROUTE_ALL, DeviceRun, Outcome, profiled

STEPS, MICRO_BATCHES, LR, MAX_NORM = 3, 2, 0.05, 0.5
# Float64 throughout: both sides sum the same terms, possibly in another order.
RTOL, ATOL = 1e-9, 1e-10
RANKS_TIMEOUT_S = 150.0


class CommNet(nn.Module):
    """Embedding, two Linears and a `branch` a forward may skip (no gradient that step)."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(64, 16)
        self.fc = nn.Linear(16, 24)
        self.branch = nn.Linear(24, 24)
        self.out = nn.Linear(24, 64, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = torch.tanh(self.fc(self.tokens(idx)))
        if use_branch:
            h = h + self.branch(h)
        return F.cross_entropy(self.out(h).flatten(0, 1), targets.flatten())


def batch(rank: int, step: int, micro: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    idx = torch.randint(0, 64, (4, 9), generator=gen)
    return idx[:, :-1].to(device), idx[:, 1:].to(device)


@dataclass
class Trainer:
    """One configuration: forward, its no_sync, what follows backward, clipping, optimizer."""

    name: str
    forward: Callable[..., torch.Tensor]
    optimizer: Any  # a torch optimizer or a ShardedOptimizer
    params: list[nn.Parameter]
    clip: Callable[[float], object]
    no_sync: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext
    after_backward: Callable[[], object] = lambda: None
    buffers: int = 0  # flatgrad's gradient buffers (collectives per step under the hook)
    keep: list[object] = field(default_factory=list)  # wrappers that must outlive the steps


def _ids(device: torch.device) -> list[int] | None:
    return [device.index or 0] if device.type == "cuda" else None


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def _stock_clip(params: list[nn.Parameter]) -> Callable[[float], object]:
    return lambda max_norm: torch.nn.utils.clip_grad_norm_(params, max_norm)


def stock_plain(model: nn.Module, device: torch.device) -> Trainer:
    m = copy.deepcopy(model)
    params = list(m.parameters())
    return Trainer("stock", m, adamw(params), params, _stock_clip(params))


def stock_ddp(
    model: nn.Module, device: torch.device, find_unused: bool = True, bucket_view: bool = False
) -> Trainer:
    m = copy.deepcopy(model)
    ddp = DDP(
        m, device_ids=_ids(device), find_unused_parameters=find_unused, gradient_as_bucket_view=bucket_view
    )
    params = list(m.parameters())
    return Trainer("stock DDP", ddp, adamw(params), params, _stock_clip(params), ddp.no_sync)


def flat_hook(model: nn.Module, device: torch.device, config: flatgrad.FlatGradConfig = ROUTE_ALL) -> Trainer:
    flat = flatgrad.FlatGrad(copy.deepcopy(model), config=config)
    ddp = DDP(flat, device_ids=_ids(device), **flat.ddp_kwargs())
    ddp.register_comm_hook(flat.comm_state(), flatgrad.allreduce_hook)
    params = list(flat.parameters())
    trainer = Trainer("DDP + allreduce_hook", ddp, adamw(params), params, flat.clip_grad_norm_, ddp.no_sync)
    trainer.buffers = len(flat.grad_buffers)
    return trainer


def flat_dp(
    model: nn.Module,
    device: torch.device,
    sharded: bool = False,
    bucket_cap_mb: float = 0.002,
    config: flatgrad.FlatGradConfig = ROUTE_ALL,
    shard_by: Literal["element", "tensor"] | None = None,
) -> Trainer:
    """DataParallel (several buckets at the default `bucket_cap_mb`: launched during backward),
    with a ShardedOptimizer when `sharded` (by `shard_by`)."""
    flat = flatgrad.FlatGrad(copy.deepcopy(model), config=config)
    dp = flatgrad.replicate(flat, bucket_cap_mb=bucket_cap_mb)
    params = list(flat.parameters())
    if sharded:
        opt = flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, lr=LR, weight_decay=0.1, shard_by=shard_by)
        name = "ShardedOptimizer" + (" by tensor" if shard_by == "tensor" else "")
        return Trainer(name, dp, opt, params, opt.clip_grad_norm_, dp.no_sync)
    return Trainer("DataParallel", dp, adamw(params), params, flat.clip_grad_norm_, dp.no_sync)


def flat_all_reduce(model: nn.Module, device: torch.device) -> Trainer:
    flat = flatgrad.FlatGrad(copy.deepcopy(model), config=ROUTE_ALL)
    params = list(flat.parameters())
    return Trainer(
        "all_reduce_grads",
        flat,
        adamw(params),
        params,
        flat.clip_grad_norm_,
        after_backward=flat.all_reduce_grads,
    )


def _step(trainer: Trainer, rank: int, step: int, device: torch.device, use_branch: bool) -> None:
    trainer.optimizer.zero_grad()
    for micro in range(MICRO_BATCHES):
        last = micro == MICRO_BATCHES - 1
        with contextlib.nullcontext() if last else trainer.no_sync():
            trainer.forward(*batch(rank, step, micro, device), use_branch).backward()
    trainer.after_backward()
    trainer.clip(MAX_NORM)
    trainer.optimizer.step()


def _allreduces(prof: torch.profiler.profile) -> int:
    return sum(e.name == "c10d::allreduce_" for e in prof.events())


def compare(
    stock: Trainer, ours: Trainer, device: torch.device, skip_branch: bool, count: bool = False
) -> dict[str, Any]:
    """Train both for `STEPS` steps on the same batches (the last rank skips the branch in
    step 1 when `skip_branch`); raise unless the parameters match. Returns the largest
    difference and, when `count`, the all-reduces of each of our steps."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    counts = []
    for step in range(STEPS):
        use_branch = not (skip_branch and step == 1 and rank == world_size - 1)
        _step(stock, rank, step, device, use_branch)
        with profiled(device) if count else contextlib.nullcontext() as prof:
            _step(ours, rank, step, device, use_branch)
        if prof is not None:
            counts.append(_allreduces(prof))
    worst = 0.0
    for p, q in zip(ours.params, stock.params):
        torch.testing.assert_close(
            p, q, rtol=RTOL, atol=ATOL, msg=lambda m: f"{ours.name} against {stock.name}: {m}"
        )
        worst = max(worst, float((p - q).detach().abs().max()))
    if count and counts != [ours.buffers] * STEPS:
        raise AssertionError(f"{ours.name}: expected {ours.buffers} all-reduce per step, got {counts}")
    return {"max_abs_diff": worst, **({"allreduces_per_step": counts} if count else {})}


Builder = Callable[[nn.Module, torch.device], Trainer]


class SyncPath(NamedTuple):
    """A flatgrad path, its stock oracle, and how the branch may go unused in step 1."""

    name: str
    stock: Builder
    ours: Builder
    skip_branch: bool  # the last rank skips the branch in step 1
    # Whether the path matches stock when no rank uses the branch: ShardedOptimizer steps a
    # whole shard, so an unused parameter moves (zero gradient, momentum and weight decay
    # still apply; documented in flatgrad._sharded) where stock skips it.
    none_used_ok: bool = True
    count_allreduces: bool = False  # per step: one per gradient buffer expected


# DDP without find_unused_parameters needs every parameter used: the hook path and its
# oracle always run the branch.
PATHS = (
    SyncPath("DataParallel", stock_ddp, flat_dp, True),
    SyncPath(
        "ShardedOptimizer", stock_ddp, lambda m, d: flat_dp(m, d, sharded=True), True, none_used_ok=False
    ),
    # By tensor every rank holds every averaged gradient and steps whole parameters: a
    # parameter no rank used keeps `.grad` None and is skipped, as stock skips it.
    SyncPath(
        "ShardedOptimizer by tensor", stock_ddp, lambda m, d: flat_dp(m, d, True, shard_by="tensor"), True
    ),
    SyncPath("all_reduce_grads", stock_ddp, flat_all_reduce, True),
    SyncPath(
        "DDP + allreduce_hook",
        lambda m, d: stock_ddp(m, d, find_unused=False),
        flat_hook,
        False,
        count_allreduces=True,
    ),
)


def run_paths(device: torch.device, oracle: Builder | None = None) -> dict[str, dict[str, Any]]:
    """Every path of `PATHS` in the default group against its stock oracle (or `oracle`),
    each isolated: a failure is recorded as ``{"error": ...}`` and the next path runs
    (every rank fails alike: the paths are deterministic). On one rank, a path that cannot
    match stock with the branch unused everywhere keeps it used."""
    torch.manual_seed(0)
    model = CommNet().double().to(device)
    results: dict[str, dict[str, Any]] = {}
    for path in PATHS:
        skip = path.skip_branch and (path.none_used_ok or dist.get_world_size() > 1)
        try:
            stock, ours = (oracle or path.stock)(model, device), path.ours(model, device)
            results[path.name] = compare(stock, ours, device, skip, path.count_allreduces)
        except Exception as error:  # the other paths still run
            results[path.name] = {"error": f"{type(error).__name__}: {error}"}
    return results


def paths_outcome(results: dict[str, dict[str, Any]], setting: str) -> Outcome:
    """Passed when no path failed; the detail gives each path's largest difference (and
    all-reduce counts) or its error."""
    parts = []
    for name, r in results.items():
        if "error" in r:
            parts.append(f"{name}: FAILED {r['error']}")
            continue
        counted = f", all-reduces per step {r['allreduces_per_step']}" if "allreduces_per_step" in r else ""
        parts.append(f"{name}: max |diff| {r['max_abs_diff']:.2g}{counted}")
    detail = (
        f"{setting}; {STEPS} AdamW steps of {MICRO_BATCHES} micro-batches with clipping, float64, "
        f"parameters compared at rtol {RTOL:g}: " + "; ".join(parts)
    )
    return Outcome(all("error" not in r for r in results.values()), detail)


RankJob = Callable[[torch.device], dict[str, Any]]  # what each spawned rank runs; rank 0's result


def _rank_main(rank: int, world_size: int, port: int, device_name: str, out: str, job: RankJob) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
    try:
        results = job(torch.device(device_name))
        dist.barrier()
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        gc.collect()  # free DDP reducers while the group exists: gloo can abort otherwise
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn_gloo(
    device: torch.device, world_size: int = 2, timeout: float = RANKS_TIMEOUT_S, job: RankJob = run_paths
) -> dict[str, Any]:
    """Run `job` (default `run_paths`; picklable: spawned) on `world_size` ranks; rank 0's
    results. A rank's exception is raised here (with its traceback); so is a run past
    `timeout` seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        args = (world_size, _free_port(), str(device), str(out), job)
        context = mp.start_processes(
            _rank_main, args=args, nprocs=world_size, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + timeout
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"gloo ranks did not finish within {timeout:g} s")
        return dict(json.loads(out.read_text()))


def check_gloo_two_ranks(run: DeviceRun) -> Outcome:
    tensors = "CUDA tensors on one GPU" if run.cuda else "CPU tensors"
    results = spawn_gloo(torch.device("cuda", 0) if run.cuda else torch.device("cpu"))
    return paths_outcome(results, f"2 gloo ranks ({tensors}) against stock DDP")
