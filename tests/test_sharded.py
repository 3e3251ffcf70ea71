"""`flatgrad.ShardedOptimizer` (ZeRO-1) against stock DDP + the same optimizer + clipping.

2 and 3 gloo ranks, different data per rank, float64. The oracle is DDP
(find_unused_parameters=True) on a deep copy with torch.optim.AdamW (weight decay) and
`torch.nn.utils.clip_grad_norm_`; both sides average the same per-rank gradients and apply
the same element-wise update, shard by shard on ours, so parameters agree to round-off
(1e-10 after several steps; the clip norm is a sum in another order).
"""

from __future__ import annotations

import copy
import io
import math
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from conftest import ROUTE_ALL, grad_in_buffers
from dist_utils import rank_profile, run_ranks
from oracle import Lockstep, assert_params_like, stock
from test_parallel import _Net, _tokens
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import flatgrad
from flatgrad import replicate_state
from flatgrad._flatgrad import engine_of

pytestmark = pytest.mark.distributed

TOL = {"rtol": 1e-10, "atol": 1e-10}


def _build(
    rank: int,
) -> tuple[nn.Module, flatgrad.FlatGrad, flatgrad.ReplicateModule, flatgrad.ShardedOptimizer]:
    torch.manual_seed(0)
    model = _Net()
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    dp = flatgrad.replicate(flat, bucket_cap_mb=0.002)  # several buckets
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, lr=0.05, weight_decay=0.1)
    return model, flat, dp, opt


def _train(dp, opt, rank: int, steps: range) -> list[torch.Tensor]:  # noqa: ANN001
    norms = []
    for step in steps:
        opt.zero_grad()
        # the branch is unused on rank 1 every third step (used globally: see the module notes)
        use_branch = not (rank == 1 and step % 3 == 1)
        with dp.no_sync():  # a first micro-batch accumulates locally
            dp(_tokens(rank, step, 1), use_branch).backward()
        dp(_tokens(rank, step), use_branch).backward()
        norms.append(opt.clip_grad_norm_(0.5))
        opt.step()
    return norms


def _stock(model: nn.Module) -> tuple[DDP, torch.optim.Optimizer]:
    """The module's oracle on a deep copy of `model`: DDP(find_unused_parameters=True) + AdamW."""
    return stock(model, torch.optim.AdamW, {"find_unused_parameters": True}, lr=0.05, weight_decay=0.1)


def _with_stock(model: nn.Module, dp: flatgrad.ReplicateModule, opt: flatgrad.ShardedOptimizer) -> Lockstep:
    """Ours (from `_build`) in lockstep with `_stock(model)`."""
    return Lockstep(model, dp, opt, *_stock(model))


def _equal_to_ddp_worker(rank: int, world_size: int) -> None:
    model, flat, dp, opt = _build(rank)
    ref, ref_opt = _stock(model)
    ours = _train(dp, opt, rank, range(4))
    for step in range(4):
        ref_opt.zero_grad()
        use_branch = not (rank == 1 and step % 3 == 1)
        with ref.no_sync():
            ref(_tokens(rank, step, 1), use_branch).backward()
        ref(_tokens(rank, step), use_branch).backward()
        total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        torch.testing.assert_close(ours[step], total, **TOL)
        ref_opt.step()
    Lockstep(model, dp, opt, ref, ref_opt).assert_params(**TOL)
    # memory: this rank holds about 1/world_size of AdamW's state
    full = sum(2 * p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert opt.state_bytes() <= (0.6 if world_size == 2 else 0.45) * full, (opt.state_bytes(), full)
    # parameters are views of one flat parameter buffer per (dtype, device)
    storages = {p.untyped_storage().data_ptr() for p in model.parameters() if p.requires_grad}
    assert len(storages) == 1
    assert dp.state_dict().keys() == ref.module.state_dict().keys()


@pytest.mark.parametrize("world_size", [2, 3])
def test_parameters_equal_stock_ddp_adamw_with_clipping(world_size):
    run_ranks(_equal_to_ddp_worker, world_size=world_size)


def _profile_worker(rank: int, world_size: int, overlap: bool) -> None:
    torch.manual_seed(0)
    dp = flatgrad.replicate(flatgrad.FlatGrad(_Net(), config=ROUTE_ALL), bucket_cap_mb=0.002)
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, lr=0.05, overlap_param_gather=overlap)
    _train(dp, opt, rank, range(2))
    opt.zero_grad()
    with rank_profile() as prof:
        dp(_tokens(rank, 5)).backward()
        opt.step()
        opt.wait_param_gather()
    names = [e.name for e in prof.events()]
    num_buckets = len(replicate_state(dp).buckets)
    assert num_buckets > 2
    # gloo averages the buckets by all-reduce and gathers by broadcasts of each rank's shard
    # (both faster there: see flatgrad._comm.launch_average, flatgrad._zero); NCCL by
    # reduce-scatter and all-gather
    assert names.count("c10d::_reduce_scatter_base_") == 0, sorted(set(names))
    # the used-parameter flags go with the optimizer's step count (checked on every rank:
    # see flatgrad._bucket_sync.Round._check_round) in one small all-reduce of bytes
    assert not replicate_state(dp)._engine.last_round.carries_flags
    assert names.count("c10d::allreduce_") == num_buckets + 1
    # every rank holds all averaged gradients after gloo's all-reduce: one shard of the
    # whole buffer per rank, one broadcast each; a bucket's shard per rank where the next
    # forward waits for each bucket (overlap_param_gather)
    assert len(opt._engine.shards) == (num_buckets if overlap else 1)
    assert names.count("c10d::broadcast_") == (num_buckets if overlap else 1) * world_size
    assert names.count("c10d::_allgather_base_") == 0


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap_param_gather"])
def test_one_average_per_bucket_and_one_gather_per_shard(overlap):
    run_ranks(_profile_worker, overlap)


def _division_worker(rank: int, world_size: int) -> None:
    model, flat, dp, opt = _build(rank)
    torch.manual_seed(0)
    ref = flatgrad.replicate(flatgrad.FlatGrad(_Net(), config=ROUTE_ALL), bucket_cap_mb=0.002)
    for step in range(2):
        opt.zero_grad()
        with rank_profile(record_shapes=True) as prof:
            dp(_tokens(rank, step)).backward()
        ref.zero_grad()
        ref(_tokens(rank, step)).backward()
        # gloo sums float64 buckets whole and divides only this rank's shards after (one
        # foreach pass over 1/world_size of the buffer); on 2 ranks (a power of two) that
        # is the divided-then-summed average (DataParallel's, and DDP's) to the bit
        events = prof.events()
        engine = opt._engine
        assert [e.name for e in events].count("aten::_foreach_div_") == 1
        # (on CPU the foreach runs a div_ per tensor; dividing the buckets first would
        # divide world_size times as many elements)
        divided = sum(
            math.prod(e.input_shapes[0]) for e in events if e.name == "aten::div_" and e.input_shapes[0]
        )
        assert divided <= sum(b.numel() for b in replicate_state(dp).buckets) // world_size, divided
        for p, q in zip(flat.parameters(), ref.parameters()):
            if p not in engine.store:
                continue
            _, slot = engine.store.slot(p)
            for shard, (view, start) in zip(engine.shards, engine.bucket_views):
                size = view.numel() // world_size
                lo, hi = start + rank * size, start + (rank + 1) * size
                a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if a < b:  # this rank's part of p's gradient
                    mine = shard.grad[a - lo : b - lo]
                    assert torch.equal(mine, q.grad.flatten()[a - slot.offset : b - slot.offset])


def test_gloo_divides_only_the_shards_to_the_bit_of_dividing_first():
    run_ranks(_division_worker)


def _resume_worker(rank: int, world_size: int, tmp: str) -> None:
    model, flat, dp, opt = _build(rank)
    _train(dp, opt, rank, range(2))
    torch.save({"model": flat.state_dict(), "opt": opt.state_dict()}, f"{tmp}/ckpt{rank}.pt")
    _train(dp, opt, rank, range(2, 4))
    expected = [p.detach().clone() for p in model.parameters()]
    dist.barrier()
    model2, flat2, dp2, opt2 = _build(rank)
    # (a per-element state pickles as this rank's shards, plain tensors: weights_only loads it)
    saved = torch.load(f"{tmp}/ckpt{rank}.pt", weights_only=True)
    flat2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    _train(dp2, opt2, rank, range(2, 4))
    for p, q in zip(model2.parameters(), expected):
        assert torch.equal(p, q)  # bit-identical
    wrong = dict(saved["opt"], param_groups=saved["opt"]["param_groups"] * 2)
    with pytest.raises(ValueError, match="does not fit .*parameter groups hold other parameters"):
        opt2.load_state_dict(wrong)


def test_resume_from_state_dict_is_bit_identical(tmp_path):
    """Each rank torch.saves its own state_dict and loads it into a new run."""
    run_ranks(_resume_worker, str(tmp_path))


def _refuse_worker(rank: int, world_size: int) -> None:
    flat = flatgrad.FlatGrad(nn.Linear(4, 4))
    dp = flatgrad.replicate(flat)
    with pytest.raises(ValueError, match="cannot shard LBFGS: its update of a parameter reads other"):
        flatgrad.ShardedOptimizer(dp, torch.optim.LBFGS, lr=1.0)
    with pytest.raises(TypeError, match="model must be one flatgrad.replicate was applied to, got a Linear"):
        flatgrad.ShardedOptimizer(flatgrad.FlatGrad(nn.Linear(4, 4)), torch.optim.SGD, lr=1.0)
    # Bad optimizer arguments raise before anything moves: dp stays as replicate left it.
    weight = flat.weight
    with pytest.raises(TypeError, match="weight_deacy"):
        flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, lr=1.0, weight_deacy=0.1)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        flatgrad.ShardedOptimizer(dp, torch.optim.SGD, lr=-1.0)
    assert flat.weight is weight and weight.data_ptr() != 0
    assert weight.untyped_storage().size() == weight.numel() * weight.element_size()  # not moved
    dp(torch.full((2, 4), float(rank + 1))).sum().backward()
    grads = [torch.empty_like(weight.grad) for _ in range(world_size)]
    dist.all_gather(grads, weight.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)  # all-reduced, not scattered
    torch.testing.assert_close(weight.grad, torch.full((4, 4), 3.0))  # (2 + 4) / 2
    flatgrad.ShardedOptimizer(dp, torch.optim.SGD, lr=1.0)
    with pytest.raises(ValueError, match="the model already has a ShardedOptimizer"):
        flatgrad.ShardedOptimizer(dp, torch.optim.SGD, lr=1.0)


def test_optimizers_that_need_whole_tensors_are_refused():
    run_ranks(_refuse_worker)


def _accumulate_synced_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2).double()
    ref = copy.deepcopy(model)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model))
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.SGD, lr=0.1)
    ddp = DDP(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    pair = Lockstep(model, dp, opt, ddp, ref_opt, loss=_sum_of_squares)
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randn(3, 4, dtype=torch.float64, generator=gen) for _ in range(4)]
    # a second synchronised backward before zero_grad adds its average onto the first's, as
    # two synchronised backwards under DDP do
    for x in batches[:2]:
        pair.backward(x)
    # adding local gradients onto reduce-scattered shards under no_sync: refused
    with (
        pytest.raises(RuntimeError, match=r"under dp.no_sync\(\) after a synchronised backward"),
        dp.no_sync(),
    ):
        dp(batches[1]).square().sum().backward()
    pair.step()
    pair.assert_params(rtol=1e-12, atol=1e-12)
    for zero in (lambda: opt.zero_grad(), lambda: model.zero_grad(set_to_none=False)):
        zero()
        ref_opt.zero_grad()
        for x in batches[2:]:  # the supported way: no_sync, then one synchronised backward
            with pair.no_sync():
                pair.backward(x)
        pair.backward(batches[0])
        pair.step()
        pair.assert_params(rtol=1e-12, atol=1e-12)  # (the bias too)


