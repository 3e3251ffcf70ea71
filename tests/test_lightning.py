"""flatgrad.lightning: `L.Trainer(strategy="flatgrad...")` on an unmodified LightningModule, on
2 gloo ranks, against Lightning's own ``"ddp"`` strategy on the same module and data.

Every case (one strategy) runs in this module's persistent ranks (tests/dist_utils.py: importing
Lightning and spawning is most of a case's cost), which pose as a torchrun launch to Lightning
(its TorchElasticEnvironment: Lightning starts no processes and reuses the process group). A
case trains one epoch in float64 (``precision="64-true"``) with two accumulated micro-batches
per step, norm clipping that clips every step, AdamW with weight decay and a StepLR
schedule; saves a checkpoint with ``trainer.save_checkpoint``; resumes it in a second
Trainer's ``fit(ckpt_path=...)`` on a fresh module for a second epoch; then runs
``trainer.test`` and ``trainer.predict``. The oracle is the same sequence under ``"ddp"``
(run once per rank process and kept). Tolerance 1e-12: float64, two ranks, both sides add the
same two halves and differ only by round-off in the layer backwards and the norm. Then, in
the same ranks: the three under "bf16-mixed" and "16-mixed", a second fit of the same module
by a new Trainer, and the sharded strategy's refusal of value clipping.
"""

from __future__ import annotations

import ast
import contextlib
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_utils import run_ranks
from torch import nn

L = pytest.importorskip("lightning", reason="pip install -e '.[dev,frameworks]'")

import flatgrad  # noqa: E402
import flatgrad.lightning  # noqa: E402  (after the skip: it imports Lightning)

CLIP = 0.05  # below every step's gradient norm (checked on the stock run): every step clips
TOL = 1e-12


class LitLM(L.LightningModule):
    """A plain LightningModule: an embedding, two Linears, a LayerNorm; no flatgrad inside."""

    def __init__(self, record_norms: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.record_norms = record_norms
        self.emb = nn.Embedding(50, 16)
        self.fc = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 50)
        self.norms: list[float] = []  # the stock run's gradient norms before clipping

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(torch.tanh(self.fc(self.emb(tokens)))))
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())

    def training_step(self, tokens: torch.Tensor, _: int) -> torch.Tensor:
        return self(tokens)

    def test_step(self, tokens: torch.Tensor, _: int) -> None:
        self.log("test_loss", self(tokens), sync_dist=True)

    def predict_step(self, tokens: torch.Tensor, _: int) -> torch.Tensor:
        return self(tokens)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.record_norms:  # (the stock run's: a reduce-scattered .grad refuses reads)
            grads = [p.grad for p in self.parameters()]
            self.norms.append(torch.nn.utils.get_total_norm(grads).item())

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]


