"""Mixed precision across ranks: bfloat16 parameters with float32 main grads under
`DataParallel` and `ShardedOptimizer` (float32 master shards), against a written-out
reference: each micro-batch's gradient alone, in float32 (a one-process FlatGrad's main
grads after that micro-batch only: `test_main_grad` checks those against float64 oracles),
summed in float32 over the rank's micro-batches, averaged over the ranks in float32
(divided, then summed, as DDP does), clipped in float32 by torch, stepped by the torch
optimizer on float32 master copies of the parameters, cast back to bfloat16."""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from test_main_grad import MAIN, _batches, _model
from torch import nn

import flatgrad
from flatgrad import replicate_state

MICRO, STEPS, MAX_NORM = 4, 3, 0.5
STEPS_SCALED = 8
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.5, "momentum": 0.9, "weight_decay": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
}


def _torch_clip(masters: list[torch.Tensor]) -> None:
    torch.nn.utils.clip_grad_norm_(masters, MAX_NORM)


def reference_step(
    flat: flatgrad.FlatGrad,
    masters: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    batches: list[torch.Tensor],
    clip: Callable[[list[torch.Tensor]], object],
) -> None:
    """One step written out: each micro-batch's main grad alone, summed in float32, averaged
    over the ranks in float32 (divided, then summed, as DDP does), clipped (`clip` of the
    masters, whose `.grad` holds the averages), the torch optimizer on the float32 masters,
    cast back into `flat`'s parameters."""
    sums = [torch.zeros_like(m) for m in masters]
    for tokens in batches:
        flat.zero_grad()
        flat(tokens).backward()
        for total, param in zip(sums, flat.parameters()):
            total += flat.main_grad(param)
    for master, total in zip(masters, sums):
        total /= dist.get_world_size()
        dist.all_reduce(total)
        master.grad = total
    clip(masters)
    optimizer.step()
    with torch.no_grad():
        for param, master in zip(flat.parameters(), masters):
            param.copy_(master)


def _sharded_worker(rank: int, world_size: int, name: str, device: str = "cpu") -> None:
    optimizer_class, options = OPTIMIZERS[name]
    if device == "cuda":
        torch.cuda.set_device(rank)
    model = _model().to(device)
    reference = copy.deepcopy(model)
    masters = [p.detach().float().requires_grad_() for p in reference.parameters()]
    ref_opt = optimizer_class(masters, **options)
    ref_flat = flatgrad.FlatGrad(reference, config=MAIN)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model, config=MAIN), bucket_cap_mb=0.01)
    # (3 ranks: with the parameter all-gathers left in flight until the next forward)
    opt = flatgrad.ShardedOptimizer(dp, optimizer_class, overlap_param_gather=world_size == 3, **options)
    batches = [tokens.to(device) for tokens in _batches(seed=10 + rank)]
    initial = [p.detach().clone() for p in model.parameters()]
    for step in range(STEPS):
        micro = batches[step * MICRO : (step + 1) * MICRO]
        with dp.no_sync():
            for tokens in micro[:-1]:
                dp(tokens).backward()
        dp(micro[-1]).backward()
        opt.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()
        reference_step(ref_flat, masters, ref_opt, micro, _torch_clip)
    opt.wait_param_gather()  # (read outside a forward)
    for (label, param), ref, start in zip(model.named_parameters(), reference.parameters(), initial):
        assert param.dtype == torch.bfloat16 and param.grad is None, label
        assert not torch.equal(param, start), f"{label} never moved"
        # (an element near zero, passed by a step of lr = 1e-2, has no meaningful ulp of its own)
        ulp = torch.finfo(torch.bfloat16).eps * ref.float().abs().clamp_min(1e-3)
        off = (param.float() - ref.float()).abs()
        assert (off == 0).float().mean() >= 0.99, (label, (off == 0).float().mean())
        assert bool((off <= 2 * ulp).all().item()), (label, float((off / ulp).max()))


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sharded_optimizer_steps_float32_masters_like_the_reference(world_size, name):
    run_ranks(_sharded_worker, name, world_size=world_size)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_on_cuda_over_nccl_the_masters_step_like_the_reference(name):
    """World size 1 over NCCL (one GPU): the routed GEMMs accumulate into the main grads
    with ``out_dtype`` where the probe allows it, the buckets reduce-scatter on NCCL's
    stream, the masters step and the bfloat16 all-gather runs on the device."""
    run_ranks(_sharded_worker, name, "cuda", world_size=1, backend="nccl")


