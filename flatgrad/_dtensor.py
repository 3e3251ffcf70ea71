"""DTensor parameters: a model made tensor-parallel (`parallelize_module`) with FlatGrad applied.

A DTensor parameter's slot holds its *local* shard, a plain tensor in the flat buffer like any other slot, so
buffers, buckets and all-reduces over the data-parallel ranks stay plain tensors. Its `.grad` is a DTensor
with the parameter's mesh and placements whose local tensor is that slot (`grad_of_slot`): what reads `.grad`
(torch's optimizers over DTensor parameters, `torch.nn.utils.clip_grad_norm_`, DCP) sees what it sees without
flatgrad, and AccumulateGrad's in-place add into that DTensor writes the slot.

`TensorParallel` is the one mesh of a model's DTensor parameters: which slots a norm counts on this rank (a
shard on every rank, a replicated parameter on the mesh's first rank only), the all-reduce that makes a local
norm the norm of the whole, unsharded gradient, and the check that a data-parallel group does not cross it."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from flatgrad._torch_compat import DTensor, local_shape_and_offset, set_local_tensor


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a DTensor (a tensor-parallel parameter or its gradient)."""
    return isinstance(tensor, DTensor)


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor this rank holds of `tensor`: a DTensor's local shard (no autograd edge), or itself."""
    if not isinstance(tensor, DTensor):
        return tensor
    with torch.no_grad():
        return tensor.to_local()


def is_sharded(param: torch.Tensor) -> bool:
    """Whether `param` is a DTensor sharded over every mesh dimension (each rank holds other elements)."""
    return isinstance(param, DTensor) and all(placement.is_shard() for placement in param.placements)


def move_into(param: torch.Tensor, view: torch.Tensor) -> None:
    """Make `view` (a plain tensor shaped, strided and typed as `param`'s local tensor: its
    slot of a flat parameter buffer) `param`'s memory: a DTensor's local shard, any other
    parameter's ``.data``. Under no_grad, with the values copied in already."""
    if isinstance(param, DTensor):
        set_local_tensor(param, view)
    else:
        param.data = view


