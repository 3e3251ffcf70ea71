"""ZeRO-1 by whole tensors, for a ShardedOptimizer with ``shard_by="tensor"`` (see `flatgrad._sharded`).

The backward all-reduces every bucket, so every `.grad` stays whole and readable. Each rank owns a contiguous
run of slots of each flat parameter buffer (`own_runs`), steps and keeps state for those parameters only, then
broadcasts its runs: at most world_size + (buffers - 1) broadcasts, each of one contiguous run
(`TensorEngine.launch_gather`); Megatron-Core's layer-wise optimizer for Muon shards so too. Which optimizers
need it, the cut and torch's ZeroRedundancyOptimizer: docs/data-parallel.md, "Optimizers that update whole
tensors"; why these collectives: docs/performance.md.

`TensorGroups` is the inner torch optimizer, over stand-ins of the owned parameters (`nn.Parameter`s sharing
each parameter's memory and shape) with one inner group per group of `param_groups`, kept in step with them as
`flatgrad._zero.PieceGroups` keeps its pieces; its state is saved per parameter name, whole, by the rank that
owns it (``torch.distributed.checkpoint`` loads it on any world size)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flatgrad._buffer import GradStore
from flatgrad._layout import GroupKey, merge_touching
from flatgrad._torch_compat import broadcast_coalesced
from flatgrad._zero import FlatParameters, InnerGroups, StoreSource, options, retake_master, unscale_shards
from flatgrad._zero_state import (
    CLASS_STATE,
    MASTER,
    STEP,
    OptimizerRecipe,
    load_own_state,
    never_stepped,
    own_state,
    refuse_misfits,
)


@dataclass(frozen=True)
class Run:
    """One rank's run of one flat parameter buffer: [start, end) holds whole slots (and the padding after
    each) of the parameters that rank owns."""

    key: GroupKey
    start: int
    end: int
    rank: int


def own_runs(store: GradStore, world_size: int, members: set[int]) -> tuple[dict[int, int], list[Run]]:
    """Owners of `store`'s parameters in `members` (the optimizer's ids), and the runs each rank broadcasts.
    Taking the buffers in turn, their slots in buffer order, a member goes to the rank whose 1/world_size of
    all members' elements holds its middle element, so owners only grow along it, each rank within a parameter
    of 1/world_size of the elements. A run is a stretch of one rank's member slots (each with its padding)
    with no other slot between: one run per rank and buffer when the optimizer holds every parameter, more
    where another optimizer's parameters (Muon's matrices beside AdamW's vectors) lie between."""
    order = [
        (key, store.slot(p)[1].offset, p)
        for key in store.buffers
        for p in sorted(
            (p for p in store.params if store.slot(p)[0] == key), key=lambda p: store.slot(p)[1].offset
        )
    ]
    total = max(1, sum(p.numel() for _, _, p in order if id(p) in members))
    owners: dict[int, int] = {}
    spans: dict[tuple[GroupKey, int], list[tuple[int, int]]] = {}  # (buffer, rank) -> slot spans
    position = 0
    for index, (key, offset, param) in enumerate(order):
        if id(param) not in members:
            continue
        rank = min(world_size - 1, (2 * position + param.numel()) * world_size // (2 * total))
        owners[id(param)] = rank
        position += param.numel()
        following = order[index + 1] if index + 1 < len(order) else None
        end = following[1] if following is not None and following[0] == key else store.buffers[key].numel()
        spans.setdefault((key, rank), []).append((offset, end))
    runs = [
        Run(key, start, end, rank)
        for (key, rank), found in spans.items()
        for start, end in merge_touching(found)
    ]
    return owners, runs


class TensorEngine(FlatParameters):
    """The flat parameter buffers (`flatgrad._zero.FlatParameters`), which parameters this rank owns, and the
    broadcasts that bring every rank's updated parameters to the others."""

    def __init__(
        self,
        store: GradStore,
        process_group: dist.ProcessGroup | None,
        members: set[int],
        companion: bool,
    ) -> None:
        super().__init__(store, process_group, companion)
        # The model's gradient store now: `store` (the flat parameter buffers' layout) until parameters are
        # frozen or unfrozen, then replicate's new one (`follow`); buffers, owners and runs stay.
        self.grads = store
        self.owners: dict[int, int] = {}  # id(param) -> the rank that steps it
        self.runs_by_rank: list[list[torch.Tensor]] = [[] for _ in range(self.world_size)]
        self.in_flight: list[Any] = []  # the broadcasts of the last step still in flight
        self.add_members(members)

    def add_members(self, members: set[int]) -> None:
        """Give the parameters `members` (ids; none owned yet: a param group added later) owners and runs of
        their own, balanced among themselves (`own_runs`): owned parameters stay with their state."""
        owners, runs = own_runs(self.store, self.world_size, members - self.owners.keys())
        self.owners.update(owners)
        for run in runs:
            buffer = self.param_buffers[run.key]
            self.runs_by_rank[run.rank].append(buffer.narrow(0, run.start, run.end - run.start))

    def follow(self, store: GradStore, stores: StoreSource) -> None:
        """Take `store`, the model's gradient store now, differing from the layout's only by parameters frozen
        or unfrozen since (GAN-style toggling, progressive freezing): a frozen parameter keeps its slot, owner
        and optimizer state and is stepped only with a `.grad` (as by a plain optimizer); unfrozen, it steps
        on from that state. Nothing moves; O(parameters) per new store. A parameter added or replaced since,
        or unfrozen after being frozen at construction (no slot), raises RuntimeError."""
        if store is self.grads:
            return
        laid_out = {id(p) for p in self.store.params}
        now = {id(p) for p in store.params}
        in_model = now | {id(p) for p in stores.others}
        if not now <= laid_out or not laid_out <= in_model:
            raise RuntimeError(
                "the model's parameters changed (added, replaced, or unfrozen where they were "
                "frozen when the ShardedOptimizer was built) after it was built: by tensor they have no "
                "place in its flat parameter buffers; shard by element (it follows a layer unfrozen "
                "later: Lightning's BackboneFinetuning under FlatGradShardedStrategy()), or build "
                "replicate and ShardedOptimizer again (parameters frozen or unfrozen after construction "
                "are followed)"
            )
        self.grads = store

    def owns(self, param: torch.Tensor) -> bool:
        """Whether this rank steps `param` (a parameter of the store)."""
        return self.owners.get(id(param)) == self.rank

    def grad_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """What `param` steps from: its `.grad` (a frozen parameter's too: torch's
        optimizers step any parameter with one); for a bfloat16/float16 parameter with a main
        grad, that float32 slot where it holds a gradient (`GradStore.has_main`)."""
        grads = self.grads
        if param not in grads or not grads.is_main(param):
            return param.grad
        return grads.view(param) if grads.has_main(param) else None

    def has_grads(self) -> bool:
        """Whether a step has gradients to use: a parameter of this optimizer has one
        (`grad_of`; the same answer on every rank: a synchronised backward sets them alike)."""
        return any(self.grad_of(p) is not None for p in self.store.params if id(p) in self.owners)

    def take_assigned_grads(self) -> None:
        """Nothing to take: the stand-ins step from each parameter's `.grad` as it is."""

    def unscale_(self, inv_scale: torch.Tensor, found_inf: torch.Tensor | None, allow_fp16: bool) -> None:
        """Multiply this optimizer's gradients by `inv_scale` (only its own: a second ShardedOptimizer over
        the model unscales the others, as a loss scaler unscales each torch optimizer's); with `found_inf`,
        set it to 1.0 where any of them holds an inf or NaN (every rank holds all of them, averaged: the small
        all-reduce of `unscale_shards` only keeps the ranks in step)."""
        grads = [g for p in self.store.params if id(p) in self.owners and (g := self.grad_of(p)) is not None]
        if grads:
            tensor_parallel = self.store.tensor_parallel
            unscale_shards(grads, inv_scale, found_inf, allow_fp16, self.process_group, tensor_parallel)

    def launch_gather(self) -> None:
        """Broadcast every rank's runs of the flat parameter buffers from it, in the parameters' dtype: a
        rank's one run (the optimizer holds every parameter) as it lies, asynchronously (`wait_gather`
        finishes it); several runs (another optimizer's parameters between) coalesced into one broadcast per
        dtype and ~250 MiB (DDP's `_broadcast_coalesced`: a copy in and out, not one collective per run)."""
        self.wait_gather()
        group = self.process_group
        for rank, runs in enumerate(self.runs_by_rank):
            if len(runs) == 1:
                src = self.global_ranks[rank]  # (dist.broadcast takes a global rank)
                self.in_flight.append(dist.broadcast(runs[0], src=src, group=group, async_op=True))
            elif runs:
                broadcast_coalesced(group, runs, rank)  # (a rank of the group)

    def wait_gather(self, indices: tuple[int, ...] | None = None) -> None:
        """Wait for the broadcasts `launch_gather` started: every parameter is whole afterwards (on CUDA: for
        work queued on the current stream from now on). `indices` (the element path's buckets) is accepted for
        the same call and ignored: all are waited for."""
        for work in self.in_flight:
            work.wait()
        self.in_flight = []


class TensorGroups(InnerGroups):
    """The inner optimizer (`inner`) over stand-ins of the parameters this rank owns, one inner group per
    group of `param_groups` (empty where it owns none of the group; see `InnerGroups`). `names` maps id(param)
    to the plain parameter name (the checkpoint's keys)."""

    how_to_add = "which gives each its owner rank; the inner optimizer holds this rank's parameters only"

    def __init__(
        self,
        engine: TensorEngine,
        names: dict[int, str],
        recipe: OptimizerRecipe,
        param_groups: list[dict[str, Any]],
    ) -> None:
        self.engine = engine
        self.names = names
        self.recipe = recipe
        self.stand_ins: dict[int, nn.Parameter] = {}  # id(param) -> its stand-in
        self.owned: list[list[torch.Tensor]] = []  # per group: the parameters this rank steps
        self.unplaced: list[torch.Tensor] = []  # the groups' parameters frozen at construction (no slot)
        # The owned parameters with float32 masters, and their version counters when the masters last matched
        # them (a write since, a model load_state_dict, is taken into the master: `take_masters`).
        self.masters: list[torch.Tensor] = []
        self._versions: dict[int, int] = {}
        self.inner = recipe.build([self._inner_group(group) for group in param_groups])
        self.hold(param_groups, self.stand_in_ids)

    def _inner_group(self, group: dict[str, Any]) -> dict[str, Any]:
        owned = [p for p in group["params"] if p in self.engine.store and self.engine.owns(p)]
        self.owned.append(owned)
        self.unplaced += [p for p in group["params"] if p not in self.engine.store]
        for param in owned:
            master = self.engine.store.is_main(param)
            # What the inner optimizer steps: a leaf sharing the parameter's memory, shape and version
            # counter, so the update lands in it as a plain optimizer's would; or, for a bfloat16/float16
            # parameter with a main grad, its float32 master, which `write_back` rounds into it.
            self.stand_ins[id(param)] = nn.Parameter(param.detach().float() if master else param.detach())
            if master:
                self.masters.append(param)
                self._versions[id(param)] = param._version
        return {**options(group), "params": [self.stand_ins[id(p)] for p in owned]}

    def stand_in_ids(self) -> set[int]:
        """The ids of the stand-ins: what the inner optimizer may hold."""
        return {id(s) for s in self.stand_ins.values()}

    def add(self, group: dict[str, Any], param_groups: list[dict[str, Any]]) -> None:
        """The inner group for `group`, just added to `param_groups` (its parameters get owners first)."""
        self.engine.add_members({id(p) for p in group["params"]})
        torch.optim.Optimizer.add_param_group(self.inner, self._inner_group(group))
        self.added(group, param_groups)

    def point_grads(self) -> None:
        """Each stand-in's `.grad`: its parameter's (`TensorEngine.grad_of`; None: skipped). Raises
        RuntimeError, before anything moves, for a parameter frozen at construction that has a `.grad`."""
        graded = [self.names[id(p)] for p in self.unplaced if p.grad is not None]
        if graded:  # (unfrozen for a backward since, and frozen again: a torch optimizer steps it)
            raise RuntimeError(
                f"parameters frozen when the ShardedOptimizer (by tensor) was built have a .grad: "
                f"{', '.join(graded[:3])}{' ...' if len(graded) > 3 else ''} (unfrozen for a backward "
                "since); they have no place in its flat parameter buffers, so it cannot step them as a torch "
                "optimizer would: shard by element, or build replicate and ShardedOptimizer again with them "
                "trainable (freezing later is followed)"
            )
        for owned in self.owned:
            for param in owned:
                stand_in, grad = self.stand_ins[id(param)], self.engine.grad_of(param)
                # (a float32 master steps from a float32 gradient: a main grad, or the .grad
                # in the parameter's dtype that freezing left a parameter with one)
                stand_in.grad = grad if grad is None else grad.to(stand_in.dtype)

    def take_masters(self) -> None:
        """Before a step: a master whose parameter was written since (a model load_state_dict, a copy under
        no_grad) takes the parameter's value where it no longer rounds to it (exactly: the cast up is exact);
        a master loaded from the same checkpoint as the parameter is kept."""
        with torch.no_grad():
            for param in self.masters:
                if param._version != self._versions[id(param)]:
                    retake_master(self.stand_ins[id(param)], param)
                    self._versions[id(param)] = param._version

    def write_back(self) -> None:
        """After a step: the masters into their parameters (rounded to nearest), before the broadcasts."""
        with torch.no_grad():
            for param in self.masters:
                param.copy_(self.stand_ins[id(param)])
                self._versions[id(param)] = param._version

    def drop_grads(self) -> None:
        """Drop the stand-ins' `.grad` (zero_grad)."""
        for stand_in in self.stand_ins.values():
            stand_in.grad = None

    def state_dict(self, param_groups: list[dict[str, Any]]) -> dict[str, Any]:
        """This rank's parameters' state, whole, by name, as the class's own ``state_dict()`` gives it
        (`own_state`; a parameter not stepped yet: zeros shaped as one step's state, step count 0, so
        ``torch.distributed.checkpoint`` has a tensor to load into); every group's options with all its
        parameter names (alike on every rank); the class's non-parameter state under `CLASS_STATE`."""
        entries, rest = own_state(self.inner)
        state: dict[str, Any] = {}
        for group, owned in zip(self.inner.param_groups, self.owned):
            for param in owned:
                stand_in = self.stand_ins[id(param)]
                entry = entries.get(id(stand_in))
                if not entry or not self.stepped:  # (a state its constructor made, SPAM's mask: a step's too)
                    entry = {**_unstepped_state(self.recipe, options(group), stand_in), **(entry or {})}
                state[self.names[id(param)]] = dict(entry)
                if stand_in.dtype != param.dtype:  # (a float32 master: saved and loaded in place)
                    state[self.names[id(param)]][MASTER] = stand_in.detach()
        groups = [
            {**options(group), "params": [self.names[id(p)] for p in group["params"]]}
            for group in param_groups
        ]
        return {"state": state, "param_groups": groups, CLASS_STATE: rest}

    def load_state_dict(self, param_groups: list[dict[str, Any]], state_dict: dict[str, Any]) -> None:
        """Load `state_dict` (a ShardedOptimizer's of the same groups, on any world size through
        torch.distributed.checkpoint, or this rank's own) into the inner optimizer, through its class's own
        ``load_state_dict`` (`load_own_state`), and the groups' options, after every rank found it fits
        (`refuse_misfits`). A saved step count of 0 (never stepped) loads as a fresh optimizer's state."""
        try:
            problem = self._misfit(param_groups, state_dict)
        except (TypeError, KeyError, AttributeError, ValueError) as error:  # (each rank must reach the check)
            problem = f"not a ShardedOptimizer state ({type(error).__name__}: {error})"
        device = next(iter(self.engine.param_buffers.values())).device
        refuse_misfits(problem, device, self.engine.process_group)
        entries: dict[int, dict[str, Any]] = {}
        for inner, saved, owned in zip(self.inner.param_groups, state_dict["param_groups"], self.owned):
            for param in owned:
                stand_in = self.stand_ins[id(param)]
                entry = state_dict["state"].get(self.names[id(param)])
                if isinstance(entry, dict) and MASTER in entry and stand_in.dtype != param.dtype:
                    with torch.no_grad():
                        stand_in.copy_(entry[MASTER])
                    self._versions[id(param)] = param._version
                    entry = {key: value for key, value in entry.items() if key != MASTER}
                if entry is None or never_stepped(entry):
                    fresh = self.recipe.build([{**options(inner), **options(saved), "params": [stand_in]}])
                    entry = fresh.state.get(stand_in)  # (Adagrad's initial accumulator)
                if entry:
                    entries[id(stand_in)] = dict(entry)
        load_own_state(self.inner, entries, state_dict.get(CLASS_STATE), state_dict["param_groups"])
        self.options.loaded(param_groups, self.inner)

    def _misfit(self, param_groups: list[dict[str, Any]], saved: object) -> str | None:
        """What keeps `saved` from loading on this rank; None when it fits."""
        if not isinstance(saved, dict) or not {"state", "param_groups"} <= saved.keys():
            return "not an optimizer state keyed by parameter names (ShardedOptimizer.state_dict())"
        names = [[self.names[id(p)] for p in group["params"]] for group in param_groups]
        if [list(group.get("params", ())) for group in saved["param_groups"]] != names:
            return "its parameter groups hold other parameters (another model or grouping)"
        for group_names, owned in zip(names, self.owned):
            entries = [saved["state"][n] for n in group_names if n in saved["state"]]
            if not entries or all(never_stepped(e) for e in entries):
                continue  # (a group that never stepped: fresh)
            missing = [self.names[id(p)] for p in owned if self.names[id(p)] not in saved["state"]]
            if missing:
                return f"no state for {missing[:4]}"
        return None


def _unstepped_state(
    recipe: OptimizerRecipe, group_options: dict[str, Any], stand_in: torch.Tensor
) -> dict[str, Any]:
    """The state of a parameter not stepped yet, for a checkpoint to load into: what one step of `recipe`'s
    optimizer with a zero gradient makes on a throwaway copy of it. With a step count, every tensor zeroed and
    the count 0 (which says "never stepped": it loads as fresh state); without one (Muon's momentum,
    schedule-free's ``z``, a copy of the parameter), the values that step left, as a fresh optimizer's."""
    dummy = nn.Parameter(stand_in.detach().clone())
    dummy.grad = torch.zeros_like(dummy)
    probe = recipe.build_to_step([{**group_options, "params": [dummy]}])
    recipe.step(probe)
    state = probe.state.get(dummy, {})
    if STEP not in state:
        return dict(state)
    return {
        key: torch.zeros_like(value) if isinstance(value, torch.Tensor) else value
        for key, value in state.items()
    }
