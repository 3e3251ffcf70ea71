"""`flatgrad.ReplicateModule` against stock DDP (the oracle), on 2 and 3 gloo ranks.

Each rank feeds different data; the oracle is DDP(find_unused_parameters=True) on a deep
copy in the same process, stepping the same optimizer. float64: both sides sum the same
per-rank gradients divided by the world size, so they agree to round-off (1e-10 after
several optimizer steps).
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from conftest import ROUTE_ALL, grad_in_buffers
from dist_utils import average_grads, rank_profile, run_ranks
from oracle import Lockstep, assert_grads_like, assert_params_like, stock
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import flatgrad
from flatgrad import replicate_state
from flatgrad._flatgrad import engine_of

pytestmark = pytest.mark.distributed

TOL = {"rtol": 1e-10, "atol": 1e-10}


class _Net(nn.Module):
    """Tied embedding/head, routed and unrouted layers, a frozen layer, a branch used on
    some steps only, and a block that can run under activation checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 16)
        self.fc = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.frozen = nn.Linear(16, 16).requires_grad_(False)
        self.branch = nn.Linear(16, 16)
        self.head = nn.Linear(16, 40, bias=False)
        self.head.weight = self.emb.weight
        self.double()

    def forward(
        self, tokens: torch.Tensor, use_branch: bool = True, checkpoint: bool = False
    ) -> torch.Tensor:
        h = self.emb(tokens)
        if checkpoint:
            h = torch.utils.checkpoint.checkpoint(self._block, h, use_reentrant=False)
        else:
            h = self._block(h)
        h = self.frozen(h)
        if use_branch:
            h = self.branch(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), tokens.flatten())

    def _block(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.tanh(self.fc(h)))


def _tokens(rank: int, step: int, micro: int = 0) -> torch.Tensor:
    seed = 1000 * rank + 10 * step + micro
    return torch.randint(0, 40, (4, 6), generator=torch.Generator().manual_seed(seed))


def _assert_close(ours: nn.Module, ref: nn.Module, what: str) -> None:
    """Parameters, and `.grad` with their None-ness, equal the oracle's (by name)."""
    assert_params_like(ours, ref, **TOL, what=what)
    assert_grads_like(ours, ref, **TOL, what=f"grad {what}")


def _dp_and_ddp(
    bucket_cap_mb: float, build: Callable[[], nn.Module] = _Net, config: Any = ROUTE_ALL
) -> tuple[flatgrad.FlatGrad, flatgrad.ReplicateModule, DDP]:
    """One model (`_Net` unless `build` says) under FlatGrad + DataParallel, and a copy of
    it under stock DDP."""
    torch.manual_seed(0)
    model = build()
    ref = DDP(copy.deepcopy(model), find_unused_parameters=True)
    flat = flatgrad.FlatGrad(model, config=config)
    return flat, flatgrad.replicate(flat, bucket_cap_mb=bucket_cap_mb), ref


def _assert_grads_match(ours: nn.Module, ref: nn.Module, what: str) -> None:
    """`.grad` None-ness and values equal the oracle's (float32 ones to float32 precision)."""
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), f"{what} {name}"
        if q.grad is not None:
            tol = TOL if q.dtype == torch.float64 else {"rtol": 1e-6, "atol": 1e-7}
            torch.testing.assert_close(p.grad, q.grad, **tol, msg=lambda m, n=name: f"{what} {n}: {m}")


def _equal_to_ddp_worker(rank: int, world_size: int, bucket_cap_mb: float) -> None:
    flat, dp, ref = _dp_and_ddp(bucket_cap_mb)
    model = flat
    assert len(replicate_state(dp).buckets) >= (2 if bucket_cap_mb < 0.01 else 1)
    opt = torch.optim.AdamW(dp.parameters(), lr=0.05, weight_decay=0.1)
    pair = Lockstep(model, dp, opt, ref, torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1))
    for step in range(4):
        pair.zero_grad()
        use_branch = not (step == 1 and rank == 1) and step != 2  # unused on one rank, then on all
        checkpoint = step == 3
        with pair.no_sync():  # gradient accumulation: the first micro-batch does not sync
            pair.backward(_tokens(rank, step, 0), use_branch, checkpoint)
        pair.backward(_tokens(rank, step, 1), use_branch, checkpoint)
        _assert_close(flat, ref.module, f"step {step} before update")
        pair.step()
    _assert_close(flat, ref.module, "final")
    assert dp.state_dict().keys() == model.state_dict().keys()
    # As under DDP, a backward whose graph bypasses the model's call (``model.forward``, as
    # DDP's ``ref.module``) is not averaged after an averaged one (no synchronising forward since).
    pair.zero_grad()
    flat.forward(_tokens(rank, 9), True, False).backward()
    ref.module(_tokens(rank, 9), True, False).backward()
    _assert_close(flat, ref.module, "bypassed")


@pytest.mark.parametrize(("world_size", "bucket_cap_mb"), [(2, 25.0), (2, 0.001), (3, 0.001)])
def test_parameters_equal_stock_ddp(world_size, bucket_cap_mb):
    run_ranks(_equal_to_ddp_worker, bucket_cap_mb, world_size=world_size)


class _Reentrant(nn.Module):
    """Three Linears, one of them under a reentrant activation checkpoint: in the middle
    (its gradients come from a nested backward) or last (the backward's first gradients do),
    or none (torch.autograd.grad does not go with reentrant checkpoints)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        self.where = where
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.where == "none":
            return self._last(self._middle(h))
        if self.where == "middle":
            h = torch.utils.checkpoint.checkpoint(self._middle, h, use_reentrant=True)
            return self.c(h).sum()
        return torch.utils.checkpoint.checkpoint(self._last, self._middle(h), use_reentrant=True)

    def _middle(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.b(h))

    def _last(self, h: torch.Tensor) -> torch.Tensor:
        return self.c(h).sum()


def _max_grad_diff(ours: nn.Module, ref: nn.Module) -> float:
    return max((p.grad - q.grad).abs().max().item() for p, q in zip(ours.parameters(), ref.parameters()))


def _backward_kinds_worker(rank: int, world_size: int) -> None:
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    x.requires_grad_(True)
    for where in ("middle", "last"):
        torch.manual_seed(0)
        model = _Reentrant(where)
        ref = DDP(copy.deepcopy(model))  # DDP supports reentrant checkpoints without unused parameters
        dp = flatgrad.replicate(flatgrad.FlatGrad(model, config=ROUTE_ALL), bucket_cap_mb=0.0001)
        for _ in range(2):
            dp.zero_grad()
            ref.zero_grad()
            dp(x).backward()
            ref(x).backward()
            assert _max_grad_diff(model, ref.module) < 1e-12, where
    # torch.autograd.grad accumulates nothing: the averaged .grad stay as they are
    model.where = "none"
    before = [p.grad.clone() for p in model.parameters()]
    torch.autograd.grad(dp(x), x)
    torch.autograd.grad(dp(x), list(dp.parameters()))
    torch.autograd.grad(dp(x), x, create_graph=True)
    assert all(torch.equal(b, p.grad) for b, p in zip(before, model.parameters()))
    # a create_graph backward cannot be averaged: refused, allowed under no_sync
    with pytest.raises(RuntimeError, match="cannot average the gradients of a backward with create_graph"):
        dp(x).backward(create_graph=True)
    with dp.no_sync():
        dp(x).backward(create_graph=True)
    # as under DDP, the forward decides: a forward under no_sync does not sync its backward
    dp.zero_grad()
    ref.zero_grad()
    with dp.no_sync():
        ours = dp(x)
    with ref.no_sync():
        theirs = ref(x)
    ours.backward()
    theirs.backward()
    assert _max_grad_diff(model, ref.module) < 1e-12


def test_reentrant_checkpointing_autograd_grad_create_graph_and_no_sync_forward():
    run_ranks(_backward_kinds_worker)


def _bf16_hook(state, bucket):  # noqa: ANN001, ANN202 (DDP checks annotations that are real types)
    """DDP's bf16_compress_hook (refused by DDP on CPU): cast, divide, sum, cast back."""
    buffer = bucket.buffer()
    wire = buffer.to(torch.bfloat16).div_(dist.get_world_size())
    future = dist.all_reduce(wire, async_op=True).get_future()
    return future.then(lambda f: buffer.copy_(f.value()[0]))


