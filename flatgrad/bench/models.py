"""The benchmark models, each with a batch generator. Small enough for CPUs by default;
`scale` grows them for GPUs."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import flatgrad


class ManySmallLayers(nn.Module):
    """A deep stack of narrow Linear + LayerNorm blocks: many tiny gradients, so the
    synchronisation is latency-bound (one launch per bucket matters)."""

    def __init__(self, width: int = 128, depth: int = 48) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width)) for _ in range(depth)
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + 0.1 * torch.relu(block(x))
        return F.mse_loss(x.mean(-1), y)


class Recommender(nn.Module):
    """Embedding-heavy click model: large user/item/category tables, a per-item bias read
    with `gather_with_index_add`, and a small MLP on the concatenated embeddings."""

    def __init__(self, num_users: int = 50_000, num_items: int = 50_000, dim: int = 64) -> None:
        super().__init__()
        self.users = nn.Embedding(num_users, dim)
        self.items = nn.Embedding(num_items, dim)
        self.categories = nn.Embedding(1000, dim)
        self.item_bias = nn.Parameter(torch.zeros(num_items))
        self.mlp = nn.Sequential(
            nn.Linear(3 * dim, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 1)
        )

    def forward(self, ids: torch.Tensor, clicks: torch.Tensor) -> torch.Tensor:
        user, item, category = ids.unbind(-1)
        features = torch.cat([self.users(user), self.items(item), self.categories(category)], dim=-1)
        logits = self.mlp(features).squeeze(-1) + flatgrad.gather_with_index_add(self.item_bias, item)
        return F.binary_cross_entropy_with_logits(logits, clicks)


class TiedGPT(nn.Module):
    """A small GPT from torch's own blocks (nn.TransformerEncoderLayer, causal mask) whose
    LM head shares the token embedding's weight."""

    def __init__(
        self, vocab: int = 4096, dim: int = 128, depth: int = 4, heads: int = 4, block: int = 64
    ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(block, dim)
        layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        steps = idx.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(steps, device=idx.device)
        x = self.tokens(idx) + self.positions(torch.arange(steps, device=idx.device))
        logits = self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class LargeMLP(nn.Module):
    """Wide Linear layers holding ~100 MB of float32 gradients: the case where DDP's
    per-bucket all-reduces overlap the backward and a single all-reduce at the end may lose."""

    def __init__(self, width: int = 2048, depth: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.mse_loss(x, y)


class ReorderedMLP(LargeMLP):
    """`LargeMLP` whose layers run in the reverse of their registration (the buffer, laid out
    in the reverse of registration, then holds the first gradients of backward last), with
    a layer it never uses (a head for another task): stock DDP needs
    find_unused_parameters=True; DataParallel's buckets learn their launch order in the
    first step and count the unused layer ready when backward starts."""

    def __init__(self, width: int = 2048, depth: int = 6) -> None:
        super().__init__(width, depth)
        self.unused = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return F.mse_loss(x, y)


class _LlamaBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.RMSNorm(dim)
        self.gate_up = nn.Linear(dim, 2 * (8 * dim // 3), bias=False)
        self.down = nn.Linear(8 * dim // 3, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, steps, dim = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(batch, steps, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attn.transpose(1, 2).reshape(batch, steps, dim))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class LlamaLike(nn.Module):
    """A Llama-shaped LM in plain torch: RMSNorm, attention through
    `scaled_dot_product_attention`, a SwiGLU MLP, and an LM head tied to the embedding."""

    def __init__(self, vocab: int = 4096, dim: int = 256, depth: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_LlamaBlock(dim, heads) for _ in range(depth))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), targets.flatten())


Batch = tuple[torch.Tensor, ...]  # a forward's positional arguments
BatchFn = Callable[[torch.Generator, torch.device], Batch]


@dataclass(frozen=True)
class BenchModel:
    """A model factory and a batch factory (a batch is the forward's positional args)."""

    build: Callable[[], nn.Module]
    batch: BatchFn
    # Whether the model leaves parameters unused (the same ones every step): stock DDP then
    # runs with find_unused_parameters=True (static_graph=True needs no flag).
    unused_parameters: bool = False


def regression(rows: int, width: int, wide_targets: bool = False) -> BatchFn:
    """Batches of `rows` random inputs of `width` and random targets, one per row (`width`
    each with `wide_targets`)."""
    targets = (rows, width) if wide_targets else (rows,)

    def batch(gen: torch.Generator, device: torch.device) -> Batch:
        inputs = torch.randn(rows, width, generator=gen)
        return inputs.to(device), torch.randn(targets, generator=gen).to(device)

    return batch


def tokens(vocab: int, rows: int, length: int) -> BatchFn:
    """Batches of `rows` random sequences of `length` token ids and their next tokens."""

    def batch(gen: torch.Generator, device: torch.device) -> Batch:
        idx = torch.randint(0, vocab, (rows, length + 1), generator=gen)
        return idx[:, :-1].to(device), idx[:, 1:].to(device)

    return batch


def _recommender_batch(gen: torch.Generator, device: torch.device) -> Batch:
    ids = torch.stack([torch.randint(0, n, (2048,), generator=gen) for n in (50_000, 50_000, 1000)], dim=-1)
    return ids.to(device), torch.randint(0, 2, (2048,), generator=gen).float().to(device)


# One-process step benchmarks (flatgrad.bench.local): the issue-sized models.
LOCAL_MODELS: dict[str, BenchModel] = {
    "llama": BenchModel(LlamaLike, tokens(4096, 8, 64)),
    "small_layers_64": BenchModel(lambda: ManySmallLayers(width=64, depth=48), regression(32, 64)),
    "linear_1024": BenchModel(lambda: LargeMLP(width=1024, depth=4), regression(64, 1024, wide_targets=True)),
}

MODELS: dict[str, BenchModel] = {
    "small_layers": BenchModel(ManySmallLayers, regression(32, 128)),
    "recommender": BenchModel(Recommender, _recommender_batch),
    "gpt": BenchModel(TiedGPT, tokens(4096, 8, 64)),
    "mlp": BenchModel(LargeMLP, regression(16, 2048, wide_targets=True)),
    "mlp_reordered": BenchModel(
        ReorderedMLP, regression(16, 2048, wide_targets=True), unused_parameters=True
    ),
}


def resolve_model(name: str, models: Mapping[str, BenchModel] | None = None) -> BenchModel:
    """A built-in model by name (from `models`, default `MODELS`), or
    ``"package.module:factory"``: a function of no arguments returning a `BenchModel` (so you
    can benchmark your own model)."""
    if ":" not in name:
        return (MODELS if models is None else models)[name]
    module_name, _, attr = name.partition(":")
    spec = getattr(importlib.import_module(module_name), attr)()
    if not isinstance(spec, BenchModel):
        raise TypeError(f"{name} must return a flatgrad.bench.models.BenchModel, got {type(spec).__name__}")
    return spec
