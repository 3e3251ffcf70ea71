"""`GradStore`: the flat gradient buffers, each parameter's slot in them (kept in a
`flatgrad._slot_table.SlotTable`), and the slots' `.grad` around a backward."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from flatgrad._buffer_ops import aligned_zeros, write_flags
from flatgrad._main_grads import MAIN_GRAD_GUARD, MainGrads
from flatgrad._prescale import Prescale
from flatgrad._slot_registry import REGISTRY
from flatgrad._slot_table import SlotEntry, SlotTable
from flatgrad.layout import GroupKey, SlotSpec, dense_stride, plan_layout

_Flagged = tuple[torch.Tensor, torch.Tensor, tuple[torch.nn.Parameter, ...]]
# The last parameter tuple `seat` was given, its (parameter, slot) pairs and `spans`.
_SeatCache = tuple[Sequence[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]


class GradStore:
    """One zero-initialised 1-D tensor per (dtype, device) group, and each parameter's slot.

    Each slot has one view, made once: it is what `.grad` is set to, so "is `.grad` the
    slot?" is an identity test on the hot path. Nothing relies on AccumulateGrad stealing a
    tensor (which would need the view to have no other reference): flatgrad sets `.grad`.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        align_bytes: int,
        multiple: int = 1,
        grad_dtype: str | None = None,
    ) -> None:
        self.params = tuple(params)
        REGISTRY.check_free(self.params)
        self.stale = False  # set when a parameter no longer fits its slot
        self._seat_cache: _SeatCache | None = None  # dropped when the slots move
        self.buffers: dict[GroupKey, torch.Tensor] = {}
        self._table = SlotTable(self.buffers)
        self._entries: dict[torch.Tensor, SlotEntry] = self._table.entries
        self._views: dict[int, torch.Tensor] = self._table.views  # by id: no Tensor hash
        # Per group: the buffer followed, in the same memory, by one used-flag element per
        # parameter; those flags; and those parameters (see `flagged`).
        self._flagged: dict[GroupKey, _Flagged] = {}
        # What `seat` last seated, until that backward's final callback `unseat`s it (`flagged`
        # may ask before). A nested backward that seats nothing leaves it alone.
        self.seated: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self.prescale = Prescale()  # (see `flatgrad._prescale`)
        for key, group in plan_layout(self.params, align_bytes, multiple, grad_dtype).items():
            members = tuple(self.params[index] for index in group.param_indices)
            raw = aligned_zeros(group.numel + len(members), key, align_bytes)
            self.buffers[key] = raw.narrow(0, 0, group.numel)
            self._flagged[key] = (raw, raw.narrow(0, group.numel, len(members)), members)
            for index, slot in zip(group.param_indices, group.slots):
                self._table.set(self.params[index], key, slot)
        self.runs = self._table.runs()
        # Parameters whose slot is a main grad (float32 for a bfloat16/float16 parameter):
        # their `.grad` stays None, the slot alone holds the gradient (see `main_grad`).
        mains = [p for p in self.params if self._entries[p].view.dtype != p.dtype]
        self._main_grads = MainGrads(mains, self._views, self.spans(mains))
        self.mains, self._main_ids = self._main_grads.params, self._main_grads.ids
        REGISTRY.claim(self)
        if self.mains:
            MAIN_GRAD_GUARD.watch(self)

    def spans(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """1-D views of the buffers that cover the slots of `params` and no other slot, as
        few as the layout allows: slots adjacent in a buffer (alignment padding between
        them included, which is zero anyway) share one view. Zeroing these is one fill
        per view instead of one per parameter."""
        return self._table.spans(params)

    def release(self) -> None:
        """Stop owning the parameters (before a rebuild replaces this store)."""
        REGISTRY.forget(weakref.ref(self), [id(param) for param in self.params])

    def __contains__(self, param: object) -> bool:
        return isinstance(param, torch.Tensor) and param in self._entries

    @property
    def views(self) -> dict[int, torch.Tensor]:
        """Each held parameter's slot view, by ``id(param)`` (the backward's lookup)."""
        return self._views

    def view(self, param: torch.Tensor) -> torch.Tensor:
        """`param`'s slot, shaped and strided like the parameter (always the same tensor)."""
        return self._entries[param].view

    def is_main(self, param: torch.Tensor) -> bool:
        """Whether `param`'s slot is a main grad: a float32 slot of a bfloat16/float16
        parameter, which is its gradient while `.grad` stays None."""
        return id(param) in self._main_ids

    def zero_mains(self) -> None:
        """Zero every main grad (a few fills: adjacent slots share one)."""
        self._main_grads.zero()

    def slot(self, param: torch.Tensor) -> tuple[GroupKey, SlotSpec]:
        """`param`'s group key and slot (offset and size in elements within that buffer)."""
        entry = self._entries[param]
        return entry.key, entry.slot

    def flat_view(self, param: torch.Tensor) -> torch.Tensor:
        """`param`'s slot as a 1-D view."""
        entry = self._entries[param]
        return self.buffers[entry.key].narrow(0, entry.slot.offset, entry.slot.numel)

    def holds(self, param: torch.Tensor, grad: torch.Tensor | None) -> bool:
        """Whether `grad` is exactly `param`'s slot (same memory, shape and strides)."""
        if grad is None:
            return False
        view = self._entries[param].view
        return grad is view or (
            grad.device == view.device
            and grad.dtype == view.dtype
            and grad.data_ptr() == view.data_ptr()
            and grad.shape == view.shape
            and grad.stride() == view.stride()
        )

    def place(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """Copy `grad` into `param`'s slot and make the slot its `.grad`; returns the slot."""
        slot = self._entries[param].view
        slot.copy_(grad.to_dense() if grad.is_sparse else grad.detach())
        param.grad = slot
        return slot

    def take_in(self, params: Sequence[torch.Tensor], zero_empty: bool = False) -> None:
        """Move the `.grad` of each of `params` that lives outside its slot (a routed layer
        that ran as plain torch, under torch.compile or torch.func; a `.grad` assigned by
        hand, or produced with create_graph=True) into the slot, so a sync of the slots sees
        it; with `zero_empty`, also zero the slots of those whose `.grad` is None."""
        views = self._views
        if self._main_ids:  # a main grad is the gradient even where `.grad` is None: never zeroed
            params = self._main_grads.take_in(params)
        for param in params:
            grad = param.grad
            if grad is None:
                if zero_empty:
                    views[id(param)].zero_()
            elif grad is not views[id(param)] and not self.holds(param, grad):
                self.place(param, grad)

    def adopt(
        self, buffer: torch.Tensor, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
    ) -> bool:
        """Make `buffer` (a DDP bucket) the flat buffer of its group, with `grads[i]` (views
        of it) as the slot of `params[i]`. Refused (False) unless the bucket holds exactly
        the group's parameters: a group split over several buckets is not one buffer."""
        key = (buffer.dtype, buffer.device)
        group = [p for p in self.params if self._entries[p].key == key]
        if len(params) != len(group) or {id(p) for p in params} != {id(p) for p in group}:
            return False
        self.buffers[key] = buffer
        self._flagged.pop(key, None)  # DDP's bucket has no room after it
        base = int(buffer.storage_offset())
        for param, grad in zip(params, grads):
            # DDP's bucket view (the `.grad` it made) follows the parameter's own strides where
            # it is dense (`Reducer::initialize_bucket_views`, as the layout contract); the
            # `bucket.gradients()` views are contiguous ones over the same elements.
            offset = int(grad.storage_offset()) - base
            slot = SlotSpec(offset, grad.numel(), tuple(grad.shape), dense_stride(param))
            self._table.set(param, key, slot)
            if param.grad is not None:
                param.grad = self._entries[param].view  # same memory, now our view object
        self.runs = self._table.runs()
        self._seat_cache = None
        return True

    def flagged(self, key: GroupKey) -> _Flagged | None:
        """(the group's buffer followed by one flag per parameter, the flags, those
        parameters), with each flag set to 1 where the parameter's `.grad` is defined and 0 where it is None;
        None once the buffer is a DDP bucket (`adopt`). A sync that all-reduces this one
        tensor instead of the buffer learns in the same collective which parameters some
        rank used: a flag other than 0 (sums and averages of 0s and 1s). That is what stock DDP
        with find_unused_parameters=True learns from its extra all-reduce of used flags."""
        found = self._flagged.get(key)
        if found is None:
            return None
        _, flags, members = found
        if self.seated:
            # Asked inside the backward (DataParallel launching a group's last bucket, when
            # every gradient of the group is final): a seated slot nothing wrote into is
            # unused, as the final callback's `unseat` will find, and as DDP counts a
            # parameter whose AccumulateGrad ran with no gradient.
            entries = self._entries
            GradStore.unseat([s for s in self.seated if entries[s[0]].key == key])
        mains = self._main_ids  # a main grad always counts as used (its `.grad` stays None)
        write_flags(flags, [float(param.grad is not None or id(param) in mains) for param in members])
        return found

    def seat(self, params: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """Before a backward: point every one of `params` whose `.grad` is None at its slot,
        zeroed, so that AccumulateGrad adds the incoming gradient into it in place (in C++:
        no hook, no copy). Returns (param, slot, slot version) for `unseat`. When every
        `.grad` was None the slots are zeroed in a few fills (`spans`). The (parameter, slot)
        pairs and the spans are cut once per `params` tuple and kept while the slots stay
        where they are: this runs before every backward, once per parameter.

        A parameter whose shape, dtype or device no longer matches its slot (``param.data``
        replaced, a conversion behind the wrapper's back) is left alone and marks the store
        stale, so the wrapper lays the buffers out again before the next forward.
        """
        cached = self._seat_cache
        if cached is None or cached[0] is not params:
            views = self._views
            pairs = [(param, views[id(param)]) for param in params]
            cached = self._seat_cache = (params, pairs, self.spans(params))
        _, pairs, spans = cached
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
        # Slots have version counters of their own (see `SlotTable.set`), which a fill through a
        # span does not bump: `unseat` compares against the versions read after the fill.
        zeroed = spans if len(seated) == len(pairs) else [view for _, view in seated]
        if zeroed:  # none when every seated parameter has zero elements
            torch._foreach_zero_(zeroed)
        self.seated = [(param, view, view._version) for param, view in seated]
        return self.seated

    def check(self, params: Sequence[torch.Tensor]) -> None:
        """Mark the store stale if one of `params` (the main grads' among them) no longer fits
        its slot, or a slot view no longer points at its slot (before every backward: by id,
        as `Tensor.__hash__` is Python)."""
        views, mains = self._views, self._main_ids
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
        """Whether every slot view still points at its slot. ``param.grad.data = t`` (older
        training code, `nn.Module._apply` converting gradients) re-points the view object
        itself, which is the `.grad`, at other memory; the identity tests of the hot path
        would then trust a tensor the buffers no longer hold, so the wrapper lays the
        buffers out again (and moves that `.grad`'s values in) when this is False."""
        return self._table.intact()

    @staticmethod
    def unseat(seated: Sequence[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
        """After that backward: a seated slot nothing wrote into goes back to None, as stock
        leaves the `.grad` of a parameter that got no gradient."""
        for param, view, version in seated:
            if view._version == version and param.grad is view:
                param.grad = None

    def settle(self) -> None:
        """Make the buffers the truth: zero the slots of parameters whose `.grad` is None
        (stale values must not reach a norm or a sync) and move any `.grad` that lives
        elsewhere into its slot (`take_in`)."""
        self.take_in(self.params, zero_empty=True)