def _wire_and_rebuild_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = _Net()
    ref = DDP(copy.deepcopy(model), find_unused_parameters=True)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    dp = flatgrad.replicate(flat, bucket_cap_mb=0.002, reduce_dtype=torch.bfloat16)
    ref.register_comm_hook(None, _bf16_hook)
    buckets = replicate_state(dp).buckets
    for step in range(3):
        if step == 2:  # freezing a layer lays the buffers out again; the buckets follow
            model.fc.requires_grad_(False)
            ref.module.fc.requires_grad_(False)
        dp.zero_grad()
        ref.zero_grad()
        dp(_tokens(rank, step)).backward()
        ref(_tokens(rank, step)).backward()
        # bfloat16 on the wire: exactly what DDP's bf16 hook computes, element by element
        _assert_close(flat, ref.module, f"step {step}")
        for p in flat.parameters():
            assert p.grad is None or grad_in_buffers(flat, p.grad)
        with torch.no_grad():  # a plain SGD step on both
            for p, q in zip(model.parameters(), ref.module.parameters()):
                if p.grad is not None:
                    p.sub_(0.1 * p.grad)
                    q.sub_(0.1 * q.grad)
    assert replicate_state(dp).buckets[0].data_ptr() != buckets[0].data_ptr()  # cut from the new buffer


def test_wire_dtype_equals_ddp_bf16_hook_and_buckets_follow_a_rebuild():
    run_ranks(_wire_and_rebuild_worker)


def _converted_worker(rank: int, world_size: int) -> None:
    """The model converted behind the wrapper (``flat.float()`` / ``.double()`` on
    the plain model, not on the wrapper) and a layer frozen behind it, between steps. The
    forward's per-step check is O(1) and does not look at dtypes; the slots are found stale
    when the backward starts, FlatGrad lays out again there, and DataParallel cuts its
    buckets from the new buffers before any gradient is final. Oracle: stock autograd on a
    copy converted the same way, averaged by one all-reduce per gradient."""
    torch.manual_seed(0)
    model = _Net()
    ref = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    dp = flatgrad.replicate(flat, bucket_cap_mb=0.002)
    for step, change in enumerate(["", "float", "double", "freeze"]):
        for module in (model, ref):
            if change == "freeze":
                module.fc.requires_grad_(False)
            elif change:
                getattr(module, change)()
        dp.zero_grad()
        ref.zero_grad()
        dp(_tokens(rank, step)).backward()
        ref(_tokens(rank, step)).backward()
        for q in ref.parameters():
            if q.grad is not None:
                dist.all_reduce(q.grad)
                q.grad.div_(world_size)
        tol = TOL if model.fc.bias.dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
        for (name, p), q in zip(flat.named_parameters(), ref.parameters()):
            assert p.dtype == q.dtype, name
            assert (p.grad is None) == (q.grad is None), f"step {step} {name}"
            if q.grad is not None:
                where = f"step {step} {name}"
                torch.testing.assert_close(p.grad, q.grad, **tol, msg=lambda m, w=where: f"{w}: {m}")
                assert grad_in_buffers(flat, p.grad), f"step {step} {name}"
        assert {b.dtype for b in replicate_state(dp).buckets} == {model.fc.bias.dtype}


def test_conversions_and_freezing_behind_the_wrapper_are_followed_by_the_buckets():
    run_ranks(_converted_worker)


def _profile_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)]).double()
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)  # routed: weight gradients written in place
    dp = flatgrad.replicate(flat, bucket_cap_mb=0.6)  # about one 256x256 float64 weight each
    x = torch.randn(8, 256, dtype=torch.float64)
    launched: list[float] = []
    original = dist.all_reduce

    def spy(tensor, *args, **kwargs):  # noqa: ANN001, ANN202
        launched.append(time.perf_counter())
        return original(tensor, *args, **kwargs)

    for step in range(3):
        dp.zero_grad()
        loss = dp(x).square().mean()
        if step == 2:
            dist.all_reduce = spy  # type: ignore[assignment]
            with rank_profile(record_shapes=True) as prof:
                loss.backward()
            dist.all_reduce = original  # type: ignore[assignment]
            ended = time.perf_counter()
        else:
            loss.backward()
    events = [e for e in prof.events() if e.name.startswith("c10d::allreduce_")]
    num_buckets = len(replicate_state(dp).buckets)
    assert num_buckets >= 3
    assert len(events) == num_buckets  # one per bucket: the used flags travel with the last
    copies = [
        e.name
        for e in prof.events()
        if e.name in {"aten::copy_", "aten::add_", "aten::clone"}
        and [256, 256] in [list(s) for s in e.input_shapes]
    ]
    assert copies == []  # zero weight-sized gradient copies
    # No division pass over the weights either: their layers wrote them divided by the world
    # size (`flatgrad._prescale`); only the biases' slots are divided at their buckets' launch.
    divisions = [
        e.input_shapes
        for e in prof.events()
        if e.name in {"aten::div_", "aten::mul_", "aten::_foreach_div_"}
        and any(math.prod(s) >= 256 * 256 for s in e.input_shapes if s)
    ]
    assert divisions == []
    backward_ops = sorted(e.time_range.start for e in prof.events() if e.name == "aten::mm")
    first_collective = min(e.time_range.start for e in events)
    assert first_collective < backward_ops[-1], "the first bucket must launch before backward ends"
    assert launched and launched[0] < ended
    buffers = list(flat.grad_buffers.values())
    for p in model.parameters():
        assert p.grad.untyped_storage().data_ptr() == buffers[0].untyped_storage().data_ptr()


def test_one_collective_per_bucket_first_launched_during_backward_zero_copy():
    run_ranks(_profile_worker)


class _UsedTwice(nn.Module):
    """A routed weight also read directly (a penalty on it), a tied embedding and head
    (two routed writers of one slot), and an embedding with repeated indices."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 16)
        self.fc = nn.Linear(16, 16)
        self.head = nn.Linear(16, 40, bias=False)
        self.head.weight = self.emb.weight
        self.double()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.fc(self.emb(tokens))))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        return loss + 0.1 * self.fc.weight.square().sum() + 0.01 * self.emb.weight.sum()


def _used_twice_worker(rank: int, world_size: int) -> None:
    flat, dp, ref = _dp_and_ddp(25.0, _UsedTwice)
    store = engine_of(flat).store
    opt = torch.optim.SGD(dp.parameters(), lr=0.1)
    pair = Lockstep(flat, dp, opt, ref, torch.optim.SGD(ref.parameters(), lr=0.1))
    for step in range(3):
        pair.zero_grad()
        accumulate = step == 2
        if accumulate:  # a first micro-batch under no_sync: written undivided
            with pair.no_sync():
                pair.backward(_tokens(rank, step, 0))
        pair.backward(_tokens(rank, step, 1 if accumulate else 0))
        routed = {id(flat.fc.weight), id(flat.emb.weight)}
        # Both are also read directly: the first backward finds it (their gradients reach
        # AccumulateGrad) and later ones sum their uses as stock's, not written by the layers.
        assert (store.prescale.written == routed) == (world_size == 2 and step == 0)
        assert store.read_elsewhere >= routed
        _assert_close(flat, ref.module, f"step {step}")
        pair.backward(_tokens(rank, step, 5))  # a second synchronised backward adds on top
        _assert_close(flat, ref.module, f"step {step}, added")
        pair.step()


class _ReadOtherwise(nn.Module):
    """A routed layer called under autocast and again outside it, its weight also read by
    `flatgrad.gather` before it runs; a large plain table read with `gather_with_index_add`
    and directly; and (set by the test) a post-accumulate-grad hook on a routed weight."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.out = nn.Linear(16, 16)
        self.table = nn.Parameter(torch.randn(1 << 10, 128))  # placed, not seated
        self.double()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = tokens.double().repeat(1, 3)[:, :16] / 40
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.lin(x)
        h = self.lin(torch.tanh(h.double()))  # this later call's backward writes the slot first
        read = flatgrad.gather(self.out.weight, 1, torch.arange(4).repeat(16, 1)).sum()
        rows = flatgrad.gather_with_index_add(self.table, tokens.flatten() * 7)
        return self.out(h).square().sum() + read + rows.square().sum() + 0.1 * self.table.sum()


