"""Autograd Functions whose backward writes weight gradients straight into the flat buffer.

Each backward first decides where a weight gradient goes (`weight_target`: ``"out"``, ``"add"``, ``"fresh"``,
``"skip"`` or ``"main"``) and writes it; the gathers' backwards scatter-add their rows (`scatter_rows`,
`scatter_add_into`: repeated positions summed, deterministic under `torch.use_deterministic_algorithms`). What
each mode does, and why "out" makes the slot `.grad` rather than returning it for AccumulateGrad to steal
(tied weights; AccumulateGrad then adds any unrouted contribution into it in place): docs/design.md, "Routed
layers".

Undefined gradients are not materialised as zeros (an output nothing differentiable used, a consumer that
returned None for it): the Functions hand every input None, as torch's own backwards do, so the slot is not
written and `.grad` stays None where stock leaves it. Nothing here imports torch.distributed."""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch.autograd.graph import Node

from flatgrad._buffer import count_use, find_slot
from flatgrad._prescale import write_scale
from flatgrad._torch_compat import GATHER_TAKES_INT32, fast_apply, functorch_active, will_execute


def plain_torch() -> bool:
    """Whether the routed forwards and the gathers must be plain torch ops: under torch.compile (Dynamo traces
    torch's own ops, no graph break), under torch.func transforms (they need no `.grad`) and inside a
    forward-mode AD level (these Functions have no jvp; torch's ops do)."""
    return torch.compiler.is_compiling() or functorch_active()


class _Linear(torch.autograd.Function):
    """`F.linear` whose backward writes the weight and bias gradients into their slots.

    The backward is written out flat (no helper per gradient): it runs once per layer per step, and its Python
    is what routing a layer costs over torch's own backward. A product in autocast's dtype is cast as written;
    one in half precision is rounded before it is added into a slot, as stock's AccumulateGrad adds it (not
    inside the GEMM); one into an empty slot off a fresh tensor's alignment is copied in (`aligned`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
        # (the bias first, as addmm's: AccumulateGrad nodes run in stock's order; None: no edge)
        out = F.linear(x, weight, bias)  # autocast, if on, picks the compute dtype here
        count_use(weight, False)
        if bias is not None:
            count_use(bias, True)
        ctx.save_for_backward(x, weight)
        ctx.set_materialize_grads(False)  # see the module doc on undefined gradients
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if grad_out is None:
            return None, None, None
        x, weight = ctx.saved_tensors
        need_x, need_b, need_w = ctx.needs_input_grad
        compute = grad_out.dtype  # differs from weight.dtype under autocast
        grad_x = grad_w = grad_b = None
        # Flattened once for every product: a non-contiguous gradient (through a permute, as a
        # fused qkv projection's) is copied at most once, as by stock's view backward.
        rows = grad_out if grad_out.dim() == 2 else _rows(grad_out)
        if need_x:
            grad_x = rows.mm(weight if weight.dtype == compute else weight.to(compute))
            if grad_out.dim() != 2:
                grad_x = grad_x.view(*grad_out.shape[:-1], grad_x.shape[-1])
            if grad_x.dtype != x.dtype:
                grad_x = grad_x.to(x.dtype)
        if not (need_w or need_b):
            return grad_x, None, None
        nexts = None if torch.compiler.is_compiling() else ctx.next_functions  # see TRACED
        if need_w:
            mode, slot, param = TRACED if nexts is None else node_target(nexts[-1][0])
            if mode != "skip":
                dtype = weight.dtype
                rows_t = rows.t()
                xs = x if x.dim() == 2 else _rows(x)
                if xs.dtype != compute:
                    xs = xs.to(compute)
                if mode == "fresh":  # (in the weight's layout, as stock's `mm_mat2_backward`)
                    row_major = weight.stride(1) == 1 and weight.stride(0) == weight.shape[1]
                    grad_w = _as(rows_t.mm(xs) if row_major else xs.t().mm(rows).t(), dtype)
                elif mode == "main":
                    add_product(slot, rows_t, xs)  # type: ignore[arg-type]
                elif _fresh_first(mode, slot, compute, dtype):  # type: ignore[arg-type]
                    w = rows_t.mm(xs)
                    slot.copy_(w) if mode == "out" else slot.add_(w, alpha=write_scale(param, mode))  # type: ignore[union-attr,arg-type]
                else:  # (scaled in the GEMM inside a replicate backward: see `write_scale`)
                    scale = write_scale(param, mode)  # type: ignore[arg-type]
                    if mode == "add":
                        slot.addmm_(rows_t, xs, alpha=scale)  # type: ignore[union-attr]
                    elif scale == 1.0:
                        torch.mm(rows_t, xs, out=slot)
                    else:  # (beta=0: the slot's old values are not read)
                        slot.addmm_(rows_t, xs, beta=0, alpha=scale)  # type: ignore[union-attr]
                if mode == "out":
                    param.grad = slot  # type: ignore[union-attr]
        if need_b and ctx.bias_dtype is not None:
            mode, slot, param = TRACED if nexts is None else node_target(nexts[1][0])
            if mode != "skip":
                dtype = ctx.bias_dtype
                if mode == "fresh":
                    grad_b = _as(rows.sum(0), dtype)
                elif mode == "out":
                    torch.sum(rows, 0, out=slot) if compute == dtype else slot.copy_(rows.sum(0))  # type: ignore[union-attr]
                    param.grad = slot  # type: ignore[union-attr]
                elif mode == "main":
                    slot.add_(rows.sum(0, dtype=slot.dtype))  # type: ignore[union-attr]
                else:
                    slot.add_(rows.sum(0))  # type: ignore[union-attr]
        return grad_x, grad_b, grad_w


def _fresh_first(mode: str, slot: torch.Tensor, compute: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether a routed Linear computes its weight's product ("out" or "add" mode) fresh, then copies or adds
    it into `slot`, as stock's AccumulateGrad would: in autocast's dtype (cast as it is written), added in
    half precision (rounded first), or into an empty slot off a fresh tensor's alignment (`aligned`)."""
    return compute != dtype or (dtype.itemsize < 4 if mode == "add" else not aligned(slot))


