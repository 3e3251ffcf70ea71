"""A ShardedOptimizer's state in a form that does not depend on the world size.

The inner optimizer keeps its state per *piece* (a run of slots inside this rank's shard of
a bucket), and pieces change with the world size and the buckets. The checkpoint form is
per parameter, keyed by the plain parameter names, as torch's own optimizer state dicts
after ``torch.distributed.checkpoint.state_dict.get_state_dict``:

    {"state": {name: {key: value}}, "param_groups": [{**options, "params": [name, ...]}],
     "stepped": [bool per group]}

A state tensor with one value per element (``exp_avg``) is a ShardedTensor of the
parameter's elements in its slot's memory order, 1-D, whose shards are every rank's pieces
of that parameter (built from the layout each rank knows, no communication): the local
shards are views of the inner optimizer's state, so ``torch.distributed.checkpoint`` saves
them in place and loads them into any other world size's pieces (it reshards). A scalar
state (``step``) is a plain tensor, the same on every rank that holds a piece of the group.
``stepped`` says whether a group's state exists (a group that has not stepped yet resumes
fresh, however its template was filled).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flatgrad._torch_compat import sharded_tensor
from flatgrad.layout import GroupKey


@dataclass(frozen=True)
class Piece:
    """A run of one group's slots inside this rank's shard of a bucket."""

    param: nn.Parameter  # a 1-D view of the flat parameter buffer (what the inner optimizer steps)
    grad: torch.Tensor  # the same elements of the flat gradient buffer
    key: GroupKey
    start: int  # offset in its flat buffer


@dataclass(frozen=True)
class Chunk:
    """One rank's part of one parameter: `numel` elements from `offset` in the parameter
    (in its slot's memory order), at `start` in the flat buffer."""

    rank: int
    offset: int
    numel: int
    start: int


@dataclass(frozen=True)
class Layout:
    """Where every parameter's elements are, on every rank: shards of each bucket."""

    world_size: int
    rank: int
    global_ranks: tuple[int, ...]  # the process group's ranks as global ranks (placements)
    buckets: dict[GroupKey, list[tuple[int, int]]]  # (start, numel) of each bucket
    slots: dict[int, tuple[GroupKey, int, int]]  # id(param) -> (key, offset, numel)

    def chunks(self, param: torch.Tensor) -> list[Chunk]:
        key, offset, numel = self.slots[id(param)]
        found = []
        for start, size in self.buckets[key]:
            shard = size // self.world_size
            for rank in range(self.world_size):
                lo = max(offset, start + rank * shard)
                hi = min(offset + numel, start + (rank + 1) * shard)
                if lo < hi:
                    found.append(Chunk(rank, lo - offset, hi - lo, lo))
        return found


@dataclass(frozen=True)
class StateSpec:
    """What an optimizer keeps per parameter: the per-element state keys, and the scalar
    states with a template value each."""

    per_element: tuple[str, ...]
    scalars: dict[str, Any]


def state_spec(
    optimizer_class: type[torch.optim.Optimizer], options: dict[str, Any], like: torch.Tensor
) -> StateSpec:
    """What `optimizer_class` keeps per parameter with these group options: one step of a
    throwaway one-element parameter like `like` shows it."""
    dummy = nn.Parameter(like.new_zeros(1))
    dummy.grad = torch.zeros_like(dummy)
    probe = optimizer_class([dict(options, params=[dummy])])  # type: ignore[call-arg]
    probe.step()
    state = probe.state[dummy]
    per_element = tuple(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() == 1)
    return StateSpec(per_element, {k: v for k, v in state.items() if k not in per_element})


def piece_states(pieces: list[Piece], live: Any, spec: StateSpec) -> list[dict[str, Any]]:
    """Each piece's state: the inner optimizer's where it has one, else zeros (and the
    spec's scalars) shaped as it would be."""
    states = []
    for piece in pieces:
        state = live.get(piece.param)
        if not state:
            state = {key: torch.zeros_like(piece.param.detach()) for key in spec.per_element}
            state.update({key: _copy(value) for key, value in spec.scalars.items()})
        if MASTER in spec.per_element:  # (a new dict: the optimizer's own keeps its keys)
            state = {**state, MASTER: piece.param.detach()}  # the master, saved and loaded in place
        states.append(state)
    return states


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def parameter_state(
    layout: Layout,
    params: list[tuple[str, torch.Tensor]],
    pieces: list[Piece],
    states: list[dict[str, Any]],
    spec: StateSpec,
    process_group: dist.ProcessGroup | None,
) -> dict[str, dict[str, Any]]:
    """The per-parameter form of one group's state (see the module notes)."""
    out = {}
    for name, param in params:
        chunks = layout.chunks(param)
        if not chunks:
            continue  # no elements (numel 0): no state
        mine = [c for c in chunks if c.rank == layout.rank]
        # Every rank holds a shard of every parameter's state, an empty one where it has no
        # elements: torch.distributed.checkpoint drops a ShardedTensor without local shards
        # from a rank's plan, and then mistakes the checkpoint for an old-format one.
        # (At the end: a chunk is known by its offset, and two at one offset are one.)
        held = {c.rank for c in chunks}
        end = param.numel()
        chunks = chunks + [Chunk(r, end, 0, 0) for r in range(layout.world_size) if r not in held]
        mine = mine or [Chunk(layout.rank, end, 0, 0)]
        # Scalars on every rank (every rank has a piece of the group, maybe an empty one, and
        # the same values): the same keys everywhere, as torch.distributed.checkpoint expects.
        entry: dict[str, Any] = {key: states[0][key] for key in spec.scalars}
        for key in spec.per_element:
            dtype = _dtype_of(states, key, param)
            views = [_local_view(c, pieces, states, key) if c.numel else _empty(dtype, param) for c in mine]
            entry[key] = sharded_tensor(
                views, chunks, param.numel(), dtype, layout.global_ranks, process_group
            )
        out[name] = entry
    return out


def _empty(dtype: torch.dtype, param: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=param.device)


def _dtype_of(states: list[dict[str, Any]], key: str, param: torch.Tensor) -> torch.dtype:
    for state in states:
        value = state.get(key)
        if isinstance(value, torch.Tensor):
            return value.dtype
    return param.dtype


def _local_view(chunk: Chunk, pieces: list[Piece], states: list[dict[str, Any]], key: str) -> torch.Tensor:
    for piece, state in zip(pieces, states):
        if piece.start <= chunk.start and chunk.start + chunk.numel <= piece.start + piece.param.numel():
            view: torch.Tensor = state[key].narrow(0, chunk.start - piece.start, chunk.numel)
            return view
    raise AssertionError(f"no piece holds the chunk at {chunk.start} (+{chunk.numel})")


def missing_state(
    layout: Layout, params: list[tuple[str, torch.Tensor]], saved: dict[str, Any], spec: StateSpec
) -> list[str]:
    """What this rank needs from `saved` (one group's per-parameter state) and does not
    find in it: parameter names and keys, for the error."""
    missing = []
    for name, param in params:
        chunks = layout.chunks(param)
        if not chunks:
            continue
        mine = [c for c in chunks if c.rank == layout.rank]
        entry = saved.get(name)
        if not isinstance(entry, dict):
            missing.append(name)
            continue
        for key in (*spec.per_element, *spec.scalars):
            if key not in entry:
                missing.append(f"{name}[{key!r}]")
        for key in spec.per_element:
            if key in entry and not all(_covered(entry[key], c, param.numel()) for c in mine):
                missing.append(f"{name}[{key!r}] (this rank's elements)")
    return missing


def _saved_parts(value: Any, numel: int) -> list[tuple[int, torch.Tensor]]:
    """(offset, 1-D data) of the parts of a saved per-element state this rank holds: a
    ShardedTensor's local shards, or a whole tensor of the parameter's elements."""
    if hasattr(value, "local_shards"):
        return [(int(s.metadata.shard_offsets[0]), s.tensor.reshape(-1)) for s in value.local_shards()]
    if isinstance(value, torch.Tensor) and value.numel() == numel:
        return [(0, value.reshape(-1))]
    return []


def _covered(value: Any, chunk: Chunk, numel: int) -> bool:
    covered = 0
    for offset, data in _saved_parts(value, numel):
        covered += max(0, min(offset + data.numel(), chunk.offset + chunk.numel) - max(offset, chunk.offset))
    return covered == chunk.numel


def load_parameter_state(
    layout: Layout,
    params: list[tuple[str, torch.Tensor]],
    saved: dict[str, Any],
    pieces: list[Piece],
    states: list[dict[str, Any]],
    spec: StateSpec,
) -> None:
    """Copy one group's saved per-parameter state into `states` (its pieces' state), once
    `missing_state` found nothing missing."""
    for name, param in params:
        for chunk in (c for c in layout.chunks(param) if c.rank == layout.rank):
            for key in spec.per_element:
                _copy_chunk(_local_view(chunk, pieces, states, key), chunk, saved[name][key], param.numel())
    scalars = next(saved[name] for name, param in params if layout.chunks(param))
    for state in states:
        state.update({key: _copy(scalars[key]) for key in spec.scalars})


def _copy_chunk(target: torch.Tensor, chunk: Chunk, saved: Any, numel: int) -> None:
    for offset, data in _saved_parts(saved, numel):
        lo, hi = max(offset, chunk.offset), min(offset + data.numel(), chunk.offset + chunk.numel)
        if lo < hi:
            source = data.narrow(0, lo - offset, hi - lo)
            part = target.narrow(0, lo - chunk.offset, hi - lo)
            if part.data_ptr() != source.data_ptr():  # (loaded in place: the same memory)
                part.copy_(source)


# --- one optimizer's groups ----------------------------------------------------------------


@dataclass(frozen=True)
class GroupView:
    """One parameter group as the checkpoint sees it: its named parameters (those with a
    slot), its options and this rank's pieces of it."""

    params: list[tuple[str, torch.Tensor]]
    options: dict[str, Any]
    pieces: list[Piece]
    # Whether the pieces are float32 masters of bfloat16/float16 parameters: they are saved
    # and loaded with the state, as the per-element key `MASTER`.
    masters: bool = False


MASTER = "master"


def group_spec(optimizer_class: type[torch.optim.Optimizer], group: GroupView) -> StateSpec:
    """The state `group` saves per parameter: the optimizer's, and its masters if any."""
    like = group.pieces[0].param if group.pieces else group.params[0][1]
    spec = state_spec(optimizer_class, group.options, like)
    if group.masters:
        return StateSpec((*spec.per_element, MASTER), spec.scalars)
    return spec


def optimizer_state(
    optimizer: torch.optim.Optimizer,
    groups: list[GroupView],
    stepped: list[bool],
    layout: Layout,
    process_group: dist.ProcessGroup | None,
) -> dict[str, Any]:
    """The per-parameter form of `optimizer`'s state over `groups` (see the module notes)."""
    state: dict[str, Any] = {}
    for group in groups:
        if group.params:
            spec = group_spec(type(optimizer), group)
            states = piece_states(group.pieces, optimizer.state, spec)
            state.update(parameter_state(layout, group.params, group.pieces, states, spec, process_group))
    param_groups = [{**group.options, "params": [name for name, _ in group.params]} for group in groups]
    return {"state": state, "param_groups": param_groups, "stepped": list(stepped)}


def misfit(
    optimizer_class: type[torch.optim.Optimizer], groups: list[GroupView], layout: Layout, saved: Any
) -> str | None:
    """What keeps `saved` from loading on this rank; None when it fits."""
    if not isinstance(saved, dict) or not {"state", "param_groups", "stepped"} <= saved.keys():
        return "not a ShardedOptimizer.state_dict()"
    names = [[name for name, _ in group.params] for group in groups]
    saved_names = [list(group.get("params", ())) for group in saved["param_groups"]]
    if saved_names != names or len(saved["stepped"]) != len(groups):
        return "its parameter groups hold other parameters (another model or grouping)"
    for group, stepped in zip(groups, saved["stepped"]):
        if stepped and group.params:
            spec = group_spec(optimizer_class, group)
            missing = missing_state(layout, group.params, saved["state"], spec)
            if missing:
                return f"no state for {missing[:4]}"
    return None


def refuse_misfits(
    problem: str | None, device: torch.device, process_group: dist.ProcessGroup | None
) -> None:
    """Raise the same ValueError on every rank when `problem` (this rank's `misfit`) or any
    other rank's is not None (one small all-reduce): no rank loads a state that does not fit
    on every rank."""
    world_size, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
    flags = torch.zeros(world_size, dtype=torch.int32, device=device)
    flags[rank] = int(problem is not None)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=process_group)
    wrong = [r for r, flag in enumerate(flags.tolist()) if flag]
    if wrong:
        mine = f" (this rank {rank}: {problem})" if problem is not None else ""
        raise ValueError(
            f"ShardedOptimizer state given to rank(s) {wrong} does not fit{mine}; save and load "
            "it with torch.distributed.checkpoint (dcp.save({'optim': opt}, ...), any world "
            "size), or torch.save each rank's own state and load it on that rank"
        )


def load_group(
    optimizer: torch.optim.Optimizer, group: GroupView, layout: Layout, saved: dict[str, Any], stepped: bool
) -> None:
    """Give `group`'s pieces their state from `saved` (which `misfit` accepted); a group
    saved before it stepped gets a fresh optimizer's state."""
    if not group.params or not group.pieces:
        return
    if not stepped:
        fresh = type(optimizer)([dict(group.options, params=[p.param for p in group.pieces])])  # type: ignore[call-arg]
        for piece in group.pieces:
            optimizer.state.pop(piece.param, None)
            if fresh.state.get(piece.param):
                optimizer.state[piece.param] = fresh.state[piece.param]
        return
    spec = group_spec(type(optimizer), group)
    states = piece_states(group.pieces, optimizer.state, spec)
    load_parameter_state(layout, group.params, saved, group.pieces, states, spec)
    for piece, state in zip(group.pieces, states):
        state.pop(MASTER, None)  # (loaded into the piece itself)
        optimizer.state[piece.param] = state
