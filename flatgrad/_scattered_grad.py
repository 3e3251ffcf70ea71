"""`.grad` after a reduce-scattering backward (ZeRO-1): a view of its slot that refuses math.

After replicate reduce-scatters the buckets for a ShardedOptimizer, a rank holds the average over the ranks
only in its own shards; the rest of its buffer holds its local gradients divided by the world size
(reduce-scatter, NCCL), or the sums over the ranks (gloo, which all-reduces and divides only the shards). A
model parameter's `.grad` is a view of that buffer, so anything computed from it
(``torch.nn.utils.clip_grad_norm_``, a logged ``p.grad.norm()``) would be wrong, and different on every rank.
The right global values need another all-gather of the gradients, which ZeRO-1's communication does not have;
ShardedOptimizer's own ``clip_grad_norm_`` gets the global norm from the shards.

So from the end of such a backward until the gradients are zeroed, every defined `.grad` is a `ScatteredGrad`:
the same memory as the slot (the optimizer, AccumulateGrad and the collectives, which never go through
Python's ``__torch_function__``, are unaffected), whose ``__torch_function__`` lets metadata reads through
(shape, dtype, strides, data pointer: flatgrad's own identity tests) and zeroing (``nn.Module.zero_grad``),
and raises for anything that reads or writes values."""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch

from flatgrad._buffer import GradStore, Scattered
from flatgrad._dtensor import is_dtensor, local_of
from flatgrad._torch_compat import DisableTorchFunctionSubclass, DTensor, dtensor_over, tree_leaves

# What a ScatteredGrad lets through: metadata (no value is read), `requires_grad` (set to
# False by nn.Module.zero_grad), and zeroing (zero is the right average of zeros).
_ALLOWED_GETTERS = frozenset({
    "shape", "dtype", "device", "layout", "ndim", "requires_grad", "grad", "grad_fn", "is_leaf",
    "is_sparse", "is_quantized", "is_meta", "is_nested", "is_cuda", "is_cpu", "is_mps",
    "is_xpu", "is_mkldnn", "itemsize", "nbytes", "_version", "output_nr",
})  # fmt: skip
_ALLOWED_SETTERS = frozenset({"requires_grad"})
_ALLOWED_CALLS = frozenset({
    "size", "stride", "dim", "numel", "nelement", "element_size", "data_ptr", "storage_offset",
    "untyped_storage", "is_contiguous", "is_floating_point", "is_complex", "is_signed",
    "is_pinned", "is_inference", "get_device", "_is_view", "requires_grad_", "zero_",
    "_foreach_zero_",
})  # fmt: skip
# In-place edits element by element: what the shard holds after one is what the whole average would (clip by
# value, masking rows, scaling), where the op reads no ScatteredGrad but its target (`_edits_in_place`).
_EDITS = frozenset({
    "mul_", "div_", "add_", "sub_", "clamp_", "clamp_min_", "clamp_max_", "clip_", "fill_", "copy_",
    "masked_fill_", "index_fill_", "nan_to_num_", "__setitem__", "_foreach_mul_", "_foreach_div_",
    "_foreach_add_", "_foreach_sub_", "_foreach_clamp_min_", "_foreach_clamp_max_",
})  # fmt: skip

_ADVICE = (
    "use opt.clip_grad_norm_(max_norm) to clip (ShardedOptimizer's own: the global norm from "
    "every rank's shard, one small all-reduce; it returns that norm, for logging too); "
    "with a loss scaler use flatgrad.GradScaler (it unscales the shards); after "
    "opt.zero_grad() .grad is plain again; to edit or read .grad itself between the backward and "
    "the step (clip by value, mask rows), shard_by='tensor' keeps every .grad whole"
)


@contextlib.contextmanager
def unguarded(*stores: GradStore | None) -> Iterator[None]:
    """Inside, the ScatteredGrads of `stores` act as plain tensors: for flatgrad laying their buffers out
    again (cloning or copying `.grad` into new slots) on the way to refusing that change. The flag is each
    store's (`GradStore.scattered`)."""
    states = [store.scattered for store in stores if store is not None]
    previous = [state.unguarded for state in states]
    for state in states:
        state.unguarded = True
    try:
        yield
    finally:
        for state, was in zip(states, previous):
            state.unguarded = was


