"""The examples: their run-config models (examples/run_config.py) and one short torchrun of
examples/train_gpt.py, whose checkpoint must load into the plain GPT."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from pydantic import ValidationError

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))  # the examples import each other from there
# (the examples log through tqdm; a machine with torch and pytest alone, a lent GPU's, still
# collects the suite)
pytest.importorskip("tqdm", reason="pip install -e '.[dev]'")

from gpt_model import GPT, CharData, read_text  # noqa: E402
from run_config import CompareConfig, TrainConfig, load_config  # noqa: E402

RunConfig = TrainConfig | CompareConfig


@pytest.mark.parametrize(
    ("cls", "data", "name"),
    [
        (TrainConfig, {"max_step": 3}, "max_step"),
        (TrainConfig, {"model": {"n_layers": 2}}, "model.n_layers"),
        (TrainConfig, {"flatgrad": {"align": 64}}, "flatgrad.align"),
        (CompareConfig, {"max_steps": 3}, "max_steps"),  # a TrainConfig key is not a CompareConfig key
    ],
)
def test_unknown_key_is_an_error_naming_it(cls: type[RunConfig], data: dict[str, Any], name: str) -> None:
    with pytest.raises(ValidationError, match=rf"{name}\n\s+Extra inputs are not permitted"):
        cls.model_validate(data)


@pytest.mark.parametrize(
    ("cls", "data", "message"),
    [
        (TrainConfig, {"seq_len": 65, "model": {"block_size": 64}}, "seq_len must be <= model.block_size"),
        (CompareConfig, {"seq_len": 65, "model": {"block_size": 64}}, "seq_len must be <= model.block_size"),
        (TrainConfig, {"model": {"n_embd": 100, "n_head": 3}}, "n_embd must be a multiple of n_head"),
        (TrainConfig, {"data": {"source": "file"}}, 'path must be set when source is "file"'),
        (TrainConfig, {"data": {"path": "x.txt"}}, 'path must be unset when source is "stdlib"'),
        (TrainConfig, {"lr": 1e-3, "min_lr": 1e-2}, "min_lr must be <= lr"),
        (CompareConfig, {"steps": 10, "warmup_steps": 10}, "warmup_steps must be < steps"),
        (TrainConfig, {"batch_size": 0}, "batch_size\n.*greater than 0"),
        (TrainConfig, {"zero": True}, 'zero must be false unless engine is "flatgrad"'),
        (
            TrainConfig,
            {"dtype": "bfloat16", "engine": "flatgrad"},
            'dtype "bfloat16" needs engine "flatgrad" with',
        ),
        (TrainConfig, {"device": "tpu"}, "device\n.*'auto', 'cpu' or 'cuda'"),
    ],
)
def test_invalid_config_says_why(cls: type[RunConfig], data: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        cls.model_validate(data)


def test_constant_schedule_ignores_min_lr() -> None:
    # min_lr only matters for the cosine decay, so it is not checked against lr otherwise.
    assert TrainConfig(lr_schedule="constant", lr=1e-3, min_lr=1e-2).min_lr == 1e-2


def test_configs_are_frozen() -> None:
    with pytest.raises(ValidationError, match="frozen"):
        TrainConfig().max_steps = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("cls", "name"), [(TrainConfig, "gpt_cpu.yaml"), (CompareConfig, "compare_cpu.yaml")]
)
def test_shipped_configs_load(cls: type[RunConfig], name: str) -> None:
    cfg = load_config(cls, ROOT / "configs" / name)
    assert cfg.device == "cpu"
    assert cfg.flatgrad.align_bytes == 256


def test_overrides_are_validated_and_none_is_skipped(tmp_path: Path) -> None:
    path = ROOT / "configs" / "gpt_cpu.yaml"
    cfg = load_config(TrainConfig, path, {"max_steps": 3, "out_dir": tmp_path, "seed": None})
    assert (cfg.max_steps, cfg.out_dir, cfg.seed) == (3, tmp_path, 0)
    with pytest.raises(ValidationError, match="max_steps\n.*greater than 0"):
        load_config(TrainConfig, path, {"max_steps": 0})


def test_load_config_rejects_missing_and_non_mapping_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_config(TrainConfig, tmp_path / "missing.yaml")
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="must hold a mapping, got list"):
        load_config(TrainConfig, listing)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", r"config file '.*run.yaml' is empty"),
        ("max_steps: 3\nmax_steps: 4\n", r"(?s)run.yaml' is not valid YAML: duplicate key 'max_steps'"),
        ("model:\n  n_head: 2\n  n_head: 4\n", r"(?s)duplicate key 'n_head'\n  in \".*run.yaml\", line 3"),
        ("max_steps: [3,\n", r"run.yaml' is not valid YAML"),
    ],
)
def test_run_config_file_errors_name_the_file(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_config(TrainConfig, path)


def test_run_config_directory_is_not_called_missing(tmp_path: Path) -> None:
    with pytest.raises(IsADirectoryError, match="is a directory, not a YAML/JSON file"):
        load_config(TrainConfig, tmp_path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max_steps: true\n", r"max_steps\n.*Input should be a valid integer"),
        ('max_steps: "3"\n', r"max_steps\n.*Input should be a valid integer"),
        ("max_steps: 3.0\n", r"max_steps\n.*Input should be a valid integer"),
        ("model:\n  n_layer: yes\n", r"model.n_layer\n.*Input should be a valid integer"),
        ('zero: "true"\n', r"zero\n.*Input should be a valid boolean"),
        ("zero: 1\n", r"zero\n.*Input should be a valid boolean"),
        ("grad_clip: true\n", r"grad_clip\n.*must be a number, got True"),
    ],
)
def test_run_config_types_are_strict(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ValidationError, match=message):
        load_config(TrainConfig, path)


def test_run_config_floats_written_without_a_dot_still_load(tmp_path: Path) -> None:
    """YAML 1.1 reads `3e-3` as a string; a float field still takes it, as before."""
    path = tmp_path / "run.yaml"
    path.write_text("lr: 3e-3\nmin_lr: 1e-4\n")
    cfg = load_config(TrainConfig, path)
    assert (cfg.lr, cfg.min_lr) == (3e-3, 1e-4)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "engine",
    [
        [],
        ["--engine", "flatgrad"],
        ["--engine", "flatgrad", "--zero"],
        ["--engine", "flatgrad", "--zero", "--dtype", "bfloat16"],
    ],
)
def test_train_gpt_under_torchrun_saves_a_plain_checkpoint(tmp_path: Path, engine: list[str]) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "examples/train_gpt.py", "--config", "configs/gpt_cpu.yaml",
        "--max-steps", "3", "--out-dir", str(tmp_path), *engine,
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    cfg = TrainConfig.model_validate(checkpoint["config"])
    assert cfg.max_steps == 3
    model = GPT(len(checkpoint["vocab"]), **cfg.model.model_dump())
    assert checkpoint["model"].keys() == model.state_dict().keys()  # no "module." prefixes
    model.load_state_dict(checkpoint["model"])  # strict
    assert set(checkpoint["losses"]) == {1, 3}
    metadata = dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata().state_dict_metadata
    assert any(key.startswith("optim.state.") for key in metadata), "AdamW's moments, per parameter"
    if "bfloat16" in engine:  # bfloat16 weights in the plain checkpoint, float32 masters in dcp
        assert {t.dtype for t in checkpoint["model"].values()} == {torch.bfloat16}
        assert any(key.endswith(".master") for key in metadata), "the float32 master shards"
    if "--zero" in engine:  # the sharded state resumes on another number of ranks
        resume = [*command, "--resume", "--max-steps", "4"]
        resume[resume.index("--nproc_per_node=2")] = "--nproc_per_node=1"
        result = subprocess.run(resume, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert "resumed after step 3" in result.stderr + result.stdout
        assert set(torch.load(tmp_path / "ckpt.pt", weights_only=True)["losses"]) == {4}


@pytest.mark.distributed
@pytest.mark.parametrize("optimizer", ["AdamW", "ShardedOptimizer"])
def test_train_gpt_2d_on_a_2x2_mesh_saves_what_the_plain_gpt_loads(tmp_path: Path, optimizer: str) -> None:
    """examples/train_gpt_2d.py on 4 processes (dp 2 x tp 2), with torch's AdamW or a
    ShardedOptimizer: it trains, and its DCP checkpoint (DTensor shards of the MLPs) loads
    into the plain GPT in one process."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
        "examples/train_gpt_2d.py", "--tp", "2", "--max-steps", "3", "--out-dir", str(tmp_path),
    ] + (["--zero"] if optimizer == "ShardedOptimizer" else [])  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "mesh dp=2 x tp=2" in output and "16 of them DTensors" in output and f"; {optimizer}" in output
    cfg = load_config(TrainConfig, ROOT / "configs" / "gpt_cpu.yaml")
    data = CharData(read_text(cfg.data.source, cfg.data.stdlib_modules, cfg.data.path))
    model = GPT(data.vocab_size, **cfg.model.model_dump())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=tmp_path / "dcp_2d")  # (no process group: one process)
    model.load_state_dict(state["model"])
    assert all(not torch.equal(before[k], v) for k, v in model.state_dict().items() if "mlp.0.weight" in k)
