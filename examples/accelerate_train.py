"""FlatGrad under Hugging Face Accelerate: DDP with flatgrad's comm hook, 2 CPU processes.

    torchrun --standalone --nproc_per_node=2 examples/accelerate_train.py
    torchrun --standalone --nproc_per_node=2 examples/accelerate_train.py --compare  # and stock

Launch with torchrun: `Accelerator` reads torchrun's environment (RANK, WORLD_SIZE, ...) and
joins a gloo group of 2 processes. `accelerate launch --cpu --num_processes 2` starts a
single, non-distributed process (accelerate 1.x without a multi-CPU `accelerate config`).

The recipe, three lines on top of a plain Accelerate loop:
1. `flat.ddp_kwargs()` goes in through `DistributedDataParallelKwargs` (gradient_as_bucket_view
   and a bucket cap above the flat buffer, never 25: Accelerate drops a value equal to DDP's
   default);
2. the FlatGrad, not the bare model, goes through `accelerator.prepare`;
3. Accelerate has no option for a comm hook: register `flatgrad.allreduce_hook` on the
   prepared DDP model before the first forward.

``--compare`` trains again as plain Accelerate (``--stock``: only that) in the same processes
and prints the largest parameter difference. With ``--report out.json`` rank 0 also writes
the final parameters and, per step, the hook's calls so far, gradient-sized copies in
backward and whether every `.grad` was a view of the flat buffer (examples/recipe_probe.py;
tests/test_frameworks.py checks them).
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, DistributedDataParallelKwargs
from recipe_probe import StepProbe, TinyLM, batch, run_and_summarise

import flatgrad


def train(steps: int, stock: bool, probe_steps: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyLM().double()  # float64: the test compares with the stock run to round-off
    flat = None if stock else flatgrad.FlatGrad(model, config={"linear_min_numel": 0})
    handlers = [] if flat is None else [DistributedDataParallelKwargs(**flat.ddp_kwargs())]
    accelerator = Accelerator(cpu=True, kwargs_handlers=handlers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ddp, optimizer = accelerator.prepare(flat if flat is not None else model, optimizer)
    probe = StepProbe(model, flat)
    if flat is not None:
        probe.state = flat.comm_state()
        ddp.register_comm_hook(probe.state, flatgrad.allreduce_hook)

    for step in range(steps):
        optimizer.zero_grad()
        loss = ddp(batch(step, accelerator.process_index))
        with probe.backward() if probe_steps else contextlib.nullcontext():
            accelerator.backward(loss)
        optimizer.step()
    return probe.report(accelerator.num_processes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--stock", action="store_true", help="plain DDP through Accelerate, no flatgrad")
    parser.add_argument("--compare", action="store_true", help="flatgrad's run, then the stock run")
    parser.add_argument("--report", type=Path, help="rank 0 writes a JSON report here (probes every step)")
    args = parser.parse_args()
    run_and_summarise(
        args.stock, args.compare, lambda stock: train(args.steps, stock, args.report is not None), args.report
    )


if __name__ == "__main__":
    main()