def _clip_in_place(param: torch.Tensor) -> None:
    param.grad.clamp_(-1.0, 1.0)  # type: ignore[union-attr]


def _read_otherwise_worker(rank: int, world_size: int) -> None:
    flat, dp, ref = _dp_and_ddp(25.0, _ReadOtherwise)
    for model in (flat, ref.module):
        model.out.weight.register_post_accumulate_grad_hook(_clip_in_place)
    for step in range(2):
        dp.zero_grad()
        ref.zero_grad()
        dp(_tokens(rank, step)).backward()
        ref(_tokens(rank, step)).backward()
        _assert_close(flat, ref.module, f"step {step}")


def test_routed_weights_read_otherwise_get_ddp_averages():
    """Where a routed slot is written divided, every other write into it in that backward is
    divided too (autocast's, a gather's), a plain parameter's slot (no hook to divide what
    plain autograd brings) is not, and neither is one whose post-accumulate-grad hook must
    see the local gradient, as under DDP."""
    run_ranks(_read_otherwise_worker)


@pytest.mark.parametrize("world_size", [2, 3])
def test_routed_weights_written_divided_also_used_directly_or_tied_match_ddp(world_size):
    """On 2 ranks the routed layers write their slots divided by the world size (no bucket
    division over them); a gradient that reaches such a weight through plain autograd is
    divided on its way into the slot (the first backward: from the next on, a weight also
    read directly sums its uses as stock's). 3 ranks divide the buckets as before."""
    run_ranks(_used_twice_worker, world_size=world_size)


def _failing_worker(rank: int, world_size: int) -> None:
    flat = flatgrad.FlatGrad(nn.Linear(4, 4))
    dp = flatgrad.replicate(flat)
    if rank == 1:
        raise RuntimeError("rank 1 fails before its backward")
    dp(torch.randn(2, 4)).sum().backward()


def test_a_failing_rank_ends_the_run_quickly():
    start = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 (the harness reports the failed rank)
        run_ranks(_failing_worker, timeout=90)
    assert time.monotonic() - start < 80


def _compiled_worker(rank: int, world_size: int, bucket_cap_mb: float) -> None:
    torch._dynamo.reset()
    flat, dp, ref = _dp_and_ddp(bucket_cap_mb)
    compiled = torch.compile(dp, backend="aot_eager")
    opt = torch.optim.AdamW(dp.parameters(), lr=0.05, weight_decay=0.1)
    pair = Lockstep(flat, compiled, opt, ref, torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1))
    for step in range(3):
        pair.backward(_tokens(rank, step))
        _assert_close(flat, ref.module, f"step {step}")
        assert all(grad_in_buffers(flat, p.grad) for p in flat.parameters() if p.grad is not None)
        pair.step()
        pair.zero_grad()


@pytest.mark.parametrize("bucket_cap_mb", [25.0, 0.001], ids=["one_bucket", "buckets"])
def test_torch_compile_of_dataparallel_averages_from_the_first_step(bucket_cap_mb):
    """torch.compile(dp): the compiled model's first backward hands the routed weights'
    gradients to AccumulateGrad outside the buffer (the layers run as plain torch); each
    bucket takes them in before its collective, so step 0 is averaged too (it was not)."""
    run_ranks(_compiled_worker, bucket_cap_mb, timeout=240)


def _assigned_grad_worker(rank: int, world_size: int, bucket_cap_mb: float) -> None:
    flat, dp, ref = _dp_and_ddp(bucket_cap_mb)
    for module in (flat, ref.module):
        for param in module.parameters():
            if param.requires_grad:  # a .grad of one's own, outside the buffer
                param.grad = torch.full_like(param, float(rank + 1))
    dp(_tokens(rank, 0)).backward()
    ref(_tokens(rank, 0)).backward()
    _assert_close(flat, ref.module, "assigned")


@pytest.mark.parametrize("bucket_cap_mb", [25.0, 0.001], ids=["one_bucket", "buckets"])
def test_a_grad_assigned_before_backward_is_averaged_like_ddp(bucket_cap_mb):
    """Stock DDP averages whatever `.grad` holds after backward, a tensor assigned before
    it included (AccumulateGrad adds into it); DataParallel takes it into the slot first."""
    run_ranks(_assigned_grad_worker, bucket_cap_mb)


def _compiled_autograd_worker(rank: int, world_size: int) -> None:
    from torch._dynamo import compiled_autograd

    dp = flatgrad.replicate(flatgrad.FlatGrad(_Net(), config=ROUTE_ALL))
    compiled = compiled_autograd._enable(torch.compile(backend="aot_eager"))
    with pytest.raises(RuntimeError, match="cannot run its bucket hooks under compiled autograd"), compiled:
        dp(_tokens(rank, 0)).backward()


def test_compiled_autograd_is_refused_with_a_clear_error_on_every_rank():
    """Compiled autograd traces backward hooks into a graph and refuses autograd final
    callbacks, which DataParallel needs to launch its last bucket: a clear error at the
    start of that backward, on every rank, before any collective (so nothing hangs)."""
    torch._dynamo.reset()
    run_ranks(_compiled_autograd_worker, timeout=120)


def _mismatch_worker(rank: int, world_size: int, how: str) -> None:
    if how == "extra layer":
        model = nn.Sequential(nn.Linear(4, 4), *([nn.Linear(4, 4)] if rank == 1 else []))
    else:  # same number of tensors, other shapes: a broadcast would not even complain
        model = nn.Sequential(nn.Linear(4, 4 + rank), nn.Linear(4 + rank, 4))
    with pytest.raises(ValueError, match=f"the model differs across ranks \\(rank {rank}: "):
        flatgrad.replicate(flatgrad.FlatGrad(model))


@pytest.mark.parametrize("how", ["extra layer", "other widths"])
def test_different_models_across_ranks_are_refused_on_every_rank(how):
    """As DDP's constructor does: a clear error on every rank, not a hang in the broadcast
    (an extra layer) or buckets that mix unrelated slots (other widths)."""
    run_ranks(_mismatch_worker, how, timeout=90)


def test_bad_arguments_are_refused():
    flat = flatgrad.FlatGrad(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got Tensor"):
        flatgrad.replicate(torch.zeros(2))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="needs an initialised process group"):
        flatgrad.replicate(flat)
    assert not isinstance(flat, flatgrad.ReplicateModule)  # (refused: the model as it was)


def _cuda_worker(rank: int, world_size: int, zero: bool) -> None:
    """DataParallel (and ShardedOptimizer) on CUDA, against stock DDP on the same GPUs: with
    NCCL (one GPU per rank) ReduceOp.AVG and the process group's communication stream; with
    gloo (both ranks on one GPU) divide-then-sum on CUDA tensors and gloo's own streams; the
    final callback's waits either way, with micro-batches and a branch unused on one rank."""
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", rank if nccl else 0)
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = _Net().to(device)
    ref = DDP(copy.deepcopy(model), device_ids=[device.index], find_unused_parameters=True)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    dp = flatgrad.replicate(flat, bucket_cap_mb=0.001)
    if zero:
        opt = flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, lr=0.05, weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(dp.parameters(), lr=0.05, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1)
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        use_branch = not (step == 1 and rank == 1)
        with dp.no_sync():
            dp(_tokens(rank, step, 1).to(device), use_branch).backward()
        with ref.no_sync():
            ref(_tokens(rank, step, 1).to(device), use_branch).backward()
        dp(_tokens(rank, step).to(device), use_branch).backward()
        ref(_tokens(rank, step).to(device), use_branch).backward()
        opt.step()
        ref_opt.step()
    torch.cuda.synchronize()
    for p, q in zip(flat.parameters(), ref.module.parameters()):
        torch.testing.assert_close(p, q, **TOL)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")
@pytest.mark.parametrize("zero", [False, True])
def test_nccl_on_two_gpus_equals_stock_ddp(zero):
    run_ranks(_cuda_worker, zero, backend="nccl")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("zero", [False, True])
def test_gloo_on_one_gpu_equals_stock_ddp(zero):
    run_ranks(_cuda_worker, zero)


