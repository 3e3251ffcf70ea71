"""The framework recipes (examples/lightning_train.py, examples/accelerate_train.py,
examples/trainer_train.py) on 2 CPU processes under torchrun or ``accelerate launch`` (gloo,
127.0.0.1); then, in one process, transformers' `Trainer` choosing the parameters it decays
by name, on the wrapper as on the plain model.

Each recipe runs twice in the same 2 processes (``--compare``), with flatgrad and as the same
framework's stock DDP run, and reports per step (examples/recipe_probe.py): the comm hook's
calls so far (one bucket: one call per step), gradient-sized copy ops the profiler saw in
backward, and whether every `.grad` was a view of `flat.grad_buffers`. Oracle for the
result: the stock run's final parameters; float64 and two ranks, so both sides add the same
two halves and differ only by round-off in the layer backwards (1e-12).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_llama
from torch import nn

import flatgrad

ROOT = Path(__file__).resolve().parent.parent
STEPS = 4
DEADLINE_S = 180  # a run takes 15-30 s; a hung rendezvous or collective must not hang the suite


def _needs(package: str) -> None:
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed: pip install -e '.[dev,frameworks]'")


TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
# accelerate launch with the repository's 2-process config (which starts torch.distributed.run:
# see the file's comment and docs/integrations.md)
ACCELERATE_LAUNCH = (
    sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate_2cpu.yaml",
)  # fmt: skip


def _run(
    script: str, report: Path, *extra: str, launcher: tuple[str, ...] = TORCHRUN
) -> tuple[dict[str, Any], str]:
    """Launch the example on 2 processes; returns rank 0's reports (by run) and the output."""
    command = [*launcher, f"examples/{script}", "--steps", str(STEPS), "--report", str(report), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: on timeout the ranks die with torchrun
    )  # fmt: skip
    try:
        output, _ = process.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{script} did not finish within {DEADLINE_S} s:\n{output[-3000:]}")
    assert process.returncode == 0, output[-6000:]
    return json.loads(report.read_text()), output


def _assert_params_equal(ours: dict[str, Any], stock: dict[str, Any]) -> None:
    assert len(ours["params"]) == len(stock["params"])
    for p, q in zip(ours["params"], stock["params"]):
        torch.testing.assert_close(torch.tensor(p), torch.tensor(q), rtol=1e-12, atol=1e-12)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("script", "package", "launcher"),
    [("accelerate_train.py", "accelerate", ACCELERATE_LAUNCH), ("lightning_train.py", "lightning", TORCHRUN)],
    ids=["accelerate_launch_attach", "lightning"],
)
def test_recipe_runs_the_hook_once_per_step_without_copies_and_matches_stock(
    tmp_path: Path, script: str, package: str, launcher: tuple[str, ...]
) -> None:
    """Accelerate: `flatgrad.accelerate.attach`, the one call, under ``accelerate launch``
    with configs/accelerate_2cpu.yaml."""
    _needs(package)
    reports, output = _run(script, tmp_path / "report.json", "--compare", launcher=launcher)
    ours, stock = reports["flatgrad"], reports["stock"]
    assert ours["world_size"] == stock["world_size"] == 2
    assert ours["hook_calls"] == list(range(1, STEPS + 1))  # one all-reduce of the one buffer per step
    assert stock["num_calls"] == 0
    assert ours["grads_in_buffers"] == [True] * STEPS
    # Steps 0 and 1 copy once into DDP's first buckets (allocated before the hook adopts them, and
    # again at DDP's bucket rebuild in iteration 2); from then on nothing is copied but a Linear
    # weight's product whose place in the packed bucket is off a fresh tensor's alignment (copied
    # in for stock's bits: docs/ddp.md). Stock DDP copies every weight matrix into its bucket and
    # back every step: the counter sees copies.
    assert ours["grad_copies"][2:] == ours["off_alignment"][2:], ours
    assert all(n > 0 for n in stock["grad_copies"]), stock["grad_copies"]
    assert "allreduce_hook has not run" not in output
    assert "largest parameter difference" in output
    _assert_params_equal(ours, stock)