def _loader() -> torch.utils.data.DataLoader:
    """8 batches: 4 per rank per epoch (Lightning's DistributedSampler), 2 steps of 2."""
    data = torch.randint(0, 50, (8, 4, 12), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(data, batch_size=None)


def _unshuffled_loader() -> torch.utils.data.DataLoader:
    """`_loader`'s batches, each rank's in the same order every epoch: Lightning's own
    DistributedSampler shuffles, and a fit resumed from a checkpoint written at the end of
    an epoch runs the next epoch in another order than an uninterrupted fit does (seen under
    "ddp" alone), which a resumed run's oracle cannot have."""
    data = torch.randint(0, 50, (8, 4, 12), generator=torch.Generator().manual_seed(0))
    sampler = torch.utils.data.distributed.DistributedSampler(data, shuffle=False)  # (kept by Lightning)
    return torch.utils.data.DataLoader(data, batch_size=None, sampler=sampler)


def _trainer(strategy: Any, epochs: int, precision: str = "64-true") -> Any:
    return L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs, precision=precision,
        accumulate_grad_batches=2, gradient_clip_val=CLIP, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip


def _as_torchrun(rank: int, world_size: int) -> None:
    """What torchrun sets (MASTER_ADDR/PORT are the pool's): Lightning then launches nothing."""
    os.environ.update(
        TORCHELASTIC_RUN_ID="flatgrad-tests", RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0",
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
    )  # fmt: skip


def _params(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _run(strategy: Any, directory: Path) -> dict[str, Any]:
    """Fit an epoch, save, resume into a fresh module for a second epoch, test, predict."""
    first = LitLM(record_norms=strategy == "ddp")
    trainer = _trainer(strategy() if callable(strategy) else strategy, 1)
    trainer.fit(first, _loader())
    path = directory / "epoch1.ckpt"
    trainer.save_checkpoint(path)
    resumed = LitLM(record_norms=strategy == "ddp")
    trainer = _trainer(strategy() if callable(strategy) else strategy, 2)
    trainer.fit(resumed, _loader(), ckpt_path=path)
    tested = trainer.test(resumed, _loader(), verbose=False)
    predicted = trainer.predict(resumed, _loader())
    return {
        "epoch1": _params(first),
        "checkpoint": torch.load(path, weights_only=False),
        "resumed": _params(resumed),
        "test_loss": tested[0]["test_loss"],
        "predicted": [p.item() for p in predicted],
        "norms": first.norms + resumed.norms,
        "names": [name for name, _ in resumed.named_parameters()],
    }


_STOCK: dict[str, Any] = {}  # per rank process: Lightning's "ddp" run, made once


def _assert_close(ours: Any, stock: Any, what: str) -> None:
    torch.testing.assert_close(ours, stock, rtol=TOL, atol=TOL, msg=lambda m: f"{what}: {m}")


def _compare_checkpoints(ours: dict[str, Any], stock: dict[str, Any]) -> None:
    """The model state under the plain model's keys; the optimizer state exactly as "ddp"
    saves its torch AdamW's (every strategy's: the sharded one converts its own to that
    form); the schedules."""
    assert list(ours["state_dict"]) == list(stock["state_dict"])
    for key, value in stock["state_dict"].items():
        _assert_close(ours["state_dict"][key], value, key)
    (opt,), (ref,) = ours["optimizer_states"], stock["optimizer_states"]
    _assert_torch_optimizer_state(opt, ref)
    assert ours["lr_schedulers"] == stock["lr_schedulers"]


def _assert_torch_optimizer_state(ours: dict[str, Any], stock: dict[str, Any]) -> None:
    """`ours` in the form of `stock`, a torch optimizer's state dict: the same groups
    (options and parameter indices), the same indices in the state with the same keys,
    every tensor of the same dtype and shape and close at TOL, and each its own storage
    (torch.save keeps shared tensors shared, and every parameter's ``step += 1`` would then
    advance one counter)."""
    assert ours["param_groups"] == stock["param_groups"]
    assert sorted(ours["state"]) == sorted(stock["state"])
    storages = set()
    for index, entry in stock["state"].items():
        assert sorted(ours["state"][index]) == sorted(entry), index
        for key, value in entry.items():
            mine = ours["state"][index][key]
            _assert_close(mine, value, f"state {index} {key}")  # (dtype and shape included)
            storages.add(mine.untyped_storage().data_ptr())
    assert len(storages) == sum(len(entry) for entry in stock["state"].values()), "shared tensors"


def _strategy_case(rank: int, world_size: int, name: str, directory: str) -> None:
    _as_torchrun(rank, world_size)
    if not _STOCK:
        stock_dir = Path(directory) / "stock"  # (the same on every rank: rank 0 writes the file)
        stock_dir.mkdir(exist_ok=True)
        _STOCK.update(_run("ddp", stock_dir))
    stock = _STOCK
    assert min(stock["norms"]) > CLIP and len(stock["norms"]) == 4  # 2 steps per epoch, each clipped
    strategies = {
        "sharded_by_tensor": lambda: flatgrad.lightning.FlatGradShardedStrategy(shard_by="tensor"),
    }
    ours = _run(strategies.get(name, name), Path(directory))
    for key in ("epoch1", "resumed"):
        for p, q, param in zip(ours[key], stock[key], stock["names"]):
            _assert_close(p, q, f"{key} {param}")
    if rank == 0:  # (the file Lightning wrote: rank 0's dicts)
        _compare_checkpoints(ours["checkpoint"], stock["checkpoint"])
    _assert_close(ours["test_loss"], stock["test_loss"], "test_loss")
    _assert_close(torch.tensor(ours["predicted"]), torch.tensor(stock["predicted"]), "predict")


@pytest.mark.distributed
@pytest.mark.parametrize(
    "name", ["flatgrad", "flatgrad_data_parallel", "flatgrad_sharded", "sharded_by_tensor"]
)
def test_strategy_trains_resumes_tests_and_predicts_as_lightning_ddp(tmp_path: Path, name: str) -> None:
    """An unmodified LightningModule under each strategy equals Lightning's "ddp" run:
    parameters after the first fit and after the resumed one, the checkpoint (model keys and
    values, optimizer state per parameter, schedules), test loss and predictions."""
    (tmp_path / "run").mkdir()
    run_ranks(_strategy_case, name, str(tmp_path / "run"), timeout=240.0)


_UNINTERRUPTED: list[torch.Tensor] = []  # per rank process: "ddp" fit for two epochs at once


def _cross_case(rank: int, world_size: int, sharded: str, directory: str) -> None:
    _as_torchrun(rank, world_size)
    if not _UNINTERRUPTED:
        module = LitLM().double()
        _trainer("ddp", 2).fit(module, _unshuffled_loader())
        _UNINTERRUPTED.extend(_params(module))
    strategy = {"sharded_by_tensor": lambda: flatgrad.lightning.FlatGradShardedStrategy(shard_by="tensor")}
    make = strategy.get(sharded, lambda: sharded)

    def fit(name: Any, epochs: int, ckpt_path: Path | None = None) -> Any:
        # Built in float64: Lightning loads a checkpoint's weights into the module before the
        # precision plugin converts it (float32 weights would round them: 6e-8 off under "ddp").
        module = LitLM().double()
        trainer = _trainer(name, epochs)
        trainer.fit(module, _unshuffled_loader(), ckpt_path=ckpt_path)
        return module, trainer

    def save(trainer: Any, name: str) -> Path:
        path = Path(directory) / name  # (rank 0 writes it; save_checkpoint ends in a barrier)
        trainer.save_checkpoint(path)
        return path

    # An epoch under "ddp" and under the sharded strategy: the sharded one's optimizer state
    # is "ddp"'s, and loads into a plain torch AdamW, which then saves it as "ddp" did.
    module, trainer = fit("ddp", 1)
    stock = save(trainer, "ddp.ckpt")
    ours = save(fit(make(), 1)[1], "sharded.ckpt")
    (saved,) = torch.load(ours, weights_only=False)["optimizer_states"]
    (expected,) = torch.load(stock, weights_only=False)["optimizer_states"]
    _assert_torch_optimizer_state(saved, expected)
    plain = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)
    plain.load_state_dict(saved)
    _assert_torch_optimizer_state(plain.state_dict(), expected)
    # The sharded checkpoint resumed for the second epoch under each other strategy, and the
    # "ddp" one under the sharded strategy.
    runs = [(name, ours) for name in ("ddp", "flatgrad", "flatgrad_data_parallel")] + [(make(), stock)]
    for name, path in runs:
        resumed, _ = fit(name, 2, path)
        for p, q, (param, _) in zip(_params(resumed), _UNINTERRUPTED, resumed.named_parameters()):
            _assert_close(p, q, f"{path.name} resumed under {name}: {param}")


@pytest.mark.distributed
@pytest.mark.parametrize("sharded", ["flatgrad_sharded", "sharded_by_tensor"])
def test_checkpoints_resume_across_strategies(tmp_path: Path, sharded: str) -> None:
    """A checkpoint of the sharded strategy (AdamW, an epoch) resumed for a second epoch under
    "ddp", "flatgrad" and "flatgrad_data_parallel"; its optimizer state loaded into a plain
    torch AdamW; a "ddp" checkpoint resumed under the sharded strategy. Oracle: "ddp" fit for
    the two epochs at once (and its checkpoint after one, for the optimizer state's form).
    Tolerance 1e-12, as the other cases: float64, the same local gradients on both sides."""
    run_ranks(_cross_case, sharded, str(tmp_path), timeout=240.0)


def _mixed_case(rank: int, world_size: int, precision: str) -> None:
    _as_torchrun(rank, world_size)
    results = {}
    for name in ("ddp", "flatgrad", "flatgrad_data_parallel", "flatgrad_sharded"):
        module = LitLM()
        plugins = []
        if precision == "16-mixed":  # a small first scale: no step skipped for overflow
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**6, growth_interval=1)
            plugins = [L.pytorch.plugins.MixedPrecision("16-mixed", "cpu", scaler=scaler)]
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=name, max_epochs=1, accumulate_grad_batches=2,
            gradient_clip_val=CLIP, plugins=plugins, precision=None if plugins else precision, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(module, _loader())
        results[name] = _params(module)
    for p, q in zip(results["ddp"], _params(LitLM())):
        assert not torch.equal(p, q)  # every step stepped (none skipped for an overflow)
    for name in ("flatgrad", "flatgrad_data_parallel", "flatgrad_sharded"):
        for p, q in zip(results[name], results["ddp"]):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.distributed
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_strategies_under_mixed_precision_train_as_lightning_ddp(precision: str) -> None:
    """Mixed precision (float32 weights and gradients, bfloat16/float16 autocast; "16-mixed"
    with a loss scaler, which the sharded strategy makes a flatgrad.GradScaler and unscales
    before clipping): an epoch with accumulation and clipping equals "ddp"'s. Both sides run
    the same autocast ops and add the same two halves; 1e-6 leaves room for float32
    round-off in the norm (seen: equal)."""
    run_ranks(_mixed_case, precision, timeout=240.0)


