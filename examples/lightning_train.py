"""FlatGrad under PyTorch Lightning: DDPStrategy with flatgrad's comm hook, 2 CPU processes.

    torchrun --standalone --nproc_per_node=2 examples/lightning_train.py
    torchrun --standalone --nproc_per_node=2 examples/lightning_train.py --compare  # and stock

Lightning's `DDPStrategy(ddp_comm_hook=...)` registers the hook on CUDA only
(`DDPStrategy._register_ddp_hooks`), so on CPU (gloo) the hook passed to it never runs and
DDP copies every gradient. The recipe:
1. the LightningModule holds the `FlatGrad` as its one module with parameters, so DDP's one
   bucket per (dtype, device) is exactly flatgrad's buffer;
2. `FlatGradDDPStrategy` below passes `flat.ddp_kwargs()` to DDPStrategy and registers
   `flatgrad.allreduce_hook` itself in `configure_ddp`, on every device (it gives DDPStrategy
   no `ddp_comm_hook`, so on CUDA the hook is not registered twice).

``--compare`` trains again with a plain DDPStrategy (``--stock``: only that) in the same
processes and prints the largest parameter difference; ``--hook-via-lightning`` shows the
CPU trap (the hook never runs; flatgrad warns). With ``--report out.json`` rank 0 also writes
the final parameters and, per step, the hook's calls so far, gradient-sized copies in
backward and whether every `.grad` was a view of the flat buffer (examples/recipe_probe.py;
tests/test_frameworks.py checks them).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from recipe_probe import StepProbe, TinyLM, batch, run_and_summarise
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

import flatgrad


class FlatGradDDPStrategy(DDPStrategy):
    """DDPStrategy with FlatGrad's zero-copy, one-all-reduce path on every device."""

    def __init__(self, flat: flatgrad.FlatGrad, **kwargs: Any) -> None:
        super().__init__(**flat.ddp_kwargs(), **kwargs)
        self.comm_state = flat.comm_state()

    def configure_ddp(self) -> None:
        super().configure_ddp()  # wraps the LightningModule in DDP: self.model
        assert isinstance(self.model, DistributedDataParallel)
        self.model.register_comm_hook(self.comm_state, flatgrad.allreduce_hook)


class LitLM(L.LightningModule):
    def __init__(self, stock: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        model = TinyLM().double()  # float64: the test compares with the stock run to round-off
        self.net = model if stock else flatgrad.FlatGrad(model, config={"linear_min_numel": 0})

    def training_step(self, step: int, _: int) -> torch.Tensor:
        return self.net(batch(step, self.global_rank))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


class ProbeCallback(L.Callback):
    """Runs `StepProbe` around each backward (only with --report)."""

    def __init__(self, probe: StepProbe) -> None:
        self.probe = probe

    def on_before_backward(self, trainer: L.Trainer, module: L.LightningModule, loss: torch.Tensor) -> None:
        self.probe.start()

    def on_after_backward(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.probe.stop()


def train(steps: int, stock: bool, probe_steps: bool, hook_via_lightning: bool = False) -> dict[str, Any]:
    module = LitLM(stock)
    flat = module.net if isinstance(module.net, flatgrad.FlatGrad) else None
    probe = StepProbe(flat.module if flat is not None else module.net, flat)
    strategy = DDPStrategy()
    if flat is not None and hook_via_lightning:  # the hook never runs on CPU: flatgrad warns
        probe.state = flat.comm_state()
        strategy = DDPStrategy(
            **flat.ddp_kwargs(), ddp_comm_state=probe.state, ddp_comm_hook=flatgrad.allreduce_hook
        )
    elif flat is not None:
        strategy = FlatGradDDPStrategy(flat)
        probe.state = strategy.comm_state
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        callbacks=[ProbeCallback(probe)] if probe_steps else [],
        use_distributed_sampler=False,  # each rank draws its own batches (recipe_probe.batch)
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # item i is step i's number; a range is a map-style dataset
    loader: DataLoader[int] = DataLoader(range(steps), batch_size=None)  # type: ignore[arg-type]
    trainer.fit(module, loader)
    return probe.report(trainer.world_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--stock", action="store_true", help="plain DDPStrategy, no flatgrad")
    parser.add_argument("--compare", action="store_true", help="flatgrad's run, then the stock run")
    parser.add_argument(
        "--hook-via-lightning",
        action="store_true",
        help="pass the hook to DDPStrategy(ddp_comm_hook=...) instead (CUDA only: on CPU it never runs)",
    )
    parser.add_argument("--report", type=Path, help="rank 0 writes a JSON report here (probes every step)")
    args = parser.parse_args()
    run_and_summarise(
        args.stock,
        args.compare,
        lambda stock: train(args.steps, stock, args.report is not None, args.hook_via_lightning),
        args.report,
    )


if __name__ == "__main__":
    main()