@pytest.mark.distributed
def test_lightning_hook_given_to_ddp_strategy_never_runs_on_cpu_and_flatgrad_says_so(tmp_path: Path) -> None:
    """The recipe Lightning's docs suggest, `DDPStrategy(ddp_comm_hook=...)`, registers the hook
    on CUDA only: on CPU it never runs, DDP copies, and flatgrad logs that once per rank."""
    _needs("lightning")
    reports, output = _run("lightning_train.py", tmp_path / "report.json", "--hook-via-lightning")
    report = reports["flatgrad"]
    assert report["hook_calls"] == [0] * STEPS
    assert all(n > 0 for n in report["grad_copies"]), report["grad_copies"]
    assert output.count("allreduce_hook has not run in 2 steps") == 2, output[-6000:]
    assert "register it yourself on CPU" in output


@pytest.mark.distributed
def test_trainer_defaults_train_save_load_and_resume_a_tied_lm_as_stock(tmp_path: Path) -> None:
    """examples/trainer_train.py on 2 processes: a plain Trainer over ``FlatGrad(llama)``
    (``attach`` called on its accelerator)
    (tied embeddings, float64) with Trainer's defaults (``remove_unused_columns=True``: the
    dataset has a column the model does not take; ``save_strategy="steps"``), against a
    plain `transformers.Trainer` on the plain model. Equal losses and final parameters; the
    last checkpoints load with ``from_pretrained`` to equal parameters, the LM head tied
    again; resumed from the first checkpoint, the run ends where the uninterrupted stock run
    does; the hook ran once per step (one bucket). 1e-12: float64, two ranks, the same sums."""
    _needs("transformers")
    _needs("accelerate")
    report, output = _run("trainer_train.py", tmp_path / "report.json", "--out", str(tmp_path), "--compare")
    runs, loaded = report["runs"], report["loaded"]
    ours, stock, resumed = runs["flatgrad"], runs["stock"], runs["resumed"]
    assert ours["world_size"] == stock["world_size"] == resumed["world_size"] == 2
    assert ours["hook_calls"] == STEPS and stock["hook_calls"] == 0
    assert resumed["hook_calls"] == STEPS - 2  # resumed after checkpoint-2
    assert len(ours["losses"]) == STEPS and ours["losses"] == pytest.approx(stock["losses"], rel=1e-12, abs=0)
    # the first two from checkpoint-2's trainer state, the last two trained after resuming
    assert resumed["losses"] == pytest.approx(stock["losses"], rel=1e-12, abs=0)
    _assert_params_equal(ours, stock)
    _assert_params_equal(resumed, stock)
    assert loaded["flatgrad"]["tied"] and loaded["stock"]["tied"] and loaded["resumed"]["tied"]
    _assert_params_equal(loaded["flatgrad"], loaded["stock"])
    _assert_params_equal(loaded["flatgrad"], ours)  # the last checkpoint holds the final weights
    _assert_params_equal(loaded["resumed"], stock)
    assert "allreduce_hook has not run" not in output


# --- transformers' Trainer: weight decay chosen by name --------------------------------------


def _clip() -> nn.Module:
    """A tiny CLIP: a transformers model with a parameter at its root (``logit_scale``)."""
    transformers = pytest.importorskip("transformers", reason="pip install -e '.[dev,frameworks]'")
    torch.manual_seed(0)
    text = dict(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=16, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )  # fmt: skip
    vision = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8
    )
    config = transformers.CLIPConfig(
        text_config=text, vision_config={**vision, "patch_size": 4}, projection_dim=8
    )
    return transformers.CLIPModel(config).double()


def _lora(model: nn.Module) -> nn.Module:
    peft = pytest.importorskip("peft", reason="pip install -e '.[dev,frameworks]'")
    torch.manual_seed(1)
    return peft.get_peft_model(
        model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    )


