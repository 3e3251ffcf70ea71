"""`GradEngine`: one model's gradient store and seater, built together, and what each forward does about them
(lay out again, seat or not under DDP).

`FlatGrad(model)` gives the model one (``engine_of(model)``); `replicate`, `ShardedOptimizer` and the DDP
hook's state reach the store through it. The engine holds the model weakly (the model holds the engine).

The layout is fixed when FlatGrad is applied, as DDP, FSDP2 and Megatron-Core fix theirs: conversions
(``.to()``, ``.double()``, also of a submodule) and ``requires_grad`` toggles lay the buffers out again; a
parameter added, replaced, removed or re-pointed at a tensor of another shape since is refused (a RuntimeError
naming it) at the next norm or sync, or as the next backward starts, before anything moves, until
``model.relayout()`` lays the buffers out for the model as it is now."""

from __future__ import annotations

import logging
import operator
import weakref
from itertools import chain
from typing import Any

import torch
from torch import nn

from flatgrad import _comm
from flatgrad._backward import ForwardPlan, Participant, Seater, watch
from flatgrad._buffer import GradStore, LayoutChanged, refuse_old_grad
from flatgrad._config import FlatGradConfig
from flatgrad._routing import route_layers
from flatgrad._torch_compat import graph_task_id

logger = logging.getLogger(__name__)

# (module, name, parameter, requires_grad, dtype, device, shape) as they were at the last build
# (module, None for the model itself: the engine holds its model weakly)
_Watched = tuple[nn.Module | None, str, nn.Parameter, bool, torch.dtype, torch.device, torch.Size]
_trainable = operator.attrgetter("requires_grad")
# (every module but the model itself, which the engine holds weakly; the parameters in every
# module's ``_parameters`` dict, the model's first, in order; the children likewise)
_Held = tuple[tuple[nn.Module, ...], tuple[Any, ...], tuple[Any, ...]]
_PARAMETERS, _MODULES = operator.attrgetter("_parameters"), operator.attrgetter("_modules")
_SPARSE_LAYERS = (nn.Embedding, nn.EmbeddingBag)