def test_a_second_synchronised_backward_adds_its_average_and_no_sync_onto_shards_is_refused():
    """A second synchronised backward before zero_grad: its average lands on the first's
    (this rank's shards of the first are set aside and added back), equal to DDP + SGD. A
    backward under no_sync onto reduce-scattered gradients, whose local gradients would be
    added onto averages held in this rank's shard only, is refused on every rank; after any
    zero_grad accumulation works as usual."""
    run_ranks(_accumulate_synced_worker, timeout=90)


def _gan_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 5)).double()
    disc = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    ref_gen, ref_disc = DDP(copy.deepcopy(gen)), DDP(copy.deepcopy(disc))
    g_dp = flatgrad.replicate(flatgrad.FlatGrad(gen, config=ROUTE_ALL), bucket_cap_mb=0.0002)
    d_dp = flatgrad.replicate(flatgrad.FlatGrad(disc, config=ROUTE_ALL), bucket_cap_mb=0.0002)
    g_opt = flatgrad.ShardedOptimizer(g_dp, torch.optim.Adam, lr=0.01)
    d_opt = flatgrad.ShardedOptimizer(d_dp, torch.optim.SGD, lr=0.05, momentum=0.9)
    ref_g_opt = torch.optim.Adam(ref_gen.parameters(), lr=0.01)
    ref_d_opt = torch.optim.SGD(ref_disc.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(rank)
    for step in range(3):
        real = torch.randn(4, 5, dtype=torch.float64, generator=data)
        z = torch.randn(4, 3, dtype=torch.float64, generator=data)
        for g, d, g_o, d_o in ((g_dp, d_dp, g_opt, d_opt), (ref_gen, ref_disc, ref_g_opt, ref_d_opt)):
            d_o.zero_grad()
            scores = d(torch.cat([real, g(z).detach()]))
            (scores[4:].mean() - scores[:4].mean()).backward()
            d_o.step()
            g_o.zero_grad()
            # through the discriminator, which stepped: its second synchronised backward
            # before zero_grad (DDP adds the average onto its gradients)
            (-d(g(z)).mean()).backward()
            g_o.step()
            if step == 2:  # the discriminator steps on the sum of both averages
                d_o.step()
    for ours, ref in ((gen, ref_gen.module), (disc, ref_disc.module)):
        for p, q in zip(ours.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **TOL)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_gan_with_a_sharded_optimizer_each_equals_two_ddps(world_size):
    """Generator and discriminator with a DataParallel + ShardedOptimizer each: the
    generator's loss backpropagates through the discriminator after it stepped (a second
    synchronised backward before its zero_grad), as with two DDPs and plain optimizers."""
    run_ranks(_gan_worker, world_size=world_size)


def _layout_change_worker(rank: int, world_size: int) -> None:
    """The parameters of a ShardedOptimizer are views of its flat parameter buffer, which
    the all-gather refills: a conversion before a step is refused at `step()` on every rank (while the
    gradients are reduce-scattered, at the conversion itself, before anything converts),
    never a silent update of parameters that no longer are those views; a freeze after
    zero_grad is followed (a freeze between a backward and its step is stepped as stock's:
    `test_a_layer_frozen_while_its_gradient_is_in_flight_is_averaged_and_stepped_as_ddp`)."""
    for change in ("float", "freeze, zero_grad", "zero_grad, float"):
        model, flat, dp, opt = _build(rank)
        pair = _with_stock(model, dp, opt)
        pair.train_step(_tokens(rank, 0))
        pair.zero_grad()
        pair.backward(_tokens(rank, 1))
        if change == "float":
            # refused before anything converts (`nn.Module._apply` converts a parameter before its
            # reduce-scattered .grad, whose refusal left that one converted): the step is stock's
            with pytest.raises(RuntimeError, match=r"converting the model .* \(nothing was converted\)"):
                model.float()
            assert {p.dtype for p in model.parameters()} == {torch.float64}
            pair.step()
            pair.assert_params(**TOL)
            continue
        if change == "zero_grad, float":
            opt.zero_grad()
            model.float()  # (no .grad to guard: the parameters move to new memory)
        else:
            model.fc.requires_grad_(False)
        if change == "freeze, zero_grad":
            opt.zero_grad()  # lays the buffers out again, moving the reduce-scattered .grads
            before = [p.detach().clone() for p in model.parameters()]
            opt.step()  # a freeze with no gradients in flight is followed (see the freeze test)
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))  # none: no move
            continue
        with pytest.raises(RuntimeError, match=r"changed .* unfrozen between its synchronised backward"):
            opt.step()


def test_a_layout_change_before_step_is_refused():
    run_ranks(_layout_change_worker)


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _scattered_grad_worker(rank: int, world_size: int) -> None:
    model, flat, dp, opt = _build(rank)
    pair = _with_stock(model, dp, opt)
    advice = r"use opt\.clip_grad_norm_\(max_norm\) to clip"
    # every way to zero between steps: ShardedOptimizer's, and behind its back (the next
    # backward finds the zeroed buffers and makes .grad plain before any gradient arrives)
    zeroers = [
        lambda: opt.zero_grad(),
        lambda: opt.zero_grad(set_to_none=False),
        lambda: flat.zero_grad(set_to_none=False),
        lambda: model.zero_grad(set_to_none=False),  # stock's: a zero_ per .grad, let through
    ]
    for step, zero in enumerate(zeroers):
        zero()
        pair.ref_opt.zero_grad()
        pair.backward(_tokens(rank, step))
        # each rank holds the average of its own shard only: torch's clip (either path), a
        # norm for logging and the flat-buffer norms would all be quietly wrong, per rank
        for wrong in (
            lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0),
            lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True),
            lambda: model.fc.weight.grad.norm(),
            lambda: model.fc.weight.grad * 2,
            lambda: model.fc.weight.grad.clone(),
            lambda: flat.grad_norm(),
            lambda: flat.clip_grad_norm_(1.0),
            lambda: flat.all_reduce_grads(),  # (it averaged the shards with other ranks' sums: 9.3e-2 off)
            lambda: flat.grad_buffers,  # (a norm of them differed between ranks)
        ):
            with pytest.raises(RuntimeError, match=advice):
                wrong()
        # metadata reads stay (flatgrad's own identity tests read them): still the slots
        for p in _trainable(model):
            assert p.grad.shape == p.shape and p.grad.dtype == p.dtype
            assert grad_in_buffers(flat, p.grad)
        assert "reduce-scattered by a ShardedOptimizer" in repr(model.fc.weight.grad)
        # ShardedOptimizer's own clip is the global norm, as stock's over DDP's gradients
        total = opt.clip_grad_norm_(1.0)
        torch.testing.assert_close(total, torch.nn.utils.clip_grad_norm_(pair.ref.parameters(), 1.0), **TOL)
        pair.step()
        pair.assert_params(**TOL)
    opt.zero_grad(set_to_none=False)  # plain zeroed slots, readable again
    for p in _trainable(model):
        assert type(p.grad) is torch.Tensor and grad_in_buffers(flat, p.grad)
        assert not p.grad.any()
    assert float(flat.grad_norm()) == 0.0
    dp(_tokens(rank, 9)).backward()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_torch_clip_grad_norm_after_a_sharded_backward_raises_on_every_rank():
    """After a reduce-scattering backward `.grad` is right only inside this rank's shard:
    torch.nn.utils.clip_grad_norm_ and every other read of its values raise on every rank,
    pointing at opt.clip_grad_norm_ (stock DDP + AdamW + stock clipping is the oracle for
    that and for the steps); so do the model's all_reduce_grads() and grad_buffers, which read them
    silently before; metadata reads and every zero_grad keep working."""
    run_ranks(_scattered_grad_worker, timeout=90)


def _param_group_worker(rank: int, world_size: int) -> None:
    model, flat, dp, opt = _build(rank)
    pair = _with_stock(model, dp, opt)
    no_decay = [model.norm.weight, model.norm.bias]
    with pytest.raises(
        ValueError, match="inner optimizer holds this rank's pieces .* cannot take model param"
    ):
        opt.optimizer.add_param_group({"params": no_decay, "weight_decay": 0.0})
    with pytest.raises(ValueError, match="appear in more than one parameter group"):  # torch's check
        opt.add_param_group({"params": no_decay, "weight_decay": 0.0})
    with pytest.raises(ValueError, match="parameters of dp only"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
    assert len(opt.param_groups) == 1 and len(opt.optimizer.param_groups) == 1
    for bad in (0.0, -1.0, float("-inf"), float("nan")):  # checked before any collective
        with pytest.raises(ValueError, match="norm_type must be positive or inf"):
            opt.clip_grad_norm_(1.0, norm_type=bad)
    for step in range(2):  # nothing was added: stepped once, as stock
        pair.train_step(_tokens(rank, step))
    pair.assert_params(**TOL)
    opt.param_groups[0]["params"].append(nn.Parameter(torch.zeros(2)))  # past add_param_group
    with pytest.raises(RuntimeError, match="were changed by hand: add parameters with opt.add_param_group"):
        opt.step()


def test_model_parameters_are_refused_by_the_inner_optimizer():
    """A model parameter in the inner optimizer would be stepped there and again through
    its shard: add_param_group raises at the call, and step() refuses a group changed by
    hand."""
    run_ranks(_param_group_worker, timeout=90)


def _decay_groups(model: nn.Module) -> list[dict[str, Any]]:
    """nanoGPT's groups: weight decay on matrices only, the rest with its own lr."""
    params = _trainable(model)
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": 0.02},
    ]


