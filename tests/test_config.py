"""FlatGradConfig: defaults, validation messages, loading from YAML/JSON, and every form
`FlatGrad(model, config=...)` accepts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch import nn

import flatgrad
from flatgrad import FlatGradConfig
from flatgrad._config import load_mapping

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_YAML = REPO_ROOT / "configs" / "default.yaml"


def _model() -> nn.Module:
    return nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 3))


# --- defaults and immutability ------------------------------------------------------------


def test_defaults() -> None:
    config = FlatGradConfig()
    assert config.align_bytes == 256
    assert config.layers == ("linear", "embedding")


def test_frozen() -> None:
    config = FlatGradConfig()
    with pytest.raises(ValidationError, match="frozen"):
        config.align_bytes = 512  # type: ignore[misc]
    assert config.align_bytes == 256


def test_unknown_key_is_rejected_by_name() -> None:
    with pytest.raises(ValidationError, match=r"(?s)bogus_option.*Extra inputs are not permitted"):
        FlatGradConfig(bogus_option=1)  # type: ignore[call-arg]


# --- align_bytes --------------------------------------------------------------------------


@pytest.mark.parametrize("align_bytes", [1, 2, 64, 256, 4096, 1 << 16])
def test_align_bytes_powers_of_two_accepted(align_bytes: int) -> None:
    assert FlatGradConfig(align_bytes=align_bytes).align_bytes == align_bytes


@pytest.mark.parametrize("align_bytes", [3, 96, 255, 1000])
def test_align_bytes_not_power_of_two(align_bytes: int) -> None:
    with pytest.raises(ValidationError, match=rf"align_bytes must be a power of two, got {align_bytes}"):
        FlatGradConfig(align_bytes=align_bytes)


@pytest.mark.parametrize("align_bytes", [0, -4, -256])
def test_align_bytes_not_positive(align_bytes: int) -> None:
    with pytest.raises(ValidationError, match=r"(?s)align_bytes.*greater than or equal to 1"):
        FlatGradConfig(align_bytes=align_bytes)


def test_align_bytes_too_large() -> None:
    with pytest.raises(ValidationError, match=r"(?s)align_bytes.*less than or equal to 65536"):
        FlatGradConfig(align_bytes=1 << 17)


# --- layers -------------------------------------------------------------------------------


@pytest.mark.parametrize("layers", [(), ("linear",), ("embedding",), ("embedding", "linear")])
def test_layers_accepted(layers: tuple[str, ...]) -> None:
    assert FlatGradConfig(layers=layers).layers == layers  # type: ignore[arg-type]


def test_layers_unknown_kind() -> None:
    with pytest.raises(ValidationError, match=r"(?s)layers\.1.*'linear' or 'embedding'"):
        FlatGradConfig(layers=("linear", "conv2d"))  # type: ignore[arg-type]


def test_layers_repeated_kind() -> None:
    with pytest.raises(ValidationError, match=r"layers must not repeat a kind, got \['linear', 'linear'\]"):
        FlatGradConfig(layers=("linear", "linear"))


# --- from_file ----------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".yaml", ".yml"])
def test_from_file_yaml(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"config{suffix}"
    path.write_text("align_bytes: 512\nlayers: [embedding]\n")
    assert FlatGradConfig.from_file(path) == FlatGradConfig(align_bytes=512, layers=("embedding",))


def test_from_file_json(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"align_bytes": 1024, "layers": ["linear"]}))
    assert FlatGradConfig.from_file(str(path)) == FlatGradConfig(align_bytes=1024, layers=("linear",))


def test_from_file_empty_yaml_gives_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing set\n")
    assert FlatGradConfig.from_file(path) == FlatGradConfig()


def test_default_yaml_equals_defaults() -> None:
    assert FlatGradConfig.from_file(DEFAULT_YAML) == FlatGradConfig()


def test_from_file_missing(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.yaml"
    with pytest.raises(FileNotFoundError, match="nowhere.yaml.*does not exist"):
        FlatGradConfig.from_file(path)


@pytest.mark.parametrize(("name", "text"), [("list.yaml", "- 256\n- linear\n"), ("list.json", "[256]")])
def test_from_file_not_a_mapping(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"{name}.*must hold a mapping, got list"):
        FlatGradConfig.from_file(path)


def test_from_file_unknown_key(tmp_path: Path) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text("align_byte: 256\n")
    with pytest.raises(ValidationError, match=r"(?s)align_byte\n.*Extra inputs are not permitted"):
        FlatGradConfig.from_file(path)


# --- FlatGrad(model, config=...) ----------------------------------------------------------


def test_flatgrad_config_none() -> None:
    flat = flatgrad.FlatGrad(_model())
    assert flat.flatgrad_config == FlatGradConfig()


def test_flatgrad_config_instance() -> None:
    config = FlatGradConfig(align_bytes=1024)
    flat = flatgrad.FlatGrad(_model(), config=config)
    assert flat.flatgrad_config is config
    for buffer in flat.grad_buffers.values():
        assert buffer.data_ptr() % 1024 == 0


def test_flatgrad_config_dict() -> None:
    flat = flatgrad.FlatGrad(_model(), config={"align_bytes": 512, "layers": ["linear"]})
    assert flat.flatgrad_config == FlatGradConfig(align_bytes=512, layers=("linear",))


def test_flatgrad_config_dict_unknown_key() -> None:
    with pytest.raises(ValidationError, match="alignment"):
        flatgrad.FlatGrad(_model(), config={"alignment": 512})


@pytest.mark.parametrize("as_str", [False, True])
def test_flatgrad_config_path(tmp_path: Path, as_str: bool) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("align_bytes: 2048\n")
    flat = flatgrad.FlatGrad(_model(), config=str(path) if as_str else path)
    assert flat.flatgrad_config == FlatGradConfig(align_bytes=2048)


def test_flatgrad_config_default_yaml_path() -> None:
    flat = flatgrad.FlatGrad(_model(), config=DEFAULT_YAML)
    assert flat.flatgrad_config == FlatGradConfig()


def test_flatgrad_config_missing_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing.json"):
        flatgrad.FlatGrad(_model(), config=tmp_path / "missing.json")


@pytest.mark.parametrize("config", [42, 1.5, ["align_bytes", 256], torch.zeros(1)])
def test_flatgrad_config_wrong_type(config: object) -> None:
    with pytest.raises(TypeError, match=rf"config must be a FlatGradConfig.*got {type(config).__name__}"):
        flatgrad.FlatGrad(_model(), config=config)  # type: ignore[arg-type]


# --- file errors name the file; strict types ----------------------------------------------


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_empty_file_names_the_file(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"empty{suffix}"
    path.write_text("  \n")
    with pytest.raises(ValueError, match=rf"config file '.*empty\{suffix}' is empty"):
        FlatGradConfig.from_file(path)


@pytest.mark.parametrize(
    ("suffix", "text", "kind"), [(".yaml", "align_bytes: [1,", "YAML"), (".json", "{", "JSON")]
)
def test_invalid_file_names_the_file(tmp_path: Path, suffix: str, text: str, kind: str) -> None:
    path = tmp_path / f"broken{suffix}"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"config file '.*broken\{suffix}' is not valid {kind}"):
        FlatGradConfig.from_file(path)


def test_directory_is_not_called_missing(tmp_path: Path) -> None:
    with pytest.raises(IsADirectoryError, match="is a directory, not a YAML/JSON file"):
        FlatGradConfig.from_file(tmp_path)


# A file FlatGradConfig.from_file refuses: (file name, contents, error, pattern of the message).
BAD_FILES = [
    (
        "dup.yaml",
        "align_bytes: 64\nalign_bytes: 128\n",
        ValueError,
        r"(?s)dup.yaml' is not valid YAML.*duplicate key 'align_bytes'",
    ),
    (
        "nested.yaml",
        "outer:\n  key: 1\n  key: 2\n",
        ValueError,
        r'(?s)duplicate key \'key\'\n  in ".*nested.yaml", line 3',
    ),
    (
        "dup.json",
        '{"align_bytes": 64, "align_bytes": 128}',
        ValueError,
        r"dup.json' is not valid JSON: duplicate key 'align_bytes'",
    ),
    (
        "bool.yaml",
        "linear_min_numel: true\n",
        ValidationError,
        r"(?s)linear_min_numel.*Input should be a valid integer",
    ),
    (
        "typed.yaml",
        "align_bytes: true\n",
        ValidationError,
        r"(?s)align_bytes.*Input should be a valid integer",
    ),
    (
        "typed.yaml",
        'align_bytes: "64"\n',
        ValidationError,
        r"(?s)align_bytes.*Input should be a valid integer",
    ),
    (
        "typed.yaml",
        "align_bytes: 64.0\n",
        ValidationError,
        r"(?s)align_bytes.*Input should be a valid integer",
    ),
    (
        "typed.json",
        '{"align_bytes": true}',
        ValidationError,
        r"(?s)align_bytes.*Input should be a valid integer",
    ),
    (
        "listkey.yaml",
        "? [1, 2]\n: 3\n",
        ValueError,
        r"(?s)listkey.yaml' is not valid YAML.*found unhashable key",
    ),
    ("null.json", "null", ValueError, r"null.json' must hold a mapping, got null"),
    ("binary.yaml", b"\xff\xfe\x00", ValueError, r"binary.yaml' is not UTF-8 text"),
]


@pytest.mark.parametrize(("name", "contents", "error", "match"), BAD_FILES)
def test_bad_file_is_refused_naming_file_and_constraint(
    tmp_path: Path, name: str, contents: str | bytes, error: type[Exception], match: str
) -> None:
    path = tmp_path / name
    if isinstance(contents, bytes):
        path.write_bytes(contents)
    else:
        path.write_text(contents)
    with pytest.raises(error, match=match):
        FlatGradConfig.from_file(path)


@pytest.mark.parametrize("value", [True, "64", 64.0])
def test_align_bytes_must_be_a_real_int(value: object) -> None:
    with pytest.raises(ValidationError, match=r"(?s)align_bytes.*Input should be a valid integer"):
        FlatGradConfig(align_bytes=value)  # type: ignore[arg-type]


def test_yaml_merge_keys_still_work(tmp_path: Path) -> None:
    """`<<: *anchor` is not a repeated key: the keys written beside it override, as in YAML."""
    path = tmp_path / "merge.yaml"
    path.write_text(
        "base: &base {align_bytes: 64, layers: [linear]}\nconfig:\n  <<: *base\n  align_bytes: 512\n"
    )
    config = FlatGradConfig.model_validate(load_mapping(path)["config"])
    assert config == FlatGradConfig(align_bytes=512, layers=("linear",))


def test_directory_via_flatgrad_is_not_called_missing(tmp_path: Path) -> None:
    with pytest.raises(IsADirectoryError, match=rf"config file '{re.escape(str(tmp_path))}' is a directory"):
        flatgrad.FlatGrad(_model(), config=tmp_path)
