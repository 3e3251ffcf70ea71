"""The benchmark suite: its profiler counters on cases whose answer is known, and one tiny
end-to-end run whose JSON must hold every figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROUTE_ALL
from dist_utils import run_ranks
from torch import nn

import flatgrad
from flatgrad.bench.counters import count_step, grad_bytes
from flatgrad.bench.runners import CONFIGS, build_runner


def _mlp() -> nn.Module:
    """Three weights above the default `linear_min_numel`, so flatgrad routes them all."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 384), nn.Tanh(), nn.Linear(384, 384))


def _backward_step(module: nn.Module, x: torch.Tensor):
    loss = module(x).square().mean()
    return lambda: loss.backward()


def test_counters_local_stock_accumulating_adds_once_per_weight():
    model = _mlp()
    x = torch.randn(16, 512)
    model(x).sum().backward()  # .grad defined: AccumulateGrad adds in place, one add_ per weight
    counts = count_step(_backward_step(model, x), model.parameters())
    assert counts == type(counts)(collectives=0, grad_copies=3)


def test_counters_local_flatgrad_is_zero_copy():
    flat = flatgrad.FlatGrad(_mlp(), config=ROUTE_ALL)
    x = torch.randn(16, 512)
    for _ in range(2):  # empty slots, then accumulating
        counts = count_step(_backward_step(flat, x), flat.parameters())
        assert counts.grad_copies == 0 and counts.collectives == 0


def test_grad_bytes_counts_distinct_storages():
    model = _mlp()
    model(torch.randn(2, 512)).sum().backward()
    numel = sum(p.numel() for p in model.parameters())
    assert grad_bytes(model.parameters()) == 4 * numel
    flat = flatgrad.FlatGrad(_mlp(), config=ROUTE_ALL)
    flat(torch.randn(2, 512)).sum().backward()
    (buffer,) = flat.grad_buffers.values()
    storage_bytes = buffer.untyped_storage().nbytes()  # may exceed the view: alignment slack
    assert grad_bytes(flat.parameters()) == storage_bytes
    assert grad_bytes(flat.parameters(), [torch.empty(10)]) == storage_bytes + 40


def _known_ddp_costs_worker(rank: int, world_size: int) -> None:
    model = _mlp()
    x = torch.randn(16, 512)
    num_weights = 3
    expected = {
        # DDP copies each gradient into its bucket (mul_out by 1/world) and back out to .grad.
        "ddp_default": (1, 2 * num_weights, 2),
        # .grad is a bucket view, but zero_grad(set_to_none=True) makes AccumulateGrad create a
        # fresh gradient each step, which DDP copies into the bucket.
        "ddp_bucket_view": (1, num_weights, 1),
        "flatgrad_ddp_hook": (1, 0, 1),
        "flatgrad_all_reduce": (1, 0, 1),
        "local_stock": (0, 0, 1),
        "local_flatgrad": (0, 0, 1),
    }
    numel_bytes = 4 * sum(p.numel() for p in model.parameters())
    for name, (collectives, copies, grad_copies_held) in expected.items():
        runner = build_runner(name, model, torch.device("cpu"))
        for _ in range(3):  # past DDP's bucket rebuild in iteration 2
            runner.backward(runner.forward((x,)).square().mean())
            runner.update()
        loss = runner.forward((x,)).square().mean()
        counts = count_step(lambda r=runner, out=loss: r.backward(out), runner.module.parameters())
        if runner.ddp is not None and name.startswith("ddp_"):  # stock DDP: one per bucket
            collectives = len(runner.ddp.reducer._get_zeros_like_grad_buckets())
        assert (counts.collectives, counts.grad_copies) == (collectives, copies), (name, counts)
        held = grad_bytes(runner.module.parameters(), runner.bucket_buffers())
        assert abs(held - grad_copies_held * numel_bytes) < 4096, (name, held, numel_bytes)


@pytest.mark.distributed
def test_counters_on_stock_ddp_and_flatgrad():
    run_ranks(_known_ddp_costs_worker)