def _refit_case(rank: int, world_size: int) -> None:
    _as_torchrun(rank, world_size)
    results = {}
    for name in ("ddp", "flatgrad", "flatgrad_data_parallel", "flatgrad_sharded"):
        module = LitLM()
        _trainer(name, 1).fit(module, _loader())
        _trainer(name, 1).fit(module, _loader())  # a new Trainer (and strategy), the same module
        results[name] = _params(module)
    for name in ("flatgrad", "flatgrad_data_parallel", "flatgrad_sharded"):
        for p, q in zip(results[name], results["ddp"]):
            _assert_close(p, q, name)


@pytest.mark.distributed
def test_a_second_fit_of_the_same_module_wraps_it_again() -> None:
    """A module fit once and then again by a new Trainer: the second strategy wraps it again
    (the first fit's wrapper, left in reference cycles, is collected first: a parameter lives
    in one FlatGrad's buffer) and trains on as "ddp" does (the second fit's optimizer is
    new, as under "ddp")."""
    run_ranks(_refit_case, timeout=240.0)


class LitGAN(L.LightningModule):
    """A GAN-like LightningModule in manual optimization: two optimizers (Adam, SGD with
    momentum), ``toggle_optimizer`` / ``manual_backward`` / ``untoggle_optimizer``, and the
    generator's loss accumulated over two halves of the batch, the first inside
    ``trainer.strategy.block_backward_sync()`` (local), the second averaging, then clipped
    by norm while the discriminator is frozen. Under ``"flatgrad_sharded"`` the two are
    ShardedOptimizers by tensor over one DataParallel, which follow the parameters each
    toggle freezes and unfreezes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: torch.Tensor, _: int) -> None:
        opt_g, opt_d = self.optimizers()  # type: ignore[misc]
        noise, real = batch[:, :8], batch[:, 8:]
        self.toggle_optimizer(opt_g)
        for i, half in enumerate(noise.chunk(2)):
            local = self.trainer.strategy.block_backward_sync() if i == 0 else contextlib.nullcontext()
            with local:
                fake = self.generator(half)
                self.manual_backward(nn.functional.softplus(-self.discriminator(fake)).mean() / 2)
        self.clip_gradients(opt_g, 0.05, gradient_clip_algorithm="norm")  # (the discriminator frozen)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        fake = self.generator(noise).detach()
        loss_real = nn.functional.softplus(-self.discriminator(real)).mean()
        self.manual_backward(loss_real + nn.functional.softplus(self.discriminator(fake)).mean())
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)

    def configure_optimizers(self) -> Any:
        return [
            torch.optim.Adam(self.generator.parameters(), lr=1e-2),
            torch.optim.SGD(self.discriminator.parameters(), lr=1e-1, momentum=0.9),
        ]


class _AccumulatedByHand(L.LightningModule):
    """Manual optimization accumulating by hand: a `manual_backward` (averaging) per batch, a step and
    zero_grad every second batch, so the second backward adds onto the first's averages."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: torch.Tensor, index: int) -> None:
        self.manual_backward(self.net(batch).square().mean())
        if index % 2:
            optimizer = self.optimizers()
            optimizer.step()  # type: ignore[union-attr]
            optimizer.zero_grad()  # type: ignore[union-attr]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _manual_fit(strategy: Any, model: str) -> list[torch.Tensor]:
    """One epoch of Lightning's own ManualOptimBoringModel (SGD, one manual_backward per
    step), of `_AccumulatedByHand` or of `LitGAN`, in float64; the parameters after it."""
    from lightning.pytorch.demos.boring_classes import ManualOptimBoringModel, RandomDataset

    torch.manual_seed(0)
    if model == "boring":
        module: L.LightningModule = ManualOptimBoringModel()
        data = torch.utils.data.DataLoader(RandomDataset(32, 16), batch_size=2)
    elif model == "by_hand":
        module = _AccumulatedByHand()
        data = torch.utils.data.DataLoader(torch.randn(32, 16), batch_size=4)
    else:
        module = LitGAN()
        data = torch.utils.data.DataLoader(torch.randn(16, 16), batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, precision="64-true", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, data)
    return _params(module)


