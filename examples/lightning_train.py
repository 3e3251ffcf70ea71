"""FlatGrad under PyTorch Lightning: DDPStrategy with flatgrad's comm hook, 2 CPU processes.

    torchrun --standalone --nproc_per_node=2 examples/lightning_train.py
    torchrun --standalone --nproc_per_node=2 examples/lightning_train.py --stock  # plain DDPStrategy

Lightning's DDPStrategy registers its `ddp_comm_hook` on CUDA only, so on CPU (gloo) passing
the hook to it silently trains without the fast path. `FlatGradDDPStrategy` below passes
`flat.ddp_kwargs()` and registers `flatgrad.allreduce_hook` itself, on any device. The
LightningModule holds the FlatGrad as its only module with parameters, so DDP's single
bucket is exactly flatgrad's buffer. With ``--report out.json`` rank 0 writes the final
parameters, the hook calls and whether every `.grad` was a view of the flat buffer.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
from accelerate_train import TinyLM, batch, grads_in_buffers
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, Dataset

import flatgrad


class FlatGradDDPStrategy(DDPStrategy):
    """DDPStrategy with FlatGrad's zero-copy, one-all-reduce path on every device."""

    def __init__(self, flat: flatgrad.FlatGrad, hook: Any = flatgrad.allreduce_hook, **kwargs: Any) -> None:
        super().__init__(**flat.ddp_kwargs(), **kwargs)
        self._flat = flat
        self._hook = hook

    def configure_ddp(self) -> None:
        super().configure_ddp()
        self.model.register_comm_hook(self._flat.comm_state(), self._hook)  # type: ignore[union-attr]


class Steps(Dataset):
    """Item i is the batch of step i on this rank (rank-dependent, as in accelerate_train)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, step: int) -> int:
        return step


class Module(L.LightningModule):
    def __init__(self, stock: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyLM().double()
        self.flat = None if stock else flatgrad.FlatGrad(self.model, config={"linear_min_numel": 0})
        self.in_buffers: list[bool] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return (self.flat or self.model)(tokens)

    def training_step(self, step: torch.Tensor, _: int) -> torch.Tensor:
        return self(batch(int(step), self.global_rank))

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.flat is not None:
            self.in_buffers.append(grads_in_buffers(self.flat))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--stock", action="store_true", help="plain DDPStrategy, no flatgrad")
    parser.add_argument("--report", type=Path, help="rank 0 writes a JSON report here")
    args = parser.parse_args()
    module = Module(args.stock)
    calls = [0]

    def counting_hook(state, bucket):  # noqa: ANN001, ANN202 (DDP checks no annotations here)
        calls[0] += 1
        return flatgrad.allreduce_hook(state, bucket)

    strategy = DDPStrategy() if module.flat is None else FlatGradDDPStrategy(module.flat, counting_hook)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # one item per step and rank, not shuffled: each rank sees its own batches 0..steps-1
    loader = DataLoader(Steps(args.steps), batch_size=None, shuffle=False)
    trainer.fit(module, loader)
    report = {
        "params": [p.detach().tolist() for p in module.model.parameters()],
        "hook_calls": calls[0],
        "steps": args.steps,
        "grads_in_buffers": all(module.in_buffers) if module.flat is not None else None,
        "world_size": trainer.world_size,
    }
    if trainer.global_rank == 0:
        if args.report is not None:
            args.report.write_text(json.dumps(report))
        else:
            print(
                f"{report['world_size']} ranks, {report['steps']} steps, hook calls: {report['hook_calls']}"
            )


if __name__ == "__main__":
    main()
