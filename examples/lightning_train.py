"""An unmodified LightningModule under flatgrad's Lightning strategies, 2 CPU processes.

    torchrun --standalone --nproc_per_node=2 examples/lightning_train.py
    torchrun --standalone --nproc_per_node=2 examples/lightning_train.py --compare  # and stock
    torchrun --standalone --nproc_per_node=2 examples/lightning_train.py --strategy flatgrad_sharded

The recipe is two lines: ``import flatgrad.lightning`` (it registers the strategies in
Lightning's StrategyRegistry), then ``L.Trainer(strategy="flatgrad")`` (DDP with flatgrad's
comm hook), ``"flatgrad_data_parallel"`` (flatgrad.ReplicateModule) or ``"flatgrad_sharded"``
(ZeRO-1: the optimizer from ``configure_optimizers`` rebuilt as a ShardedOptimizer). The
LightningModule holds no flatgrad: the strategy applies FlatGrad to it in place at setup
(docs/integrations.md).

``--compare`` trains again with Lightning's ``"ddp"`` (``--stock``: only that) in the same
processes and prints the largest parameter difference. ``--hook-via-lightning`` shows the
trap the strategy avoids: ``FlatGrad`` inside the module and the hook given to
``DDPStrategy(ddp_comm_hook=...)``, which Lightning registers on CUDA only
(`DDPStrategy._register_ddp_hooks`): on CPU the hook never runs and flatgrad warns. With
``--report out.json`` rank 0 also writes the final parameters and, per step, the hook's calls
so far, gradient-sized copies in backward and whether every `.grad` was a view of the flat
buffer (examples/recipe_probe.py; tests/test_frameworks.py checks them).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from recipe_probe import StepProbe, TinyLM, batch, run_and_summarise
from torch.utils.data import DataLoader

import flatgrad
import flatgrad.lightning  # registers "flatgrad", "flatgrad_data_parallel", "flatgrad_sharded"
from flatgrad.lightning import FlatGradDataParallelStrategy, FlatGradDDPStrategy, FlatGradShardedStrategy

# TinyLM's Linears are small: route them too (the default routes from ~313x313 up), so that the
# probe sees no gradient copy. With the default config, ``strategy="flatgrad"`` by name is enough.
ROUTE_ALL = {"linear_min_numel": 0}
STRATEGIES = {
    "flatgrad": FlatGradDDPStrategy,
    "flatgrad_data_parallel": FlatGradDataParallelStrategy,
    "flatgrad_sharded": FlatGradShardedStrategy,
}


class LitLM(L.LightningModule):
    """A plain LightningModule (``flatgrad_inside``: FlatGrad applied to its `net`, for
    --hook-via-lightning only)."""

    def __init__(self, flatgrad_inside: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = TinyLM().double()  # float64: the test compares with the stock run to round-off
        if flatgrad_inside:
            flatgrad.FlatGrad(self.net, config=ROUTE_ALL)  # (in place: `self.net` itself)

    def training_step(self, step: int, _: int) -> torch.Tensor:
        return self.net(batch(step, self.global_rank))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


class ProbeCallback(L.Callback):
    """Runs `StepProbe` around each backward (only with --report); takes the strategy's
    hook state once it has set up."""

    def __init__(self, probe: StepProbe) -> None:
        self.probe = probe

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if isinstance(trainer.strategy, FlatGradDDPStrategy):
            self.probe.state = trainer.strategy.comm_state

    def on_before_backward(self, trainer: L.Trainer, module: L.LightningModule, loss: torch.Tensor) -> None:
        self.probe.start()

    def on_after_backward(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.probe.stop()


def train(steps: int, strategy: str, probe_steps: bool, hook_via_lightning: bool = False) -> dict[str, Any]:
    module = LitLM(flatgrad_inside=hook_via_lightning)
    probe = StepProbe(module)  # FlatGrad applied to `module` by the strategy, or to `module.net`
    chosen: str | DDPStrategy = strategy if strategy == "ddp" else STRATEGIES[strategy](config=ROUTE_ALL)
    if isinstance(module.net, flatgrad.FlatGrad):  # --hook-via-lightning: on CPU flatgrad warns
        probe.state = module.net.comm_state()
        chosen = DDPStrategy(
            **module.net.ddp_kwargs(), ddp_comm_state=probe.state, ddp_comm_hook=flatgrad.allreduce_hook
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=chosen,
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
    parser.add_argument(
        "--strategy",
        default="flatgrad",
        choices=["flatgrad", "flatgrad_data_parallel", "flatgrad_sharded"],
        help="flatgrad's strategy (flatgrad.lightning)",
    )
    parser.add_argument("--stock", action="store_true", help="Lightning's own 'ddp', no flatgrad")
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
        lambda stock: train(
            args.steps,
            "ddp" if stock else args.strategy,
            args.report is not None,
            args.hook_via_lightning and not stock,
        ),
        args.report,
    )


if __name__ == "__main__":
    main()
