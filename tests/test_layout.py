"""layout (plan_layout, dense_stride, align_elements) and buffer.GradStore.

The oracle for layout is the contract written in the docstrings: groups by (dtype, device),
slots in reverse registration order, aligned, non-overlapping, strides as `empty_like` gives.
"""

from __future__ import annotations

import gc
from itertools import pairwise

import pytest
import torch
from torch import nn

from flatgrad._buffer import GradStore, owner_of
from flatgrad._layout import align_elements, dense_stride, merge_touching, overlap, plan_layout

CPU = torch.device("cpu")
META = torch.device("meta")


def _mixed_params() -> list[torch.Tensor]:
    """float32 and float64 params of odd sizes, interleaved, plus a meta-device group."""
    shapes_dtypes = [
        ((7, 3), torch.float32),
        ((5,), torch.float64),
        ((1,), torch.float32),
        ((2, 3, 4), torch.float64),
        ((65,), torch.float32),
        ((0,), torch.float32),
        ((3, 33), torch.float64),
        ((129,), torch.float32),
    ]
    params = [torch.empty(shape, dtype=dtype) for shape, dtype in shapes_dtypes]
    params.append(torch.empty(11, 3, device=META))
    params.append(torch.empty(4, device=META))
    return params


def _check_no_overlap(spans: list[tuple[int, int]]) -> None:
    spans = sorted(spans)
    for (start_a, end_a), (start_b, _) in pairwise(spans):
        assert end_a <= start_b, f"slots [{start_a}, {end_a}) and [{start_b}, ...) overlap"


# --- align_elements / dense_stride --------------------------------------------------------


@pytest.mark.parametrize(
    ("align_bytes", "element_size", "expected"),
    [(256, 4, 64), (256, 8, 32), (256, 2, 128), (256, 1, 256), (4, 8, 1), (1, 4, 1), (8, 8, 1)],
)
def test_align_elements(align_bytes: int, element_size: int, expected: int) -> None:
    assert align_elements(align_bytes, element_size) == expected


def test_dense_stride_contiguous() -> None:
    assert dense_stride(torch.empty(3, 4, 5)) == (20, 5, 1)


def test_dense_stride_keeps_channels_last() -> None:
    param = torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last)
    assert dense_stride(param) == param.stride() == (60, 1, 15, 3)


def test_dense_stride_keeps_dense_transpose() -> None:
    param = torch.empty(4, 6).t()
    assert dense_stride(param) == param.stride() == (1, 6)


@pytest.mark.parametrize(
    "param",
    [
        torch.empty(4, 6)[:, ::2],  # gaps
        torch.empty(4, 1).expand(4, 3),  # overlapping (stride 0)
        torch.empty(2, 3, 4, 6)[..., ::2],
    ],
    ids=["strided", "expanded", "strided-4d"],
)
def test_dense_stride_non_dense_becomes_contiguous(param: torch.Tensor) -> None:
    assert dense_stride(param) == torch.empty(param.shape).stride()


def test_dense_stride_meta_param() -> None:
    assert dense_stride(torch.empty(2, 3, device=META)) == (3, 1)


# --- plan_layout --------------------------------------------------------------------------


def test_plan_layout_groups_by_dtype_and_device() -> None:
    params = _mixed_params()
    layouts = plan_layout(params, 256)
    assert set(layouts) == {(torch.float32, CPU), (torch.float64, CPU), (torch.float32, META)}
    for (dtype, device), group in layouts.items():
        for index in group.param_indices:
            assert params[index].dtype == dtype and params[index].device == device
    covered = sorted(i for group in layouts.values() for i in group.param_indices)
    assert covered == list(range(len(params)))


def test_plan_layout_reverse_registration_order() -> None:
    params = _mixed_params()
    for group in plan_layout(params, 256).values():
        assert list(group.param_indices) == sorted(group.param_indices, reverse=True)
        offsets = [slot.offset for slot in group.slots]
        assert offsets == sorted(offsets)
        # Strictly increasing wherever the earlier slot is non-empty.
        for slot, nxt in pairwise(group.slots):
            if slot.numel:
                assert nxt.offset > slot.offset


