"""Turning a benchmark report into tables."""

from __future__ import annotations

from typing import Any

from flatgrad.bench.overlap import exposed_communication


def format_table(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"torch {env['torch']}, {env['backend']}, world size {env['world_size']}, "
        f"{env['threads_per_rank']} thread(s)/rank, {env['gpu'] or env['cpu']}",
        f"{'model':13s} {'configuration':20s} {'median ms':>9s} {'min':>8s} {'max':>8s} "
        f"{'ratio':>6s} {'vs view':>7s} "
        f"{'colls':>5s} {'copies':>6s} {'grad MB':>8s} {'opt MB':>7s} {'+peak MB':>8s} {'loss':>8s}",
    ]
    for model, result in report["models"].items():
        for name, r in result["configs"].items():
            lines.append(
                f"{model:13s} {name:20s} {r['median_ms']:9.2f} {r['min_ms']:8.2f} {r['max_ms']:8.2f} "
                f"{r.get('ratio_to_ddp_default', float('nan')):6.2f} "
                f"{r.get('pair_ratio_to_ddp_bucket_view', float('nan')):7.2f} {r['collectives_per_step']:5d} "
                f"{'-' if r['grad_copies_per_step'] is None else r['grad_copies_per_step']:>6} "
                f"{r['grad_bytes'] / 2**20:8.1f} {r['optimizer_state_bytes'] / 2**20:7.1f} "
                f"{r['step_peak_extra_mb']:8.1f} {r['final_loss']:8.4f}"
            )
    lines.append(
        "ratio / vs view: median over steps of the step-time ratio to stock DDP default / to stock "
        "DDP with gradient_as_bucket_view=True (same step, interleaved); colls: collectives in the "
        "backward (the parameter all-gathers of flatgrad_zero, zero_stock and fsdp2 come after or "
        "before it); copies: gradient-sized copies per step (counted as dispatched; -: not counted, "
        "fsdp2's chunk_cat into its reduce-scatter input is not a counted op); grad MB / opt MB: "
        "gradient memory / optimizer state held by one rank (SGD momentum; the sharded configurations "
        "keep their shard of the state, fsdp2 of the gradients too); "
        "+peak MB: the most a step added at its peak over what was resident before it "
        "(RSS on Linux CPUs, a lower bound; the allocator on CUDA), over ranks"
    )
    return "\n".join(lines)


def format_muon(report: dict[str, Any]) -> str:
    """The Muon + AdamW rows (`runners.MUON_CONFIGS`) of a report: step times, the ratio to
    the stock ZeRO-1 (`zero_stock_muon`) and every rank's optimizer state; "" without
    them."""
    from flatgrad.bench.runners import MUON_CONFIGS  # (here: this module imports no torch)

    lines = [
        "Muon + AdamW (Muon for the hidden matrices, AdamW for the embeddings, tied head and "
        "vectors; clipped at 1.0)",
        f"{'model':13s} {'configuration':20s} {'median ms':>9s} {'min':>8s} {'max':>8s} "
        f"{'vs ZeRO':>7s} {'opt MB per rank':>20s} {'most/unsharded':>14s}",
    ]
    rows = 0
    for model, result in report["models"].items():
        configs = result["configs"]
        unsharded = [
            configs[n]["optimizer_state_bytes"] for n in ("ddp_muon", "flatgrad_dp_muon") if n in configs
        ]
        for name in [n for n in MUON_CONFIGS if n in configs]:
            r = configs[name]
            rows += 1
            per_rank = " / ".join(f"{b / 2**20:.2f}" for b in r["optimizer_state_bytes_by_rank"])
            share = max(r["optimizer_state_bytes_by_rank"]) / unsharded[0] if unsharded else float("nan")
            lines.append(
                f"{model:13s} {name:20s} {r['median_ms']:9.2f} {r['min_ms']:8.2f} {r['max_ms']:8.2f} "
                f"{r.get('pair_ratio_to_zero_stock_muon', float('nan')):7.3f} {per_rank:>20s} {share:14.2f}"
            )
    lines.append(
        "vs ZeRO: median over steps of the step-time ratio to zero_stock_muon (DDP + two "
        "ZeroRedundancyOptimizers; same step, interleaved); opt MB per rank: the optimizer state "
        "each rank holds (rank 0 first); most/unsharded: the most any rank holds over what "
        "every rank of ddp_muon (or flatgrad_dp_muon) holds"
    )
    return "\n".join(lines) if rows else ""