def _data_parallel_worker(rank: int, world_size: int) -> None:
    """DataParallel alone: the float32 main grads average in float32 buckets (several per
    model: bucket_cap_mb is tiny), micro-batches under no_sync, one branch unused on rank 1."""
    model = _model()
    reference = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model, config=MAIN)
    dp = flatgrad.replicate(flat, bucket_cap_mb=0.01, check_finite=True)
    ref_flat = flatgrad.FlatGrad(reference, config=MAIN)
    batches = _batches(seed=10 + rank)
    assert len(replicate_state(dp).buckets) > 1 and {b.dtype for b in replicate_state(dp).buckets} == {
        torch.float32
    }
    for step in range(2):
        flat.zero_grad()
        ref_flat.zero_grad()
        micro = batches[step * MICRO : (step + 1) * MICRO]
        with dp.no_sync():
            for tokens in micro[:-1]:
                dp(tokens).backward()
        dp(micro[-1]).backward()
        for tokens in micro:
            ref_flat(tokens).backward()
        ref_flat.all_reduce_grads()
        for (label, param), ref in zip(model.named_parameters(), reference.parameters()):
            assert param.grad is None, label
            torch.testing.assert_close(flat.main_grad(param), ref_flat.main_grad(ref), rtol=1e-6, atol=1e-8)


def _check_finite_worker(rank: int, world_size: int) -> None:
    """check_finite with main grads: a NaN made on rank 1 only, in a main grad (whose
    `.grad` stays None), makes both ranks raise, rank 1 naming the parameter."""
    model = _model()
    dp = flatgrad.replicate(flatgrad.FlatGrad(model, config=MAIN), check_finite=True)
    tokens = _batches(seed=10 + rank)[0]
    dp(tokens).backward()  # finite: averaged as usual
    dp.zero_grad()
    expected = r"on rank 1 \(this rank\) in \['norm.bias'\]" if rank == 1 else r"on rank\(s\) \[1\]"
    poison = float("nan") if rank == 1 else 0.0
    with pytest.raises(RuntimeError, match=r"check_finite=True\): a non-finite gradient .* " + expected):
        (dp(tokens) + model.norm.bias.float().sum() * poison).backward()


@pytest.mark.distributed
def test_check_finite_names_a_non_finite_main_grad():
    run_ranks(_check_finite_worker)


@pytest.mark.distributed
def test_data_parallel_averages_main_grads_in_float32():
    run_ranks(_data_parallel_worker, world_size=2)


def _setup_sharded(
    overlap: bool = False, negate: bool = False
) -> tuple[nn.Module, flatgrad.ReplicateModule, flatgrad.ShardedOptimizer]:
    model = _model()
    if negate:  # another starting point, far from every checkpoint of the usual one
        with torch.no_grad():
            for param in model.parameters():
                param.neg_()
    dp = flatgrad.replicate(flatgrad.FlatGrad(model, config=MAIN), bucket_cap_mb=0.01)
    opt = flatgrad.ShardedOptimizer(
        dp, torch.optim.AdamW, lr=1e-3, weight_decay=0.1, overlap_param_gather=overlap
    )
    return model, dp, opt


def _train(dp: flatgrad.ReplicateModule, opt: flatgrad.ShardedOptimizer, rank: int, steps: range) -> None:
    batches = _batches(seed=30 + rank)
    for step in steps:
        opt.zero_grad()
        dp(batches[step]).backward()
        opt.clip_grad_norm_(MAX_NORM)
        opt.step()