def _wrapped(case: str) -> tuple[nn.Module, nn.Module, dict[str, nn.Parameter]]:
    """The model given to Trainer, the plain model it stands for (the same weights), and the
    given model's parameters by plain name, read under the wrapper (not through it)."""
    builders = {
        "llama": tiny_llama,
        "clip_root_parameter": _clip,
        "peft_then_flatgrad": lambda: _lora(tiny_llama()),
    }
    build = builders[case]
    flat = flatgrad.FlatGrad(build())
    return flat, build(), dict(flat.named_parameters())


def _trainer(model: nn.Module, output_dir: Path, dataset: Any = None, **options: Any) -> Any:
    transformers = pytest.importorskip("transformers", reason="pip install -e '.[dev,frameworks]'")
    pytest.importorskip("accelerate", reason="pip install -e '.[dev,frameworks]'")
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), weight_decay=0.1, report_to=[], save_strategy="no", use_cpu=True,
        seed=0, disable_tqdm=True, **options,
    )  # fmt: skip
    return transformers.Trainer(model=model, args=args, train_dataset=dataset)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("case", ["llama", "clip_root_parameter", "peft_then_flatgrad"])
def test_trainer_decays_the_parameters_of_a_wrapped_model_it_decays_on_the_plain_one(tmp_path, case):
    """Trainer names the parameters it decays by recursing `named_children` and reading each
    module's own ``_parameters``, then matches those names against `named_parameters`: its
    decay names and optimizer groups (weight decay and the very parameters, in order) equal
    the plain model's; also for a parameter at the model's root (CLIP's ``logit_scale``) and
    for a peft model with FlatGrad applied."""
    given, plain, by_name = _wrapped(case)
    ours, stock = _trainer(given, tmp_path / "flat"), _trainer(plain, tmp_path / "stock")
    names = stock.get_decay_parameter_names(plain)
    assert ours.get_decay_parameter_names(given) == names
    plain_names = {id(p): n for n, p in plain.named_parameters()}
    groups, ref_groups = ours.create_optimizer().param_groups, stock.create_optimizer().param_groups
    assert [g["weight_decay"] for g in groups] == [g["weight_decay"] for g in ref_groups] == [0.1, 0.0]
    assert ref_groups[0]["params"]  # something to decay
    for group, ref in zip(groups, ref_groups):
        assert [id(p) for p in group["params"]] == [id(by_name[plain_names[id(q)]]) for q in ref["params"]]


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids.clone()}