# The oracle per model: the GAN leaves each network's parameters without gradients in the
# other's backwards, which DDP allows with find_unused_parameters=True only.
_MANUAL_ORACLE = {"boring": "ddp", "by_hand": "ddp", "gan": "ddp_find_unused_parameters_true"}
_MANUAL_STOCK: dict[str, list[torch.Tensor]] = {}  # per rank process, per model


def _manual_case(rank: int, world_size: int, name: str, model: str) -> None:
    _as_torchrun(rank, world_size)
    if model not in _MANUAL_STOCK:
        _MANUAL_STOCK[model] = _manual_fit(_MANUAL_ORACLE[model], model)
    stock = _MANUAL_STOCK[model]
    strategies: dict[str, Any] = {
        "flatgrad": lambda: flatgrad.lightning.FlatGradDDPStrategy(find_unused_parameters=model == "gan"),
    }
    ours = _manual_fit(strategies.get(name, lambda: name)(), model)
    for p, q in zip(ours, stock):
        torch.testing.assert_close(p, q, rtol=MANUAL_TOL, atol=MANUAL_TOL)
    peer = [p.clone() for p in ours]  # (the same on every rank: rank 0's)
    for tensor in peer:
        torch.distributed.broadcast(tensor, src=0)
    for p, q in zip(ours, peer):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=lambda m: f"the ranks diverged: {m}")