def _no_sync_worker(rank: int, world_size: int) -> None:
    """A synchronised step on CUDA with NCCL, every parameter used: the host never waits
    for the GPU (the used flags travel with the last bucket and are not read back; nothing
    is copied from pageable memory). `torch.cuda.set_sync_debug_mode("error")` raises on
    any synchronising call."""
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]).to(device)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model, config=ROUTE_ALL), bucket_cap_mb=0.3)
    x = torch.randn(16, 256, device=device)
    for step in range(3):
        dp.zero_grad()
        if step == 2:
            torch.cuda.set_sync_debug_mode("error")
        try:
            dp(x).square().mean().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL)")
def test_a_dataparallel_step_does_not_make_the_host_wait_for_the_gpu():
    run_ranks(_no_sync_worker, world_size=1, backend="nccl")


class _Normed(nn.Module):
    """BatchNorm: its running statistics are buffers that each rank updates from its own data."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 1)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.fc(x)))).square().mean()


def _buffers_worker(rank: int, world_size: int, broadcast_buffers: bool) -> None:
    torch.manual_seed(0)
    model = _Normed()
    ref, ref_opt = stock(model, torch.optim.SGD, {"broadcast_buffers": broadcast_buffers}, lr=0.1)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model), broadcast_buffers=broadcast_buffers)
    pair = Lockstep(model, dp, torch.optim.SGD(dp.parameters(), lr=0.1), ref, ref_opt)
    gen = torch.Generator().manual_seed(rank)
    for step in range(5):
        x = torch.randn(8, 6, generator=gen, dtype=torch.float64)
        extra = torch.randn(8, 6, generator=gen, dtype=torch.float64)
        if step == 2:  # a no_sync micro-batch: the next forward does not broadcast
            with pair.no_sync():
                pair.backward(extra * (rank + 1))
        if step == 3:  # an evaluation forward: nor does the one after it
            with torch.no_grad():
                dp(extra)
                ref(extra)
        pair.backward(x)
        pair.step()
        pair.zero_grad()
        for (name, ours), theirs in zip(model.named_buffers(), ref.module.buffers()):
            torch.testing.assert_close(ours, theirs, **TOL, msg=lambda m, n=name, s=step: f"{s} {n}: {m}")
        _assert_close(model, ref.module, f"step {step}")
    stats = torch.stack([model.bn.running_mean, ref.module.bn.running_mean])
    gathered = [torch.empty_like(stats) for _ in range(world_size)]
    dist.all_gather(gathered, stats)
    assert not torch.equal(gathered[0], gathered[1])  # ranks see different data: the test can tell


@pytest.mark.parametrize("broadcast_buffers", [True, False])
def test_buffers_are_broadcast_before_forward_like_ddp(broadcast_buffers):
    run_ranks(_buffers_worker, broadcast_buffers)


def _mixed_outputs_worker(rank: int, world_size: int) -> None:
    """One backward through an output of a forward under no_sync() and one of a forward
    outside it averages everything, as under DDP, whichever output backward reaches first."""
    torch.manual_seed(0)
    model = _Net()
    ref = DDP(copy.deepcopy(model))
    dp = flatgrad.replicate(flatgrad.FlatGrad(model, config=ROUTE_ALL))
    for quiet_reached_first in (True, False):
        # the engine reaches the output of the later forward first (larger sequence number)
        for module in (dp, ref):
            module.zero_grad()
            if quiet_reached_first:
                loud = module(_tokens(rank, 1))
            with module.no_sync():
                quiet = module(_tokens(rank, 0))
            if not quiet_reached_first:
                loud = module(_tokens(rank, 1))
            (loud + 2 * quiet).backward()
        _assert_close(model, ref.module, f"quiet_reached_first={quiet_reached_first}")


def test_one_backward_through_synced_and_no_sync_outputs_averages_like_ddp():
    run_ranks(_mixed_outputs_worker)


def _averaging_worker(rank: int, world_size: int) -> None:
    """`replicate_state(dp)._engine.averaging()` (what flatgrad.pipelining's stage opens its last backward
    in): micro-batches whose forwards all ran under no_sync(), the last backward inside it
    averages everything accumulated, overlapped (buckets launched inside the backward);
    the oracle is DDP's no_sync accumulation with a synchronised last micro-batch."""
    flat, dp, ref = _dp_and_ddp(0.002)
    for step in range(2):
        dp.zero_grad()
        ref.zero_grad()
        with dp.no_sync():
            losses = [dp(_tokens(rank, step, micro)) for micro in range(3)]
        for micro, loss in enumerate(losses):
            if micro == 2:
                with replicate_state(dp)._engine.averaging():
                    loss.backward()
            else:
                loss.backward()
        with ref.no_sync():
            for micro in range(2):
                ref(_tokens(rank, step, micro)).backward()
        ref(_tokens(rank, step, 2)).backward()
        _assert_grads_match(flat, ref.module, f"step {step}")
    assert replicate_state(dp)._engine.num_syncs == 2
    assert replicate_state(dp)._engine.last_round.launched_in_backward > 0


def test_a_backward_inside_averaging_averages_after_no_sync_forwards():
    run_ranks(_averaging_worker)


class _BackwardInForward(nn.Module):
    """A model whose forward runs the step's backwards itself, as a LightningModule's
    training_step with ``manual_backward`` does inside the wrapper's forward: two
    micro-batches, the first inside `local` (the DataParallel's no_sync, set once wrapped)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _Net()
        self.local: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext

    def forward(self, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        with self.local():
            self.net(first).backward()
        self.net(second).backward()
        return torch.zeros(())


def _backward_in_forward_worker(rank: int, world_size: int) -> None:
    """Backwards inside dp's forward: the one under no_sync() stays local (one averaged
    backward per forward), the other averages everything accumulated; the oracle is the
    same backwards on a copy, averaged by hand (`average_grads`)."""
    torch.manual_seed(0)
    model = _BackwardInForward()
    ref = copy.deepcopy(model.net)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model, config=ROUTE_ALL))
    model.local = dp.no_sync
    for step in range(3):
        syncs = replicate_state(dp)._engine.num_syncs
        dp.zero_grad()
        ref.zero_grad()
        dp(_tokens(rank, step, 0), _tokens(rank, step, 1))
        for micro in range(2):
            ref(_tokens(rank, step, micro)).backward()
        average_grads([ref], None)
        _assert_grads_match(model.net, ref, f"step {step}")
        assert replicate_state(dp)._engine.num_syncs == syncs + 1, (
            f"step {step}: the no_sync backward averaged"
        )


def test_backwards_inside_the_forward_average_unless_under_no_sync():
    """Lightning's manual optimization (`manual_backward` in training_step, which the
    wrapper's forward runs; `block_backward_sync()` is no_sync): the engine decides a
    backward that opens inside a training forward by no_sync as it opens, not by the
    arming of an earlier forward."""
    run_ranks(_backward_in_forward_worker)


class _TwoDtypes(nn.Module):
    """A float64 and a float32 group (two flat buffers), each with a layer some ranks use
    on some steps only, and a layer no rank uses."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8).double()
        self.a_branch = nn.Linear(8, 8).double()
        self.b = nn.Linear(8, 8)
        self.b_branch = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_a: bool, use_b: bool) -> torch.Tensor:
        h = self.a(x)
        if use_a:
            h = self.a_branch(h)
        h = self.b(h.float())
        if use_b:
            h = self.b_branch(h)
        return h.square().mean()


def _two_dtypes_worker(rank: int, world_size: int) -> None:
    for bucket_cap_mb in (25.0, 0.0005):  # one bucket per group; several
        flat, dp, ref = _dp_and_ddp(bucket_cap_mb, _TwoDtypes)
        assert len(flat.grad_buffers) == 2
        for step in range(4):
            # step 0: all ranks use both branches; 1: rank 0 only uses a_branch; 2: only
            # rank 1 uses b_branch; 3: no rank uses either
            use_a = step == 0 or (step == 1 and rank == 0)
            use_b = step == 0 or (step == 2 and rank == 1)
            dp.zero_grad()
            ref.zero_grad()
            gen = torch.Generator().manual_seed(rank + 10 * step)
            x = torch.randn(4, 8, dtype=torch.float64, generator=gen)
            dp(x, use_a, use_b).backward()
            ref(x, use_a, use_b).backward()
            _assert_grads_match(flat, ref.module, f"{bucket_cap_mb} step {step}")
            assert all(grad_in_buffers(flat, p.grad) for p in flat.parameters() if p.grad is not None)