@pytest.mark.distributed
def test_bench_end_to_end_tiny(tmp_path: Path):
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        "-m",
        "flatgrad.bench",
        "--world-size",
        "2",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--models",
        "small_layers,gpt",
        "--op-repeats",
        "1",
        "--local-steps",
        "1",
        "--out",
        str(out),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ratio" in result.stdout and "flatgrad_ddp_hook" in result.stdout
    report = json.loads(out.read_text())
    assert set(report) >= {"environment", "settings", "models", "ops", "peak_rss_mb_max_rank"}
    assert set(report["environment"]) >= {"torch", "backend", "world_size", "threads_per_rank", "cpu", "gpu"}
    assert set(report["models"]) == {"small_layers", "gpt"}
    for result_ in report["models"].values():
        assert set(result_["configs"]) == set(CONFIGS)
        for record in result_["configs"].values():
            assert set(record) == {
                "median_ms",
                "pair_ratio_to_ddp_bucket_view",
                "min_ms",
                "max_ms",
                "ratio_to_ddp_default",
                "collectives_per_step",
                "grad_copies_per_step",
                "grad_bytes",
                "step_peak_extra_mb",
                "final_loss",
                "optimizer_state_bytes",
                "exposed_comm_ms",
                "bucket_launch_ms",
                "backward_ms",
                "bucket_bytes",
            }
            assert record["min_ms"] <= record["median_ms"] <= record["max_ms"]
        assert result_["configs"]["ddp_default"]["ratio_to_ddp_default"] == 1.0
        assert result_["configs"]["flatgrad_ddp_hook"]["collectives_per_step"] == 1
        zero, dp = result_["configs"]["flatgrad_zero"], result_["configs"]["flatgrad_dp"]
        assert zero["optimizer_state_bytes"] <= 0.6 * dp["optimizer_state_bytes"]
        assert dp["exposed_comm_ms"] >= 0 and len(dp["bucket_launch_ms"]) == len(dp["bucket_bytes"])
    assert {row["case"] for row in report["ops"]} and all(row["ratio"] > 0 for row in report["ops"])
    assert {(row["model"], row["clip"]) for row in report["local"]} == {
        (name, clip) for name in ("llama", "small_layers_64", "linear_1024") for clip in (False, True)
    }
    assert all(set(row) == {"model", "clip", "stock_ms", "flatgrad_ms", "ratio"} for row in report["local"])
    assert report["compile"] is None  # only with --compile
    assert "one process: model" in result.stdout


def test_compile_row_counts_graphs_and_times_compiled_steps():
    from flatgrad.bench.local import compile_row, format_local
    from flatgrad.bench.models import BenchModel

    def build() -> torch.nn.Module:
        return torch.nn.Sequential(_mlp(), torch.nn.Flatten(0)).append(_Mean())

    spec = BenchModel(build, lambda gen, device: (torch.randn(4, 512, generator=gen).to(device),))
    row = compile_row(2, warmup=1, spec=spec)
    assert "error" not in row, row
    assert (
        (row["stock_graphs"], row["stock_breaks"])
        == (row["flatgrad_graphs"], row["flatgrad_breaks"])
        == (1, 0)
    )
    assert row["stock_ms"] > 0 and row["flatgrad_ms"] > 0 and row["ratio"] > 0
    assert "graphs/breaks stock 1/0, flatgrad 1/0" in format_local([], row)


class _Mean(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean()


def test_bench_rejects_unknown_model():
    from flatgrad.bench.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--models", "resnet"])


def tiny_bench_model():
    from flatgrad.bench.models import BenchModel

    return BenchModel(_mlp, lambda gen, device: (torch.randn(4, 512, generator=gen).to(device),))


def test_resolve_model_takes_a_factory_of_your_own():
    from flatgrad.bench.models import MODELS, resolve_model

    assert resolve_model("gpt") is MODELS["gpt"]
    spec = resolve_model("test_bench:tiny_bench_model")
    (x,) = spec.batch(torch.Generator().manual_seed(0), torch.device("cpu"))
    assert spec.build()(x).shape == (4, 384)
    with pytest.raises(TypeError, match="must return a flatgrad.bench.models.BenchModel, got Sequential"):
        resolve_model("test_bench:_mlp")


def test_counting_prints_nothing_to_the_terminal(capfd):
    from flatgrad.bench.counters import count_step

    model = _mlp()
    x = torch.randn(4, 512)
    counts = count_step(lambda: model(x).sum().backward(), model.parameters())
    assert counts.grad_copies == 0  # fresh .grad: AccumulateGrad steals, nothing is copied
    captured = capfd.readouterr()
    assert "USDT" not in captured.err and "USDT" not in captured.out


def test_overlap_model_arithmetic():
    from flatgrad.bench.overlap import allreduce_ms, exposed_communication

    # 2 ranks move (2 * 1/2) * n bytes: 1 GB at 1 GB/s is 1000 ms, plus 1 ms latency
    assert allreduce_ms(1e9, 2, 1.0, 1000.0) == pytest.approx(1001.0)
    # two 0.5 GB buckets at 1 GB/s (500 ms each, no latency), ready at 0 and 800 ms, backward 1000 ms:
    # the first runs 0-500, the second 800-1300: 300 ms exposed; one shot after backward: 1000 ms
    estimate = exposed_communication([0.0, 800.0], [5e8, 5e8], 1000.0, 2, 1.0, latency_us=0.0)
    assert estimate.bucketed_exposed_ms == pytest.approx(300.0)
    assert estimate.one_shot_exposed_ms == pytest.approx(1000.0)
    with pytest.raises(ValueError, match="equal lengths"):
        exposed_communication([0.0], [1, 2], 1.0, 2, 1.0)
