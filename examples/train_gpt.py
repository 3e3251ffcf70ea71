"""Train a small character-level GPT with FlatGrad under DDP (one all-reduce per step).

The text is the source of a few Python stdlib modules, so nothing is downloaded. Each rank
samples its own random windows; DDP averages the gradients through `flatgrad.allreduce_hook`.

    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --config configs/gpt_cpu.yaml
    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --engine flatgrad --zero
    python examples/train_gpt.py --max-steps 50      # one process, same code path
    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --engine flatgrad --zero \
        --dtype bfloat16                             # bf16 weights, fp32 main grads and masters

    torchrun --standalone --nproc_per_node=1 examples/train_gpt.py --engine flatgrad --zero \
        --max-steps 300 --resume                     # go on from the last checkpoint, 1 rank

AdamW's weight decay applies to matrices only (nanoGPT's groups), the learning rate follows
a `LambdaLR` schedule, and accumulation uses ``require_backward_grad_sync`` as nanoGPT does.
Rank 0 logs step, loss and tokens/s. At the end every rank writes the resharding checkpoint
``<out_dir>/dcp`` (``torch.distributed.checkpoint``: model, optimiser, schedule, step), which
``--resume`` loads on any number of ranks (``--zero``'s sharded optimiser state included);
rank 0 also saves ``<out_dir>/ckpt.pt``, the plain model's state_dict (FlatGrad, applied in
place, keeps the GPT's keys) with the run config, for sampling without flatgrad.
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from gpt_model import GPT, CharData, init_distributed, launch, lm_loss, read_text
from run_config import TrainConfig, load_config
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import flatgrad

logger = logging.getLogger("train_gpt")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to `lr`, then constant or a cosine decay to `min_lr` (step is 0-based)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def global_mean(value: torch.Tensor, world_size: int) -> float:
    """Mean of a scalar over all ranks (gloo has no AVG, so SUM / world_size)."""
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / world_size


def train(cfg: TrainConfig) -> None:
    rank, world_size, device = init_distributed(cfg.device)
    data = CharData(read_text(cfg.data.source, cfg.data.stdlib_modules, cfg.data.path))
    torch.manual_seed(cfg.seed)  # the same init on every rank (DDP also broadcasts rank 0's)
    dtype = getattr(torch, cfg.dtype)
    model: torch.nn.Module = GPT(data.vocab_size, **cfg.model.model_dump()).to(device, dtype)
    torch.manual_seed(cfg.seed + rank)  # dropout masks differ per rank
    generator = torch.Generator().manual_seed(cfg.seed + rank)  # so do the data windows

    # bfloat16 weights: float32 main grads (and ShardedOptimizer's float32 master shards)
    options = {"grad_dtype": "float32"} if cfg.dtype == "bfloat16" else {}
    model = flatgrad.FlatGrad(model, config=cfg.flatgrad.model_copy(update=options))  # in place
    ddp_or_model, optimizer = build_engine(cfg, model, device)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg) / cfg.lr)
    progress = {"step": torch.zeros((), dtype=torch.int64)}
    checkpoint = {"model": model, "optim": optimizer, "sched": schedule, "progress": progress}
    if cfg.resume:  # saved on any number of ranks: dcp reshards
        dcp.load(checkpoint, checkpoint_id=cfg.out_dir / "dcp")
    first_step = int(progress["step"]) + 1

    num_params = sum(p.numel() for p in model.parameters())
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum_steps * world_size
    if rank == 0:
        logger.info(
            "%d ranks on %s, vocab %d, %d characters of text, %.2fM parameters, %d tokens/step%s",
            world_size, device, data.vocab_size, len(data.ids), num_params / 1e6, tokens_per_step,
            f", resumed after step {first_step - 1}" if cfg.resume else "",
        )  # fmt: skip

    losses: dict[int, float] = {}
    bar = tqdm(total=cfg.max_steps, initial=first_step - 1, disable=rank != 0, dynamic_ncols=True)
    last_time, last_step = time.perf_counter(), first_step - 1
    for step in range(first_step, cfg.max_steps + 1):
        step_loss = torch.zeros((), device=device)
        for micro in range(cfg.grad_accum_steps):
            inputs, targets = data.batch(cfg.batch_size, cfg.seq_len, generator, device)
            # Only the last micro-batch's backward all-reduces; the others just accumulate.
            ddp_or_model.require_backward_grad_sync = micro == cfg.grad_accum_steps - 1
            loss = lm_loss(ddp_or_model(inputs).float(), targets) / cfg.grad_accum_steps
            loss.backward()
            step_loss += loss.detach()
        if cfg.grad_clip is not None:  # one norm over the flat buffer (or the shards)
            (optimizer if cfg.zero else model).clip_grad_norm_(cfg.grad_clip)  # type: ignore[union-attr]
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()  # set_to_none=True; flatgrad keeps .grad in its buffer anyway
        progress["step"].fill_(step)
        bar.update()

        if step == first_step or step % cfg.log_interval == 0 or step == cfg.max_steps:
            losses[step] = global_mean(step_loss, world_size)
            if device.type == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            tokens_per_s = tokens_per_step * (step - last_step) / (now - last_time)
            last_time, last_step = now, step
            if rank == 0:
                bar.set_postfix(loss=f"{losses[step]:.3f}")
                logger.info("step %5d | loss %.4f | lr %.2e | %.0f tokens/s",
                            step, losses[step], lr_at(step - 1, cfg), tokens_per_s)  # fmt: skip
    bar.close()

    if rank == 0 and losses:
        first, last = min(losses), max(losses)
        logger.info("loss %.4f at step %d -> %.4f at step %d", losses[first], first, losses[last], last)
    dcp.save(checkpoint, checkpoint_id=cfg.out_dir / "dcp")
    if rank == 0:
        save_model(cfg, model, data, losses)


def optim_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """nanoGPT's groups: weight decay on matrices (linear weights, embeddings), none on
    biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def build_engine(cfg: TrainConfig, model: flatgrad.FlatGrad, device: torch.device) -> tuple[Any, Any]:
    """What the training loop calls and the optimiser, for `cfg.engine` / `cfg.zero`: DDP
    around `model` with flatgrad's hook, or `model` itself, replicated in place."""
    groups = optim_groups(model, cfg.weight_decay)
    if cfg.engine == "ddp":
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **model.ddp_kwargs())
        ddp.register_comm_hook(model.comm_state(), flatgrad.allreduce_hook)
        return ddp, torch.optim.AdamW(groups, lr=cfg.lr)
    model = flatgrad.replicate(model, bucket_cap_mb=cfg.bucket_cap_mb)  # the same object
    if cfg.zero:
        return model, flatgrad.ShardedOptimizer(model, torch.optim.AdamW, groups, lr=cfg.lr)
    return model, torch.optim.AdamW(groups, lr=cfg.lr)