def _checkpoint_worker(rank: int, world_size: int, tmp: str) -> None:
    model, dp, opt = _setup_sharded()
    _train(dp, opt, rank, range(3))
    dcp.save({"model": dp, "optim": opt}, checkpoint_id=f"{tmp}/ckpt")
    saved = opt.state_dict()["state"]["up.weight"]
    assert saved["master"].dtype == torch.float32  # (a ShardedTensor of this rank's master elements)
    _train(dp, opt, rank, range(3, 6))
    final = [p.detach().clone() for p in model.parameters()]

    model, dp, opt = _setup_sharded()
    _train(dp, opt, rank, range(1))  # state the load must replace
    dcp.load({"model": dp, "optim": opt}, checkpoint_id=f"{tmp}/ckpt")
    _train(dp, opt, rank, range(3, 6))
    for (label, param), expected in zip(model.named_parameters(), final):
        assert torch.equal(param, expected), label

    # Without the masters (the model's bfloat16 weights loaded alone, masters rebuilt from
    # them) the run is another one: the check above depends on them.
    # The masters take the loaded weights (not those they were made from): one step (lr
    # 1e-3) moves each weight by about 1e-3 from what was loaded, far from the negated start.
    model, dp, opt = _setup_sharded(negate=True)
    fresh = [p.detach().clone() for p in model.parameters()]
    dcp.load({"model": dp}, checkpoint_id=f"{tmp}/ckpt")
    loaded = [p.detach().clone() for p in model.parameters()]
    assert max(float((a - b).abs().max()) for a, b in zip(fresh, loaded)) > 1e-2
    _train(dp, opt, rank, range(3, 4))
    assert max(float((p - b).abs().max()) for p, b in zip(model.parameters(), loaded)) < 2e-3
    _train(dp, opt, rank, range(4, 6))
    assert any(not torch.equal(p, e) for p, e in zip(model.parameters(), final))


@pytest.mark.distributed
def test_masters_and_optimizer_state_resume_bit_identically(tmp_path):
    run_ranks(_checkpoint_worker, str(tmp_path), world_size=2, timeout=180)


def _memory_worker(rank: int, world_size: int) -> None:
    """Every tensor alive in the process after two steps, less those alive before the model
    was built, per parameter: bfloat16 parameters (2 bytes), float32 main grads (4), and
    this rank's half of the float32 masters and AdamW's two moments (12 / 2)."""
    gc.collect()
    before = _live_storages()
    model, dp, opt = _setup_sharded(overlap=True)
    _train(dp, opt, rank, range(2))
    opt.zero_grad()
    opt.wait_param_gather()
    gc.collect()
    held = sum(nbytes for key, nbytes in _live_storages().items() if key not in before)
    numel = sum(p.numel() for p in model.parameters())
    per_parameter = held / numel
    assert per_parameter <= 1.1 * (2 + 4 + 12 / world_size), per_parameter
    assert per_parameter >= 2 + 4 + 12 / world_size - 0.5, per_parameter  # (the count sees them all)


def _live_storages() -> dict[int, int]:
    found = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
            storage = obj.untyped_storage()
            found[storage.data_ptr()] = storage.nbytes()
    return found


@pytest.mark.distributed
def test_memory_per_parameter_is_params_main_grads_and_half_of_masters_and_state():
    run_ranks(_memory_worker, world_size=2)


def _refusals_worker(rank: int, world_size: int) -> None:
    model, dp, opt = _setup_sharded()
    dp(_batches()[0]).backward()
    with pytest.raises(RuntimeError, match="reduce-scattered"):
        opt.dp.module.main_grad(model.up.weight).sum()  # averaged in this rank's shards only
    with pytest.raises(RuntimeError, match="reduce-scattered"):
        dp.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match="cannot add to them locally"), dp.no_sync():
        dp(_batches()[1]).backward()
    opt.zero_grad()
    assert float(dp.main_grad(model.up.weight).abs().sum()) == 0.0  # plain again

    mixed = _model()
    mixed.norm.float()  # float32 parameters next to bfloat16 ones in the float32 buffer
    mixed_dp = flatgrad.replicate(flatgrad.FlatGrad(mixed, config=MAIN))
    with pytest.raises(ValueError, match="share the torch.float32 gradient buffer"):
        flatgrad.ShardedOptimizer(mixed_dp, torch.optim.AdamW, lr=1e-3)


