"""The scatter-adds of the gathers' backwards (repeated positions summed), each with its
deterministic variant under `torch.use_deterministic_algorithms`, and naming an index a
gather refused."""

from __future__ import annotations

import torch


def scatter_rows(
    target: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, alpha: float = 1.0
) -> torch.Tensor:
    """``target[index] += alpha * rows`` with repeated indices summed.

    `index_add_` scatters without sorting; under `torch.use_deterministic_algorithms`
    the sort-based `index_put_(accumulate=True)` gives a run-to-run identical sum.
    """
    if torch.are_deterministic_algorithms_enabled():
        return target.index_put_((index,), rows if alpha == 1.0 else rows * alpha, accumulate=True)
    return target.index_add_(0, index, rows, alpha=alpha)


def scatter_add_into(
    target: torch.Tensor, dim: int, index: torch.Tensor, values: torch.Tensor
) -> torch.Tensor:
    """``target.scatter_add_(dim, index, values)``: repeated positions are summed.

    On CPU that kernel is run-to-run identical (each output element is summed in one
    thread, in order); on accelerators it uses atomics, so under
    `torch.use_deterministic_algorithms` the sum goes through the sorting
    ``index_put_(accumulate=True)`` on linear indices instead.
    """
    if target.device.type == "cpu" or not torch.are_deterministic_algorithms_enabled():
        return target.scatter_add_(dim, index, values)
    flat = (
        target if target.is_contiguous() else torch.zeros_like(target, memory_format=torch.contiguous_format)
    )
    strides = flat.stride()
    linear = index * strides[dim]
    for d in range(index.dim()):
        if d != dim:
            shape = [1] * index.dim()
            shape[d] = index.shape[d]
            linear = linear + torch.arange(index.shape[d], device=index.device).view(shape) * strides[d]
    flat.view(-1).index_put_((linear.reshape(-1),), values.reshape(-1), accumulate=True)
    return target if flat is target else target.add_(flat)


def out_of_range(index: torch.Tensor, low: int, size: int) -> int | None:
    """A value of a CPU `index` outside ``[low, size)``, read after a gather refused it (to
    name it: the gathers do not look at their indices beforehand); None when every value
    lies inside, on accelerators (a sync), or where the values cannot be read (inside a
    torch.func transform)."""
    if index.device.type != "cpu" or not index.numel():
        return None
    try:
        smallest, largest = (int(value) for value in torch.aminmax(index))
    except RuntimeError:
        return None
    if smallest < low:
        return smallest
    return largest if largest >= size else None
