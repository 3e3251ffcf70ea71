"""`SlotTable`: the table a `GradStore` keeps of each parameter's slot (its group, its place
in that group's flat buffer, one view made once) and the 1-D views it cuts over slots."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from flatgrad.layout import GroupKey, SlotSpec


@dataclass(frozen=True)
class SlotEntry:
    key: GroupKey
    slot: SlotSpec
    view: torch.Tensor  # the slot, shaped and strided like the parameter; becomes its .grad


class SlotTable:
    """Each parameter's slot in `buffers` (the store's dict of flat buffers, shared: a slot
    set after the store replaced a buffer points into the new one).

    Args:
        buffers: the flat buffer of each (dtype, device) group.
    """

    def __init__(self, buffers: dict[GroupKey, torch.Tensor]) -> None:
        self.buffers = buffers
        self.entries: dict[torch.Tensor, SlotEntry] = {}
        self.views: dict[int, torch.Tensor] = {}  # by id: the backward's lookup, no Tensor hash
        self._addresses: dict[int, int] = {}  # by id: where each view points (see `intact`)

    def set(self, param: torch.Tensor, key: GroupKey, slot: SlotSpec) -> None:
        """Make `slot` of the `key` group's buffer `param`'s, with a new view."""
        buffer = self.buffers[key]
        # `set_` rather than a view op: the slot shares the buffer's memory but has a
        # version counter of its own, so `_version` tells whether this slot was written
        # (AccumulateGrad's in-place add, a Function's out=/addmm_) since it was seated.
        view = torch.empty(0, dtype=buffer.dtype, device=buffer.device).set_(
            buffer.untyped_storage(), buffer.storage_offset() + slot.offset, slot.shape, slot.stride
        )
        self.entries[param] = SlotEntry(key, slot, view)
        self.views[id(param)] = view
        self._addresses[id(param)] = view.data_ptr()

    def intact(self) -> bool:
        """Whether every slot view still points at its slot (see `GradStore.intact`)."""
        # Both dicts gain their keys together in `set`, so they iterate in one order.
        return list(map(_data_ptr, self.views.values())) == list(self._addresses.values())

    def _in_buffer_order(self) -> list[tuple[torch.Tensor, SlotEntry]]:
        return sorted(self.entries.items(), key=lambda item: (str(item[1].key), item[1].slot.offset))

    def runs(self) -> list[torch.Tensor]:
        """1-D views covering exactly the gradient elements of every slot (never the
        alignment padding), adjacent slots merged: what a scale (clipping) may touch.
        Padding stays zero by construction, so whole-buffer norms and syncs may read it."""
        spans: dict[GroupKey, list[list[int]]] = {}
        for _, entry in self._in_buffer_order():
            runs = spans.setdefault(entry.key, [])
            if runs and runs[-1][1] == entry.slot.offset:
                runs[-1][1] += entry.slot.numel
            else:
                runs.append([entry.slot.offset, entry.slot.offset + entry.slot.numel])
        return self._cut([(key, start, end) for key, runs in spans.items() for start, end in runs])

    def spans(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """1-D views of the buffers that cover the slots of `params` and no other slot, as
        few as the layout allows: slots adjacent in a buffer (alignment padding between
        them included, which is zero anyway) share one view."""
        wanted = {id(param) for param in params}
        spans: list[tuple[GroupKey, int, int]] = []
        entries = self._in_buffer_order()
        open_span = False  # whether the previous slot of the same buffer extended spans[-1]
        for index, (param, entry) in enumerate(entries):
            same_buffer = index > 0 and entries[index - 1][1].key == entry.key
            if id(param) not in wanted:
                open_span = False
                continue
            end = entry.slot.offset + entry.slot.numel
            if open_span and same_buffer:
                spans[-1] = (entry.key, spans[-1][1], end)
            else:
                spans.append((entry.key, entry.slot.offset, end))
            open_span = True
        return self._cut(spans)

    def _cut(self, spans: Iterable[tuple[GroupKey, int, int]]) -> list[torch.Tensor]:
        return [self.buffers[key].narrow(0, start, end - start) for key, start, end in spans if end > start]


_data_ptr = torch.Tensor.data_ptr
