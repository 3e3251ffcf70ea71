"""Run configs of the examples (train_gpt.py, ddp_compare.py): pydantic v2, loaded from YAML.

These describe a *run* (model size, data, optimiser, steps); the library's own settings are
the nested `flatgrad` field, a `flatgrad.FlatGradConfig` (imported by name: a field
called `flatgrad` would shadow the module inside the class body). Unknown keys fail loudly,
so does a key repeated in one mapping, and every error about the file names it.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, model_validator

from flatgrad import FlatGradConfig

DEFAULT_MODULES = (
    "argparse", "collections", "textwrap", "difflib", "string", "json.decoder", "json.encoder",
    "functools", "heapq", "dataclasses", "shutil", "tokenize", "csv", "random", "contextlib",
    "pprint", "calendar", "fractions",
)  # fmt: skip


def _not_a_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"must be a number, got {value}")
    return value


# Floats stay lax otherwise: YAML reads `3e-3` (no dot) as a string, which pydantic converts.
_Real = Annotated[float, BeforeValidator(_not_a_bool)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    """Size of the GPT (examples/gpt_model.py)."""

    n_layer: StrictInt = Field(default=4, gt=0)
    """Number of transformer blocks."""

    n_head: StrictInt = Field(default=4, gt=0)
    """Attention heads per block; must divide `n_embd`."""

    n_embd: StrictInt = Field(default=128, gt=0)
    """Width of the residual stream (and of the tied token embedding / LM head)."""

    block_size: StrictInt = Field(default=128, gt=0)
    """Longest context the model can see: rows of the learned position embedding."""

    dropout: _Real = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout probability on embeddings, attention and MLP outputs (0 turns it off)."""

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        if self.n_embd % self.n_head:
            raise ValueError(
                f"n_embd must be a multiple of n_head, because each head gets n_embd / n_head "
                f"channels; got n_embd={self.n_embd}, n_head={self.n_head}"
            )
        return self


class DataConfig(_Strict):
    """Where the training text comes from; characters are the tokens."""

    source: Literal["stdlib", "file"] = "stdlib"
    """"stdlib": the concatenated source of `stdlib_modules` (nothing to download);
    "file": the text file at `path`."""

    stdlib_modules: tuple[str, ...] = Field(default=DEFAULT_MODULES, min_length=1)
    """Python stdlib modules whose source files make up the text when source is "stdlib"."""

    path: Path | None = None
    """Text file to train on when source is "file"."""

    @model_validator(mode="after")
    def _path_matches_source(self) -> DataConfig:
        if self.source == "file" and self.path is None:
            raise ValueError('path must be set when source is "file": there is no text to read otherwise')
        if self.source == "stdlib" and self.path is not None:
            raise ValueError(
                f'path must be unset when source is "stdlib", it would be ignored; got {self.path}'
            )
        return self


