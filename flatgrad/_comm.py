"""Flat-buffer sync across ranks: DDP comm hook, no-DDP sync, replicate's collectives (`launch_average`).

No postponed annotations: DDP checks the hook's (`dist.GradBucket`, `Future[Tensor]`) at registration."""

import logging
import math
import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from flatgrad._buffer import GradStore, host_tensor
from flatgrad._torch_compat import active_ddp, divides_by_ranks_not_joined, graph_task_id, join_state

logger = logging.getLogger(__name__)

_WIRE_DTYPES = (torch.bfloat16, torch.float16)
_DDP_DEFAULT_BUCKET_MB = 25


class HookEngine(Protocol):
    """What the DDP hook's state needs of the engine (`_engine.GradEngine`, which imports this module)."""

    ddp: "DDPEdge"

    def current(self) -> GradStore: ...


@dataclass
class FlatGradCommState:
    """The settings of `allreduce_hook` and its call count; build it with `FlatGrad.comm_state()`. What the
    hook does to the model's buffers (adopting DDP's buckets, a `Join`'s count) belongs to the engine's DDP
    edge (`DDPEdge`), which the hook reaches through `engine`.

    Args:
        model: The `flatgrad.FlatGrad` model whose buffers the hook keeps pointing at DDP's buckets.
        engine: That model's engine.
        process_group: The group to average over, None: the default group. The hook does not see the group DDP
            was given (torch's own hooks take theirs alike), so a DDP on a sub-group needs it here too.
        reduce_dtype: ``torch.bfloat16``/``torch.float16``: the floating-point buckets' wire dtype, or None.

    Attributes:
        num_calls: The hook's calls (one per bucket and synchronised backward: with `ddp_kwargs()`, one per
            (dtype, device) buffer and step; under DDP's Python reducer, one per parameter and step).

    Raises:
        ValueError: `reduce_dtype` is not torch.bfloat16, torch.float16 or None."""

    model: nn.Module
    engine: HookEngine
    process_group: dist.ProcessGroup | None = None
    reduce_dtype: torch.dtype | None = None
    num_calls: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        check_wire_dtype(self.reduce_dtype)


_SYNCED_FORWARDS_BEFORE_WARNING = 3


def note_forward_without_hook(num_forwards: int) -> int | None:
    """Count the forwards whose backward DDP synchronises while `allreduce_hook` has not run yet; at the third
    (two synchronised backward passes done without it) warn once and stop counting (returns None).

    Called by `DDPEdge.before_forward`; `FlatGrad.ddp_kwargs()` starts the count at 0, the hook sets it to
    None, so once the hook has run a forward costs one comparison. Forwards under no_grad (evaluation,
    Lightning's sanity check) do not count, nor those inside ``ddp.no_sync()`` or outside DDP."""
    ddp = active_ddp()  # (DDP exposes the module whose forward is running, for TorchDynamo)
    if not (torch.is_grad_enabled() and ddp is not None and ddp.require_backward_grad_sync):
        return num_forwards
    num_forwards += 1
    if num_forwards < _SYNCED_FORWARDS_BEFORE_WARNING:
        return num_forwards
    logger.warning(
        "flatgrad: ddp_kwargs() was used but allreduce_hook has not run in %d steps, so DDP "
        "all-reduces its own buckets and copies every gradient: register it with "
        "ddp.register_comm_hook(model.comm_state(), flatgrad.allreduce_hook) (PyTorch "
        "Lightning's DDPStrategy registers its ddp_comm_hook on CUDA only: register it "
        "yourself on CPU, see examples/lightning_train.py)",
        num_forwards - 1,
    )
    return None