def _guarded(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any:
    """The ``__torch_function__`` of both kinds of reduce-scattered `.grad`: metadata and
    zeroing through, anything else refused unless its store is `unguarded`."""
    name, allowed = _op(func)
    if name in ("__repr__", "__format__"):
        return _describe(args[0])
    if not (allowed or _edits_in_place(name, args, kwargs) or _unguarded(args, kwargs)):
        raise RuntimeError(
            f"{name} on a parameter's .grad under a ShardedOptimizer: after the synchronised "
            "backward the gradients are reduce-scattered, so each rank holds the average over "
            "the ranks only in its own shard and .grad elsewhere holds other values (this "
            "rank's own, or sums); any value computed from .grad (torch.nn.utils.clip_grad_norm_, "
            f"p.grad.norm() for logging) would be wrong and differ between ranks; {_ADVICE}"
        )
    with DisableTorchFunctionSubclass():
        return func(*args, **(kwargs or {}))


class _Guarded:
    """The ``__torch_function__`` both kinds of reduce-scattered `.grad` share (`_guarded`); each knows its
    store's reduce-scatter state (`scattered`), which says when it acts as a plain tensor."""

    scattered: Scattered

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Collection[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return _guarded(func, args, kwargs)


class ScatteredGrad(_Guarded, torch.Tensor):
    """A model parameter's `.grad` between a reduce-scattering backward and `zero_grad`: the
    slot's memory, readable for metadata only (see the module notes)."""


class ScatteredDTensorGrad(_Guarded, DTensor):  # type: ignore[misc]
    """A DTensor parameter's `.grad` between a reduce-scattering backward and `zero_grad`: the DTensor over
    its slot, guarded as `ScatteredGrad` at the DTensor's own calls (``torch.nn.utils.clip_grad_norm_``,
    ``p.grad.norm()``), whose local tensor is its slot's `ScatteredGrad` (``p.grad.to_local()`` is guarded
    too). DTensor's dispatch runs the local tensor's ops below ``__torch_function__``: what the guard lets
    through (zeroing) reaches the slot."""


_ALIASES = (ScatteredGrad, ScatteredDTensorGrad)


def _unguarded(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> bool:
    """Whether a ScatteredGrad the op is given belongs to a store inside `unguarded` (read
    only for an op that would be refused: the metadata reads never come here)."""
    values = (*args, *kwargs.values()) if kwargs else args
    return any(isinstance(v, _ALIASES) and v.scattered.unguarded for v in values)


def _edits_in_place(name: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> bool:
    """Whether the op is one of `_EDITS` on (a list of) plain tensors and ScatteredGrads, reading no other
    ScatteredGrad (one parameter's shard range is not another's: ``g1.mul_(g2)``, ``ema.add_(g)`` refused)."""
    if name not in _EDITS or not args:
        return False
    targets = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
    read = tree_leaves([args[1:], kwargs or {}])
    return not any(isinstance(t, ScatteredDTensorGrad) for t in targets) and not any(
        isinstance(v, _ALIASES) for v in read
    )


def _op(func: object) -> tuple[str, bool]:
    """(the op's name, whether a ScatteredGrad lets it through); a property: its ``__get__``/``__set__``."""
    name = getattr(func, "__name__", repr(func))
    owner = getattr(func, "__self__", None)
    if name in ("__get__", "__set__") and owner is not None:
        attribute = getattr(owner, "__name__", "?")
        if name == "__get__":
            return f"Tensor.{attribute}", attribute in _ALLOWED_GETTERS
        return f"setting Tensor.{attribute}", attribute in _ALLOWED_SETTERS
    return name, name in _ALLOWED_CALLS


def _describe(grad: torch.Tensor) -> str:
    with DisableTorchFunctionSubclass():
        shape, dtype = tuple(grad.shape), grad.dtype
    return (
        f"ScatteredGrad(shape={shape}, dtype={dtype}): reduce-scattered by a ShardedOptimizer's "
        f"backward, averaged over the ranks only in this rank's shard; {_ADVICE}"
    )


def _aliases(store: GradStore) -> tuple[torch.Tensor, ...]:
    """The store's ScatteredGrads, one per parameter (aliases of the slot views), made once."""
    state = store.scattered
    if not state.aliases:
        aliases = []
        for param in store.params:
            view = store.view(param)
            local = local_of(view).as_subclass(ScatteredGrad)
            local.scattered = state
            alias: ScatteredGrad | ScatteredDTensorGrad = local
            if is_dtensor(view):
                alias = dtensor_over(ScatteredDTensorGrad, view, local)  # type: ignore[assignment]
                alias.scattered = state
            aliases.append(alias)
        state.aliases = tuple(aliases)
    return state.aliases


def mark_scattered(store: GradStore) -> None:
    """After a reduce-scattering backward: every defined `.grad` (its slot, where the sync
    left it) becomes its slot's ScatteredGrad. One attribute set per parameter."""
    store.scattered.marked = True
    for param, alias in zip(store.params, _aliases(store)):
        if param.grad is not None:
            param.grad = alias


_GRAD = operator.attrgetter("grad")
_KEPT = frozenset({*_ALIASES, type(None)})  # (what a `.grad` the sync left is: an alias, or None)


def replaced_by_hand(store: GradStore) -> list[torch.Tensor]:
    """The parameters (main grads aside) whose reduce-scattered `.grad` was replaced by hand (``p.grad = g``:
    neither its alias nor None). Two C loops over the parameters in the usual step, which finds none."""
    grads = list(map(_GRAD, store.params))
    if set(map(type, grads)) <= _KEPT:
        return []
    return [p for p, g in zip(store.params, grads) if type(g) not in _KEPT and not store.is_main(p)]


def is_scattered(store: GradStore | None) -> bool:
    """Whether `store`'s gradients were reduce-scattered and not zeroed since."""
    return store is not None and store.scattered.marked


def scattered_main_grad(store: GradStore, param: torch.Tensor) -> torch.Tensor:
    """The main grad of `param` as `flat.main_grad` gives it while `store` is reduce-
    scattered: its slot's ScatteredGrad (a main grad has no `.grad` to mark)."""
    index = next(i for i, held in enumerate(store.params) if held is param)
    return _aliases(store)[index]


def unmark_scattered(store: GradStore, to_none: bool = False) -> None:
    """Every ScatteredGrad `.grad` becomes its plain slot again: the gradients were zeroed
    (or are about to be), so they are right on every rank. With `to_none` the caller sets
    every `.grad` of the store to None itself (`zero_grad`): only the mark goes."""
    if not store.scattered.marked:
        return
    store.scattered.marked = False
    if to_none:
        return
    for param in store.params:
        if type(param.grad) in _ALIASES:
            param.grad = store.view(param)


def refuse_scattered(store: GradStore | None, what: str) -> None:
    """Raise if a `.grad` of `store` is a ScatteredGrad: `what` (a norm, an all-reduce, the buffers
    handed out) would read values that are averaged only inside this rank's shards."""
    if is_scattered(store) and (store.mains or any(type(p.grad) in _ALIASES for p in store.params)):  # type: ignore[union-attr]
        raise RuntimeError(
            f"{what} after a ShardedOptimizer's synchronised backward: the gradient buffers are "
            "reduce-scattered (each rank holds the average over the ranks only in its own shard), "
            f"so what it reads from them would be wrong and differ between ranks; {_ADVICE}"
        )


def holds_scattered(store: GradStore) -> bool:
    # Still held: a `.grad` the sync marked (not a seated slot the seater set since for a `.grad` that was
    # None), or a main grad (zeroed by flatgrad's zero_grad only); and not zeroed since.
    held = bool(store.mains) or any(type(p.grad) in _ALIASES for p in store.params)
    return held and any(bool(b.any()) for b in store.buffers.values())


def carry_scattered(store: GradStore | None, shards: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Before a synchronised backward that would add onto reduce-scattered gradients (a GAN: the generator's
    loss backpropagates through a discriminator that already synchronised): copies of this rank's `shards` of
    the averages, with the buffers zeroed and every `.grad` plain again, so that the new backward averages its
    own gradients alone; the caller adds the copies onto its averages (a sum of averages is the average of the
    sums, as two synchronised backwards under DDP give). None where nothing is held any more (zeroed behind
    ShardedOptimizer's back, model.zero_grad)."""
    if store is None:
        return None
    carried = [shard.clone() for shard in shards] if holds_scattered(store) else None
    if carried is not None:
        for buffer in store.buffers.values():
            buffer.zero_()
    unmark_scattered(store)
    return carried


def refuse_adding_onto_scattered(store: GradStore | None) -> None:
    """Before a backward under no_sync that would add onto reduce-scattered gradients: refuse. After a
    reduce-scatter a rank holds the average of its own shard only; another backward's local gradients added
    onto that and reduce-scattered again are not the average of the two (stock DDP's all-reduced gradients are
    the same on every rank, so there it adds up). Every rank runs the same backwards, so every rank raises.
    Gradients set to None or zeroed since are fine (a buffer read, only here); `.grad` is plain then."""
    if store is None:
        return
    if holds_scattered(store):
        raise RuntimeError(
            "ShardedOptimizer: a backward under dp.no_sync() after a synchronised backward "
            "and before zero_grad(): the first one reduce-scattered the gradients, so this "
            "one cannot add to them locally; accumulate micro-batches under dp.no_sync() "
            "before the synchronised one, or synchronise this backward too"
        )
    unmark_scattered(store)  # zeroed behind ShardedOptimizer's back (model.zero_grad)
