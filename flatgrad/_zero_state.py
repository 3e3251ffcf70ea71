"""A ShardedOptimizer's state in a form that does not depend on the world size.

The inner optimizer keeps its state per *piece* (a run of slots inside this rank's shard of a bucket), and
pieces change with the world size and the buckets. The checkpoint form is per parameter, keyed by the plain
parameter names, as torch's own optimizer state after ``get_state_dict`` (docs/data-parallel.md, "Checkpoints
that reshard"): a per-element state (``exp_avg``) is a ShardedTensor shaped as its parameter whose shards are
every rank's pieces (at most 2N-1 rectangles of an N-d tensor, `boxes`), views of the inner optimizer's state
(copies where the memory order is not row-major). ``torch.save`` writes this rank's shards as plain tensors,
which ``torch.load(..., weights_only=True)`` reads. A scalar state (``step``) is a plain tensor, the same on
every rank holding a piece of the group; a group that has not stepped saves a step count of 0 and resumes
fresh (`saved_stepped`)."""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flatgrad._dtensor import local_of
from flatgrad._layout import GroupKey, overlap
from flatgrad._torch_compat import SAVED_SHARDS, sharded_tensor


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
    # id(param) -> (offset, whole shape) of a DTensor parameter's local shard in the whole parameter
    # (`flatgrad._dtensor.shard_origin`): its state is saved in the whole shape.
    origins: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = dataclasses.field(default_factory=dict)
    # id(param) -> the boxes (global rank, offsets, sizes) of a sharded DTensor parameter's state that the
    # other tensor-parallel ranks' pieces hold (`flatgrad._zero.peer_boxes`).
    peers: dict[int, list[tuple[int, tuple[int, ...], tuple[int, ...]]]] = dataclasses.field(
        default_factory=dict
    )
    # id(param) -> where every tensor-parallel rank's chunks of a replicated parameter start and end: its
    # chunks are cut there too, so each saved box is the same on every rank (one copy is written).
    cuts: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def extent(self, param: torch.Tensor) -> Extent:
        """Where `param`'s slot lies in the tensor its per-element state is saved as."""
        local = _sharded_shape(local_of(param))
        origin, size = self.origins.get(id(param), ((0,) * local.dim(), tuple(local.shape)))
        if not origin and not size:  # (a 0-d DTensor: one element, as `_sharded_shape`)
            origin, size = (0,), (1,)
        return Extent(local, origin, size)

    def chunks(self, param: torch.Tensor) -> list[Chunk]:
        key, offset, numel = self.slots[id(param)]
        cuts = self.cuts.get(id(param), ())
        found = []
        for start, size in self.buckets[key]:
            shard = size // self.world_size
            for rank in range(self.world_size):
                inside = overlap(offset, offset + numel, start + rank * shard, start + (rank + 1) * shard)
                if inside is not None:
                    lo, hi = inside
                    edges = [lo, *(offset + c for c in cuts if lo < offset + c < hi), hi]
                    found += [Chunk(rank, a - offset, b - a, a) for a, b in zip(edges, edges[1:])]
        return found


@dataclass(frozen=True)
class Extent:
    """One parameter's slot as its per-element state is saved: `local` shaped and strided as the slot (what
    the pieces hold, in its memory order), lying at `origin` in a tensor of shape `size` (the whole
    parameter's: for a DTensor, this rank's shard where it lies in the whole)."""

    local: torch.Tensor
    origin: tuple[int, ...]
    size: tuple[int, ...]

    def boxes(self, start: int, numel: int) -> list[Box]:
        """`boxes` of the slot's run [start, start + numel), placed in the saved tensor."""
        return [
            Box(tuple(o + a for o, a in zip(box.offsets, self.origin)), box.sizes, box.start)
            for box in boxes(self.local, start, numel)
        ]


