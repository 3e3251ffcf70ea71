"""What train_gpt.py and ddp_compare.py share: a small GPT, its character-level data, and
the process-group setup (torchrun, or a one-process group under plain ``python``).

Not a script; the examples import it from their own directory.
"""

from __future__ import annotations

import gc
import importlib
import inspect
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm.contrib.logging import logging_redirect_tqdm

# --- model ----------------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, n_head: int, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, embd = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(embd, dim=2)
        q, k, v = (t.view(batch, seq, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        att = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(batch, seq, embd))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer; the LM head shares its weight with the token embedding."""

    def __init__(
        self, vocab_size: int, n_layer: int, n_head: int, n_embd: int, block_size: int, dropout: float
    ) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_head, n_embd, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied: one parameter used twice per step
        self.apply(_init_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, seq, vocab) for token ids `idx` of shape (batch, seq)."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _init_weights(module: nn.Module) -> None:
    # GPT-2's init: small normal weights, zero biases (the default init trains much slower here).
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-character cross-entropy (nats)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# --- data -----------------------------------------------------------------------------------


def read_text(source: str, stdlib_modules: tuple[str, ...], path: Path | None) -> str:
    """Training text: the concatenated source of stdlib modules (no download), or a file."""
    if source == "file":
        assert path is not None, "the run config checks that data_path is set"
        return path.read_text()
    files = [inspect.getsourcefile(importlib.import_module(name)) for name in stdlib_modules]
    return "\n".join(Path(f).read_text() for f in files if f is not None)


class CharData:
    """Character vocabulary over `text` and random (input, target) windows of it."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        index = {ch: i for i, ch in enumerate(self.chars)}
        self.ids = torch.tensor([index[ch] for ch in text], dtype=torch.long)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batch(
        self, batch_size: int, seq_len: int, generator: torch.Generator, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(len(self.ids) - seq_len - 1, (batch_size,), generator=generator)
        window = torch.stack([self.ids[s : s + seq_len + 1] for s in starts.tolist()])
        return window[:, :-1].to(device), window[:, 1:].to(device)


# --- process group --------------------------------------------------------------------------


def init_distributed(device_choice: str) -> tuple[int, int, torch.device]:
    """Join the process group (NCCL on CUDA, else gloo); returns (rank, world_size, device).

    Under plain ``python`` (no torchrun environment) it forms a one-process group, so the
    DDP code path is the same either way.
    """
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ["MASTER_PORT"] = str(_free_port())
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("device is 'cuda' but torch.cuda.is_available() is False")
    if use_cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if not use_cuda:  # share this machine's cores: a rank must not oversubscribe its neighbours
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
    return rank, world_size, device


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(run: Callable[[], None]) -> None:
    """Run `run` with logging on rank 0 only (above any progress bar), then free DDP and
    destroy the process group, whatever happened."""
    quiet = os.environ.get("RANK", "0") != "0"
    logging.basicConfig(
        level=logging.WARNING if quiet else logging.INFO, format="%(asctime)s %(name)s: %(message)s"
    )
    try:
        with logging_redirect_tqdm():
            run()
    finally:
        # Free DDP (kept in reference cycles) while its process group still exists: a reducer
        # collected at interpreter exit, after the group is gone, can abort the process (gloo).
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