def save_model(cfg: TrainConfig, model: flatgrad.FlatGrad, data: CharData, losses: dict[int, float]) -> None:
    """ckpt.pt: the plain GPT's state_dict, the run config, the vocabulary and the losses."""
    path = cfg.out_dir / "ckpt.pt"
    checkpoint = {
        "model": model.state_dict(),  # the plain GPT's keys: loads into GPT(...) directly
        "config": cfg.model_dump(mode="json"),
        "vocab": data.chars,
        "losses": losses,
    }
    torch.save(checkpoint, path)
    logger.info("saved %s and %s", path, cfg.out_dir / "dcp")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=Path("configs/gpt_cpu.yaml"), help="YAML run config")
    parser.add_argument("--max-steps", type=int, help="override max_steps")
    parser.add_argument("--out-dir", type=Path, help="override out_dir")
    parser.add_argument("--engine", choices=("ddp", "flatgrad"), help="override engine")
    parser.add_argument("--zero", action="store_true", default=None, help="ZeRO-1 (engine flatgrad)")
    parser.add_argument("--resume", action="store_true", default=None, help="go on from <out_dir>/dcp")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="override dtype (bf16: main grads)")
    args = parser.parse_args()
    overrides = {
        "max_steps": args.max_steps,
        "out_dir": args.out_dir,
        "engine": args.engine,
        "zero": args.zero,
        "resume": args.resume,
        "dtype": args.dtype,
    }
    cfg = load_config(TrainConfig, args.config, overrides)
    launch(lambda: train(cfg))


if __name__ == "__main__":
    main()