def _groups_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = _Net()
    ref = DDP(copy.deepcopy(model), find_unused_parameters=True)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    dp = flatgrad.replicate(flat, bucket_cap_mb=0.002)  # buckets hold parameters of both groups
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, _decay_groups(model), lr=0.05, betas=(0.8, 0.9))
    ref_opt = torch.optim.AdamW(_decay_groups(ref.module), lr=0.05, betas=(0.8, 0.9))
    pair = Lockstep(model, dp, opt, ref, ref_opt)
    assert isinstance(opt, torch.optim.Optimizer)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert [g["lr"] for g in opt.param_groups] == [0.05, 0.02]
    assert opt.param_groups[0]["betas"] == (0.8, 0.9)  # the defaults fill every group
    kinds = [{p.dim() >= 2 for p in bucket.params} for bucket in replicate_state(dp)._engine._plan.buckets]
    assert {True, False} in kinds, "a bucket should hold parameters of both groups"
    schedules = []
    for optimizer in (opt, ref_opt):
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
        schedules.append(warmup)
    for step in range(6):
        pair.zero_grad()
        use_branch = not (rank == 1 and step % 3 == 1)
        with pair.no_sync():
            pair.backward(_tokens(rank, step, 1), use_branch)
        pair.backward(_tokens(rank, step), use_branch)
        norm = opt.clip_grad_norm_(0.5)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        torch.testing.assert_close(norm, ref_norm, **TOL)
        if step == 4:  # a loop writing the lr by hand (nanoGPT's cosine schedule does)
            for optimizer in (opt, ref_opt):
                for group in optimizer.param_groups:
                    group["lr"] *= 0.5
        pair.step()
        for schedule in schedules:
            schedule.step()
        pair.assert_params(**TOL)
    assert opt.param_groups[1]["lr"] == ref_opt.param_groups[1]["lr"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_param_groups_and_a_scheduler_equal_stock(world_size):
    """Decay/no-decay groups with their own lr, LambdaLR warm-up, an lr written by hand,
    clipping, accumulation under no_sync and a branch unused on one rank: parameters equal
    DDP + torch.optim.AdamW with the same groups and schedule, on 2 and 3 ranks."""
    run_ranks(_groups_worker, world_size=world_size, timeout=120)


def _add_group_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = _Net()
    ref = DDP(copy.deepcopy(model), find_unused_parameters=True)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    dp = flatgrad.replicate(flat, bucket_cap_mb=0.002)
    first, second = _decay_groups(model)
    ref_first, ref_second = _decay_groups(ref.module)
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.SGD, [first], lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD([ref_first], lr=0.1, momentum=0.9)
    pair = Lockstep(model, dp, opt, ref, ref_opt)
    for step in range(4):
        if step == 2:  # a group added mid-run (unfreezing schedules do this)
            opt.add_param_group(second)
            ref_opt.add_param_group(ref_second)
        pair.train_step(_tokens(rank, step))
        pair.assert_params(**TOL)


def test_a_param_group_added_later_and_parameters_in_no_group_equal_stock():
    """Until step 2 only the matrices are stepped (the rest in no group: averaged, never
    stepped, as stock); then add_param_group adds the others with their own lr."""
    run_ranks(_add_group_worker, timeout=90)


def _another_optimizer_worker(rank: int, world_size: int, shard_by: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    ref = DDP(copy.deepcopy(model))
    dp = flatgrad.replicate(flatgrad.FlatGrad(model))
    opt = flatgrad.ShardedOptimizer(
        dp, torch.optim.SGD, list(model[0].parameters()), lr=0.1, shard_by=shard_by
    )
    pairs = [(opt, torch.optim.SGD(ref.module[0].parameters(), lr=0.1))]
    pairs.append(
        (torch.optim.SGD(model[2].parameters(), lr=0.1), torch.optim.SGD(ref.module[2].parameters(), lr=0.1))
    )
    for step in range(3):
        torch.manual_seed(10 * step + rank)
        batch = torch.randn(5, 6, dtype=torch.double)
        for module in (dp, ref):
            module(batch).square().sum().backward()
        for ours, theirs in pairs:  # (a common loop: each optimizer steps, then zeroes)
            if shard_by == "element" and ours is not opt:
                with pytest.raises(RuntimeError, match=r"SGD.step\(\) would step 2 parameter\(s\) in none"):
                    ours.step()
                return
            ours.step()
            ours.zero_grad()
            theirs.step()
            theirs.zero_grad()
        assert_params_like(model, ref.module, **TOL)


@pytest.mark.parametrize("shard_by", ["element", "tensor"])
def test_another_optimizer_over_the_parameters_outside_the_groups(shard_by):
    """By tensor another torch optimizer over the rest of the model equals stock; by element (the buckets
    reduce-scattered, the model's gradients zeroed together) it is refused at its step, where the second
    optimizer stepped the head with `.grad` None after the first's zero_grad: it never moved (0.80 off)."""
    run_ranks(_another_optimizer_worker, shard_by, timeout=90)


def _unfrozen_worker(rank: int, world_size: int, zero_after_forward: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    model[0].requires_grad_(False)
    ref = copy.deepcopy(model)  # (averaged by hand: DDP never averages what was frozen when it wrapped)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model))
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.SGD, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    for step in range(4):
        if step == 2:  # Lightning's BackboneFinetuning: unfreeze, and a group for the backbone
            for module, optimizer in ((model, opt), (ref, ref_opt)):
                module[0].requires_grad_(True)
                optimizer.add_param_group({"params": list(module[0].parameters()), "lr": 0.05})
        torch.manual_seed(10 * step + rank)
        batch = torch.randn(5, 6, dtype=torch.double)
        for module, optimizer in ((dp, opt), (ref, ref_opt)):
            if not zero_after_forward:
                optimizer.zero_grad()
            loss = module(batch).square().sum()
            if zero_after_forward:  # (Lightning's order: the forward meets the last step's gradients)
                optimizer.zero_grad()
            loss.backward()
            if module is ref:
                for param in ref.parameters():
                    if param.grad is not None:
                        dist.all_reduce(param.grad)
                        param.grad /= world_size
            optimizer.step()
        assert_params_like(model, ref, **TOL)


@pytest.mark.parametrize("zero_after_forward", [False, True])
def test_a_layer_frozen_at_construction_unfrozen_with_a_group_equals_stock(zero_after_forward):
    """Unfreezing a layer frozen when ShardedOptimizer was built and adding its group (BackboneFinetuning)
    lays the model out again at the next forward; where that forward meets the last step's reduce-scattered
    gradients (Lightning zeroes after the forward), they are gathered whole first (the relayout crashed
    reading them before), and the run equals stock averaging by hand."""
    run_ranks(_unfrozen_worker, zero_after_forward, timeout=90)


def _frozen_main_grad_worker(
    rank: int, world_size: int, by_optimizer: bool, to_none: bool, shard_by: str
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).to(torch.bfloat16)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model, config=flatgrad.FlatGradConfig(grad_dtype="float32")))
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.SGD, lr=0.1, momentum=0.9, shard_by=shard_by)
    for step in range(3):
        if step == 2:  # frozen before the forward; Lightning zeroes after it
            model[0].requires_grad_(False)
            before = [p.detach().clone() for p in model[0].parameters()]
        torch.manual_seed(10 * step + rank)
        loss = dp(torch.randn(5, 6, dtype=torch.bfloat16)).float().square().sum()
        (opt.zero_grad if by_optimizer else model.zero_grad)(set_to_none=to_none)
        loss.backward()
        opt.step()
    # Stock: `.grad` None skips the frozen layer; zeroed in place, SGD steps it (its momentum moves it)
    assert all(torch.equal(p, q) for p, q in zip(model[0].parameters(), before)) == to_none


@pytest.mark.parametrize("shard_by", ["element", "tensor"])
@pytest.mark.parametrize("to_none", [True, False], ids=["to_none", "in_place"])
@pytest.mark.parametrize("by_optimizer", [True, False], ids=["optimizer", "model"])
def test_a_main_grad_layer_frozen_before_the_forward_that_meets_scattered_gradients_is_not_stepped(
    by_optimizer: bool, to_none: bool, shard_by: str
) -> None:
    """bfloat16 with float32 main grads: a layer frozen before a forward that meets the last step's
    gradients (by element reduce-scattered: it keeps its slot until they are zeroed) is not stepped where
    stock skips a frozen parameter whose `.grad` zero_grad set to None (by element its main grad counted as
    a gradient, and SGD's momentum moved it, 0.096), zeroed by the optimizer or by the model; zeroed in
    place, it is stepped as stock's zero `.grad`."""
    run_ranks(_frozen_main_grad_worker, by_optimizer, to_none, shard_by, timeout=90)


def _frozen_main_grad_when_worker(rank: int, world_size: int, when: str, shard_by: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    model = flatgrad.FlatGrad(model.to(torch.bfloat16), config=flatgrad.FlatGradConfig(grad_dtype="float32"))
    dp = flatgrad.replicate(model)
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, lr=0.05, weight_decay=0.1, shard_by=shard_by)
    for step in range(3):
        if step == (0 if when == "at_build" else 1) and when != "after_zero_grad":
            model[2].requires_grad_(False)
        opt.zero_grad()
        if step == 1 and when == "after_zero_grad":
            model[2].requires_grad_(False)
        before = [p.detach().clone() for p in model[2].parameters()]
        torch.manual_seed(10 * step + rank)
        dp(torch.randn(4, 6, dtype=torch.bfloat16)).float().square().sum().backward()
        assert model[2].weight.grad is None  # (as stock's, zeroed to None and frozen since)
        opt.step()
        if not model[2].weight.requires_grad:  # (AdamW's decay moves a parameter stepped with zeros)
            assert all(torch.equal(p, q) for p, q in zip(model[2].parameters(), before))


@pytest.mark.parametrize("shard_by", ["element", "tensor"])
@pytest.mark.parametrize("when", ["at_build", "before_zero_grad", "after_zero_grad"])
def test_a_main_grad_layer_frozen_between_steps_is_not_stepped(when: str, shard_by: str) -> None:
    """bfloat16 with float32 main grads: a layer frozen between steps (before zero_grad or after it, or
    right after building) is not stepped, as stock skips a `.grad` zeroed to None. Its main grad, leaving the
    buffers as the next forward lays them out again, became its `.grad` (zeros), which a step then took
    (AdamW by tensor 3.6e-2, SGD momentum 9.7e-2): a main grad zeroed to None with nothing written since
    leaves as None now."""
    run_ranks(_frozen_main_grad_when_worker, when, shard_by, timeout=90)


class _Branches(nn.Module):
    """`a`, then `b` where the batch asks for it (step by step, rank by rank), then `c`."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.c(self.b(h) if use_b else h).float().square().sum()


def _unused_main_grad_worker(rank: int, world_size: int, shard_by: str) -> None:
    torch.manual_seed(0)
    model = _Branches().to(torch.bfloat16)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model, config=flatgrad.FlatGradConfig(grad_dtype="float32")))
    groups = [{"params": [*model.a.parameters(), *model.c.parameters()]}, {"params": [*model.b.parameters()]}]
    opt = flatgrad.ShardedOptimizer(
        dp, torch.optim.AdamW, groups, lr=0.05, weight_decay=0.1, shard_by=shard_by
    )
    for step, used_by in enumerate([(0, 1), (), (1,), ()]):  # (the ranks whose batch uses b)
        opt.zero_grad()
        before = [p.detach().clone() for p in model.b.parameters()]
        torch.manual_seed(10 * step + rank)
        dp(torch.randn(4, 6, dtype=torch.bfloat16), use_b=rank in used_by).backward()
        opt.step()
        # Stock (DDP with find_unused_parameters=True): b's `.grad` is None where no rank used it, and AdamW
        # skips it; used on one rank, it is the average on every rank, and stepped.
        moved = [not torch.equal(p, q) for p, q in zip(model.b.parameters(), before)]
        assert moved == [bool(used_by)] * 2, (step, moved)
    model.zero_grad()  # (the model's zeroing to None: no gradient left to step)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize("shard_by", ["element", "tensor"])
def test_a_main_grad_layer_no_rank_used_is_not_stepped(shard_by: str) -> None:
    """bfloat16 with float32 main grads: a layer no rank used in a step is left as stock DDP leaves it
    (`.grad` None, not stepped; one rank used it: averaged and stepped), and a step after `model.zero_grad()`
    moves nothing. Its main grad (zero) counted as a gradient: AdamW's decay and moments moved it."""
    run_ranks(_unused_main_grad_worker, shard_by, timeout=90)


def _closure(module: nn.Module, zero_grad: Callable[[], None], tokens: torch.Tensor) -> Callable[..., Any]:
    def closure() -> torch.Tensor:
        zero_grad()
        loss = module(tokens)
        loss.backward()
        return loss

    return closure


def _closure_worker(rank: int, world_size: int) -> None:
    model, flat, dp, opt = _build(rank)
    pair = _with_stock(model, dp, opt)
    ref, ref_opt = pair.ref, pair.ref_opt
    for step in range(3):
        with torch.no_grad():  # torch's step runs the closure under grad mode anyway
            loss = opt.step(_closure(dp, opt.zero_grad, _tokens(rank, step)))
        ref_loss = ref_opt.step(_closure(ref, ref_opt.zero_grad, _tokens(rank, step)))
        torch.testing.assert_close(loss, ref_loss, **TOL)
        pair.assert_params(**TOL)


def test_step_with_a_closure_equals_stock():
    """opt.step(closure), torch's documented pattern (the closure zeroes, runs forward and
    backward and returns the loss), against stock DDP + AdamW with the same closure."""
    run_ranks(_closure_worker, timeout=90)


def _no_backward_worker(rank: int, world_size: int) -> None:
    model, flat, dp, opt = _build(rank)
    pair = _with_stock(model, dp, opt)
    for set_to_none in (True, False):
        pair.train_step(_tokens(rank, 0))
        # no backward since: set_to_none=True leaves every .grad None (stock moves nothing);
        # set_to_none=False steps with zero gradients (AdamW's momentum and decay move)
        pair.zero_grad(set_to_none=set_to_none)
        before = [p.detach().clone() for p in model.parameters()]
        with rank_profile() as prof:
            opt.step()
        pair.ref_opt.step()
        pair.assert_params(**TOL)
        gathers = [e.name for e in prof.events()].count("c10d::broadcast_") // world_size  # (gloo)
        moved = any(not torch.equal(p, q) for p, q in zip(model.parameters(), before))
        assert (gathers, moved) == ((0, False) if set_to_none else (len(opt._engine.shards), True))
    pair.train_step(_tokens(rank, 1))  # a last step: AdamW's step counts (bias correction) agree with stock's
    pair.assert_params(**TOL)


