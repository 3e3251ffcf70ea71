"""`overlap_param_gather`'s waits in the forward: where to wait for each bucket's all-gather, learned once.

A module's forward pre hook waits for its own parameters' buckets. Parameters may be read first elsewhere (by
an ancestor), so the first grad-enabled forward through replicate after the optimizer is built learns, under a
`TorchFunctionMode`, which running module first reads each bucket's parameters, and from then on that module's
pre hook waits for the bucket too (the cases, and a module that never runs: docs/data-parallel.md,
"Overlapped parameter gather"). Then only the modules that wait keep a hook. A module skipped in that forward
and run later still waits for its own parameters."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from flatgrad._bucket_sync import BucketSync
from flatgrad._flatgrad import ModelHook
from flatgrad._torch_compat import register_load_pre_hook, tree_leaves
from flatgrad._zero import ShardEngine

# Tensor methods and attributes that read metadata only: not a read of the parameter's values.
_METADATA = frozenset(
    {"size", "dim", "numel", "stride", "element_size", "is_floating_point", "is_complex", "is_contiguous"}
)
_METADATA_ATTRS = frozenset({
    "shape", "dtype", "device", "ndim", "layout", "requires_grad", "is_leaf", "is_cuda", "is_sparse", "names",
})  # fmt: skip


class ForwardWaits:
    """The hooks of one ShardedOptimizer with `overlap_param_gather` on its model; `engine` is its
    `ShardEngine` (`bucket_indices`, `wait_gather`), `sync` its replicate's `BucketSync`, whose forward runs
    the model inside `learning` (`BucketSync.run_forwards_in`) until a forward has taught the waits."""

    def __init__(self, engine: ShardEngine, model: nn.Module, sync: BucketSync) -> None:
        self.engine, self.sync = engine, sync
        self._hooked = list(model.modules())
        # each parameter's buckets (by id), and each module's own parameters' (by the module's id)
        self._buckets_of = {
            id(p): found
            for m in self._hooked
            for p in m.parameters(recurse=False)
            if (found := engine.bucket_indices([p]))
        }
        self._own = {
            id(m): tuple(
                sorted({i for p in m.parameters(recurse=False) for i in self._buckets_of.get(id(p), ())})
            )
            for m in self._hooked
        }
        self._reads: _FirstReads | None = None  # in the learning forward
        self._ran: set[int] = set()
        self._learning = []
        for module in self._hooked:
            note = ModelHook(functools.partial(self._note, id(module)))
            self._learning.append(module.register_forward_pre_hook(note, prepend=True))
            self._learning.append(module.register_forward_hook(ModelHook(self._leave), always_call=True))
        self._learning.append(model.register_forward_hook(ModelHook(self._learn)))
        sync.run_forwards_in(self.learning)
        self._waits: list[Any] = []
        # the model's state_dict and load_state_dict read or write every parameter: wait for all
        self._always = [
            model.register_state_dict_pre_hook(ModelHook(self._wait_all)),
            register_load_pre_hook(model, ModelHook(self._wait_all)),
        ]

    @contextlib.contextmanager
    def learning(self) -> Iterator[None]:
        """Around the model's forward in replicate's: a forward with grad enabled runs under `_FirstReads`
        (left however it ends; one that raises teaches nothing). Not under no_grad: a mode disables torch's
        inference fast paths (`nn.TransformerEncoderLayer`'s), which would change that forward's output."""
        if not torch.is_grad_enabled() or self._reads is not None:
            yield
            return
        self._ran = set()
        self._reads = _FirstReads(self._buckets_of)
        try:
            with self._reads:
                yield
        finally:
            self._reads = None

    def _note(self, key: int, *hook_args: Any) -> None:
        self.engine.wait_gather()  # (nothing is known yet, so everything now)
        if self._reads is not None:
            self._ran.add(key)
            self._reads.running.append(key)

    def _leave(self, *hook_args: Any) -> None:
        if self._reads is not None and self._reads.running:
            self._reads.running.pop()

    def _learn(self, *hook_args: Any) -> None:
        """After the learning forward: each module's buckets go to itself, to the module that first read them,
        and, when it did not run and a parameter of its was not seen read (a read no torch function shows:
        TorchScript, a C++ extension), to the first module that ran up each of its ancestries (a module shared
        by two parents may be read by both), whose pre hooks wait for them from now on."""
        reads = self._reads
        if reads is None:
            return  # a forward that does not learn (no_grad, or not through replicate)
        parents: dict[int, list[nn.Module]] = {}
        for module in self._hooked:
            for child in module.children():
                parents.setdefault(id(child), []).append(module)
        waits: dict[int, set[int]] = {}
        for index, reader in reads.first.items():
            waits.setdefault(reader, set()).add(index)
        for module in self._hooked:
            indices = self._own[id(module)]
            if not indices:
                continue
            waits.setdefault(id(module), set()).update(indices)  # (one skipped now may run later)
            if id(module) in self._ran or all(id(p) in reads.read for p in module.parameters(recurse=False)):
                continue
            stack, seen = list(parents.get(id(module), ())), set()
            while stack:
                up = stack.pop()
                if id(up) in seen:
                    continue
                seen.add(id(up))
                if id(up) in self._ran:
                    waits.setdefault(id(up), set()).update(indices)
                else:
                    stack.extend(parents.get(id(up), ()))
        self.sync.run_forwards_in(None)
        self._remove(self._learning)
        by_id = {id(module): module for module in self._hooked}
        self._hooked, self._own, self._buckets_of, self._ran = [], {}, {}, set()  # (no references kept)
        for key, waited in waits.items():
            hook = ModelHook(functools.partial(_wait_for, self.engine, tuple(sorted(waited))))
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
        self.sync.run_forwards_in(None, replacing=self.learning)
        for handles in (self._learning, self._waits, self._always):
            self._remove(handles)


class _FirstReads(TorchFunctionMode):
    """The learning forward's reads: for each bucket (`buckets_of`: a parameter's id to its buckets), the id
    of the innermost module of the model running when a torch function first took one of its parameters (reads
    while none runs, replicate's and FlatGrad's own, do not count), and the ids of the parameters read."""

    def __init__(self, buckets_of: dict[int, tuple[int, ...]]) -> None:
        super().__init__()
        self.buckets_of = buckets_of
        self.running: list[int] = []  # the ids of the modules whose forward is running
        self.first: dict[int, int] = {}
        self.read: set[int] = set()

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Collection[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if self.running and not _metadata(func):
            buckets_of, reader = self.buckets_of, self.running[-1]
            for leaf in tree_leaves((args, kwargs)):
                indices = buckets_of.get(id(leaf))
                if indices:
                    self.read.add(id(leaf))
                    for index in indices:
                        self.first.setdefault(index, reader)
        return func(*args, **kwargs)


def _metadata(func: object) -> bool:
    """Whether `func` reads a tensor's metadata only (``w.shape``, ``w.size()``)."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", "") in _METADATA_ATTRS
    return name in _METADATA and getattr(torch.Tensor, name, None) is func


def _wait_for(engine: ShardEngine, indices: tuple[int, ...], *hook_args: Any) -> None:
    engine.wait_gather(indices)
