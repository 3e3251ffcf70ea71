"""FlatGrad under Hugging Face Accelerate: DDP with flatgrad's comm hook, 2 CPU processes.

    accelerate launch --config_file configs/accelerate_2cpu.yaml examples/accelerate_train.py
    torchrun --standalone --nproc_per_node=2 examples/accelerate_train.py --compare  # and stock

Either launcher starts 2 processes under torch.distributed.run, and ``Accelerator(cpu=True)``
reads their environment (RANK, WORLD_SIZE, ...) and joins a gloo group (Accelerate's
MULTI_CPU). The config file says ``distributed_type: MULTI_GPU`` for that reason: with
``MULTI_CPU`` accelerate 1.x's launcher starts one process, not distributed, unless the config
names an mpirun hostfile (it then runs mpirun, which this setup does not have); see
docs/integrations.md.

The recipe, one call on top of a plain Accelerate loop: `flatgrad.accelerate.attach` after
``Accelerator()`` and before ``accelerator.prepare(model, ...)``, FlatGrad applied to the
model in place. The DDP that prepare builds then gets `model.ddp_kwargs()`
(gradient_as_bucket_view and a bucket cap above the flat buffer) and
`flatgrad.allreduce_hook`, registered by Accelerate's DDP handler itself.

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
from accelerate import Accelerator
from recipe_probe import StepProbe, TinyLM, batch, run_and_summarise

import flatgrad
import flatgrad.accelerate


def train(steps: int, stock: bool, probe_steps: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model: torch.nn.Module = TinyLM().double()  # float64: compared with the stock run to round-off
    if not stock:
        model = flatgrad.FlatGrad(model, config={"linear_min_numel": 0})  # in place
    accelerator = Accelerator(cpu=True)
    probe = StepProbe(model)
    if isinstance(model, flatgrad.FlatGrad):
        probe.state = flatgrad.accelerate.attach(accelerator, model)  # the one call
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ddp, optimizer = accelerator.prepare(model, optimizer)

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