@pytest.mark.distributed
def test_reduce_scattered_main_grads_and_mixed_dtypes_are_refused():
    run_ranks(_refusals_worker, world_size=2)


def _scaler_worker(rank: int, world_size: int) -> None:
    """float16 parameters, main grads, ShardedOptimizer and flatgrad.GradScaler, against the
    written-out reference with the scaler's own scale each step: the scaled float16
    backward per micro-batch, float32 sums, an overflow on any rank skipping the step on
    every rank, unscaled, averaged, stepped on float32 masters (equal to the last bit:
    nothing but the order of exact power-of-two scalings differs). The first steps
    overflow everywhere (a scale of 2**24), step 4 on rank 1 only (an inf in its loss)."""
    model = _model(torch.float16)
    reference = copy.deepcopy(model)
    masters = [p.detach().float().requires_grad_() for p in reference.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1)
    ref_flat = flatgrad.FlatGrad(reference, config=MAIN)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model, config=MAIN), bucket_cap_mb=0.01)
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    scaler = flatgrad.GradScaler("cpu", init_scale=2.0**24, growth_interval=2)
    batches = _batches(seed=50 + rank)
    skipped, expected, norms = [], [], []
    for step in range(STEPS_SCALED):
        scale = scaler.get_scale()
        poison = float("inf") if (step == 4 and rank == 1) else 1.0
        micro = batches[step * 2 : step * 2 + 2]
        before = [p.detach().clone() for p in model.parameters()]
        with dp.no_sync():
            scaler.scale(dp(micro[0])).backward()
        scaler.scale(dp(micro[1]) * poison).backward()
        scaler.unscale_(opt)
        # The clip reads the unscaled shards (a limit no norm reaches: the clip's own
        # round-off is checked above, and the parameters must stay bit-identical here).
        norms.append(float(opt.clip_grad_norm_(1e9)))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        skipped.append(all(torch.equal(p, b) for p, b in zip(model.parameters(), before)))

        sums = [torch.zeros_like(m) for m in masters]
        for index, tokens in enumerate(micro):
            ref_flat.zero_grad()
            loss = ref_flat(tokens) * (poison if index == 1 else 1.0)
            (loss * scale).backward()
            for total, param in zip(sums, reference.parameters()):
                total += ref_flat.main_grad(param)
        found = torch.tensor(float(any(not bool(t.isfinite().all()) for t in sums)))
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        expected.append(bool(found))
        if not found:
            for master, total in zip(masters, sums):
                master.grad = total / scale / world_size
                dist.all_reduce(master.grad)
            expected_norm = torch.linalg.vector_norm(torch.stack([m.grad.norm() for m in masters]))
            assert norms[-1] == pytest.approx(float(expected_norm), rel=1e-5), (step, norms[-1])
            ref_opt.step()
            with torch.no_grad():
                for param, master in zip(reference.parameters(), masters):
                    param.copy_(master)
    assert skipped == expected and skipped[0] and skipped[4] and skipped.count(False) >= 2, skipped
    assert scaler.get_scale() < 2.0**24
    for (label, param), ref in zip(model.named_parameters(), reference.parameters()):
        assert param.dtype == torch.float16, label
        assert torch.equal(param, ref), label


@pytest.mark.distributed
def test_grad_scaler_skips_overflow_steps_on_every_rank_and_unscales_main_grads():
    run_ranks(_scaler_worker, world_size=2)


def _torch_scaler_worker(rank: int, world_size: int) -> None:
    model, dp, opt = _setup_sharded()
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(dp(_batches()[rank])).backward()
    with pytest.raises(TypeError, match="use flatgrad.GradScaler"):
        scaler.step(opt)


@pytest.mark.distributed
def test_torch_grad_scaler_on_a_sharded_optimizer_says_to_use_flatgrad_s():
    run_ranks(_torch_scaler_worker, world_size=2)
