"""Every private PyTorch name flatgrad uses, resolved in one place.

Checked against torch 2.4 through 2.15 (the floor: `flatgrad._torch_version`); where a release lacks a name a
fallback says what happens. Nothing else in the package reads a private name of torch's (``torch._C``,
``_execution_engine``, DDP's class-level helpers); an nn.Module's own
``_parameters``/``_modules``/``_buffers`` dicts are torch's documented extension surface."""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any, SupportsIndex

import torch
import torch.distributed as dist
from torch.autograd import Variable, forward_ad
from torch.distributed.algorithms.join import _JoinConfig
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._pytree import tree_leaves as tree_leaves  # (re-exported)

# --- DTensor ----------------------------------------------------------------------------------

try:  # public from torch 2.5
    from torch.distributed.tensor import DTensor as DTensor
except ImportError:  # torch 2.4: the same class under its private module
    from torch.distributed._tensor import DTensor as DTensor  # type: ignore[no-redef]


def set_local_tensor(dtensor: torch.Tensor, local: torch.Tensor) -> None:
    """Make `local` (a plain tensor of the same shape, strides and dtype) the memory of DTensor `dtensor` (a
    parameter: a ShardedOptimizer moves it into a flat parameter buffer). DTensor keeps its shard as the
    private attribute ``_local_tensor`` (torch 2.4-2.15) and has no public setter: ``to_local()`` of a
    parameter returns a fresh view, and ``param.data = ...`` replaces the wrapper, not the shard."""
    dtensor._local_tensor = local  # type: ignore[attr-defined]


def dtensor_over(cls: type, dtensor: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A `cls` (a DTensor subclass) with `dtensor`'s mesh, placements, shape and strides over `local` (its
    local tensor or an alias), without autograd: DTensor's constructor (``DTensor(local, spec,
    requires_grad=...)``) and ``_spec``, private in torch 2.4-2.15; ``from_local`` makes a fresh view."""
    return cls(local, dtensor._spec, requires_grad=False)  # type: ignore[attr-defined]


def local_shape_and_offset(dtensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's shard of DTensor `dtensor`: its shape and its offset in the whole tensor, per dimension
    (torch's private ``compute_local_shape_and_global_offset``, in ``tensor._utils`` from 2.5)."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # torch 2.4
        from torch.distributed._tensor._utils import (  # type: ignore[no-redef]
            compute_local_shape_and_global_offset,
        )
    mesh, placements = dtensor.device_mesh, dtensor.placements  # type: ignore[attr-defined]
    shape, offset = compute_local_shape_and_global_offset(dtensor.shape, mesh, placements)
    return tuple(shape), tuple(offset)


# --- autograd engine ------------------------------------------------------------------------

_ENGINE: Any = Variable._execution_engine  # type: ignore[attr-defined]


def queue_callback(callback: Callable[[], None]) -> None:
    """Run `callback` when the running backward ends (an autograd final callback)."""
    _ENGINE.queue_callback(callback)


graph_task_id: Callable[[], int] = torch._C._current_graph_task_id
"""The running backward's graph task (-1 outside one): tells backwards apart."""

will_execute: Callable[[Any], bool] = torch._C._will_engine_execute_node
"""Whether the running backward will run `node` (raises outside a backward's hooks)."""

current_autograd_node: Callable[[], Any] = torch._C._current_autograd_node
"""The node whose hook or Function is running (None at the top level of a backward)."""

DisableTorchFunctionSubclass = torch._C.DisableTorchFunctionSubclass
"""A context where tensor subclasses' ``__torch_function__`` is not called."""


def fast_apply(cls: type[torch.autograd.Function]) -> Callable[..., Any]:
    """``cls.apply`` through the C++ descriptor ``_FunctionBase.apply`` (skips the Python wrapper's checks for
    functorch and setup_context, which flatgrad's Functions decide themselves)."""
    bound: Callable[..., Any] = torch._C._FunctionBase.__dict__["apply"].__get__(None, cls)
    return bound


