"""Stock DDP against FlatGrad + DDP + `flatgrad.allreduce_hook`, side by side in one run.

Both start from the same weights and see the same batches; their steps interleave (the order
alternates every step) so that load on the machine hits both alike. Each step is forward,
backward (with DDP's all-reduce), gradient clipping, AdamW, ``optimizer.zero_grad()``.
Rank 0 prints the median step time of each, their ratio and both final losses (averaged
over ranks). The losses match closely but not bit for bit: gradients agree to float32
round-off (~1e-6 relative; the same sums in another order), and AdamW, which divides by
the gradient's running RMS, lets such differences grow step by step in the weights.

    torchrun --standalone --nproc_per_node=2 examples/ddp_compare.py --config configs/compare_cpu.yaml
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from gpt_model import GPT, CharData, init_distributed, launch, lm_loss, read_text
from run_config import CompareConfig, load_config
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import flatgrad

logger = logging.getLogger("ddp_compare")


class Run:
    """One of the two contestants: a DDP-wrapped model, its optimiser and its clipping."""

    def __init__(
        self, name: str, ddp: DDP, clip: Callable[[float], torch.Tensor], cfg: CompareConfig
    ) -> None:
        self.name, self.ddp, self.clip, self.grad_clip = name, ddp, clip, cfg.grad_clip
        self.optimizer = torch.optim.AdamW(ddp.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.times: list[float] = []
        self.loss = torch.zeros(())

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, timed: bool) -> None:
        _synchronize(inputs.device)
        start = time.perf_counter()
        loss = lm_loss(self.ddp(inputs), targets)
        loss.backward()
        if self.grad_clip is not None:
            self.clip(self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad()  # set_to_none=True, torch's default, for both
        _synchronize(inputs.device)
        if timed:
            self.times.append(time.perf_counter() - start)
        self.loss = loss.detach()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_runs(cfg: CompareConfig, model: nn.Module, device: torch.device) -> list[Run]:
    device_ids = [device.index] if device.type == "cuda" else None
    stock_model = copy.deepcopy(model)  # same initial weights for both
    stock = DDP(stock_model, device_ids=device_ids, gradient_as_bucket_view=True)

    def stock_clip(max_norm: float) -> torch.Tensor:
        return nn.utils.clip_grad_norm_(stock_model.parameters(), max_norm)

    model = flatgrad.FlatGrad(model, config=cfg.flatgrad)  # in place
    ours = DDP(model, device_ids=device_ids, **model.ddp_kwargs())
    ours.register_comm_hook(model.comm_state(), flatgrad.allreduce_hook)
    return [Run("stock DDP", stock, stock_clip, cfg), Run("flatgrad + DDP", ours, model.clip_grad_norm_, cfg)]


def compare(cfg: CompareConfig) -> None:
    rank, world_size, device = init_distributed(cfg.device)
    data = CharData(read_text(cfg.data.source, cfg.data.stdlib_modules, cfg.data.path))
    torch.manual_seed(cfg.seed)
    model = GPT(data.vocab_size, **cfg.model.model_dump()).to(device)
    runs = build_runs(cfg, model, device)
    generator = torch.Generator().manual_seed(cfg.seed + rank)  # each rank its own windows
    if rank == 0:
        logger.info("%d ranks on %s, %d steps each (%d untimed), batch %d x %d per rank",
                    world_size, device, cfg.steps, cfg.warmup_steps, cfg.batch_size, cfg.seq_len)  # fmt: skip

    for step in range(cfg.steps):
        inputs, targets = data.batch(cfg.batch_size, cfg.seq_len, generator, device)
        for run in runs if step % 2 == 0 else runs[::-1]:
            run.step(inputs, targets, timed=step >= cfg.warmup_steps)

    final_losses = []
    for run in runs:
        loss = run.loss.clone()
        dist.all_reduce(loss)
        final_losses.append(loss.item() / world_size)
    if rank == 0:
        print_table(runs, final_losses)


def print_table(runs: list[Run], final_losses: list[float]) -> None:
    medians = [statistics.median(run.times) * 1e3 for run in runs]
    print(f"\n{'':<24}{'median step (ms)':>18}{'final loss':>14}")
    for run, median, loss in zip(runs, medians, final_losses, strict=True):
        print(f"{run.name:<24}{median:>18.2f}{loss:>14.5f}")
    print(f"{'ratio flatgrad / stock':<24}{medians[1] / medians[0]:>18.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config", type=Path, default=Path("configs/compare_cpu.yaml"), help="YAML run config"
    )
    parser.add_argument("--steps", type=int, help="override steps")
    args = parser.parse_args()
    cfg = load_config(CompareConfig, args.config, {"steps": args.steps})
    launch(lambda: compare(cfg))


if __name__ == "__main__":
    main()