MANUAL_TOL = 1e-10


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("name", "model"),
    [
        (name, model)
        for name in ("flatgrad", "flatgrad_data_parallel", "flatgrad_sharded")
        for model in ("boring", "by_hand", "gan")
    ],
)
def test_manual_optimization_trains_as_lightning_ddp(name: str, model: str) -> None:
    """Manual optimization (``manual_backward`` runs inside the wrapper's forward, where
    Lightning calls training_step): Lightning's ManualOptimBoringModel, two averaging backwards a step
    (by element the second met the first's reduce-scattered gradients before it opened: SGD 3.3e-2 off
    silently; now the strategy sets them aside before it) and a GAN-like module
    (two optimizers, toggle_optimizer under every strategy, a half accumulated in
    block_backward_sync()) equal Lightning's DDP after an epoch, and the ranks agree exactly.
    Oracle: "ddp" (the GAN: "ddp_find_unused_parameters_true", which lets each network go
    without gradients in the other's backward). Tolerance 1e-10: float64, both sides average the same local
    gradients, and may differ in round-off only where the half accumulated locally here is
    averaged by itself there (averaging is linear); seen: equal."""
    run_ranks(_manual_case, name, model, timeout=240.0)


def _value_clipping_case(rank: int, world_size: int) -> None:
    _as_torchrun(rank, world_size)
    finals = {}
    for name in ("ddp", "element", "tensor"):
        strategy = name if name == "ddp" else flatgrad.lightning.FlatGradShardedStrategy(shard_by=name)
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, gradient_clip_val=0.02,
            gradient_clip_algorithm="value", logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        torch.manual_seed(0)
        module = LitLM()
        trainer.fit(module, _loader())
        finals[name] = _params(module)
    for name in ("element", "tensor"):
        for ours, stock in zip(finals[name], finals["ddp"]):
            torch.testing.assert_close(ours, stock, rtol=0, atol=1e-12)
    strategy = flatgrad.lightning.FlatGradShardedStrategy(shard_by="element")
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match="shard_by must be 'tensor' or None under flatgrad_sharded with 2"):
        trainer.fit(LitGAN(), torch.utils.data.DataLoader(torch.randn(8, 16), batch_size=4))


@pytest.mark.distributed
def test_sharded_strategy_clips_by_value_as_ddp_and_refuses_several_optimizers_by_element() -> None:
    """Value clipping under flatgrad_sharded, both kinds, as under "ddp" (it was refused: by element the
    reduce-scattered `.grad`s now take element-wise edits)."""
    run_ranks(_value_clipping_case, timeout=120.0)


