"""`FlatGrad`: wraps a model so that all its gradients live in flat per-(dtype, device) buffers."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import operator
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Variable
from torch.nn.utils import parametrize
from torch.utils._pytree import tree_leaves

from flatgrad import _norms, comm, functional
from flatgrad._names import PlainNames
from flatgrad._scattered import refuse_scattered
from flatgrad._watch import LayoutWatch
from flatgrad.buffer import GradStore, scale_
from flatgrad.config import FlatGradConfig, resolve_config
from flatgrad.layout import GroupKey

logger = logging.getLogger(__name__)

_PREFIX = "module."
_execution_engine: Any = Variable._execution_engine  # type: ignore[attr-defined]


# (module, name, parameter, requires_grad, dtype, device, shape) as they were at the last build
_Watched = tuple[nn.Module, str, nn.Parameter, bool, torch.dtype, torch.device, torch.Size]
# Unrouted parameters below this many elements are seated (zero fill + AccumulateGrad's
# in-place add, no Python per parameter); larger ones are copied in by a pre-hook (one pass).
_SEAT_MAX_NUMEL = 1 << 15
_trainable = operator.attrgetter("requires_grad")
_SPARSE_LAYERS = (nn.Embedding, nn.EmbeddingBag)


# Model methods that generic per-module walkers call on every module they meet
# (``m.reset_parameters()`` if ``hasattr(m, "reset_parameters")``, as torch's meta-device
# materialisation does): through the wrapper they would reach the model twice.
_NOT_FORWARDED = frozenset({"reset_parameters"})
# Private attributes that libraries set on the model they are handed and read back from the
# module they give DDP: `DDP._set_params_and_buffers_to_ignore_for_model(model, names)`
# (names are the plain model's, which DDP(flat) walks).
_FORWARDED_PRIVATE = frozenset({"_ddp_params_and_buffers_to_ignore"})


def _forwarded(model: nn.Module, name: str) -> bool:
    """Whether `name`, not the wrapper's own, is read and written on the wrapped `model`:
    its public attributes (``flat.generate``, ``flat.accepts_loss_kwargs``,
    ``flat.gradient_checkpointing_enable()``), which libraries handed the wrapped model
    (transformers' Trainer) read, call and set as on the plain one. One rule for reads and
    writes, so a value written through the wrapper is the one read back."""
    return (
        not name.startswith("_")
        and name not in _NOT_FORWARDED
        and not hasattr(FlatGrad, name)
        and hasattr(model, name)
    )


class FlatGrad(PlainNames):
    """Wraps `model`; every trainable parameter's `.grad` lives in `grad_buffers`.

    Linear and Embedding layers (those that keep torch's own `forward`) run their backward
    through Functions that write weight gradients straight into the buffer. Every other
    parameter's `.grad` is pointed at its zeroed slot when a backward through the wrapper's
    output starts, so AccumulateGrad adds into the buffer in place (no hook per parameter).
    """

    def __init__(
        self,
        model: nn.Module,
        config: FlatGradConfig | dict[str, Any] | str | Path | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        super().__init__()
        self.flatgrad_config = resolve_config(config)
        self.module = model
        self._watch_model()
        self._store: GradStore | None = None
        self._seater: _Seater | None = None
        self._watched: tuple[_Watched, ...] = ()
        self._others: tuple[nn.Parameter, ...] = ()  # the model's parameters without a slot
        self._frozen: tuple[nn.Parameter, ...] = ()
        # Of those, the ones of layers that make sparse gradients (`_sparse_ids`): stock's
        # sparse `.grad`, outside the buffers; the rest of `_others` is frozen.
        self._sparse: tuple[nn.Parameter, ...] = ()
        self._generation = -1
        self._ddp_forwards = -1  # forwards since ddp_kwargs() without allreduce_hook; -1: not asked
        # The DDP that synchronised the last synchronised forward into bucket views, and the
        # groups whose buffer is its current bucket (`allreduce_hook` adopted it).
        self._ddp_state: comm.DDPState | None = None
        self._adopted: set[GroupKey] = set()
        self._slot_multiple = 1  # slots start on multiples of this many elements (sharding)
        if not _trainable_parameters(model):
            raise ValueError(
                "model must have at least one parameter with requires_grad=True (and a dense "
                "gradient: sparse embeddings keep theirs outside the flat buffers), got none"
            )
        self._build()
        self.register_state_dict_post_hook(_strip_prefix)
        self.register_load_state_dict_pre_hook(_add_prefix)
        logger.info("flatgrad: %s", self._summary())

    def __getstate__(self) -> dict[str, Any]:
        # The store's views and the seater are rebuilt by `__setstate__`.
        state = self.__dict__.copy()
        state.update(
            _store=None,
            _seater=None,
            _watched=(),
            _others=(),
            _sparse=(),
            _frozen=(),
            _generation=-1,
            _watch=None,
            _ddp_state=None,
            _adopted=set(),
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "config" in state:  # pickled before the wrapper's own config became flatgrad_config
            state["flatgrad_config"] = state.pop("config")
        super().__setstate__(state)
        self._watch_model()
        self._build()

    # Eager under torch.compile(flat) (the frame only: what it calls is compiled unless
    # disabled itself). The bookkeeping around the model is disabled as a whole, so Dynamo
    # sees none of it; `_call_module` is where it starts tracing the model.
    @torch.compiler.disable(recursive=False)
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        ddp_state = self._before_forward()
        output = self._call_module(*args, **kwargs)
        if torch.is_grad_enabled():
            self._after_forward(output, ddp_state)
        return output

    @torch.compiler.disable
    def _before_forward(self) -> comm.DDPState | None:
        self._current_store()
        if self._ddp_forwards >= 0:
            self._ddp_forwards = comm.note_forward_without_hook(self._ddp_forwards)
        ddp_state = comm.bucket_view_ddp(self._ddp_state)
        if ddp_state is not self._ddp_state and ddp_state is not None:
            self._ddp_state, self._adopted = ddp_state, set()  # another DDP, or its buckets moved
        return ddp_state

    @torch.compiler.disable
    def _after_forward(self, output: Any, ddp_state: comm.DDPState | None) -> None:
        seater = self._seater
        if seater is None:
            return
        # Under a DDP that synchronises this backward into buckets that are not the flat
        # buffers (its own copies, or bucket views `allreduce_hook` has not adopted yet):
        # seat nothing, the gradients take stock's way into DDP's buckets. DDP's reducer
        # leaves the `.grad` of a parameter no rank used untouched, so a seated zero would
        # survive where stock keeps None (see `comm.bucket_view_ddp`).
        alone = not comm.under_ddp()
        if ddp_state is not None:
            seater.seating = len(self._adopted) == len(seater.store.buffers)
        else:
            seater.seating = alone or not comm.ddp_will_sync()
        seater.alone = alone
        seater.watch(output)

    def _call_module(self, *args: Any, **kwargs: Any) -> Any:
        # Under torch.compile(flat) the (disabled) forward frame runs eagerly and this frame
        # is where Dynamo starts tracing: a frame of flatgrad's, so the wrapped model is
        # traced as one graph even when its root is a torch container (nn.Sequential), whose
        # own frames Dynamo would skip, compiling each child apart.
        return self.module(*args, **kwargs)

    # --- the plain model's names (the walks are `PlainNames`'; state_dict, functional_call) --

    @property
    def config(self) -> Any:
        """The wrapped model's ``config`` where it has one (a transformers model's, which
        `Trainer`, accelerate and peft read and write through the model they are given);
        otherwise this wrapper's `FlatGradConfig`, which `flatgrad_config` always is."""
        inner = self.__dict__.get("_modules", {}).get("module")
        if inner is not None and hasattr(inner, "config"):
            return inner.config
        return self.flatgrad_config

    @config.setter
    def config(self, value: Any) -> None:
        inner = self.__dict__.get("_modules", {}).get("module")
        if inner is None or not hasattr(inner, "config"):
            raise AttributeError(
                "FlatGrad's own config is fixed when wrapping (flatgrad_config); "
                "wrap the model again to change it"
            )
        inner.config = value

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is None or not (
                name in _FORWARDED_PRIVATE
                or name in inner._modules
                or name in inner._parameters
                or name in inner._buffers
                or _forwarded(inner, name)
            ):
                raise
            # A plain-model name (``flat.fc`` is ``flat.module.fc``), or a public attribute
            # of the model (see `_forwarded`).
            return getattr(inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        inner = self.__dict__.get("_modules", {}).get("module")
        if (
            inner is None
            or name in self.__dict__
            or name.startswith("_")
            or hasattr(type(self), name)
            or not (
                name in inner._parameters
                or name in inner._buffers
                or name in inner._modules
                or _forwarded(inner, name)
            )
        ):
            super().__setattr__(name, value)
        elif (
            name in inner._parameters
            and isinstance(value, torch.Tensor)
            and not isinstance(value, nn.Parameter)
        ):
            # torch.func.functional_call(flat, {"<top-level name>": tensor}) swaps a plain tensor
            # in for the model's parameter, as it does on the plain model
            inner._parameters[name] = value  # type: ignore[assignment]
        else:
            setattr(inner, name, value)  # a plain-model name: ``flat.w = ...`` is ``flat.module.w = ...``

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """The wrapped model's `load_state_dict`: same keys, and errors that name them as
        the plain model does. (Nested in another module, e.g. ``DDP(flat)``, the keys go
        through a pre-hook that adds the ``module.`` prefix.)"""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    @property
    def grad_buffers(self) -> dict[GroupKey, torch.Tensor]:
        """The flat gradient buffers, one per (dtype, device); every `.grad` is a view of one."""
        store = self._refresh()
        store.settle()
        return dict(store.buffers)

    # --- building and re-building ---------------------------------------------------------

    def _watch_model(self) -> None:
        """Watch the model's registrations (`LayoutWatch`) while this wrapper lives; when
        it is collected the model is as it was before wrapping (plain dicts, torch's
        forwards), unless another wrapper still holds it."""
        self._watch = watch = LayoutWatch()
        weakref.finalize(self, watch.close, _unroute).atexit = False
        self._cover()

    def _cover(self) -> None:
        """Watch this wrapper and every module of the model not watched yet; the root dicts
        the wrapper shares with the model are then the watched ones (`PlainNames`)."""
        self._watch.cover(self)
        self._share_root()

    def _build(self) -> None:
        """Lay out the buffers for the current trainable parameters; route new layers."""
        with torch.inference_mode(False), torch.no_grad():  # buffers must be normal tensors
            params = _trainable_parameters(self.module)
            old = self._store
            if self._seater is not None:
                self._seater.retire()  # a graph still alive must not seat into old buffers
            if old is not None:
                _detach_leaving(old, params)
                old.release()
            routed = _route_layers(self.module, self.flatgrad_config)
            self._store = store = GradStore(params, self.flatgrad_config.align_bytes, self._slot_multiple)
            self._adopted = set()  # new buffers: no DDP bucket is one of them
            self._seater = _Seater(store, params, routed, self)
            self._watched = _watch_list(self.module) or ()
            held = {id(p) for p in params}
            # by id, once each: a tied parameter is held by two modules
            self._others = tuple({id(e[2]): e[2] for e in self._watched if id(e[2]) not in held}.values())
            sparse = _sparse_ids(self.module)
            self._sparse = tuple(p for p in self._others if id(p) in sparse)
            self._frozen = tuple(p for p in self._others if id(p) not in sparse)
            self._cover()
            self._generation = self._watch.generation
            store.settle()  # move gradients that already exist into the buffers

    def _refresh(self) -> GradStore:
        """The store, laid out again first if the model's parameters changed: replaced,
        added, removed, (un)frozen, converted or reshaped. O(parameters); forward calls it
        only when something was registered since, norms and syncs always (as stock
        `clip_grad_norm_(model.parameters())` walks the model too)."""
        store = self._store
        if store is None or store.stale or not store.intact() or self._layout_changed():
            logger.info("flatgrad: parameters changed after wrapping; laying out the buffers again")
            self._build()
        self._generation = self._watch.generation
        assert self._store is not None, "FlatGrad is not built"
        return self._store

    def _layout_changed(self) -> bool:
        if self._watch.changed(self._generation):
            self._cover()  # a module added since is watched from now on
            current = _watch_list(self.module)
            if current is None:
                return False  # reparametrized for a moment (torch.func.functional_call): keep
            if len(current) != len(self._watched) or any(
                a[:2] != b[:2] or a[2] is not b[2] for a, b in zip(current, self._watched)
            ):
                return True
        for module, name, param, requires_grad, dtype, device, shape in self._watched:
            current_param = module._parameters.get(name)
            if current_param is not param:
                # a plain tensor there is functional_call's temporary: keep the layout
                return isinstance(current_param, nn.Parameter) or current_param is None
            if (
                param.requires_grad != requires_grad
                or param.dtype != dtype
                or param.device != device
                or param.shape != shape
            ):
                return True
        return False

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> FlatGrad:
        # .to(), .double(), .half(), .cuda() ... convert parameters and their .grad out of
        # the buffers; lay the buffers out again for the new dtypes/devices.
        super()._apply(fn, recurse)
        if getattr(self, "_store", None) is not None:
            self._build()
        return self

    def _rebuilt_seater(self) -> _Seater:
        self._refresh()
        assert self._seater is not None, "FlatGrad is not built"
        return self._seater

    def _checked_store(self) -> GradStore:
        """The store, rebuilt first if the model's parameters changed behind the wrapper."""
        return self._refresh()

    def _current_store(self) -> GradStore:
        """The store, laid out again first only on what the per-step paths (every forward,
        DataParallel's forward, the DDP hook) can see in O(1): a parameter registered since,
        a slot found stale during a backward, a parameter without a slot unfrozen. The rest
        (a held parameter frozen, converted or re-pointed in place) is found by the full walk
        of `_refresh` at the next norm or sync, or as staleness by the next backward."""
        store = self._store
        if (
            store is None
            or self._watch.changed(self._generation)
            or store.stale
            or any(p.requires_grad for p in self._frozen)  # unfrozen: nothing else tells
        ):
            return self._refresh()
        return store

    def _steady_store(self) -> GradStore:
        """`_current_store`, and the full walk of `_refresh` when a held parameter was frozen
        since (one `requires_grad` read per parameter): for DataParallel's forward, whose
        buckets must not keep communicating a frozen slot. `torch.func.functional_call`'s
        temporaries (plain tensors) keep the layout: their gradients stay local, as DDP's."""
        store = self._current_store()
        return store if all(map(_trainable, store.params)) else self._refresh()

    def _summary(self) -> str:
        buffers = self._checked_store().buffers
        parts = [
            f"{key[0]}@{key[1]}: {buf.numel()} elements, {buf.numel() * buf.element_size()} bytes"
            for key, buf in buffers.items()
        ]
        num_params = len(self._checked_store().params)
        return f"{len(buffers)} buffer(s) for {num_params} parameters ({'; '.join(parts)})"

    # --- flat-buffer operations -----------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Like `nn.Module.zero_grad`, for every parameter of the model (frozen ones too);
        with set_to_none=False the buffered gradients are one fill per buffer."""
        store = self._refresh()
        if set_to_none:
            for param in store.params + self._others:
                param.grad = None
            return
        for param in store.params:  # (a ScatteredGrad, or a `.grad` outside its slot)
            if param.grad is not None and param.grad is not store.view(param):
                param.grad = store.view(param)
        for buffer in store.buffers.values():
            buffer.zero_()
        for param in self._others:
            _zero_stock(param)

    def _grads_and_norms(
        self, norm_type: float
    ) -> tuple[GradStore, list[torch.Tensor], list[torch.Tensor], torch.dtype]:
        """(store, gradients outside it, the per-piece float64 norms whose `norm_type` norm
        is the total, the total's dtype). For a positive order a whole buffer is one piece
        (its padding and the slots of parameters without a gradient are zero, so they add
        nothing), its norm accumulated in chunks (`flatgrad._norms`); order 0 and negative
        orders are defined by torch per gradient tensor, so each is its own piece."""
        store = self._refresh()
        store.settle()
        others = [p.grad for p in self._others if p.grad is not None]
        if norm_type > 0:
            pieces = list(store.buffers.values())
        else:
            pieces = [p.grad for p in store.params if p.grad is not None]
        pieces += others
        norms = [_norms.vector_norm(t, norm_type) for t in pieces]
        dtypes = [_norms.norm_dtype(t.dtype) for t in pieces]
        dtype = functools.reduce(torch.promote_types, dtypes, torch.float32)
        return store, others, norms, dtype

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of all gradients together, as `torch.nn.utils.clip_grad_norm_` computes
        it, but accumulated in float64 over chunks of each buffer: within about 1e-9
        (float32 gradients) or 1e-7 (bfloat16/float16) of the float64 norm at any size, and
        returned in at least float32 (stock's bfloat16 norm keeps 3 digits). Parameters
        whose `.grad` is None count as absent; frozen parameters that still hold a `.grad`
        count, a tied one once."""
        norm_type = _check_norm_type(norm_type)
        refuse_scattered(self._store, "flat.grad_norm()")
        _, _, norms, dtype = self._grads_and_norms(norm_type)
        return _norms.total_norm(norms, norm_type, dtype)

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` on the flat buffers:
        scales every gradient in place by ``min(1, max_norm / (total_norm + 1e-6))``, with
        the total norm of `grad_norm` (more exact than stock's). Only gradient elements are
        scaled, never the alignment padding, which stays zero; on the CPU a factor of
        exactly 1 skips the pass (see `flatgrad.buffer.scale_`)."""
        norm_type = _check_norm_type(norm_type)
        refuse_scattered(self._store, "flat.clip_grad_norm_()")
        store, others, norms, dtype = self._grads_and_norms(norm_type)
        total = _norms.total_norm(norms, norm_type, dtype)
        if not norms:
            return total
        if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
            raise RuntimeError(
                f"the total norm of order {norm_type} of the gradients is non-finite, so it "
                "cannot be clipped; pass error_if_nonfinite=False to clip anyway"
            )
        scale_(store.runs + others, torch.clamp(float(max_norm) / (total + 1e-6), max=1.0))
        return total

    # --- synchronisation (the communication itself lives in flatgrad.comm) --------------

    def all_reduce_grads(self, process_group: Any = None, wire_dtype: torch.dtype | None = None) -> None:
        """Without DDP: average all gradients over `process_group` (default: the world),
        one all-reduce per buffer. Call it after backward, before the optimizer step.
        Afterwards `.grad` is as stock DDP with find_unused_parameters=True leaves it (None
        only for a parameter no rank used)."""
        store = self._refresh()
        self._refuse_sparse("all_reduce_grads")
        comm.all_reduce_grads(store, process_group, wire_dtype)

    def _refuse_sparse(self, what: str) -> None:
        """Raise unless every trainable parameter has a slot: flatgrad's own syncs average
        the flat buffers only, so a sparse gradient (kept outside them) would stay local.
        The same on every rank (it depends on the model only)."""
        sparse = [p for p in self._sparse if p.requires_grad]
        if sparse:
            raise ValueError(
                f"{what} averages the flat buffers only, and {len(sparse)} parameter(s) of "
                "sparse embeddings (sparse=True) keep their sparse gradients outside them; "
                "synchronise this model with DDP(flat, ...) (it all-reduces sparse gradients), "
                "or make the embeddings dense (sparse=False)"
            )

    def ddp_kwargs(self) -> dict[str, Any]:
        """Constructor arguments for ``DDP(flat, **flat.ddp_kwargs())``: the zero-copy,
        one-all-reduce-per-buffer path together with `allreduce_hook` (a warning follows
        if the hook has not run after two steps)."""
        self._ddp_forwards = max(self._ddp_forwards, 0)
        return comm.ddp_kwargs(self._refresh())

    def comm_state(
        self, process_group: Any = None, wire_dtype: torch.dtype | None = None
    ) -> comm.FlatGradCommState:
        """State for ``ddp.register_comm_hook(flat.comm_state(), flatgrad.allreduce_hook)``.

        `wire_dtype` (torch.bfloat16 or torch.float16) all-reduces a compressed copy and
        decompresses into the buffer, like torch's bf16/fp16 compress hooks.
        """
        return comm.FlatGradCommState(self, process_group, wire_dtype)


class _Seater:
    """Points `.grad` of the unrouted parameters at their zeroed slots when a backward
    through the wrapper's output starts, and puts back None where that backward delivered
    nothing (from an autograd final callback), so `.grad` is None exactly where stock has it.

    One prehook per output node per forward, whatever the number of parameters: that, a
    zero fill and a loop that sets `.grad` replace a Python hook per parameter per backward.
    A parameter used outside the wrapper's output, or a backward that does not go through
    it, still gets a correct `.grad` (outside the buffer); the next norm or sync moves it in.
    """

    def __init__(
        self, store: GradStore, params: list[nn.Parameter], routed: set[int], wrapper: FlatGrad
    ) -> None:
        self.store = store
        unrouted = [p for p in params if id(p) not in routed]
        self.params = tuple(p for p in unrouted if p.numel() < _SEAT_MAX_NUMEL)  # seated ones
        # Large unrouted parameters (a conv, an attention projection): a zero fill plus an
        # in-place add would be two passes over the gradient where one copy will do, and a
        # Python hook costs nothing next to it: a pre-hook on AccumulateGrad copies in.
        self._placed = tuple(p for p in unrouted if p.numel() >= _SEAT_MAX_NUMEL)
        self._routed = tuple(p for p in params if id(p) in routed)  # their Functions write the slot
        self._wrapper = weakref.ref(wrapper)
        self._task = -1
        self._retired = False
        self.seating = True  # False: the next backward seats nothing (set by the forward)
        self.alone = True  # False: a DDP's reducer places the next backward's gradients
        self._accumulators: list[Any] = []  # a parameter holds its AccumulateGrad node weakly
        self._hooks: list[Any] = []
        for param in self._placed:
            self._hook(param)

    def _hook(self, param: nn.Parameter) -> None:
        with torch.enable_grad():
            node: Any = param.view_as(param).grad_fn.next_functions[0][0]  # type: ignore[union-attr]
        self._hooks.append(node.register_prehook(functools.partial(_place_incoming, self.store, param)))
        self._accumulators.append(node)

    def retire(self) -> None:
        self._retired = True
        for handle in self._hooks:  # a graph still alive must not write into old buffers
            handle.remove()

    def watch(self, output: Any) -> None:
        """Hook the autograd nodes that produced `output` (see `output_nodes`)."""
        for node in output_nodes(output):
            node.register_prehook(self._on_backward)

    def _on_backward(self, grad_outputs: Any) -> None:
        if self._retired or torch.is_grad_enabled():  # create_graph: grads stay differentiable
            return
        if torch.compiler.is_compiling():
            return  # compiled autograd traces this hook: see README
        task = torch._C._current_graph_task_id()
        if task == self._task:
            return  # another output of the same backward
        self._task = task
        store = self.store
        store.check(self._routed + self._placed)  # the seated ones are checked by `seat`
        seated = [] if store.stale or not self.seating else store.seat(self.params)
        wrapper = self._wrapper()
        if store.stale and wrapper is not None:
            # A parameter was converted or reshaped behind the wrapper (model.double() on the
            # inner model, param.data = ...): lay out again now, before any gradient arrives.
            GradStore.unseat(seated)
            if store.seated is seated:
                store.seated = []
            seater = wrapper._rebuilt_seater()
            seater._task = task
            store = seater.store
            seated = store.seat(seater.params)
        _execution_engine.queue_callback(functools.partial(self._after_backward, store, seated))

    def _after_backward(self, store: GradStore, seated: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
        GradStore.unseat(seated)
        if store.seated is seated:
            store.seated = []
        # A routed weight whose gradient came through plain autograd (its layer ran inside a
        # torch.compile'd region, or its owner used the weight without calling the layer)
        # got a tensor of its own from AccumulateGrad: outside DDP it moves into the slot
        # now, so that `.grad` lives in the buffer when the backward returns (under DDP it
        # is the reducer's bucket view), and from now on the weight is seated (or placed)
        # like an unrouted one.
        views = self.store._views
        bypassed = [p for p in self._routed if p.grad is not None and p.grad is not views[id(p)]]
        if bypassed and not self._retired:
            if self.alone and not self.store.stale:
                self.store.take_in(bypassed)
            self.params += tuple(p for p in bypassed if p.numel() < _SEAT_MAX_NUMEL)
            for param in bypassed:
                if param.numel() >= _SEAT_MAX_NUMEL:
                    self._placed += (param,)
                    self._hook(param)
            self._routed = tuple(p for p in self._routed if p.grad is None or p.grad is views[id(p)])


def _place_incoming(
    store: GradStore, param: nn.Parameter, grads: tuple[torch.Tensor | None, ...]
) -> tuple[torch.Tensor | None, ...] | None:
    """AccumulateGrad pre-hook of a large unrouted parameter: when `.grad` is None, copy
    the incoming gradient into the slot, make the slot the `.grad`, and hand AccumulateGrad
    nothing to do (its post hooks, DDP's among them, still run). When `.grad` is defined
    AccumulateGrad adds in place into it, which is the slot. Under create_graph=True the
    gradient must stay differentiable: left alone."""
    grad = grads[0]
    if grad is None or param.grad is not None or torch.is_grad_enabled() or not param.requires_grad:
        return None  # (frozen since the forward: AccumulateGrad skips it, as stock's does)
    if store.view(param).shape != grad.shape:
        store.stale = True  # reshaped behind the wrapper: AccumulateGrad takes it as stock does
        return None
    store.place(param, grad)
    return (None,)


def output_nodes(output: Any) -> set[Any]:
    """The autograd nodes that made the tensors of a model's output: a tensor, any pytree
    of them, and the fields of dataclass instances in it (a dataclass is one opaque pytree
    leaf unless registered, and models return them: output classes, loss records)."""
    if isinstance(output, torch.Tensor):
        return set() if output.grad_fn is None else {output.grad_fn}
    nodes = set()
    stack, seen = tree_leaves(output), set()
    while stack:
        leaf = stack.pop()
        if isinstance(leaf, torch.Tensor):
            if leaf.grad_fn is not None:
                nodes.add(leaf.grad_fn)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type) and id(leaf) not in seen:
            seen.add(id(leaf))
            stack.extend(tree_leaves([getattr(leaf, field.name) for field in dataclasses.fields(leaf)]))
    return nodes


def _trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that get a slot: trainable, with a dense gradient. (parameters()
    yields a shared, tied, parameter once.)"""
    sparse = _sparse_ids(model)
    return [param for param in model.parameters() if param.requires_grad and id(param) not in sparse]


def _sparse_ids(model: nn.Module) -> set[int]:
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
            entries.append((module, name, param, param.requires_grad, param.dtype, param.device, param.shape))
    return tuple(entries)


def _detach_leaving(store: GradStore, staying: list[nn.Parameter]) -> None:
    """A parameter that leaves the buffers (frozen, replaced) keeps its `.grad` values in a
    tensor of its own, so the old buffer can be freed."""
    kept = {id(p) for p in staying}
    for param in store.params:
        if id(param) not in kept and store.holds(param, param.grad):
            param.grad = param.grad.clone()  # type: ignore[union-attr]


def _zero_stock(param: nn.Parameter) -> None:
    """What `nn.Module.zero_grad(set_to_none=False)` does to one parameter."""
    grad = param.grad
    if grad is None:
        return
    if grad.grad_fn is not None:
        grad.detach_()
    else:
        grad.requires_grad_(False)
    grad.zero_()


def _check_norm_type(norm_type: float) -> float:
    norm_type = float(norm_type)
    if math.isnan(norm_type):
        raise ValueError(f"norm_type must be a number or +-inf, got {norm_type}")
    return norm_type


# --- routing supported layers through the flat-buffer Functions ----------------------------


def _linear_forward(module: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    weight = module.weight
    if torch.is_grad_enabled() and not weight.is_complex() and not functional.plain_torch():
        return functional._apply_linear(functional.unwrap_if_dead(input), weight, module.bias)
    return F.linear(input, weight, module.bias)


def _embedding_forward(module: nn.Embedding, input: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and not module.sparse and not functional.plain_torch():
        return functional.embedding(
            input,
            module.weight,
            module.padding_idx,
            module.max_norm,
            module.norm_type,
            module.scale_grad_by_freq,
        )
    return F.embedding(
        input,
        module.weight,
        module.padding_idx,
        module.max_norm,
        module.norm_type,
        module.scale_grad_by_freq,
        module.sparse,
    )


_ROUTES: dict[str, tuple[type[nn.Module], Callable[..., torch.Tensor]]] = {
    "linear": (nn.Linear, _linear_forward),
    "embedding": (nn.Embedding, _embedding_forward),
}


def _route_layers(model: nn.Module, config: FlatGradConfig) -> set[int]:
    """Give every supported layer that keeps torch's own forward a flat-buffer forward;
    returns the ids of the parameters those layers' Functions write themselves.

    Left alone: subclasses that override `forward` (LoRA layers, quantised layers...),
    parametrized layers (their weight is computed, never a leaf: nothing to write into,
    and reading it would run the parametrization) and complex Linears. Their parameters
    still get their gradients in the buffer. Never runs model code.
    """
    chosen: list[tuple[nn.Module, Callable[..., torch.Tensor]]] = []
    # nn.MultiheadAttention never calls its out_proj (its forward reads out_proj.weight):
    # routed, that Linear would only ever see its gradient arrive through plain autograd.
    uncalled = {id(m.out_proj) for m in model.modules() if isinstance(m, nn.MultiheadAttention)}
    for module in model.modules():
        if id(module) in uncalled:
            continue
        for kind in config.layers:
            cls, forward = _ROUTES[kind]
            if not isinstance(module, cls) or type(module).forward is not cls.forward:
                continue
            own = module.__dict__.get("forward")
            if own is not None:  # routed by an earlier build, or a forward the user set: keep it
                if isinstance(own, functools.partial) and own.func is forward:
                    chosen.append((module, forward))
                continue
            if parametrize.is_parametrized(module):
                continue
            weight = module._parameters.get("weight")
            if weight is None:
                continue
            if isinstance(module, nn.Linear) and (
                weight.numel() < config.linear_min_numel or weight.is_complex()
            ):
                continue
            if isinstance(module, nn.Embedding) and module.sparse:
                continue  # a sparse gradient stays outside the buffers (`_sparse_ids`)
            chosen.append((module, forward))
    routed: set[int] = set()
    for module, forward in chosen:  # after every check: a refused wrap changes nothing
        # A partial of a module-level function (not a bound method) pickles and deep-copies.
        module.forward = functools.partial(forward, module)  # type: ignore[method-assign]
        routed.update(id(p) for p in module._parameters.values() if p is not None)
    return routed


def _unroute(module: nn.Module) -> None:
    """Give a routed layer torch's own forward back (its wrapper is gone)."""
    own = module.__dict__.get("forward")
    if isinstance(own, functools.partial) and any(own.func is route for _, route in _ROUTES.values()):
        del module.__dict__["forward"]


# --- state_dict keys: the plain model's, in both directions --------------------------------


def _rekey(mapping: dict[str, Any], old: str, new: str, root: str | None = None) -> None:
    """Rename keys starting with `old` to start with `new` (all at once: no clashes);
    `root`, if given, is a key equal to `old` without its dot, renamed to `new[:-1]`."""
    moved = {k: mapping.pop(k) for k in [k for k in mapping if k.startswith(old) or k == root]}
    for key, value in moved.items():
        mapping[new[:-1] if key == root else new + key[len(old) :]] = value


def _strip_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """After `state_dict()`: ``<prefix>module.x`` -> ``<prefix>x``, so the keys (and the
    version metadata) are the plain model's, also under ``DDP(flat)``."""
    _rekey(state_dict, prefix + _PREFIX, prefix)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        metadata.pop(prefix[:-1], None)  # FlatGrad's own entry; the model's root takes its key
        _rekey(metadata, prefix + _PREFIX, prefix, root=prefix + _PREFIX[:-1])


def _add_prefix(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any, *args: Any
) -> None:
    """Before loading: ``<prefix>x`` -> ``<prefix>module.x`` (every key: FlatGrad has no
    state of its own, and a child of the model may itself be called "module")."""
    _rekey(state_dict, prefix, prefix + _PREFIX)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        _rekey(metadata, prefix, prefix + _PREFIX, root=prefix[:-1])