def test_step_without_a_backward_after_zero_grad_equals_stock():
    run_ranks(_no_backward_worker, timeout=90)


def _load_other_rank_worker(rank: int, world_size: int, tmp: str) -> None:
    _, _, dp, opt = _build(rank)
    _train(dp, opt, rank, range(1))
    saved = opt.state_dict()
    if rank == 1:  # rank 1 is given a state without one parameter's
        saved = dict(saved, state={k: v for k, v in saved["state"].items() if k != "fc.weight"})
    before = opt.optimizer.state_dict()
    with pytest.raises(ValueError, match=r"state given to rank\(s\) \[1\] does not fit"):
        opt.load_state_dict(saved)
    after = opt.optimizer.state_dict()
    for index, state in before["state"].items():  # nothing was loaded, on any rank
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(after["state"][index][key]))
    _train(dp, opt, rank, range(1, 2))  # and the ranks still train together


def test_loading_another_ranks_state_raises_on_every_rank(tmp_path):
    """A state that does not fit on rank 1 only: every rank raises the same error naming
    rank 1, none loads anything or is left waiting in a collective."""
    run_ranks(_load_other_rank_worker, str(tmp_path), timeout=90)


def _overlap_gather_worker(rank: int, world_size: int) -> None:
    built = []
    for overlap in (False, True):
        torch.manual_seed(0)
        model = _Net()
        dp = flatgrad.replicate(flatgrad.FlatGrad(model, config=ROUTE_ALL), bucket_cap_mb=0.002)
        with mock.patch.object(flatgrad._bucket_sync.BucketSync, "shard_plan", _bucket_shards):
            # the synchronous path with the shards overlap_param_gather has (one per bucket;
            # on gloo it would split whole buffers): the same clip norm, summed over the
            # same shards, so bit-identical parameters
            opt = flatgrad.ShardedOptimizer(
                dp, torch.optim.AdamW, lr=0.05, weight_decay=0.1, overlap_param_gather=overlap
            )
        built.append((model, dp, opt))
    (sync_model, sync_dp, sync_opt), (model, dp, opt) = built
    engine = opt._engine
    order = []  # modules in the order their forward started
    for name, module in model.named_modules():
        module.register_forward_pre_hook(lambda m, args, n=name: order.append((n, len(engine.in_flight))))
    for step in range(4):
        for o, d in ((sync_opt, sync_dp), (opt, dp)):
            o.zero_grad()
            # (the branch unused on one rank each step: some rank uses it, see `_unused_worker`)
            d(_tokens(rank, step), (step + rank) % 2 == 0).backward()
            o.clip_grad_norm_(0.5)
            o.step()
        num_buckets = len(replicate_state(dp).buckets)
        assert len(engine.in_flight) == num_buckets  # step() returned with every gather in flight
        engine.waited.clear()
        order.clear()
        if step == 1:
            state = dp.state_dict()  # waits for all first
            assert not engine.in_flight and len(engine.waited) == num_buckets
            assert all(torch.equal(state[n], p) for n, p in sync_dp.state_dict().items())
            continue
        if step == 2:
            opt.wait_param_gather()
            assert not engine.in_flight
            continue
        with torch.no_grad():
            dp(_tokens(rank, 9))  # the next forward (eval-like) waits bucket by bucket
        # the first module with parameters waited only for its own buckets: the others were
        # still in flight while it ran
        assert [n for n, _ in order][:2] == ["", "emb"]  # the root, then the embedding
        in_flight_at_emb = dict(order)["emb"]
        assert 0 < in_flight_at_emb < num_buckets, (in_flight_at_emb, num_buckets)
        assert sorted(engine.waited) == list(range(num_buckets))
    opt.wait_param_gather()
    for (name, p), q in zip(model.named_parameters(), sync_model.parameters()):
        assert torch.equal(p, q), name  # bit-identical to the synchronous gather
    # the synchronous path as built on gloo (shards of whole buffers): the clip norm is
    # summed over other shards, so equal to round-off
    torch.manual_seed(0)
    plain_model = _Net()
    plain_dp = flatgrad.replicate(flatgrad.FlatGrad(plain_model, config=ROUTE_ALL), bucket_cap_mb=0.002)
    plain_opt = flatgrad.ShardedOptimizer(plain_dp, torch.optim.AdamW, lr=0.05, weight_decay=0.1)
    assert len(plain_opt._engine.shards) == 1 < len(opt._engine.shards)
    for step in range(4):
        plain_opt.zero_grad()
        plain_dp(_tokens(rank, step), (step + rank) % 2 == 0).backward()
        plain_opt.clip_grad_norm_(0.5)
        plain_opt.step()
    for (name, p), q in zip(model.named_parameters(), plain_model.parameters()):
        torch.testing.assert_close(p, q, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    with pytest.raises(TypeError, match="overlap_param_gather must be a bool"):
        flatgrad.ShardedOptimizer(dp, torch.optim.SGD, lr=0.1, overlap_param_gather=1)


_shard_plan = flatgrad._bucket_sync.BucketSync.shard_plan


def _bucket_shards(engine, store, overlap_param_gather):  # noqa: ANN001, ANN202
    return _shard_plan(engine, store, overlap_param_gather=True)  # (one shard per bucket)


def test_overlap_param_gather_waits_per_bucket_in_the_next_forward_and_equals_the_sync_path():
    """overlap_param_gather=True: step() returns with every bucket's all-gather in flight;
    the next forward waits for each bucket just before the first module using it (the
    embedding, first, finds the other buckets still in flight), state_dict and
    wait_param_gather() wait for all; parameters equal the synchronous path bit for bit."""
    run_ranks(_overlap_gather_worker, timeout=120)


def _nan_step_worker(rank: int, world_size: int) -> None:
    """One non-finite batch on one rank: the norm is NaN on every rank for that step (the
    loop skips it, as stock's does), and the next steps are stock's again. The NaN clip
    coefficient of that step multiplies gradients only, never the alignment padding inside
    the shards, which no zeroing reaches and every later norm would read."""
    model, flat, dp, opt = _build(rank)
    pair = _with_stock(model, dp, opt)
    ref = pair.ref
    store = engine_of(flat).store
    padded = sum(b.numel() for b in store.buffers.values()) > sum(p.numel() for p in store.params)
    assert padded, "the model must leave alignment padding in its buffers"
    for step in range(4):
        pair.zero_grad()
        nan = step == 1 and rank == 1
        loss = dp(_tokens(rank, step))
        (loss * float("nan") if nan else loss).backward()
        ref_loss = ref(_tokens(rank, step))
        (ref_loss * float("nan") if nan else ref_loss).backward()
        norm = opt.clip_grad_norm_(0.5)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        assert torch.isfinite(norm) == torch.isfinite(ref_norm) == (step != 1), (step, norm, ref_norm)
        if torch.isfinite(norm):
            torch.testing.assert_close(norm, ref_norm, **TOL)
            pair.step()
    pair.assert_params(**TOL)


def test_a_nan_step_does_not_poison_the_next_ones():
    run_ranks(_nan_step_worker)


def _model_zero_grad_worker(rank: int, world_size: int, who: str) -> None:
    """Gradients zeroed through the model (``model.zero_grad()``, as transformers' Trainer
    does), through the wrapper or DataParallel, never through the optimizer: the next
    backward is a fresh one (the routed Embedding's slot still holds the last average) and
    a step with no backward in between steps nothing, as with stock."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    ref, ref_opt = _stock(model)
    flat = flatgrad.FlatGrad(model)  # (the default config routes the Embedding)
    dp = flatgrad.replicate(flat)
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, lr=0.05, weight_decay=0.1)
    pair = Lockstep(model, dp, opt, ref, ref_opt, loss=lambda out: out.square().mean())
    zero = {"model": model.zero_grad, "flat": flat.zero_grad, "dp": dp.zero_grad}[who]
    for step in range(4):
        x = torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(step * 2 + rank))
        zero()
        ref.zero_grad()
        if step != 2:  # step 2: zeroed, then a step with nothing to step
            pair.backward(x)
        pair.step()
    pair.assert_params(**TOL)


@pytest.mark.parametrize("who", ["model", "flat", "dp"])
def test_gradients_zeroed_through_the_model_equal_stock(who):
    run_ranks(_model_zero_grad_worker, who)


class _ReadsUncalled(nn.Module):
    """`head` is never called: its parameters are read in the root's forward. `attn` reads
    its `out_proj` without calling it (nn.MultiheadAttention)."""

    def __init__(self, probe: Callable[[], None]) -> None:
        super().__init__()
        self.head = nn.Linear(8, 1)
        self.inp = nn.Linear(4, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.probe = probe
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h, _ = self.attn(h, h, h, need_weights=False)
        self.probe()  # just before the head's parameters are read
        return nn.functional.linear(h, self.head.weight, self.head.bias).square().mean()


def _uncalled_worker(rank: int, world_size: int) -> None:
    """overlap_param_gather: the buckets of a module whose forward never runs are waited for
    before its parents' forward reads them (learned in the first forward), not left in
    flight; parameters equal stock DDP's after each step."""
    pending: list[tuple[int, ...]] = []
    engine: list[Any] = []

    def probe() -> None:
        if engine:
            head = engine[0].bucket_indices(list(model.head.parameters()))
            pending.append(tuple(i for i in head if i in engine[0].in_flight))

    torch.manual_seed(0)
    model = _ReadsUncalled(probe)
    ref, ref_opt = stock(model, torch.optim.SGD, {"find_unused_parameters": True}, lr=0.1)
    ref.module.probe = lambda: None
    dp = flatgrad.replicate(flatgrad.FlatGrad(model), bucket_cap_mb=0.0001)  # a bucket or two per layer
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.SGD, lr=0.1, overlap_param_gather=True)
    engine.append(opt._engine)
    pair = Lockstep(model, dp, opt, ref, ref_opt)
    assert len(replicate_state(dp).buckets) > 2
    for step in range(4):
        gen = torch.Generator().manual_seed(step * 2 + rank)
        pair.train_step(torch.randn(2, 3, 4, dtype=torch.float64, generator=gen))
    assert len(pending) == 4 and not any(pending), pending  # no head bucket in flight when read
    opt.wait_param_gather()
    pair.assert_params(**TOL)


def _copied_overlap_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = _Net()
    dp = flatgrad.replicate(flatgrad.FlatGrad(model), bucket_cap_mb=0.002)
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, lr=1e-2, overlap_param_gather=True)
    pair = Lockstep(model, dp, opt, *stock(model, torch.optim.AdamW, lr=1e-2))
    copy.deepcopy(model)  # (before any forward: the learning hooks)
    ema = torch.optim.swa_utils.AveragedModel(model)
    ref_ema = torch.optim.swa_utils.AveragedModel(pair.ref.module)
    for step in range(3):
        pair.train_step(_tokens(rank, step))
        ema.update_parameters(model)  # (right after the step: the gathers still in flight, waited for)
        ref_ema.update_parameters(pair.ref.module)
        assert all(torch.equal(p, q) for p, q in zip(ema.parameters(), ref_ema.parameters())), step
        saved = io.BytesIO()
        torch.save(model, saved)  # (the gathers still in flight: waited for first)
        copies = [copy.deepcopy(model), torch.optim.swa_utils.AveragedModel(model).module]
        copies.append(torch.load(io.BytesIO(saved.getvalue()), weights_only=False))
        tokens = _tokens(rank, 9)
        for copied in copies:  # the model's own class, FlatGrad applied, no hook of the optimizer's
            assert isinstance(copied, _Net) and isinstance(copied, flatgrad.FlatGrad)
            assert all(torch.equal(p, q) for p, q in zip(copied.parameters(), model.parameters()))
            for module in copied.modules():
                for hooks in (module._forward_pre_hooks, module._forward_hooks, module._state_dict_pre_hooks):
                    assert not any("flatgrad" in getattr(h, "__module__", "") for h in hooks.values())
            with torch.no_grad():
                torch.testing.assert_close(copied(tokens), model(tokens), rtol=0, atol=0)
        pair.assert_params(**TOL)


