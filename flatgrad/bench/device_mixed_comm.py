"""`ShardedOptimizer` with main grads on one rank in this process (NCCL on CUDA, gloo on
CPU) against the written-out float32-master reference of tests/test_mixed_precision.py."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import flatgrad
from flatgrad.bench.device_base import DeviceRun, Outcome, single_rank_group
from flatgrad.bench.device_mixed import main_grad_model, token_batches, wrap_main_grads

STEPS, MICRO, MAX_NORM, LR, WEIGHT_DECAY = 3, 4, 2.0, 1e-2, 0.1  # norms ~7: every step clips


def _clip(masters: list[torch.Tensor]) -> None:
    """torch's `clip_grad_norm_` with its total norm taken in float64, as flatgrad's is:
    ``min(1, max_norm / (norm + 1e-6))``, rounded to float32, multiplies every gradient.
    torch's own norm is float32 round-off away from it, which can move the coefficient by a
    float32 ulp; AdamW magnifies that where a clipped gradient is near its eps (measured on
    CPU, torch's clip as the reference: 1 seed of 4 left 1% of the elements unequal and one
    4.6 bf16 ulps off; with this one, 10 seeds of 10 at least 99.99% equal, within 1 ulp)."""
    grads = [m.grad for m in masters if m.grad is not None]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads]))
    coef = torch.clamp(MAX_NORM / (total + 1e-6), max=1.0).float()
    torch._foreach_mul_(grads, coef)


def reference_step(
    flat: flatgrad.FlatGrad,
    masters: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    batches: list[torch.Tensor],
    clip: Callable[[list[torch.Tensor]], Any] | None = None,
) -> None:
    """One step written out: each micro-batch's main grad alone, summed in float32, averaged
    over the ranks in float32 (divided, then summed, as DDP does), clipped (`clip` of the
    masters, whose `.grad` holds the averages; `_clip` when None), the torch optimizer on the float32 masters,
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
    (_clip if clip is None else clip)(masters)
    optimizer.step()
    with torch.no_grad():
        for param, master in zip(flat.parameters(), masters):
            param.copy_(master)


def _train_sharded(model: nn.Module, batches: list[torch.Tensor]) -> list[float]:
    """`STEPS` steps of DataParallel + ShardedOptimizer(AdamW) on `model`, micro-batches
    under no_sync but the last; the norm before clipping at each step."""
    dp = flatgrad.replicate(wrap_main_grads(model), bucket_cap_mb=0.01)
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY)
    norms = []
    for step in range(STEPS):
        micro = batches[step * MICRO : (step + 1) * MICRO]
        with dp.no_sync():
            for tokens in micro[:-1]:
                dp(tokens).backward()
        dp(micro[-1]).backward()
        norms.append(float(opt.clip_grad_norm_(MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return norms


def _ulps_apart(params: list[nn.Parameter], reference: list[nn.Parameter]) -> tuple[float, float]:
    """Over all elements: the share equal, and the largest difference in bf16 ulps of the
    reference's value (of 1e-3 for an element near zero, which a step of lr = 1e-2 passes:
    it has no meaningful ulp of its own)."""
    ours = torch.cat([p.detach().float().flatten() for p in params])
    ref = torch.cat([p.detach().float().flatten() for p in reference])
    off = (ours - ref).abs()
    ulp = torch.finfo(torch.bfloat16).eps * ref.abs().clamp_min(1e-3)
    return float((off == 0).float().mean()), float((off / ulp).max())


def check_sharded_main_grads(run: DeviceRun) -> Outcome:
    """ShardedOptimizer over DataParallel with main grads, world size 1 (NCCL on CUDA, gloo
    on CPU), against the written-out float32-master reference of tests/test_mixed_precision.py
    (`reference_step`): over all elements, >= 99% equal and every one within 2 bf16 ulps;
    the parameters stay bfloat16 with `.grad` None."""
    backend = "nccl" if run.cuda else "gloo"
    model = main_grad_model(run.device)
    reference = copy.deepcopy(model)
    masters = [p.detach().float().requires_grad_() for p in reference.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=LR, weight_decay=WEIGHT_DECAY)
    batches = token_batches(STEPS * MICRO, run.device, seed=10)
    with single_rank_group(backend, run.device):
        norms = _train_sharded(model, batches)
        ref_flat = wrap_main_grads(reference)
        for step in range(STEPS):
            reference_step(ref_flat, masters, ref_opt, batches[step * MICRO : (step + 1) * MICRO])
    params = list(model.parameters())
    equal, ulps = _ulps_apart(params, list(reference.parameters()))
    kept = all(p.dtype == torch.bfloat16 and p.grad is None for p in params)
    detail = (
        f"{backend} world size 1, bf16 tied LM, {STEPS} AdamW steps of {MICRO} micro-batches, norms "
        f"{', '.join(f'{n:.2f}' for n in norms)} clipped to {MAX_NORM:g}: against float32 masters "
        f"stepped by torch from float32 sums and cast back, {equal:.2%} of elements equal (>= 99% "
        f"required), at most {ulps:.2f} bf16 ulps apart (<= 2); parameters "
        f"{'bf16 with .grad None' if kept else 'NOT all bf16 with .grad None'}"
    )
    return Outcome(equal >= 0.99 and ulps <= 2 and kept, detail)