def format_mixed(row: dict[str, Any], world_size: int) -> str:
    """The mixed-precision row (`flatgrad.bench.mixed`): step times, ratios, memory per parameter."""
    per = row["num_parameters"]
    lines = [
        f"mixed precision: {row['model']} ({per:,} parameters), {world_size} ranks, "
        f"{row['micro_batches']} micro-batches per step (no_sync on all but the last), "
        f"{row['optimizer']['name']}, clipping at {row['max_norm']:g}",
        f"{'variant':20s} {'median ms':>9s} {'min':>8s} {'max':>8s} {'vs autocast':>11s} {'vs bf16':>7s} "
        f"{'B/param':>7s} {'params':>6s} {'grads':>6s} {'masters':>7s} {'state':>6s} {'+peak MB':>8s} "
        f"{'loss':>8s}",
    ]
    for name, r in row["variants"].items():
        b = {role: value / per for role, value in r["bytes"].items()}
        autocast, bf16 = (r.get(f"ratio_to_{base}", float("nan")) for base in ("ddp_autocast", "ddp_bf16"))
        lines.append(
            f"{name:20s} {r['median_ms']:9.2f} {r['min_ms']:8.2f} {r['max_ms']:8.2f} "
            f"{autocast:11.2f} {bf16:7.2f} "
            f"{r['bytes_per_parameter']:7.2f} {b['params']:6.2f} {b['grads']:6.2f} {b['masters']:7.2f} "
            f"{b['optimizer_state']:6.2f} {r['step_peak_extra_mb']:8.1f} {r['final_loss']:8.4f}"
        )
    lines.append(
        "ddp_autocast: stock DDP, float32 parameters, bf16 autocast; ddp_bf16: stock DDP, bfloat16 "
        "parameters and AdamW state; flatgrad_main_grads: bfloat16 parameters, float32 main grads "
        "(DataParallel), float32 master shards and AdamW state (ShardedOptimizer). vs autocast / vs "
        "bf16: median over steps of the step-time ratio to ddp_autocast / ddp_bf16 (same step, "
        "interleaved); B/param: bytes per parameter one rank holds after a step (the most over ranks), "
        "then by role: parameters, gradients (.grad, main grads), masters, optimizer state"
    )
    return "\n".join(lines)


_LINKS_GBS = (12.5, 50.0)  # 100 Gb/s between nodes; a fast intra-node link


def format_overlap(report: dict[str, Any]) -> str:
    """The overlap model (flatgrad.bench.overlap) on DataParallel's measured bucket launch
    times: exposed communication of overlapped buckets against one all-reduce after backward."""
    lines = [
        "overlap model (not a measurement): exposed ms after backward on a given link, from the "
        "measured bucket launch times of flatgrad_dp",
        f"{'model':13s} {'buckets':>7s} {'backward ms':>11s} "
        + " ".join(f"{f'{g:g} GB/s: bucketed / one-shot':>30s}" for g in _LINKS_GBS),
    ]
    world_size = report["environment"]["world_size"]
    for model, result in report["models"].items():
        r = result["configs"].get("flatgrad_dp")
        if not r or not r.get("bucket_bytes"):
            continue
        estimates = [
            exposed_communication(r["bucket_launch_ms"], r["bucket_bytes"], r["backward_ms"], world_size, gbs)
            for gbs in _LINKS_GBS
        ]
        cells = [f"{e.bucketed_exposed_ms:14.2f} / {e.one_shot_exposed_ms:13.2f}" for e in estimates]
        lines.append(f"{model:13s} {len(r['bucket_bytes']):7d} {r['backward_ms']:11.2f} " + " ".join(cells))
    return "\n".join(lines)
