"""One rank's share of the benchmark: every configuration on every model, steps interleaved;
and `single_rank_group`, a group of world size 1 to run it in one process (the device
report's data-parallel rows; tests)."""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from flatgrad.bench.counters import count_step, grad_bytes
from flatgrad.bench.models import resolve_model
from flatgrad.bench.runners import Runner, build_runner
from flatgrad.bench.timing import rank_records, rank_timer, rotate

# Each record's median per-step ratio to these configurations, where they ran: stock DDP as
# it comes, at its best setting for memory and copies, and the stock ZeRO-1 of the Muon rows.
BASES = {
    "ddp_default": "ratio_to_ddp_default",
    "ddp_bucket_view": "pair_ratio_to_ddp_bucket_view",
    "zero_stock_muon": "pair_ratio_to_zero_stock_muon",
}


def bench_model(
    model_name: str, configs: list[str], steps: int, warmup: int, device: torch.device
) -> dict[str, Any]:
    """Interleaved steps of every configuration on the same data; step time is the slowest
    rank's. Then one counted backward each for collectives, copies and gradient bytes (the
    parameter all-gathers of the sharded configurations, in their step or forward, are not
    in it), and every rank's optimizer state bytes."""
    spec = resolve_model(model_name)
    torch.manual_seed(0)
    model = spec.build()
    runners = [
        build_runner(name, model, device, unused_parameters=spec.unused_parameters) for name in configs
    ]
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    batches = (spec.batch(gen, device) for _ in range(warmup + steps))
    measured = rotate([rank_timer(r.step, device) for r in runners], batches)
    results = rank_records(dict(zip(configs, measured)), warmup, device, BASES)
    batch = spec.batch(gen, device)
    for runner in runners:
        loss = runner.forward(batch)
        counts = count_step(functools.partial(runner.backward, loss), runner.module.parameters())
        runner.update()
        results[runner.name].update(
            collectives_per_step=counts.collectives,
            grad_copies_per_step=counts.grad_copies if runner.counts_grad_copies else None,
            grad_bytes=grad_bytes(runner.module.parameters(), runner.bucket_buffers()),
            optimizer_state_bytes=runner.optimizer_state_bytes(),
            **_engine_times(runner, device),
        )
    mine = torch.tensor([r.optimizer_state_bytes() for r in runners], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    for index, runner in enumerate(runners):
        results[runner.name]["optimizer_state_bytes_by_rank"] = [int(t[index].item()) for t in every]
    grad_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"num_parameters": grad_params, "configs": results}


def _engine_times(runner: Runner, device: torch.device) -> dict[str, Any]:
    """What a DataParallel engine measured in its last backward (None without one): the
    communication it waited for after the backward (host time: on CUDA the waits do not
    block the host, so it would read about 0), each bucket's launch, the backward's time,
    and each bucket's bytes."""
    engine = runner.engine
    if engine is None:
        return dict.fromkeys(("exposed_comm_ms", "bucket_launch_ms", "backward_ms", "bucket_bytes"))
    return {
        "exposed_comm_ms": engine.exposed_s * 1e3 if device.type != "cuda" else None,
        "bucket_launch_ms": [t * 1e3 for t in engine.launch_offsets_s],
        "backward_ms": engine.backward_s * 1e3,
        "bucket_bytes": [b.numel() * b.element_size() for b in engine.buckets],
    }


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