class GradEngine:
    """Builds, checks and rebuilds the gradient layout of its model."""

    def __init__(self, model: nn.Module, config: FlatGradConfig, slot_multiple: int = 1) -> None:
        self._model = weakref.ref(model)
        self.config = config
        self.slot_multiple = slot_multiple  # slots start on multiples of this many elements (ZeRO)
        self.store: GradStore | None = None
        self.seater: Seater | None = None
        self._watched: tuple[_Watched, ...] = ()
        # Every module, and what they held at the last build (`_moved`).
        self._held: _Held = ((), (), ())
        self.others: tuple[nn.Parameter, ...] = ()  # the model's parameters without a slot
        self.frozen: tuple[nn.Parameter, ...] = ()
        # Of those, the ones of layers that make sparse gradients (`sparse_ids`): stock's
        # sparse `.grad`, outside the buffers; the rest of `others` is frozen.
        self.sparse: tuple[nn.Parameter, ...] = ()
        self.ddp = _comm.DDPEdge()  # whether a DDP runs the forwards, its hook, its Join
        # A replicated model's bucket sync and sync flag for the next forward (`expect_sync`),
        # and the running forward's, taken by `before_forward`.
        self._next_sync: tuple[Participant, bool] | None = None
        self._forward_sync: tuple[Participant, bool] | None = None
        # The parameters hold no hook of the seater's once the model is collected (the main
        # grads' hooks live on the parameters themselves); `_hooks` is the current seater's list.
        self._hooks: list[Any] = []
        weakref.finalize(model, _remove_all, self._hooks).atexit = False
        self.build()

    @property
    def model(self) -> nn.Module:
        model = self._model()
        assert model is not None, "the model is gone"
        return model

    def use_slot_multiple(self, multiple: int) -> GradStore:
        """Lay out again with every slot starting on a multiple of `multiple` elements
        (ZeRO-1: equal shards per bucket)."""
        self.slot_multiple = multiple
        self.build()
        assert self.store is not None, "the engine is not built"
        return self.store

    def refuse_sparse(self, what: str) -> None:
        """Raise unless every trainable parameter has a slot: flatgrad's own syncs average
        the flat buffers only, so a sparse gradient (kept outside them) would stay local.
        The same on every rank (it depends on the model only)."""
        sparse = [p for p in self.sparse if p.requires_grad]
        if sparse:
            raise ValueError(
                f"{what} averages the flat buffers only, and {len(sparse)} parameter(s) of "
                "sparse embeddings (sparse=True) keep their sparse gradients outside them; "
                "synchronise this model with DDP(model, ...) (it all-reduces sparse gradients), "
                "or make the embeddings dense (sparse=False)"
            )

    @torch.compiler.disable
    def before_forward(self) -> None:
        if torch.is_grad_enabled():
            self.current()
        self._forward_sync, self._next_sync = self._next_sync, None  # this forward's (or None)
        self.ddp.before_forward()

    @torch.compiler.disable
    def after_forward(self, output: object) -> None:
        seater = self.seater
        # Under a DDP, seat nothing: its reducer copies each gradient into its bucket (the flat
        # buffer with `ddp_kwargs()`: one pass in C++), and with find_unused_parameters counts a
        # parameter used when its `.grad` is defined as its hook runs: a seated slot would leave
        # zeros where stock keeps None. Routed layers and placed parameters still write slots.
        alone = self.ddp.after_forward()
        # A replicated model's forward (`expect_sync`, just before) binds its bucket sync too.
        bucket_sync, sync = self._forward_sync if self._forward_sync is not None else (None, False)
        self._forward_sync = None
        if seater is not None or bucket_sync is not None:
            watch(output, ForwardPlan(seater, alone, bucket_sync, sync))
        if seater is not None and graph_task_id() == -1:  # (a recompute inside a backward: not)
            seater.store.prescale.factor = None  # a backward that raised left it on: see `_prescale`

    def expect_sync(self, bucket_sync: Participant, sync: bool) -> None:
        """From a replicated model's forward, before it runs this engine's: the backward through
        this forward's output is `bucket_sync`'s too, averaging when `sync`."""
        self._next_sync = (bucket_sync, sync)

    def build(self) -> None:
        """Lay out the buffers for the current trainable parameters; route new layers."""
        with torch.inference_mode(False), torch.no_grad():  # buffers must be normal tensors
            model = self.model
            params, old = trainable_parameters(model), self.store
            for param in params:  # (before anything moves; a main grad of the old shape too, unless zero)
                if param.grad is not None:
                    refuse_old_grad(param, param.grad)
                main = old.view(param) if old is not None and old.is_main(param) else None
                if main is not None and main.shape != param.shape and bool(main.any()):
                    refuse_old_grad(param, main)
            scattered = old.scattered if old is not None else None  # (unguarded: to be dropped or refused)
            if scattered is not None and scattered.marked and not scattered.unguarded and scattered.gather:
                scattered.gather()  # (reduce-scattered: the averages whole first, to be carried)
            if self.seater is not None:
                self.seater.retire()  # a graph still alive must not seat into old buffers
            if old is not None:
                _detach_leaving(old, params)
                old.release()
            routed, elsewhere = route_layers(model, self.config)
            self.store = store = GradStore(
                params, self.config.align_bytes, self.slot_multiple, self.config.grad_dtype
            )
            store.read_elsewhere = elsewhere
            if old is not None:
                _carry_mains(old, store)
                store.follow_mains(old)
                store.unsynced = old.unsynced  # (local gradients moved in: still to be averaged)
                store.uses, store.counted = old.uses, old.counted  # (reads before a relayout)
                store.read_elsewhere |= old.read_elsewhere
            self.seater = Seater(store, params, routed, self)
            self._hooks[:] = self.seater.hooks
            self._watched = _watch_list(model) or ()
            self._held = _held_by_module(model)
            held = {id(p) for p in params}
            # by id, once each: a tied parameter is held by two modules
            self.others = tuple({id(e[2]): e[2] for e in self._watched if id(e[2]) not in held}.values())
            sparse = sparse_ids(model)
            self.sparse = tuple(p for p in self.others if id(p) in sparse)
            self.frozen = tuple(p for p in self.others if id(p) not in sparse)
            store.settle()  # move gradients that already exist into the buffers

    def refresh(self) -> GradStore:
        """The store, laid out again first if a parameter was converted, reshaped through
        its ``.grad``, or (un)frozen; raises RuntimeError if one was added, replaced,
        removed or re-pointed at another shape (see the module doc). O(parameters): norms
        and syncs call it (as stock ``clip_grad_norm_(model.parameters())`` walks the model);
        the walk over the modules only when `_moved` saw something."""
        store, watched = self.store, self._watched
        self.check_layout()  # (then the parameters that moved are followed)
        if self._converted(watched) or store is None or store.stale or not store.intact():
            logger.info("flatgrad: parameters converted or (un)frozen; laying out the buffers again")
            self.build()
        assert self.store is not None, "the engine is not built"
        return self.store

    def _converted(self, watched: tuple[_Watched, ...]) -> bool:
        """Whether a parameter of the build was converted or (un)frozen since (frozen: not while
        a DDP's bucket is the buffer, as `toggle_optimizer` under DDP needs); raises
        (`_refuse_moved`) for one re-pointed at another shape, before any relayout."""
        follow = not (self.store is not None and _keeps_frozen(self.store))
        for _, _, param, requires_grad, dtype, device, shape in watched:
            if param.shape != shape:
                _refuse_moved(self.model, watched, _watch_list(self.model) or watched)
            frozen = param.requires_grad != requires_grad and (follow or param.requires_grad)
            if frozen or param.dtype != dtype or param.device != device:
                return True
        return False

    def _moved(self) -> bool:
        """Whether a module holds other parameters or children than at the last build: one
        identity test each, in C loops over the modules' ``_parameters`` and ``_modules`` dicts
        (every registration, replacement and deletion writes those; a dict assigned whole too)."""
        modules, params, children = self._held
        modules = (self.model, *modules)  # (the model weakly: the engine must not keep it alive)
        param_dicts, child_dicts = tuple(map(_PARAMETERS, modules)), tuple(map(_MODULES, modules))
        return (
            sum(map(len, param_dicts)) != len(params)
            or sum(map(len, child_dicts)) != len(children)
            or not all(map(operator.is_, chain.from_iterable(map(dict.values, param_dicts)), params))
            or not all(map(operator.is_, chain.from_iterable(map(dict.values, child_dicts)), children))
        )

    def rebuilt_seater(self) -> Seater:
        self.refresh()
        assert self.seater is not None, "the engine is not built"
        return self.seater

    def current(self) -> GradStore:
        """The store, after what every training forward checks in O(1) (a slot found stale, a
        parameter without a slot unfrozen: then `refresh`). A held parameter frozen or
        converted in place is found by `refresh` at the next norm or sync, or as staleness by
        the next backward; one added or replaced, by `check_layout` as a backward starts."""
        store = self.store
        if store is None or store.stale or any(p.requires_grad for p in self.frozen):  # (unfrozen)
            return self.refresh()
        return store

    def check_layout(self) -> None:
        """Raise if a parameter was added, replaced, removed or re-pointed since the layout
        was made (`refresh`'s refusal), after one identity test per parameter and child
        (`_moved`); a backward that accumulates calls it as it starts. Parameters that only
        moved to other modules are followed; `torch.func.functional_call`'s temporaries are
        gone by then (or plain tensors, as under `torch.func.grad`: kept)."""
        if not self._moved():
            return
        current = _watch_list(self.model)
        if current is not None:
            _refuse_moved(self.model, self._watched, current)
            self._watched, self._held = current, _held_by_module(self.model)

    def steady(self) -> GradStore:
        """`current`, and `refresh` when a held parameter was frozen since: for a replicated
        model's forward, whose buckets must not keep communicating a frozen slot.
        `torch.func.functional_call`'s temporaries keep the layout (gradients local, as DDP's)."""
        store = self.current()
        return store if all(map(_trainable, store.params)) else self.refresh()

    def summary_lines(self) -> list[str]:
        """What `FlatGrad` logs once as it is applied: the buffers, and a note on the main
        grads when `grad_dtype` keeps some (a torch optimizer over their parameters raises at
        its step: see MainGradGuard)."""
        store = self.refresh()
        parts = [
            f"{key[0]}@{key[1]}: {buf.numel()} elements, {buf.numel() * buf.element_size()} bytes"
            for key, buf in store.buffers.items()
        ]
        lines = [f"{len(store.buffers)} buffer(s) for {len(store.params)} parameters ({'; '.join(parts)})"]
        if store.mains:
            lines.append(
                f"{len(store.mains)} bfloat16/float16 parameters keep float32 main grads (grad_dtype) "
                "and their .grad stays None: step them with flatgrad.ShardedOptimizer (float32 "
                "master shards), or from model.main_grad(param) (see docs/mixed-precision.md)"
            )
        return lines


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that get a slot: trainable, with a dense gradient. (parameters()
    yields a shared, tied, parameter once.)"""
    sparse = sparse_ids(model)
    return [param for param in model.parameters() if param.requires_grad and id(param) not in sparse]


def sparse_ids(model: nn.Module) -> set[int]:
    """Ids of the parameters of layers that make sparse gradients: `nn.Embedding` and
    `nn.EmbeddingBag` with ``sparse=True``, as DDP tells them (`produces_sparse_gradient` in
    `DistributedDataParallel._build_params_for_reducer`). They keep stock's sparse `.grad`
    (a dense slot would cost a full table per step and break `torch.optim.SparseAdam`)."""
    return {
        id(param)
        for module in model.modules()
        if isinstance(module, _SPARSE_LAYERS) and module.sparse
        for param in module._parameters.values()
        if param is not None
    }


def _watch_list(model: nn.Module) -> tuple[_Watched, ...] | None:
    """Every (module, name) that holds a parameter, with what a layout depends on; None while
    a module holds a plain tensor there (torch.func.functional_call reparametrizes that way)."""
    entries = []
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None:
                continue
            if not isinstance(param, nn.Parameter):
                return None
            owner = None if module is model else module
            entries.append((owner, name, param, param.requires_grad, param.dtype, param.device, param.shape))
    return tuple(entries)


def _held_by_module(model: nn.Module) -> _Held:
    modules = tuple(model.modules())
    params = tuple(chain.from_iterable(m._parameters.values() for m in modules))
    return modules[1:], params, tuple(chain.from_iterable(m._modules.values() for m in modules))


def _refuse_moved(model: nn.Module, before: tuple[_Watched, ...], now: tuple[_Watched, ...]) -> None:
    """Raise LayoutChanged, naming the parameters, if one was added, replaced, removed or re-pointed at a
    tensor of another shape since the layout was made (`before`). A parameter that moved to another module
    (``convert_sync_batchnorm`` rebuilds layers around their parameters) keeps its slot."""
    if len(before) == len(now) and all(
        a[0] is b[0] and a[1] == b[1] and a[2] is b[2] and a[2].shape == a[6] for a, b in zip(before, now)
    ):
        return
    was = {id(e[2]): e for e in before}
    staying = {id(e[2]) for e in now}
    keys = {(id(e[0]), e[1]) for e in before}
    prefixes = {id(m): prefix for prefix, m in model.named_modules(remove_duplicate=False)}

    def name(entry: _Watched) -> str:
        prefix = prefixes.get(id(entry[0]))
        return entry[1] if not prefix else f"{prefix}.{entry[1]}"

    changes = []
    for entry in now:
        old = was.get(id(entry[2]))
        if old is None:
            changes.append(f"{name(entry)} ({'replaced' if (id(entry[0]), entry[1]) in keys else 'added'})")
        elif entry[2].shape != old[6]:
            changes.append(f"{name(entry)} (re-pointed: shape {tuple(old[6])} -> {tuple(entry[2].shape)})")
    now_keys = {(id(e[0]), e[1]) for e in now}

    def removed(entry: _Watched) -> str:  # (by name where its module is still the model's)
        kept = entry[0] is None or id(entry[0]) in prefixes
        return f"{name(entry) if kept else f'{entry[1]} of a {type(entry[0]).__name__}'} (removed)"

    changes += [removed(e) for e in before if id(e[2]) not in staying and (id(e[0]), e[1]) not in now_keys]
    if changes:
        raise LayoutChanged(
            "the model's parameters changed after FlatGrad laid out its gradient buffers: "
            + ", ".join(dict.fromkeys(changes[:6]))
            + (f" and {len(changes) - 6} more" if len(changes) > 6 else "")
            + "; the layout is fixed when FlatGrad is applied (as DDP's and FSDP's): call "
            "model.relayout() after changing its parameters (before building replicate and the "
            "optimizer over them), or apply FlatGrad to the model once it has its final parameters"
        )


def _keeps_frozen(store: GradStore) -> bool:
    """Whether a parameter frozen since `store` was laid out keeps its slot: in a DDP's bucket (DDP keeps its
    buckets), or while the slots' gradients are still to be averaged (`GradStore.unsynced`) or stepped from
    reduce-scattered shards, as DDP averages a frozen parameter's no_sync() gradient and a torch optimizer
    steps a frozen parameter that holds a gradient."""
    return store.ddp_bucket or store.unsynced or store.scattered.marked


def _detach_leaving(store: GradStore, staying: list[nn.Parameter]) -> None:
    """A parameter that leaves the buffers (frozen, replaced) keeps its `.grad` values in a
    tensor of its own, so the old buffer can be freed."""
    kept = {id(p) for p in staying}
    for param in store.params:
        if id(param) in kept:
            continue
        if store.is_main(param):  # (a main grad's `.grad` is None: its values become one)
            param.grad = store.leaving_main(param)
        elif store.holds(param, param.grad):
            param.grad = param.grad.clone()  # type: ignore[union-attr]


def _carry_mains(old: GradStore, new: GradStore) -> None:
    """Move the main grads of `old` into `new` (laid out again): into the new main grad
    of a parameter that keeps one, or as the `.grad` of one that no longer has one (a
    conversion to float32: the slot is then its `.grad`)."""
    for param in old.mains:
        if param not in new or new.view(param).shape != param.shape or old.view(param).shape != param.shape:
            continue  # (a main grad of the old shape: zero, see `build`)
        if not old.has_main(param):
            continue  # (zero, and no gradient: nothing to carry)
        values = old.view(param)
        if new.is_main(param):
            new.view(param).copy_(values)
        elif param.grad is None and new.view(param).dtype == values.dtype:
            new.place(param, values)


def _remove_all(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
