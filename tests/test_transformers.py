"""`flatgrad.transformers.FlatGradTrainer` in one process: the decisions Trainer takes by the
class of its model, made as for the plain model. Training, saving, loading and resuming on 2
processes against a plain Trainer are tests/test_frameworks.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_llama

import flatgrad

transformers = pytest.importorskip("transformers", reason="pip install -e '.[dev,frameworks]'")
pytest.importorskip("accelerate", reason="pip install -e '.[dev,frameworks]'")
flatgrad_transformers = pytest.importorskip("flatgrad.transformers")
flatgrad_accelerate = pytest.importorskip("flatgrad.accelerate")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _args(path: Path, **options: Any) -> Any:
    return transformers.TrainingArguments(output_dir=str(path), report_to=[], use_cpu=True, **options)


def test_ddp_arguments_are_the_plain_models_with_the_wrappers_ddp_kwargs(tmp_path):
    """With activation checkpointing a plain Trainer gives the plain model's DDP
    ``find_unused_parameters=False`` and a wrapper True (it is no PreTrainedModel);
    `FlatGradTrainer` gives the wrapper the plain model's, and its accelerator's DDP handler
    is `attach`'s. Given a plain model it is a plain Trainer."""
    args = _args(tmp_path, gradient_checkpointing=True)
    flat = flatgrad.FlatGrad(tiny_llama())
    plain = transformers.Trainer(model=tiny_llama(), args=args).accelerator.ddp_handler
    wrapper_alone = transformers.Trainer(
        model=flatgrad.FlatGrad(tiny_llama()), args=args
    ).accelerator.ddp_handler
    ours = flatgrad_transformers.FlatGradTrainer(model=flat, args=args).accelerator.ddp_handler
    assert plain.find_unused_parameters is False and wrapper_alone.find_unused_parameters is True
    assert (
        isinstance(ours, flatgrad_accelerate.FlatGradDDPKwargs) and ours.flatgrad_comm_state.wrapper is flat
    )
    assert ours.to_kwargs() == {**plain.to_kwargs(), **flat.ddp_kwargs()}
    unwrapped = flatgrad_transformers.FlatGradTrainer(model=tiny_llama(), args=args).accelerator.ddp_handler
    assert type(unwrapped) is type(plain) and unwrapped.to_kwargs() == plain.to_kwargs()


def test_a_tied_lm_saves_as_the_plain_model_and_loads_with_from_pretrained(tmp_path):
    """A plain Trainer saves a wrapper with `safetensors.torch.save_file`, which refuses the
    tied head; `FlatGradTrainer` saves it through the plain model's ``save_pretrained``, the
    same files as a plain Trainer writes for the plain model, which ``from_pretrained``
    loads with the head tied again and the same (bit-equal) weights."""
    model = tiny_llama()
    with pytest.raises(RuntimeError, match="Some tensors share memory"):
        transformers.Trainer(model=flatgrad.FlatGrad(tiny_llama()), args=_args(tmp_path / "a")).save_model()
    flatgrad_transformers.FlatGradTrainer(
        model=flatgrad.FlatGrad(model), args=_args(tmp_path / "ours")
    ).save_model()
    transformers.Trainer(model=tiny_llama(), args=_args(tmp_path / "stock")).save_model()
    files = {p.name for p in (tmp_path / "stock").iterdir()}
    assert {p.name for p in (tmp_path / "ours").iterdir()} == files and "config.json" in files
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float64)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    for (name, p), q in zip(loaded.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name