@dataclass(frozen=True)
class OptimizerRecipe:
    """An optimizer class and the constructor arguments the user gave it: every optimizer ShardedOptimizer
    builds (the inner one, and the throwaway probes) is built from both, as a plain optimizer is, since some
    classes read constructor arguments outside the groups (Adagrad's ``initial_accumulator_value``,
    ``differentiable``, ``fused``)."""

    optimizer_class: type[torch.optim.Optimizer]
    kwargs: Mapping[str, Any]

    @property
    def name(self) -> str:
        """The class's name, for messages."""
        return self.optimizer_class.__name__

    def build(self, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        """``optimizer_class(groups, **kwargs)``: the groups' options override the arguments."""
        return self.optimizer_class(groups, **self.kwargs)

    @property
    def steps_with_closure(self) -> bool:
        """Whether the class's ``step`` requires its closure (schedule-free's ``*Closure`` classes run it
        at moved parameters), rather than taking one it may run first, as torch's classes do."""
        try:
            closure = inspect.signature(self.optimizer_class.step).parameters.get("closure")
        except (TypeError, ValueError):  # (no signature to read)
            return False
        return closure is not None and closure.default is inspect.Parameter.empty

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """One step of a throwaway optimizer whose gradients are set, with a closure that
        leaves them as they are where the class requires one."""
        if self.steps_with_closure:
            optimizer.step(lambda: 0.0)
        else:
            optimizer.step()

    def build_to_step(self, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        """`build`, for a throwaway optimizer about to step: in training mode where it has one (schedule-free
        ones step only after ``train()``, and a group saved at their eval point says ``train_mode=False``)."""
        optimizer = self.build(groups)
        train = getattr(optimizer, "train", None)
        if callable(train):
            train()
        return optimizer


@dataclass(frozen=True)
class StateSpec:
    """What an optimizer keeps per parameter: the per-element state keys, and the scalar
    states with a template value each."""

    per_element: tuple[str, ...]
    scalars: dict[str, Any]


def state_spec(recipe: OptimizerRecipe, options: dict[str, Any], like: torch.Tensor) -> StateSpec:
    """What `recipe`'s optimizer keeps per parameter with these group options: one step of
    a throwaway one-element parameter like `like` shows it."""
    dummy = nn.Parameter(like.new_zeros(1))
    dummy.grad = torch.zeros_like(dummy)
    with isolated_rng(like):
        probe = recipe.build_to_step([dict(options, params=[dummy])])
        recipe.step(probe)
    state = probe.state[dummy]
    per_element = tuple(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() == 1)
    return StateSpec(per_element, {k: v for k, v in state.items() if k not in per_element})


# A group option the class's first step adds, saved by a group before that step: DCP loads only the keys the
# loading optimizer's `state_dict()` shows, so every state_dict shows them (`load_state_dict` drops this).
NOT_STEPPED = "flatgrad: not stepped yet"


def with_stepped_options(groups: list[dict[str, Any]], added: list[tuple[str, ...]]) -> list[dict[str, Any]]:
    """A state_dict's `groups`, each with the options a first step adds (`added`: `first_step_keys`) that it
    lacks (it has not stepped) set to `NOT_STEPPED`."""
    return [{**dict.fromkeys(keys, NOT_STEPPED), **group} for group, keys in zip(groups, added)]


def first_step_keys(
    recipe: OptimizerRecipe, options: dict[str, Any], like: torch.Tensor
) -> tuple[tuple[str, ...], tuple[object, ...]]:
    """The group options, and the keys of state not of a parameter (MADGRAD's ``k``), that a step of
    `recipe`'s class adds with a group of a small `like` (none if it refuses it)."""
    dummy = nn.Parameter(like.new_zeros((2,) * like.dim()))
    dummy.grad = torch.ones_like(dummy)
    try:
        with isolated_rng(like):
            probe = recipe.build_to_step([dict(options, params=[dummy])])
            before = set(probe.param_groups[0])
            recipe.step(probe)
    except Exception:  # (what the class refuses of a throwaway tensor it raises at its own step too)
        return (), ()
    added = tuple(k for k in probe.param_groups[0] if k not in before)
    return added, tuple(k for k in probe.state if not isinstance(k, torch.Tensor))


def by_count(steps: dict[str, float]) -> str:
    """Parameter names by step count, a few of each (a message's)."""
    counts: dict[float, list[str]] = {}
    for name, count in steps.items():
        counts.setdefault(count, []).append(name)
    return "; ".join(
        f"{c:g}: {names[:3]}" + (f" and {len(names) - 3} more" * (len(names) > 3))
        for c, names in counts.items()
    )


def without_stepped_options(groups: object) -> object:
    """A loaded state_dict's groups without the options `with_stepped_options` marked."""
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        return groups
    return [{k: v for k, v in g.items() if not (isinstance(v, str) and v == NOT_STEPPED)} for g in groups]


def isolated_rng(like: torch.Tensor) -> Any:
    """A context giving back the random state (of `like`'s CUDA device too) a throwaway step draws from."""
    return torch.random.fork_rng(devices=[like.device.index or 0] if like.device.type == "cuda" else [])


def zeros_start_fresh(recipe: OptimizerRecipe, options: dict[str, Any], like: torch.Tensor) -> bool:
    """Whether `recipe`'s per-element state, zeroed, steps a parameter as no state does (as a first step):
    Adam's moments, SGD's momentum without dampening do; SGD's with dampening does not (its first step takes
    the gradient whole). Probed on two throwaway one-element parameters like `like`, one fresh, one zeroed."""
    fresh, zeroed = (nn.Parameter(like.new_full((1,), 0.5)) for _ in range(2))
    with isolated_rng(like):
        first, second = (recipe.build_to_step([dict(options, params=[p])]) for p in (fresh, zeroed))
        zeroed.grad = torch.zeros_like(zeroed)
        recipe.step(second)
        with torch.no_grad():
            zeroed.fill_(0.5)
            for value in second.state[zeroed].values():
                if isinstance(value, torch.Tensor) and value.dim() == 1:
                    value.zero_()
        fresh.grad, zeroed.grad = (like.new_full((1,), 0.25) for _ in range(2))
        recipe.step(first)
        recipe.step(second)
    ours, theirs = first.state[fresh], second.state[zeroed]
    return (
        torch.equal(fresh, zeroed)
        and ours.keys() == theirs.keys()
        and all(torch.equal(ours[k], theirs[k]) for k in ours if isinstance(ours[k], torch.Tensor))
    )


def piece_states(
    pieces: list[Piece], live: Mapping[torch.Tensor, dict[str, Any]], spec: StateSpec
) -> list[dict[str, Any]]:
    """Each piece's state: the inner optimizer's where it has one, else zeros (and the
    spec's scalars) shaped as it would be."""
    states = []
    for piece in pieces:
        state = live.get(piece.param)
        if not state:  # (not stepped: a step count of 0 says so, see `saved_stepped`)
            state = {key: torch.zeros_like(piece.param.detach()) for key in spec.per_element}
            state.update({key: _copy(value) for key, value in spec.scalars.items()})
            if isinstance(state.get(STEP), torch.Tensor):
                state[STEP] = torch.zeros_like(state[STEP])
        if MASTER in spec.per_element:  # (a new dict: the optimizer's own keeps its keys)
            state = {**state, MASTER: piece.param.detach()}  # the master, saved and loaded in place
        states.append(state)
    return states


STEP = "step"  # the step count torch's optimizers (all but SGD) keep per parameter


def _copy(value: object) -> object:
    return value.clone() if isinstance(value, torch.Tensor) else value


def memory_order(param: torch.Tensor) -> list[int]:
    """The parameter's dimensions from the outermost in memory to the innermost (its slot's element order)."""
    strides = param.stride()
    return sorted(range(param.dim()), key=lambda d: (-strides[d], d))


@dataclass(frozen=True)
class Box:
    """A rectangle of a parameter (`offsets` and `sizes` per dimension) whose elements are
    one run of its slot, from element `start` in the slot's memory order."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def boxes(param: torch.Tensor, start: int, numel: int) -> list[Box]:
    """The run of `numel` elements from `start` in `param`'s memory order as rectangles of the parameter: at
    most 2N-1 for N dimensions (a partial row of each inner dimension at either end, whole rows between)."""
    order = memory_order(param)
    shape = [param.shape[d] for d in order]
    found = []
    for offsets, sizes in _rows(shape, start, start + numel):
        flat = sum(o * math.prod(shape[i + 1 :]) for i, o in enumerate(offsets))
        logical_offsets, logical_sizes = [0] * len(order), [0] * len(order)
        for i, d in enumerate(order):
            logical_offsets[d], logical_sizes[d] = offsets[i], sizes[i]
        found.append(Box(tuple(logical_offsets), tuple(logical_sizes), flat))
    return found


def _rows(shape: list[int], lo: int, hi: int) -> list[tuple[list[int], list[int]]]:
    """[lo, hi) of a row-major `shape` as (offsets, sizes) rectangles, each one run."""
    if lo >= hi:
        return []
    if not shape:
        return [([], [])]
    inner = math.prod(shape[1:])
    first, head = divmod(lo, inner)
    last, tail = divmod(hi, inner)
    if first == last:  # inside one row of the outer dimension
        return [([first, *o], [1, *n]) for o, n in _rows(shape[1:], head, tail)]
    found = []
    if head:
        found += [([first, *o], [1, *n]) for o, n in _rows(shape[1:], head, inner)]
        first += 1
    if first < last:
        found.append(([first] + [0] * (len(shape) - 1), [last - first, *shape[1:]]))
    if tail:
        found += [([last, *o], [1, *n]) for o, n in _rows(shape[1:], 0, tail)]
    return found


def _sharded_shape(param: torch.Tensor) -> torch.Tensor:
    """The parameter as its state is saved: its own shape (a 0-d one as one element, so
    that every rank can hold an empty shard of it)."""
    return param if param.dim() else param.view(1)


def _box_view(flat: torch.Tensor, first: int, box: Box, param: torch.Tensor) -> torch.Tensor:
    """`box` of a state whose elements `first`, `first + 1`, ... in `param`'s memory order are `flat`: a view
    shaped as the box (not contiguous where the memory order is not row-major)."""
    order = memory_order(param)
    run = flat.narrow(0, box.start - first, box.numel).view([box.sizes[d] for d in order])
    return run.permute(sorted(range(len(order)), key=order.__getitem__))


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
        extent = layout.extent(param)
        placed = [(c, box) for c in chunks for box in extent.boxes(c.offset, c.numel)]
        mine = [(c, box) for c, box in placed if c.rank == layout.rank]
        # Every rank holds a shard of every parameter's state, an empty one (past the end of the first
        # dimension: a shard is known by its offsets) where it has no elements: DCP drops a ShardedTensor
        # without local shards from a rank's plan, and then mistakes the checkpoint for an old-format one.
        held = {c.rank for c in chunks}
        size = extent.size
        end = Box((size[0],) + (0,) * (len(size) - 1), (0, *size[1:]), 0)
        ranks = layout.global_ranks
        extents = [(ranks[c.rank], box.offsets, box.sizes) for c, box in placed]
        extents += [(ranks[r], end.offsets, end.sizes) for r in range(layout.world_size) if r not in held]
        extents += layout.peers.get(id(param), [])
        # Scalars on every rank (each has a piece of the group, maybe empty, and the same values): the same
        # keys everywhere, as DCP expects; a copy each, so DCP loads each parameter's own (`misfit` compares).
        entry: dict[str, Any] = {key: _copy(states[0][key]) for key in spec.scalars}
        for key in spec.per_element:
            # (the state's dtype where a piece holds it, else the parameter's)
            dtype = next((s[key].dtype for s in states if isinstance(s.get(key), torch.Tensor)), param.dtype)
            local = [_local_view(c, pieces, states, key, box, extent).contiguous() for c, box in mine]
            local = local or [torch.empty(end.sizes, dtype=dtype, device=param.device)]
            group = process_group if id(param) not in layout.peers else None  # (the peers' ranks too)
            entry[key] = sharded_tensor(local, extents, size, dtype, group)
        out[name] = entry
    return out


def _local_view(
    chunk: Chunk, pieces: list[Piece], states: list[dict[str, Any]], key: str, box: Box, extent: Extent
) -> torch.Tensor:
    """`box` (inside `chunk`) of the state `key` of the piece holding `chunk`: a view."""
    for piece, state in zip(pieces, states):
        if piece.start <= chunk.start and chunk.start + chunk.numel <= piece.start + piece.param.numel():
            flat = state[key].narrow(0, chunk.start - piece.start, chunk.numel)
            return _box_view(flat, chunk.offset, box, extent.local)
    raise AssertionError(f"no piece holds the chunk at {chunk.start} (+{chunk.numel})")


def missing_state(
    layout: Layout, params: list[tuple[str, torch.Tensor]], saved: dict[str, Any], spec: StateSpec
) -> list[str]:
    """What this rank needs from `saved` (one group's per-parameter state) and does not find in it:
    parameter names and keys, for the error."""
    missing = []
    for name, param in params:
        chunks = layout.chunks(param)
        if not chunks:
            continue
        entry = saved.get(name)
        if not isinstance(entry, dict):
            missing.append(name)
            continue
        for key in (*spec.per_element, *spec.scalars):
            if key not in entry:
                missing.append(f"{name}[{key!r}]")
        extent = layout.extent(param)
        mine = [box for c in chunks if c.rank == layout.rank for box in extent.boxes(c.offset, c.numel)]
        for key in spec.per_element:
            if key in entry and not all(_covered(entry[key], box, extent.size) for box in mine):
                missing.append(f"{name}[{key!r}] (this rank's elements)")
    return missing


def _saved_parts(value: Any, size: tuple[int, ...]) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """(offsets, data) of the parts of a saved per-element state this rank holds: a ShardedTensor's local
    shards, what one became in ``torch.save`` (`SAVED_SHARDS`), or a whole tensor of the parameter's shape
    `size` (a plain optimizer's). Parts of another shape (another parameter) are left out."""
    if hasattr(value, "local_shards"):
        parts = [(tuple(s.metadata.shard_offsets), s.tensor) for s in value.local_shards()]
    elif isinstance(value, dict) and SAVED_SHARDS in value:
        parts = [(tuple(offsets), tensor) for offsets, tensor in value[SAVED_SHARDS]]
    elif isinstance(value, torch.Tensor) and value.numel() == math.prod(size):
        parts = [((0,) * len(size), value.view(size))]
    else:
        parts = []
    return [(o, t) for o, t in parts if len(o) == len(size) and t.dim() == len(size)]


def _overlaps(
    box: Box, value: object, size: tuple[int, ...]
) -> Iterator[tuple[tuple[slice, ...], torch.Tensor]]:
    """Where each part of a saved per-element state (`_saved_parts`) overlaps `box`: (index into the box,
    that piece of the part)."""
    for offsets, data in _saved_parts(value, size):
        lo = [max(a, b) for a, b in zip(box.offsets, offsets)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(box.offsets, box.sizes, offsets, data.shape)]
        if any(low >= high for low, high in zip(lo, hi)):
            continue
        into_box = tuple(slice(low - a, high - a) for low, high, a in zip(lo, hi, box.offsets))
        yield into_box, data[tuple(slice(low - b, high - b) for low, high, b in zip(lo, hi, offsets))]


def _covered(value: object, box: Box, size: tuple[int, ...]) -> bool:
    return sum(piece.numel() for _, piece in _overlaps(box, value, size)) == box.numel


def load_parameter_state(
    layout: Layout,
    params: list[tuple[str, torch.Tensor]],
    saved: dict[str, Any],
    pieces: list[Piece],
    states: list[dict[str, Any]],
    spec: StateSpec,
) -> None:
    """Copy one group's saved per-parameter state into `states` (its pieces'), once `missing_state` passed."""
    for name, param in params:
        extent = layout.extent(param)
        for chunk in (c for c in layout.chunks(param) if c.rank == layout.rank):
            for box in extent.boxes(chunk.offset, chunk.numel):
                for key in spec.per_element:
                    target = _local_view(chunk, pieces, states, key, box, extent)
                    _copy_box(target, box, saved[name][key], extent.size)
    scalars = next(saved[name] for name, param in params if layout.chunks(param))
    for state in states:
        state.update({key: _copy(scalars[key]) for key in spec.scalars})


def _copy_box(target: torch.Tensor, box: Box, saved: object, size: tuple[int, ...]) -> None:
    for into_box, source in _overlaps(box, saved, size):
        part = target[into_box]
        if part.data_ptr() != source.data_ptr() or part.stride() != source.stride():
            part.copy_(source)  # (loaded in place, it is the same memory)


# --- the class's own state form --------------------------------------------------------------

CLASS_STATE = "class_state"  # a ShardedOptimizer state's key for the state not of a parameter


def own_state(optimizer: torch.optim.Optimizer) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    """`optimizer`'s state as its class saves it (its own ``state_dict()``: the class's override and its hooks
    run), unpacked: each parameter's entry by id(param), and the rest (state under a key that is not a
    parameter, MADGRAD's ``k``; keys beside ``"state"`` and ``"param_groups"``), saved under `CLASS_STATE`.

    Raises:
        ValueError: The class's ``state_dict()`` is not torch's form (groups numbering
            their parameters as the optimizer holds them).
    """
    packed = optimizer.state_dict()
    ids = _packed_ids(optimizer, packed)
    entries = {ids[index]: entry for index, entry in packed["state"].items() if index in ids}
    rest: dict[str, Any] = {"state": {k: v for k, v in packed["state"].items() if k not in ids}}
    rest.update({key: value for key, value in packed.items() if key not in ("state", "param_groups")})
    return entries, rest


def _packed_ids(optimizer: torch.optim.Optimizer, packed: object) -> dict[object, int]:
    """index -> id(param) of `packed` (`optimizer`'s ``state_dict()``)."""
    packed = packed if isinstance(packed, dict) else {}
    groups = packed.get("param_groups")
    if (
        not isinstance(groups, list)
        or not isinstance(packed.get("state"), dict)
        or len(groups) != len(optimizer.param_groups)
        or any(len(g.get("params", ())) != len(o["params"]) for g, o in zip(groups, optimizer.param_groups))
    ):
        raise ValueError(
            f"ShardedOptimizer cannot save or load {type(optimizer).__name__}'s state: its "
            "state_dict() is not torch's form ({'state': {index: ...}, 'param_groups': [{..., "
            "'params': [index, ...]}]}, one group per param group)"
        )
    return {
        index: id(param)
        for group, own in zip(groups, optimizer.param_groups)
        for index, param in zip(group["params"], own["params"])
    }


def load_own_state(
    optimizer: torch.optim.Optimizer,
    entries: Mapping[int, dict[str, Any]],
    rest: object,
    saved_groups: list[dict[str, Any]],
) -> None:
    """Load `entries` (each parameter's state, by id(param)) and `rest` (`own_state`'s or None) through
    `optimizer`'s own ``load_state_dict`` (the class's override and hooks: it casts and places each value as
    for any checkpoint), with the options of `saved_groups` (one per group) over its groups' own."""
    state: dict[object, Any] = {}
    param_groups = []
    index = 0
    for group, saved in zip(optimizer.param_groups, saved_groups):
        chosen = {key: value for key, value in {**group, **saved}.items() if key != "params"}
        indices = []
        for param in group["params"]:
            if id(param) in entries:
                state[index] = entries[id(param)]
            indices.append(index)
            index += 1
        param_groups.append({**chosen, "params": indices})
    rest = rest if isinstance(rest, dict) else {}
    state.update(rest.get("state") or {})
    extra = {key: value for key, value in rest.items() if key != "state"}
    optimizer.load_state_dict({**extra, "state": state, "param_groups": param_groups})


# --- one optimizer's groups ----------------------------------------------------------------


@dataclass(frozen=True)
class GroupView:
    """One parameter group as the checkpoint sees it: its named parameters (those with a slot), its options
    and this rank's pieces of it."""

    params: list[tuple[str, torch.Tensor]]
    options: dict[str, Any]
    pieces: list[Piece]
    # Whether the pieces are float32 masters of bfloat16/float16 parameters (saved as per-element `MASTER`).
    masters: bool = False


MASTER = "master"


def group_spec(recipe: OptimizerRecipe, group: GroupView) -> StateSpec:
    """The state `group` saves per parameter: the optimizer's, and its masters if any."""
    like = group.pieces[0].param if group.pieces else group.params[0][1]
    spec = state_spec(recipe, group.options, like)
    if group.masters:
        return StateSpec((*spec.per_element, MASTER), spec.scalars)
    return spec


def optimizer_state(
    optimizer: torch.optim.Optimizer,
    recipe: OptimizerRecipe,
    groups: list[GroupView],
    layout: Layout,
    process_group: dist.ProcessGroup | None,
) -> dict[str, Any]:
    """The per-parameter form of `optimizer`'s state (from `recipe`) over `groups` (see the module notes),
    from the class's own ``state_dict()`` (`own_state`); state not of a parameter under `CLASS_STATE`."""
    entries, rest = own_state(optimizer)
    pieces = [piece.param for group in groups for piece in group.pieces]
    live: dict[torch.Tensor, dict[str, Any]] = {p: entries[id(p)] for p in pieces if id(p) in entries}
    state: dict[str, Any] = {}
    for group in groups:
        if group.params:
            spec = group_spec(recipe, group)
            states = piece_states(group.pieces, live, spec)
            state.update(parameter_state(layout, group.params, group.pieces, states, spec, process_group))
    param_groups = [{**group.options, "params": [name for name, _ in group.params]} for group in groups]
    return {"state": state, "param_groups": param_groups, CLASS_STATE: rest}


def whole_state(
    state: dict[str, dict[str, Any]], process_group: dist.ProcessGroup | None
) -> dict[str, dict[str, Any]]:
    """`state` (an `optimizer_state`'s ``"state"``) with each per-element ShardedTensor made whole on every
    rank: each element is in one rank's shards, so a sum over ranks of zeros holding this rank's shards is
    exact (one all-reduce per dtype and device). Scalars stay as they are (the same on every rank)."""
    whole: dict[str, dict[str, Any]] = {}
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for name, entry in state.items():
        whole[name] = dict(entry)
        for key, value in entry.items():
            if not hasattr(value, "local_shards"):
                continue
            shards = value.local_shards()
            properties = value.metadata().tensor_properties
            tensor = torch.zeros(value.size(), dtype=properties.dtype, device=shards[0].tensor.device)
            for shard in shards:
                meta = shard.metadata
                index = tuple(slice(o, o + n) for o, n in zip(meta.shard_offsets, meta.shard_sizes))
                tensor[index] = shard.tensor
            whole[name][key] = tensor
            by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for tensors in by_kind.values():
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, group=process_group)
        for tensor, summed in zip(tensors, flat.split([t.numel() for t in tensors])):
            tensor.copy_(summed.view(tensor.shape))
    return whole


def saved_stepped(groups: list[GroupView], saved: dict[str, Any]) -> list[bool]:
    """Whether each group's saved state is that of an optimizer that stepped, as a parameter's says (not
    `never_stepped`)."""
    state = saved["state"]
    return [any(not never_stepped(state[n]) for n, _ in group.params if n in state) for group in groups]


def never_stepped(entry: object) -> bool:
    """Whether a parameter's saved state says its optimizer never stepped: a step count of 0 (torch's
    optimizers keep no state then), or no state at all (a group added and not stepped since; SGD without
    momentum, which has none to load); one without a count, SGD with momentum, loads its state otherwise."""
    if isinstance(entry, dict) and not entry:
        return True
    step = entry.get(STEP) if isinstance(entry, dict) else None
    return step is not None and float(step) == 0


def misfit(recipe: OptimizerRecipe, groups: list[GroupView], layout: Layout, saved: object) -> str | None:
    """What keeps `saved` from loading on this rank; None when it fits."""
    if not isinstance(saved, dict) or not {"state", "param_groups"} <= saved.keys():
        return "not an optimizer state keyed by parameter names (ShardedOptimizer.state_dict())"
    names = [[name for name, _ in group.params] for group in groups]
    saved_names = [list(group.get("params", ())) for group in saved["param_groups"]]
    if saved_names != names:
        return "its parameter groups hold other parameters (another model or grouping)"
    for group, stepped in zip(groups, saved_stepped(groups, saved)):
        if stepped and group.params:
            spec = group_spec(recipe, group)
            missing = missing_state(layout, group.params, saved["state"], spec)
            if missing:
                return f"no state for {missing[:4]}"
            entries = {n: saved["state"].get(n, {}) for n, _ in group.params}
            steps = {n: float(entry[STEP]) for n, entry in entries.items() if STEP in entry}
            if STEP in spec.scalars and len(set(steps.values())) > 1:  # (a parameter parked when saved)
                return (
                    f"a param group would hold parameters with different step counts ({by_count(steps)}); "
                    f"{recipe.name} counts steps per parameter, ShardedOptimizer per group: freeze "
                    "what was frozen when saved before loading"
                )
    return None


def flagged_ranks(flag: bool, device: torch.device, process_group: dist.ProcessGroup | None) -> list[int]:
    """The `process_group` ranks whose `flag` is set (one small all-reduce; all ranks call it together)."""
    world_size, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
    flags = torch.zeros(world_size, dtype=torch.int32, device=device)
    flags[rank] = int(flag)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=process_group)
    return [r for r, flagged in enumerate(flags.tolist()) if flagged]


def refuse_misfits(
    problem: str | None, device: torch.device, process_group: dist.ProcessGroup | None
) -> None:
    """Raise the same ValueError on every rank when `problem` (this rank's `misfit`) or any other rank's is
    not None (one small all-reduce): no rank loads a state that does not fit on every rank."""
    rank = dist.get_rank(process_group)
    wrong = flagged_ranks(problem is not None, device, process_group)
    if wrong:
        mine = f" (this rank {rank}: {problem})" if problem is not None else ""
        raise ValueError(
            f"ShardedOptimizer state given to rank(s) {wrong} does not fit{mine}; save and load "
            "it with torch.distributed.checkpoint (dcp.save({'optim': opt}, ...), any world "
            "size), or torch.save each rank's own state and load it on that rank"
        )


def load_group(
    recipe: OptimizerRecipe,
    group: GroupView,
    layout: Layout,
    saved: dict[str, Any],
    stepped: bool,
    live: Mapping[torch.Tensor, dict[str, Any]],
) -> dict[int, dict[str, Any]]:
    """`group`'s pieces' states from `saved` (which `misfit` accepted), by id(piece), for the class's own
    ``load_state_dict`` (`load_own_state`): written into the state the pieces hold now (`live`, the class's
    own form of it) or into zeros; a group saved before it stepped gets a fresh optimizer's state (`recipe`'s:
    Adagrad's holds its initial accumulator). The masters are loaded into the pieces themselves."""
    if not group.params or not group.pieces:
        return {}
    if not stepped:
        fresh = recipe.build([dict(group.options, params=[p.param for p in group.pieces])])
        return {id(p.param): fresh.state[p.param] for p in group.pieces if fresh.state.get(p.param)}
    spec = group_spec(recipe, group)
    states = piece_states(group.pieces, live, spec)
    load_parameter_state(layout, group.params, saved, group.pieces, states, spec)
    for state in states:
        state.pop(MASTER, None)  # (loaded into the piece itself)
    return {id(piece.param): state for piece, state in zip(group.pieces, states)}
