"""The configurations compared: `CONFIGS` (stock DDP's settings, FlatGrad with and without DDP,
one process, and the sharded ones: flatgrad's ZeRO-1, torch's ZeroRedundancyOptimizer, FSDP2),
all with SGD (momentum); `MUON_CONFIGS`, asked for by name. Each owns its model and optimizer."""

from __future__ import annotations

import copy
import functools
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
from torch.nn.parallel import DistributedDataParallel as DDP

import flatgrad
from flatgrad.bench.counters import storage_bytes
from flatgrad.bench.models import Batch


@dataclass
class Runner:
    """One configuration: `forward(batch)` -> loss, then `backward(loss)` (backward plus
    whatever synchronisation the configuration does), then `update()`."""

    name: str
    module: nn.Module
    optimizer: torch.optim.Optimizer | Optimizers
    sync: Callable[[], None] = lambda: None
    ddp: DDP | None = None
    engine: flatgrad.ReplicateState | None = None
    counts_grad_copies: bool = True
    """False where `counters.COPY_OPS` misses the configuration's gradient copies: FSDP2
    copies every gradient into its reduce-scatter input with ``fsdp::chunk_cat``."""

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (`optimizer_state_bytes`)."""
        parts = self.optimizer.parts if isinstance(self.optimizer, Optimizers) else [self.optimizer]
        return sum(optimizer_state_bytes(part) for part in parts)

    def forward(self, batch: Batch) -> torch.Tensor:
        self.optimizer.zero_grad()  # set_to_none=True, torch's default, for every configuration
        return self.module(*batch)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        self.sync()

    def update(self) -> None:
        self.optimizer.step()

    def step(self, batch: Batch) -> torch.Tensor:
        """One training step: `forward`, `backward`, `update`; returns the loss."""
        loss = self.forward(batch)
        self.backward(loss)
        self.update()
        return loss

    def bucket_buffers(self) -> list[torch.Tensor]:
        """DDP buckets that hold gradients apart from `.grad` (none when `.grad` views them)."""
        if self.ddp is None or self.ddp.gradient_as_bucket_view:
            return []
        return [bucket.buffer() for bucket in self.ddp.reducer._get_zeros_like_grad_buckets()]


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds: a ShardedOptimizer's shards (or whole
    parameters' state, by tensor), a ZeroRedundancyOptimizer's local optimizer, the local
    shards of FSDP2's DTensors (`counters.storage_bytes`)."""
    if isinstance(optimizer, flatgrad.ShardedOptimizer):
        return optimizer.state_bytes()
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer = optimizer.optim  # its `state` holds no tensors; this rank's are here
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return storage_bytes({"state": state})["state"]


@dataclass
class Optimizers:
    """Several optimizers stepped as one (Muon's recipe: Muon and AdamW over parts of one
    model): `step()` clips the whole model's gradients (`clip`), then steps each part."""

    parts: list[torch.optim.Optimizer]
    clip: Callable[[], object]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.clip()
        for part in self.parts:
            part.step()


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

# Muon's recipe (Muon for the 2-D hidden matrices, AdamW for the embeddings, the tied head
# and the vectors; the whole model clipped at MUON_MAX_NORM), asked for by name: not in
# the default run (Newton-Schulz on the MLPs' 2048x2048 matrices takes seconds per step on
# a CPU). Their `lr` is theirs, not build_runner's.
MUON_CONFIGS = (
    "ddp_muon",  # DDP (bucket views) + torch.optim.Muon + torch.optim.AdamW
    "flatgrad_dp_muon",  # DataParallel + the same two plain optimizers
    "flatgrad_zero_muon",  # DataParallel + two ShardedOptimizers by tensor
    "zero_stock_muon",  # DDP (bucket views) + two ZeroRedundancyOptimizers
    "zero_stock_muon_view",  # the same with parameters_as_bucket_view=True
)
MUON: dict[str, Any] = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01}
MUON_ADAMW: dict[str, Any] = {"lr": 3e-3, "weight_decay": 0.1}
MUON_MAX_NORM = 1.0