def test_two_dtypes_with_parameters_unused_on_some_ranks_match_ddp():
    """The used flags travel with each group's last bucket: `.grad` None-ness and values
    equal DDP(find_unused_parameters=True) for parameters used on every rank, on some, and
    on none, in both groups, with one bucket per group and with several."""
    run_ranks(_two_dtypes_worker)


class _NoneForWeight(torch.autograd.Function):
    """``x * w.mean()`` whose backward hands `w` no gradient (AccumulateGrad still runs)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x * w.mean()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


class _Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 6)  # registered first: the last bucket
        self.b = nn.Linear(6, 6)
        self.w = nn.Parameter(torch.randn(400, 400))  # large, unrouted: copied in, not seated
        self.double()

    def forward(self, x: torch.Tensor, none_for_w: bool) -> torch.Tensor:
        h = self.b(self.first(x))
        h = _NoneForWeight.apply(h, self.w) if none_for_w else h * self.w.mean()
        return h.square().mean()


def _replaced_and_none_worker(rank: int, world_size: int) -> None:
    for bucket_cap_mb in (25.0, 1e-6):
        flat, dp, ref = _dp_and_ddp(bucket_cap_mb, _Holder, None)
        model = flat
        x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
        for step in range(3):
            if step == 1:  # parameter objects swapped in without registering them, on both
                previous = torch.__future__.get_overwrite_module_params_on_conversion()
                torch.__future__.set_overwrite_module_params_on_conversion(True)
                try:
                    model.b.float().double()
                    ref.module.b.float().double()
                finally:
                    torch.__future__.set_overwrite_module_params_on_conversion(previous)
                with pytest.raises(RuntimeError, match=r"b.weight \(replaced\)"):
                    flat.grad_norm()  # the layout is fixed: refused, the same on every rank
                flat.relayout()
            none_for_w = step == 2 and rank == 1  # AccumulateGrad runs with no gradient
            dp.zero_grad()
            ref.zero_grad()
            dp(x, none_for_w).backward()
            ref(x, none_for_w).backward()
            if step >= 1:  # DDP's reducer still holds the old `b`: average the new one by hand
                for param in ref.module.b.parameters():
                    dist.all_reduce(param.grad)
                    param.grad /= world_size
            _assert_grads_match(model, ref.module, f"{bucket_cap_mb} step {step}")


def test_parameters_swapped_in_unregistered_and_a_weight_given_no_gradient_match_ddp():
    """A parameter object put in place without `register_parameter` (a conversion under
    ``set_overwrite_module_params_on_conversion(True)``, as accelerate's
    `set_module_tensor_to_device` does) is refused, then averaged from the next forward on
    after ``relayout()``. (Stock DDP's reducer keeps following the old
    object, so the new one's gradient would stay local on every rank; the oracle averages
    it by hand.) A large unrouted weight whose
    AccumulateGrad runs with no gradient on one rank contributes zeros there, not the
    slot's previous values (as DDP)."""
    run_ranks(_replaced_and_none_worker)


class _EarlyGroup(nn.Module):
    """A float32 group whose gradients are all final before the float64 group's (its last
    bucket launches inside the backward), holding a small seated parameter `s` whose
    AccumulateGrad may run with no gradient, and whose gradient has -0.0 elements where it
    has one (``s * signs``: ±0.0 entries, so some are -0.0 whichever sign the rest has)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8).double()
        self.b = nn.Linear(8, 8)
        self.s = nn.Parameter(torch.randn(8))
        self.register_buffer("signs", torch.tensor([1.0, -0.0, 0.0, -0.0, -1.0, 0.0, -0.0, 0.25]))

    def forward(self, x: torch.Tensor, none_for_s: bool) -> torch.Tensor:
        h = self.b(self.a(x).float())
        h = _NoneForWeight.apply(h, self.s) if none_for_s else h * (self.s * self.signs).sum()
        return h.square().mean()


def _early_group_worker(rank: int, world_size: int) -> None:
    for bucket_cap_mb in (25.0, 1e-6):
        flat, dp, ref = _dp_and_ddp(bucket_cap_mb, _EarlyGroup, None)
        model = flat
        for step in range(3):
            # step 0: no rank gives `s` a gradient; 1: rank 0 only; 2: every rank
            none_for_s = step == 0 or (step == 1 and rank == 1)
            gen = torch.Generator().manual_seed(rank + 10 * step)
            x = torch.randn(4, 8, dtype=torch.float64, generator=gen)
            dp.zero_grad()
            ref.zero_grad()
            dp(x, none_for_s).backward()
            ref(x, none_for_s).backward()
            launched_inside = replicate_state(dp).launch_offsets_s[0] < replicate_state(dp).backward_s
            _assert_grads_match(model, ref.module, f"{bucket_cap_mb} step {step}")
            if ref.module.s.grad is not None:  # -0.0 where DDP has it (+0.0 from a rank that sent zeros)
                signs = torch.signbit(model.s.grad), torch.signbit(ref.module.s.grad)
                assert torch.equal(*signs), (
                    f"{bucket_cap_mb} step {step}: {model.s.grad} vs {ref.module.s.grad}"
                )
            assert all(grad_in_buffers(flat, p.grad) for p in model.parameters() if p.grad is not None)
            assert launched_inside, "the float32 group's bucket should launch inside the backward"


def test_a_seated_parameter_given_no_gradient_by_any_rank_keeps_none_in_an_early_bucket():
    """A small (seated) parameter whose AccumulateGrad runs with no gradient, in a group
    whose last bucket (with the used flags) launches inside the backward: None where no rank
    gave it a gradient, the average where one did, as DDP(find_unused_parameters=True), the
    sign of its zeros included (the rank without a gradient sends +0.0, as DDP's zeroed
    bucket)."""
    run_ranks(_early_group_worker)


def _functional_call_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    ref = DDP(copy.deepcopy(model))
    flat = flatgrad.FlatGrad(model)
    dp = flatgrad.replicate(flat)
    x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    store = engine_of(flat).store
    for wrapper, inner in ((dp, model), (ref, ref.module)):
        prefix = "module." if wrapper is ref else ""  # (DDP's names; the model's own are plain)
        temp = {prefix + n: nn.Parameter(p.detach().clone()) for n, p in inner.named_parameters()}
        torch.func.functional_call(wrapper, temp, (x,)).sum().backward()
        grad = temp[prefix + "0.weight"].grad
        gathered = [torch.empty_like(grad) for _ in range(world_size)]
        dist.all_gather(gathered, grad)
        assert not torch.equal(gathered[0], gathered[1]), "temporary parameters are not averaged (DDP)"
        assert all(p.grad is None for p in inner.parameters())
    assert engine_of(flat).store is store  # not laid out onto the temporary parameters
    for module in (dp, ref):
        module(x).sum().backward()
    assert_grads_like(model, ref.module, **TOL)
    assert engine_of(flat).store is store


def test_functional_call_through_dataparallel_leaves_the_temporary_parameters_local_as_ddp():
    """`torch.func.functional_call(dp, {...: nn.Parameter})`: the temporary parameters get
    their local gradients, not averaged (DDP's reducer is bound to the model's own), nothing
    is laid out again, and the next plain step averages the model's parameters as DDP."""
    run_ranks(_functional_call_worker)


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        raise RuntimeError("boom")


def _raised_backward_worker(rank: int, world_size: int) -> None:
    for bucket_cap_mb in (25.0, 1e-6):
        torch.manual_seed(0)
        model = _EarlyGroup()
        ref = copy.deepcopy(model)
        dp = flatgrad.replicate(flatgrad.FlatGrad(model), bucket_cap_mb=bucket_cap_mb)
        x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
        # raises after the float32 group's bucket launched, before the float64 group's
        with pytest.raises(RuntimeError, match="boom"):
            model_out = dp(_Boom.apply(x), False)
            model_out.backward()
        assert replicate_state(dp)._engine.last_round.work[0] is not None, "a bucket should be in flight"
        for step in range(3):
            dp.zero_grad()
            ref.zero_grad()
            gen = torch.Generator().manual_seed(rank + 10 * step)
            batch = torch.randn(4, 8, dtype=torch.float64, generator=gen)
            dp(batch, False).backward()
            ref(batch, False).backward()
            for p in ref.parameters():  # the oracle: stock autograd, then an average
                dist.all_reduce(p.grad)
                p.grad /= world_size
            _assert_grads_match(model, ref, f"{bucket_cap_mb} step {step}")