def test_a_model_whose_sharded_optimizer_overlaps_its_gather_can_be_copied() -> None:
    """``copy.deepcopy``, ``torch.save`` and ``AveragedModel`` (an EMA) of a replicated model whose
    ShardedOptimizer has ``overlap_param_gather=True``, right after a step: copies of the gathered
    parameters with FlatGrad applied and none of the optimizer's forward hooks (each copied the ShardEngine
    with them and raised, "cannot pickle AccumulateGrad" or a ScatteredGrad's refusal); the EMA updated then
    equal to stock's (it read parameters still being gathered: 1e-2 off, ranks apart); the model trains on
    as stock."""
    run_ranks(_copied_overlap_worker, timeout=90)


def test_overlap_param_gather_waits_for_modules_that_are_never_called():
    run_ranks(_uncalled_worker)


class _Reader(nn.Module):
    def __init__(self, shared: nn.Linear, probe: Callable[[], None]) -> None:
        super().__init__()
        self.shared, self.lin, self.probe = shared, nn.Linear(4, 4), probe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.probe()  # just before the shared weight is read
        return nn.functional.linear(self.lin(x), self.shared.weight)


def _in_flight_when_read(
    build: Callable[[Callable[[], None]], nn.Module],
    read: Callable[[nn.Module], nn.Parameter],
    bucket_cap_mb: float,
) -> tuple[nn.Module, Any, list[list[int]]]:
    """Three steps of `build(probe)` with `overlap_param_gather` on one gloo rank; `probe`,
    called by the model just before it reads `read(model)`, notes which of that parameter's
    buckets still have their all-gather in flight (none may). Returns the model, the
    optimizer's engine and the notes."""
    from flatgrad.bench.suite import single_rank_group

    in_flight: list[list[int]] = []
    engine: list[Any] = []

    def probe() -> None:
        if engine:
            held = engine[0].bucket_indices([read(model)])
            in_flight.append([i for i in held if i in engine[0].in_flight])

    with single_rank_group("gloo", torch.device("cpu")):
        model = build(probe)
        dp = flatgrad.replicate(flatgrad.FlatGrad(model), bucket_cap_mb=bucket_cap_mb)
        opt = flatgrad.ShardedOptimizer(dp, torch.optim.SGD, lr=0.1, overlap_param_gather=True)
        engine.append(opt._engine)
        assert len(replicate_state(dp).buckets) > 1
        for _ in range(3):
            opt.zero_grad()
            dp(torch.randn(2, 4)).square().mean().backward()
            opt.step()
        opt.wait_param_gather()
    return model, engine[0], in_flight


def test_overlap_param_gather_waits_for_a_module_never_called_in_each_parent_that_reads_it():
    """A module shared by two parents, never called itself, read by both: each parent's pre
    hook waits for its buckets (the first to run must not read them in flight)."""
    shared = nn.Linear(4, 4, bias=False)
    _, _, in_flight = _in_flight_when_read(
        lambda probe: nn.Sequential(_Reader(shared, probe), _Reader(shared, probe)),
        lambda model: shared.weight,
        bucket_cap_mb=0.00001,  # a bucket per layer
    )
    assert len(in_flight) == 6 and not any(in_flight), in_flight


class _ReadsFirst(nn.Module):
    """Reads `proj`'s weight (a scale from its norm) before `proj` runs."""

    def __init__(self, probe: Callable[[], None]) -> None:
        super().__init__()
        self.inp, self.proj, self.probe = nn.Linear(4, 4), nn.Linear(4, 4), probe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.probe()  # just before proj's weight is read
        scale = self.proj.weight.norm()
        return self.proj(torch.tanh(self.inp(x))) / scale


def test_overlap_param_gather_waits_before_an_ancestor_reads_a_module_that_runs_later():
    """A module whose forward runs, but whose weight its parent reads first: the parent's
    pre hook waits for its buckets (learned from the first forward's reads), not only the
    module's own, which runs after the read."""
    model, engine, in_flight = _in_flight_when_read(
        lambda probe: nn.Sequential(nn.Linear(4, 4), _ReadsFirst(probe)),
        lambda model: model[1].proj.weight,
        bucket_cap_mb=0.00001,  # a bucket per layer
    )
    assert len(engine.bucket_indices([model[1].proj.weight])) == 1
    assert len(in_flight) == 3 and not any(in_flight), in_flight


class _Fails(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(4, 4), nn.Linear(4, 1)
        self.fail: type[BaseException] | None = RuntimeError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if self.fail is not None:
            raise self.fail("the forward fails")
        return self.out(h)


def test_overlap_param_gather_learns_from_a_training_forward_that_completes():
    """The learning forward runs under a torch function mode: a forward that raises (an
    interrupt too) leaves it, with no mode left behind, and teaches nothing; so do a
    no_grad forward (a mode would turn off torch's inference fast paths) and a submodule
    called on its own; the next whole training forward learns."""
    from flatgrad.bench.suite import single_rank_group

    def learning_hooks() -> int:
        return sum(len(m._forward_hooks) for m in model.modules())

    with single_rank_group("gloo", torch.device("cpu")):
        model = _Fails()
        dp = flatgrad.replicate(flatgrad.FlatGrad(model), bucket_cap_mb=0.00001)
        opt = flatgrad.ShardedOptimizer(dp, torch.optim.SGD, lr=0.1, overlap_param_gather=True)
        modes, hooks = torch._C._len_torch_function_stack(), learning_hooks()
        for fail in (RuntimeError, KeyboardInterrupt):
            model.fail = fail
            with pytest.raises(fail, match="the forward fails"):
                dp(torch.randn(2, 4))
            assert torch._C._len_torch_function_stack() == modes
        model.fail = None
        with torch.no_grad():
            dp(torch.randn(2, 4))
        model.inp(torch.randn(2, 4))  # a submodule alone
        assert torch._C._len_torch_function_stack() == modes and learning_hooks() == hooks > 0
        for _ in range(2):
            opt.zero_grad()
            dp(torch.randn(2, 4)).square().mean().backward()
            opt.step()
            assert torch._C._len_torch_function_stack() == modes
        hooked = [m for m in model.modules() if m._forward_pre_hooks]
        assert hooked and all(len(m._forward_pre_hooks) == 1 for m in hooked)  # the waits only
        assert learning_hooks() == 0


@torch.jit.script
def _scripted_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x @ weight.t()


class _ReadsUnseen(nn.Module):
    """`h` never runs; TorchScript reads its weight (no torch function shows that read);
    `b`, in the same bucket, runs after."""

    def __init__(self, probe: Callable[[], None]) -> None:
        super().__init__()
        self.h, self.b, self.probe = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False), probe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.probe()
        return self.b(_scripted_linear(x, self.h.weight))


def test_overlap_param_gather_waits_for_a_never_called_module_read_unseen_in_its_ancestor():
    """A never-called module whose parameter the learning forward did not see read is
    waited for by its nearest running ancestor, even when another parameter of its bucket
    was seen read later."""
    model, engine, in_flight = _in_flight_when_read(
        lambda probe: nn.Sequential(nn.Linear(4, 4), _ReadsUnseen(probe)),
        lambda model: model[1].h.weight,
        bucket_cap_mb=0.0004,
    )
    buckets = [engine.bucket_indices([p]) for p in (model[0].weight, model[1].h.weight, model[1].b.weight)]
    assert buckets[1] == buckets[2] != buckets[0]  # h and b share a bucket, the first layer has its own
    assert len(in_flight) == 3 and not any(in_flight), in_flight


# --- torch's optimizer contracts (the lines of torch's ZeRO tests) -------------------------


