"""ZeRO-1 for a `ShardedOptimizer` (`flatgrad._sharded`): this rank's engine, shard collectives, param groups.

`ShardEngine`, over replicate's buckets: flat parameter buffers, its shards, the pieces the inner optimizer
steps, the clip over shards, the parameter all-gather and the hooks awaiting it (``overlap_param_gather``).
Free functions over this rank's gradient shards (`runs_in_shards`, `clip_shards`, `unscale_shards`): each
element's average lives in exactly one rank's shard, so one scalar all-reduce covers every gradient.
The optimizer's arguments checked (`as_groups`, `checked_defaults`, ...), and `PieceGroups`, the inner torch
optimizer with one group per `param_groups` group over 1-D pieces of the flat parameter buffer, kept in step.
Design: docs/design.md, "ShardedOptimizer"."""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from flatgrad import _norms
from flatgrad._buffer import GradStore, host_tensor, scale_
from flatgrad._comm import BackendPolicy, all_gather_flat
from flatgrad._dtensor import TensorParallel, is_sharded, local_of, move_into, shard_origin
from flatgrad._layout import GroupKey, merge_touching, overlap
from flatgrad._scattered_grad import is_scattered, replaced_by_hand, unguarded, unmark_scattered
from flatgrad._torch_compat import non_finite_check_and_unscale
from flatgrad._zero_state import (
    CLASS_STATE,
    MASTER,
    STEP,
    GroupView,
    Layout,
    OptimizerRecipe,
    Piece,
    by_count,
    flagged_ranks,
    group_spec,
    load_group,
    load_own_state,
    misfit,
    optimizer_state,
    own_state,
    refuse_misfits,
    saved_stepped,
    state_spec,
    zeros_start_fresh,
)


class StoreSource(Protocol):
    """What lays the model's gradient buffers out (its `FlatGrad` engine): the current store,
    cheaply when nothing changed (`steady`) or after a full check (`refresh`)."""

    store: GradStore | None
    others: tuple[nn.Parameter, ...]  # the model's parameters without a slot (frozen, sparse)

    def steady(self) -> GradStore: ...

    def refresh(self) -> GradStore: ...


@dataclass(frozen=True)
class Shard:
    """This rank's shard of one bucket."""

    param: torch.Tensor  # of the flat parameter buffer
    grad: torch.Tensor  # the same elements of the gradient buffer
    bucket: torch.Tensor  # the whole bucket of the flat parameter buffer (all-gather output)
    # With main grads (bfloat16/float16 parameters, float32 gradients): a float32 copy of `param` the
    # optimizer steps, cast back into `param` after each step.
    master: torch.Tensor | None = None

    @property
    def stepped(self) -> torch.Tensor:
        """What the inner optimizer steps: the float32 master, or the parameters themselves."""
        return self.param if self.master is None else self.master


class FlatParameters:
    """The flat parameter buffers of a ShardedOptimizer, laid out like `store`'s gradient buffers (every
    parameter a view of its slot: `flat_parameters`), over `process_group`; what both kinds of shard plan
    (`ShardEngine`, by element; `flatgrad._zero_tensor. TensorEngine`, by tensor) do with them alike."""

    def __init__(
        self, store: GradStore, process_group: dist.ProcessGroup | None, companion: bool = False
    ) -> None:
        self.store = store
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.global_ranks = tuple(
            dist.get_global_rank(process_group, r) if process_group is not None else r
            for r in range(self.world_size)
        )
        # (`companion`: another ShardedOptimizer over the same model steps its flat buffers)
        self.param_buffers = flat_parameters(store, reuse_only=companion)
        self._addresses = list(map(_data_ptr, store.params))  # (see `params_in_place`)

    def params_in_place(self) -> bool:
        """Whether every parameter still lies in its slot of the flat parameter buffers (a
        dtype or device conversion, or ``param.data = ...``, gives it other memory)."""
        return list(map(_data_ptr, self.store.params)) == self._addresses

    def check_layout(self, stores: StoreSource) -> None:
        """Raise RuntimeError where the parameters changed since construction in a way `follow` does not take
        (`stores`: the model's gradient engine), as they are views of the flat buffer the gather refills. A
        data pointer per parameter and the engine's O(1) checks stand for its full walk."""
        # A change moves the reduce-scattered .grads (and is refused just below).
        in_place = self.params_in_place()
        with unguarded(self.store, stores.store):
            store = stores.steady() if in_place else stores.refresh()
        self.follow(store, stores)
        if not in_place:  # (the same layout, but a parameter's memory is not its slot's any more)
            raise RuntimeError(
                "a parameter's memory was replaced (param.data = ...) after the ShardedOptimizer "
                "was built: the optimizer steps, and gathers into, the flat parameter buffer its "
                "slot is in, so the parameter would not move; write into it instead "
                "(with torch.no_grad(): param.copy_(value)), or build replicate and "
                "ShardedOptimizer again"
            )

    def follow(self, store: GradStore, stores: StoreSource) -> None:
        """Take `store` (the model's store now) or raise RuntimeError for any other than the
        layout's (by element, the caller lays out again where parameters were only (un)frozen)."""
        if store is not self.store:
            raise RuntimeError(
                "the model's parameters changed (added, replaced, frozen, converted) after ShardedOptimizer "
                "was built, or were unfrozen between its synchronised backward and step() (do that before "
                "the forward or after step()); otherwise build replicate and ShardedOptimizer again"
            )

    def unscale_(self, inv_scale: torch.Tensor, found_inf: torch.Tensor | None, allow_fp16: bool) -> None:
        """Scale this rank's step gradients by `inv_scale`; `found_inf`: 1.0 if any rank's hold inf/NaN."""
        raise NotImplementedError

    def skip_or_unscale(self, found_inf: torch.Tensor | None, grad_scale: torch.Tensor | None) -> bool:
        """What a step under ``GradScaler.step`` does (the scaler's `found_inf` and `grad_scale`, as handed to
        an optimizer that scales itself; None outside one): skip (True) after an inf or NaN on any rank, every
        rank alike; otherwise unscale unless ``scaler.unscale_`` did already (`grad_scale` None)."""
        if found_inf is None:  # (not under scaler.step)
            return False
        if not isinstance(found_inf, torch.Tensor):  # (no inf check ran: torch's own scaler)
            raise TypeError(
                "torch.amp.GradScaler cannot unscale or check a ShardedOptimizer's gradients "
                "(they are averaged in this rank's shards only, and main grads have no .grad): "
                "use flatgrad.GradScaler, a torch.amp.GradScaler that does"
            )
        if bool(found_inf.item()):
            return True
        if grad_scale is not None:
            self.unscale_(grad_scale.double().reciprocal().float(), None, allow_fp16=True)
        return False


