"""transformers' Trainer over FlatGrad on 2 CPU processes: train, save, load, resume.

    torchrun --standalone --nproc_per_node=2 examples/trainer_train.py --out /tmp/trainer_run
    torchrun --standalone --nproc_per_node=2 examples/trainer_train.py --out /tmp/trainer_run --compare

A tiny Llama with tied embeddings, built from a config (no download), in float64, with
FlatGrad applied (the model stays a ``LlamaForCausalLM``), trained by a plain
`transformers.Trainer` with its default arguments except the run's length and learning rate:
``remove_unused_columns=True`` (the dataset has a column the model does not take),
``save_strategy="steps"`` (a checkpoint every 2 steps). Trainer reads torchrun's environment
and joins a gloo group of 2 processes; one call, ``flatgrad.accelerate.attach(
trainer.accelerator, model)`` before ``train()``, gives its DDP `FlatGrad.ddp_kwargs` and
`flatgrad.allreduce_hook`.

``--compare`` also trains the plain model with a plain `transformers.Trainer` (the oracle),
and resumes flatgrad's run from its first checkpoint to the end. Rank 0 prints the largest
differences; with ``--report out.json`` it writes each run's parameters, losses and hook
calls, and the parameters ``AutoModelForCausalLM.from_pretrained`` loads from each run's
last checkpoint (tests/test_frameworks.py checks them).
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers

import flatgrad
import flatgrad.accelerate

SAVE_STEPS = 2


class Tokens(torch.utils.data.Dataset):
    """Token ids as inputs and labels, and an ``index`` column the model's forward does not
    take (Trainer drops it by the forward's signature)."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> dict[str, Any]:
        ids = torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids.clone(), "index": index}


def tiny_llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=88, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).double()  # float64: compared to round-off


def train(out: Path, steps: int, stock: bool, resume: Path | None = None) -> dict[str, Any]:
    """One Trainer run into `out` (a checkpoint every SAVE_STEPS steps); returns its report."""
    model = tiny_llama()
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, save_steps=SAVE_STEPS, per_device_train_batch_size=4,
        learning_rate=1e-2, logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    if not stock:
        flatgrad.FlatGrad(model)  # (in place: `model` itself)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
    state = None if stock else flatgrad.accelerate.attach(trainer.accelerator, model)
    trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)
    return {
        "world_size": trainer.accelerator.num_processes,
        "params": [p.detach().tolist() for p in model.parameters()],
        "losses": [log["loss"] for log in trainer.state.log_history if "loss" in log],
        "hook_calls": state.num_calls if state is not None else 0,
    }


def loaded(checkpoint: Path) -> dict[str, Any]:
    """What ``from_pretrained`` loads from a checkpoint: its parameters, and whether the LM
    head is tied to the embedding again."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    return {"params": [p.detach().tolist() for p in model.parameters()], "tied": tied}


def largest_difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    pairs = zip(a["params"], b["params"])
    return max((torch.tensor(p) - torch.tensor(q)).abs().max().item() for p, q in pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, required=True, help="the runs' output directories go here")
    parser.add_argument("--compare", action="store_true", help="also the stock run and a resumed run")
    parser.add_argument("--report", type=Path, help="rank 0 writes a JSON report here")
    args = parser.parse_args()
    try:
        runs = {"flatgrad": train(args.out / "flatgrad", args.steps, stock=False)}
        if args.compare:
            runs["stock"] = train(args.out / "stock", args.steps, stock=True)
            first = args.out / "flatgrad" / f"checkpoint-{SAVE_STEPS}"
            runs["resumed"] = train(args.out / "resumed", args.steps, stock=False, resume=first)
        if dist.get_rank() == 0:
            report: dict[str, Any] = {"runs": runs, "loaded": {}}
            for name in runs:
                report["loaded"][name] = loaded(args.out / name / f"checkpoint-{args.steps}")
            for name, run in runs.items():
                print(f"{name}: {run['world_size']} ranks, allreduce_hook calls {run['hook_calls']}")
            if args.compare:
                loads = report["loaded"]
                for what, a, b in [
                    ("largest parameter difference", runs["flatgrad"], runs["stock"]),
                    ("resumed vs stock", runs["resumed"], runs["stock"]),
                    ("loaded checkpoints", loads["flatgrad"], loads["stock"]),
                ]:
                    print(f"{what}: {largest_difference(a, b):.3g}")
            if args.report is not None:
                args.report.write_text(json.dumps(report))
    finally:
        gc.collect()  # free DDP while the process group exists (gloo can abort otherwise)
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