def _small(rank: int) -> tuple[nn.Module, nn.Module, flatgrad.ReplicateModule]:
    """A float64 model of several slots, its deep copy (the oracle's) and DataParallel."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    ref = copy.deepcopy(model)
    return model, ref, flatgrad.replicate(flatgrad.FlatGrad(model, config=ROUTE_ALL), bucket_cap_mb=0.0002)


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(100 * rank + step))


def _sum_of_squares(output: torch.Tensor) -> torch.Tensor:
    """The loss of `_small`'s model (and of `_accumulate_synced_worker`'s)."""
    return output.square().sum()


def _load_other_options_worker(rank: int, world_size: int) -> None:
    """torch's test_state_dict: a state saved with momentum=0.9 loads into an optimizer
    built with lr=0.01 and no momentum; the momentum buffers come with it (torch loads what
    the dict holds, whatever the constructor said)."""
    model, ref, dp = _small(rank)
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.SGD, lr=0.1, momentum=0.9)
    ddp = DDP(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    pair = Lockstep(model, dp, opt, ddp, ref_opt, loss=_sum_of_squares)
    for step in range(2):
        pair.train_step(_batch(rank, step))
    saved, ref_saved = opt.state_dict(), ref_opt.state_dict()
    model2, ref2, dp2 = _small(rank)
    with torch.no_grad():
        for p, q in zip(model2.parameters(), model.parameters()):
            p.copy_(q)
    opt2 = flatgrad.ShardedOptimizer(dp2, torch.optim.SGD, lr=0.01)
    ref_opt2 = torch.optim.SGD(ref.parameters(), lr=0.01)
    opt2.load_state_dict(saved)
    ref_opt2.load_state_dict(ref_saved)
    assert opt2.param_groups[0]["momentum"] == 0.9 == ref_opt2.param_groups[0]["momentum"]
    pair2 = Lockstep(model2, dp2, opt2, ddp, ref_opt2, loss=_sum_of_squares)
    for step in range(2, 4):
        pair2.train_step(_batch(rank, step))
    pair2.assert_params(**TOL)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_state_loaded_into_an_optimizer_built_with_other_options_equals_torch(world_size):
    run_ranks(_load_other_options_worker, world_size=world_size)


def _assigned_grad_worker(rank: int, world_size: int) -> None:
    """``p.grad = g`` with no backward (gradient surgery, torch.autograd.grad, torch's join
    test), then ``opt.step()``: steps from those gradients as torch.optim.Adam does (the
    same gradients on every rank, so every rank agrees with the plain optimizer); also
    after a synchronised step and zero_grad."""
    model, ref, dp = _small(rank)
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.Adam, lr=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(7)  # the same on every rank
    for _ in range(3):
        grads = [torch.randn(p.shape, dtype=p.dtype, generator=gen) for p in ref.parameters()]
        for o, m in ((opt, model), (ref_opt, ref)):
            o.zero_grad()
            for p, g in zip(m.parameters(), grads):
                p.grad = g.clone()
            o.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **TOL)
    # a synchronised step, then hand-set gradients on every parameter again
    pair = Lockstep(model, dp, opt, DDP(ref), ref_opt, loss=_sum_of_squares)
    pair.train_step(_batch(rank, 0))
    pair.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        g = torch.full_like(p, 0.5)
        p.grad, q.grad = g.clone(), g.clone()
    pair.step()
    pair.assert_params(**TOL)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_grad_assigned_by_hand_is_stepped_as_torch(world_size):
    run_ranks(_assigned_grad_worker, world_size=world_size)


class _SGDWithExtras(torch.optim.SGD):
    """An optimizer whose step takes a keyword and writes a key into its groups."""

    def step(self, closure=None, *, scale: float = 1.0):  # noqa: ANN001, ANN201
        for group in self.param_groups:
            group["lr"] *= scale
            group["steps_seen"] = group.get("steps_seen", 0) + 1
        return super().step(closure)


def _torch_signatures_worker(rank: int, world_size: int) -> None:
    """What torch's optimizers and clip_grad_norm_ take, ShardedOptimizer takes: step's
    keywords go to the inner optimizer (as torch's ZeroRedundancyOptimizer passes them),
    keys the inner step writes into its groups show in param_groups, clip_grad_norm_ takes
    error_if_nonfinite= and foreach=, and a non-tensor in params is a TypeError naming it."""
    model, ref, dp = _small(rank)
    params = list(dp.parameters())
    with pytest.raises(TypeError, match="can only optimize Tensors, but one of the params is int"):
        flatgrad.ShardedOptimizer(dp, torch.optim.SGD, params + [42], lr=0.1)
    opt = flatgrad.ShardedOptimizer(dp, _SGDWithExtras, lr=0.1, shard_by="element")
    ref_opt = _SGDWithExtras(ref.parameters(), lr=0.1)
    pair = Lockstep(model, dp, opt, DDP(ref), ref_opt, loss=_sum_of_squares)
    for step in range(2):
        pair.zero_grad()
        pair.backward(_batch(rank, step))
        total = opt.clip_grad_norm_(0.5, foreach=True, error_if_nonfinite=True)
        ref_total = torch.nn.utils.clip_grad_norm_(
            ref.parameters(), 0.5, foreach=True, error_if_nonfinite=True
        )
        torch.testing.assert_close(total, ref_total, **TOL)
        pair.step(scale=0.5)
    assert opt.param_groups[0]["steps_seen"] == 2 == ref_opt.param_groups[0]["steps_seen"]
    assert opt.param_groups[0]["lr"] == 0.025 == ref_opt.param_groups[0]["lr"]
    pair.assert_params(**TOL)
    opt.zero_grad()
    x = _batch(rank, 5)
    x[0, 0] = float("nan") if rank == world_size - 1 else 0.0  # non-finite on one rank only
    dp(x).square().sum().backward()
    with pytest.raises(RuntimeError, match="total norm of order 2.0 of the gradients is non-finite"):
        opt.clip_grad_norm_(1.0, error_if_nonfinite=True)


def test_step_kwargs_group_keys_and_clip_arguments_as_torch():
    run_ranks(_torch_signatures_worker, world_size=2)


def _ddp_inside_worker(rank: int, world_size: int) -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    ddp = DDP(model, gradient_as_bucket_view=True)
    with pytest.raises(ValueError, match=r"FlatGrad must be applied to the plain model .*ddp_kwargs"):
        flatgrad.FlatGrad(ddp)
    with pytest.raises(ValueError, match=r"submodule 'inner' that is a DistributedDataParallel"):
        flatgrad.FlatGrad(nn.ModuleDict({"inner": ddp}))


def test_flatgrad_around_ddp_is_refused_at_wrap_time():
    """FlatGrad(DDP(m, gradient_as_bucket_view=True)): DDP's reducer insists that every
    .grad is its bucket view, which the routed layers' writes are not; refused at wrap time
    with the order that works."""
    run_ranks(_ddp_inside_worker, world_size=1)


def _schedule_free_freeze_worker(rank: int, world_size: int) -> None:
    schedulefree = pytest.importorskip("schedulefree")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    dp = flatgrad.replicate(flatgrad.FlatGrad(model, config=ROUTE_ALL))
    opt = flatgrad.ShardedOptimizer(dp, schedulefree.AdamWScheduleFree, lr=0.05, shard_by="element")
    opt.train()
    for step in range(2):
        if step == 1:
            model[0].requires_grad_(False)
        opt.zero_grad()
        dp(_batch(rank, step)).square().sum().backward()
        opt.step()
    with pytest.raises(
        ValueError, match=r"eval\(\) would leave the parameters frozen.*\['0.bias', '0.weight'\]"
    ):
        opt.eval()


def test_schedule_free_by_element_refuses_to_switch_with_a_parked_parameter():
    """Schedule-free's train()/eval() move every parameter it holds state for, a frozen one too; by element a
    frozen parameter's state is parked outside the shards, and eval() left it at the training point (5.8e-4
    from stock at the final eval()). Refused on every rank, naming shard_by='tensor', which is exact."""
    run_ranks(_schedule_free_freeze_worker, world_size=2)


def _freeze_worker(rank: int, world_size: int, case: str) -> None:
    """Parameters frozen and unfrozen between steps, against DDP(find_unused_parameters=
    True) + the plain optimizer, which skips a parameter without a gradient and keeps its
    state."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    ref = copy.deepcopy(model)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model, config=ROUTE_ALL), bucket_cap_mb=0.0002)
    ddp = DDP(ref, find_unused_parameters=True)
    if case == "unfreeze_into_a_new_group":  # progressive unfreezing, the first layer last
        for m in (model, ref):
            m[0].requires_grad_(False)
    cls, kwargs = (torch.optim.SGD, {"momentum": 0.9}) if case == "flip" else (torch.optim.AdamW, {})
    opt = flatgrad.ShardedOptimizer(
        dp, cls, [p for p in model.parameters() if p.requires_grad], lr=0.05, **kwargs
    )
    ref_opt = cls([p for p in ref.parameters() if p.requires_grad], lr=0.05, **kwargs)
    pair = Lockstep(model, dp, opt, ddp, ref_opt, loss=_sum_of_squares)
    for step in range(6):
        if case == "flip" and step in (2, 4):  # frozen at 2, trainable again at 4, state kept
            for m in (model, ref):
                m[2].requires_grad_(step == 4)
        if case == "unfreeze_into_a_new_group" and step == 3:
            for m, o in ((model, opt), (ref, ref_opt)):
                m[0].requires_grad_(True)
                o.add_param_group({"params": list(m[0].parameters()), "lr": 0.02})
        if case == "adam_flip" and step in (1, 2):
            for m in (model, ref):
                m[2].requires_grad_(step == 2)
            if step == 2:
                opt.zero_grad()
                dp(_batch(rank, step)).square().sum().backward()
                with pytest.raises(
                    ValueError,  # (the names by step count)
                    match=r"param group 0 would hold parameters with different step counts \(2: \['0.weight'",
                ):
                    opt.step()
                return
        pair.train_step(_batch(rank, step))
        pair.assert_params(**TOL)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", ["flip", "unfreeze_into_a_new_group", "adam_flip"])
def test_parameters_frozen_and_unfrozen_between_steps_equal_ddp(world_size, case):
    """SGD with momentum, a layer frozen for two steps and trainable again: its momentum is
    kept while frozen (parked) and the others step on, as DDP + SGD; AdamW with the first
    layer frozen, then unfrozen into a new param group (progressive unfreezing); an AdamW
    layer frozen and unfrozen inside its group refused on every rank (torch counts AdamW's
    steps per parameter, ShardedOptimizer per group), before anything moved."""
    run_ranks(_freeze_worker, case, world_size=world_size)


def _frozen_with_gradients_worker(rank: int, world_size: int, optimizer: str, when: str) -> None:
    """A layer frozen while it holds a gradient that is still to be averaged (accumulated under
    no_sync(), `when="micro-batches"`) or, reduce-scattered, still to be stepped (`when="before step"`),
    against DDP(find_unused_parameters=True) + the plain optimizer: DDP's fixed buckets average the
    frozen layer's local gradient at the synchronised backward, and a torch optimizer steps a frozen
    parameter that holds a gradient. Three steps; the layer stays frozen after the first."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    ref = copy.deepcopy(model)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model, config=ROUTE_ALL), bucket_cap_mb=0.0002)
    ddp = DDP(ref, find_unused_parameters=True)
    cls, kwargs = (torch.optim.AdamW, {}) if optimizer == "adamw" else (torch.optim.SGD, {"momentum": 0.9})
    ref_opt = cls(ref.parameters(), lr=0.05, **kwargs)
    if optimizer == "plain":
        opt: torch.optim.Optimizer = cls(model.parameters(), lr=0.05, **kwargs)
    else:
        shard_by = "tensor" if optimizer == "by tensor" else "element"
        opt = flatgrad.ShardedOptimizer(dp, cls, lr=0.05, shard_by=shard_by, **kwargs)
    for step in range(3):
        for net, o in ((dp, opt), (ddp, ref_opt)):
            o.zero_grad()
            with net.no_sync():
                net(_batch(rank, 2 * step)).square().sum().backward()
            if step == 0 and when == "micro-batches":
                net.module[0].requires_grad_(False) if net is ddp else model[0].requires_grad_(False)
            net(_batch(rank, 2 * step + 1)).square().sum().backward()
            if step == 0 and when == "before step":
                net.module[0].requires_grad_(False) if net is ddp else model[0].requires_grad_(False)
            o.step()
        if isinstance(opt, flatgrad.ShardedOptimizer):
            opt.wait_param_gather()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **TOL, msg=lambda m, n=name, s=step: f"{n} after step {s}: {m}")


@pytest.mark.parametrize(
    ("world_size", "optimizer", "when"),
    [
        (2, "plain", "micro-batches"),
        (3, "plain", "micro-batches"),
        (2, "by element", "micro-batches"),
        (3, "by element", "before step"),
        (2, "adamw", "before step"),
        (2, "by tensor", "micro-batches"),
    ],
)
def test_a_layer_frozen_while_its_gradient_is_in_flight_is_averaged_and_stepped_as_ddp(
    world_size, optimizer, when
):
    """Before, a layer frozen between a no_sync() micro-batch and the synchronised one lost its place in
    the buckets at once: its gradient stayed this rank's own (replicas apart by 0.014 after one SGD step),
    a ShardedOptimizer by element did not step it (0.049 from DDP's), one by tensor stepped the owner's
    local gradient; and by element a freeze between the synchronised backward and step() was refused.
    Now a parameter frozen while its slot's gradient is still to be averaged or stepped keeps the slot
    until then (`flatgrad._engine._keeps_frozen`)."""
    run_ranks(_frozen_with_gradients_worker, optimizer, when, world_size=world_size)


def _join_steps(dp, opt, rank: int, divide_initial: bool) -> None:  # noqa: ANN001
    """Uneven data (rank r runs 2 + r steps), two micro-batches a step (the first under
    no_sync), inside Join([dp, opt]) (a plain torch optimizer is no Joinable: Join([dp]))."""
    from torch.distributed.algorithms import Join, Joinable

    joinables = [dp, opt] if isinstance(opt, Joinable) else [dp]
    with Join(joinables, divide_by_initial_world_size=divide_initial):
        for step in range(2 + rank):
            opt.zero_grad()
            with dp.no_sync():
                dp(_tokens(rank, step, 1)).backward()
            dp(_tokens(rank, step)).backward()
            opt.step()


def _join_worker(rank: int, world_size: int, divide_initial: bool, overlap: bool, check_finite: bool) -> None:
    torch.manual_seed(0)
    model = _Net()
    ref = DDP(copy.deepcopy(model), find_unused_parameters=True)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    dp = flatgrad.replicate(flat, bucket_cap_mb=0.002, check_finite=check_finite)  # several buckets
    opt = flatgrad.ShardedOptimizer(
        dp, torch.optim.AdamW, lr=0.05, weight_decay=0.1, overlap_param_gather=overlap
    )
    _join_steps(dp, opt, rank, divide_initial)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1)
    _join_steps(ref, ref_opt, rank, divide_initial)
    opt.wait_param_gather()
    pair = Lockstep(model, dp, opt, ref, ref_opt)
    pair.assert_params(**TOL)
    # Every rank stepped its shards each step: the state of the last rank to join (the
    # only one stock's model takes at the end) continues.
    last = world_size - 1
    ref_opt.zero_grad()
    if rank != last:
        ref_opt.state.clear()  # (only the last rank's stock optimizer saw every step)
    opt.zero_grad()
    pair.backward(_tokens(rank, 9))
    opt.step()
    opt.wait_param_gather()
    if rank == last:
        ref_opt.step()
        pair.assert_params(**TOL, what="after the Join")


@pytest.mark.parametrize(
    ("world_size", "divide_initial", "overlap", "check_finite"),
    [(2, True, False, False), (3, True, True, False), (3, False, False, True), (2, False, True, True)],
)
def test_join_with_uneven_batches_equals_stock_ddp_adamw(world_size, divide_initial, overlap, check_finite):
    """Oracle: stock DDP + AdamW under the same Join (the ranks still training step, the
    last to join broadcasts its model at the end). A joined rank here gets the others'
    averages from dp's join hook and steps its shards with them, so its shards' state is
    the last joiner's stock optimizer state: the step after the Join equals that rank's."""
    run_ranks(_join_worker, divide_initial, overlap, check_finite, world_size=world_size, timeout=150)


def _skip_worker(rank: int, world_size: int) -> None:
    model, flat, dp, opt = _build(rank)
    pair = _with_stock(model, dp, opt)
    for step in range(2):  # in step: the same as stock
        pair.train_step(_tokens(rank, step))
    pair.assert_params(**TOL)
    with pytest.raises(
        RuntimeError,
        match=r"the ranks disagree on the round: rank \d runs the backward after [23] .*Join\(\[dp, opt\]\)",
    ):
        for step in range(2, 4):
            opt.zero_grad()
            if not (rank == 1 and step == 2):  # an empty batch on rank 1: no forward, no backward
                dp(_tokens(rank, step)).backward()
            opt.step()


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_that_skips_forward_and_backward_raises_on_every_rank(world_size):
    """Oracle: stock DDP's ranks raise too (here a gloo abort or a hang without the check).
    Rank 1 skips step 2's forward and backward and steps; its next backward pairs with the
    others' step-2 backward, and every rank raises there, naming the mismatch."""
    run_ranks(_skip_worker, world_size=world_size, timeout=90)


def _constructor_arguments_worker(rank: int, world_size: int, kwargs: dict[str, Any]) -> None:
    """Adagrad reads ``initial_accumulator_value`` from its constructor, not its groups (it
    fills ``state["sum"]`` with it): built from the groups alone, the inner optimizer would
    start from 0 (a 3e-2 difference after 6 steps). Against DDP + Adagrad with the same
    arguments: 3 steps, a state_dict round trip into a fresh ShardedOptimizer, 3 more; and a
    first layer frozen in a group of its own, unfrozen at step 2 (its fresh state is the
    constructor's accumulator, as stock's eager one is)."""
    model, ref, dp = _small(rank)
    ddp = DDP(ref, find_unused_parameters=True)  # (before the freeze: DDP syncs only what is trainable then)
    model[0].requires_grad_(False)
    ref[0].requires_grad_(False)
    groups = lambda m: [{"params": list(m[0].parameters())}, {"params": list(m[2].parameters())}]  # noqa: E731
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.Adagrad, groups(model), lr=0.1, **kwargs)
    ref_opt = torch.optim.Adagrad(groups(ref), lr=0.1, **kwargs)
    pair = Lockstep(model, dp, opt, ddp, ref_opt, loss=_sum_of_squares)
    for step in range(3):
        if step == 2:
            model[0].requires_grad_(True)
            ref[0].requires_grad_(True)
        pair.train_step(_batch(rank, step))
        pair.assert_params(**TOL, what=f"step {step}")
    saved = opt.state_dict()
    model2, _, dp2 = _small(rank)
    with torch.no_grad():
        for p, q in zip(model2.parameters(), model.parameters()):
            p.copy_(q)
    opt2 = flatgrad.ShardedOptimizer(dp2, torch.optim.Adagrad, groups(model2), lr=0.1, **kwargs)
    opt2.load_state_dict(saved)
    pair2 = Lockstep(model2, dp2, opt2, ddp, ref_opt, loss=_sum_of_squares)
    for step in range(3, 6):
        pair2.train_step(_batch(rank, step))
        pair2.assert_params(**TOL, what=f"resumed, step {step}")


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial_accumulator_value": 0.1},
        {"initial_accumulator_value": 0.1, "foreach": True},
        {"initial_accumulator_value": 0.1, "fused": True},
        {"initial_accumulator_value": 0.25, "lr_decay": 0.01, "weight_decay": 0.1, "maximize": True},
    ],
    ids=["plain", "foreach", "fused", "decays_maximize"],
)
def test_constructor_arguments_outside_the_groups_reach_the_inner_optimizer(world_size, kwargs):
    run_ranks(_constructor_arguments_worker, kwargs, world_size=world_size)


