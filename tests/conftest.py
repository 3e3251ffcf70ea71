"""Shared models and checks. The oracle everywhere is stock PyTorch autograd on a deep copy."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import dist_utils
import pytest
import torch
import torch.nn.functional as F
from oracle import assert_grads_like
from torch import nn

import flatgrad
from flatgrad._flatgrad import settled_buffers

# Route every Linear, however small: these tests are about the routed backward's results.
ROUTE_ALL = flatgrad.FlatGradConfig(linear_min_numel=0)


def total_norm(grads: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The oracle norm: ``torch.nn.utils.get_total_norm`` (torch 2.6+), or on older torch
    the same definition (the norm of the per-tensor norms) that `clip_grad_norm_` used."""
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)
    if get_total_norm is not None:
        return get_total_norm(grads, norm_type)
    norms = [torch.linalg.vector_norm(grad, norm_type) for grad in grads]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


class TiedLM(nn.Module):
    """Embedding -> Linear/LayerNorm -> output Linear sharing the embedding's weight."""

    def __init__(self, vocab: int = 13, dim: int = 8, padding_idx: int | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(torch.tanh(self.proj(self.emb(tokens))))
        logits = self.head(hidden)
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())


class CompileLM(nn.Module):
    """Tied embedding and LM head, routed Linears, a LayerNorm: what flatgrad routes (the
    torch.compile tests' model)."""

    def __init__(self, vocab: int = 64, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        h = self.norm(h + self.down(F.gelu(self.up(h))))
        return F.cross_entropy(self.head(h).flatten(0, 1), tokens.flatten())


def grad_in_buffers(flat: flatgrad.FlatGrad, grad: torch.Tensor) -> bool:
    """Whether `grad` is a view inside one of `flat.grad_buffers` (storage and byte range; read without
    its refusal while reduce-scattered: a look at where `.grad` lives, not at its values)."""
    for buf in settled_buffers(flat).values():
        if grad.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr():
            continue
        if not grad.numel():
            return True  # an empty tensor's data_ptr() is 0: its storage is the buffer's
        start, end = buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()
        if start <= grad.data_ptr() and grad.data_ptr() + grad.numel() * grad.element_size() <= end:
            return True
    return False


def assert_same_grads(
    flat: flatgrad.FlatGrad, oracle: nn.Module, rtol: float = 1e-12, atol: float = 1e-12
) -> None:
    """Grads equal the oracle's (None where it has None) and every grad lies in the buffers.

    Default tolerance is float64 round-off: the same sums, possibly in another order.
    """
    assert_grads_like(flat, oracle, rtol, atol)
    ours = dict(flat.named_parameters())
    for name, ref in oracle.named_parameters():
        param = ours[name]
        if ref.grad is not None and param.requires_grad:
            assert grad_in_buffers(flat, param.grad), f"{name}: .grad is outside grad_buffers"


def tiny_llama() -> nn.Module:
    """A tiny Llama with tied embeddings, from a config (no download), in float64; skips the
    test without transformers."""
    transformers = pytest.importorskip("transformers", reason="pip install -e '.[dev,frameworks]'")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=88, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).double()


@pytest.fixture
def tied_pair() -> tuple[flatgrad.FlatGrad, nn.Module]:
    torch.manual_seed(0)
    model = TiedLM().double()
    oracle = copy.deepcopy(model)
    return flatgrad.FlatGrad(model, config=ROUTE_ALL), oracle


@pytest.fixture(autouse=True, scope="module")
def _rank_pools() -> Iterator[None]:
    """One persistent group of gloo ranks per test module (and world size): ended here."""
    yield
    dist_utils.close_pools()