def test_collectives_launched_by_a_backward_that_raised_do_not_land_on_the_next_step():
    """A backward that raises after a bucket was launched (an OOM skipped by the training
    loop): the next forward waits for what is in flight, so the next steps' gradients are
    the averages of their own (it landed on them before)."""
    run_ranks(_raised_backward_worker)


class _SkipsForward(nn.Module):
    """A Linear whose weight its owner uses without calling it (as nn.MultiheadAttention
    does with its out_proj), and an attention layer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(nn.functional.linear(x, self.lin.weight, self.lin.bias))
        return self.attn(h, h, h, need_weights=False)[0].square().mean()


def _skipped_forward_worker(rank: int, world_size: int) -> None:
    for bucket_cap_mb in (25.0, 1e-6):
        flat, dp, ref = _dp_and_ddp(bucket_cap_mb, _SkipsForward)
        hooked = flatgrad.FlatGrad(copy.deepcopy(ref.module), config=ROUTE_ALL)
        ddp = DDP(hooked, **hooked.ddp_kwargs())
        ddp.register_comm_hook(hooked.comm_state(), flatgrad.allreduce_hook)
        for step in range(3):
            if step != 1:  # step 1 accumulates onto step 0
                for model in (dp, ref, ddp):
                    model.zero_grad()
            gen = torch.Generator().manual_seed(rank + 10 * step)
            x = torch.randn(3, 5, 16, dtype=torch.float64, generator=gen)
            for model in (dp, ref, ddp):
                model(x).backward()
            for ours in (flat, hooked):
                _assert_grads_match(ours, ref.module, f"{bucket_cap_mb} step {step}")
                storages = {p.grad.untyped_storage().data_ptr() for p in ours.parameters()}
                assert storages == {
                    b.untyped_storage().data_ptr() for b in engine_of(ours).store.buffers.values()
                }


def test_a_layer_whose_owner_skips_its_forward_is_averaged_in_the_buffer_as_ddp():
    """From the first step on, under DataParallel (one bucket and several) and under DDP
    with `allreduce_hook`, against stock DDP; as backward left `.grad` (no settling)."""
    run_ranks(_skipped_forward_worker)


class _Result:
    """A plain object holding the loss: an opaque pytree leaf, not a dataclass."""

    def __init__(self, loss: torch.Tensor) -> None:
        self.loss = loss


class _LossDict(dict):
    """A dict subclass, which torch.utils._pytree does not flatten (an opaque leaf)."""


class _Aux(nn.Module):
    """Keeps an auxiliary loss on itself during forward (``self.aux``) and returns the main
    loss as it is, in a plain object or in a dict subclass: none of the outputs but the first
    shows dp a tensor. Routed layers (Linear, Embedding), a small unrouted parameter (seated
    on the output path) and a large one (copied in by a pre-hook). The auxiliary loss reaches
    every parameter, so stock DDP with default flags averages it whichever loss is backwarded."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 16)
        self.fc = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 40)
        self.big = nn.Parameter(torch.randn(400, 400) / 400)  # above SEAT_MAX_NUMEL: placed
        self.double()

    def forward(self, tokens: torch.Tensor, wrap: str = "tensor") -> Any:
        h = self.norm(torch.tanh(self.fc(self.emb(tokens)))) * (1 + self.big.mean())
        logits = self.head(h)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        self.aux = logits.square().mean()
        if wrap == "object":
            return _Result(loss)
        if wrap == "dict":
            return _LossDict(loss=loss)
        return loss


def _dp_and_default_ddp(bucket_cap_mb: float) -> tuple[flatgrad.FlatGrad, flatgrad.ReplicateModule, DDP]:
    """`_Aux` under FlatGrad + DataParallel and a copy under stock DDP with default flags
    (every parameter is used in every step: DDP's hooks on the parameters average any
    backward after its forward)."""
    torch.manual_seed(0)
    model = _Aux()
    ref = DDP(copy.deepcopy(model))
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    dp = flatgrad.replicate(flat, bucket_cap_mb=bucket_cap_mb)
    assert len(replicate_state(dp).buckets) >= (1 if bucket_cap_mb > 1 else 3)
    return flat, dp, ref


def _main_loss(output: Any) -> torch.Tensor:
    if isinstance(output, _Result):
        return output.loss
    return output["loss"] if isinstance(output, dict) else output


def _step(module: nn.Module, tokens: torch.Tensor, wrap: str, which: str) -> None:
    """One forward of `module` (dp or the DDP oracle) and the backward of `which` loss."""
    output = module(tokens, wrap)
    inner = module.module if isinstance(module, DDP) else module
    if which == "aux":
        inner.aux.backward()
    elif which == "sum":
        (_main_loss(output) + 0.5 * inner.aux).backward()
    else:
        _main_loss(output).backward()


def _bypass_worker(
    rank: int, world_size: int, bucket_cap_mb: float, cases: list[tuple[str, str, str]]
) -> None:
    """Each case is (wrap, rank 0's loss, rank 1's loss); a plain SGD step after each, so the
    later cases start from parameters that only agree if every earlier one averaged."""
    flat, dp, ref = _dp_and_default_ddp(bucket_cap_mb)
    model = flat
    for step, (wrap, *losses) in enumerate(cases):
        for module in (dp, ref):
            module.zero_grad()
            _step(module, _tokens(rank, step), wrap, losses[rank])
        what = f"{bucket_cap_mb} step {step} {wrap} {losses[rank]}"
        _assert_grads_match(model, ref.module, what)
        assert all(grad_in_buffers(flat, p.grad) for p in model.parameters()), what
        with torch.no_grad():
            for p, q in zip(model.parameters(), ref.module.parameters()):
                p.sub_(0.1 * p.grad)
                q.sub_(0.1 * q.grad)
    _assert_close(model, ref.module, "final")


_BYPASS_CASES = {
    "aux": [("tensor", "aux", "aux"), ("tensor", "sum", "sum"), ("tensor", "aux", "aux")],
    "wrapped": [("object", "main", "main"), ("dict", "main", "main"), ("object", "sum", "sum")],
    "split": [
        ("tensor", "main", "aux"),
        ("tensor", "aux", "main"),
        ("object", "main", "sum"),
        ("dict", "aux", "main"),
    ],
}


@pytest.mark.parametrize("bucket_cap_mb", [25.0, 0.0005], ids=["one_bucket", "buckets"])
@pytest.mark.parametrize("case", list(_BYPASS_CASES))
def test_a_loss_that_bypasses_the_output_is_averaged_like_ddp(case, bucket_cap_mb):
    """A loss that reaches the parameters around dp's output is averaged, as under stock
    DDP (whose hooks sit on the parameters, armed by the forward): an auxiliary loss kept on
    the module, backwarded alone or added to the output's loss ("aux"); the output returned
    in a plain object or a dict subclass, which dp cannot look into ("wrapped"); one rank's
    loss through the output and the other's around it ("split": both average, no hang)."""
    run_ranks(_bypass_worker, bucket_cap_mb, _BYPASS_CASES[case], timeout=100)