def _differentiable_worker(rank: int, world_size: int) -> None:
    model, _, dp = _small(rank)
    weight = model[0].weight
    for groups in ([{"params": list(model.parameters())}], [{"params": [weight], "differentiable": True}]):
        kwargs = {"differentiable": True} if len(groups) == 1 else {}
        with pytest.raises(ValueError, match=r"cannot step Adam with differentiable=True \(param group 0\)"):
            flatgrad.ShardedOptimizer(dp, torch.optim.Adam, groups, lr=0.1, **kwargs)
    assert model[0].weight is weight and weight.untyped_storage().size() == weight.numel() * 8  # not moved


def test_differentiable_steps_are_refused_before_anything_moves():
    """torch refuses a differentiable step on leaf parameters (at the first step); ours
    refuses at construction, on every rank, and leaves the model as it was."""
    run_ranks(_differentiable_worker)


def _join_refusal_worker(rank: int, world_size: int) -> None:
    """torch's test_zero_join puts the optimizer alone in a Join: refused inside (a joined
    rank could not follow), and the refusal ends with the block: later steps outside any
    Join, and a Join([dp, opt]) after it, step as stock."""
    from torch.distributed.algorithms import Join

    model, ref, dp = _small(rank)
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.SGD, lr=0.1, momentum=0.9)
    ddp = DDP(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    pair = Lockstep(model, dp, opt, ddp, ref_opt, loss=_sum_of_squares)
    with pytest.raises(ValueError, match="needs its model first in the same Join"), Join([opt]):
        pair.train_step(_batch(rank, 0))
    ref_opt.zero_grad()
    with Join([opt]):  # (torch's test_zero_join form: a body that never steps leaves nothing behind)
        pass
    for step in range(1, 3):
        pair.train_step(_batch(rank, step))
    with Join([dp, opt]), Join([ddp]):
        pair.train_step(_batch(rank, 3))
    pair.train_step(_batch(rank, 4))
    pair.assert_params(**TOL)


def test_a_join_that_refused_leaves_the_optimizer_usable():
    run_ranks(_join_refusal_worker)


def _inner_scheduler_worker(rank: int, world_size: int) -> None:
    """An LR scheduler built on ``opt.optimizer`` (where users of other ZeRO wrappers put
    it) takes effect as on the plain optimizer, by element and by tensor; so does a hand
    edit of the inner groups; an option set on both sides to different values is refused on
    every rank. Oracle: DDP + AdamW with the same scheduler, float64, TOL (only the
    gradient average's summation order differs)."""
    for shard_by in ("element", "tensor"):
        model, ref, dp = _small(rank)
        opt = flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, lr=0.1, shard_by=shard_by)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
        schedulers = [
            torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0 / (step + 1))
            for o in (opt.optimizer, ref_opt)
        ]
        pair = Lockstep(model, dp, opt, DDP(ref), ref_opt, loss=_sum_of_squares)
        for step in range(4):
            pair.train_step(_batch(rank, step))
            for scheduler in schedulers:
                scheduler.step()
            if step == 1:
                for o in (opt.optimizer, ref_opt):
                    o.param_groups[0]["weight_decay"] = 0.3
        pair.assert_params(**TOL)
        assert opt.optimizer.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
        opt.param_groups[0]["lr"], opt.optimizer.param_groups[0]["lr"] = 0.5, 0.25
        with pytest.raises(ValueError, match="option 'lr' of param group 0 was set both on opt.param_groups"):
            pair.train_step(_batch(rank, 9))


def test_a_scheduler_on_the_inner_optimizer_takes_effect_or_is_refused():
    run_ranks(_inner_scheduler_worker)


class _TwoDtypes(nn.Module):
    """A float64 branch and layer and a float32 layer with the branch's shapes (slots at the
    same offsets of two buffers), and an empty parameter nothing reads (a device marker)."""

    def __init__(self) -> None:
        super().__init__()
        self.branch = nn.Linear(8, 8).double()
        self.a = nn.Linear(8, 8).double()
        self.b = nn.Linear(8, 8)
        self.marker = nn.Parameter(torch.empty(0))

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use_branch:
            h = self.branch(h)
        return self.b(h.float()).double().square().mean()


def _input(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    if isinstance(model, _TwoDtypes):
        return torch.randn(
            4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * rank + step)
        )
    return _tokens(rank, step)


# A parameter no rank used in a step (the branch, skipped on both ranks in step 1): stock DDP
# (find_unused_parameters=True) leaves its `.grad` None and the optimizer leaves it alone.
_SGD_MOMENTUM = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}
_UNUSED_CASES = {
    "adamw_own_group": (_Net, torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}, True, None),
    "adagrad_own_group": (
        _Net,
        torch.optim.Adagrad,
        {"lr": 0.05, "lr_decay": 0.1, "weight_decay": 0.1},
        True,
        None,
    ),
    "sgd_momentum_one_group": (_Net, torch.optim.SGD, _SGD_MOMENTUM, False, None),
    "sgd_one_group": (_Net, torch.optim.SGD, {"lr": 0.1, "weight_decay": 0.1}, False, None),
    "two_dtypes_sgd_momentum_one_group": (_TwoDtypes, torch.optim.SGD, _SGD_MOMENTUM, False, None),
    "empty_parameter_adamw": (_TwoDtypes, torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}, True, None),
    "adamw_one_group": (
        _Net,
        torch.optim.AdamW,
        {"lr": 0.05, "weight_decay": 0.1},
        False,
        "keeps a step count",
    ),
    "sgd_dampening_one_group": (
        _Net,
        torch.optim.SGD,
        {"lr": 0.1, "momentum": 0.9, "dampening": 0.5},
        False,
        "keeps",
    ),
}


def _groups(model: nn.Module, own_group: bool) -> list[dict[str, Any]]:
    branch = [p for n, p in model.named_parameters() if n.startswith("branch.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("branch.") and p.requires_grad]
    return [{"params": rest}, {"params": branch}] if own_group else [{"params": rest + branch}]


def _unused_worker(rank: int, world_size: int, case: str) -> None:
    build, optimizer_class, options, own_group, refusal = _UNUSED_CASES[case]
    torch.manual_seed(0)
    model = build()
    ref = DDP(copy.deepcopy(model), find_unused_parameters=True)
    ref_opt = optimizer_class(_groups(ref.module, own_group), **options)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model, config=ROUTE_ALL), bucket_cap_mb=0.002)
    opt = flatgrad.ShardedOptimizer(dp, optimizer_class, _groups(model, own_group), **options)
    pair = Lockstep(model, dp, opt, ref, ref_opt)
    for step in range(4):
        use_branch = step != 1 and not (rank == 1 and step == 2)  # (step 2: used on rank 0 only)
        pair.zero_grad()
        pair.backward(_input(model, rank, step), use_branch)
        if refusal is not None and step == 1:
            before = [p.detach().clone() for p in model.parameters()]
            with pytest.raises(ValueError, match=refusal):
                opt.step()
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))  # nothing moved
            return
        pair.step()
        pair.assert_params(**TOL, what=f"step {step}")


@pytest.mark.parametrize("case", list(_UNUSED_CASES))
def test_a_parameter_no_rank_used_is_not_stepped_as_stock(case):
    """Skipped whole where its group has no other gradient (any class), left as it was by
    element where the class allows it (no scalar state, zeroed state steps as none), else
    refused on every rank before anything moves."""
    run_ranks(_unused_worker, case)


