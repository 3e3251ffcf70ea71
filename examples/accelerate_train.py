"""FlatGrad under Hugging Face Accelerate: DDP with flatgrad's comm hook, 2 CPU processes.

    torchrun --standalone --nproc_per_node=2 examples/accelerate_train.py
    torchrun --standalone --nproc_per_node=2 examples/accelerate_train.py --stock  # no flatgrad

(`accelerate launch --cpu --num_processes 2` starts a single process on some setups;
torchrun's environment is what Accelerator reads, so this launch gives two ranks for sure.)
`flat.ddp_kwargs()` goes in through `DistributedDataParallelKwargs`; Accelerate has no
option for a custom comm hook, so it is registered on the prepared DDP model before the
first forward. With ``--report out.json`` rank 0 writes the final parameters, the hook
calls per step, and whether every `.grad` was a view of the flat buffer after each backward.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator, DistributedDataParallelKwargs
from torch import nn

import flatgrad


class TinyLM(nn.Module):
    """Embedding, two Linears and an LM head: what flatgrad routes."""

    def __init__(self, vocab: int = 50, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.fc = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(torch.tanh(self.fc(self.emb(tokens)))))
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 50, (8, 12), generator=torch.Generator().manual_seed(1000 * rank + step))


def grads_in_buffers(flat: flatgrad.FlatGrad) -> bool:
    buffers = {b.untyped_storage().data_ptr() for b in flat._checked_store().buffers.values()}
    return all(p.grad.untyped_storage().data_ptr() in buffers for p in flat.module.parameters())


def train(steps: int, stock: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyLM().double()
    flat = None if stock else flatgrad.FlatGrad(model, config={"linear_min_numel": 0})
    kwargs = DistributedDataParallelKwargs(**(flat.ddp_kwargs() if flat is not None else {}))
    accelerator = Accelerator(cpu=True, kwargs_handlers=[kwargs])
    module = flat if flat is not None else model
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)
    ddp, optimizer = accelerator.prepare(module, optimizer)
    calls = [0]
    if flat is not None:

        def counting_hook(state, bucket):  # noqa: ANN001, ANN202 (DDP checks no annotations here)
            calls[0] += 1
            return flatgrad.allreduce_hook(state, bucket)

        ddp.register_comm_hook(flat.comm_state(), counting_hook)
    in_buffers = []
    for step in range(steps):
        optimizer.zero_grad()
        accelerator.backward(ddp(batch(step, accelerator.process_index)))
        if flat is not None:
            in_buffers.append(grads_in_buffers(flat))
        optimizer.step()
    return {
        "params": [p.detach().tolist() for p in model.parameters()],
        "hook_calls": calls[0],
        "steps": steps,
        "grads_in_buffers": all(in_buffers) if flat is not None else None,
        "world_size": accelerator.num_processes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--stock", action="store_true", help="plain DDP through Accelerate, no flatgrad")
    parser.add_argument("--report", type=Path, help="rank 0 writes a JSON report here")
    args = parser.parse_args()
    try:
        report = train(args.steps, args.stock)
        if args.report is not None and dist.get_rank() == 0:
            args.report.write_text(json.dumps(report))
        elif dist.get_rank() == 0:
            print(
                f"{report['world_size']} ranks, {report['steps']} steps, hook calls: {report['hook_calls']}"
            )
    finally:
        gc.collect()  # free DDP while the process group exists (gloo can abort otherwise)
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