class ShardEngine(FlatParameters):
    """`FlatParameters` and this rank's `Shard` of each piece of the shard plan (`bucket_views` from
    `BucketSync.shard_plan`: buckets or whole buffers, as (gradient view, offset in its flat buffer))."""

    def __init__(
        self,
        store: GradStore,
        bucket_views: list[tuple[torch.Tensor, int]],
        process_group: dist.ProcessGroup | None,
        policy: BackendPolicy,
    ) -> None:
        super().__init__(store, process_group)
        self.bucket_views = bucket_views
        self.shards = self._cut_shards()
        self.grad_shards = [shard.grad for shard in self.shards]  # this rank's gradient shards
        self.grad_runs = runs_in_shards(store, self.grad_shards)  # (clipping)
        # The groups a clip norm all-reduces over: dp's, and with DTensor parameters the mesh's,
        # its norm then reading only the runs of the shards this rank counts (`norm_pieces`).
        tensor_parallel = store.tensor_parallel
        self.norm_groups = [process_group] + ([tensor_parallel.group] if tensor_parallel is not None else [])
        counted = store.norm_pieces() if tensor_parallel is not None else None
        self.counted_runs = None if counted is None else runs_in_shards(store, self.grad_shards, counted)
        # The parameters' version counters when the masters last matched them (`take_masters`).
        self._versions = self._param_versions()
        self.layout = self._chunk_layout()
        # bucket index -> the works of its parameter gather still in flight
        self.in_flight: dict[int, list[Any]] = {}
        self.gather_by_broadcast = not policy.all_gather  # (gloo: see `BackendPolicy`)
        self.waited: list[int] = []  # this step's buckets, in the order their gathers were waited for

    def _cut_shards(self) -> list[Shard]:
        shards = []
        for view, start in self.bucket_views:
            size = view.numel() // self.world_size
            params = self.param_buffers[(view.dtype, view.device)].narrow(0, start, view.numel())
            shard = params.narrow(0, self.rank * size, size)  # shares the memory
            master = shard.float() if shard.dtype != view.dtype else None  # (a copy)
            shards.append(Shard(shard, view.narrow(0, self.rank * size, size), params, master))
        return shards

    def has_grads(self) -> bool:
        """Whether a step has gradients: a parameter has a `.grad` (reduce-scattered ones are ScatteredGrads),
        or main grads were reduce-scattered into since flatgrad's last zeroing (they have no `.grad`). Every
        rank answers alike (a sync sets `.grad` on all) without a collective: a rank that skipped its backward
        must not meet the others' backward with one; its next backward refuses (`Round._check_round`)."""
        store = self.store
        return any(p.grad is not None for p in store.params) or (is_scattered(store) and bool(store.mains))

    def take_assigned_grads(self) -> None:
        """Before a step with no synchronised backward since the last zeroing: each `.grad` assigned by hand
        (``p.grad = g``) is copied into its slot, which the shards read; a parameter without one has its slot
        zeroed (left unstepped on this rank: `PieceGroups.step`); after one, a reduce-scattered `.grad`
        replaced by hand alike (stock steps with the replacement). Unaveraged, as torch's
        ZeroRedundancyOptimizer steps its partition."""
        store = self.store
        if is_scattered(store):
            store.take_in(replaced_by_hand(store))  # (none in the usual step)
        elif any(p.grad is not None for p in store.params):
            store.take_in(store.params, zero_empty=True)

    @property
    def has_masters(self) -> bool:
        """Whether the optimizer steps float32 masters of bfloat16/float16 parameters."""
        return any(shard.master is not None for shard in self.shards)

    def _param_versions(self) -> list[int]:
        # A write through a parameter (copy_ under no_grad, load_state_dict, torch.distributed.checkpoint's
        # load into its detached alias) bumps its counter; the all-gather's into the flat buffers does not.
        return list(map(_version, self.store.params))

    def take_masters(self) -> None:
        """Before a step, where the parameters were written since the masters last matched them (a model
        load_state_dict, a copy under no_grad): `retake_master` on every shard; one version read per parameter
        otherwise. (A write through ``param.data`` has its own version counter, unseen.)"""
        if not self.has_masters or self._param_versions() == self._versions:
            return
        with torch.no_grad():
            for shard in self.shards:
                if shard.master is not None:
                    retake_master(shard.master, shard.param)
        self._versions = self._param_versions()

    def write_back(self) -> None:
        """After a step: the masters into the parameters (rounded to nearest), before the all-gather."""
        if not self.has_masters:
            return
        with torch.no_grad():
            for shard in self.shards:
                if shard.master is not None:
                    shard.param.copy_(shard.master)

    def _chunk_layout(self) -> Layout:
        buckets: dict[Any, list[tuple[int, int]]] = {}
        for view, start in self.bucket_views:
            buckets.setdefault((view.dtype, view.device), []).append((start, view.numel()))
        slots, origins = {}, {}
        for param in self.store.params:
            key, slot = self.store.slot(param)
            slots[id(param)] = (key, slot.offset, slot.numel)
            origin = shard_origin(param)
            if origin is not None:
                origins[id(param)] = origin
        layout = Layout(self.world_size, self.rank, self.global_ranks, buckets, slots, origins)
        return tensor_parallel_layout(layout, self.store)

    def pieces(self, params: list[torch.Tensor]) -> list[Piece]:
        """This rank's pieces of `params`: the runs of their slots (each with its padding) in its shards."""
        runs = {key: _runs(self.store, key, {id(p) for p in params}) for key in self.store.buffers}
        pieces = []
        for (view, start), shard in zip(self.bucket_views, self.shards):
            key = (view.dtype, view.device)
            size = view.numel() // self.world_size
            lo = start + self.rank * size
            for run in runs[key]:
                inside = overlap(*run, lo, lo + size)
                if inside is not None:
                    a, b = inside
                    piece = nn.Parameter(shard.stepped.narrow(0, a - lo, b - a))
                    pieces.append(Piece(piece, self.store.buffers[key].narrow(0, a, b - a), key, a))
        held = [p for p in params if p in self.store]
        if not pieces and held:
            # No element in this rank's shards: an empty piece steps along, keeping the group's scalar state.
            empty = self.store.view(held[0]).new_empty(0)  # (float32 for a main grad's)
            pieces.append(Piece(nn.Parameter(empty), empty, (empty.dtype, empty.device), 0))
        return pieces

    def clip(
        self,
        max_norm: float,
        norm_type: float,
        error_if_nonfinite: bool = False,
        stages: dist.ProcessGroup | None = None,
    ) -> torch.Tensor:
        """`clip_shards` over this rank's gradient shards (with `stages`, a pipeline's: over every stage)."""
        groups = self.norm_groups + ([stages] if stages is not None else [])
        runs, counted = self.grad_runs, self.counted_runs
        return clip_shards(self.grad_shards, max_norm, norm_type, groups, runs, error_if_nonfinite, counted)

    def unscale_(  # (FlatParameters')
        self, inv_scale: torch.Tensor, found_inf: torch.Tensor | None, allow_fp16: bool
    ) -> None:
        """Multiply the gradient shards by `inv_scale` (a loss scaler's 1/scale); with `found_inf`, set it to
        1.0 where any rank's shard holds an inf or NaN (`unscale_shards`)."""
        unscale_shards(
            self.grad_shards, inv_scale, found_inf, allow_fp16, self.process_group, self.store.tensor_parallel
        )

    def launch_gather(self) -> None:
        """Start the all-gathers of every bucket's parameters from the ranks' updated shards (`wait_gather`
        finishes them), in the parameters' dtype (bfloat16 with masters: half float32's bytes)."""
        self.wait_gather()  # (one still in flight would land after this one)
        self.waited = []
        self.in_flight = {
            index: self._gather(shard.bucket, shard.param.detach()) for index, shard in enumerate(self.shards)
        }

    def gather_grads(self) -> None:
        """Every rank's gradient shards (the averages) into the whole pieces, each `.grad` plain again (what
        DDP leaves): for a relayout while reduce-scattered (a layer unfrozen between a backward and the next
        `zero_grad`: Lightning zeroes after the forward); a collective, as every rank lays out again."""
        pieces = [view for view, _ in self.bucket_views]
        works = [w for piece, s in zip(pieces, self.shards) for w in self._gather(piece, s.grad.clone())]
        for work in works:
            work.wait()
        unmark_scattered(self.store)

    def _gather(self, bucket: torch.Tensor, mine: torch.Tensor) -> list[Any]:
        group = self.process_group
        if not self.gather_by_broadcast:
            return [all_gather_flat(bucket, mine, group=group, async_op=True)]
        size = mine.numel()
        return [
            dist.broadcast(bucket.narrow(0, r * size, size), src=src, group=group, async_op=True)
            for r, src in enumerate(self.layout.global_ranks)
        ]

    def wait_gather(self, indices: tuple[int, ...] | None = None) -> None:
        """Wait for the all-gathers of buckets `indices` (all when None): their parameters are whole
        afterwards (on CUDA: for work queued on the current stream from now on)."""
        if not self.in_flight:
            return
        for index in tuple(self.in_flight) if indices is None else indices:
            works = self.in_flight.pop(index, None)
            if works is not None:
                for work in works:
                    work.wait()
                self.waited.append(index)
        if not self.in_flight:
            self._versions = self._param_versions()  # the parameters match the masters again

    def bucket_indices(self, params: list[torch.Tensor]) -> tuple[int, ...]:
        """The buckets holding `params`' slots (those in the store), in bucket order."""
        found = set()
        for param in params:
            if param not in self.store:
                continue
            key, slot = self.store.slot(param)
            for index, (view, start) in enumerate(self.bucket_views):
                if (view.dtype, view.device) == key and start <= slot.offset < start + view.numel():
                    found.add(index)
        return tuple(sorted(found))


