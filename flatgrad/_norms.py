"""Gradient norms that stay accurate at any buffer size.

One `vector_norm` over a whole flat buffer sums millions of squares into one accumulator; on the CPU a float32
norm of a 20M-element tensor is then about 1e-3 off the float64 norm (2e-4 at 6.6M, 1e-5 at 1M), and a
bfloat16 one is rounded to bfloat16 besides. Stock `clip_grad_norm_` takes one norm per parameter, which hides
this on models of small tensors; a flat buffer would expose it. Here a tensor is cut into chunks of
`_CHUNK_NUMEL` elements, each chunk's norm is taken in the tensor's precision (at least float32) and the chunk
norms are combined in float64: still one pass over the memory, and within about 1e-9 (float32) or 1e-7
(bfloat16, float16) of the float64 norm at any size."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from flatgrad._buffer import GradStore

# The CPU's norm kernel accumulates each row in order, so its error grows with the row:
# with gradients of mean 0.5, 8Ki-element rows are ~1e-6 off, 1Ki-element rows ~1e-9
# (float32) and ~1e-7 (bfloat16 upcast). Accelerators reduce in trees anyway.
_CHUNK_NUMEL = 1 << 10
# Low-precision tensors are upcast to float32 this many elements at a time (a bounded
# temporary: a bfloat16 row norm with dtype=float32 is as slow on the CPU and less exact).
_BLOCK_NUMEL = 1 << 20
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a norm of `dtype` gradients: at least float32 (a bfloat16 norm keeps 3
    significant digits), real for complex gradients."""
    if dtype.is_complex:
        return torch.float64 if dtype == torch.complex128 else torch.float32
    return torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else torch.float32


def vector_norm(tensor: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The `norm_type` norm of all elements of `tensor` as a float64 0-d tensor on its
    device, accumulated in chunks (see the module notes) for a positive finite order (0,
    negative, infinite: one `vector_norm`); complex64 in complex128 (each ``|z|`` rounds)."""
    if tensor.is_sparse:
        tensor = tensor.coalesce().values()  # the norm of a sparse tensor is its values'
    flat = tensor.reshape(-1) if tensor.dtype != torch.complex64 else tensor.reshape(-1).to(torch.complex128)
    if not (0 < norm_type < math.inf) or flat.numel() <= _CHUNK_NUMEL:
        return torch.linalg.vector_norm(flat, norm_type, dtype=_accumulator(flat.dtype)).double()
    num_chunks = flat.numel() // _CHUNK_NUMEL
    body = flat[: num_chunks * _CHUNK_NUMEL]
    if body.dtype in _LOW_PRECISION:
        parts = [
            torch.linalg.vector_norm(_upcast(block).view(-1, _CHUNK_NUMEL), norm_type, dim=1)
            for block in body.split(_BLOCK_NUMEL)
        ]
    else:
        parts = [torch.linalg.vector_norm(body.view(num_chunks, _CHUNK_NUMEL), norm_type, dim=1)]
    tail = flat[num_chunks * _CHUNK_NUMEL :]
    if tail.numel():
        parts.append(torch.linalg.vector_norm(tail, norm_type, dtype=_accumulator(tail.dtype)).reshape(1))
    return torch.linalg.vector_norm(torch.cat([part.double() for part in parts]), norm_type)


def total_norm(norms: Sequence[torch.Tensor], norm_type: float, dtype: torch.dtype) -> torch.Tensor:
    """torch's combination of per-piece norms (the `norm_type` norm of their stack), done in
    float64 on the first piece's device and returned as `dtype`; 0 when there is none."""
    if not norms:
        return torch.tensor(0.0, dtype=dtype)
    first = norms[0].device
    stacked = torch.stack([norm.to(first, torch.float64) for norm in norms])
    return torch.linalg.vector_norm(stacked, norm_type).to(dtype)


def _accumulator(dtype: torch.dtype) -> torch.dtype | None:
    return torch.float32 if dtype in _LOW_PRECISION else None


def _upcast(block: torch.Tensor) -> torch.Tensor:
    """`block` as float32, exactly. A bfloat16 is the top half of a float32's bits: moved
    there with integer ops, which CPUs without bfloat16 instructions vectorise (4x faster
    than ``.float()`` measured on one core: 18 against 69 ms for 20M elements)."""
    if block.dtype == torch.bfloat16:
        return (block.view(torch.int16).to(torch.int32) << 16).view(torch.float32)
    return block.float()


def piece_norms(
    store: GradStore, others: list[torch.Tensor], norm_type: float
) -> tuple[list[torch.Tensor], torch.dtype]:
    """The per-piece float64 norms whose `norm_type` norm is the total of a store's gradients and `others`
    (gradients outside it), and the total's dtype. For a positive order a whole buffer is one piece (its
    padding and the slots of parameters without a gradient are zero, so they add nothing); order 0 and
    negative orders are defined by torch per gradient tensor, so each is its own piece (a main grad always is
    one: it stands for its parameter's gradient, whose `.grad` stays None)."""
    if norm_type > 0:
        pieces = store.norm_pieces()
    else:
        grads = [store.view(p) if store.is_main(p) else p.grad for p in store.params]
        pieces = [grad for grad in grads if grad is not None]
    pieces += others
    norms = [vector_norm(t, norm_type) for t in pieces]
    dtype = functools.reduce(torch.promote_types, [norm_dtype(t.dtype) for t in pieces], torch.float32)
    return norms, dtype