def _armed_worker(rank: int, world_size: int) -> None:
    """Which backwards that go through no synchronising output average, step by step against
    DDP with default flags: the first after a synchronising training forward does (DDP's
    hooks on the parameters are armed by its forward), whatever graph it goes through, and
    disarms; one with no such forward since does not."""
    flat, dp, ref = _dp_and_default_ddp(25.0)
    model = flat
    params = list(model.parameters())

    def both(step: Callable[[nn.Module, nn.Module], None], what: str, zero: bool = True) -> None:
        for wrapper, inner in ((dp, model), (ref, ref.module)):
            if zero:
                wrapper.zero_grad()
            step(wrapper, inner)
        _assert_grads_match(model, ref.module, what)

    tokens = [_tokens(rank, step) for step in range(6)]
    # no forward through the wrapper yet: local
    # (``m.forward``: the model's forward without the call that arms, as DDP's ``ref.module``)
    both(lambda w, m: m.forward(tokens[0]).backward(), "before any dp forward")
    # a synchronising forward whose output is dropped: the next backward averages...
    both(lambda w, m: (w(tokens[1]), m.forward(tokens[2]).backward()), "after a dropped output")
    # ...and only that one
    both(lambda w, m: m.forward(tokens[3]).backward(), "the next one", zero=False)

    def quiet(w: nn.Module, m: nn.Module) -> None:
        with w.no_sync():
            w(tokens[4])
        m.aux.backward()

    both(quiet, "after a no_sync forward")

    def grad_first(w: nn.Module, m: nn.Module) -> None:
        w(tokens[5])  # torch.autograd.grad accumulates nothing: the next backward averages
        torch.autograd.grad(m.aux, list(m.parameters()), retain_graph=True)
        m.aux.backward()

    both(grad_first, "after torch.autograd.grad")
    dp(tokens[0])
    with pytest.raises(RuntimeError, match="cannot average the gradients of a backward with create_graph"):
        model.aux.backward(create_graph=True)
    for p in params:
        p.grad = None
    both(lambda w, m: w(tokens[1]).backward(), "a step after the refused one")


def test_a_backward_through_no_output_averages_after_a_synchronising_forward_as_ddp():
    run_ranks(_armed_worker)


class _CheckpointedAux(nn.Module):
    """An auxiliary loss computed under a reentrant activation checkpoint from the model's
    last layer: backwarded alone, its first gradients come from the checkpoint's nested
    backward, and the other layers' after that backward ended."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.b(self.a(x)))
        self.aux = torch.utils.checkpoint.checkpoint(self._last, h, use_reentrant=True)
        return h.square().mean()

    def _last(self, h: torch.Tensor) -> torch.Tensor:
        return self.c(h).square().mean()


def _checkpointed_aux_worker(rank: int, world_size: int) -> None:
    for bucket_cap_mb in (25.0, 1e-6):
        torch.manual_seed(0)
        model = _CheckpointedAux()
        ref = DDP(copy.deepcopy(model))  # DDP supports reentrant checkpoints without unused parameters
        dp = flatgrad.replicate(flatgrad.FlatGrad(model, config=ROUTE_ALL), bucket_cap_mb=bucket_cap_mb)
        for step in range(2):
            gen = torch.Generator().manual_seed(rank + 10 * step)
            x = torch.randn(4, 8, dtype=torch.float64, generator=gen)
            for wrapper in (dp, ref):
                wrapper.zero_grad()
                wrapper(x)
                (wrapper.module if isinstance(wrapper, DDP) else wrapper).aux.backward()
            _assert_grads_match(model, ref.module, f"{bucket_cap_mb} step {step}")


def test_a_bypassing_backward_opened_inside_a_reentrant_checkpoint_averages_at_its_end():
    """The first gradient of a backward that reached no output of dp's comes from a nested
    backward (a reentrant checkpoint): the step ends with the outer backward, not the nested
    one (which would launch every bucket before the other layers' gradients exist)."""
    run_ranks(_checkpointed_aux_worker)


def _sharded_bypass_worker(rank: int, world_size: int) -> None:
    for bucket_cap_mb in (25.0, 0.0005):
        flat, dp, ref = _dp_and_default_ddp(bucket_cap_mb)
        opt = flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, lr=0.01)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
        for step, (wrap, *losses) in enumerate(_BYPASS_CASES["split"]):
            for module, optimizer in ((dp, opt), (ref, ref_opt)):
                _step(module, _tokens(rank, step), wrap, losses[rank])
                optimizer.step()
                optimizer.zero_grad()
            assert_params_like(flat, ref.module, **TOL, what=f"{bucket_cap_mb} step {step}")


def test_a_loss_that_bypasses_the_output_is_reduce_scattered_for_a_sharded_optimizer():
    """The same as the "split" case with ShardedOptimizer (reduce-scatter, a shard step and
    an all-gather): the parameters equal those of stock DDP with AdamW after every step."""
    run_ranks(_sharded_bypass_worker)


def _require_backward_grad_sync_worker(rank: int, world_size: int) -> None:
    flat, dp, ref = _dp_and_ddp(0.002)
    calls = []
    all_reduce = dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counted  # type: ignore[assignment]
    try:
        for step in range(2):
            for micro in range(3):  # nanoGPT's train.py: the flag instead of no_sync()
                for model in (dp, ref):
                    model.require_backward_grad_sync = micro == 2
                    (model(_tokens(rank, step, micro)) / 3).backward()
                if micro < 2:
                    assert not calls, "a micro-batch with the flag off communicated"
            assert calls and dp.require_backward_grad_sync
            _assert_grads_match(flat, ref.module, f"step {step}")
            calls.clear()
            for model in (dp, ref):
                model.zero_grad()
    finally:
        dist.all_reduce = all_reduce  # type: ignore[assignment]


def test_require_backward_grad_sync_set_by_hand_accumulates_locally_as_ddp():
    run_ranks(_require_backward_grad_sync_worker)


class _Poisoned(nn.Module):
    """A loss whose gradient for `bias` is `poison` (NaN on one rank), the rest finite."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bias = nn.Parameter(torch.zeros(8))
        self.double()

    def forward(self, x: torch.Tensor, poison: float) -> torch.Tensor:
        return self.fc(x).square().mean() + (self.bias * poison).sum()


def _check_finite_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    flat = flatgrad.FlatGrad(_Poisoned(), config=ROUTE_ALL)
    with pytest.raises(TypeError, match="check_finite must be a bool, got str"):
        flatgrad.replicate(flat, check_finite="yes")  # type: ignore[arg-type]
    dp = flatgrad.replicate(flat, check_finite=True)
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    dp(x, 0.0).backward()  # all finite: averaged as usual
    assert all(bool(torch.isfinite(p.grad).all()) for p in flat.parameters())
    flat.zero_grad()
    expected = r"on rank 1 \(this rank\) in \['bias'\]" if rank == 1 else r"on rank\(s\) \[1\]"
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"check_finite=True\): a non-finite gradient .* " + expected):
        dp(x, float("nan") if rank == 1 else 0.0).backward()
    assert time.monotonic() - started < 60
    flat.zero_grad()
    dp(x, 0.0).backward()  # nothing left in flight: the next step averages
    assert all(bool(torch.isfinite(p.grad).all()) for p in flat.parameters())


def test_check_finite_makes_every_rank_raise_naming_the_rank_and_parameter():
    """`DataParallel(flat, check_finite=True)`: a NaN gradient made on rank 1 only makes
    both ranks raise from the same backward (no hang), rank 1 naming itself and the
    parameter whose gradient really is non-finite, rank 0 naming rank 1."""
    run_ranks(_check_finite_worker, timeout=90)


def test_one_rank_divides_nothing_and_equals_the_plain_model_to_the_bit():
    """World size 1 (a single-GPU or CPU run of a data-parallel script): the average is the
    local gradient, so no path spends a pass dividing it by 1, and the result equals the
    plain model's bit for bit (`.grad`, and the parameters after a ShardedOptimizer step)."""
    from flatgrad.bench.suite import single_rank_group

    torch.manual_seed(0)
    plain = _Net()
    tokens = torch.randint(0, 40, (4, 6))
    plain(tokens).backward()
    grads = {name: p.grad for name, p in plain.named_parameters() if p.grad is not None}
    torch.optim.SGD(plain.parameters(), lr=0.1).step()
    with single_rank_group("gloo", torch.device("cpu")):
        for path in ("DataParallel", "ShardedOptimizer", "all_reduce_grads"):
            torch.manual_seed(0)
            flat = flatgrad.FlatGrad(_Net())
            dp = flatgrad.replicate(flat) if path != "all_reduce_grads" else None
            opt = None
            if path == "ShardedOptimizer":
                opt = flatgrad.ShardedOptimizer(dp, torch.optim.SGD, lr=0.1)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                (dp if dp is not None else flat)(tokens).backward()
                if dp is None:
                    flat.all_reduce_grads()
                if opt is not None:
                    opt.step()
            divisions = [e.name for e in prof.events() if e.name in ("aten::div_", "aten::_foreach_div_")]
            assert divisions == [], (path, divisions)
            for name, param in flat.named_parameters():
                if opt is not None:
                    assert torch.equal(param, dict(plain.named_parameters())[name]), name
                elif name in grads:
                    assert torch.equal(param.grad, grads[name]), (path, name)