def functorch_active() -> bool:
    """Whether a torch.func transform (vmap, grad, jvp) or forward-mode AD is running."""
    return bool(torch._C._are_functorch_transforms_active()) or forward_ad._current_level >= 0


unwrap_if_dead: Callable[[torch.Tensor], torch.Tensor] = torch._C._functorch.unwrap_if_dead
"""A tensor left wrapped by a finished torch.func transform, unwrapped."""


def in_compiled_autograd() -> bool:
    """Whether compiled autograd runs this backward (its hooks are traced into a graph, and
    an autograd final callback is refused there), or Dynamo is tracing."""
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(getattr(module, "in_compiled_autograd_region", False)) or torch.compiler.is_compiling()


def accumulate_grad_node(tensor: torch.Tensor) -> Any:
    """The AccumulateGrad node of a leaf `tensor` that requires grad: the one autograd node its gradient
    passes last, where hooks that must see every gradient of a parameter go (reached through a throwaway
    view's graph, grad mode on, as DDP's reducer does). The caller keeps it alive for its hooks."""
    with torch.inference_mode(False), torch.enable_grad():  # (a relayout in an eval forward: Lightning's)
        return tensor.view_as(tensor).grad_fn.next_functions[0][0]  # type: ignore[union-attr]


def _accumulate_grad_skips_hooks_without_a_gradient() -> bool:
    """Whether AccumulateGrad skips a tensor's post-accumulate-grad hooks when no gradient reaches it: probed
    with None on one leaf's node (`Node.__call__` runs only its apply: no backward, engine thread or hook)."""
    ran: list[torch.Tensor] = []
    with torch.inference_mode(False), torch.enable_grad():
        leaf = torch.zeros(1, device="cpu", requires_grad=True)
        leaf.register_post_accumulate_grad_hook(ran.append)
        accumulate_grad_node(leaf)(None)
    return not ran


POST_ACCUMULATE_HOOKS_NEED_A_GRADIENT = _accumulate_grad_skips_hooks_without_a_gradient()
"""True on torch 2.4: its ``AccumulateGrad::apply`` returns before calling the tensor's
post-accumulate-grad hooks when the incoming gradient is undefined (``if
(!grads[0].defined()) return {};`` at its top, the hook call at its end), which is what a
flatgrad Function hands it after writing the gradient into the slot. Later releases return
early only from the accumulation (``AccumulateGrad_apply_impl``) and call the hooks in
any case. Where True, flatgrad runs them itself (`run_post_accumulate_hooks`)."""


def run_post_accumulate_hooks(
    param: torch.Tensor,
    grad_inputs: tuple[torch.Tensor | None, ...],
    grad_outputs: tuple[torch.Tensor | None, ...],
) -> None:
    """A post hook of `param`'s AccumulateGrad node (bound to `param` with a partial), for torch 2.4
    (`POST_ACCUMULATE_HOOKS_NEED_A_GRADIENT`): when no gradient reached it, call `param`'s
    post-accumulate-grad hooks, in their order, as later releases' AccumulateGrad does (registered first on
    the node, it runs where theirs would: after the accumulation, before the node's other post hooks)."""
    hooks = param._post_accumulate_grad_hooks
    if grad_outputs[0] is not None or not hooks:
        return  # (a gradient arrived: AccumulateGrad itself called them)
    for hook in tuple(hooks.values()):
        if hook(param) is not None:
            raise RuntimeError("Tensor post accumulate grad hooks should return None.")


_PRESERVE = torch.autograd._unsafe_preserve_version_counter
# It takes a tuple of tensors from torch 2.5 (its argument is then called `tensors`).
_PRESERVE_TAKES_TUPLE = "tensors" in inspect.signature(_PRESERVE.__init__).parameters


@contextlib.contextmanager
def preserve_version_counter(tensors: tuple[torch.Tensor, ...]) -> Iterator[None]:
    """Write `tensors` without bumping their version counters (as DDP's buffer broadcast):
    ``torch.autograd._unsafe_preserve_version_counter`` over the tuple (before 2.5: per tensor)."""
    with contextlib.ExitStack() as stack:
        for each in [tensors] if _PRESERVE_TAKES_TUPLE else tensors:
            stack.enter_context(_PRESERVE(each))
        yield


