"""The configurations compared: stock DDP variants, FlatGrad with and without DDP,
single-process stock/FlatGrad, and the sharded ones (flatgrad's ZeRO-1, torch's
ZeroRedundancyOptimizer, FSDP2). Each owns its model copy and optimizer."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch < 2.6: FSDP2 under its composable name only
    from torch.distributed._composable.fsdp import fully_shard  # type: ignore[no-redef]
from torch.distributed.optim import ZeroRedundancyOptimizer

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch < 2.5: the private module only
    from torch.distributed._tensor import DTensor  # type: ignore[no-redef]
from torch.nn.parallel import DistributedDataParallel as DDP

import flatgrad


def _no_sync() -> None:
    pass


@dataclass
class Runner:
    """One configuration: `forward(batch)` -> loss, then `backward(loss)` (backward plus
    whatever synchronisation the configuration does), then `update()`."""

    name: str
    module: nn.Module
    optimizer: torch.optim.Optimizer
    sync: Callable[[], None] = _no_sync
    ddp: DDP | None = None
    engine: flatgrad.DataParallel | None = None
    counts_grad_copies: bool = True
    """False where `counters.COPY_OPS` misses the configuration's gradient copies: FSDP2
    copies every gradient into its reduce-scatter input with ``fsdp::chunk_cat``."""

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: a ShardedOptimizer's shards, a
        ZeroRedundancyOptimizer's local optimizer, the local shards of FSDP2's DTensors."""
        if isinstance(self.optimizer, flatgrad.ShardedOptimizer):
            return self.optimizer.state_bytes()
        optimizer = self.optimizer
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            optimizer = optimizer.optim  # its `state` holds no tensors; this rank's are here
        return sum(
            local_bytes(t)
            for state in optimizer.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor)
        )

    def forward(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        self.optimizer.zero_grad()  # set_to_none=True, torch's default, for every configuration
        return self.module(*batch)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        self.sync()

    def update(self) -> None:
        self.optimizer.step()

    def bucket_buffers(self) -> list[torch.Tensor]:
        """DDP buckets that hold gradients apart from `.grad` (none when `.grad` views them)."""
        if self.ddp is None or self.ddp.gradient_as_bucket_view:
            return []
        return [bucket.buffer() for bucket in self.ddp.reducer._get_zeros_like_grad_buckets()]


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds of `tensor`: a DTensor's local shard (its own `numel()` is the
    global one)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


CONFIGS = (
    "ddp_default",
    "ddp_bucket_view",
    "ddp_static_graph",
    "flatgrad_ddp_hook",
    "flatgrad_all_reduce",
    "local_stock",
    "local_flatgrad",
    "flatgrad_dp",
    "flatgrad_zero",
    "zero_stock",
    "fsdp2",
)
BASELINE = "ddp_default"
BEST_STOCK = "ddp_bucket_view"  # stock DDP's best setting for memory and copies


def _device_ids(device: torch.device) -> list[int] | None:
    return [device.index or 0] if device.type == "cuda" else None


def build_runner(
    name: str, model: nn.Module, device: torch.device, lr: float = 1e-3, unused_parameters: bool = False
) -> Runner:
    """A fresh copy of `model` set up as configuration `name`; `unused_parameters`: the model
    leaves some unused, which DDP (but for static_graph) must be told."""
    module = copy.deepcopy(model).to(device)
    ids = _device_ids(device)
    ddp: DDP | None = None
    sync: Callable[[], None] = _no_sync
    if name in ("ddp_default", "ddp_bucket_view", "ddp_static_graph"):
        kwargs: dict[str, dict[str, Any]] = {
            "ddp_bucket_view": {"gradient_as_bucket_view": True},
            "ddp_static_graph": {"static_graph": True},
        }
        unused = unused_parameters and name != "ddp_static_graph"
        ddp = DDP(module, device_ids=ids, find_unused_parameters=unused, **kwargs.get(name, {}))
        wrapped: nn.Module = ddp
    elif name == "flatgrad_ddp_hook":
        flat = flatgrad.FlatGrad(module)
        ddp = DDP(flat, device_ids=ids, find_unused_parameters=unused_parameters, **flat.ddp_kwargs())
        ddp.register_comm_hook(flat.comm_state(), flatgrad.allreduce_hook)
        wrapped = ddp
    elif name == "flatgrad_all_reduce":
        flat = flatgrad.FlatGrad(module)
        _broadcast_parameters(flat)
        wrapped, sync = flat, flat.all_reduce_grads
    elif name in ("flatgrad_dp", "flatgrad_zero"):
        dp = flatgrad.DataParallel(flatgrad.FlatGrad(module))
        if name == "flatgrad_zero":
            sharded = flatgrad.ShardedOptimizer(dp, torch.optim.SGD, lr=lr, momentum=0.9)
            return Runner(name, dp, sharded, engine=dp)  # type: ignore[arg-type]
        return Runner(name, dp, torch.optim.SGD(dp.parameters(), lr=lr, momentum=0.9), engine=dp)
    elif name == "zero_stock":
        ddp = DDP(
            module, device_ids=ids, gradient_as_bucket_view=True, find_unused_parameters=unused_parameters
        )
        zero = ZeroRedundancyOptimizer(
            ddp.parameters(),
            optimizer_class=torch.optim.SGD,
            parameters_as_bucket_view=True,
            lr=lr,
            momentum=0.9,
        )
        return Runner(name, ddp, zero, ddp=ddp)
    elif name == "fsdp2":
        _fully_shard(module, device)
        optimizer = torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9)
        return Runner(name, module, optimizer, counts_grad_copies=False)
    elif name == "local_stock":
        wrapped = module
    elif name == "local_flatgrad":
        wrapped = flatgrad.FlatGrad(module)
    else:
        raise ValueError(f"configuration must be one of {', '.join(CONFIGS)}, got {name!r}")
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=lr, momentum=0.9)
    return Runner(name, wrapped, optimizer, sync, ddp)


def _fully_shard(module: nn.Module, device: torch.device) -> None:
    """FSDP2 as its documentation applies it: each block first (every child of a ModuleList:
    the bench models keep their blocks in one), then the root. `reshard_after_forward=False`
    keeps the gathered parameters from forward to backward (ZeRO-2: one all-gather per
    block per step, as ZeRO-1's all-gather after the step)."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for blocks in [m for m in module.modules() if isinstance(m, nn.ModuleList)]:
        for block in blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(module, mesh=mesh, reshard_after_forward=False)


def _broadcast_parameters(module: nn.Module) -> None:
    """What DDP's constructor does: start every rank from rank 0's weights."""
    for tensor in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(tensor.data, src=0)