class _HeadOnly(L.LightningModule):
    """An optimizer over the head alone while the body still trains (requires_grad): Lightning clips the
    optimizer's parameters' gradients, not the model's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(3, 4).double(), nn.Linear(4, 1).double()

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.head(torch.tanh(self.body(batch[0]))), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.head.parameters(), lr=1.0)


def _partial_clipping_case(rank: int, world_size: int) -> None:
    _as_torchrun(rank, world_size)
    x = torch.randn(8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1] * 5), batch_size=2)
    finals = {}
    for name in ("ddp", "tensor", "element"):
        strategy = name if name == "ddp" else flatgrad.lightning.FlatGradShardedStrategy(shard_by=name)
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, gradient_clip_val=0.01,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        module = _HeadOnly()
        if name == "element":
            with pytest.raises(
                ValueError, match=r"does not hold every one that has a gradient.*shard_by='tensor'"
            ):
                trainer.fit(module, loader)
            continue
        trainer.fit(module, loader)
        finals[name] = _params(module)
    for ours, stock in zip(finals["tensor"], finals["ddp"]):
        torch.testing.assert_close(ours, stock, rtol=0, atol=1e-12)


@pytest.mark.distributed
def test_clipping_an_optimizer_over_part_of_the_model_clips_its_parameters_as_lightning_ddp() -> None:
    """Before, flatgrad_sharded clipped by the whole model's norm (by tensor, the head 1.3e-3 from ddp's
    after one epoch; with two optimizers stepped in turn, 0.19): now by the optimizer's own parameters
    where the gradients are readable (by tensor), and refused by element, whose shards hold every
    parameter's gradient together."""
    run_ranks(_partial_clipping_case, timeout=240.0)


class _Rebuilt(L.LightningModule):
    """Lightning's BoringModel (a Linear 32 -> 2) with the optimizer `how` names: SGD with momentum under a
    SequentialLR (a chained scheduler), lion_pytorch's Lion with ``decoupled_weight_decay=True`` (kept as an
    attribute, not in its defaults), or that Lion built as a ShardedOptimizer by the module itself."""

    def __init__(self, how: str) -> None:
        from lightning.pytorch.demos.boring_classes import BoringModel

        super().__init__()
        torch.manual_seed(0)
        self.how, self.boring = how, BoringModel()

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        return self.boring.training_step(batch, index)["loss"]

    def configure_optimizers(self) -> Any:
        lion = pytest.importorskip("lion_pytorch").Lion
        if self.how == "sequential":
            opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
            lrs = torch.optim.lr_scheduler
            warm, decay = lrs.LinearLR(opt, start_factor=0.25, total_iters=3), lrs.ExponentialLR(opt, 0.8)
            return [opt], [lrs.SequentialLR(opt, [warm, decay], milestones=[3])]
        arguments = dict(lr=0.01, weight_decay=0.5, decoupled_weight_decay=True)
        if self.how == "sharded lion":
            return flatgrad.ShardedOptimizer(self, lion, self.parameters(), **arguments)
        return lion(self.parameters(), **arguments)


def _rebuild_case(rank: int, world_size: int) -> None:
    _as_torchrun(rank, world_size)
    data = torch.randn(32, 32, generator=torch.Generator().manual_seed(1))
    finals = {}
    for how, name in [
        *((h, s) for h in ("sequential", "lion") for s in ("ddp", "flatgrad_sharded", "tensor")),
        ("sharded lion", "flatgrad_sharded"),
    ]:
        strategy = flatgrad.lightning.FlatGradShardedStrategy(shard_by="tensor") if name == "tensor" else name
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, precision="64-true", logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        module, loader = _Rebuilt(how), torch.utils.data.DataLoader(data, batch_size=2)
        if how == "lion" and name != "ddp":
            with pytest.raises(
                ValueError, match=r"do not give back \['decoupled_wd'\].*ShardedOptimizer\(self"
            ):
                trainer.fit(module, loader)
            continue
        trainer.fit(module, loader)
        finals[how, name] = _params(module) + [torch.tensor(trainer.optimizers[0].param_groups[0]["lr"])]
    for (how, name), ours in finals.items():
        stock = finals[how.removeprefix("sharded "), "ddp"]
        for a, b in zip(ours, stock):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=lambda m, w=(how, name): f"{w}: {m}")