class _NoGrad(torch.autograd.Function):
    """A stop-gradient op: its backward hands its input no gradient (None)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> None:
        return None


class _Stopped(nn.Module):
    """`b` reaches the loss through `_NoGrad` only: its AccumulateGrad runs with no gradient
    on every rank. `head`, registered first, ends the buffer and runs last, so from the
    second step the learned order launches the buffer's last bucket first and the used
    flags take their own all-reduce."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(6, 1)
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(4, 6)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.a(x)) + 0 * _NoGrad.apply(self.b(x))).square().mean()


def _no_grad_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = _Stopped()
    ref, ref_opt = stock(
        model, torch.optim.AdamW, {"find_unused_parameters": True}, lr=0.05, weight_decay=0.1
    )
    dp = flatgrad.replicate(flatgrad.FlatGrad(model), bucket_cap_mb=0.0001)  # several buckets
    pair = Lockstep(model, dp, torch.optim.AdamW(dp.parameters(), lr=0.05, weight_decay=0.1), ref, ref_opt)
    for step in range(3):
        pair.zero_grad()
        pair.backward(
            torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(step * 2 + rank))
        )
        assert ref.module.b.weight.grad is None and model.b.weight.grad is None, step
        pair.step()
    pair.assert_params(**TOL)


def test_a_parameter_that_gets_no_gradient_anywhere_keeps_grad_none_like_ddp():
    run_ranks(_no_grad_worker)


def _join_batches(rank: int) -> range:
    return range(2 + rank)  # uneven: rank r runs out after 2 + r steps


def _train_joined(model: nn.Module, opt: torch.optim.Optimizer, rank: int, divide_initial: bool) -> None:
    """Steps of two micro-batches (the first under no_sync) inside Join([model, opt]) (a plain
    torch optimizer is no Joinable: Join([model]))."""
    from torch.distributed.algorithms import Join, Joinable

    joinables = [model, opt] if isinstance(opt, Joinable) else [model]
    with Join(joinables, divide_by_initial_world_size=divide_initial):
        for step in _join_batches(rank):
            opt.zero_grad()
            with model.no_sync():
                model(_tokens(rank, step, 1)).backward()
            model(_tokens(rank, step)).backward()
            opt.step()


def _join_worker(rank: int, world_size: int, divide_initial: bool, check_finite: bool) -> None:
    torch.manual_seed(0)
    model = _Net()
    ref = DDP(copy.deepcopy(model), find_unused_parameters=True)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    dp = flatgrad.replicate(flat, bucket_cap_mb=0.001, check_finite=check_finite)
    assert len(replicate_state(dp).buckets) >= 2
    _train_joined(dp, torch.optim.SGD(dp.parameters(), lr=0.1, momentum=0.9), rank, divide_initial)
    _train_joined(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), rank, divide_initial)
    assert_params_like(model, ref.module, **TOL)
    # After the Join the ranks train together again, as DDP's. (A joined rank's `.grad` is
    # the others' last average here, DDP's its own last gradient: zeroed first.)
    flat.zero_grad()
    ref.zero_grad()
    dp(_tokens(rank, 7)).backward()
    ref(_tokens(rank, 7)).backward()
    _assert_grads_match(flat, ref.module, "after the Join")


@pytest.mark.parametrize(
    ("world_size", "divide_initial", "check_finite"),
    [(2, True, False), (3, True, True), (3, False, False), (2, False, True)],
)
def test_join_with_uneven_batches_equals_stock_ddp(world_size, divide_initial, check_finite):
    """Oracle: stock DDP + SGD under the same Join (a joined rank's DDP shadows the others'
    all-reduces with zeros; the last to join broadcasts the model at the end), dividing by
    the world size (DDP's default) or by the ranks not joined yet."""
    run_ranks(_join_worker, divide_initial, check_finite, world_size=world_size, timeout=120)


def _settings_worker(rank: int, world_size: int) -> None:
    """A setting that shapes the collectives, different on one rank: every rank raises,
    naming the setting and each rank's value (before, gloo killed one rank silently)."""
    last = rank == world_size - 1
    cases = [
        ({}, {"bucket_cap_mb": 1.5 if last else 25.0}, r"bucket_cap_mb: rank 0 25, rank 1 1.5"),
        (
            {},
            {"reduce_dtype": torch.bfloat16 if last else None},
            r"reduce_dtype: rank 0 None, rank 1 torch.bfloat16",
        ),
        ({}, {"check_finite": last}, r"check_finite: rank 0 False, rank 1 True"),
        (
            {"align_bytes": 64 if last else 256},
            {},
            r"align_bytes: rank 0 256, rank 1 64; buffer elements",
        ),
    ]
    for config, kwargs, message in cases:
        torch.manual_seed(0)
        flat = flatgrad.FlatGrad(nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3)), config=config)
        with pytest.raises(ValueError, match=message):
            flatgrad.replicate(flat, **kwargs)


def test_settings_that_differ_across_ranks_raise_on_every_rank():
    run_ranks(_settings_worker)


@pytest.mark.parametrize("optimizer", ["torch", "ShardedOptimizer"])
def test_a_replicated_model_is_freed_without_the_cycle_collector(optimizer):
    """The replicate state lives in the model and holds it weakly back: dropping the model
    and its optimizer after a few steps frees the model (its buffers, its hooks) at once,
    with the cyclic collector off, as a plain model."""
    import gc
    import weakref

    from flatgrad.bench.suite import single_rank_group

    with single_rank_group("gloo", torch.device("cpu")):
        model = flatgrad.replicate(_Net())
        if optimizer == "torch":
            opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        else:
            opt = flatgrad.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            model(torch.randint(0, 40, (4, 6))).backward()
            opt.step()
        gone = weakref.ref(model)
        gc.collect()
        gc.disable()
        try:
            del model, opt
            assert gone() is None
        finally:
            gc.enable()


def _ddp_over_replicate_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    ddp = DDP(flatgrad.replicate(flatgrad.FlatGrad(model)))
    x = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    with pytest.raises(ValueError, match="a DistributedDataParallel runs this replicated model"):
        ddp(x)
    with torch.no_grad():  # (an evaluation averages nothing)
        torch.testing.assert_close(ddp(x), model.forward(x), rtol=0, atol=0)


def test_a_replicated_model_run_by_ddp_is_refused():
    """Trainer and Accelerate's prepare wrap the model they are given in DDP; a replicated one then had every
    gradient averaged twice (one collective more per bucket, results equal up to round-off, 3e-15 after six
    Trainer steps). Refused at its first training forward, naming FlatGrad's DDP hook."""
    run_ranks(_ddp_over_replicate_worker)


def _eval_after_relayout_worker(rank: int, world_size: int) -> None:
    """A forward under inference_mode after a change that lays the buffers out again (a layer frozen, a
    `.to()`), as Lightning's validation runs on GPUs: it crashed re-hooking the parameters (no grad_fn inside
    inference mode). And a freeze after `no_sync()` backwards averaged by `all_reduce_grads` (a pipeline
    stage's split backward) is followed at the next forward: `all_reduce_grads` ends the wait for an average
    (before, the frozen layer kept its slot until a synchronised backward, which such a loop never runs)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    plain = copy.deepcopy(model)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model, config=ROUTE_ALL))
    x = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    dp(x).sum().backward()
    model.zero_grad()
    for change in (lambda: model[0].requires_grad_(False), lambda: model.to(torch.float64)):
        change()
        plain[0].requires_grad_(model[0].weight.requires_grad)
        with torch.inference_mode():
            torch.testing.assert_close(dp(x), plain(x), rtol=0, atol=0)
    model[0].requires_grad_(True)
    for _ in range(2):
        with dp.no_sync():
            dp(x).sum().backward()
        dp.all_reduce_grads()
        model.zero_grad()
    model[0].requires_grad_(False)
    dp(x).sum().backward()
    assert model[0].weight not in engine_of(model).store  # (laid out without it)


def test_an_eval_forward_after_a_relayout_and_a_freeze_after_all_reduce_grads():
    run_ranks(_eval_after_relayout_worker, world_size=2)
