"""The flat gradient buffers, and where each parameter's gradient lives in them.

- `GradStore`: one zero-initialised 1-D buffer per (dtype, device) group, each parameter's slot in it (a
  `SlotEntry`: group, place, one view), the 1-D views it cuts over them, the slots' `.grad` around a backward.
- `find_slot`, `owner_of`: which live store owns a parameter (a table by id this module owns), so that a layer
  backward given only the weight finds its slot.
- Main grads (`GradStore.mains`): a float32 slot of a bfloat16/float16 parameter is its gradient while `.grad`
  stays None; `MainGradGuard` (`MAIN_GRAD_GUARD`) makes a torch optimizer that would skip them raise.
- `Prescale`: a store's prescaling state, which `flatgrad._prescale` writes and reads; `Scattered`: its
  reduce-scatter state, which `flatgrad._scattered_grad` writes and reads.
- Free functions over the buffers' tensors: allocating a buffer aligned (`aligned_zeros`), filling seated
  slots (`negative_zero_`), staging host values for a device copy (`host_tensor`, `write_flags`), scaling in
  place (`scale_`), reading on another CUDA stream (`read_here`)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from flatgrad import _dtensor
from flatgrad._layout import GroupKey, SlotSpec, dense_stride, merge_touching, plan_layout
from flatgrad._torch_compat import graph_task_id

_Flagged = tuple[torch.Tensor, torch.Tensor, tuple[torch.nn.Parameter, ...]]
# `seat`'s last parameter tuple, its (parameter, slot) pairs, spans and their fill's sources.
_Pairs = list[tuple[torch.Tensor, torch.Tensor]]
_SeatCache = tuple[Sequence[torch.Tensor], _Pairs, list[torch.Tensor], list[torch.Tensor] | None]


class GradStore:
    """One zero-initialised 1-D tensor per (dtype, device) group and each parameter's slot, whose one view
    (made once) is the `.grad` flatgrad sets: "is `.grad` the slot?" is an identity test on the hot path.
    Nothing relies on AccumulateGrad stealing a tensor (which needs the view to have no other reference)."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        align_bytes: int,
        multiple: int = 1,
        grad_dtype: str | None = None,
    ) -> None:
        self.params = tuple(params)
        _check_free(self.params)
        # The DTensor parameters' mesh, or None: their slots hold local shards (`flatgrad._dtensor`).
        self.tensor_parallel = _dtensor.tensor_parallel_of(self.params)
        self._counted_runs: list[torch.Tensor] | None = None  # (see `norm_pieces`)
        if self.tensor_parallel is not None and grad_dtype is not None:
            raise ValueError(
                f"grad_dtype must be None for a model with DTensor parameters, got {grad_dtype!r}: "
                "main grads of tensor-parallel parameters are not supported"
            )
        self.stale = False  # set when a parameter no longer fits its slot
        self.ddp_bucket = False  # a buffer is a DDP's bucket (`adopt`), which keeps a slot frozen since
        self.unsynced = False  # set by replicate: no_sync() gradients await averaging (`_keeps_frozen`)
        self._seat_cache: _SeatCache | None = None  # dropped when the slots move
        self.buffers: dict[GroupKey, torch.Tensor] = {}
        self._entries: dict[torch.Tensor, SlotEntry] = {}
        self.views: dict[int, torch.Tensor] = {}  # each slot view, by ``id(param)`` (no Tensor hash)
        self._locals: dict[int, torch.Tensor] = {}  # the slots themselves (a DTensor view's local), by id
        self._addresses: dict[int, int] = {}  # where each slot view points, by id (see `intact`)
        # Per group: the buffer followed, in the same memory, by one used-flag element per
        # parameter; those flags; and those parameters (see `flagged`).
        self._flagged: dict[GroupKey, _Flagged] = {}
        # What `seat` last seated, until that backward's final callback `unseat`s it (`flagged`
        # may ask before). A nested backward that seats nothing leaves it alone.
        self.seated: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        # `seated` by id, for `unseat_final`: made from the list it was made of when first asked.
        self._seated_ids: tuple[list[Any], dict[int, tuple[torch.Tensor, torch.Tensor, int]]] = ([], {})
        # Reads per id since the backward began (`count_use`), the ids read outside their layers
        # (`route_layers`, `_backward._read_elsewhere`), those the running backward sums.
        self.uses: dict[int, tuple[torch.Tensor, int, bool]] = {}
        self.counted = self.uses  # (the reads the last backward was decided from)
        self.read_elsewhere: frozenset[int] = frozenset()
        self.summed: set[int] = set()
        self.prescale = Prescale()  # (see `flatgrad._prescale`)
        self.scattered = Scattered()  # (see `flatgrad._scattered_grad`)
        shards = [_dtensor.local_of(param) for param in self.params]  # (a DTensor's local shard)
        for key, group in plan_layout(shards, align_bytes, multiple, grad_dtype).items():
            members = tuple(self.params[index] for index in group.param_indices)
            raw = aligned_zeros(group.numel + len(members), key, align_bytes)
            self.buffers[key] = raw.narrow(0, 0, group.numel)
            self._flagged[key] = (raw, raw.narrow(0, group.numel, len(members)), members)
            for index, slot in zip(group.param_indices, group.slots):
                self._set_slot(self.params[index], key, slot)
        self.runs = self._runs()
        # Main grads (see `is_main`): their `.grad` stays None, the slot alone holds the gradient.
        self.mains = tuple(p for p in self.params if self._entries[p].view.dtype != p.dtype)
        self._main_ids = frozenset(map(id, self.mains))
        self._main_spans = self.spans(self.mains)  # (zeroed by `zero_mains`)
        # Main grads holding no gradient (`has_main`): zeroed to None, and no backward wrote them since.
        self.unwritten = set(self._main_ids)
        self._disown = _claim(self)
        if self.mains:
            MAIN_GRAD_GUARD.watch(self)

    def release(self) -> None:
        """Stop owning the parameters (before a rebuild replaces this store)."""
        self._disown()  # (runs once: a second release, or the store's death, does nothing)

    def __contains__(self, param: object) -> bool:
        return isinstance(param, torch.Tensor) and param in self._entries

    def view(self, param: torch.Tensor) -> torch.Tensor:
        """`param`'s slot as its `.grad`, shaped and strided like the parameter (always the
        same tensor): the slot itself, or for a DTensor parameter the DTensor over it."""
        return self._entries[param].view

    def norm_pieces(self) -> list[torch.Tensor]:
        """What a positive-order norm of this rank's gradients reads: every buffer whole (padding and slots
        without a gradient are zero), or, with DTensor parameters, the runs of the slots this rank counts
        (`TensorParallel.counts`), whose norms `TensorParallel.combine` makes the whole gradient's norm."""
        tensor_parallel = self.tensor_parallel
        if tensor_parallel is None:
            return list(self.buffers.values())
        if self._counted_runs is None:  # (the slots stay where they are while this store lives)
            counted = [param for param in self.params if tensor_parallel.counts(param)]
            self._counted_runs = self._runs(counted)
        return self._counted_runs

    def is_main(self, param: torch.Tensor) -> bool:
        """Whether `param`'s slot is a main grad (see the module docstring: its `.grad` stays None)."""
        return id(param) in self._main_ids

    def zero_mains(self) -> None:
        """Zero every main grad (a few fills: adjacent slots share one), as a zeroing that sets `.grad`
        None: none holds a gradient until a backward writes it (`has_main`)."""
        if self._main_spans:
            torch._foreach_zero_(self._main_spans)
            self.unwritten = set(self._main_ids)

    def zeroed_to_none(self, params: Iterable[torch.Tensor]) -> None:
        """`params`' main grads were zeroed by a zeroing that sets `.grad` None (a by-tensor
        ShardedOptimizer's own): until a backward writes them, they hold no gradient (`has_main`)."""
        self.unwritten |= {id(p) for p in params if id(p) in self._main_ids}

    def follow_mains(self, old: GradStore) -> None:
        """After `old`'s main grads were carried in (a relayout): which hold no gradient, as in `old`
        (a parameter that had no main grad there: where its `.grad` is None)."""
        self.unwritten = {
            id(p) for p in self.mains if (id(p) in old.unwritten if old.is_main(p) else p.grad is None)
        }

    def leaving_main(self, param: torch.Tensor) -> torch.Tensor | None:
        """The `.grad` of a main-grad `param` leaving the buffers (frozen, replaced): its values in its own
        dtype, or None where it holds no gradient (`has_main`: a step must skip it, as stock's None)."""
        return self.view(param).to(param.dtype) if self.has_main(param) else None

    def has_main(self, param: torch.Tensor) -> bool:
        """Whether `param` has a main grad that holds a gradient, as stock's `.grad` is defined: written by a
        backward (here, or on some rank: a sync's used flags) since the last zeroing to None (the model's,
        the optimizer's; a zeroing in place keeps it, as stock's zeroes a defined `.grad`)."""
        return id(param) in self._main_ids and id(param) not in self.unwritten

    def slot(self, param: torch.Tensor) -> tuple[GroupKey, SlotSpec]:
        """`param`'s group key and slot (offset and size in elements within that buffer)."""
        entry = self._entries[param]
        return entry.key, entry.slot

    def holds(self, param: torch.Tensor, grad: torch.Tensor | None) -> bool:
        """Whether `grad` is exactly `param`'s slot (same memory, shape and strides)."""
        if grad is None:
            return False
        entry = self._entries[param]
        view = entry.view
        if grad is view:
            return True
        if view is not entry.local:  # a DTensor parameter's: the same placements over the slot
            if not _dtensor.is_dtensor(grad) or tuple(grad.placements) != tuple(view.placements):  # type: ignore[attr-defined]
                return False
            grad, view = _dtensor.local_of(grad), entry.local
        return (
            grad.device == view.device
            and grad.dtype == view.dtype
            and grad.data_ptr() == view.data_ptr()
            and grad.shape == view.shape
            and grad.stride() == view.stride()
        )

    def place(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """Copy `grad` into `param`'s slot and make the slot its `.grad`; returns the slot (a
        DTensor `grad` is first laid out as the parameter's placements)."""
        entry = self._entries[param]
        refuse_old_grad(param, grad)
        entry.local.copy_(_dtensor.local_gradient(grad.to_dense() if grad.is_sparse else grad, entry.view))
        param.grad = entry.view
        return entry.view

    def take_in(self, params: Sequence[torch.Tensor], zero_empty: bool = False) -> None:
        """Move each `.grad` of `params` that lives outside its slot into it (a routed layer run as plain
        torch, under torch.compile or torch.func; a `.grad` assigned by hand or made with create_graph=True),
        so a sync of the slots sees it; with `zero_empty`, also zero the slots whose `.grad` is None."""
        views, mains = self.views, self._main_ids
        if mains:  # a main grad is the gradient even where `.grad` is None: never zeroed
            for param in [p for p in params if id(p) in mains]:
                # (a low-precision `.grad` from AccumulateGrad: added into the main grad, `.grad` to None)
                grad = param.grad
                if grad is not None:
                    views[id(param)].add_(grad.to_dense() if grad.is_sparse else grad.detach())
                    param.grad = None
                    self.unwritten.discard(id(param))
            params = [p for p in params if id(p) not in mains]
        for param in params:
            grad = param.grad
            if grad is None:
                if zero_empty:
                    self._locals[id(param)].zero_()
            elif grad is not views[id(param)] and not self.holds(param, grad):
                self.place(param, grad)

    def adopt(
        self, buffer: torch.Tensor, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
    ) -> bool:
        """Make `buffer` (a DDP bucket) the flat buffer of its group, with `grads[i]` (views of it) as the
        slot of `params[i]`. Refused (False) unless the bucket holds exactly the group's parameters."""
        key = (buffer.dtype, buffer.device)
        group = [p for p in self.params if self._entries[p].key == key]
        if len(params) != len(group) or {id(p) for p in params} != {id(p) for p in group}:
            return False
        self.buffers[key], self.ddp_bucket = buffer, True
        self._flagged.pop(key, None)  # DDP's bucket has no room after it
        base = int(buffer.storage_offset())
        for param, grad in zip(params, grads):
            # DDP's bucket view (the `.grad` it made) follows the parameter's own strides where it is dense
            # (`Reducer::initialize_bucket_views`); `bucket.gradients()` views are contiguous ones.
            offset = int(grad.storage_offset()) - base
            slot = SlotSpec(offset, grad.numel(), tuple(grad.shape), dense_stride(param))
            self._set_slot(param, key, slot)
            if param.grad is not None:
                param.grad = self._entries[param].view  # same memory, now our view object
        self.runs = self._runs()
        self._seat_cache = None
        self._counted_runs = None
        return True

    def flagged(self, key: GroupKey) -> _Flagged | None:
        """(the group's buffer followed by one flag per parameter, the flags, those parameters), each flag 1
        where the parameter's `.grad` is defined, else 0; None once the buffer is a DDP bucket (`adopt`). A
        sync all-reducing this tensor learns in the same collective which parameters some rank used, where
        stock DDP with find_unused_parameters=True runs an extra all-reduce."""
        found = self._flagged.get(key)
        if found is None:
            return None
        _, flags, members = found
        if self.seated:
            # Asked inside the backward (replicate launching a group's last bucket, when every gradient of the
            # group is final): a seated slot nothing wrote into is unused, as the final callback's `unseat`
            # will find, and as DDP counts a parameter whose AccumulateGrad ran with no gradient.
            entries = self._entries
            GradStore.unseat([s for s in self.seated if entries[s[0]].key == key])
        main = self.has_main  # (a main grad's `.grad` stays None)
        write_flags(flags, [float(param.grad is not None or main(param)) for param in members])
        return found

    def seat(self, params: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """Before a backward: point each of `params` whose `.grad` is None at its slot, filled with -0.0
        (`negative_zero_`), so AccumulateGrad adds into it in place (in C++: no hook, no copy). Returns
        (param, slot, slot version) for `unseat`. The (parameter, slot) pairs and the fill's `spans` are cut
        once per `params` tuple and kept while the slots stay put (this runs before every backward). A
        parameter that no longer fits its slot is left alone and marks the store stale (laid out again)."""
        cached = self._seat_cache
        if cached is None or cached[0] is not params:
            views = self.views
            pairs = [(param, views[id(param)]) for param in params]
            spans = self.spans(params)
            cached = self._seat_cache = (params, pairs, spans, negative_zero_sources(spans))
        _, pairs, spans, sources = cached
        seated = [pair for pair in pairs if pair[0].grad is None]
        if not seated:
            return []
        refused = False
        for param, view in seated:
            try:
                param.grad = view
            except RuntimeError:
                refused = True
        if refused:
            self.stale = True
            seated = [pair for pair in seated if pair[0].grad is pair[1]]
            if not seated:
                return []
        # Slots have version counters of their own (see `_set_slot`), which a fill through a
        # span does not bump: `unseat` compares against the versions read after the fill.
        if len(seated) == len(pairs):
            negative_zero_(spans, sources)  # (no span when every slot has zero elements)
        else:
            negative_zero_([self._locals[id(param)] for param, _ in seated])
        self.seated = [(param, view, view._version) for param, view in seated]
        return self.seated

    def seat_one(self, param: torch.Tensor, view: torch.Tensor) -> None:
        """`seat` `param` alone, inside the backward (its gradient returned to AccumulateGrad)."""
        negative_zero_([_dtensor.local_of(view)])
        param.grad = view
        self.seated.append((param, view, view._version))
        self._seated_ids = ([], {})

    def unseat_final(self, params: Sequence[torch.Tensor]) -> None:
        """Inside a backward, for `params` whose gradients are final (replicate launching their bucket):
        `unseat` those seated, so an unwritten slot has `.grad` None and holds +0.0 (not its -0.0 fill) in the
        sent bucket, as DDP's bucket zeros a parameter without a gradient. One dict read per parameter."""
        if not self.seated:
            return
        found = self._seated_by_id()
        GradStore.unseat([found[id(p)] for p in params if id(p) in found])

    def fresh_seat(self, param: torch.Tensor) -> bool:
        """Whether `param` is seated in the running backward and nothing wrote its slot since the -0.0 fill:
        a routed Function then writes it as an empty `.grad` ("out"), since a scatter would leave -0.0 where
        it writes nothing (stock's fresh gradient: +0.0)."""
        if not self.seated:
            return False
        entry = self._seated_by_id().get(id(param))
        return entry is not None and entry[1]._version == entry[2]

    def _seated_by_id(self) -> dict[int, tuple[torch.Tensor, torch.Tensor, int]]:
        seated = self.seated
        if self._seated_ids[0] is not seated:  # (made once per backward that seats)
            self._seated_ids = (seated, {id(entry[0]): entry for entry in seated})
        return self._seated_ids[1]

    def begin_backward(self) -> None:
        """As a backward begins: the parameters whose uses it sums as stock's, where writing them in one by
        one would round otherwise (docs/design.md, "Routed layers")."""
        if self.uses:  # (else no forward came since the last backward: the same graph's again)
            self.counted, self.uses = self.uses, {}
        self.summed = {
            key
            for key, (param, n, rounded) in self.counted.items()
            if n > 2 or key in self.read_elsewhere or (n > 1 and (param.grad is not None or not rounded))
        }

    def check(self, params: Sequence[torch.Tensor]) -> None:
        """Mark the store stale if one of `params` (main grads' included) no longer fits its slot, or a slot
        view no longer points at its slot (before every backward; by id: `Tensor.__hash__` is Python)."""
        views, mains = self.views, self._main_ids
        for param in params:
            view = views[id(param)]
            # A main grad's slot is float32 for a bfloat16/float16 parameter: its dtypes must
            # differ (equal: the parameter was converted to float32 since), any other's match.
            retyped = (view.dtype != param.dtype) != (id(param) in mains)
            if retyped or view.shape != param.shape or view.device != param.device:
                self.stale = True
                return
        if not self.intact():
            self.stale = True

    def intact(self) -> bool:
        """Whether every slot view still points at its slot. ``param.grad.data = t`` (`nn.Module._apply`
        converting gradients) re-points the view object, which is the `.grad`, at other memory, which the
        hot path's identity tests would trust: the engine lays out again (moving it in) when False."""
        # Both dicts gain their keys together in `_set_slot`, so they iterate in one order.
        return list(map(_data_ptr, self._locals.values())) == list(self._addresses.values())

    @staticmethod
    def unseat(seated: Sequence[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
        """After that backward: a seated slot nothing wrote into goes back to None, as stock leaves the
        `.grad` of a parameter that got no gradient, and is zeroed (a sync must send +0.0, not its -0.0)."""
        unwritten = []
        for param, view, version in seated:
            if view._version == version and param.grad is view:
                param.grad = None
                unwritten.append(_dtensor.local_of(view))  # (a DTensor parameter's: its local slot)
        if unwritten:
            torch._foreach_zero_(unwritten)

    def _set_slot(self, param: torch.Tensor, key: GroupKey, slot: SlotSpec) -> None:
        """Make `slot` of the `key` group's buffer `param`'s, with a new view."""
        buffer = self.buffers[key]
        # `set_`, not a view op: the slot shares the buffer's memory, not its version counter, so `_version`
        # tells whether it was written (AccumulateGrad's in-place add, a Function's out=/addmm_) since seated.
        local = torch.empty(0, dtype=buffer.dtype, device=buffer.device).set_(
            buffer.untyped_storage(), buffer.storage_offset() + slot.offset, slot.shape, slot.stride
        )
        view = _dtensor.grad_of_slot(local, param) if _dtensor.is_dtensor(param) else local
        self._entries[param] = SlotEntry(key, slot, view, local)
        self.views[id(param)] = view
        self._locals[id(param)] = local
        self._addresses[id(param)] = local.data_ptr()

    def _in_buffer_order(self) -> list[tuple[torch.Tensor, SlotEntry]]:
        return sorted(self._entries.items(), key=lambda item: (str(item[1].key), item[1].slot.offset))

    def _runs(self, params: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """1-D views covering exactly the gradient elements of every slot (never the alignment padding),
        adjacent slots merged: what a scale (clipping) may touch. Padding stays zero by construction, so
        whole-buffer norms and syncs may read it. With `params`, the slots of those only."""
        wanted = None if params is None else {id(param) for param in params}
        slots: dict[GroupKey, list[tuple[int, int]]] = {}
        for param, entry in self._in_buffer_order():
            if wanted is not None and id(param) not in wanted:
                continue
            slots.setdefault(entry.key, []).append((entry.slot.offset, entry.slot.offset + entry.slot.numel))
        return self._cut([(key, *run) for key, spans in slots.items() for run in merge_touching(spans)])

    def spans(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """As few 1-D views of the buffers as cover the slots of `params` and no other slot (adjacent slots
        share one, the zero padding between included), so zeroing them is one fill per view."""
        wanted = {id(param) for param in params}
        entries = self._in_buffer_order()
        slots: dict[GroupKey, list[tuple[int, int]]] = {}
        for index, (param, entry) in enumerate(entries):
            if id(param) not in wanted:
                continue
            end = entry.slot.offset + entry.slot.numel
            if index + 1 < len(entries):  # the next slot of this buffer wanted too: up to it
                after, following = entries[index + 1]
                if id(after) in wanted and following.key == entry.key:
                    end = following.slot.offset
            slots.setdefault(entry.key, []).append((entry.slot.offset, end))
        return self._cut([(key, *span) for key, spans in slots.items() for span in merge_touching(spans)])

    def _cut(self, spans: Iterable[tuple[GroupKey, int, int]]) -> list[torch.Tensor]:
        return [self.buffers[key].narrow(0, start, end - start) for key, start, end in spans if end > start]

    def settle(self) -> None:
        """Make the buffers the truth: zero slots whose `.grad` is None (no stale value reaches a norm or
        sync), move in any `.grad` living elsewhere."""
        self.take_in(self.params, zero_empty=True)


@dataclass(frozen=True)
class SlotEntry:
    key: GroupKey
    slot: SlotSpec
    view: torch.Tensor  # the slot as the parameter's .grad (a DTensor parameter's: a DTensor over it)
    local: torch.Tensor  # the slot, shaped and strided like the parameter (its local shard)


_data_ptr = torch.Tensor.data_ptr


# Which live store owns each parameter, by id (docs/design.md, "What is process-wide, and why"). A store
# keeps its parameters alive, so ids are not reused while its entries stand; no weak reference to a
# parameter (it blocks torch.utils.swap_tensors).
_OWNERS: dict[int, weakref.ref[GradStore]] = {}


class LayoutChanged(RuntimeError):
    """The model's parameters changed since the gradient layout was made, as only a new layout follows."""


def refuse_old_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Raise LayoutChanged where `grad` is of another shape than `param` (its ``.data`` re-pointed since)."""
    if grad.shape != param.shape:
        raise LayoutChanged(
            f"a parameter of shape {tuple(param.shape)} holds a .grad of shape {tuple(grad.shape)} from "
            "before its .data was re-pointed, which cannot go into its slot: set it to None first "
            "(model.zero_grad() or optimizer.zero_grad()), then lay out again"
        )


def _claim(store: GradStore) -> Callable[[], Any]:
    """Record `store` as its parameters' owner; returns the one call undoing it (also run on collection)."""
    me = weakref.ref(store)
    ids = [id(param) for param in store.params]
    for param_id in ids:
        _OWNERS[param_id] = me
    return weakref.finalize(store, _forget, me, ids)


def _forget(store: weakref.ref[GradStore], ids: list[int]) -> None:
    for param_id in ids:
        if _OWNERS.get(param_id) == store:  # (not a later store's entry)
            del _OWNERS[param_id]


def find_slot(param: torch.Tensor) -> tuple[GradStore, torch.Tensor] | None:
    """(store, slot view) of `param` if a live store holds it: the layer backwards' lookup (by id, weakly)."""
    ref = _OWNERS.get(id(param))
    store = ref() if ref is not None else None
    if store is None:
        return None
    view = store.views.get(id(param))
    return None if view is None else (store, view)


def count_use(param: torch.Tensor, adds_rounded: bool) -> None:
    """From a routed Function's forward (not a recompute inside a backward): one more read of `param`
    before the next backward (`GradStore.begin_backward`), by a layer that adds into a written slot
    rounded, as AccumulateGrad would, or not (a Linear's weight: in its GEMM)."""
    store = owner_of(param) if graph_task_id() == -1 else None
    if store is not None:
        seen = store.uses.get(id(param))
        store.uses[id(param)] = (param, 1, adds_rounded) if seen is None else (param, seen[1] + 1, seen[2])


def owner_of(param: torch.Tensor) -> GradStore | None:
    """The live store holding `param`'s slot, if any."""
    found = find_slot(param)
    return None if found is None else found[0]


def _check_free(params: Sequence[torch.Tensor]) -> None:
    for param in params:
        if find_slot(param) is not None:
            raise ValueError(
                f"a parameter of shape {tuple(param.shape)} already has its gradient in the flat "
                "buffer of another module FlatGrad was applied to (a parameter's gradient can live "
                "in one flat buffer only): apply FlatGrad once, to the outermost model"
            )


_Scan = tuple[tuple[int, ...], list[torch.Tensor]]


class MainGradGuard:
    """While a store with main grads lives, a torch optimizer step over a main-grad parameter whose `.grad` is
    None raises instead of skipping it silently, and so does one over a parameter outside the groups of a
    by-element ShardedOptimizer over its model (`watch_sharded`) (`register_optimizer_step_pre_hook`,
    removed with the last such store). An optimizer that steps main grads itself sets a true class attribute
    ``steps_main_grads`` (ShardedOptimizer). Why process-wide: docs/design.md, "What is process-wide, and
    why". An optimizer's main-grad parameters are found once and kept (weakly, by optimizer) until its
    groups change or a store with main grads is built."""

    def __init__(self) -> None:
        self._stores: weakref.WeakSet[GradStore] = weakref.WeakSet()
        self._handle: Any = None
        self._builds = 0  # stores with main grads built so far: a kept scan older is redone
        # Per optimizer: `_builds`, its groups' lists and lengths at the scan, its main-grad parameters then.
        self._scans: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Scan] = weakref.WeakKeyDictionary()

    def watch(self, store: GradStore) -> None:
        self._stores.add(store)
        self._builds += 1
        if self._handle is None:
            self._handle = register_optimizer_step_pre_hook(self._check)
        weakref.finalize(store, self._release)

    def watch_sharded(self, store: GradStore, holds: Callable[[torch.Tensor], bool]) -> None:
        """`store` is reduce-scattered for a ShardedOptimizer that holds the parameters `holds` says."""
        store.scattered.holds = holds
        self.watch(store)

    def _release(self) -> None:
        if self._handle is not None and not self._stores:
            self._handle.remove()
            self._handle = None
            self._scans.clear()

    def _check(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if getattr(optimizer, "steps_main_grads", False):
            return
        groups = optimizer.param_groups
        key = (self._builds, *groups_key(groups))
        scan = self._scans.get(optimizer)
        if scan is None or scan[0] != key:
            scan = (key, [p for g in groups for p in g["params"] if _has_main(p) or _outside(p, owner_of(p))])
            with contextlib.suppress(TypeError):  # (an optimizer without weak references: not kept)
                self._scans[optimizer] = scan
        # (frozen: skipped, as by stock; a store laid out again since may own it no more)
        found = [(p, owner_of(p)) for p in scan[1] if p.requires_grad]
        outside = sum(_outside(p, store) for p, store in found)
        if outside:
            raise RuntimeError(
                f"{type(optimizer).__name__}.step() would step {outside} parameter(s) in none of the groups "
                "of the ShardedOptimizer (by element) over their model, which reduce-scatters their "
                "gradients (each rank holds the average only in its own shard) and zeroes them in its "
                "zero_grad: give them a group of that ShardedOptimizer (opt.add_param_group with their "
                "own options), or shard with shard_by='tensor', whose gradients stay whole"
            )
        skipped = sum(p.grad is None and store is not None and store.is_main(p) for p, store in found)
        if skipped:
            raise RuntimeError(
                f"{type(optimizer).__name__}.step() would skip {skipped} bfloat16/float16 "
                "parameter(s) whose gradient is a float32 main grad (grad_dtype='float32': their "
                ".grad stays None): step them with flatgrad.ShardedOptimizer (float32 master "
                "shards, on any number of ranks), or give the optimizer float32 master copies "
                "whose .grad you take from model.main_grad(param)"
            )


def groups_key(groups: list[dict[str, Any]]) -> tuple[int, ...]:
    """What changes when param groups are added or their lists replaced or resized (a kept scan's key)."""
    return (*[id(g["params"]) for g in groups], *[len(g["params"]) for g in groups])


def _has_main(param: torch.Tensor) -> bool:
    store = owner_of(param)
    return store is not None and store.is_main(param)


def _outside(param: torch.Tensor, store: GradStore | None) -> bool:
    """Whether `param`'s `store` is reduce-scattered for a ShardedOptimizer holding `param` in no group."""
    holds = store.scattered.holds if store is not None else None
    return holds is not None and not holds(param)


MAIN_GRAD_GUARD = MainGradGuard()


@dataclass
class Prescale:
    """A store's prescaling state: the factor while such a backward runs (None otherwise) and the ids of the
    parameters whose slots were written so scaled."""

    factor: float | None = None
    written: set[int] = field(default_factory=set)
    # The parameters whose AccumulateGrad scales what plain autograd brings (`scale_incoming`).
    hooked: set[int] = field(default_factory=set)

    def start(self, factor: float | None) -> None:
        self.written.clear()
        self.factor = factor


@dataclass(eq=False)
class Scattered:
    """A store's reduce-scatter state (ShardedOptimizer): whether its gradients are reduce-scattered, not
    zeroed since (`marked`); one ScatteredGrad alias per slot view in parameter order, made once (`aliases`);
    whether they act as plain tensors (`unguarded`: during a relayout); the collective gathering all ranks'
    shards of the averages into whole plain gradients (`gather`: before a relayout, every rank together);
    whether the ShardedOptimizer holds a parameter in a group (`holds`: `MainGradGuard` refuses another)."""

    marked: bool = False
    aliases: tuple[torch.Tensor, ...] = ()
    unguarded: bool = False
    gather: Callable[[], None] | None = None
    holds: Callable[[torch.Tensor], bool] | None = None


def aligned_zeros(numel: int, key: GroupKey, align_bytes: int) -> torch.Tensor:
    """A zeroed 1-D tensor whose first element sits on an `align_bytes` boundary."""
    dtype, device = key
    buffer = torch.zeros(numel, dtype=dtype, device=device)
    misalignment = buffer.data_ptr() % align_bytes
    if misalignment == 0:
        return buffer
    itemsize = buffer.element_size()
    raw = torch.zeros(numel + align_bytes // itemsize, dtype=dtype, device=device)
    start = (-raw.data_ptr() % align_bytes) // itemsize
    return raw.narrow(0, start, numel)


def negative_zero_(tensors: Sequence[torch.Tensor], sources: list[torch.Tensor] | None = None) -> None:
    """Fill `tensors` with -0.0 (both parts of a complex element): how a seated slot starts. AccumulateGrad's
    in-place add then leaves exactly the incoming gradient (``-0.0 + x`` is ``x`` bit for bit, ``-0.0``
    included, where ``+0.0 + -0.0`` is ``+0.0``). A slot left without a gradient is zeroed by
    `GradStore.unseat`, and every reader of a slot with `.grad` None zeroes it first. On the CPU: one foreach
    copy from a -0.0 scalar per dtype (`sources`, from `negative_zero_sources`); on accelerators two fused
    passes (zero, negate), where such a copy would launch a kernel per tensor (docs/performance.md, "Seated
    slots start at -0.0")."""
    sources = negative_zero_sources(tensors) if sources is None else sources
    if sources is not None:
        if sources:
            torch._foreach_copy_(list(tensors), sources)
        return
    on_cpu = [t for t in tensors if t.device.type == "cpu"]
    if on_cpu:
        negative_zero_(on_cpu)
    elsewhere = [t for t in tensors if t.device.type != "cpu"]
    torch._foreach_zero_(elsewhere)
    torch._foreach_neg_(elsewhere)


def negative_zero_sources(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """`negative_zero_`'s 0-d -0.0 per tensor (one per dtype) if all are on the CPU, else None."""
    if any(t.device.type != "cpu" for t in tensors):
        return None
    scalars = {dtype: torch.zeros((), dtype=dtype).neg_() for dtype in {t.dtype for t in tensors}}
    return [scalars[t.dtype] for t in tensors]


def host_tensor(values: Sequence[bool | float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device`. For an accelerator it is staged in pinned memory and copied without
    blocking: a copy from pageable memory would make the host wait for everything queued on the stream (the
    whole backward), where the copy needs only to be ordered after it. Pinned blocks come from torch's caching
    host allocator, which does not hand a block out again before the copy that reads it has run."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    if device.type != "cuda":  # (pinned staging is CUDA's; other backends copy as they do)
        return torch.tensor(values, dtype=dtype).to(device)
    staged = torch.tensor(values, dtype=dtype, pin_memory=True)
    return staged.to(device, non_blocking=True)


def write_flags(flags: torch.Tensor, values: Sequence[float]) -> None:
    """Write `values` (one per element) into `flags` without waiting on the device."""
    if all(values):
        flags.fill_(1)  # the usual step: no host data to send
    else:
        flags.copy_(host_tensor(values, flags.dtype, flags.device), non_blocking=True)


def scale_(tensors: Sequence[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply `tensors` in place by the 0-d `coef` (a clipping coefficient), one foreach per device. A CPU
    `coef` of exactly 1 skips the pass (``x * 1.0`` is ``x`` bit for bit); on accelerators the multiply always
    runs: reading `coef` would sync (docs/performance.md, "A clip whose factor is 1")."""
    if coef.device.type == "cpu" and bool(coef == 1.0):
        return
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_device.setdefault(tensor.device, []).append(tensor)
    for device, group in by_device.items():
        torch._foreach_mul_(group, coef.to(device))


def read_here(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, marked as read by the current CUDA stream (`Tensor.record_stream`), where it may have been
    made on another: an AccumulateGrad hook runs on the stream its node was made on (replicate keeps the nodes
    from its construction), a final callback on the caller's. Torch's caching allocator then does not hand its
    memory out again, once it is freed, before that read has run. Elsewhere a no-op."""
    if tensor.is_cuda:
        tensor.record_stream(torch.cuda.current_stream(tensor.device))
    return tensor