class DDPEdge:
    """One model's side of the DDP boundary, owned by its engine (`GradEngine.ddp`): whether a DDP runs its
    forwards (its reducer then places the gradients, and nothing is seated), the check that `allreduce_hook`
    runs after `ddp_kwargs()`, what the hook does to the model's buffers (`adopt`: DDP's bucket becomes the
    flat buffer), and the DDP whose last forward ran inside an enabled `Join` (`ranks_not_joined`)."""

    def __init__(self) -> None:
        # Forwards since ddp_kwargs() without allreduce_hook; None: not asked, or the hook ran.
        self.forwards_without_hook: int | None = None
        # Whether a forward under a DDP came since the last backward began: its reducer places
        # the next backward's gradients, whichever output that backward reaches first.
        self.pending = False
        self._joining: weakref.ref[DDP] | None = None  # the DDP whose last forward ran in a `Join`
        self.warned = False  # (the hook's one warning, said once)

    def expect_hook(self) -> None:
        """`ddp_kwargs()` was asked for: warn if `allreduce_hook` does not run."""
        if self.forwards_without_hook is None:
            self.forwards_without_hook = 0

    def before_forward(self) -> None:
        if self.forwards_without_hook is not None:
            self.forwards_without_hook = note_forward_without_hook(self.forwards_without_hook)

    def after_forward(self) -> bool:
        """After a training forward: whether it ran alone, under no DDP (under one, synchronising or in
        ``no_sync()``, its reducer, not flatgrad, decides where `.grad` lives)."""
        ddp = active_ddp()
        if ddp is None:
            return True
        self.pending = True  # (see `take_pending`)
        self._joining = weakref.ref(ddp) if join_state(ddp)[0] else None
        return False

    def take_pending(self) -> bool:
        """Whether a forward under a DDP came since the last backward began (then DDP's reducer places this
        backward's gradients), forgetting it."""
        pending, self.pending = self.pending, False
        return pending

    def ranks_not_joined(self, device: torch.device, process_group: dist.ProcessGroup | None) -> int | None:
        """Under a `Join` with ``divide_by_initial_world_size=False``, the ranks not joined
        yet, which DDP divides by (it leaves that to a comm hook); None otherwise.

        Inside an enabled `Join` every rank all-reduces one count per bucket, whatever the Join divides by, so
        all make the same collectives: a joined rank, matching the backward's all-reduces with zero buckets,
        knows it is inside such a Join but not which DDP it stands in for (DDP hands its hook only the state
        and the bucket). The rank still training reads the count only where its DDP divides by it."""
        joined = graph_task_id() == -1  # a joined rank matching the backward's all-reduces
        ddp = None if joined or self._joining is None else self._joining()
        if ddp is None and not joined:
            return None  # (no Join: nothing to match)
        count = torch.full((1,), 0 if joined else 1, dtype=torch.int64, device=device)
        dist.all_reduce(count, group=process_group)
        if ddp is None or not divides_by_ranks_not_joined(ddp):
            return None  # (a joined rank's buckets are zeros: any divisor will do)
        return int(count.item())

    def adopt(self, bucket: dist.GradBucket, store_now: Callable[[], GradStore]) -> None:
        """Make DDP's `bucket` (handed `allreduce_hook`) the model's flat buffer, once per bucket allocation,
        in the store `store_now` gives (laid out again first if the model changed: `GradEngine.current`). Only
        when `.grad` lives in the bucket already (gradient_as_bucket_view=True) and one bucket holds the whole
        (dtype, device) group; else stay correct on DDP's copies and say once how to get zero-copy."""
        self.forwards_without_hook = None  # the hook runs: nothing to warn about
        buffer = bucket.buffer()
        if buffer.layout != torch.strided:
            return  # a sparse gradient (DDP gives each its own bucket): averaged as it is
        if graph_task_id() == -1:
            # Not inside a backward: DDP's `Join` shadowing one on a rank that ran out of inputs, with zero
            # stand-in buckets (`_match_all_reduce_for_bwd_pass`). Nothing to adopt or warn about.
            return
        store = store_now()  # once per bucket per step: no full walk
        key = (buffer.dtype, buffer.device)
        current = store.buffers.get(key)
        if (
            current is not None
            and current.data_ptr() == buffer.data_ptr()
            and current.numel() == buffer.numel()
        ):
            return
        params, grads = bucket.parameters(), bucket.gradients()
        # Parameters DDP found unused (find_unused_parameters=True) may have no .grad yet.
        pairs = [(p.grad, g) for p, g in zip(params, grads) if p.grad is not None]
        as_views = bool(pairs) and all(grad.data_ptr() == view.data_ptr() for grad, view in pairs)
        if not (as_views and store.adopt(buffer, params, grads)) and not self.warned:
            self.warned = True
            logger.warning(
                "flatgrad: DDP keeps gradients in its own buckets, so they are copied every step; "
                "construct DDP(model, ..., **model.ddp_kwargs()) (gradient_as_bucket_view=True and one "
                "bucket per dtype) for the zero-copy, one-all-reduce path"
            )


