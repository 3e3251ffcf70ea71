"""`PipelineStage`: torch's pipeline stage over a `flatgrad.replicate`d submodule, averaging in the last
micro-batch's backward of each step, as torch's stage does for a DDP submodule. Imports
`torch.distributed.pipelining`; `import flatgrad` never imports this module.

torch's stage (`torch.distributed.pipelining.PipelineStage`) tells only DDP and FSDP submodules, by
`isinstance`, which backward of a step is the last. For DDP it runs every forward under ``no_sync()`` and
prepares DDP's reducer before the last backward (``last_backward``, which the schedule passes to
`backward_one_chunk` and `backward_weight_one_chunk`). This subclass does the same for `replicate` through
those public methods alone: every forward under ``model.no_sync()``, and the last full backward opened
averaging (`flatgrad._bucket_sync.BucketSync.averaging`), so its buckets launch during that backward as
`replicate`'s do outside a pipeline, with a ShardedOptimizer's reduce-scatter too. A step that ran a split
backward (zero-bubble schedules: an input part and a weight part, whose weight gradients come from
``torch.autograd.grad`` and are assigned to `.grad` by the stage, so no AccumulateGrad hook sees them)
averages instead with one `FlatGrad.all_reduce_grads` after its last backward, not overlapped. Either way the
step synchronises once. `scale_grads` (the schedule's division by the number of micro-batches) divides the
flat gradient buffers, where every gradient is after that synchronisation (also a ShardedOptimizer's
reduce-scattered ones, whose `.grad` refuses math, and main grads, whose `.grad` is None)."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import pipelining

from flatgrad._flatgrad import settled_buffers
from flatgrad._parallel import ReplicateModule, ReplicateState, replicate_state
from flatgrad._zero_state import flagged_ranks

# The methods of torch's stage this subclass runs inside, and the parameter each must take.
_STAGE_METHODS = {
    "forward_maybe_with_nosync": None,
    "backward_one_chunk": "last_backward",
    "backward_weight_one_chunk": "last_backward",
    "scale_grads": "grad_scale_factor",
}


def _check_torch_stage() -> None:
    """Raise unless torch's stage has the methods (and their parameters) this subclass
    overrides: on a torch whose stage lacks them the schedule would call around it."""
    for name, parameter in _STAGE_METHODS.items():
        method = getattr(pipelining.PipelineStage, name, None)
        names = inspect.signature(method).parameters if method is not None else {}
        takes = method is not None and (parameter is None or parameter in names)
        if not takes:
            raise RuntimeError(
                f"flatgrad.pipelining.PipelineStage needs torch's PipelineStage.{name}"
                + (f"({parameter}=...)" if parameter else "")
                + f", which torch {torch.__version__} lacks: average with model.no_sync() around "
                "schedule.step(...) and model.all_reduce_grads(dp_group) after it"
            )


class PipelineStage(pipelining.PipelineStage):
    """`torch.distributed.pipelining.PipelineStage` whose submodule is replicated (`flatgrad.replicate`): the
    micro-batches accumulate locally, and the step's last backward averages, overlapped bucket by bucket (the
    step's one synchronisation). No ``no_sync()`` or ``all_reduce_grads`` around ``schedule.step(...)``. Takes
    torch's arguments: ``PipelineStage(model, stage_index, num_stages, device, input_args=...,
    output_args=..., group=..., dw_builder=None)``.

    Args:
        submodule: The stage's module, replicated (over the stage's data-parallel group).
        *args: torch's PipelineStage arguments after the submodule (stage index, number of
            stages, device, ...), unchanged.
        **kwargs: torch's keyword arguments (``input_args``, ``output_args``, ``group``),
            unchanged; ``dw_builder`` must be None.

    Raises:
        TypeError: `submodule` is not replicated (a FlatGrad alone, or DDP
            over one, goes into torch's own PipelineStage).
        ValueError: A ``dw_builder`` is given (its weight gradients would come after the averaging backward).
        RuntimeError: torch's stage lacks the methods this one runs inside (an older torch)."""

    def __init__(self, submodule: ReplicateModule, *args: Any, **kwargs: Any) -> None:
        if not isinstance(submodule, ReplicateModule):
            raise TypeError(
                "submodule must be one flatgrad.replicate was applied to (a FlatGrad alone or DDP "
                "over one goes into torch.distributed.pipelining.PipelineStage), got a "
                f"{type(submodule).__name__}"
            )
        if kwargs.get("dw_builder") is not None:
            raise ValueError(
                "dw_builder must be None for flatgrad.pipelining.PipelineStage (its weight "
                f"gradients would come after the averaging backward), got {kwargs['dw_builder']!r}"
            )
        _check_torch_stage()
        super().__init__(submodule, *args, **kwargs)
        self.replicated = submodule
        self.data_parallel = replicate_state(submodule)
        self._split_this_step = False  # a split backward (input part) ran since the last average
        self._averaged = False  # the step's last backward averaged since the last scale_grads

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        """Every micro-batch's forward under ``model.no_sync()``: its backward accumulates.

        Args:
            *args: The micro-batch's positional inputs, for the submodule.
            **kwargs: Its keyword inputs.

        Returns:
            The submodule's output."""
        with self.replicated.no_sync():
            return super().forward_maybe_with_nosync(*args, **kwargs)

    def backward_one_chunk(
        self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True, last_backward: bool = False
    ) -> None:
        """torch's, with the step's last full backward averaging, overlapped (or, after a split backward this
        step, followed by one all-reduce).

        Args:
            bwd_chunk_id: The micro-batch.
            loss: The last stage's loss of that micro-batch.
            full_backward: False for the input part of a split backward.
            last_backward: Whether this is the stage's last backward of the step."""
        if not full_backward:
            self._split_this_step = True
        overlapped = last_backward and full_backward and not self._split_this_step
        with self.data_parallel._engine.averaging() if overlapped else contextlib.nullcontext():
            super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        if last_backward and full_backward:
            if not overlapped:
                self._all_reduce()
            self._split_this_step = False
            self._averaged = True

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        """torch's weight part of a split backward; the step's last is followed by one
        all-reduce of the flat buffers (these gradients reach no AccumulateGrad hook).

        Args:
            bwd_chunk_id: The micro-batch.
            last_backward: Whether this is the stage's last backward of the step."""
        super().backward_weight_one_chunk(bwd_chunk_id, last_backward)
        if last_backward:
            self._all_reduce()
            self._split_this_step = False
            self._averaged = True

    def _all_reduce(self) -> None:
        """The split-backward step's average: `replicate`'s settings (`reduce_dtype`, and
        with `check_finite` its check first, on every rank alike), one all-reduce per buffer."""
        dp = self.data_parallel
        if dp._engine.check_finite:
            _check_finite(dp)
        dp.module.all_reduce_grads(dp.process_group, dp.reduce_dtype)

    def scale_grads(self, grad_scale_factor: int) -> None:
        """Divide every gradient by `grad_scale_factor` (the schedule's number of micro-batches, for a mean
        loss), in the flat buffers: as torch's ``p.grad.div_``, also of reduce-scattered and main grads.

        Args:
            grad_scale_factor: What the schedule divides by (1: nothing).

        Raises:
            RuntimeError: No backward since the last call was the step's last (a schedule that passes no
                ``last_backward``): the gradients were not averaged."""
        if not self._averaged:
            raise RuntimeError(
                "flatgrad.pipelining.PipelineStage: the schedule scaled the gradients before any "
                "backward it called the step's last (last_backward=True), so they were not averaged "
                "over the data-parallel group"
            )
        self._averaged = False
        if grad_scale_factor != 1:
            with torch.no_grad():
                for buffer in settled_buffers(self.data_parallel.module).values():
                    buffer.div_(grad_scale_factor)


def _check_finite(dp: ReplicateState) -> None:
    """What ``check_finite=True`` does in a replicated backward, before a split-backward step's all-reduce:
    raise `RuntimeError` on every rank when any holds a non-finite gradient (naming its parameters there). One
    all-reduce of a flag per rank (split weight gradients may still be `.grad`s outside the buffers)."""
    group = dp.process_group
    grads = [(name, p.grad) for name, p in dp.module.named_parameters() if p.grad is not None]
    local = [name for name, grad in grads if not bool(torch.isfinite(grad).all())]
    device = grads[0][1].device if grads else torch.device("cpu")
    bad = flagged_ranks(bool(local), device, group)
    if bad:
        rank = dist.get_rank(group)
        where = f"rank {rank} (this rank) in {local[:8]}" if local else f"rank(s) {bad}"
        raise RuntimeError(
            f"replicate(check_finite=True): a non-finite gradient (NaN or inf) before averaging "
            f"on {where}; this step's gradients are not usable: skip it (zero_grad) or stop"
        )