def aligned(slot: torch.Tensor) -> bool:
    """Whether a GEMM writing into `slot` with ``out=`` gives a fresh output's bits: the kernels pick their
    blocking by the output's address. Measured on an AVX-512 CPU (torch 2.13): a float32 product into memory
    4, 8 or 12 bytes past a 16-byte boundary, a float64 one 8 bytes past, differs in the last bits from the
    same product into a fresh (64-byte aligned) tensor. On CUDA torch's cuBLASLt path reads the alignment up
    to 256 bytes (`_getAlignment`, CUDABlas.cpp), the caching allocator's blocks are 512-byte aligned. The
    flat buffer's slots sit on `align_bytes` (256 by default); DDP's bucket packs them."""
    return slot.data_ptr() % (64 if slot.device.type == "cpu" else 256) == 0


def add_product(main: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``main += a @ b`` for a float32 `main` (a main grad) and bfloat16/float16 `a`, `b`, with every product
    and sum in float32 and no temporary of `main`'s size: on CUDA the GEMM accumulates into `main` itself
    (``addmm(..., out_dtype=torch.float32)``) where this torch has that kernel (`fused_accumulate`); elsewhere
    `a` and `b` (activation- sized) are upcast, exactly, and multiplied in float32."""
    if a.dtype == main.dtype:
        main.addmm_(a, b)
    elif main.device.type == "cuda" and fused_accumulate(main.device.type):
        torch.addmm(main, a, b, out_dtype=main.dtype, out=main)  # type: ignore[call-overload]
    else:
        main.addmm_(a.to(main.dtype), b.to(main.dtype))


@functools.cache
def fused_accumulate(device_type: str) -> bool:
    """Whether this torch's GEMM on `device_type` accumulates bfloat16 products into a float32 tensor in place
    (``torch.addmm(main, a, b, out_dtype=torch.float32, out=main)``): CUDA kernels of recent releases (2.8
    added ``out_dtype``; some refuse a float32 ``input``). Probed once per device type (2x2); CPU has none."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        main = torch.ones(2, 2, device=device_type)
        ones = torch.ones(2, 2, dtype=torch.bfloat16, device=device_type)
        torch.addmm(main, ones, ones, out_dtype=torch.float32, out=main)  # type: ignore[call-overload]
        return bool((main == 3).all())
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """Leading dims flattened: (..., n) -> (N, n); explicit sizes, so n == 0 works too."""
    return tensor.reshape(math.prod(tensor.shape[:-1]), tensor.shape[-1])


def _read_counts(index: torch.Tensor, size: int) -> torch.Tensor:
    """How often `index` reads each of `size` rows, int64 (scale_grad_by_freq). On CUDA `torch.bincount` sizes
    its output by ``index.max().item()``, a device sync per backward; a scatter-add of ones into `size` int64
    counters needs none (integer sums: the same counts in any order; 1-D: a deterministic kernel too)."""
    if index.device.type != "cuda":
        return torch.bincount(index, minlength=size)
    counts = torch.zeros(size, dtype=torch.int64, device=index.device)
    return counts.scatter_add_(0, index.long(), torch.ones_like(index, dtype=torch.int64))


def _as(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


class _GatherRows(torch.autograd.Function):
    """``weight[indices]`` along dim 0 (an embedding lookup) with a scatter-add backward."""

    @staticmethod
    def forward(
        ctx: Any,
        weight: torch.Tensor,
        indices: torch.Tensor,
        padding_idx: int | None,
        scale_grad_by_freq: bool,
    ) -> torch.Tensor:
        ctx.save_for_backward(indices)  # not the weight: a max_norm renorm may bump its version
        count_use(weight, True)
        ctx.set_materialize_grads(False)  # see the module doc on undefined gradients
        ctx.weight_meta = (weight.dtype, weight.device, weight.shape)
        ctx.padding_idx = padding_idx
        ctx.scale_grad_by_freq = scale_grad_by_freq
        flat_index = indices.reshape(-1)
        return weight.index_select(0, flat_index).view(*indices.shape, *weight.shape[1:])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        (indices,) = ctx.saved_tensors
        mode, target, param = weight_target(ctx, 0)
        if mode == "skip" or grad_out is None:
            return None, None, None, None
        dtype, device, shape = ctx.weight_meta
        if mode == "main":
            dtype = target.dtype  # type: ignore[union-attr]  # float32 rows into the main grad
        index = indices.reshape(-1)
        rows = grad_out.reshape(index.numel(), *shape[1:]).to(dtype)
        if ctx.padding_idx is not None:
            rows = rows.masked_fill((index == ctx.padding_idx).view(-1, *(1,) * (rows.dim() - 1)), 0)
        counts = _read_counts(index, shape[0])[index] if ctx.scale_grad_by_freq else None
        if mode == "fresh":
            fresh = torch.zeros(shape, dtype=dtype, device=device)
            if torch.is_grad_enabled():  # create_graph: keep the result differentiable
                rows = rows if counts is None else _divided(rows, counts)
                return fresh.index_add(0, index, rows), None, None, None
            return scatter_rows(fresh, index, rows, counts=counts), None, None, None
        assert target is not None and param is not None
        if mode == "out":
            scatter_rows(target.zero_(), index, rows, write_scale(param, mode), counts)
            param.grad = target
        else:
            add_rows(target, index, rows, 1.0 if mode == "main" else write_scale(param, mode), counts)
        return None, None, None, None


def gather_with_index_add(buffer: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``buffer[indices]`` along dim 0, whose backward is an `index_add_` scatter.

    Indices follow ``buffer[indices]``: in ``[-len(buffer), len(buffer))``, negative ones counting from the
    end. On CPU an index out of that range raises an `IndexError` naming it (one min over the indices finds
    negative ones; one above the range is named after the gather's own check refuses it); on CUDA looking
    would cost a device sync per call, so the gather's own device-side bounds check reports it.

    The default backward of ``buffer[indices]`` is ``index_put_(accumulate=True)``, which sorts the indices;
    the scatter computes the same sum without sorting. A `buffer` that is a `FlatGrad` model's parameter gets
    its gradient written into its slot. Under torch.compile, torch.func transforms and forward-mode AD it is
    `index_select` (whose backward is the same `index_add_`), so compiled graphs do not break.

    Args:
        buffer: The tensor to gather rows from (at least 1-d).
        indices: An int32 or int64 tensor of row indices, of any shape.

    Returns:
        A tensor of shape ``(*indices.shape, *buffer.shape[1:])``.

    Raises:
        TypeError: `buffer` or `indices` is not a tensor, or `indices` is not int32/int64.
        ValueError: `buffer` is 0-d.
        IndexError: On CPU, an index lies outside ``[-len(buffer), len(buffer))``."""
    if not isinstance(buffer, torch.Tensor) or not isinstance(indices, torch.Tensor):
        raise TypeError(
            f"buffer and indices must be tensors, got {type(buffer).__name__} and {type(indices).__name__}"
        )
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"indices must be an int32 or int64 tensor, got {indices.dtype}")
    if buffer.dim() == 0:
        raise ValueError("buffer must have at least one dimension, got a 0-d tensor")
    size = buffer.shape[0]
    if _has_negative(indices, size):
        indices = torch.where(indices < 0, indices + size, indices)
    if torch.compiler.is_compiling():
        return _select_rows(buffer, indices)
    try:
        if functorch_active():
            return _select_rows(buffer, indices)
        return gather_rows_into_slot(buffer, indices, None, False)
    except (IndexError, RuntimeError) as error:  # the gather's own range check: name the index
        bad = out_of_range(indices, 0, size)  # (negative ones are wrapped by now)
        if bad is not None:
            raise _bad_row(size, bad) from error
        raise


def _select_rows(buffer: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``buffer[indices]`` (indices in range) as torch's own op, for Dynamo and torch.func."""
    return buffer.index_select(0, indices.reshape(-1)).view(*indices.shape, *buffer.shape[1:])


def _bad_row(size: int, bad: int) -> IndexError:
    return IndexError(f"indices must lie in [-{size}, {size}) for a buffer of {size} rows, got {bad}")


def _has_negative(indices: torch.Tensor, size: int) -> bool:
    """Whether `indices` may hold negative entries (assumed on accelerators, where looking costs a sync, and
    while compiling or in torch.func transforms, where values cannot be read); on CPU one min over them, which
    also names an index below ``-size`` (one above the range is named when the gather refuses it)."""
    if not indices.numel():
        return False
    if indices.device.type != "cpu" or plain_torch():
        return True
    low = int(indices.min())
    if low < -size:
        raise _bad_row(size, low)
    return low < 0


class _GatherDim(torch.autograd.Function):
    """``torch.gather(input, dim, index)`` whose backward scatter-adds into the slot."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        count_use(input, False)
        ctx.set_materialize_grads(False)  # see the module doc on undefined gradients
        ctx.input_meta = (input.dtype, input.device, input.shape, dim)
        return torch.gather(input, dim, index)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        (index,) = ctx.saved_tensors
        mode, target, param = weight_target(ctx, 0)
        if mode == "skip" or grad_out is None:
            return None, None, None
        dtype, device, shape, dim = ctx.input_meta
        values = grad_out.to(dtype if mode != "main" else target.dtype)  # type: ignore[union-attr]
        if mode == "fresh":
            fresh = torch.zeros(shape, dtype=dtype, device=device)
            if torch.is_grad_enabled():  # create_graph: keep the result differentiable
                return fresh.scatter_add(dim, index, values), None, None
            return scatter_add_into(fresh, dim, index, values), None, None
        assert target is not None and param is not None
        if mode == "out":
            scatter_add_into(target.zero_(), dim, index, values)
            param.grad = target
        else:  # (into a slot written divided in this backward: divided too)
            scale = 1.0 if mode == "main" else write_scale(param, mode)
            scatter_add_into(target, dim, index, values if scale == 1.0 else values * scale)
        return None, None, None


def gather(input: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """``torch.gather(input, dim, index)`` whose backward scatter-adds the output gradient (repeats summed)
    straight into the slot of a `FlatGrad` model's parameter `input`: no input-sized temporary, copy or add.

    Same forward as `torch.gather`: `index` has `input`'s number of dimensions, is no larger than `input`
    along every dimension but `dim`, and holds values in ``[0, input.size(dim))``. On CPU an out-of-range
    value raises an `IndexError` naming it and the size (read after torch.gather's own check refused it:
    nothing added to valid calls); on accelerators (reading costs a device sync) torch.gather's device-side
    bounds check reports it. Under torch.compile, torch.func and forward-mode AD: `torch.gather`.

    Args:
        input: The tensor to gather from.
        dim: The dimension to gather along; negative counts from the end.
        index: An int32 or int64 tensor of positions along `dim`.

    Returns:
        A tensor of `index`'s shape and `input`'s dtype, as `torch.gather` returns.

    Raises:
        TypeError: `input` or `index` is not a tensor, `index` is not int32/int64, or `dim` is not an int.
        IndexError: `dim` is out of range; on CPU, an `index` value lies outside ``[0, input.size(dim))``.
        ValueError: `index` has another number of dimensions than `input` (and more than one element), or is
            larger than `input` along a dimension other than `dim`."""
    _check_gather(input, dim, index)
    if index.dtype == torch.int32 and not GATHER_TAKES_INT32:
        index = index.long()  # (torch 2.4's gather and scatter_add take int64 only: the same positions)
    if torch.compiler.is_compiling():
        return torch.gather(input, dim, index)
    gathered = dim % max(input.dim(), 1)
    try:
        return torch.gather(input, dim, index) if functorch_active() else gather_dim(input, gathered, index)
    except RuntimeError as error:  # torch.gather's own range check: name the value and the size
        size = input.shape[gathered] if input.dim() else 1
        bad = out_of_range(index, 0, size)
        if bad is not None:
            message = f"index values must lie in [0, {size}) along dimension {gathered}, got {bad}"
            raise IndexError(message) from error
        raise


def _check_gather(input: torch.Tensor, dim: int, index: torch.Tensor) -> None:
    if not isinstance(input, torch.Tensor) or not isinstance(index, torch.Tensor):
        raise TypeError(
            f"input and index must be tensors, got {type(input).__name__} and {type(index).__name__}"
        )
    if index.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"index must be an int32 or int64 tensor, got {index.dtype}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    ndim = max(input.dim(), 1)
    if not -ndim <= dim < ndim:
        raise IndexError(f"dim must lie in [{-ndim}, {ndim - 1}] for a {input.dim()}-d input, got {dim}")
    if index.dim() != input.dim() and index.numel() > 1:
        raise ValueError(f"index must have as many dimensions as input ({input.dim()}), got {index.dim()}")
    gathered = dim % ndim
    for d in range(index.dim() if index.dim() == input.dim() else 0):
        if d != gathered and index.shape[d] > input.shape[d]:
            raise ValueError(
                f"index must be no larger than input along dimension {d} (not the gathered one), "
                f"got {index.shape[d]} > {input.shape[d]}"
            )


# The routed layers' forwards (`flatgrad._routing`) and the gathers, which have checked that
# no torch.func transform is active: `Function.apply` without its Python layer (`fast_apply`).
linear_into_slot = fast_apply(_Linear)
gather_rows_into_slot = fast_apply(_GatherRows)
gather_dim = fast_apply(_GatherDim)


Mode = Literal["skip", "fresh", "out", "add", "main"]
# Compiled autograd traces a Function's backward with Dynamo (no graph or `.grad` to look
# at): the gradient is returned to the traced AccumulateGrad, as for stock.
TRACED: tuple[Mode, None, None] = ("fresh", None, None)


def weight_target(ctx: Any, index: int) -> tuple[Mode, torch.Tensor | None, torch.Tensor | None]:
    """Where the gradient of input `index` goes in this backward: (mode, slot, parameter).

    The parameter is taken from the graph (its AccumulateGrad node), not from saved
    tensors, which checkpointing and saved-tensor hooks hand back as other objects."""
    if not ctx.needs_input_grad[index]:
        return "skip", None, None
    if torch.compiler.is_compiling():
        return TRACED
    return node_target(ctx.next_functions[index][0])


def node_target(node: Node) -> tuple[Mode, torch.Tensor | None, torch.Tensor | None]:
    """`weight_target` for an input known to need a gradient, given its graph node."""
    param = getattr(node, "variable", None)  # None unless the input is a leaf (AccumulateGrad)
    found = find_slot(param) if param is not None else None
    if found is None or torch.is_grad_enabled():
        return "fresh", None, param
    if not param.requires_grad:  # type: ignore[union-attr]
        return "skip", None, param  # frozen since the forward: AccumulateGrad skips it too
    try:
        if not will_execute(node):
            return "skip", None, param  # backward(inputs=...) without this weight
    except RuntimeError:
        return "fresh", None, param  # torch.autograd.grad captures this leaf: leave .grad alone
    store, view = found
    if view.dtype != param.dtype or view.shape != param.shape:  # type: ignore[union-attr]
        if view.shape != param.shape:  # type: ignore[union-attr]
            raise _re_pointed(tuple(view.shape), tuple(param.shape))  # type: ignore[union-attr]
        if store.is_main(param):  # type: ignore[arg-type]
            # A main grad: hooked gradients are returned, and AccumulateGrad's hook adds them in.
            if param._backward_hooks:  # type: ignore[union-attr]
                return "fresh", None, param
            store.unwritten.discard(id(param))  # (the layer writes it now)
            return "main", view, param
        store.stale = True  # param.data replaced or converted since the layout: lay out again
        return "fresh", None, param
    grad = param.grad  # type: ignore[union-attr]
    if param._backward_hooks or id(param) in store.summed:  # type: ignore[union-attr]
        # Tensor hooks must see the gradient, and uses summed as stock's (`begin_backward`) are autograd's to
        # add: return it for AccumulateGrad to add into the slot (seated here when empty, -0.0 filled).
        if grad is None:
            store.seat_one(param, view)  # type: ignore[arg-type]
        return "fresh", None, param
    if grad is None:
        return "out", view, param
    if grad is view:
        return ("out" if store.fresh_seat(param) else "add"), view, param  # type: ignore[arg-type]
    return ("add", grad, param) if store.holds(param, grad) else ("fresh", None, param)  # type: ignore[arg-type]


def _re_pointed(was: tuple[int, ...], now: tuple[int, ...]) -> RuntimeError:
    """A routed weight re-pointed at another shape, reached past the model's call (no layout check ran)."""
    return RuntimeError(
        f"a parameter of shape {was} was re-pointed at a tensor of shape {now} (param.data = ...) after "
        "FlatGrad laid out its gradient buffers; the layout is fixed when FlatGrad is applied: call "
        "model.relayout() after changing its parameters"
    )


def scatter_rows(
    target: torch.Tensor,
    index: torch.Tensor,
    rows: torch.Tensor,
    alpha: float = 1.0,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """``target[index] += alpha * rows`` with repeated indices summed; with `counts` (one
    integer per row, scale_grad_by_freq), each row divided by its own.

    `index_add_` scatters without sorting; under `torch.use_deterministic_algorithms`, and for a
    bfloat16/float16 `target` on the CPU, `index_put_(accumulate=True)` (run-to-run identical; on the CPU
    serial, rounding after each row as stock's embedding backward does, where `index_add_` gives other bits).
    With `counts` on the CPU, stock adds each row times ``1 / count`` (its add kernel's multiply-add): the
    rows, stably sorted by count (each index keeps its rows' order), go in one `index_add_` per count with
    that scale (exactly 1: as above), bit for bit stock's. Elsewhere they are divided."""
    if counts is not None:
        if target.device.type == "cpu":
            order = torch.argsort(counts, stable=True)
            counts, index, rows = counts[order], index[order], rows.index_select(0, order)
            values, sizes = torch.unique_consecutive(counts, return_counts=True)
            bounds = [0, *itertools.accumulate(sizes.tolist())]
            scales = [alpha / count for count in values.tolist()]
            for scale, start, end in zip(scales, bounds, bounds[1:]):  # (CPU: deterministic)
                if scale == 1.0:  # (index_add_'s own path at 1: half precision below)
                    scatter_rows(target, index[start:end], rows[start:end])
                else:
                    target.index_add_(0, index[start:end], rows[start:end], alpha=scale)
            return target
        rows = _divided(rows, counts)
    if torch.are_deterministic_algorithms_enabled() or (
        target.dtype in (torch.bfloat16, torch.float16) and target.device.type == "cpu"
    ):
        return target.index_put_((index,), rows if alpha == 1.0 else rows * alpha, accumulate=True)
    return target.index_add_(0, index, rows, alpha=alpha)


def _divided(rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each of `rows` divided by its count, in float32 at least (a float16 count overflows)."""
    wide = counts.to(torch.promote_types(rows.dtype, torch.float32))
    return (rows / wide.view(-1, *(1,) * (rows.dim() - 1))).to(rows.dtype)


def add_rows(
    target: torch.Tensor,
    index: torch.Tensor,
    rows: torch.Tensor,
    alpha: float = 1.0,
    counts: torch.Tensor | None = None,
) -> None:
    """``target[index] += alpha * rows`` (each row divided by its `counts`, as in `scatter_rows`) with the
    rows of each repeated index summed first, as stock sums them: its backward scatters them into zeros (the
    "out" mode's sum) and AccumulateGrad adds that to the gradient already there. Scattered straight into
    `target`, a row would round against that gradient one at a time ((g + r1) + r2, not g + (r1 + r2)).

    A table no longer than the rows is summed as stock does (into zeros of its size, then one add), and so is
    any on an accelerator under `torch.use_deterministic_algorithms` (CUDA's scatter-min alerts; CPU's
    scatters are deterministic). A longer one, without a sort: a scatter-min finds each index's first position
    (one integer per row of `target`), the rows are summed there in `scatter_rows`'s order, and every other
    position adds +0.0. That changes nothing: a sum started from +0.0, as stock's, is never -0.0, so ``g + s``
    is not -0.0 either, and ``x + 0.0`` is `x` for every other `x` (added before the sum, in any order, the
    same holds; not under flush-to-zero, where ``g + s`` can flush to -0.0: only its sign differs then)."""
    deterministic = index.device.type != "cpu" and torch.are_deterministic_algorithms_enabled()
    if target.shape[0] <= index.numel() or deterministic:
        target.add_(scatter_rows(torch.zeros_like(target), index, rows, counts=counts), alpha=alpha)
        return
    index = index.long()  # (int32 indexing is patchy on older releases)
    positions = torch.arange(index.numel(), device=index.device)
    first = torch.full((target.shape[0],), index.numel(), dtype=torch.long, device=index.device)
    first = first.scatter_reduce_(0, index, positions, "amin").index_select(0, index)
    scatter_rows(target, index, scatter_rows(torch.zeros_like(rows), first, rows, counts=counts), alpha)


def scatter_add_into(
    target: torch.Tensor, dim: int, index: torch.Tensor, values: torch.Tensor
) -> torch.Tensor:
    """``target.scatter_add_(dim, index, values)``: repeated positions are summed.

    On CPU that kernel is run-to-run identical (each output element is summed in one thread, in order); on
    accelerators it uses atomics, so under `torch.use_deterministic_algorithms` the sum goes through the
    sorting ``index_put_(accumulate=True)`` on linear indices instead."""
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
    """A value of a CPU `index` outside ``[low, size)``, read after a gather refused it (to name it: the
    gathers do not look at their indices beforehand); None when every value lies inside, on accelerators (a
    sync), or where the values cannot be read (inside a torch.func transform)."""
    if index.device.type != "cpu" or not index.numel():
        return None
    try:
        smallest, largest = (int(value) for value in torch.aminmax(index))
    except RuntimeError:
        return None
    if smallest < low:
        return smallest
    return largest if largest >= size else None
