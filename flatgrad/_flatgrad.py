"""`FlatGrad`: applied to a model in place (see the class), it keeps all the model's gradients in flat
per-(dtype, device) buffers. The engine runs around the model's call (`FlatGrad.__call__`); its operations
(zeroing, main grads, norms, clipping, the all-reduce without DDP) are the methods `FlatGrad` adds, each
taking the model's `GradEngine` (`engine_of`) and its store from `GradEngine.refresh` (`zero_grad` setting
None: `GradEngine.current`). Norm arithmetic: `flatgrad._norms`; collectives: `flatgrad._comm`."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.parameter import is_lazy

from flatgrad import _comm, _dtensor, _norms
from flatgrad._buffer import GradStore, LayoutChanged, scale_
from flatgrad._config import FlatGradConfig, resolve_config
from flatgrad._engine import GradEngine, trainable_parameters
from flatgrad._layout import GroupKey
from flatgrad._scattered_grad import is_scattered, refuse_scattered, scattered_main_grad, unmark_scattered

logger = logging.getLogger(__name__)


def _refuse_lazy(model: nn.Module) -> None:
    """Raise ValueError for a parameter not materialised yet (``nn.LazyLinear`` before its first forward):
    without a shape it has no slot (DDP refuses it too)."""
    lazy = [name for name, param in model.named_parameters() if is_lazy(param)]
    if lazy:
        raise ValueError(
            f"model has parameters that are not initialised yet ({', '.join(lazy[:4])}: lazy "
            "modules such as nn.LazyLinear); a flat buffer needs every parameter's shape: run "
            "one dummy forward pass to initialise them, then apply FlatGrad"
        )


def _refuse_inner_ddp(model: nn.Module) -> None:
    """Raise ValueError when `model` is or holds a DistributedDataParallel: its reducer owns the gradients'
    memory (with ``gradient_as_bucket_view=True`` every `.grad` must be its bucket view, which the routed
    layers' writes are not), so FlatGrad goes inside DDP, whose bucket then is the flat buffer."""
    for name, module in model.named_modules():
        if isinstance(module, DDP):
            where = "model" if not name else f"model's submodule {name!r}"
            raise ValueError(
                f"FlatGrad must be applied to the plain model and go inside DistributedDataParallel, got a "
                f"{where} that is a DistributedDataParallel; build "
                "flatgrad.FlatGrad(model); ddp = DDP(model, **model.ddp_kwargs()); "
                "ddp.register_comm_hook(model.comm_state(), flatgrad.allreduce_hook)"
            )


# What FlatGrad adds to a model: a model whose class (or instance) already has one of these names would have
# it hidden, so it is refused (`_refuse_collisions`). ``zero_grad`` is nn.Module's, which FlatGrad's extends.
_ADDED = (
    "flatgrad_config", "grad_buffers", "main_grad", "grad_norm", "clip_grad_norm_",
    "all_reduce_grads", "ddp_kwargs", "comm_state", "relayout",
)  # fmt: skip
_ENGINE = "_flatgrad_engine"  # the model's `__dict__` key of its engine
_Convert = Callable[[torch.Tensor], torch.Tensor]  # (what `nn.Module._apply` maps over the tensors)


def engine_of(model: nn.Module) -> GradEngine:
    """The `GradEngine` of a model `FlatGrad` was applied to."""
    engine: GradEngine = model.__dict__[_ENGINE]
    return engine


class FlatGrad(nn.Module):
    """``FlatGrad(model)`` keeps every trainable parameter's `.grad` in `grad_buffers` and returns `model`
    itself, now also an instance of `FlatGrad`.

    The model's class becomes a subclass of `FlatGrad` and of its own class (under its own class's name), as
    FSDP2's ``fully_shard`` makes it one of `FSDPModule`'s: ``isinstance(model, Original)`` holds, and the
    model's names, ``state_dict`` keys, forward (and its signature) and attributes are its own. Linear and
    Embedding layers (those that keep torch's own `forward`) run their backward through Functions that write
    weight gradients straight into the buffer. Every other parameter's `.grad` is pointed at its zeroed slot
    when a backward through the model's output starts (the call marks the output), so AccumulateGrad adds into
    the buffer in place; under a DDP its reducer copies those gradients into its bucket instead, which with
    `ddp_kwargs()` is the buffer. That is when the model is called (``model(x)``), as for module hooks: code
    that calls ``model.forward(x)`` gets its gradients moved into the buffers at the next norm or sync.

    The layout is fixed now: ``.to()``, dtype casts and ``requires_grad`` toggles keep working; a parameter
    added, replaced, removed or re-pointed at another shape later raises as the next backward starts, or at
    the next norm or sync, naming it, until `relayout`. ``torch.save``/``copy.deepcopy`` of the model give one
    with FlatGrad applied (its own buffers, no gradients: torch's deep copy of a parameter leaves `.grad`).

    Args:
        model: The module to apply FlatGrad to.
        config: A `FlatGradConfig`, a dict of its fields, a path to a YAML/JSON file
            (`FlatGradConfig.from_file`), or None for the defaults.

    Returns:
        `model`.

    Raises:
        TypeError: `model` is not an `nn.Module`, or `config` is none of the above.
        ValueError: `model` already has FlatGrad applied with another config (with the same, or None, it is
            returned as it is); `model` is or holds a DistributedDataParallel (FlatGrad goes inside it); has
            an attribute named as one FlatGrad adds (`grad_buffers`, `clip_grad_norm_`, ...); has no trainable
            parameter with a dense gradient; or `config` holds an invalid value (a
            `pydantic.ValidationError`). A config file raises as `FlatGradConfig.from_file` does."""

    flatgrad_config: FlatGradConfig

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is FlatGrad:
            return _apply_flatgrad(*args, **kwargs)
        # ``type(model)(...)`` of a model FlatGrad was applied to (``nn.Sequential``'s slicing
        # builds its class anew): a plain instance of the model's own class, as FSDP2's.
        return original_class(cls)(*args, **kwargs)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass  # (``FlatGrad(model)``: `__new__` did the work; Python calls this on the model)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickled and deep-copied as the model's own class, with FlatGrad applied again by
        # `__setstate__` (the engine's buffers are rebuilt, not saved); after what `state_dict`
        # waits for (parameters still being gathered: `overlap_param_gather`).
        wait_gathers(self)
        return (_new_flat_instance, (original_class(type(self)),), self.__getstate__())

    def __copy__(self) -> Any:
        raise TypeError(
            "copy.copy of a model with FlatGrad applied would share its parameters, whose .grad "
            "live in this model's buffers, with a second engine: use copy.deepcopy(model)"
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        engine = state.pop(_ENGINE)
        state["_flatgrad_slot_multiple"] = engine.slot_multiple
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        multiple = state.pop("_flatgrad_slot_multiple", 1)
        super().__setstate__(state)
        self.__dict__[_ENGINE] = GradEngine(self, self.flatgrad_config, multiple)
        _drop_copied_hooks(self)

    # Eager under torch.compile(model) (the frame only: what it calls is compiled unless disabled itself): the
    # bookkeeping around the model is disabled as a whole, so Dynamo sees none of it, and `_flatgrad_call`, a
    # frame of flatgrad's, is where it starts tracing the model (as one graph even when its class is a torch
    # container, nn.Sequential, whose own frames Dynamo would skip). Not forward hooks: Dynamo traces those.
    @torch.compiler.disable(recursive=False)
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        engine = engine_of(self)
        engine.before_forward()
        output = self._flatgrad_call(*args, **kwargs)
        if torch.is_grad_enabled():  # a backward through the output seats the unrouted slots
            engine.after_forward(output)
        return output

    def _flatgrad_call(self, *args: Any, **kwargs: Any) -> Any:
        return super().__call__(*args, **kwargs)

    def _apply(self, fn: _Convert, recurse: bool = True) -> Any:
        # .to(), .double(), .half(), .cuda() ... convert parameters and their .grad out of
        # the buffers; lay the buffers out again for the new dtypes/devices.
        engine = self.__dict__.get(_ENGINE)
        store = engine.store if engine is not None else None
        if store is not None and is_scattered(store) and not store.scattered.unguarded:
            fn = _refusing_conversion(fn)
        super()._apply(fn, recurse)
        if engine is not None:
            engine.build()
        return self

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """`nn.Module.load_state_dict`; with ``assign=True``, which replaces the parameters, the buffers are
        laid out again for the new ones (`relayout`).

        Args:
            state_dict: As torch's.
            strict: As torch's.
            assign: As torch's.

        Returns:
            torch's ``(missing_keys, unexpected_keys)``."""
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        if assign:
            self.relayout()
        return result

    def relayout(self) -> None:
        """Lay the gradient buffers out again for the model's parameters as they are now: after adding,
        replacing or removing a parameter (or re-pointing one at a tensor of another shape), which FlatGrad
        otherwise refuses. Call it before building replicate and the optimizer over the new parameters.

        Raises:
            ValueError: A parameter is not initialised (a lazy module), or none is trainable."""
        _refuse_lazy(self)
        _refuse_untrainable(self)
        engine_of(self).build()

    @property
    def grad_buffers(self) -> dict[GroupKey, torch.Tensor]:
        """The flat gradient buffers, one per (dtype, device); every `.grad` is a view of one.

        Returns:
            A new dict from ``(dtype, device)`` to that group's flat buffer (the live tensor, not a copy),
            laid out again first if the parameters changed.

        Raises:
            RuntimeError: After a ShardedOptimizer's synchronised backward (by element), until its
                ``zero_grad()``: the buffers are averaged only inside each rank's shard."""
        refuse_scattered(engine_of(self).store, "model.grad_buffers")
        return settled_buffers(self)

    # --- flat-buffer operations -----------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Like `nn.Module.zero_grad`, for every parameter of the model (frozen ones too).

        Args:
            set_to_none: True sets every `.grad` to None; False zeroes them, the buffered gradients with one
                fill per buffer (a `.grad` that is not its slot's view is pointed back at it). Main grads
                (``grad_dtype="float32"``) are zeroed either way, and their parameters' `.grad` stays None."""
        # Setting None walks no model (it runs every step): a held parameter `GradEngine.current` misses
        # (frozen or converted in place) still gets `.grad` None; the next norm, sync or backward finds it.
        engine = engine_of(self)
        try:
            store = engine.current() if set_to_none else engine.refresh()
        except LayoutChanged:  # (refused until relayout(), which this may have to precede)
            if not set_to_none:
                raise
            for param in self.parameters():
                param.grad = None
            if engine.store is not None:
                engine.store.zero_mains()
            return
        unmark_scattered(store, to_none=set_to_none)  # (zeroed: right on every rank again)
        if set_to_none:
            for param in store.params + engine.others:
                param.grad = None
            store.zero_mains()  # (their `.grad` is None already)
            return
        for param in store.params:  # (a ScatteredGrad, or a `.grad` outside its slot)
            if param.grad is not None and param.grad is not store.view(param):
                param.grad = None if store.is_main(param) else store.view(param)
        for buffer in store.buffers.values():
            buffer.zero_()
        for param in engine.others:
            _zero_stock(param)

    def main_grad(self, param: torch.Tensor) -> torch.Tensor:
        """The gradient slot of `param`, shaped like it: with ``grad_dtype="float32"`` a bfloat16/float16
        parameter's float32 main grad (its gradient, summed over micro-batches in float32, zeroed by
        `zero_grad`; `.grad` stays None), else the slot `.grad` is seated on.

        Args:
            param: A trainable parameter of the model.

        Returns:
            A live view of a `grad_buffers` buffer (not a copy): read it, step from it, or scale it in place.

        Raises:
            TypeError: `param` is not a tensor.
            ValueError: `param` is not a trainable parameter of the model with a slot (frozen, a sparse
                embedding's, another model's, or a plain tensor)."""
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"param must be a parameter of the model, got {type(param).__name__}")
        store = engine_of(self).refresh()
        if param not in store:
            raise ValueError(
                f"param must be a trainable parameter of the model with a gradient slot, "
                f"got a tensor of shape {tuple(param.shape)} that has none (frozen, sparse, "
                "another model's, or not a parameter)"
            )
        store.take_in([param], zero_empty=True)  # the buffer as the truth, as `settle` makes it
        if is_scattered(store):  # (a ShardedOptimizer's backward: averaged in its shards only)
            return scattered_main_grad(store, param)
        return store.view(param)

    def grad_norm(self, norm_type: float = 2.0, *, pp_mesh: DeviceMesh | None = None) -> torch.Tensor:
        """The norm of all gradients together, as `torch.nn.utils.clip_grad_norm_` computes it, but
        accumulated in float64 over chunks of each buffer: within about 1e-9 (float32 gradients) or 1e-7
        (bfloat16/float16) of the float64 norm at any size, and returned in at least float32 (stock's bfloat16
        norm keeps 3 digits). Parameters whose `.grad` is None count as absent; frozen parameters that still
        hold a `.grad` count, a tied one once.

        Args:
            norm_type: The order of the norm (``float("inf")`` for the max norm), as in torch.
            pp_mesh: The 1-D mesh of a pipeline's stages (``mesh["pp"]``, torchtitan's name), this model one
                stage of it: the norm of every stage's gradients together (one float64 all-reduce over it;
                every stage must call it). None: this model's own.

        Returns:
            The total norm as a 0-d tensor (0 when no parameter has a `.grad`).

        Raises:
            TypeError: `pp_mesh` is not a DeviceMesh.
            ValueError: `norm_type` is NaN (or, with `pp_mesh` or DTensor parameters, not positive), or
                `pp_mesh` is not 1-D or crosses the tensor-parallel mesh.
            RuntimeError: The gradients are reduce-scattered by a `ShardedOptimizer` (after its synchronised
                backward, until ``zero_grad()``); use its `clip_grad_norm_`."""
        norm_type = _check_norm_type(norm_type)
        _, _, norms, dtype = _grads_and_norms(engine_of(self), norm_type, pp_mesh, "model.grad_norm()")
        return _norms.total_norm(norms, norm_type, dtype)

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        *,
        pp_mesh: DeviceMesh | None = None,
    ) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` on the flat buffers: scales every
        gradient in place by ``min(1, max_norm / (total_norm + 1e-6))``, with the total norm of `grad_norm`
        (more exact than stock's). Only gradient elements are scaled, never the alignment padding, which stays
        zero; on the CPU a factor of exactly 1 skips the pass (see `flatgrad._buffer.scale_`).

        Args:
            max_norm: The largest total norm the gradients keep.
            norm_type: The order of the norm (``float("inf")`` for the max norm), as in torch.
            error_if_nonfinite: Raise instead of clipping when the total norm is NaN or infinite.
            pp_mesh: The 1-D mesh of a pipeline's stages (``mesh["pp"]``): clip by the norm of every stage's
                gradients together, as `grad_norm` does (every stage must call it); None: by this model's own.

        Returns:
            The total norm before clipping, as `grad_norm` returns it.

        Raises:
            TypeError, ValueError: As `grad_norm`.
            RuntimeError: The total norm is non-finite and `error_if_nonfinite` is True; or the gradients are
                reduce-scattered by a `ShardedOptimizer` (after its synchronised backward, until
                ``zero_grad()``): use its `clip_grad_norm_`."""
        norm_type = _check_norm_type(norm_type)
        what = "model.clip_grad_norm_()"
        store, others, norms, dtype = _grads_and_norms(engine_of(self), norm_type, pp_mesh, what)
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

    # --- synchronisation (the communication itself lives in flatgrad._comm) --------------

    def all_reduce_grads(
        self, process_group: dist.ProcessGroup | None = None, reduce_dtype: torch.dtype | None = None
    ) -> None:
        """Without DDP: average all gradients over `process_group` (default: the world), one all-reduce per
        buffer. Call it after backward, before the optimizer step. Afterwards `.grad` is as stock DDP with
        find_unused_parameters=True leaves it (None only for a parameter no rank used).

        Args:
            process_group: The group to average over; None for the default group.
            reduce_dtype: ``torch.bfloat16`` or ``torch.float16`` to all-reduce a compressed copy of the
                floating-point buffers (decompressed into them); None sends them as they are.

        Raises:
            ValueError: The model has sparse embeddings (``sparse=True``), whose gradients live outside the
                flat buffers, or `reduce_dtype` is not one of the above.
            RuntimeError: No default process group is initialised (``dist.init_process_group``), or a
                ShardedOptimizer's synchronised backward (by element) reduce-scattered the gradients since its
                last ``zero_grad()`` (averaging them again would mix other ranks' sums into the shards)."""
        engine = engine_of(self)
        refuse_scattered(engine.store, "model.all_reduce_grads()")
        store = engine.refresh()
        engine.refuse_sparse("all_reduce_grads")  # (every trainable parameter in the store)
        if store.tensor_parallel is not None:
            store.tensor_parallel.check_data_parallel(process_group, "model.all_reduce_grads()")
        _comm.all_reduce_grads(store, process_group, reduce_dtype)
        store.unsynced = False  # (replicate's no_sync() gradients are averaged now)

    def ddp_kwargs(self) -> dict[str, Any]:
        """Constructor arguments for ``DDP(model, **model.ddp_kwargs())``: the zero-copy path, one all-reduce
        per buffer with `allreduce_hook` (a warning follows if it has not run after two steps).

        Returns:
            ``{"gradient_as_bucket_view": True, "bucket_cap_mb": cap}``, with a cap above the largest buffer,
            so that DDP keeps one bucket per (dtype, device).

        Raises:
            ValueError: The model keeps main grads (``grad_dtype`` set), which DDP cannot carry."""
        _comm.refuse_main_grads(self.flatgrad_config.grad_dtype, "DDP (model.ddp_kwargs())")
        _refuse_ddp(engine_of(self), "model.ddp_kwargs()")
        engine_of(self).ddp.expect_hook()
        return _comm.ddp_kwargs(engine_of(self).refresh())

    def comm_state(
        self, process_group: dist.ProcessGroup | None = None, reduce_dtype: torch.dtype | None = None
    ) -> _comm.FlatGradCommState:
        """State for ``ddp.register_comm_hook(model.comm_state(), flatgrad.allreduce_hook)``.

        Args:
            process_group: The group to average over, None for the default group; a DDP on a sub-group needs
                the same group here (the hook does not see DDP's).
            reduce_dtype: ``torch.bfloat16`` or ``torch.float16`` all-reduces a compressed copy, decompressed
                into the buffer, like torch's bf16/fp16 compress hooks; None sends it as is.

        Returns:
            A `FlatGradCommState` for this model.

        Raises:
            ValueError: `reduce_dtype` is not torch.bfloat16, torch.float16 or None; or the model keeps main
                grads (``grad_dtype`` set), which DDP cannot carry."""
        _comm.refuse_main_grads(self.flatgrad_config.grad_dtype, "DDP's allreduce_hook (model.comm_state())")
        _refuse_ddp(engine_of(self), "model.comm_state()")
        return _comm.FlatGradCommState(self, engine_of(self), process_group, reduce_dtype)


_CLASSES: dict[tuple[type[nn.Module], type[nn.Module]], type[nn.Module]] = {}


def flat_class(original: type[nn.Module], mixin: type[FlatGrad] | None = None) -> type[FlatGrad]:
    """The subclass of `mixin` (`FlatGrad`, or a subclass of it: `replicate`'s `ReplicateModule`) and
    `original` a model becomes (one per pair), under the original's name (libraries write
    ``type(model).__name__`` into what they save: transformers' ``config.json`` ``architectures``)."""
    mixin = FlatGrad if mixin is None else mixin
    cls = _CLASSES.get((mixin, original))
    if cls is None:
        names = {"__module__": original.__module__, "__qualname__": original.__qualname__}
        cls = _CLASSES[(mixin, original)] = type(original.__name__, (mixin, original), names)
    return cls  # type: ignore[return-value]


def original_class(cls: type) -> type[nn.Module]:
    """The model's own class of a class `flat_class` made (the one after `FlatGrad`)."""
    mro = cls.__mro__
    original: type[nn.Module] = mro[mro.index(FlatGrad) + 1]
    return original


class ModelHook:
    """A hook of flatgrad's on the model's modules holding what a copy must not take (a ShardedOptimizer's
    engine): a copy of the model (``copy.deepcopy``, ``torch.save``) gets `_copied_hook` in its place, which
    the copy's `FlatGrad.__setstate__` removes."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> tuple[Callable[[], Callable[..., None]], tuple[()]]:
        return _copied, ()


def wait_gathers(model: nn.Module) -> None:
    """What `model.state_dict()` waits for first (its `ModelHook`s: parameters still being gathered)."""
    for hook in [h for h in model._state_dict_pre_hooks.values() if isinstance(h, ModelHook)]:
        hook(model, "", False)


def _copied() -> Callable[..., None]:
    return _copied_hook


def _copied_hook(*args: Any, **kwargs: Any) -> None:
    """What a `ModelHook` becomes in a copy of the model, until the copy removes it."""


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks")


def _drop_copied_hooks(model: nn.Module) -> None:
    """Remove from a copy of the model what its `ModelHook`s became (`_copied_hook`; torch before 2.5 wraps a
    load pre hook, `hook` holding ours)."""
    for module in model.modules():
        for hooks in (getattr(module, name, None) or {} for name in _HOOK_DICTS):
            for key in [k for k, hook in hooks.items() if getattr(hook, "hook", hook) is _copied_hook]:
                del hooks[key]


def _new_flat_instance(original: type[nn.Module]) -> FlatGrad:
    """An empty instance of ``flat_class(original)`` for unpickling (`FlatGrad.__setstate__` fills it)."""
    instance: FlatGrad = object.__new__(flat_class(original))
    return instance


def _refusing_conversion(fn: _Convert) -> _Convert:
    """`fn` for `nn.Module._apply` while the gradients are reduce-scattered: the first tensor it would
    convert raises before it is assigned (`_apply` converts a parameter before its `.grad`, whose refusal
    would leave that parameter converted; a main grad has no `.grad` to refuse)."""

    def convert(tensor: torch.Tensor) -> torch.Tensor:
        converted = fn(tensor)
        if converted is not tensor:
            raise RuntimeError(
                "converting the model (.to(), .float(), .cuda(), ...) between a synchronised backward and "
                "zero_grad under a ShardedOptimizer that shards by element: the gradients are reduce-"
                "scattered (each rank holds the average only in its own shard), so they cannot be converted "
                "with the parameters; convert before the forward or after opt.zero_grad() (nothing was "
                "converted)"
            )
        return converted

    return convert


def _apply_flatgrad(
    model: nn.Module, config: FlatGradConfig | dict[str, Any] | str | Path | None = None
) -> nn.Module:
    """``FlatGrad(model, config)``: check, swap the class, build the engine, hook the forward."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    flatgrad_config = resolve_config(config)
    if isinstance(model, FlatGrad):  # (a deep copy of one, a second fit of a LightningModule)
        if config is not None and flatgrad_config != model.flatgrad_config:
            raise ValueError(
                "FlatGrad is already applied to this model, with another config "
                f"({model.flatgrad_config}); its layout is fixed when it is applied: apply it once "
                "(model.relayout() lays the buffers out again for new parameters)"
            )
        return model
    _refuse_inner_ddp(model)
    _refuse_lazy(model)
    _refuse_collisions(model)
    _refuse_untrainable(model)
    model.__class__ = flat_class(type(model))
    flat: FlatGrad = model  # type: ignore[assignment]
    flat.flatgrad_config = flatgrad_config
    engine = GradEngine(flat, flatgrad_config)
    flat.__dict__[_ENGINE] = engine
    for line in engine.summary_lines():
        logger.info("flatgrad: %s", line)
    return flat


def _refuse_collisions(model: nn.Module) -> None:
    clashes = [name for name in _ADDED if hasattr(model, name)]
    if type(model).zero_grad is not nn.Module.zero_grad:
        clashes.append("zero_grad")
    if clashes:
        raise ValueError(
            f"the model's class {type(model).__name__} has attributes named as those FlatGrad adds "
            f"({', '.join(clashes)}), which FlatGrad would hide: rename them in the model"
        )


def _refuse_untrainable(model: nn.Module) -> None:
    if not trainable_parameters(model):
        raise ValueError(
            "model must have at least one parameter with requires_grad=True (and a dense "
            "gradient: sparse embeddings keep theirs outside the flat buffers), got none"
        )


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


def settled_buffers(model: nn.Module) -> dict[GroupKey, torch.Tensor]:
    """`FlatGrad.grad_buffers` without its refusal, for flatgrad's own reads (a device, a scaling)."""
    store = engine_of(model).refresh()
    store.settle()  # (the buffers as the truth)
    return dict(store.buffers)


def _grads_and_norms(
    engine: GradEngine, norm_type: float, pp_mesh: DeviceMesh | None, what: str
) -> tuple[GradStore, list[torch.Tensor], list[torch.Tensor], torch.dtype]:
    """(store, gradients outside it, per-piece float64 norms, the total's dtype) for `what`, refused after a
    reduce-scatter; with `pp_mesh`, one piece: the norm over every stage of the pipeline."""
    refuse_scattered(engine.store, what)
    store = engine.refresh()
    tensor_parallel = store.tensor_parallel
    if tensor_parallel is not None and norm_type <= 0:
        raise ValueError(
            f"norm_type must be positive or inf for a model with DTensor parameters, got {norm_type}: "
            "orders 0 and below are defined per whole tensor, not over its shards"
        )
    stages = None if pp_mesh is None else _stages(pp_mesh, tensor_parallel, norm_type)
    store.settle()
    others = [p.grad for p in engine.others if p.grad is not None]
    if tensor_parallel is None:
        norms, dtype = _norms.piece_norms(store, others, norm_type)
    else:
        # With DTensor parameters this rank counts its shards, and replicated gradients only on
        # the mesh's first rank; one all-reduce over the mesh makes that the whole gradient's norm.
        counted = [p.grad for p in engine.others if p.grad is not None and tensor_parallel.counts(p)]
        norms, dtype = _norms.piece_norms(store, counted, norm_type)  # type: ignore[arg-type]
        norms = tensor_parallel.combine(norms, norm_type)
    if stages is not None:
        norms = _dtensor.combine_norms(norms, norm_type, stages, pp_mesh.device_type)  # type: ignore[union-attr]
    return store, others, norms, dtype


def _stages(pp_mesh: DeviceMesh, tensor_parallel: _dtensor.TensorParallel | None, norm_type: float) -> Any:
    """`pp_mesh`'s group, checked (`_dtensor.pipeline_group`), for a norm of positive order."""
    if norm_type <= 0:
        raise ValueError(
            f"norm_type must be positive or inf with pp_mesh, got {norm_type}: orders 0 and below "
            "are defined per whole tensor, not summed over a pipeline's stages"
        )
    crossing = {"tensor-parallel": tensor_parallel.ranks} if tensor_parallel is not None else {}
    return _dtensor.pipeline_group(pp_mesh, **crossing)


def _check_norm_type(norm_type: float) -> float:
    norm_type = float(norm_type)
    if math.isnan(norm_type):
        raise ValueError(f"norm_type must be a number or +-inf, got {norm_type}")
    return norm_type


def _refuse_ddp(engine: GradEngine, what: str) -> None:
    """DDP takes no DTensor parameter (it broadcasts and buckets `param.data`, which a DTensor
    parameter's dispatch refuses); flatgrad's own data parallel runs over local shards."""
    if engine.refresh().tensor_parallel is not None:
        raise ValueError(
            f"{what}: the model has DTensor parameters (tensor-parallel), which DDP does not "
            "take: use flatgrad.replicate(model, process_group=mesh['dp'].get_group()), which "
            "averages the local shards over the data-parallel dimension only"
        )