# --- tensor ops -----------------------------------------------------------------------------


def _gather_takes_int32() -> bool:
    try:
        torch.gather(torch.zeros(1, device="cpu"), 0, torch.zeros(1, dtype=torch.int32, device="cpu"))
    except RuntimeError:  # "gather(): Expected dtype int64 for index"
        return False
    return True


GATHER_TAKES_INT32 = _gather_takes_int32()
"""Whether ``torch.gather`` and ``scatter_add_`` take an int32 index (False on torch 2.4:
int64 only; probed once on a one-element tensor)."""

# --- DDP --------------------------------------------------------------------------------------


def active_ddp() -> DDP | None:
    """The running forward's DDP, if any: DDP's tracking for TorchDynamo (a class attribute in each torch)."""
    return DDP._get_active_ddp_module()


def divides_by_ranks_not_joined(ddp: DDP) -> bool:
    """Whether `ddp` runs under a `Join` that averages over the ranks not joined yet
    (``ddp.join(divide_by_initial_world_size=False)``), which DDP's reducer does by itself
    but leaves to a registered comm hook, as it leaves it any division."""
    config = getattr(ddp, "_join_config", None)
    return bool(
        config is not None and config.enable and not getattr(ddp, "_divide_by_initial_world_size", True)
    )


def join_state(joinable: Any) -> tuple[bool, bool]:
    """(whether `joinable` runs inside an enabled `torch.distributed.algorithms.Join`, whether it is that
    Join's first joinable, the one whose per-iteration all-reduce tells the joined ranks that it has not
    joined), from the config `Join` sets on it (private in all supported torch; none: in no Join)."""
    config = getattr(joinable, "_join_config", None)
    if config is None:
        return False, False
    return bool(config.enable), bool(config.is_first_joinable)


def leave_join(joinable: Any) -> None:
    """Take `joinable` out of the `Join` it was configured for (the disabled config its constructor set):
    torch's `Join` never resets the configs it sets, and an exception out of the block skips even its post
    hooks, so a Join that raised would keep the joinable "joined" for every later call outside any Join."""
    joinable._join_config = _JoinConfig.construct_disabled_join_config()  # type: ignore[attr-defined]


_BROADCAST_BUCKET_BYTES = 250 * 2**20  # DDP's broadcast_bucket_size


def broadcast_coalesced(
    process_group: dist.ProcessGroup | None, tensors: list[torch.Tensor], src: int
) -> None:
    """DDP's own coalesced broadcast of `tensors` from `src` (250 MiB pieces). `src` is a group rank (not
    global, as `dist.broadcast` takes): the C++ call's root, as DDP passes ``process_group.rank()``."""
    group = process_group or dist.distributed_c10d._get_default_group()
    dist._broadcast_coalesced(group, tensors, _BROADCAST_BUCKET_BYTES, src)  # type: ignore[attr-defined]


# --- collectives ------------------------------------------------------------------------------


def collectives_run() -> int:
    """How many collectives this process has run on all of its process groups so far: the sum of their
    sequence numbers (``ProcessGroup._get_sequence_number_for_group``, private in every torch the range
    accepts; gloo and NCCL count every collective, object collectives and functional ones included). 0 without
    a default group; a group whose backend does not count adds nothing."""
    if not dist.is_initialized():
        return 0
    total = 0
    for group in list(dist.distributed_c10d._world.pg_map):
        with contextlib.suppress(RuntimeError, AttributeError):
            total += int(group._get_sequence_number_for_group())  # type: ignore[attr-defined]
    return total


# --- nn.Module ----------------------------------------------------------------------------


