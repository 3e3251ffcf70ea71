"""Command line of the benchmark suite.

python -m flatgrad.bench                                  # CPU: spawns 2 gloo ranks
python -m flatgrad.bench --models gpt,mlp --steps 30 --out bench.json
python -m flatgrad.bench --local-only --op-repeats 0      # the one-process steps alone: no ranks
python -m flatgrad.bench --mixed-steps 0                  # without the mixed-precision row (bf16 LM, AdamW)
python -m flatgrad.bench --models gpt --configs ddp_muon,flatgrad_zero_muon,zero_stock_muon  # Muon + AdamW
torchrun --nproc_per_node=8 -m flatgrad.bench             # GPUs: NCCL, one rank per GPU
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import logging
import os
import platform
import resource
import socket
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flatgrad.bench.local import format_local, local_rows
from flatgrad.bench.memory import pin_malloc
from flatgrad.bench.mixed import MIXED_VARIANTS, bench_mixed
from flatgrad.bench.models import LOCAL_MODELS, MODELS, resolve_model
from flatgrad.bench.ops import format_ops, op_ratios
from flatgrad.bench.report import format_mixed, format_muon, format_overlap, format_table
from flatgrad.bench.runners import CONFIGS, MUON_CONFIGS
from flatgrad.bench.suite import bench_model

logger = logging.getLogger("flatgrad.bench")
# The mixed-precision row takes any built-in model (the LMs are what it is for).
MIXED_MODELS = {**MODELS, **LOCAL_MODELS}


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a number above 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value:g}")
    return value


def _names(choices: Iterable[str], what: str, one: bool = False) -> Callable[[str], Any]:
    """argparse type: comma-separated names of `choices` or ``package.module:factory`` (with
    `one`: exactly one name, returned alone)."""
    known = list(choices)

    def parse(text: str) -> list[str] | str:
        items = [t for t in text.split(",") if t]
        if not items or any(t not in known and ":" not in t for t in items):
            raise argparse.ArgumentTypeError(
                f"{what} must be a comma-separated subset of {', '.join(known)}, got {text!r}"
            )
        if one and len(items) != 1:
            raise argparse.ArgumentTypeError(f"{what} must be one model, got {text!r}")
        return items[0] if one else items

    return parse


# The options: argparse's settings and the help of each.
OPTIONS: dict[str, tuple[dict[str, Any], str]] = {
    "--world-size": ({"type": positive_int, "default": 2}, "gloo ranks to spawn (ignored under torchrun)"),
    "--models": (
        {"type": _names(MODELS, "--models"), "default": list(MODELS)},
        "comma-separated built-in models, or package.module:factory returning a BenchModel",
    ),
    "--configs": (
        {"type": _names(CONFIGS + MUON_CONFIGS, "--configs"), "default": list(CONFIGS)},
        f"comma-separated configurations (default: those with SGD; Muon + AdamW, by name: "
        f"{', '.join(MUON_CONFIGS)})",
    ),
    "--steps": ({"type": positive_int, "default": 20}, "timed steps per configuration"),
    "--warmup": ({"type": int, "default": 3}, "untimed steps first (DDP rebuilds buckets in step 2)"),
    "--mixed-steps": (
        {"type": int, "default": 20},
        "timed steps of the mixed-precision row (on the ranks; 4 micro-batches, AdamW; 0: skip)",
    ),
    "--mixed-model": (
        {"type": _names(MIXED_MODELS, "--mixed-model", one=True), "default": "llama"},
        "the model of the mixed-precision row (one name, or package.module:factory)",
    ),
    "--mixed-variants": (
        {"type": _names(MIXED_VARIANTS, "--mixed-variants"), "default": list(MIXED_VARIANTS)},
        "comma-separated variants of the mixed-precision row",
    ),
    "--op-repeats": ({"type": int, "default": 30}, "repeats of the single-op backward benchmarks (0: skip)"),
    "--local-steps": (
        {"type": int, "default": 20},
        "timed one-process steps per model for the stock-vs-FlatGrad step table (0: skip)",
    ),
    "--local-models": (
        {"type": _names(LOCAL_MODELS, "--local-models"), "default": list(LOCAL_MODELS)},
        "comma-separated models of the one-process step table, or package.module:factory",
    ),
    "--local-accumulate": (
        {"type": int, "default": 4},
        "micro-batches per step of each one-process model's gradient-accumulation row (<2: no such row)",
    ),
    "--local-only": (
        {"action": "store_true"},
        "only the one-process rows (step table, single ops): no ranks",
    ),
    "--threads": ({"type": positive_int}, "torch threads per rank (default: cores / ranks)"),
    "--malloc": (
        {"choices": ("glibc", "pinned"), "default": "glibc"},
        "glibc: the C allocator as it comes; pinned: glibc's heap thresholds fixed in every benchmark "
        "process (no trimming of the heap's top), so that steps do not re-fault the memory freed by "
        "the step before, at random on either side of a comparison",
    ),
    "--out": ({"type": Path, "default": Path("bench_results.json")}, "JSON report"),
}


def command_line(
    prog: str, doc: str, options: dict[str, tuple[dict[str, Any], str]]
) -> argparse.ArgumentParser:
    """The parser of `options` (flag: argparse's settings, help), described by `doc`'s first line."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    for flag, (settings, text) in options.items():
        parser.add_argument(flag, help=text, **settings)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return command_line("flatgrad-bench", __doc__, OPTIONS).parse_args(argv)


def _set_malloc(args: argparse.Namespace) -> None:
    if args.malloc == "pinned" and not pin_malloc():
        logger.warning("--malloc pinned needs glibc's mallopt; measuring with the allocator as it comes")
        args.malloc = "glibc"


def cpu_name() -> str:
    """The CPU's model name (Linux), else what `platform` knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _environment(backend: str | None, world_size: int, threads: int, malloc: str) -> dict[str, Any]:
    return {
        "malloc": malloc,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "backend": backend,
        "world_size": world_size,
        "threads_per_rank": threads,
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def one_process(args: argparse.Namespace) -> dict[str, Any]:
    """The one-process rows (step table, single-op backwards), measured before any rank
    exists, with every core."""
    models = {name: resolve_model(name, LOCAL_MODELS) for name in args.local_models}
    return {
        "local_settings": {
            "steps": args.local_steps,
            "warmup": args.warmup,
            "models": args.local_models,
            "accumulate": args.local_accumulate,
            "threads": torch.get_num_threads(),
        },
        "local": local_rows(args.local_steps, args.warmup, models, args.local_accumulate)
        if args.local_steps > 0
        else [],
        "ops": op_ratios(args.op_repeats) if args.op_repeats else [],
    }


def _report(report: dict[str, Any], out: Path, tables: list[str]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    if any(tables):
        print("\n".join(table for table in tables if table))
    print(f"report: {out}")


def _one_process_tables(single: dict[str, Any]) -> list[str]:
    return [
        format_local(single["local"]) if single["local"] else "",
        format_ops(single["ops"]) if single["ops"] else "",
    ]


def run_local_only(args: argparse.Namespace) -> None:
    """The one-process rows alone: measure, print, write the JSON (no ranks)."""
    single = one_process(args)
    report = {"environment": _environment(None, 1, torch.get_num_threads(), args.malloc), **single}
    _report(report, args.out, _one_process_tables(single))


def run_rank(args: argparse.Namespace, single: dict[str, Any]) -> None:
    """Benchmark on this rank (process group already initialised); rank 0 reports."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    threads = args.threads or max(1, (os.cpu_count() or 1) // world_size)
    torch.set_num_threads(threads)
    models = {}
    for i, name in enumerate(args.models):
        if rank == 0:
            logger.info("flatgrad-bench: %s (%d of %d models)", name, i + 1, len(args.models))
        models[name] = bench_model(name, args.configs, args.steps, args.warmup, device)
    mixed = None
    if args.mixed_steps > 0:  # the mixed-precision row, with the settings it ran with
        spec = resolve_model(args.mixed_model, MIXED_MODELS)
        measured = bench_mixed(spec, args.mixed_variants, args.mixed_steps, args.warmup, device)
        mixed = {"model": args.mixed_model, "steps": args.mixed_steps, "warmup": args.warmup, **measured}
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    rss = torch.tensor([peak_rss_mb], dtype=torch.float64, device=device)  # (NCCL's: on the device)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank != 0:
        return
    report = {
        "environment": _environment(dist.get_backend(), world_size, threads, args.malloc),
        "settings": {"steps": args.steps, "warmup": args.warmup, "configs": args.configs},
        "peak_rss_mb_max_rank": float(rss),
        "models": models,
        "mixed_precision": mixed,
        **single,
    }
    mixed_table = format_mixed(mixed, world_size) if mixed is not None else ""
    tables = [format_table(report), format_muon(report), format_overlap(report), mixed_table]
    _report(report, args.out, tables + _one_process_tables(single))


def _in_group(args: argparse.Namespace, single: dict[str, Any] | None) -> None:
    """`run_rank` in the process group just initialised, which it then destroys; `single`
    None: rank 0 measures the one-process rows first, the others waiting (under torchrun)."""
    try:
        if single is None:
            single = one_process(args) if dist.get_rank() == 0 else {}
            dist.barrier()
        run_rank(args, single)
    finally:
        gc.collect()  # free DDP reducers (reference cycles) while the group exists: gloo can abort otherwise
        dist.destroy_process_group()


def _spawned(rank: int, world_size: int, port: int, args: argparse.Namespace, single: dict[str, Any]) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    _set_malloc(args)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(minutes=10))
    _in_group(args, single)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    _set_malloc(args)
    if args.local_only:
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun: rank 0 alone
            run_local_only(args)
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        _in_group(args, None)
        return
    single = one_process(args)  # before spawning: all cores
    mp.start_processes(
        _spawned,
        args=(args.world_size, _free_port(), args, single),
        nprocs=args.world_size,
        start_method="spawn",
    )