def tensor_parallel_layout(layout: Layout, store: GradStore) -> Layout:
    """`layout` with what the ranks of the tensor-parallel mesh hold (unchanged without DTensor parameters),
    for a state each rank saves in the whole parameters' shapes. Slots follow each rank's local shapes (an
    uneven dimension moves every slot after it), so the mesh's ranks exchange layouts once (one object
    all-gather over the mesh, every rank building its layout with the others):

    - `Layout.peers`: for each parameter sharded over the mesh, the boxes of its state (global rank, offsets,
      sizes in the whole parameter) the other ranks' pieces hold, listed in its ShardedTensor;
    - `Layout.cuts`: for each replicated parameter, where any rank's chunks start or end, so every rank cuts
      there and saves the same boxes: ``torch.distributed.checkpoint`` refuses boxes that only overlap."""
    tensor_parallel = store.tensor_parallel
    if tensor_parallel is None:
        return layout
    ranks = layout.global_ranks
    mine: list[Any] = []
    for param in store.params:
        if is_sharded(param):
            extent = layout.extent(param)
            chunks = layout.chunks(param)
            mine.append(
                [(ranks[c.rank], b.offsets, b.sizes) for c in chunks for b in extent.boxes(c.offset, c.numel)]
            )
        else:  # (where its chunks start and end: the layout has no cuts yet)
            mine.append(sorted({e for c in layout.chunks(param) for e in (c.offset, c.offset + c.numel)}))
    gathered: list[Any] = [None] * dist.get_world_size(tensor_parallel.group)
    dist.all_gather_object(gathered, mine, group=tensor_parallel.group)
    me = tensor_parallel.mesh.get_local_rank()
    peers, cuts = {}, {}
    for index, param in enumerate(store.params):
        if is_sharded(param):
            peers[id(param)] = [
                box for peer, theirs in enumerate(gathered) if peer != me for box in theirs[index]
            ]
        else:
            cuts[id(param)] = tuple(sorted({edge for theirs in gathered for edge in theirs[index]}))
    return dataclasses.replace(layout, peers=peers, cuts=cuts)


def retake_master(master: torch.Tensor, param: torch.Tensor) -> None:
    """Each element of the float32 `master` that no longer rounds to `param`'s (written since) takes its
    value, exactly (the cast up is exact); one that still does keeps its extra precision. Under no_grad."""
    moved = master.to(param.dtype) != param
    master.copy_(torch.where(moved, param.float(), master))


def _runs(store: GradStore, key: GroupKey, wanted: set[int]) -> list[tuple[int, int]]:
    """[start, end) runs of the wanted parameters' slots in `key`'s buffer, each with the padding after it."""
    slots = sorted(
        (store.slot(p)[1].offset, id(p) in wanted) for p in store.params if store.slot(p)[0] == key
    )
    end_of_buffer = store.buffers[key].numel()
    return merge_touching(
        (offset, slots[i + 1][0] if i + 1 < len(slots) else end_of_buffer)
        for i, (offset, mine) in enumerate(slots)
        if mine
    )


def _data_ptr(param: torch.Tensor) -> int:
    return local_of(param).data_ptr()  # (a DTensor's own data_ptr() is 0: its shard's)


_version = operator.attrgetter("_version")