def build_runner(
    name: str, model: nn.Module, device: torch.device, lr: float = 1e-3, unused_parameters: bool = False
) -> Runner:
    """A fresh copy of `model` set up as configuration `name`; `unused_parameters`: the model
    leaves some unused, which DDP (but for static_graph) must be told."""
    module = copy.deepcopy(model).to(device)
    ids = [device.index or 0] if device.type == "cuda" else None
    if name in MUON_CONFIGS:
        return _muon_runner(name, module, ids, unused_parameters)
    sgd = functools.partial(torch.optim.SGD, lr=lr, momentum=0.9)
    if name in ("ddp_default", "ddp_bucket_view", "ddp_static_graph", "zero_stock"):
        static = name == "ddp_static_graph"
        ddp = DDP(
            module,
            device_ids=ids,
            find_unused_parameters=unused_parameters and not static,
            gradient_as_bucket_view=name in ("ddp_bucket_view", "zero_stock"),
            static_graph=static,
        )
        if name == "zero_stock":
            zero = ZeroRedundancyOptimizer(
                ddp.parameters(),
                optimizer_class=torch.optim.SGD,
                parameters_as_bucket_view=True,
                lr=lr,
                momentum=0.9,
            )
            return Runner(name, ddp, zero, ddp=ddp)
        return Runner(name, ddp, sgd(ddp.parameters()), ddp=ddp)
    if name == "flatgrad_ddp_hook":
        flat = flatgrad.FlatGrad(module)
        ddp = DDP(flat, device_ids=ids, find_unused_parameters=unused_parameters, **flat.ddp_kwargs())
        ddp.register_comm_hook(flat.comm_state(), flatgrad.allreduce_hook)
        return Runner(name, ddp, sgd(ddp.parameters()), ddp=ddp)
    if name == "flatgrad_all_reduce":
        flat = flatgrad.FlatGrad(module)
        _broadcast_parameters(flat)
        return Runner(name, flat, sgd(flat.parameters()), sync=flat.all_reduce_grads)
    if name in ("flatgrad_dp", "flatgrad_zero"):
        dp = flatgrad.replicate(flatgrad.FlatGrad(module))
        if name == "flatgrad_zero":
            sharded = flatgrad.ShardedOptimizer(dp, torch.optim.SGD, lr=lr, momentum=0.9)
            return Runner(name, dp, sharded, engine=flatgrad.replicate_state(dp))  # type: ignore[arg-type]
        return Runner(name, dp, sgd(dp.parameters()), engine=flatgrad.replicate_state(dp))
    if name == "fsdp2":
        _fully_shard(module, device)
        return Runner(name, module, sgd(module.parameters()), counts_grad_copies=False)
    if name in ("local_stock", "local_flatgrad"):
        local = flatgrad.FlatGrad(module) if name == "local_flatgrad" else module
        return Runner(name, local, sgd(local.parameters()))
    raise ValueError(f"configuration must be one of {', '.join(CONFIGS + MUON_CONFIGS)}, got {name!r}")


def muon_split(module: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Muon's recipe: (the hidden matrices, for Muon; the rest, for AdamW). A hidden matrix
    is a 2-D parameter no `nn.Embedding` holds (a head tied to the embedding is the
    embedding's weight); on the bench's LMs that is every 2-D parameter of their
    `blocks`."""
    embeddings = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    params = [p for p in module.parameters() if p.requires_grad]
    matrices = [p for p in params if p.dim() == 2 and id(p) not in embeddings]
    rest = [p for p in params if not (p.dim() == 2 and id(p) not in embeddings)]
    return matrices, rest


def _muon_runner(name: str, module: nn.Module, ids: list[int] | None, unused_parameters: bool) -> Runner:
    """`module` (a fresh copy) set up as the Muon configuration `name`."""
    muon_class = getattr(torch.optim, "Muon", None)
    if muon_class is None:
        raise ValueError(
            f"configuration {name} needs torch.optim.Muon (torch 2.9 on), not in torch {torch.__version__}"
        )
    matrices, rest = muon_split(module)
    if name in ("flatgrad_dp_muon", "flatgrad_zero_muon"):
        dp = flatgrad.replicate(flatgrad.FlatGrad(module))
        if name == "flatgrad_zero_muon":  # (one clip over the whole model: every rank holds every gradient)
            muon = flatgrad.ShardedOptimizer(dp, muon_class, matrices, **MUON)
            adamw = flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, rest, shard_by="tensor", **MUON_ADAMW)
            clip = functools.partial(muon.clip_grad_norm_, MUON_MAX_NORM)
            return Runner(name, dp, Optimizers([muon, adamw], clip), engine=flatgrad.replicate_state(dp))
        plain = [muon_class(matrices, **MUON), torch.optim.AdamW(rest, **MUON_ADAMW)]
        clip = functools.partial(dp.clip_grad_norm_, MUON_MAX_NORM)
        return Runner(name, dp, Optimizers(plain, clip), engine=flatgrad.replicate_state(dp))
    ddp = DDP(module, device_ids=ids, gradient_as_bucket_view=True, find_unused_parameters=unused_parameters)
    parts: list[torch.optim.Optimizer]
    if name == "ddp_muon":
        parts = [muon_class(matrices, **MUON), torch.optim.AdamW(rest, **MUON_ADAMW)]
    else:
        view = name == "zero_stock_muon_view"
        parts = [
            ZeroRedundancyOptimizer(
                matrices, optimizer_class=muon_class, parameters_as_bucket_view=view, **MUON
            ),
            ZeroRedundancyOptimizer(
                rest, optimizer_class=torch.optim.AdamW, parameters_as_bucket_view=view, **MUON_ADAMW
            ),
        ]
    clip = functools.partial(torch.nn.utils.clip_grad_norm_, list(module.parameters()), MUON_MAX_NORM)
    return Runner(name, ddp, Optimizers(parts, clip), ddp=ddp)


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
