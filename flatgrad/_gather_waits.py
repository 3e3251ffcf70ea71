"""`overlap_param_gather`'s waits in the forward: where each bucket's parameter all-gather
must be waited for, learned in one forward.

A module's forward pre hook waits for the buckets holding its own parameters, just before
it runs: the parameters are read there. A module whose forward never runs has its
parameters read by an ancestor instead (``F.linear(h, self.head.weight)`` in its parent's
forward, `nn.MultiheadAttention` reading its `out_proj`): those buckets are waited for in
the pre hook of the nearest ancestor that does run. Which modules run is learned in the
first forward (every module hooked for it, every gather waited for at its start); then only
the modules that wait keep a hook. A module skipped in that forward and run later still
waits for its own parameters itself.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from flatgrad._torch_compat import register_load_pre_hook


class ForwardWaits:
    """The hooks of one ShardedOptimizer with `overlap_param_gather` on its model; `engine`
    is its `ShardEngine` (`bucket_indices`, `wait_gather`)."""

    def __init__(self, engine: Any, model: nn.Module) -> None:
        self.engine = engine
        self._hooked = list(model.modules())
        self._own = {id(m): engine.bucket_indices(list(m.parameters(recurse=False))) for m in self._hooked}
        self._ran: set[int] = set()
        self._learning = []
        for module in self._hooked:
            note = functools.partial(self._note, id(module))
            self._learning.append(module.register_forward_pre_hook(note, prepend=True))
        self._learning.append(model.register_forward_hook(self._learn))
        self._waits: list[Any] = []
        # the model's state_dict and load_state_dict read or write every parameter: wait for all
        self._always = [
            model.register_state_dict_pre_hook(self._wait_all),
            register_load_pre_hook(model, self._wait_all),
        ]

    def _note(self, key: int, *hook_args: Any) -> None:
        self._ran.add(key)
        self.engine.wait_gather()  # (learning: nothing is known yet, so everything now)

    def _learn(self, *hook_args: Any) -> None:
        """After the first forward: each module's buckets go to itself and, when it did not
        run, to the first module that ran up each of its ancestries (a module shared by two
        parents may be read by both), whose pre hooks wait for them from now on."""
        parents: dict[int, list[nn.Module]] = {}
        for module in self._hooked:
            for child in module.children():
                parents.setdefault(id(child), []).append(module)
        waits: dict[int, set[int]] = {}
        for module in self._hooked:
            indices = self._own[id(module)]
            if not indices:
                continue
            waits.setdefault(id(module), set()).update(indices)  # (one skipped now may run later)
            stack = [] if id(module) in self._ran else list(parents.get(id(module), ()))
            seen: set[int] = set()
            while stack:
                up = stack.pop()
                if id(up) in seen:
                    continue
                seen.add(id(up))
                if id(up) in self._ran:
                    waits.setdefault(id(up), set()).update(indices)
                else:
                    stack.extend(parents.get(id(up), ()))
        self._remove(self._learning)
        by_id = {id(module): module for module in self._hooked}
        self._hooked, self._own, self._ran = [], {}, set()  # (no references kept to the model)
        for key, indices in waits.items():
            hook = functools.partial(_wait_for, self.engine, tuple(sorted(indices)))
            # (first: a pre hook of the user's, weight_norm's for one, may read the parameters)
            self._waits.append(by_id[key].register_forward_pre_hook(hook, prepend=True))

    def _wait_all(self, *hook_args: Any) -> None:
        self.engine.wait_gather()

    @staticmethod
    def _remove(handles: list[Any]) -> None:
        for handle in handles:
            handle.remove()
        handles.clear()

    def remove(self) -> None:
        """Remove every hook (the optimizer is gone)."""
        for handles in (self._learning, self._waits, self._always):
            self._remove(handles)


def _wait_for(engine: Any, indices: tuple[int, ...], *hook_args: Any) -> None:
    engine.wait_gather(indices)