def parameter_dtypes(store: GradStore) -> dict[Any, set[torch.dtype]]:
    """The parameters' dtype of each gradient buffer; raises ValueError where parameters of different dtypes
    share one (float32 next to bfloat16/float16 ones with main grads): no flat parameter buffer holds them."""
    dtypes: dict[Any, set[torch.dtype]] = {}
    for param in store.params:
        dtypes.setdefault(store.slot(param)[0], set()).add(param.dtype)
    for key, found in dtypes.items():
        if len(found) > 1:
            names = sorted(str(dtype) for dtype in found)
            raise ValueError(
                f"ShardedOptimizer: parameters of dtypes {names} share the {key[0]} gradient "
                "buffer (main grads, grad_dtype='float32'), so no one flat parameter buffer "
                "holds them all; convert the model to one dtype (model.to(torch.bfloat16)) "
                "before applying FlatGrad, or keep every parameter in float32"
            )
    return dtypes


def flat_parameters(store: GradStore, reuse_only: bool = False) -> dict[Any, torch.Tensor]:
    """Flat parameter buffers with the gradient buffers' layout, in the parameters' dtype (bfloat16 for a
    float32 buffer of main grads); every parameter becomes a view of its slot (same shape, strides and
    values). Where the parameters are views of such buffers already (a second ShardedOptimizer by tensor over
    the same replicate: Muon's and AdamW's), those buffers, so both optimizers gather into one memory.

    Raises:
        ValueError: Parameters of different dtypes share a gradient buffer (`parameter_dtypes`); or, with
            `reuse_only` (another ShardedOptimizer steps the parameters already), they are not views of such
            buffers any more: new ones would move that one's parameters out of the memory it steps."""
    dtypes = parameter_dtypes(store)
    found = {key: _buffer_under(store, key) for key in store.buffers}
    if all(buffer is not None for buffer in found.values()):
        return found  # type: ignore[return-value]
    if reuse_only:
        raise ValueError(
            "dp's parameters are not views of its first ShardedOptimizer's flat parameter "
            "buffers any more (param.data = ... since it was built), so another "
            "ShardedOptimizer over dp would move them out of the memory that one steps: "
            "build dp's ShardedOptimizers again, one after the other, before changing parameters"
        )
    buffers = {
        key: torch.zeros(grad.numel(), dtype=next(iter(dtypes.get(key, {grad.dtype}))), device=grad.device)
        for key, grad in store.buffers.items()
    }
    with torch.no_grad():
        for param in store.params:
            key, slot = store.slot(param)
            buffer = buffers[key]
            view = buffer.as_strided(slot.shape, slot.stride, buffer.storage_offset() + slot.offset)
            view.copy_(local_of(param))
            move_into(param, view)
    return buffers


def _buffer_under(store: GradStore, key: GroupKey) -> torch.Tensor | None:
    """The flat parameter buffer of `key` the parameters (a DTensor's local shard) are views of already, each
    at its slot; None where they are not."""
    held = [(local_of(p), store.slot(p)[1]) for p in store.params if store.slot(p)[0] == key]
    if not held:
        return None
    first, first_slot = held[0]
    storage = first.untyped_storage()
    base = first.storage_offset() - first_slot.offset
    numel = store.buffers[key].numel()
    fits = base >= 0 and storage.nbytes() >= (base + numel) * first.element_size()
    if not fits or any(
        p.untyped_storage().data_ptr() != storage.data_ptr()
        or p.storage_offset() - slot.offset != base
        or p.stride() != slot.stride
        for p, slot in held
    ):
        return None
    return first.new_empty(0).set_(storage, base, (numel,), (1,))


