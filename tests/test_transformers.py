"""A plain `transformers.Trainer` over a model with FlatGrad applied, in one process: the
decisions Trainer takes by the class of its model are the plain model's, because the model
is still of its class. Training, saving, loading and resuming on 2 processes against a
plain Trainer are tests/test_frameworks.py's."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_llama

import flatgrad

transformers = pytest.importorskip("transformers", reason="pip install -e '.[dev,frameworks]'")
pytest.importorskip("accelerate", reason="pip install -e '.[dev,frameworks]'")
flatgrad_accelerate = pytest.importorskip("flatgrad.accelerate")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _args(path: Path, **options: Any) -> Any:
    return transformers.TrainingArguments(output_dir=str(path), report_to=[], use_cpu=True, **options)


def test_the_model_stays_a_llama_with_its_own_names_and_signature():
    """``FlatGrad(llama) is llama``: still a `LlamaForCausalLM` (and a `FlatGrad`), with
    the same state_dict keys, parameter names and forward signature as a plain one."""
    plain, model = tiny_llama(), tiny_llama()
    assert flatgrad.FlatGrad(model) is model
    assert isinstance(model, transformers.LlamaForCausalLM) and isinstance(model, flatgrad.FlatGrad)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert list(model.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert inspect.signature(model.forward) == inspect.signature(plain.forward)


def test_ddp_arguments_are_the_plain_models_and_attach_adds_the_hook(tmp_path):
    """With activation checkpointing a plain Trainer gives a llama with FlatGrad applied the
    plain model's DDP ``find_unused_parameters=False`` (it is a PreTrainedModel still);
    ``attach(trainer.accelerator, model)``, the one call flatgrad needs, makes the
    accelerator's DDP handler `FlatGradDDPKwargs` with the plain settings plus `ddp_kwargs`."""
    args = _args(tmp_path, gradient_checkpointing=True)
    plain = transformers.Trainer(model=tiny_llama(), args=args).accelerator.ddp_handler
    model = flatgrad.FlatGrad(tiny_llama())
    trainer = transformers.Trainer(model=model, args=args)
    assert trainer.accelerator.ddp_handler.to_kwargs() == plain.to_kwargs()
    state = flatgrad_accelerate.attach(trainer.accelerator, model)
    ours = trainer.accelerator.ddp_handler
    assert isinstance(ours, flatgrad_accelerate.FlatGradDDPKwargs) and ours.flatgrad_comm_state is state
    assert state.model is model
    assert ours.to_kwargs() == {**plain.to_kwargs(), **model.ddp_kwargs()}


def test_a_tied_lm_saves_as_the_plain_model_and_loads_with_from_pretrained(tmp_path):
    """A plain Trainer saves a tied llama with FlatGrad applied through its own
    ``save_pretrained``: the same files as for the plain model (``config.json`` naming
    ``LlamaForCausalLM``), which ``from_pretrained`` loads with the head tied again and the
    same (bit-equal) weights."""
    model = tiny_llama()
    transformers.Trainer(model=flatgrad.FlatGrad(model), args=_args(tmp_path / "ours")).save_model()
    transformers.Trainer(model=tiny_llama(), args=_args(tmp_path / "stock")).save_model()
    files = {p.name for p in (tmp_path / "stock").iterdir()}
    assert {p.name for p in (tmp_path / "ours").iterdir()} == files and "config.json" in files
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float64)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    for (name, p), q in zip(loaded.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name