def test_peft_applied_after_flatgrad_is_refused_at_the_next_backward_naming_the_layers():
    """PEFT replaces the layers it adapts, which after FlatGrad laid out the buffers would
    leave stale slots: the next backward raises as it starts, naming the replaced parameters and
    the fix; after ``relayout()`` it trains, every trainable `.grad` in the buffers."""
    model = flatgrad.FlatGrad(tiny_llama())
    peft_model = _lora(model)
    ids = torch.randint(0, 97, (2, 8))
    with pytest.raises(RuntimeError, match=r"q_proj.*\(added\).*model.relayout\(\)"):
        peft_model(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        peft_model(input_ids=ids, labels=ids)  # (evaluation is left alone)
    model.relayout()
    peft_model(input_ids=ids, labels=ids).loss.backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.grad is not None for p in trainable)
    storages = {b.untyped_storage().data_ptr() for b in model.grad_buffers.values()}
    assert all(p.grad.untyped_storage().data_ptr() in storages for p in trainable)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_trainer_with_weight_decay_trains_a_wrapped_model_as_stock(tmp_path):
    """`Trainer(model=FlatGrad(model))` with ``weight_decay=0.1`` (a tied Llama in float64,
    two accumulated micro-batches per step, clipping, AdamW and a schedule): losses,
    gradient norms and parameters equal a Trainer on the plain model's, to float64
    round-off (the same sums; 1e-12), so the same parameters were decayed."""
    flat, plain = flatgrad.FlatGrad(tiny_llama()), tiny_llama()

    def train(model: nn.Module, name: str) -> list[dict[str, float]]:
        trainer = _trainer(
            model, tmp_path / name, _Tokens(), per_device_train_batch_size=4, gradient_accumulation_steps=2,
            max_steps=3, learning_rate=1e-2, max_grad_norm=1.0, logging_steps=1,
        )  # fmt: skip
        trainer.train()
        logs = trainer.state.log_history
        return [{k: v for k, v in log.items() if k in ("loss", "grad_norm")} for log in logs]

    ours, stock = train(flat, "flat"), train(plain, "stock")
    assert len(ours) == 4 and all("loss" in log for log in ours[:3])
    for mine, theirs in zip(ours, stock):
        assert mine.keys() == theirs.keys()
        for key in mine:
            assert mine[key] == pytest.approx(theirs[key], rel=1e-12, abs=0), key
    for (name, p), q in zip(flat.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


class _TokensWithIndex(_Tokens):
    """`_Tokens` and an ``index`` column the model does not take (Trainer drops it by the
    forward's signature: for a PeftModel, the base model's)."""

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**super().__getitem__(index), "index": index}


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_trainer_trains_saves_and_resumes_a_lora_model_with_flatgrad_applied_as_stock(tmp_path):
    """A LoRA PeftModel of a tied Llama (float64) with FlatGrad applied, under a plain
    `transformers.Trainer` with its defaults (``remove_unused_columns=True``: the dataset has a
    column the model does not take; a checkpoint every 2 steps): losses and adapters equal a
    plain Trainer's on the plain PeftModel (1e-12); the checkpoint holds the adapter, which
    ``PeftModel.from_pretrained`` loads to the trained values; resumed from the first
    checkpoint it ends where the uninterrupted stock run does."""
    transformers = pytest.importorskip("transformers", reason="pip install -e '.[dev,frameworks]'")
    peft = pytest.importorskip("peft", reason="pip install -e '.[dev,frameworks]'")

    def run(model: nn.Module, out: Path, resume: str | None = None) -> list[float]:
        args = transformers.TrainingArguments(
            output_dir=str(out), max_steps=4, save_steps=2, per_device_train_batch_size=4, learning_rate=1e-2,
            logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
        )  # fmt: skip
        trainer = transformers.Trainer(model=model, args=args, train_dataset=_TokensWithIndex())
        trainer.train(resume_from_checkpoint=resume)
        return [log["loss"] for log in trainer.state.log_history if "loss" in log]

    def adapters(model: nn.Module) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}

    stock = _lora(tiny_llama())
    ours = flatgrad.FlatGrad(_lora(tiny_llama()))
    assert isinstance(ours, peft.PeftModel)
    stock_losses, our_losses = run(stock, tmp_path / "stock"), run(ours, tmp_path / "ours")
    assert len(our_losses) == 4 and our_losses == pytest.approx(stock_losses, rel=1e-12, abs=0)
    want = adapters(stock)
    for name, value in adapters(ours).items():
        torch.testing.assert_close(value, want[name], rtol=1e-12, atol=1e-12, msg=name)
    checkpoint = tmp_path / "ours" / "checkpoint-4"
    assert (checkpoint / "adapter_model.safetensors").exists()
    loaded = peft.PeftModel.from_pretrained(tiny_llama(), checkpoint)
    for name, value in adapters(loaded).items():
        torch.testing.assert_close(value, want[name], rtol=1e-12, atol=1e-12, msg=name)
    resumed = flatgrad.FlatGrad(_lora(tiny_llama()))
    resumed_losses = run(resumed, tmp_path / "ours", resume=str(tmp_path / "ours" / "checkpoint-2"))
    assert resumed_losses[-2:] == pytest.approx(stock_losses[-2:], rel=1e-12, abs=0)
    for name, value in adapters(resumed).items():
        torch.testing.assert_close(value, want[name], rtol=1e-12, atol=1e-12, msg=name)