def runs_in_shards(
    store: GradStore, shards: Sequence[torch.Tensor], runs: Sequence[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """The gradient elements inside `shards` (this rank's gradient shards: views of the buffers) without the
    alignment padding between slots: `GradStore.runs` (or `runs`, 1-D views of the buffers: the runs a
    tensor-parallel norm counts) cut at the shards' edges. What a scale may touch: padding is zeroed once, at
    construction, so a NaN clip coefficient there would stay in later norms."""

    def span(view: torch.Tensor) -> tuple[GroupKey, int, int]:  # (buffer, [start, end))
        key = (view.dtype, view.device)
        start = int(view.storage_offset() - store.buffers[key].storage_offset())
        return key, start, start + view.numel()

    edges = [span(shard) for shard in shards]
    found = []
    for run in store.runs if runs is None else runs:
        key, first, end = span(run)
        for shard_key, lo, hi in edges:
            inside = overlap(first, end, lo, hi) if shard_key == key else None
            if inside is not None:
                found.append(store.buffers[key].narrow(0, inside[0], inside[1] - inside[0]))
    return found


def clip_shards(
    grads: list[torch.Tensor],
    max_norm: float,
    norm_type: float,
    groups: Sequence[dist.ProcessGroup | None],
    runs: Sequence[torch.Tensor],
    error_if_nonfinite: bool = False,
    counted: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Scale `grads` (every rank's shards together) to a global norm of at most `max_norm`, multiplying only
    their `runs` (`runs_in_shards`); returns the global norm before, in at least float32 (one scalar
    all-reduce per group of `groups`: data-parallel, then a tensor-parallel mesh's and a pipeline's stages').
    The norm reads `grads`, or only `counted` (the runs this rank counts on a tensor-parallel mesh). With
    `error_if_nonfinite` a NaN or infinite norm raises instead, on every rank alike."""
    device = grads[0].device
    # float64 partial norms, accumulated in chunks (see flatgrad._norms)
    norms = [_norms.vector_norm(g, norm_type).to(device) for g in (grads if counted is None else counted)]
    stacked = torch.stack(norms) if norms else torch.zeros(1, dtype=torch.float64, device=device)
    if math.isinf(norm_type):
        total = stacked.max()
        for group in groups:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    else:
        total = stacked.pow(norm_type).sum()
        for group in groups:
            dist.all_reduce(total, group=group)
        total = total.pow(1.0 / norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite, so it "
            "cannot be clipped; pass error_if_nonfinite=False to clip anyway"
        )
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for run in runs:
        by_dtype.setdefault(run.dtype, []).append(run)
    for dtype, same in by_dtype.items():
        scale_(same, coef.to(dtype))  # (the coefficient in each gradient's dtype, as before)
    dtype = functools.reduce(torch.promote_types, [_norms.norm_dtype(g.dtype) for g in grads])
    return total.to(dtype)


def unscale_shards(
    shards: list[torch.Tensor],
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor | None,
    allow_fp16: bool,
    process_group: dist.ProcessGroup | None,
    tensor_parallel: TensorParallel | None = None,
) -> None:
    """Multiply `shards` (DTensor gradients: their local tensors) by `inv_scale` (a loss scaler's 1/scale);
    with `found_inf`, set it to 1.0 where any rank's shard holds an inf or NaN (one scalar all-reduce, so
    every rank skips the same steps; with `tensor_parallel`, a second over its mesh, holding other shards)."""
    grads: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in shards:
        grads.setdefault(grad.dtype, []).append(local_of(grad))
    if torch.float16 in grads and not allow_fp16:
        raise ValueError(
            "Attempting to unscale FP16 gradients (float16 parameters without main grads): "
            "apply FlatGrad with grad_dtype='float32', whose float32 main grads a loss "
            "scaler can unscale"
        )
    device = shards[0].device
    found = None if found_inf is None else found_inf.to(device)
    inv = inv_scale.to(device)
    with torch.no_grad():
        for same in grads.values():
            if found is None:
                torch._foreach_mul_(same, inv)
            else:
                non_finite_check_and_unscale(same, found, inv)
    if found is not None:  # (so is found_inf)
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=process_group)
        if tensor_parallel is not None:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=tensor_parallel.group)
        found_inf.copy_(found)  # type: ignore[union-attr]


def check_members(names: dict[int, str], groups: list[dict[str, Any]], what: str) -> None:
    """Raise ValueError, "`what`, got a tensor ... that is not one", for a parameter of `groups` not in
    `names` (id -> name of dp's parameters)."""
    for group in groups:
        for param in group["params"]:
            if id(param) not in names:
                raise ValueError(f"{what}, got a tensor of shape {tuple(param.shape)} that is not one")


def checked_defaults(
    store: GradStore,
    optimizer_class: type[torch.optim.Optimizer],
    groups: list[dict[str, Any]],
    defaults: dict[str, Any],
) -> dict[str, Any]:
    """`optimizer_class`'s defaults after it checked `defaults` and the groups' options on a one-element
    stand-in per parameter, before anything moves: its error for an invalid one (or a duplicate parameter)
    leaves the model as it was. Raises ValueError first for dtypes that no one flat parameter buffer holds
    (`parameter_dtypes`), and for ``differentiable=True`` (`refuse_differentiable`)."""
    parameter_dtypes(store)
    # One-element stand-ins with the parameters' dimensions, dtypes and devices: what a class checks (Muon:
    # matrices only) is checked for all, on every rank alike, before each inner optimizer holds its rank's.
    checked = optimizer_class(
        [dict(g, params=[_stand_in_for_checks(p) for p in g["params"]]) for g in groups], **defaults
    )
    refuse_differentiable(optimizer_class, checked.param_groups)
    return checked.defaults


def _stand_in_for_checks(param: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.zeros((1,) * param.dim(), dtype=param.dtype, device=param.device))


def refuse_differentiable(optimizer_class: type[torch.optim.Optimizer], groups: list[dict[str, Any]]) -> None:
    """Raise ValueError where a group (or the defaults) asks for ``differentiable=True``: a sharded step
    updates leaf views of the flat parameter buffer in place and all-gathers them, which no graph can follow
    (torch's own optimizer refuses such a step on leaf parameters, at the first ``step()``)."""
    for index, group in enumerate(groups):
        if group.get("differentiable", False):
            raise ValueError(
                f"ShardedOptimizer cannot step {optimizer_class.__name__} with "
                f"differentiable=True (param group {index}): a sharded step updates leaf "
                "parameters in place and all-gathers them, which autograd cannot "
                "differentiate; use differentiable=False (the default)"
            )


def as_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """A torch optimizer's first argument as a list of groups, each with a list of params."""
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params must be an iterable of parameters or of parameter groups (dicts), got a "
            "single tensor; pass [tensor]"
        )
    params = list(params)
    if not params:
        raise ValueError("ShardedOptimizer got an empty parameter list")
    if not isinstance(params[0], dict):
        params = [{"params": params}]
    groups = []
    for group in params:
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(f"a parameter group must be a dict with 'params', got {type(group).__name__}")
        members = group["params"]
        members = [members] if isinstance(members, torch.Tensor) else list(members)
        for member in members:
            if not isinstance(member, torch.Tensor):
                raise TypeError(
                    "ShardedOptimizer can only optimize Tensors, but one of the params is "
                    f"{type(member).__name__}"
                )
        groups.append(dict(group, params=members))
    return groups


def options(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group's options (everything but its parameters)."""
    return {key: value for key, value in group.items() if key != "params"}


def add_piece_group(
    add: Callable[[dict[str, Any]], None], pieces: Callable[[], set[int]], group: dict[str, Any]
) -> None:
    """The inner optimizer's `add_param_group`, taking this rank's pieces only (torch's checks the rest)."""
    params = group.get("params", ()) if isinstance(group, dict) else ()
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    if any(id(p) not in pieces() for p in params):
        raise ValueError(
            "ShardedOptimizer's inner optimizer holds this rank's pieces of the flat shards only "
            "and cannot take model parameters (they are stepped through their shards already, "
            "and would be stepped twice); give them to ShardedOptimizer.add_param_group"
        )
    add(group)


def group_signature(
    param_groups: list[dict[str, Any]], inner: torch.optim.Optimizer
) -> list[tuple[int, int]]:
    """The params lists of the groups and of the inner optimizer's, and their lengths: a list replaced or
    changed by hand (past add_param_group) shows here, at no cost per parameter."""
    groups = [*param_groups, *inner.param_groups]
    return [(id(group["params"]), len(group["params"])) for group in groups]


_MISSING = object()


def _same(a: object, b: object) -> bool:
    """Whether two option values are one setting: one tensor (lr tensors change in place) or equal values."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001  (values that do not compare: different settings)
        return False


class SyncedOptions:
    """The options of a ShardedOptimizer's `param_groups` and its inner optimizer's (one inner group each),
    kept one setting: whichever side changed since the last sync (a scheduler on ``opt`` or ``opt.optimizer``,
    a loop, the inner step) carries to the other; differing changes on both sides are refused. At construction
    the groups take the inner optimizer's values (a tensor lr, as torchao's, is that tensor in both)."""

    def __init__(self, param_groups: list[dict[str, Any]], inner: torch.optim.Optimizer) -> None:
        self.loaded(param_groups, inner)

    def added(self, group: dict[str, Any], own: dict[str, Any]) -> None:
        """A group just added to both sides: it takes the inner group's values."""
        group.update(options(own))
        self.seen.append(options(group))

    def loaded(self, param_groups: list[dict[str, Any]], inner: torch.optim.Optimizer) -> None:
        """The groups take the inner optimizer's options, as the last sync: after it loaded the saved ones
        (its class's own ``load_state_dict``), after a call."""
        for group, own in zip(param_groups, inner.param_groups):
            group.update(options(own))
        self.seen = [options(group) for group in param_groups]

    def run(
        self, inner: torch.optim.Optimizer, param_groups: list[dict[str, Any]], call: Callable[[], Any]
    ) -> Any:
        """`call()` (a step, schedule-free's ``train``/``eval``) on the inner optimizer with the options both
        sides agree on now; what it writes into its groups then shows in `param_groups`, as in plain torch.

        Raises:
            ValueError: An option was set on both sides since the last sync, to different values (every rank
                alike: schedulers and loops run on every rank)."""
        for index, (group, own, seen) in enumerate(zip(param_groups, inner.param_groups, self.seen)):
            for key in {*group, *own} - {"params"}:
                mine, theirs = group.get(key, _MISSING), own.get(key, _MISSING)
                before = seen.get(key, _MISSING)
                if mine is _MISSING and _same(theirs, before):
                    own.pop(key, None)  # (deleted from the group)
                elif _same(theirs, before) or _same(mine, theirs):
                    own[key] = mine  # (unchanged inside, or both alike)
                elif _same(mine, before):
                    group[key] = theirs  # (a scheduler on the inner optimizer, a hand edit of it)
                else:
                    raise ValueError(
                        f"ShardedOptimizer: option {key!r} of param group {index} was set both on "
                        f"opt.param_groups ({mine!r}) and on opt.optimizer.param_groups "
                        f"({theirs!r}) since the last step; set it in one place (build an LR "
                        "scheduler on opt or on opt.optimizer, not both)"
                    )
        result = call()
        self.loaded(param_groups, inner)
        return result


def on_every_rank(
    call: Callable[[], Any], what: str, device: torch.device, process_group: dist.ProcessGroup | None
) -> Any:
    """`call()`, its outcome agreed over `process_group` (one small all-reduce): if it raised on any rank, all
    raise (that rank its own error, the others a RuntimeError naming it), so none goes on to a collective the
    others never reach (an inner optimizer refusing an empty group, a step failing on one rank's shard)."""
    error: Exception | None = None
    result = None
    try:
        result = call()
    except Exception as caught:  # noqa: BLE001  (raised below, once every rank knows)
        error = caught
    failed = flagged_ranks(error is not None, device, process_group)
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(
            f"ShardedOptimizer: {what} raised on rank(s) {failed} (their error says why); "
            "every rank stops here rather than wait for them"
        )
    return result


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The summed size of the tensors in `optimizer`'s state."""
    return sum(
        local_of(t).numel() * t.element_size()  # (a DTensor state: this rank's shard of it)
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )


def _with_saved_options(views: list[GroupView], state_dict: object) -> list[GroupView]:
    """`views` with the options `state_dict` saved for each group over the current ones: they decide what
    state a group holds (SGD saved with momentum has momentum buffers one built without it must load), as a
    torch optimizer loads what its dict holds. Unchanged where the group count differs (`misfit` says why)."""
    saved = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if not isinstance(saved, list) or len(saved) != len(views) or not all(isinstance(g, dict) for g in saved):
        return views
    return [
        dataclasses.replace(view, options={**view.options, **options(group)})
        for view, group in zip(views, saved)
    ]


def relaid_state(
    kept: dict[str, dict[str, Any]],
    parked: dict[str, dict[str, Any]],
    views: list[GroupView],
    recipe: OptimizerRecipe,
) -> dict[str, Any]:
    """The state a new layout's groups (`views`) load after parameters were frozen or unfrozen: each
    parameter's own, whole (`kept`, of those in the layout before; `parked`, of those frozen since), a
    parameter that never had one a fresh one (`recipe`'s eager state as Adagrad's, else zeros; its master its
    value). Raises ValueError, on every rank alike, where a group would hold parameters with different step
    counts: torch's optimizers count steps per parameter, ShardedOptimizer's pieces per group."""
    state: dict[str, Any] = {}
    for index, view in enumerate(views):
        if not view.params:
            continue
        spec = group_spec(recipe, view)
        entries = {name: kept.get(name) or parked.get(name) for name, _ in view.params}
        template = next((e for e in entries.values() if e is not None), None)
        steps = {
            name: float(entry[STEP]) if entry is not None else 0.0
            for name, entry in entries.items()
            if STEP in spec.scalars and (entry is None or STEP in entry)
        }
        if len(set(steps.values())) > 1:
            raise ValueError(
                f"ShardedOptimizer: after parameters were frozen or unfrozen, param group {index} "
                f"would hold parameters with different step counts ({by_count(steps)}); "
                f"{recipe.name} counts steps per parameter, ShardedOptimizer per "
                "group: give parameters that become trainable later a group of their own "
                "(build the optimizer without them and opt.add_param_group({'params': ...}) "
                "when unfreezing them), and keep a frozen parameter frozen or its group whole"
            )
        for name, param in view.params:
            entry = entries[name]
            if entry is None:
                entry = _eager_state(recipe, view.options, param, MASTER in spec.per_element) or {
                    key: torch.zeros(  # (plain, in the whole shape: a DTensor parameter's too)
                        tuple(param.shape), dtype=_state_dtype(template, key, param), device=param.device
                    )
                    for key in spec.per_element
                }
                if MASTER in spec.per_element:
                    entry[MASTER] = param.detach().float()
                if template is not None:
                    entry.update({key: template[key] for key in spec.scalars if key in template})
                elif STEP in spec.scalars:
                    entry[STEP] = torch.zeros((), dtype=torch.float32)
                    entry.update({key: value for key, value in spec.scalars.items() if key != STEP})
            state[name] = entry
    return {
        "state": state,
        "param_groups": [{**view.options, "params": [name for name, _ in view.params]} for view in views],
    }


def _eager_state(
    recipe: OptimizerRecipe, options: dict[str, Any], param: torch.Tensor, masters: bool
) -> dict[str, Any]:
    """The state `recipe`'s optimizer builds for a `param`-shaped parameter (Adagrad's initial accumulator and
    step count; empty for classes making state at their first step), on a stand-in (float32 with masters)."""
    dtype = torch.float32 if masters else param.dtype
    stand_in = nn.Parameter(torch.zeros(param.shape, dtype=dtype, device=param.device))
    return dict(recipe.build([dict(options, params=[stand_in])]).state.get(stand_in, {}))


def _state_dtype(template: dict[str, Any] | None, key: str, param: torch.Tensor) -> torch.dtype:
    value = template.get(key) if template is not None else None
    return value.dtype if isinstance(value, torch.Tensor) else param.dtype


class InnerGroups:
    """What `PieceGroups` (by element) and `flatgrad._zero_tensor.TensorGroups` (by tensor) share: the inner
    optimizer (`inner`), one inner group per group of `param_groups`, options synced at every step
    (`SyncedOptions`), and the check that neither side's groups were changed by hand. Every method that reads
    the groups is handed the live `param_groups` list."""

    inner: torch.optim.Optimizer
    point_grads: Callable[[], None]  # each stepped tensor's `.grad`, before a step
    take_masters: Callable[[], None]  # the float32 masters of parameters written since
    write_back: Callable[[], None]  # the masters into their parameters, after a step
    how_to_add = ""  # what opt.add_param_group gives a parameter (`check`'s advice)
    stepped = False  # (a step ran)

    def hold(self, param_groups: list[dict[str, Any]], held: Callable[[], set[int]]) -> None:
        """With `inner` built: its `add_param_group` takes only tensors `held` gives ids of; sides synced."""
        # Model parameters given to the inner optimizer would be stepped twice: refused at the call. (An
        # instance attribute: the optimizer pickles and deep-copies by its state only.)
        self.inner.add_param_group = functools.partial(  # type: ignore[method-assign]
            add_piece_group, self.inner.add_param_group, held
        )
        self.held = group_signature(param_groups, self.inner)
        self.options = SyncedOptions(param_groups, self.inner)

    def added(self, group: dict[str, Any], param_groups: list[dict[str, Any]]) -> None:
        """`group` was just added to `param_groups` and its inner group to `inner`."""
        self.held = group_signature(param_groups, self.inner)
        self.options.added(group, self.inner.param_groups[-1])

    def check(self, param_groups: list[dict[str, Any]]) -> None:
        """Raise RuntimeError where the groups (or the inner ones) were changed by hand: one put into a group
        past add_param_group has no place in the plan; one in the inner optimizer would step twice."""
        if group_signature(param_groups, self.inner) != self.held:
            raise RuntimeError(
                "ShardedOptimizer's param_groups (and its inner optimizer's) were changed by "
                f"hand: add parameters with opt.add_param_group, {self.how_to_add}"
            )

    def step(self, param_groups: list[dict[str, Any]], **kwargs: Any) -> Any:
        """The inner optimizer's step (through the float32 masters, if any) with the options `param_groups`
        hold now (what a scheduler or the loop wrote); what it writes into its groups (an option adapted or
        added) shows in `param_groups` afterwards, as in a plain optimizer's."""
        self.point_grads()
        self.stepped = True
        return self.call(functools.partial(self.inner.step, **kwargs), param_groups)

    def call(self, method: Callable[[], Any], param_groups: list[dict[str, Any]]) -> Any:
        """`method` of the inner optimizer (its step; schedule-free's ``train``/``eval``, which move the
        parameters) as `SyncedOptions.run` calls it."""
        self.take_masters()
        result = self.options.run(self.inner, param_groups, method)
        self.write_back()
        return result


class PieceGroups(InnerGroups):
    """The inner optimizer (`inner`) over this rank's pieces of `param_groups` (see `InnerGroups`). `names`
    maps id(param) to the plain parameter name (the checkpoint's keys)."""

    how_to_add = (
        "which gives them their pieces of this rank's shards; the inner optimizer holds those "
        "pieces only and cannot take model parameters (each is already stepped through its shard)"
    )

    def __init__(
        self,
        engine: ShardEngine,
        names: dict[int, str],
        recipe: OptimizerRecipe,
        param_groups: list[dict[str, Any]],
    ) -> None:
        self.engine = engine
        self.names = names
        self.recipe = recipe
        # Per group: this rank's pieces of its parameters (1-D views of the flat parameter, gradient buffers).
        self.pieces = [engine.pieces(group["params"]) for group in param_groups]
        inner_groups = [self.inner_group(group, pieces) for group, pieces in zip(param_groups, self.pieces)]
        # With the user's constructor arguments, as a plain optimizer is built (`OptimizerRecipe`).
        self.inner = recipe.build(inner_groups)
        self.take_masters, self.write_back = engine.take_masters, engine.write_back  # (the engine's masters)
        # (options, dtype, device) -> `_refuse_partial`'s answer
        self.specs: dict[tuple[str, torch.dtype, torch.device], bool] = {}
        self.hold(param_groups, self.piece_ids)

    def piece_ids(self) -> set[int]:
        return {id(piece.param) for pieces in self.pieces for piece in pieces}

    @staticmethod
    def inner_group(group: dict[str, Any], pieces: list[Piece]) -> dict[str, Any]:
        return {**options(group), "params": [piece.param for piece in pieces]}

    def add(self, group: dict[str, Any], param_groups: list[dict[str, Any]]) -> None:
        """The inner group for `group`, just added to `param_groups`."""
        pieces = self.engine.pieces(group["params"])
        self.pieces.append(pieces)
        torch.optim.Optimizer.add_param_group(self.inner, self.inner_group(group, pieces))
        self.added(group, param_groups)

    def point_grads(self) -> None:
        """Each piece's `.grad`: its part of the gradient shard."""
        for pieces in self.pieces:
            for piece in pieces:
                piece.param.grad = piece.grad

    def step(self, param_groups: list[dict[str, Any]], **kwargs: Any) -> Any:
        """`InnerGroups.step`, leaving a parameter without a gradient as stock leaves it (`_unstepped`): a
        group none of whose parameters has one is skipped whole (its pieces' `.grad` None); in a stepped
        group, such a parameter's elements get their values and per-element state back after the step."""
        if "closure" in kwargs:  # (a class whose step runs the closure: its gradients come later)
            return super().step(param_groups, **kwargs)
        whole, parts = self._unstepped(param_groups)
        if not whole and not parts:
            return super().step(param_groups, **kwargs)
        self.point_grads()
        for index in whole:
            for piece in self.pieces[index]:
                piece.param.grad = None
        return self.call(self._keeping(parts, functools.partial(self.inner.step, **kwargs)), param_groups)

    def _unstepped(self, param_groups: list[dict[str, Any]]) -> tuple[set[int], list[tuple[Piece, int, int]]]:
        """The groups where no parameter has a gradient, and the [a, b) ranges of this rank's pieces of the
        other groups holding a parameter without one: `.grad` None after a synchronised backward (a main grad
        counts, `GradStore.has_main`; an empty parameter never), or, with gradients assigned by hand, on this
        rank (one small all-reduce tells every rank who has none where). Raises ValueError on every rank,
        before anything moves, where `_refuse_partial` refuses such a group (docs/data-parallel.md,
        "ShardedOptimizer (ZeRO-1)")."""
        store = self.engine.store
        scattered, main = is_scattered(store), store.has_main
        if scattered and all(p.grad is not None or main(p) or not p.numel() for p in store.params):
            return set(), []  # (the usual step: every parameter has its gradient)
        held = [[p for p in group["params"] if p in store] for group in param_groups]
        missing = [[p.grad is None and bool(p.numel()) and not main(p) for p in ps] for ps in held]
        if scattered:  # (after a synchronised backward `.grad` is None alike on every rank)
            somewhere = everywhere = missing
        else:  # by hand: which parameters lack one on some rank, and on every rank
            somewhere, everywhere = _missing_on_ranks(missing, self.engine)
        whole, parts = set(), []
        for index, (params, lacking) in enumerate(zip(held, missing)):
            if not any(somewhere[index]):
                continue
            if all(everywhere[index]):
                whole.add(index)
                continue
            self._refuse_partial(index, params, somewhere[index], param_groups[index])
            for param, lacks in zip(params, lacking):
                key, slot = store.slot(param)
                end = slot.offset + slot.numel
                for piece in self.pieces[index] if lacks else ():  # (offsets in the same buffer only)
                    inside = overlap(slot.offset, end, piece.start, piece.start + piece.param.numel())
                    if inside is not None and piece.key == key:
                        parts.append((piece, inside[0] - piece.start, inside[1] - piece.start))
        return whole, parts

    def _refuse_partial(
        self, index: int, params: list[torch.Tensor], lacking: list[bool], group: dict[str, Any]
    ) -> None:
        """Raise ValueError where group `index` steps with gradient-less parameters and its class cannot leave
        their elements as they were: it keeps scalar state per parameter (pieces keep it per group), or its
        zeroed per-element state does not step as none does (`zeros_start_fresh`). Probed in the dtype of each
        of the group's gradient buffers, so all ranks raise alike; cached by options no scheduler moves."""
        store = self.engine.store
        options = {k: v for k, v in group.items() if k != "params"}
        fixed = repr(
            {k: v for k, v in options.items() if k not in _SCHEDULED and not isinstance(v, torch.Tensor)}
        )
        for dtype, device in {store.slot(p)[0] for p in params}:
            key = (fixed, dtype, device)
            if key not in self.specs:
                if len(self.specs) > 64:  # (an option scheduled under another name: OneCycleLR's momentum)
                    self.specs.clear()
                like = torch.empty(0, dtype=dtype, device=device)
                spec = state_spec(self.recipe, options, like)
                self.specs[key] = not spec.scalars and zeros_start_fresh(self.recipe, options, like)
            if not self.specs[key]:
                names = [self.names[id(p)] for p, lacks in zip(params, lacking) if lacks]
                raise ValueError(
                    f"ShardedOptimizer: {names[:4]} of param group {index} have no gradient in this "
                    f"step while others of the group do; {self.recipe.name} keeps a step count or other "
                    "state per parameter, which a group's shard pieces keep together, so it cannot leave "
                    "them as stock leaves a parameter without a gradient, and stepping them with a zero "
                    "one would move them (weight decay, momentum). Give the parameters a step may leave "
                    "unused a param group of their own (skipped whole where none has a gradient), or "
                    "shard_by='tensor', or use them in every step"
                )

    def _keeping(self, parts: list[tuple[Piece, int, int]], step: Callable[[], Any]) -> Callable[[], Any]:
        """`step`, with `parts` put back after it: each range's values and per-element state as at its start
        (inside `call`: the masters are current), zeros for state a first step makes."""

        def keeping() -> Any:
            saved = []
            for piece, a, b in parts:
                state = _per_element(self.inner.state.get(piece.param, {}), piece.param)
                values = piece.param.detach()[a:b].clone()
                saved.append((piece.param, a, b, values, {k: v[a:b].clone() for k, v in state.items()}))
            result = step()
            with torch.no_grad():
                for param, a, b, values, before in saved:
                    param[a:b] = values
                    for key, value in _per_element(self.inner.state.get(param, {}), param).items():
                        value[a:b] = before.get(key, 0)
            return result

        return keeping

    def drop_grads(self) -> None:
        """Drop the pieces' `.grad` (zero_grad)."""
        for pieces in self.pieces:
            for piece in pieces:
                piece.param.grad = None

    def views(self, param_groups: list[dict[str, Any]]) -> list[GroupView]:
        """Each group as the checkpoint sees it (`flatgrad._zero_state.GroupView`)."""
        slots = self.engine.layout.slots
        return [
            GroupView(
                [(self.names[id(p)], p) for p in group["params"] if id(p) in slots],
                options(group),
                pieces,
                masters=self.engine.has_masters,
            )
            for group, pieces in zip(param_groups, self.pieces)
        ]

    def state_dict(self, param_groups: list[dict[str, Any]]) -> dict[str, Any]:
        """The inner optimizer's state per parameter (`flatgrad._zero_state.optimizer_state`)."""
        views = self.views(param_groups)
        return optimizer_state(self.inner, self.recipe, views, self.engine.layout, self.engine.process_group)

    def load_state_dict(self, param_groups: list[dict[str, Any]], state_dict: dict[str, Any]) -> None:
        """Load `state_dict` into the inner optimizer through its class's own ``load_state_dict``
        (`load_own_state`), and the groups' options, after every rank found it fits (`refuse_misfits`)."""
        views = _with_saved_options(self.views(param_groups), state_dict)
        layout = self.engine.layout
        problem = misfit(self.recipe, views, layout, state_dict)
        refuse_misfits(problem, self.engine.shards[0].param.device, self.engine.process_group)
        entries, _ = own_state(self.inner)
        pieces = [piece.param for view in views for piece in view.pieces]
        live: dict[torch.Tensor, dict[str, Any]] = {p: entries[id(p)] for p in pieces if id(p) in entries}
        states: dict[int, dict[str, Any]] = {}
        for view, flag in zip(views, saved_stepped(views, state_dict)):
            states.update(load_group(self.recipe, view, layout, state_dict["state"], flag, live))
        load_own_state(self.inner, states, state_dict.get(CLASS_STATE), state_dict["param_groups"])
        self.options.loaded(param_groups, self.inner)


def _per_element(state: dict[str, Any], piece: torch.Tensor) -> dict[str, torch.Tensor]:
    """The per-element entries of a piece's state (1-D, the piece's length)."""
    return {
        k: v
        for k, v in state.items()
        if isinstance(v, torch.Tensor) and v.dim() == 1 and len(v) == len(piece)
    }


def _missing_on_ranks(
    missing: list[list[bool]], engine: ShardEngine
) -> tuple[list[list[bool]], list[list[bool]]]:
    """Per group and parameter: whether some rank, and whether every rank, has no gradient for it (`missing`
    is this rank's; one small all-reduce of the counts)."""
    flat = [lacks for lacking in missing for lacks in lacking]
    counts = host_tensor(flat, torch.int32, engine.shards[0].param.device)
    dist.all_reduce(counts, group=engine.process_group)
    world_size, totals = dist.get_world_size(engine.process_group), iter(counts.tolist())
    per_group = [[next(totals) for _ in lacking] for lacking in missing]
    return [[n > 0 for n in ns] for ns in per_group], [[n == world_size for n in ns] for ns in per_group]


# Options schedulers move (LR ones, OneCycleLR's momentum bounds): not in `_refuse_partial`'s cache key.
_SCHEDULED = frozenset({"lr", "initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum"})