def test_the_rebuild_check_compares_an_optimizer_kept_inside_by_its_options() -> None:
    """SPAM keeps a warm-up SGD under a scheduler, which wraps the SGD's step in a closure: compared by its
    options, SPAM with its defaults is rebuilt (it was refused), and an argument kept only as an attribute is
    still refused."""
    from flatgrad.lightning import _rebuilt_arguments

    spam = pytest.importorskip("pytorch_optimizer").SPAM
    assert _rebuilt_arguments(spam([nn.Parameter(torch.randn(4, 4))], lr=0.01))["lr"] == 0.01
    with pytest.raises(ValueError, match=r"do not give back \['warmup', 'warmup_epoch'\]"):
        _rebuilt_arguments(spam([nn.Parameter(torch.randn(4, 4))], warmup_epoch=7))


@pytest.mark.distributed
def test_the_sharded_strategy_rebuilds_the_optimizer_with_its_arguments_and_chained_schedulers() -> None:
    """Before, flatgrad_sharded pointed only a scheduler's own optimizer at the rebuilt one (SequentialLR's
    schedulers kept writing the lr into the old optimizer: 9.5e-2 from ddp), and rebuilt Lion from its
    defaults without ``decoupled_weight_decay`` (0.2 from ddp). Now chained schedulers follow, and a class
    whose constructor arguments its rebuild would not give back is refused, naming the fix that then equals
    ddp."""
    run_ranks(_rebuild_case, timeout=300.0)


class _NormedVal(L.LightningModule):
    """A BatchNorm MLP validated every epoch: its running statistics differ between ranks that see
    differently distributed data, until rank 0's are broadcast."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1)).double()
        self.losses: list[float] = []

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch: Any, index: int) -> None:
        self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]), sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        self.losses.append(float(self.trainer.callback_metrics["val_loss"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _validation_buffers_case(rank: int, world_size: int) -> None:
    _as_torchrun(rank, world_size)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(16, 4, generator=generator, dtype=torch.float64)
    x[8:] = 3 * x[8:] + 2  # (rank 1's half of every epoch: other statistics)
    val = torch.randn(8, 4, generator=generator, dtype=torch.float64)
    loaders = [
        torch.utils.data.DataLoader(torch.utils.data.TensorDataset(v, v.sum(1, keepdim=True)), batch_size=4)
        for v in (x, val)
    ]
    runs = {}
    for name in ("ddp", "flatgrad_data_parallel", "flatgrad_sharded"):
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=name, max_epochs=2, logger=False, num_sanity_val_steps=0,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        module = _NormedVal()
        trainer.fit(module, *loaders)
        runs[name] = (module.losses, [t.detach().clone() for t in module.state_dict().values()])
    for name in ("flatgrad_data_parallel", "flatgrad_sharded"):
        assert runs[name][0] == pytest.approx(runs["ddp"][0], rel=0, abs=1e-12), name
        for ours, stock in zip(runs[name][1], runs["ddp"][1]):
            torch.testing.assert_close(ours, stock, rtol=0, atol=1e-12)


@pytest.mark.distributed
def test_validation_during_fit_uses_rank_0s_buffers_as_lightning_ddp() -> None:
    """Before, the replicate strategies validated with each rank's own BatchNorm statistics (Lightning
    called validation_step directly, past the replicated module's call that broadcasts rank 0's buffers
    before the first forward after a synchronised training one, as DDP's forward does): val_loss 7.40
    against ddp's 6.99 after the first epoch, and rank 1 ended with other running statistics."""
    run_ranks(_validation_buffers_case, timeout=240.0)


def test_the_strategies_are_registered_by_name() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["flatgrad"]["strategy"] is flatgrad.lightning.FlatGradDDPStrategy
    assert (
        StrategyRegistry["flatgrad_data_parallel"]["strategy"]
        is flatgrad.lightning.FlatGradDataParallelStrategy
    )
    assert StrategyRegistry["flatgrad_sharded"]["strategy"] is flatgrad.lightning.FlatGradShardedStrategy


FRAMEWORKS = ("lightning", "pytorch_lightning", "transformers", "accelerate")


