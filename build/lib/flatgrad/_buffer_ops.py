"""Free functions over the flat buffers' tensors: allocating a buffer aligned
(`aligned_zeros`), staging host values for a device copy (`host_tensor`, `write_flags`),
scaling in place (`scale_`), reading on another CUDA stream (`read_here`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flatgrad.layout import GroupKey


def aligned_zeros(numel: int, key: GroupKey, align_bytes: int) -> torch.Tensor:
    """A zeroed 1-D tensor whose first element sits on an `align_bytes` boundary."""
    dtype, device = key
    buffer = torch.zeros(numel, dtype=dtype, device=device)
    misalignment = buffer.data_ptr() % align_bytes
    if misalignment == 0:
        return buffer
    itemsize = buffer.element_size()
    raw = torch.zeros(numel + align_bytes // itemsize, dtype=dtype, device=device)
    start = (-raw.data_ptr() % align_bytes) // itemsize
    return raw.narrow(0, start, numel)


def host_tensor(values: Sequence[bool | float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device`. For an accelerator it is staged in pinned memory
    and copied without blocking: a copy from pageable memory would make the host wait for
    everything queued on the stream (the whole backward), where the copy needs only to be
    ordered after it. Pinned blocks come from torch's caching host allocator, which does
    not hand a block out again before the copy that reads it has run."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    if device.type != "cuda":  # (pinned staging is CUDA's; other backends copy as they do)
        return torch.tensor(values, dtype=dtype).to(device)
    staged = torch.tensor(values, dtype=dtype, pin_memory=True)
    return staged.to(device, non_blocking=True)


def write_flags(flags: torch.Tensor, values: Sequence[float]) -> None:
    """Write `values` (one per element) into `flags` without waiting on the device."""
    if all(values):
        flags.fill_(1)  # the usual step: no host data to send
    else:
        flags.copy_(host_tensor(values, flags.dtype, flags.device), non_blocking=True)


def scale_(tensors: Sequence[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply `tensors` in place by the 0-d `coef` (a clipping coefficient), one foreach
    per device. A CPU `coef` of exactly 1 (clipping that does not clip: the norm is under
    `max_norm`) skips the pass: ``x * 1.0`` is ``x`` in every floating dtype, so the result
    is bitwise what stock's unconditional multiply gives, minus a read and write of every
    gradient. On accelerators the multiply always runs: reading `coef` would sync."""
    if coef.device.type == "cpu" and bool(coef == 1.0):
        return
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_device.setdefault(tensor.device, []).append(tensor)
    for device, group in by_device.items():
        torch._foreach_mul_(group, coef.to(device))


def read_here(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, marked as read by the current CUDA stream (`Tensor.record_stream`), where it
    may have been made on another: an AccumulateGrad hook runs on the stream its node was
    made on (DataParallel keeps the nodes from its construction), a final callback on the
    caller's. Torch's caching allocator then does not hand its memory out again, once it is
    freed, before that read has run. Elsewhere a no-op."""
    if tensor.is_cuda:
        tensor.record_stream(torch.cuda.current_stream(tensor.device))
    return tensor