def shard_origin(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Where this rank's local shard of DTensor `param` lies in the whole tensor: its offset per dimension and
    the whole tensor's shape (a per-element optimizer state saved in the whole parameter's shape puts this
    rank's elements there); None for a plain parameter (its state is its own shape)."""
    if not isinstance(param, DTensor):
        return None
    _, offset = local_shape_and_offset(param)
    return offset, tuple(param.shape)


def grad_of_slot(slot: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The `.grad` of DTensor `param` whose local tensor is `slot` (its local shard's place
    in the flat buffer): the parameter's mesh, placements, global shape and strides."""
    with torch.no_grad():
        mesh, placements = param.device_mesh, param.placements  # type: ignore[attr-defined]
        return DTensor.from_local(
            slot, mesh, placements, run_check=False, shape=param.shape, stride=param.stride()
        )


def local_gradient(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of `grad` laid out as `like` (a DTensor parameter or its slot's `.grad`): `grad`
    redistributed to `like`'s placements where they differ, then local. A plain `grad` as it is."""
    if not isinstance(grad, DTensor):
        return grad.detach()
    with torch.no_grad():
        if tuple(grad.placements) != tuple(like.placements):  # type: ignore[attr-defined]
            grad = grad.redistribute(like.device_mesh, like.placements)  # type: ignore[attr-defined]
        return grad.to_local()


@dataclass(frozen=True, eq=False)
class TensorParallel:
    """The mesh a model's DTensor parameters live on, as gradient norms and data-parallel groups need it.

    Args:
        mesh: that 1-D mesh (the "tp" dimension of a 2-D one)."""

    mesh: DeviceMesh

    @functools.cached_property
    def first(self) -> bool:
        """Whether this rank is the mesh's first (where replicated gradients are counted)."""
        return self.mesh.get_local_rank() == 0

    @property
    def ranks(self) -> list[int]:
        """The mesh's global ranks."""
        return self.mesh.mesh.flatten().tolist()

    @property
    def group(self) -> dist.ProcessGroup:
        """The mesh's process group (the norms' all-reduce)."""
        return self.mesh.get_group()

    def counts(self, param: torch.Tensor) -> bool:
        """Whether a norm counts this rank's slot of `param`: a sharded parameter's on every rank (disjoint
        shards), a replicated or plain one's (alike on every rank, as computed outside the tensor-parallel
        layers) on the mesh's first rank only, so the mesh's sum counts each element once."""
        return self.first or is_sharded(param)

    def combine(self, norms: Sequence[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
        """The whole gradient's norm from this rank's float64 norms of counted slots (`combine_norms`)."""
        return combine_norms(norms, norm_type, self.group, self.mesh.device_type)

    def check_data_parallel(self, process_group: dist.ProcessGroup | None, what: str) -> None:
        """Raise unless `process_group` (None: default group) meets the mesh in this rank alone: a
        data-parallel group must hold one rank of each tensor-parallel group, or its average would mix
        different shards. Each rank checks its own pair: a crossing group crosses on all its ranks."""
        group = process_group if process_group is not None else dist.group.WORLD
        data_parallel = set(dist.get_process_group_ranks(group))
        tensor_parallel = set(self.ranks)
        shared = sorted(data_parallel & tensor_parallel)
        if len(shared) != 1:
            raise ValueError(
                f"{what}'s process_group must hold one rank of each tensor-parallel group (the mesh "
                f"of the model's DTensor parameters, ranks {sorted(tensor_parallel)}), got a group "
                f"with ranks {sorted(data_parallel)}: pass the data-parallel dimension's group, e.g. "
                'mesh["dp"].get_group() for init_device_mesh(..., mesh_dim_names=("dp", "tp"))'
            )


def combine_norms(
    norms: Sequence[torch.Tensor], norm_type: float, group: dist.ProcessGroup, device_type: str
) -> list[torch.Tensor]:
    """The norm over the ranks of `group` (a tensor-parallel mesh; a pipeline's stages) from this rank's
    float64 per-piece norms: their `norm_type` norm, combined over the group (max for inf, else a sum of
    `norm_type`-th powers; one float64 all-reduce on `device_type`): one piece, alike everywhere."""
    device = norms[0].device if norms and norms[0].device.type == device_type else torch.device(device_type)
    if norms:
        local = torch.linalg.vector_norm(torch.stack([n.to(device, torch.float64) for n in norms]), norm_type)
    else:
        local = torch.zeros((), dtype=torch.float64, device=device)
    if math.isinf(norm_type):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return [local]
    powered = local.pow(norm_type)
    dist.all_reduce(powered, group=group)
    return [powered.pow(1.0 / norm_type)]


def pipeline_group(pp_mesh: object, **groups: Sequence[int]) -> dist.ProcessGroup:
    """The process group of `pp_mesh`, the 1-D mesh of a pipeline's stages over which a norm sums each stage's
    (``mesh["pp"]``), checked against `groups` (by name: the ranks of the model's tensor-parallel mesh, of a
    data-parallel group), which it must meet in this rank alone, or a stage's gradient would be counted more
    than once. Every rank checks its own groups: a mesh that crosses one crosses it on every rank it holds.

    Raises:
        TypeError: `pp_mesh` is not a DeviceMesh.
        ValueError: It has more than one dimension, or crosses one of `groups`."""
    if not isinstance(pp_mesh, DeviceMesh):
        raise TypeError(f"pp_mesh must be a DeviceMesh (mesh['pp']), got {type(pp_mesh).__name__}")
    if pp_mesh.ndim != 1:
        raise ValueError(f"pp_mesh must be 1-D (mesh['pp']), got a mesh of shape {tuple(pp_mesh.shape)}")
    stages = set(pp_mesh.mesh.flatten().tolist())
    for name, ranks in groups.items():
        if len(stages & set(ranks)) != 1:
            raise ValueError(
                f"pp_mesh must hold one rank of each {name} group (ranks {sorted(ranks)} here), got "
                f'ranks {sorted(stages)}: pass the pipeline dimension, mesh["pp"]'
            )
    return pp_mesh.get_group()


def tensor_parallel_of(params: Sequence[torch.Tensor]) -> TensorParallel | None:
    """The `TensorParallel` of `params`' DTensors (None when there is none).

    Raises:
        ValueError: DTensor parameters on more than one mesh, on a mesh of more than one
            dimension, or with a Partial placement."""
    meshes: list[DeviceMesh] = []
    for param in params:
        if not isinstance(param, DTensor):
            continue
        mesh = param.device_mesh
        if mesh.ndim != 1:
            raise ValueError(
                f"a DTensor parameter's mesh must have one dimension (the tensor-parallel one), got "
                f"a parameter of shape {tuple(param.shape)} on a mesh of shape {tuple(mesh.shape)}: "
                'parallelize the model over mesh["tp"], and give the data-parallel dimension to '
                "flatgrad.replicate"
            )
        if any(placement.is_partial() for placement in param.placements):
            raise ValueError(
                f"a DTensor parameter's placements must be Shard or Replicate, got {param.placements} "
                f"for a parameter of shape {tuple(param.shape)}"
            )
        if not any(mesh == seen for seen in meshes):
            meshes.append(mesh)
    if len(meshes) > 1:
        raise ValueError(
            f"the model's DTensor parameters must live on one mesh, got {len(meshes)}: "
            + ", ".join(str(mesh) for mesh in meshes)
        )
    return TensorParallel(meshes[0]) if meshes else None