@pytest.mark.parametrize("align_bytes", [1, 4, 8, 64, 256, 512, 1024, 4096])
def test_plan_layout_aligned_dense_and_covering(align_bytes: int) -> None:
    params = _mixed_params()
    for (dtype, _), group in plan_layout(params, align_bytes).items():
        align = max(1, align_bytes // dtype.itemsize)
        spans = []
        for index, slot in zip(group.param_indices, group.slots, strict=True):
            param = params[index]
            assert slot.offset % align == 0
            assert slot.numel == param.numel()
            assert slot.shape == tuple(param.shape)
            assert slot.stride == dense_stride(param)
            spans.append((slot.offset, slot.offset + slot.numel))
        _check_no_overlap(spans)
        assert group.numel >= max(end for _, end in spans)
        assert group.numel >= sum(params[i].numel() for i in group.param_indices)
        # Padding is below one alignment unit per slot: the layout is tight.
        assert group.numel < sum(params[i].numel() + align for i in group.param_indices)


def test_plan_layout_slot_strides_follow_params() -> None:
    channels_last = torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last)
    non_dense = torch.empty(4, 6)[:, ::2]
    params = [channels_last, non_dense]
    group = plan_layout(params, 256)[(torch.float32, CPU)]
    strides = {index: slot.stride for index, slot in zip(group.param_indices, group.slots, strict=True)}
    assert strides == {0: (60, 1, 15, 3), 1: (3, 1)}


def test_plan_layout_exact_offsets() -> None:
    # float32, align 256 B = 64 elements; reverse order: c (100), b (64), a (1).
    a, b, c = torch.empty(1), torch.empty(8, 8), torch.empty(100)
    group = plan_layout([a, b, c], 256)[(torch.float32, CPU)]
    assert group.param_indices == (2, 1, 0)
    assert [slot.offset for slot in group.slots] == [0, 128, 192]
    assert group.numel == 256


def test_plan_layout_empty() -> None:
    assert plan_layout([], 256) == {}


# --- GradStore ----------------------------------------------------------------------------


def _store_params() -> list[nn.Parameter]:
    return [
        nn.Parameter(torch.randn(7, 3)),
        nn.Parameter(torch.randn(5, dtype=torch.float64)),
        nn.Parameter(torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)),
        nn.Parameter(torch.randn(1)),
        nn.Parameter(torch.randn(3, 33, dtype=torch.float64)),
    ]


def _flat(store: GradStore, param: torch.Tensor) -> torch.Tensor:
    """`param`'s slot as a 1-D view of its buffer."""
    key, slot = store.slot(param)
    return store.buffers[key].narrow(0, slot.offset, slot.numel)


@pytest.mark.parametrize("align_bytes", [8, 64, 256, 512, 1024, 1 << 16])
def test_store_buffers_aligned(align_bytes: int) -> None:
    params = _store_params()
    store = GradStore(params, align_bytes)
    assert set(store.buffers) == {(torch.float32, CPU), (torch.float64, CPU)}
    for (dtype, device), buffer in store.buffers.items():
        assert buffer.dim() == 1 and buffer.dtype == dtype and buffer.device == device
        assert buffer.data_ptr() % align_bytes == 0
        assert torch.count_nonzero(buffer) == 0
    for param in params:
        assert store.view(param).data_ptr() % align_bytes == 0
    store.release()


@pytest.mark.parametrize("align_bytes", [256, 512, 1024])
def test_store_alignment_over_many_allocations(align_bytes: int) -> None:
    # Allocator addresses vary; a few sizes make a misaligned first attempt likely.
    stores = [GradStore([nn.Parameter(torch.randn(n))], align_bytes) for n in (1, 3, 17, 100, 1000)]
    for store in stores:
        (buffer,) = store.buffers.values()
        assert buffer.data_ptr() % align_bytes == 0
        store.release()


def test_store_view_is_one_tensor_shaped_like_param() -> None:
    params = _store_params()
    store = GradStore(params, 256)
    for param in params:
        first, second = store.view(param), store.view(param)
        assert first is second  # `.grad is slot` is an identity test on the hot path
        assert first.data_ptr() == second.data_ptr()
        assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
        assert first.shape == param.shape and first.stride() == param.stride()
        assert first.dtype == param.dtype
        first.fill_(3.0)
        assert torch.all(second == 3.0)
        flat = _flat(store, param)
        assert flat.dim() == 1 and flat.numel() == param.numel()
        assert flat.data_ptr() == first.data_ptr()
    store.release()


def test_store_views_do_not_overlap() -> None:
    params = _store_params()
    store = GradStore(params, 256)
    for index, param in enumerate(params):
        _flat(store, param).fill_(index + 1)
    for index, param in enumerate(params):
        assert torch.all(store.view(param) == index + 1)
    store.release()


def test_store_holds() -> None:
    params = _store_params()
    store = GradStore(params, 256)
    for param in params:
        view = store.view(param)
        assert store.holds(param, view)
        assert not store.holds(param, view.clone())
        assert not store.holds(param, None)
        assert not store.holds(param, torch.zeros_like(param))
    # The slot of another parameter of the same dtype is not this one's.
    assert not store.holds(params[0], store.view(params[3]).expand(7, 3))
    store.release()


