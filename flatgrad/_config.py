"""Configuration of `FlatGrad`: pydantic v2 models, loadable from YAML or JSON."""

from __future__ import annotations

import json
from collections.abc import Hashable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

LayerKind = Literal["linear", "embedding"]


class FlatGradConfig(BaseModel):
    """How `FlatGrad` lays out its gradient buffers and which layers it routes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    align_bytes: StrictInt = Field(default=256, ge=1, le=1 << 16)
    """Every parameter's slot starts on a multiple of this many bytes (a power of two).
    256 matches the CUDA caching allocator's granularity, so every gradient view is as
    aligned as a freshly allocated tensor and vectorised kernels keep their fast path."""

    layers: tuple[LayerKind, ...] = ("linear", "embedding")
    """Layer kinds whose backward writes the weight gradient straight into the buffer.
    Parameters of other layers still get their `.grad` in the buffer, through one
    in-place add (or one copy on the first backward after `.grad` was set to None)."""

    linear_min_numel: StrictInt = Field(default=3 << 15, ge=0)
    """`nn.Linear` layers whose weight has fewer elements (98304, about 313x313) keep
    torch's own backward. A custom backward costs tens of microseconds of Python per layer,
    more than the zero fill and in-place add it saves on a small layer. Their gradients
    still land in the buffer. 0 routes every Linear."""

    grad_dtype: Literal["float32"] | None = None
    """None: every gradient slot has its parameter's dtype. ``"float32"``: the slots of
    bfloat16 and float16 parameters live in the float32 buffer of their device, as "main
    grads" (`FlatGrad.main_grad`): micro-batch sums, norms, clipping and all-reduces then
    run in float32, and those parameters' `.grad` stays None (see docs/mixed-precision.md).
    Float32 and float64 parameters are unaffected. `replicate` averages them in float32,
    `ShardedOptimizer` steps them through float32 master shards; the DDP hook path refuses
    them (DDP keeps each gradient in its parameter's dtype)."""

    @field_validator("align_bytes")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"align_bytes must be a power of two, got {value}")
        return value

    @field_validator("layers")
    @classmethod
    def _unique(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(value)) != len(value):
            raise ValueError(f"layers must not repeat a kind, got {list(value)}")
        return value

    @classmethod
    def from_file(cls, path: str | Path) -> FlatGradConfig:
        """Read a config from a YAML (``.yaml``/``.yml``) or JSON file.

        Args:
            path: The file; a ``.json`` suffix is read as JSON, any other as YAML. A YAML file holding only
                comments gives the defaults.

        Returns:
            The validated `FlatGradConfig`.

        Raises:
            FileNotFoundError: `path` does not exist.
            IsADirectoryError: `path` is a directory.
            ValueError: The file is empty, not UTF-8, not valid YAML/JSON, repeats a key, or does not hold a
                mapping (every message names the file).
            pydantic.ValidationError: A field is unknown or has an invalid value (a ValueError too)."""
        return cls.model_validate(load_mapping(path))


_YAML_MERGE_TAG = "tag:yaml.org,2002:merge"


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` refusing a key repeated in one mapping (plain YAML keeps the last, hiding typos)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == _YAML_MERGE_TAG:
                continue  # `<<: *base`: keys written beside it override the merged ones, as in YAML
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # SafeLoader itself reports an unhashable key
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _unique_json_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    for key in keys:
        if keys.count(key) > 1:
            raise ValueError(f"duplicate key {key!r}")
    return dict(pairs)


def _parse(path: Path, text: str) -> Any:
    if path.suffix == ".json":
        return json.loads(text, object_pairs_hook=_unique_json_keys)
    loader = _UniqueKeyLoader(text)
    loader.name = str(path)  # YAML's error marks then say which file, not "<unicode string>"
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def load_mapping(path: str | Path) -> dict[str, Any]:
    """Parse a YAML or JSON file that must hold a mapping (used by every config model, the examples' run
    configs too). Every error names the file. A YAML file holding only comments is an empty mapping; an empty
    file, a repeated key, or a value that is not a mapping is an error."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"config file {str(path)!r} is a directory, not a YAML/JSON file")
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"config file {str(path)!r} is not UTF-8 text: {error}") from error
    if not text.strip():
        raise ValueError(f"config file {str(path)!r} is empty; it must hold a mapping")
    try:
        data = _parse(path, text)
    except (ValueError, yaml.YAMLError) as error:  # json.JSONDecodeError is a ValueError
        kind = "JSON" if path.suffix == ".json" else "YAML"
        raise ValueError(f"config file {str(path)!r} is not valid {kind}: {error}") from error
    if data is None and path.suffix != ".json":
        return {}  # only comments
    if not isinstance(data, dict):
        found = "null" if data is None else type(data).__name__
        raise ValueError(f"config file {str(path)!r} must hold a mapping, got {found}")
    return data


def resolve_config(config: FlatGradConfig | dict[str, Any] | str | Path | None) -> FlatGradConfig:
    """Turn any accepted form of ``FlatGrad(config=...)`` into a `FlatGradConfig`."""
    if config is None:
        return FlatGradConfig()
    if isinstance(config, FlatGradConfig):
        return config
    if isinstance(config, dict):
        return FlatGradConfig.model_validate(config)
    if isinstance(config, (str, Path)):
        return FlatGradConfig.from_file(config)
    raise TypeError(
        "config must be a FlatGradConfig, a dict, a path to a YAML/JSON file or None, "
        f"got {type(config).__name__}"
    )