def check_wire_dtype(reduce_dtype: torch.dtype | None) -> None:
    if reduce_dtype is not None and reduce_dtype not in _WIRE_DTYPES:
        raise ValueError(f"reduce_dtype must be torch.bfloat16, torch.float16 or None, got {reduce_dtype}")


def to_wire(tensor: torch.Tensor, reduce_dtype: torch.dtype | None) -> torch.Tensor:
    """`tensor` as sent: cast to `reduce_dtype` when one is set and `tensor` is floating point."""
    if reduce_dtype is not None and tensor.is_floating_point() and tensor.dtype != reduce_dtype:
        return tensor.to(reduce_dtype)
    return tensor


def allreduce_hook(state: FlatGradCommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average the bucket over the group with one all-reduce.

    With the fast path (`FlatGrad.ddp_kwargs()`) the bucket is the model's whole flat
    buffer. Register it with ``ddp.register_comm_hook(model.comm_state(), allreduce_hook)``.

    Args:
        state: The `FlatGradCommState` of the model (`FlatGrad.comm_state()`).
        bucket: DDP's bucket (under DDP's Python reducer a ``(grad, param)`` pair, averaged in place).

    Returns:
        A future whose value is the bucket buffer itself, averaged in place, so DDP copies
        nothing back (None under DDP's Python reducer, which ignores it)."""
    state.num_calls += 1
    if isinstance(bucket, tuple):  # DDP's Python reducer: see `_python_reducer_mean`
        _python_reducer_mean(state, *bucket)
        return None  # type: ignore[return-value]  # (that reducer ignores what hooks return)
    engine = state.engine
    engine.ddp.adopt(bucket, engine.current)
    ranks = engine.ddp.ranks_not_joined(bucket.buffer().device, state.process_group)
    return _all_reduce_mean(bucket.buffer(), state.process_group, state.reduce_dtype, ranks)


def _python_reducer_mean(state: FlatGradCommState, grad: torch.Tensor, param: torch.Tensor) -> None:
    """`allreduce_hook` under DDP's Python reducer (``torch._dynamo.config.optimize_ddp = "python_reducer"``,
    for compiled autograd), which calls comm hooks once per parameter with ``(param.grad, param)`` after its
    AccumulateGrad, ignoring what they return: average that gradient in place with a traceable functional
    all-reduce, as DDP does there without a hook. One collective per parameter, as stock's; compiled autograd
    leaves `.grad` outside the buffer anyway (see README, "Compiled autograd")."""
    import torch.distributed._functional_collectives as fcol

    edge = state.engine.ddp
    edge.forwards_without_hook = None  # (the hook runs)
    if not edge.warned:
        edge.warned = True
        logger.warning(
            "flatgrad: DDP's python reducer (optimize_ddp='python_reducer') calls allreduce_hook "
            "once per parameter: gradients are averaged one all-reduce each, as DDP does there"
        )
    wire = to_wire(grad, state.reduce_dtype) / dist.get_world_size(state.process_group)
    group = state.process_group or dist.group.WORLD
    assert group is not None  # the hook runs inside DDP: a process group exists
    grad.copy_(fcol.all_reduce(wire, "sum", group))


# torch 2.13 renamed the flat-tensor collectives to *_single (the old names warn); older ones: *_tensor.
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def average_op(tensor: torch.Tensor, process_group: dist.ProcessGroup | None) -> tuple[Any, bool]:
    """(reduce op, whether to divide by the world size first) for averaging `tensor`: NCCL averages inside the
    reduction (`ReduceOp.AVG`, no extra pass); other backends sum a tensor divided first, so that sums stay
    finite. One rank divides nothing (``x / 1`` is ``x`` to the bit: a pass for nothing)."""
    if tensor.is_cuda and "nccl" in str(dist.get_backend(process_group)):
        return dist.ReduceOp.AVG, False
    return dist.ReduceOp.SUM, dist.get_world_size(process_group) > 1


def _all_reduce_mean(
    buffer: torch.Tensor,
    process_group: dist.ProcessGroup | None,
    reduce_dtype: torch.dtype | None,
    ranks: int | None = None,
) -> torch.futures.Future[torch.Tensor]:
    """All-reduce `buffer` in place to the group mean (over `ranks` of them: under a `Join`
    that counts only the ranks not joined yet); the future's value is `buffer`."""
    work, wire = launch_average(buffer, process_group, reduce_dtype, scatter=False, divisor=ranks)
    fut = work.get_future()
    if wire is None:
        return fut.then(lambda f: f.value()[0])
    return fut.then(lambda f: buffer.copy_(f.value()[0]))  # (a compressed wire: copied back)


def all_reduce_grads(
    store: GradStore, process_group: dist.ProcessGroup | None = None, reduce_dtype: torch.dtype | None = None
) -> None:
    """Average every buffer over the group: one all-reduce per (dtype, device) buffer.

    A parameter without a gradient on this rank contributes zeros. Afterwards `.grad` is as stock DDP with
    find_unused_parameters=True leaves it: the slot for every parameter some rank used, None for a parameter
    no rank used. The used flags travel in the same all-reduce, after the buffer (`GradStore.flagged`); a
    buffer adopted from a DDP bucket has no room for them, and its flags take one more, small, all-reduce."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "all_reduce_grads needs an initialised default process group (dist.init_process_group)"
        )
    check_wire_dtype(reduce_dtype)
    store.settle()
    futures, flagged, unflagged = [], [], []
    for key, buffer in store.buffers.items():
        found = store.flagged(key)  # (the buffer with its flags after it, the flags, their parameters)
        futures.append(_all_reduce_mean(buffer if found is None else found[0], process_group, reduce_dtype))
        if found is None:
            unflagged += [p for p in store.params if store.slot(p)[0] == key]
        else:
            flagged.append(found[1:])
    if unflagged:
        used = host_tensor([p.grad is not None for p in unflagged], torch.uint8, unflagged[0].device)
        dist.all_reduce(used, op=dist.ReduceOp.MAX, group=process_group)
        flagged.append((used, tuple(unflagged)))
    torch.futures.wait_all(futures)
    settle_unused(store, flagged)


def settle_unused(store: GradStore, flagged: Sequence[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]) -> None:
    """After a sync that carried used flags (`flags[i]` other than 0: some rank used `members[i]`): `.grad`
    becomes the slot for each parameter without a `.grad` here that another rank used, as stock DDP with
    find_unused_parameters=True leaves it (a main grad holds a gradient: `GradStore.has_main`). The flags are
    read only when this rank has such a parameter: on CUDA that waits for the communication, and usually
    every parameter has its `.grad`."""
    main = store.has_main
    for flags, members in flagged:
        if all(param.grad is not None or main(param) for param in members):
            continue
        for param, flag in zip(members, flags.tolist()):
            if flag != 0 and param.grad is None and not main(param):  # (complex: complex flags)
                if store.is_main(param):
                    store.unwritten.discard(id(param))
                else:
                    param.grad = store.view(param)


def refuse_main_grads(grad_dtype: str | None, what: str) -> None:
    """Raise if main grads are configured: DDP buckets gradients by the parameter's dtype,
    so its hook path cannot carry float32 main grads of bfloat16/float16 parameters."""
    if grad_dtype is not None:
        raise ValueError(
            f"{what} cannot carry main grads (grad_dtype={grad_dtype!r}): DDP keeps each "
            "gradient in its parameter's dtype; synchronise this model with flatgrad.replicate "
            "instead (float32 buckets; with flatgrad.ShardedOptimizer for float32 master "
            "shards), or apply FlatGrad without grad_dtype"
        )


def ddp_kwargs(store: GradStore) -> dict[str, Any]:
    """DDP constructor arguments for the zero-copy, one-all-reduce-per-buffer path.

    gradient_as_bucket_view=True makes `.grad` a view of DDP's bucket, which the hook then adopts as the flat
    buffer. A bucket cap above the largest buffer keeps one bucket per (dtype, device), also after DDP's
    one-time bucket rebuild (an explicit bucket_cap_mb sets the first bucket's cap too)."""
    largest = max(buf.numel() * buf.element_size() for buf in store.buffers.values())
    cap = math.ceil(largest / 2**20) + 1
    if cap == _DDP_DEFAULT_BUCKET_MB:
        cap += 1  # Accelerate drops a DDP kwarg equal to DDP's default: 25 would become "unset"
    return {"gradient_as_bucket_view": True, "bucket_cap_mb": cap}


@dataclass(frozen=True)
class BackendPolicy:
    """Every choice flatgrad makes for gloo and CPU hosts only, decided once per process group
    (`backend_policy`). With NCCL each field keeps its default, so the NCCL path never enters a gloo branch.
    Each choice stays only with its measured number, in docs/performance.md ("The CPU and gloo choices, and
    the numbers that keep them").

    Attributes:
        reduce_scatter: a ShardedOptimizer's buckets are reduce-scattered (NCCL). False on gloo, whose
            reduce-scatter is slower than its all-reduce: the buckets are all-reduced instead, the shards
            split whole buffers unless ``overlap_param_gather`` (`BucketSync.shard_plan`), and only the shards
            are divided after the sum (`Round.divide_after`).
        all_gather: a ShardedOptimizer's parameters are all-gathered (NCCL). False on gloo, whose all-gather
            is slower than its broadcasts of the same shards: each rank broadcasts its shard.
        spare_core: the ranks' compute threads leave a host core free (`cores_to_spare`) for gloo's thread to
            overlap the backward; without one, a CPU buffer's first bucket is half a bucket, not DDP's 1 MiB
            (`plan_buckets`)."""

    reduce_scatter: bool = True
    all_gather: bool = True
    spare_core: bool = True


def backend_policy(process_group: dist.ProcessGroup | None) -> BackendPolicy:
    """The `BackendPolicy` for `process_group` (read once, by the engine that owns it)."""
    gloo = dist.get_backend(process_group) == "gloo"
    return BackendPolicy(
        reduce_scatter=not gloo, all_gather=not gloo, spare_core=cores_to_spare(process_group)
    )


def cores_to_spare(process_group: dist.ProcessGroup | None) -> bool:
    """Whether the ranks' compute threads leave a host core free: torch's intra-op threads times the ranks on
    the host (torchrun's ``LOCAL_WORLD_SIZE``, else the group's size) below the cores this process may use."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        cores = os.cpu_count() or 1
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    ranks = int(local) if local.isdigit() else dist.get_world_size(process_group)
    return torch.get_num_threads() * ranks < cores


def launch_average(
    sent: torch.Tensor,
    process_group: dist.ProcessGroup | None,
    reduce_dtype: torch.dtype | None,
    scatter: bool,
    divide: bool = True,
    divisor: int | None = None,
) -> tuple[Any, torch.Tensor | None]:
    """Start averaging `sent` over `process_group` asynchronously: an all-reduce in place, or (`scatter`) a
    reduce-scatter whose result is this rank's piece of `sent`. Returns the work and the wire tensor if not
    `sent` itself (a `reduce_dtype` copy, for the caller to copy back once done). `divide` False where the
    reduction sums: the caller divides the sum (the shards a ShardedOptimizer reads). `divisor`: the ranks to
    average over instead of the world size (a `Join` dividing by the ranks not joined yet; joined ranks send
    zeros): a sum divided first, on every backend."""
    wire = to_wire(sent, reduce_dtype)
    op, must_divide = average_op(wire, process_group)
    world_size = dist.get_world_size(process_group)
    ranks = world_size
    if divisor is not None:
        op, must_divide, ranks = dist.ReduceOp.SUM, True, divisor
    if divide and must_divide:
        wire.div_(ranks)  # divide first, so sums stay finite (used flags stay > 0)
    if scatter:
        out = wire.view(world_size, -1)[dist.get_rank(process_group)]
        work = reduce_scatter_flat(out, wire, op=op, group=process_group, async_op=True)
    else:
        work = dist.all_reduce(wire, op=op, group=process_group, async_op=True)
    return work, (wire if wire is not sent else None)