def _by_hand_worker(rank: int, world_size: int, refused: bool) -> None:
    torch.manual_seed(0)
    model = _Net()
    oracle = copy.deepcopy(model)
    optimizer_class = torch.optim.AdamW if refused else torch.optim.SGD
    options = {"lr": 0.05, "weight_decay": 0.1, **({} if refused else {"momentum": 0.9})}
    ref_opt = optimizer_class([p for p in oracle.parameters() if p.requires_grad], **options)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model, config=ROUTE_ALL), bucket_cap_mb=0.002)
    opt = flatgrad.ShardedOptimizer(dp, optimizer_class, **options)
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        generator = torch.Generator().manual_seed(step)  # (the same gradients on every rank)
        for (name, param), ref in zip(model.named_parameters(), oracle.parameters()):
            grad = torch.randn(param.shape, dtype=param.dtype, generator=generator)
            # the branch has none on every rank in step 1 (on rank 1 only where refused)
            if param.requires_grad and not (
                name.startswith("branch.") and step == 1 and (rank == 1 or not refused)
            ):
                param.grad, ref.grad = grad.clone(), grad.clone()
        if refused and step == 1:
            with pytest.raises(ValueError, match=r"\['branch.weight', 'branch.bias'\] of param group 0"):
                opt.step()  # (rank 0 has the branch's gradients: it raises as rank 1 does)
            return
        opt.step()
        ref_opt.step()
        assert_params_like(model, oracle, **TOL, what=f"step {step}")


@pytest.mark.parametrize("refused", [False, True], ids=["sgd_momentum", "adamw_refused"])
def test_gradients_assigned_by_hand_skip_a_parameter_without_one_and_refuse_on_every_rank(refused):
    """Gradients assigned by hand (no synchronised backward): a parameter without one is left
    as a plain optimizer leaves it; where the class cannot, every rank raises, also one that
    has the gradient."""
    run_ranks(_by_hand_worker, refused)


class _BackwardInside(nn.Module):
    """Runs its loss's backward inside its forward (as Lightning's manual_backward does)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).double()

    def forward(self, x: torch.Tensor) -> None:
        self.net(x).square().mean().backward()


def _backward_inside_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = flatgrad.replicate(flatgrad.FlatGrad(_BackwardInside()))
    opt = flatgrad.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    model(torch.randn(4, 6, dtype=torch.float64))  # averaged, reduce-scattered
    with pytest.raises(RuntimeError, match="reached no output of the model"):
        model(torch.randn(4, 6, dtype=torch.float64))
    opt.zero_grad()
    model(torch.randn(4, 6, dtype=torch.float64))  # (after zero_grad: fine)
    opt.step()


def test_a_second_backward_opening_inside_the_forward_onto_scattered_gradients_is_refused():
    """By element, a second averaging backward before zero_grad that reaches no output of the model (run
    inside its forward) opens from a parameter's hook, after that parameter's gradient landed on the
    reduce-scattered ones: 4.2e-2 off stock DDP silently. Refused on every rank now; flatgrad's Lightning
    strategies set the averages aside before each backward (test_lightning's by_hand case: equal)."""
    run_ranks(_backward_inside_worker, timeout=90)


def _replaced_grad_worker(rank: int, world_size: int, shard_by: str) -> None:
    torch.manual_seed(0)
    model = _Net()
    dp = flatgrad.replicate(flatgrad.FlatGrad(model, config=ROUTE_ALL), bucket_cap_mb=0.002)
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.SGD, lr=0.5, momentum=0.9, shard_by=shard_by)
    sgd = stock(model, torch.optim.SGD, {"find_unused_parameters": True}, lr=0.5, momentum=0.9)
    pair = Lockstep(model, dp, opt, *sgd)
    ref = pair.ref
    for step in range(3):
        pair.zero_grad()
        pair.backward(_tokens(rank, step))
        surgery = torch.full_like(model.fc.weight, 0.1 * (step + 1))  # (the same on every rank)
        model.fc.weight.grad, ref.module.fc.weight.grad = surgery.clone(), surgery.clone()
        if step == 2:  # clipped: the replacement counts in the norm
            norm = opt.clip_grad_norm_(0.5)
            torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5), **TOL)
        pair.step()
        pair.assert_params(**TOL)


@pytest.mark.parametrize("shard_by", ["element", "tensor"])
def test_a_gradient_replaced_by_hand_after_the_backward_equals_stock(shard_by: str) -> None:
    """Gradient surgery after a synchronised backward (``p.grad = g``, the same g on every rank), stepped and
    clipped: as stock DDP + SGD. By element the step took the reduce-scattered average in the slot and
    ignored the replacement (0.25 off with SGD, silently); now it is copied into its slot first."""
    run_ranks(_replaced_grad_worker, shard_by, timeout=90)


def _replaced_grad_scaled_worker(rank: int, world_size: int, shard_by: str, when: str) -> None:
    torch.manual_seed(0)
    model = _Net()
    dp = flatgrad.replicate(flatgrad.FlatGrad(model, config=ROUTE_ALL), bucket_cap_mb=0.002)
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.SGD, lr=0.5, momentum=0.9, shard_by=shard_by)
    ref, ref_opt = stock(model, torch.optim.SGD, {"find_unused_parameters": True}, lr=0.5, momentum=0.9)
    scaler, ref_scaler = flatgrad.GradScaler("cpu", init_scale=16.0), torch.amp.GradScaler("cpu", 16.0)
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        scaler.scale(dp(_tokens(rank, step))).backward()
        ref_scaler.scale(ref(_tokens(rank, step))).backward()
        surgery = torch.full_like(model.fc.weight, 0.1 * (step + 1))  # (the same on every rank)
        if when == "before_unscale":  # (in scaled units: torch's unscale_ unscales it)
            model.fc.weight.grad, ref.module.fc.weight.grad = surgery * 16.0, surgery * 16.0
        scaler.unscale_(opt)
        ref_scaler.unscale_(ref_opt)
        if when == "after_unscale":  # (as it is: the step takes it)
            model.fc.weight.grad, ref.module.fc.weight.grad = surgery.clone(), surgery.clone()
        for one, opt_ in ((scaler, opt), (ref_scaler, ref_opt)):
            one.step(opt_)
            one.update()
        assert_params_like(model, ref.module, **TOL)


@pytest.mark.parametrize("when", ["before_unscale", "after_unscale"])
@pytest.mark.parametrize("shard_by", ["element", "tensor"])
def test_a_gradient_replaced_by_hand_under_a_loss_scaler_equals_torchs(shard_by: str, when: str) -> None:
    """Gradient surgery under `flatgrad.GradScaler` as under torch's with stock DDP + SGD: a `.grad` replaced
    before ``unscale_`` is unscaled with the rest, one replaced after it is stepped as it is. By element the
    replacement before ``unscale_`` was taken into its slot at the step only, after the shards were
    unscaled: stepped 16 times too large (the loss scale), silently."""
    run_ranks(_replaced_grad_scaled_worker, shard_by, when, timeout=90)


def _edited_grad_worker(rank: int, world_size: int, foreach: bool) -> None:
    torch.manual_seed(0)
    model = _Net()
    dp = flatgrad.replicate(flatgrad.FlatGrad(model, config=ROUTE_ALL), bucket_cap_mb=0.002)
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.SGD, lr=0.5, momentum=0.9)
    pair = Lockstep(
        model, dp, opt, *stock(model, torch.optim.SGD, {"find_unused_parameters": True}, lr=0.5, momentum=0.9)
    )
    for step in range(3):
        pair.zero_grad()
        pair.backward(_tokens(rank, step))
        for net in (model, pair.ref.module):  # clip by value, train some rows only, scale
            torch.nn.utils.clip_grad_value_(net.parameters(), 0.02, foreach=foreach)
            net.emb.weight.grad[:5] = 0
            net.fc.weight.grad.mul_(0.5)
            torch._foreach_add_([net.fc.bias.grad], [torch.full_like(net.fc.bias, 0.01)])
        for read in (  # reading another gradient's values (another shard range) stays refused
            lambda: torch.zeros_like(model.fc.bias).add_(model.fc.bias.grad),
            lambda: model.fc.bias.grad.add_(model.norm.bias.grad),
        ):
            with pytest.raises(RuntimeError, match="reduce-scattered"):
                read()
        pair.step()
        pair.assert_params(**TOL)


@pytest.mark.parametrize("foreach", [False, True])
def test_gradients_edited_in_place_after_a_sharded_backward_equal_stock(foreach: bool) -> None:
    """By element, between the synchronised backward and the step: ``clip_grad_value_``, rows zeroed (training
    new tokens only), a gradient scaled or shifted in place, as stock DDP + SGD (they were refused: each edits
    element by element, so what this rank's shard holds after it is the whole average's edit). An op that
    reads another `.grad` stays refused."""
    run_ranks(_edited_grad_worker, foreach, timeout=90)


def _unfrozen_for_the_backward_worker(rank: int, world_size: int, shard_by: str, built: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    ref, ref_opt = stock(model, torch.optim.SGD, {"find_unused_parameters": True}, lr=0.5, momentum=0.9)
    if built == "frozen":  # (stock's DDP was built with it trainable: it averages it)
        model[2].requires_grad_(False)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model, config=ROUTE_ALL))
    sgd = {"lr": 0.5, "momentum": 0.9}
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.SGD, model.parameters(), shard_by=shard_by, **sgd)
    model[2].requires_grad_(False)
    ref.module[2].requires_grad_(False)
    for step in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        for layer in (model[2], ref.module[2]):
            layer.requires_grad_(True)
        x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * step + rank))
        dp(x).square().sum().backward()
        ref(x).square().sum().backward()
        for layer in (model[2], ref.module[2]):
            layer.requires_grad_(False)
        if shard_by == "tensor" and built == "frozen":
            with pytest.raises(
                RuntimeError, match=r"frozen when the ShardedOptimizer \(by tensor\) was built"
            ):
                opt.step()
            return
        opt.step()
        ref_opt.step()
        assert_params_like(model, ref.module, **TOL)


@pytest.mark.parametrize("built", ["frozen", "trainable"])
@pytest.mark.parametrize("shard_by", ["element", "tensor"])
def test_a_frozen_layer_unfrozen_for_the_backward_only(shard_by: str, built: str) -> None:
    """A frozen layer (frozen when the ShardedOptimizer was built, or after) unfrozen for each backward and
    frozen again before the step (a torch optimizer steps it: it has a `.grad`). By element: as DDP + SGD
    averaging it (it crashed in an AccumulateGrad hook of the frozen parameter the reduce-scattered layout
    keeps). By tensor: as stock where it was trainable at construction; frozen then, it has no place in the
    flat parameter buffers: refused at the step (it was silently left unstepped)."""
    run_ranks(_unfrozen_for_the_backward_worker, shard_by, built, timeout=90)


def _added_after_a_freeze_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    ref, ref_opt = stock(model, torch.optim.SGD, {"find_unused_parameters": True}, lr=0.1, momentum=0.9)
    ref_opt.param_groups[0]["params"] = list(ref.module[:4].parameters())  # (the head in no group, as ours)
    dp = flatgrad.replicate(model)
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.SGD, model[:4].parameters(), lr=0.1, momentum=0.9)
    for layer in (model[4], ref.module[4]):  # frozen after building, trained later in a group of its own
        layer.requires_grad_(False)
    for step in range(4):
        if step == 2:
            for layer, optimizer in ((model[4], opt), (ref.module[4], ref_opt)):
                layer.requires_grad_(True)
                optimizer.add_param_group({"params": list(layer.parameters()), "lr": 0.02})
        x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * step + rank))
        Lockstep(model, dp, opt, ref, ref_opt, loss=lambda out: out.square().sum()).train_step(x)
        assert_params_like(model, ref.module, **TOL)


def test_a_layer_outside_the_groups_frozen_then_added_in_a_group_of_its_own_equals_stock():
    """By element: a layer in no group, frozen after construction, unfrozen and added with `add_param_group`:
    the relayout at the step took the new group's empty state for a stepped one's and refused it as a
    checkpoint that "does not fit" (by tensor it trained exactly). Now a state with nothing in it is a group
    never stepped, and it trains as DDP + SGD."""
    run_ranks(_added_after_a_freeze_worker, timeout=90)
