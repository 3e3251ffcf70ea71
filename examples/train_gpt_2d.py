"""Train the small character-level GPT on a 2-D mesh: tensor parallel inside ("tp"), data
parallel across ("dp"), with `flatgrad.replicate` averaging each rank's local shards over
"dp" only.

    torchrun --standalone --nproc_per_node=4 examples/train_gpt_2d.py --tp 2
    torchrun --standalone --nproc_per_node=2 examples/train_gpt_2d.py --tp 2      # pure TP
    torchrun --standalone --nproc_per_node=4 examples/train_gpt_2d.py --tp 2 --config configs/gpt_cpu.yaml
    torchrun --standalone --nproc_per_node=4 examples/train_gpt_2d.py --tp 2 --zero  # ZeRO-1 over "dp"

Each block's MLP is split with torch's `parallelize_module` (`ColwiseParallel` for the up
projection, `RowwiseParallel` for the down one): those weights are DTensors, each rank holds
half, and their gradients live in the rank's flat buffer as local shards (`.grad` a DTensor
over the slot). Attention, the norms and the tied embedding stay plain (the same on every
rank of a "tp" group). Ranks of one "tp" group read the same windows; each "dp" rank its own.
`model.clip_grad_norm_` clips by the norm of the whole, unsharded gradient. With `--zero`
a `flatgrad.ShardedOptimizer` shards AdamW's state over "dp" (each rank steps its part of its
local shards) and clips with its own `clip_grad_norm_`. At the end every rank writes a DCP
checkpoint (`<out_dir>/dcp_2d`) that loads on any "dp" size.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from gpt_model import GPT, CharData, init_distributed, launch, lm_loss, read_text
from run_config import TrainConfig, load_config
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import flatgrad

logger = logging.getLogger("train_gpt_2d")


def parallelize(model: GPT, tp_mesh) -> GPT:  # noqa: ANN001 (a DeviceMesh)
    """Split every block's MLP over `tp_mesh`: up projection by columns, down by rows."""
    for block in model.blocks:
        parallelize_module(block.mlp, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model


def train(cfg: TrainConfig, tp: int) -> None:
    rank, world_size, device = init_distributed(cfg.device)
    if world_size % tp:
        raise ValueError(f"--tp must divide the number of processes ({world_size}), got {tp}")
    mesh = init_device_mesh(device.type, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    data = CharData(read_text(cfg.data.source, cfg.data.stdlib_modules, cfg.data.path))
    torch.manual_seed(cfg.seed)  # the same init on every rank
    model: torch.nn.Module = parallelize(
        GPT(data.vocab_size, **cfg.model.model_dump()).to(device), mesh["tp"]
    )
    model = flatgrad.FlatGrad(model, config=cfg.flatgrad)  # both in place: the same `model`
    model = flatgrad.replicate(model, device_mesh=mesh["dp"], bucket_cap_mb=cfg.bucket_cap_mb)
    adamw = {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
    optimizer: torch.optim.Optimizer
    if cfg.zero:  # ZeRO-1 over "dp": AdamW's state of this rank's part of its local shards
        optimizer = flatgrad.ShardedOptimizer(model, torch.optim.AdamW, **adamw)
        clip = optimizer.clip_grad_norm_
    else:
        optimizer = torch.optim.AdamW(model.parameters(), **adamw)
        clip = model.clip_grad_norm_
    generator = torch.Generator().manual_seed(cfg.seed + dp_rank)  # one stream per "dp" rank
    logger.info(
        "mesh dp=%d x tp=%d; %d parameters, %d of them DTensors; %s; %s",
        world_size // tp, tp, sum(1 for _ in model.parameters()),
        sum(1 for p in model.parameters() if hasattr(p, "device_mesh")),
        {str(k): b.numel() for k, b in model.grad_buffers.items()}, type(optimizer).__name__,
    )  # fmt: skip
    start, losses = time.perf_counter(), []
    for step in range(1, cfg.max_steps + 1):
        optimizer.zero_grad()
        total = torch.zeros((), device=device)
        for micro in range(cfg.grad_accum_steps):
            inputs, targets = data.batch(cfg.batch_size, cfg.seq_len, generator, device)
            sync = micro == cfg.grad_accum_steps - 1
            with contextlib.nullcontext() if sync else model.no_sync():
                loss = lm_loss(model(inputs), targets) / cfg.grad_accum_steps
                loss.backward()
            total += loss.detach()
        norm = clip(cfg.grad_clip) if cfg.grad_clip is not None else None
        optimizer.step()
        dist.all_reduce(total, group=mesh["dp"].get_group())
        losses.append(float(total) / mesh["dp"].size())
        if step == 1 or step % cfg.log_interval == 0 or step == cfg.max_steps:
            shown = f" grad norm {float(norm):.3f}" if norm is not None else ""
            logger.info("step %d loss %.4f%s (%.1f s)", step, losses[-1], shown, time.perf_counter() - start)
    out = Path(cfg.out_dir) / "dcp_2d"
    dcp.save({"model": model, "optim": optimizer}, checkpoint_id=out)
    logger.info("loss %.3f -> %.3f; saved %s", losses[0], losses[-1], out)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="configs/gpt_cpu.yaml", help="a TrainConfig YAML")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks per data-parallel rank")
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument(
        "--zero", action="store_true", default=None, help="ZeRO-1: a ShardedOptimizer over dp"
    )
    parser.add_argument("--out-dir", default=None, help="where dcp_2d goes (the config's out_dir if unset)")
    args = parser.parse_args()
    if args.tp < 1:
        parser.error(f"--tp must be at least 1, got {args.tp}")
    # (this example always uses flatgrad.replicate; `zero` as train_gpt.py's config has it)
    overrides = {"max_steps": args.max_steps, "log_interval": 10, "out_dir": args.out_dir}
    overrides.update({"engine": "flatgrad", "zero": args.zero})
    cfg = load_config(TrainConfig, args.config, overrides)
    launch(lambda: train(cfg, args.tp))


if __name__ == "__main__":
    main()