def _imported(tree: ast.Module) -> set[str]:
    """Every module `tree` imports, at the top or inside a function (absolute names)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_importing_flatgrad_imports_no_framework() -> None:
    """The modules ``import flatgrad`` loads (its import closure, from the source: no
    interpreter to start) import no framework, anywhere in them; flatgrad.lightning is not
    among them, and it imports Lightning itself."""
    package = Path(flatgrad.__file__).parent
    imports = {path.stem: _imported(ast.parse(path.read_text())) for path in package.glob("*.py")}
    loaded, todo = set(), ["__init__"]
    while todo:
        module = todo.pop()
        loaded.add(module)
        for name in imports[module]:
            parts = name.split(".")
            if parts[0] == "flatgrad" and len(parts) > 1 and parts[1] in imports and parts[1] not in loaded:
                todo.append(parts[1])
    assert "lightning" not in loaded and "lightning" in {n.split(".")[0] for n in imports["lightning"]}
    for module in sorted(loaded):
        assert not {n for n in imports[module] if n.split(".")[0] in FRAMEWORKS}, module


def test_strategy_arguments_are_checked() -> None:
    with pytest.raises(TypeError, match="ddp_comm_hook must not be given"):
        flatgrad.lightning.FlatGradDDPStrategy(ddp_comm_hook=flatgrad.allreduce_hook)
    with pytest.raises(ValueError, match="bucket_cap_mb must be left to FlatGrad.ddp_kwargs()"):
        flatgrad.lightning.FlatGradDDPStrategy(bucket_cap_mb=100)
    with pytest.raises(
        TypeError, match=r"keyword arguments must be DDPStrategy's own .*got \['static_graph'\]"
    ):
        flatgrad.lightning.FlatGradDataParallelStrategy(static_graph=True)
    with pytest.raises(TypeError, match="FlatGradShardedStrategy's keyword arguments must be"):
        flatgrad.lightning.FlatGradShardedStrategy(find_unused_parameters=True)


def test_the_plain_state_warns_once_that_master_weights_are_left_out(caplog):
    """bfloat16 weights with float32 master shards, saved in a plain optimizer's form (which
    has no place for masters): one warning per save naming the dtype, not one per parameter."""
    from flatgrad.bench.suite import single_rank_group

    with single_rank_group("gloo", torch.device("cpu")):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).to(torch.bfloat16)
        model = flatgrad.replicate(flatgrad.FlatGrad(model, config={"grad_dtype": "float32"}))
        opt = flatgrad.ShardedOptimizer(model, torch.optim.AdamW, model.parameters(), lr=1e-3)
        model(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
        with caplog.at_level("WARNING", logger="flatgrad.lightning"):
            state = flatgrad.lightning.plain_optimizer_state(opt)
    warned = [r.getMessage() for r in caplog.records if "master weights are not saved" in r.getMessage()]
    assert len(warned) == 1 and "torch.bfloat16" in warned[0]
    assert sorted(state["state"]) == [0, 1, 2, 3] and "master" not in str(list(state["state"][0]))


class _Finetuned(L.LightningModule):
    """A backbone that Lightning's BackboneFinetuning keeps frozen for the first epoch, then unfreezes
    with a param group of its own (`add_param_group`), under a head trained from the start."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone, self.head = nn.Sequential(nn.Linear(32, 16), nn.Tanh()), nn.Linear(16, 2)

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        return self.head(self.backbone(batch)).square().sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=0.01)


def _finetuning_case(rank: int, world_size: int) -> None:
    from lightning.pytorch.callbacks import BackboneFinetuning

    _as_torchrun(rank, world_size)
    data = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    finals = {}
    for name in ("flatgrad_data_parallel", "flatgrad_sharded"):
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=name, max_epochs=3, precision="64-true", logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.0)],
        )  # fmt: skip
        module = _Finetuned()
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
        finals[name] = torch.cat([p.flatten() for p in _params(module)])
    everywhere = [torch.empty_like(finals["flatgrad_sharded"]) for _ in range(world_size)]
    torch.distributed.all_gather(everywhere, finals["flatgrad_sharded"])
    torch.testing.assert_close(everywhere[0], everywhere[1], rtol=0, atol=0)  # (the backbone averaged too)
    sharded, data_parallel = finals["flatgrad_sharded"], finals["flatgrad_data_parallel"]
    torch.testing.assert_close(sharded, data_parallel, rtol=0, atol=1e-12)


@pytest.mark.distributed
def test_backbone_finetuning_unfreezes_into_the_sharded_optimizer() -> None:
    """Lightning's BackboneFinetuning under flatgrad_sharded (by element): the backbone, frozen when the
    optimizer was built, is laid out at the forward after its unfreezing, which meets the last step's
    reduce-scattered gradients (Lightning zeroes after the forward): it crashed reading them. Now equal to
    flatgrad_data_parallel (a torch Adam, averaged as DDP averages) and the same on both ranks. (Lightning's
    own "ddp" never averages the backbone: DDP skips what was frozen when it wrapped, and the ranks'
    backbones drift apart, 1.1e-2 after three epochs.)"""
    run_ranks(_finetuning_case, timeout=300.0)