def test_store_contains() -> None:
    params = _store_params()
    store = GradStore(params[:2], 256)
    assert params[0] in store and params[1] in store
    assert params[2] not in store
    assert "not a tensor" not in store
    store.release()


def test_store_second_store_over_same_params_raises() -> None:
    params = _store_params()
    first = GradStore(params, 256)
    with pytest.raises(ValueError, match="already has its gradient in the flat buffer"):
        GradStore(params, 256)
    with pytest.raises(ValueError, match=r"shape \(1,\) already has its gradient in the flat buffer"):
        GradStore([params[3]], 256)
    assert owner_of(params[0]) is first
    first.release()
    assert owner_of(params[0]) is None
    second = GradStore(params, 256)
    assert owner_of(params[0]) is second
    second.release()


def test_store_dropped_store_frees_params() -> None:
    params = _store_params()
    first = GradStore(params, 256)
    del first
    gc.collect()
    second = GradStore(params, 256)  # no release() needed: ownership is weak
    assert owner_of(params[-1]) is second
    second.release()


def test_store_release_leaves_other_owner_alone() -> None:
    params = _store_params()
    first = GradStore(params, 256)
    first.release()
    second = GradStore(params, 256)
    first.release()  # releasing a stale store must not drop the live owner
    assert owner_of(params[0]) is second
    with pytest.raises(ValueError, match="already has its gradient in the flat buffer"):
        GradStore(params, 256)
    second.release()


def test_store_settle() -> None:
    params = _store_params()
    store = GradStore(params, 256)
    for param in params:
        _flat(store, param).fill_(7.0)  # stale values
    params[0].grad = torch.full_like(params[0], 2.0)  # lives elsewhere
    params[1].grad = store.view(params[1])  # already in its slot
    store.settle()
    assert store.holds(params[0], params[0].grad)
    assert torch.all(params[0].grad == 2.0)
    assert store.holds(params[1], params[1].grad)
    assert torch.all(params[1].grad == 7.0)
    for param in params[2:]:
        assert param.grad is None
        assert torch.count_nonzero(_flat(store, param)) == 0
    store.release()


@pytest.mark.parametrize("align_bytes", [4, 64, 256])
def test_store_spans_cover_exactly_the_chosen_slots(align_bytes: int) -> None:
    """Spans zero the chosen parameters' slots (and padding) but never another slot; slots
    next to each other in a buffer share one span, across dtypes too."""
    gen = torch.Generator().manual_seed(0)
    sizes = [3, 5, 64, 1, 17, 8, 2, 33, 4]
    params = [
        nn.Parameter(torch.randn(n, generator=gen, dtype=torch.float64 if i % 4 == 3 else torch.float32))
        for i, n in enumerate(sizes)
    ]
    store = GradStore(params, align_bytes)
    chosen = [p for i, p in enumerate(params) if i not in (2, 6)]
    for buffer in store.buffers.values():
        buffer.fill_(7)
    torch._foreach_zero_(store.spans(chosen))
    for param in params:
        expected = 0.0 if any(param is c for c in chosen) else 7.0
        assert bool((store.view(param) == expected).all()), (tuple(param.shape), expected)
    # Unchosen slots 2 and 6 (both float32) split the float32 slots into at most three spans;
    # the float64 ones are adjacent and make one.
    assert len(store.spans(chosen)) <= 4
    assert len(store.spans(params)) == len(store.buffers)
    assert store.spans([]) == []


def test_a_seat_that_seats_nothing_keeps_the_record_of_the_running_one():
    """A nested backward whose seating finds every slot seated already (the outer backward
    seated them) leaves the outer one's record, which `flagged` and its final callback use,
    as it is; unseating it puts back None where nothing was written."""
    params = [nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(2))]
    store = GradStore(params, 256)
    outer = store.seat(params)
    assert [entry[0] for entry in outer] == params and store.seated is outer
    assert store.seat(params) == [] and store.seated is outer
    params[0].grad.add_(1.0)  # delivered; params[1] is not
    GradStore.unseat(outer)
    assert params[0].grad is not None and params[1].grad is None


def test_interval_helpers_merge_touching_runs_and_clip_to_a_window():
    # The one interval arithmetic behind slot runs, spans, shard pieces and checkpoint chunks.
    assert merge_touching([(0, 4), (4, 6), (8, 9), (9, 12), (16, 20)]) == [(0, 6), (8, 12), (16, 20)]
    assert merge_touching([]) == []
    assert merge_touching([(0, 4), (5, 6)]) == [(0, 4), (5, 6)]  # a gap (padding) is not merged over
    assert overlap(2, 10, 4, 8) == (4, 8)
    assert overlap(2, 10, 0, 3) == (2, 3)
    assert overlap(2, 10, 10, 12) is None  # [start, end): touching is not overlapping
    assert overlap(5, 5, 0, 10) is None
