"""Train a small character-level GPT with FlatGrad under DDP (one all-reduce per step).

The text is the source of a few Python stdlib modules, so nothing is downloaded. Each rank
samples its own random windows; DDP averages the gradients through `flatgrad.allreduce_hook`.

    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --config configs/gpt_cpu.yaml
    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --engine flatgrad --zero
    python examples/train_gpt.py --max-steps 50      # one process, same code path

Rank 0 logs step, loss and tokens/s, and saves ``<out_dir>/ckpt.pt``: the plain model's
state_dict (``flat.state_dict()`` has its keys), the optimiser state and the run config.
With ``--zero`` the optimiser state is sharded: every rank saves its own shard to
``<out_dir>/optim_rank<r>.pt`` (resume on the same world size, each rank loading its own).
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
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
    model = GPT(data.vocab_size, **cfg.model.model_dump()).to(device)
    torch.manual_seed(cfg.seed + rank)  # dropout masks differ per rank
    generator = torch.Generator().manual_seed(cfg.seed + rank)  # so do the data windows

    flat = flatgrad.FlatGrad(model, config=cfg.flatgrad)
    ddp, optimizer = build_engine(cfg, flat, device)

    num_params = sum(p.numel() for p in model.parameters())
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum_steps * world_size
    if rank == 0:
        logger.info(
            "%d ranks on %s, vocab %d, %d characters of text, %.2fM parameters, %d tokens/step",
            world_size, device, data.vocab_size, len(data.ids), num_params / 1e6, tokens_per_step,
        )  # fmt: skip

    losses: dict[int, float] = {}
    bar = tqdm(total=cfg.max_steps, disable=rank != 0, dynamic_ncols=True)
    last_time, last_step = time.perf_counter(), 0
    for step in range(1, cfg.max_steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step - 1, cfg)
        step_loss = torch.zeros((), device=device)
        for micro in range(cfg.grad_accum_steps):
            inputs, targets = data.batch(cfg.batch_size, cfg.seq_len, generator, device)
            # Only the last micro-batch's backward all-reduces; the others just accumulate.
            sync = nullcontext() if micro == cfg.grad_accum_steps - 1 else ddp.no_sync()
            with sync:
                loss = lm_loss(ddp(inputs), targets) / cfg.grad_accum_steps
                loss.backward()
            step_loss += loss.detach()
        if cfg.grad_clip is not None:  # one norm over the flat buffer (or the shards)
            (optimizer if cfg.zero else flat).clip_grad_norm_(cfg.grad_clip)  # type: ignore[union-attr]
        optimizer.step()
        optimizer.zero_grad()  # set_to_none=True; flatgrad keeps .grad in its buffer anyway
        bar.update()

        if step == 1 or step % cfg.log_interval == 0 or step == cfg.max_steps:
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

    if rank == 0:
        first, last = min(losses), max(losses)
        logger.info("loss %.4f at step %d -> %.4f at step %d", losses[first], first, losses[last], last)
    save_checkpoint(cfg, flat, optimizer, data, losses, rank)


def build_engine(cfg: TrainConfig, flat: flatgrad.FlatGrad, device: torch.device) -> tuple[Any, Any]:
    """The data-parallel wrapper and optimiser of `cfg.engine` / `cfg.zero`."""
    if cfg.engine == "ddp":
        ddp = DDP(flat, device_ids=[device.index] if device.type == "cuda" else None, **flat.ddp_kwargs())
        ddp.register_comm_hook(flat.comm_state(), flatgrad.allreduce_hook)
        return ddp, torch.optim.AdamW(flat.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    dp = flatgrad.DataParallel(flat, bucket_mb=cfg.bucket_mb)
    if cfg.zero:
        return dp, flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return dp, torch.optim.AdamW(flat.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


def save_checkpoint(
    cfg: TrainConfig,
    flat: flatgrad.FlatGrad,
    optimizer: Any,
    data: CharData,
    losses: dict[int, float],
    rank: int,
) -> None:
    """Rank 0 saves ckpt.pt; with zero, every rank also saves its own shard of the
    optimiser state (optim_rank<r>.pt: each rank loads its own, on the same world size)."""
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    if cfg.zero:
        torch.save(optimizer.state_dict(), cfg.out_dir / f"optim_rank{rank}.pt")
    if rank != 0:
        return
    path = cfg.out_dir / "ckpt.pt"
    checkpoint = {
        "model": flat.state_dict(),  # the plain GPT's keys: loads into GPT(...) directly
        "config": cfg.model_dump(mode="json"),
        "vocab": data.chars,
        "losses": losses,
    }
    if not cfg.zero:
        checkpoint["optimizer"] = optimizer.state_dict()
    torch.save(checkpoint, path)
    logger.info("saved %s", path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=Path("configs/gpt_cpu.yaml"), help="YAML run config")
    parser.add_argument("--max-steps", type=int, help="override max_steps")
    parser.add_argument("--out-dir", type=Path, help="override out_dir")
    parser.add_argument("--engine", choices=("ddp", "flatgrad"), help="override engine")
    parser.add_argument("--zero", action="store_true", default=None, help="ZeRO-1 (engine flatgrad)")
    args = parser.parse_args()
    overrides = {
        "max_steps": args.max_steps,
        "out_dir": args.out_dir,
        "engine": args.engine,
        "zero": args.zero,
    }
    cfg = load_config(TrainConfig, args.config, overrides)
    launch(lambda: train(cfg))


if __name__ == "__main__":
    main()