class _RunConfig(_Strict):
    """Fields both examples share."""

    model: ModelConfig = ModelConfig()
    """The GPT's size."""

    data: DataConfig = DataConfig()
    """The training text."""

    seq_len: StrictInt = Field(default=128, gt=0)
    """Characters per training window; at most `model.block_size`."""

    batch_size: StrictInt = Field(default=8, gt=0)
    """Windows per micro-batch on each rank."""

    lr: _Real = Field(default=3e-3, gt=0.0)
    """AdamW learning rate (the peak, when a schedule is used)."""

    weight_decay: _Real = Field(default=0.1, ge=0.0)
    """AdamW decoupled weight decay."""

    grad_clip: _Real | None = Field(default=1.0, gt=0.0)
    """Clip the global gradient norm to this before each step; null turns it off."""

    seed: StrictInt = 0
    """Seeds the model init (same on every rank) and the data windows (offset by rank)."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """"auto" picks CUDA (with NCCL) when available, else CPU (with gloo)."""

    flatgrad: FlatGradConfig = FlatGradConfig()
    """Library settings, passed to ``flatgrad.FlatGrad(model, config=...)``."""

    @model_validator(mode="after")
    def _window_fits_model(self) -> _RunConfig:
        if self.seq_len > self.model.block_size:
            raise ValueError(
                f"seq_len must be <= model.block_size, because the position embedding has only "
                f"block_size rows; got seq_len={self.seq_len}, block_size={self.model.block_size}"
            )
        return self


class TrainConfig(_RunConfig):
    """Run config of examples/train_gpt.py."""

    grad_accum_steps: StrictInt = Field(default=1, gt=0)
    """Micro-batches per optimiser step; DDP syncs only on the last (``ddp.no_sync()``)."""

    max_steps: StrictInt = Field(default=200, gt=0)
    """Optimiser steps to train for."""

    lr_schedule: Literal["constant", "cosine"] = "cosine"
    """After warm-up: keep `lr`, or decay it along a cosine to `min_lr` at `max_steps`."""

    warmup_steps: StrictInt = Field(default=20, ge=0)
    """Steps of linear learning-rate warm-up from 0 to `lr`."""

    min_lr: _Real = Field(default=3e-4, ge=0.0)
    """Learning rate at the end of the cosine schedule."""

    log_interval: StrictInt = Field(default=20, gt=0)
    """Log step, loss and tokens/s every this many steps (and at the first and last)."""

    out_dir: Path = Path("out/gpt_cpu")
    """Directory for the final checkpoints: ``ckpt.pt`` (the plain model) and ``dcp/``
    (everything, resharding)."""

    engine: Literal["ddp", "flatgrad"] = "ddp"
    """"ddp": torch's DDP with flatgrad's comm hook (one all-reduce of the whole buffer after
    backward); "flatgrad": `flatgrad.ReplicateModule`, buckets of the flat buffer all-reduced
    while backward runs."""

    zero: StrictBool = False
    """With engine "flatgrad": `flatgrad.ShardedOptimizer` (ZeRO-1, each rank keeps 1/N of
    AdamW's state)."""

    bucket_cap_mb: _Real = Field(default=25.0, gt=0.0)
    """Bucket size of engine "flatgrad"."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """The parameters' dtype. "bfloat16": the model in bfloat16 with float32 main grads
    (FlatGrad applied with ``grad_dtype="float32"``) and `flatgrad.ShardedOptimizer`'s float32
    master shards (needs engine "flatgrad" and zero)."""

    resume: StrictBool = False
    """Go on from the checkpoint ``<out_dir>/dcp`` (model, optimiser, schedule, step), saved
    on any number of ranks; the data windows start over from the seed."""

    @model_validator(mode="after")
    def _zero_needs_the_flatgrad_engine(self) -> TrainConfig:
        if self.zero and self.engine != "flatgrad":
            raise ValueError(
                'zero must be false unless engine is "flatgrad": ZeRO-1 shards the buckets of '
                f"flatgrad.ReplicateModule, got engine={self.engine!r}"
            )
        return self

    @model_validator(mode="after")
    def _bfloat16_needs_master_shards(self) -> TrainConfig:
        if self.dtype == "bfloat16" and not (self.engine == "flatgrad" and self.zero):
            raise ValueError(
                'dtype "bfloat16" needs engine "flatgrad" with zero true: the bfloat16 '
                "parameters are stepped through ShardedOptimizer's float32 master shards "
                f"from float32 main grads, got engine={self.engine!r}, zero={self.zero}"
            )
        return self

    @model_validator(mode="after")
    def _schedule_ends_below_peak(self) -> TrainConfig:
        if self.lr_schedule == "cosine" and self.min_lr > self.lr:
            raise ValueError(
                f"min_lr must be <= lr, because the cosine schedule decays from lr down to "
                f"min_lr; got min_lr={self.min_lr}, lr={self.lr}"
            )
        return self


class CompareConfig(_RunConfig):
    """Run config of examples/ddp_compare.py (stock DDP against FlatGrad + DDP)."""

    steps: StrictInt = Field(default=60, gt=0)
    """Optimiser steps each of the two runs takes."""

    warmup_steps: StrictInt = Field(default=10, ge=0)
    """Leading steps left out of the timing (allocations, DDP's bucket rebuild)."""

    @model_validator(mode="after")
    def _some_steps_timed(self) -> CompareConfig:
        if self.warmup_steps >= self.steps:
            raise ValueError(
                f"warmup_steps must be < steps, because the steps after warm-up are the ones "
                f"timed; got warmup_steps={self.warmup_steps}, steps={self.steps}"
            )
        return self


ConfigT = TypeVar("ConfigT", bound=BaseModel)


def load_config(cls: type[ConfigT], path: str | Path, overrides: Mapping[str, Any] | None = None) -> ConfigT:
    """Read a YAML run config into `cls`; `overrides` (None values skipped) replace top-level
    keys and are validated together with the file."""
    data = _read_mapping(Path(path))
    data.update({key: value for key, value in (overrides or {}).items() if value is not None})
    return cls.model_validate(data)


def _read_mapping(path: Path) -> dict[str, Any]:
    """The mapping a YAML file holds (JSON reads as YAML too). A file holding only comments is
    an empty mapping; a missing file, a directory, an empty file, invalid YAML, a repeated key
    or a value that is not a mapping is an error naming the file."""
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
    loader = _UniqueKeyLoader(text)
    loader.name = str(path)  # YAML's error marks then say which file, not "<unicode string>"
    try:
        data = loader.get_single_data()
    except (ValueError, yaml.YAMLError) as error:
        raise ValueError(f"config file {str(path)!r} is not valid YAML: {error}") from error
    finally:
        loader.dispose()
    if data is None:
        return {}  # only comments: every default
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping, got {type(data).__name__}")
    return data


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key repeated within one mapping (plain YAML keeps the
    last one silently, which hides typos in configs)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
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