def register_load_pre_hook(module: torch.nn.Module, hook: Callable[..., None]) -> Any:
    """`hook` runs before `module.load_state_dict` loads anything, called as ``hook(module, state_dict,
    prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)``:
    ``register_load_state_dict_pre_hook`` from torch 2.5, earlier the private one (``with_module=True``)."""
    register = getattr(module, "register_load_state_dict_pre_hook", None)
    if register is None:
        return module._register_load_state_dict_pre_hook(hook, with_module=True)
    return register(hook)


# --- torch.distributed.checkpoint ---------------------------------------------------------


SAVED_SHARDS = "flatgrad_local_shards"
"""The key of what a pickled `sharded_tensor` becomes: ``{SAVED_SHARDS: [(offsets, tensor)]}``,
this rank's shards as plain tensors (``torch.load(..., weights_only=True)`` reads it)."""


@functools.cache
def _local_shards_pickled() -> type:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    class LocalShardsPickled(ShardedTensor):
        """A ShardedTensor that pickles (``torch.save``) as its local shards only, in types
        ``weights_only`` loading accepts; torch.distributed.checkpoint sees a ShardedTensor."""

        def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
            shards = [(list(s.metadata.shard_offsets), s.tensor) for s in self.local_shards()]
            return (collections.OrderedDict, ([(SAVED_SHARDS, shards)],))

    return LocalShardsPickled


def sharded_tensor(
    local: list[torch.Tensor],
    boxes: list[tuple[int, tuple[int, ...], tuple[int, ...]]],
    size: tuple[int, ...],
    dtype: torch.dtype,
    process_group: dist.ProcessGroup | None,
) -> Any:
    """A ShardedTensor of shape `size` over `process_group` (None: the default group) whose shards are `boxes`
    (each ``(global rank, offsets, sizes)``, a rectangle of the tensor), `local` (contiguous tensors: views
    where the memory allows) this rank's, in the order of its boxes; built from metadata every rank knows,
    with no communication. ``torch.distributed.checkpoint`` saves and loads its shards in place and reshards
    it, into a plain tensor of that shape too (another optimizer's state); ``torch.save`` writes only this
    rank's shards, as plain tensors (`SAVED_SHARDS`). (Checked on torch 2.4-2.15; torch deprecates
    ShardedTensor for DTensor, which cannot express uneven shards at arbitrary offsets, and warns once.)"""
    import warnings

    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    device = local[0].device if local else torch.device("cpu")
    metadata = [
        ShardMetadata(list(offsets), list(sizes), f"rank:{rank}/{device}") for rank, offsets, sizes in boxes
    ]
    rank = dist.get_rank()  # (global, as the boxes)
    mine = [meta for box, meta in zip(boxes, metadata) if box[0] == rank]
    properties = TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        tensor = ShardedTensor._init_from_local_shards_and_global_metadata(
            [Shard(tensor, meta) for tensor, meta in zip(local, mine)],
            ShardedTensorMetadata(metadata, torch.Size(size), properties),
            process_group=process_group,
        )
    tensor.__class__ = _local_shards_pickled()  # (the same object; it only pickles otherwise)
    return tensor


def non_finite_check_and_unscale(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    """``torch._amp_foreach_non_finite_check_and_unscale_`` (GradScaler's; in every torch the range accepts):
    `grads` (one device, dtype) scaled by `inv_scale` in place, `found_inf` set to 1.0 on any inf or NaN."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


class GradScalerBase(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` with one public override point for the optimizers whose gradients its walk
    over ``optimizer.param_groups``' `.grad` cannot see: `unscale_optimizer`. It wraps
    ``GradScaler._unscale_grads_`` (private; the walk that ``unscale_`` and ``step``'s inf check both run,
    with this signature in every torch the range accepts); were it renamed, the override would go unused and
    `ShardedOptimizer.step` would refuse the scaler with a TypeError rather than step unchecked."""

    def unscale_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor] | None:
        """Unscale `optimizer`'s gradients and set `found_inf`; None leaves it to torch."""
        return None

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        found = self.unscale_optimizer(optimizer, inv_scale, found_inf, allow_fp16)
        if found is not None:
            return found
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
