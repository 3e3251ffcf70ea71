"""The benchmark suite: its op counter on cases whose answer is known, checked against
torch.profiler, and tiny end-to-end runs whose JSON must hold every figure."""

from __future__ import annotations

import gc
import json
import os
import platform
import resource
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import ROUTE_ALL
from dist_utils import rank_profile, run_ranks
from test_mixed_precision import _live_storages
from torch import nn

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch < 2.5
    from torch.distributed._tensor import DTensor  # type: ignore[no-redef]

import flatgrad
from flatgrad.bench.counters import COPY_OPS, StepCounts, count_step, grad_bytes, weight_shapes
from flatgrad.bench.mixed import MICRO_BATCHES, MIXED_VARIANTS, ROLES, build_mixed
from flatgrad.bench.models import BenchModel, LlamaLike, ReorderedMLP, TiedGPT
from flatgrad.bench.runners import CONFIGS, MUON_CONFIGS, build_runner, muon_split

_LOCAL_KEYS = {"model", "clip", "micro_batches", "stock_ms", "flatgrad_ms", "ratio", "control_ratio"}
_LOCAL_KEYS |= {"stock_faults", "flatgrad_faults"}  # minor page faults per step, each side


def _mlp() -> nn.Module:
    """Three weights above the default `linear_min_numel`, so flatgrad routes them all."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 384), nn.Tanh(), nn.Linear(384, 384))


def _backward_step(module: nn.Module, x: torch.Tensor):
    loss = module(x).square().mean()
    return lambda: loss.backward()


def _profiled_counts(step: Callable[[], object], params: Iterable[nn.Parameter]) -> StepCounts:
    """The oracle: torch.profiler's events counted with the same definitions (ops of
    COPY_OPS with a weight-shaped input; c10d ops other than barriers)."""
    shapes = weight_shapes(params)
    with rank_profile(record_shapes=True) as prof:
        step()
    collectives = copies = 0
    for event in prof.events():
        if event.name.startswith("c10d::") and "barrier" not in event.name:
            collectives += 1
        elif event.name in COPY_OPS and any(tuple(s) in shapes for s in event.input_shapes if s):
            copies += 1
    return StepCounts(collectives, copies)


def _mixed() -> nn.Module:
    """`_mlp` and a Linear below the default `linear_min_numel`, which flatgrad leaves to autograd."""
    return nn.Sequential(_mlp(), nn.Linear(384, 16))


def _grad_ops(model: nn.Module) -> Callable[[], object]:
    """foreach, out= and in-place forms of counted ops on the four weight gradients."""
    grads = [p.grad for p in model.parameters() if p.grad is not None and p.dim() == 2]

    def step() -> None:
        torch._foreach_add_(grads, grads)  # 4 (the CPU fallback runs add_ per tensor)
        torch._foreach_mul_(grads, torch.tensor(0.5))  # 4
        torch.mul(grads[0], 1.0, out=grads[0])  # 1
        grads[1].copy_(torch.zeros_like(grads[1]))  # 1

    return step


def _counter_case(case: str) -> tuple[Callable[[], Callable[[], object]], nn.Module, int | None]:
    """(a factory of one step, its model, the known copy count or None where it is flatgrad's
    business). Each step is made fresh, so the counter and the profiler see the same state."""
    model: nn.Module = _mixed()
    x = torch.randn(16, 512)
    if case.startswith("flatgrad"):
        model = flatgrad.FlatGrad(model)
    if case.endswith("accumulating") or case == "grad ops":
        model(x).sum().backward()

    def backward_step() -> Callable[[], object]:
        if case.endswith("fresh"):
            model.zero_grad()
        return _backward_step(model, x)

    known = {"stock fresh": 0, "stock accumulating": 4, "grad ops": 10}.get(case)
    return (lambda: _grad_ops(model)) if case == "grad ops" else backward_step, model, known


@pytest.mark.parametrize(
    "case", ["stock fresh", "stock accumulating", "flatgrad fresh", "flatgrad accumulating", "grad ops"]
)
def test_op_counter_agrees_with_the_profiler(case: str):
    make_step, model, known = _counter_case(case)
    counted = count_step(make_step(), model.parameters())
    profiled = _profiled_counts(make_step(), model.parameters())
    assert counted == profiled, (case, counted, profiled)
    if known is not None:
        assert counted == StepCounts(collectives=0, grad_copies=known)


def test_op_counter_counts_an_op_once_where_the_profiler_lists_its_insides():
    weight = nn.Linear(64, 64).weight

    def step() -> None:
        weight.detach().clone()  # the profiler: clone and the copy_ inside it
        weight.detach().to(torch.float64)  # _to_copy and its copy_

    assert count_step(step, [weight]) == StepCounts(collectives=0, grad_copies=2)
    assert _profiled_counts(step, [weight]) == StepCounts(collectives=0, grad_copies=4)


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
        runner.update()
        loss = runner.forward((x,)).square().mean()  # the next step, under the profiler
        profiled = _profiled_counts(lambda r=runner, out=loss: r.backward(out), runner.module.parameters())
        assert counts == profiled, (name, counts, profiled)
        if runner.ddp is not None and name.startswith("ddp_"):  # stock DDP: one per bucket
            collectives = len(runner.ddp.reducer._get_zeros_like_grad_buckets())
        assert (counts.collectives, counts.grad_copies) == (collectives, copies), (name, counts)
        held = grad_bytes(runner.module.parameters(), runner.bucket_buffers())
        assert abs(held - grad_copies_held * numel_bytes) < 4096, (name, held, numel_bytes)


@pytest.mark.distributed
def test_counters_on_stock_ddp_and_flatgrad():
    run_ranks(_known_ddp_costs_worker)


_SHARDED = ("zero_stock", "fsdp2")


def _sharded_worker(rank: int, world_size: int) -> None:
    """Two SGD-with-momentum steps of each sharded configuration against ddp_bucket_view on
    the same per-rank batches. float64 and the same arithmetic but for where the gradient
    average divides by the world size (FSDP2 in its reduce-scatter): the parameters agree
    to rounding, which 1e-12 bounds with room to spare against a wrong step (lr 0.1 moves
    them by ~1e-2)."""
    torch.manual_seed(0)
    model = LlamaLike(vocab=64, dim=32, depth=2, heads=2).double()  # blocks, a tied head
    runners = {
        name: build_runner(name, model, torch.device("cpu"), lr=0.1)
        for name in ("ddp_bucket_view", *_SHARDED)
    }
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):
        batch = _tiny_tokens(gen, torch.device("cpu"))
        for runner in runners.values():
            runner.backward(runner.forward(batch))
            runner.update()
    reference = runners["ddp_bucket_view"]
    expected = dict(reference.module.module.named_parameters())
    state_bytes = {name: r.optimizer_state_bytes() for name, r in runners.items()}
    for name in _SHARDED:
        module = runners[name].module
        params = dict((module.module if name == "zero_stock" else module).named_parameters())
        assert params.keys() == expected.keys(), name
        for key, param in params.items():
            full = param.full_tensor() if isinstance(param, DTensor) else param
            torch.testing.assert_close(full, expected[key], rtol=0, atol=1e-12, msg=f"{name} {key}")
        # about half of DDP's state on each rank (ZeroRedundancyOptimizer: whole parameters,
        # balanced greedily), all of it over the ranks
        assert 0.4 <= state_bytes[name] / state_bytes["ddp_bucket_view"] <= 0.6, (name, state_bytes)
        total = torch.tensor(state_bytes[name])
        dist.all_reduce(total)
        assert total.item() == state_bytes["ddp_bucket_view"], (name, state_bytes)
    fsdp2 = runners["fsdp2"]
    loss = fsdp2.forward(_tiny_tokens(gen, torch.device("cpu")))
    counts = count_step(lambda: fsdp2.backward(loss), fsdp2.module.parameters())
    assert counts.collectives == 3  # a reduce-scatter per block and one for the root's parameters
    held = grad_bytes(fsdp2.module.parameters())  # the local shards of its DTensor gradients
    assert 0.4 <= held / grad_bytes(reference.module.parameters()) <= 0.6


@pytest.mark.distributed
def test_sharded_configurations_step_as_ddp_with_half_the_state():
    run_ranks(_sharded_worker)


def _unused_parameters_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = ReorderedMLP(width=16, depth=3)
    gen = torch.Generator().manual_seed(rank)
    batch = (torch.randn(4, 16, generator=gen), torch.randn(4, 16, generator=gen))
    for name in CONFIGS:
        runner = build_runner(name, model, torch.device("cpu"), unused_parameters=True)
        for _ in range(3):  # past DDP's bucket rebuild in iteration 2
            runner.backward(runner.forward(batch))
            runner.update()
        plain = runner.module
        while isinstance(getattr(plain, "module", None), nn.Module):  # DDP, DataParallel, FlatGrad
            plain = plain.module
        assert all(p.grad is None for p in plain.unused.parameters()), name


@pytest.mark.distributed
def test_every_configuration_runs_a_model_with_unused_parameters():
    """`ReorderedMLP` leaves a layer unused: the DDP configurations are told
    (find_unused_parameters=True, but for static_graph, which needs no flag) and every
    configuration steps it; no rank used the layer, so its `.grad` stays None."""
    run_ranks(_unused_parameters_worker)


def tiny_gpt() -> BenchModel:
    """The bench's TiedGPT, tiny and in float64 (a factory for the Muon rows' test)."""

    def batch(gen: torch.Generator, device: torch.device) -> tuple[torch.Tensor, ...]:
        idx = torch.randint(0, 32, (2, 9), generator=gen)
        return idx[:, :-1].to(device), idx[:, 1:].to(device)

    return BenchModel(lambda: TiedGPT(vocab=32, dim=16, depth=2, heads=2, block=8).double(), batch)


def _muon_rows_worker(rank: int, world_size: int) -> None:
    """The Muon + AdamW configurations through the bench's own loop (`bench_model`): every
    row, its ratio to the stock ZeRO-1, every rank's state. float64, so all five train
    alike (the loss of the last timed step agrees; Muon's bfloat16 Newton-Schulz sees the
    same gradients). Both ZeRO-1s hold about half of the unsharded state on each rank and
    all of it over the ranks."""
    from flatgrad.bench.report import format_muon
    from flatgrad.bench.suite import bench_model

    model = TiedGPT(vocab=32, dim=16, depth=2, heads=2, block=8)
    matrices, rest = muon_split(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert [names[id(p)] for p in matrices] == [
        n for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("blocks.")
    ]  # the hidden matrices; the tied embedding and head, the positions and vectors: AdamW
    assert names[id(model.tokens.weight)] in [names[id(p)] for p in rest]
    result = bench_model("test_bench:tiny_gpt", list(MUON_CONFIGS), 2, 1, torch.device("cpu"))
    rows = result["configs"]
    assert list(rows) == list(MUON_CONFIGS)
    assert rows["zero_stock_muon"]["pair_ratio_to_zero_stock_muon"] == 1.0
    unsharded = rows["ddp_muon"]["optimizer_state_bytes_by_rank"]
    assert unsharded == [rows["ddp_muon"]["optimizer_state_bytes"]] * world_size
    assert rows["flatgrad_dp_muon"]["optimizer_state_bytes_by_rank"] == unsharded
    for name, record in rows.items():
        assert record["pair_ratio_to_zero_stock_muon"] > 0 and "ratio_to_ddp_default" not in record
        assert record["final_loss"] == pytest.approx(rows["ddp_muon"]["final_loss"], rel=1e-9), name
    for name in ("flatgrad_zero_muon", "zero_stock_muon", "zero_stock_muon_view"):
        per_rank = rows[name]["optimizer_state_bytes_by_rank"]
        assert per_rank[rank] == rows[name]["optimizer_state_bytes"]
        assert sum(per_rank) == unsharded[0], (name, per_rank, unsharded)
        assert max(per_rank) <= 0.6 * unsharded[0], (name, per_rank, unsharded)
    assert rows["flatgrad_zero_muon"]["collectives_per_step"] >= 1
    table = format_muon({"models": {"tiny_gpt": result}})
    assert all(name in table for name in MUON_CONFIGS) and "vs ZeRO" in table


@pytest.mark.distributed
@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon: torch 2.9 on")
def test_bench_muon_rows_shard_the_state_and_train_alike():
    run_ranks(_muon_rows_worker)


def test_bench_muon_configurations_are_asked_for_by_name():
    from flatgrad.bench.cli import parse_args
    from flatgrad.bench.report import format_muon

    assert set(parse_args([]).configs) == set(CONFIGS)  # not in the default run
    assert parse_args(["--configs", "zero_stock_muon,flatgrad_zero_muon"]).configs == [
        "zero_stock_muon",
        "flatgrad_zero_muon",
    ]
    assert format_muon({"models": {"gpt": {"configs": {}}}}) == ""


# Bytes per parameter one rank holds after a step, on 2 ranks with AdamW: parameters +
# gradients + masters + the two moments.
_MIXED_BYTES = {
    "ddp_autocast": 4 + 4 + 0 + 8,  # float32 throughout
    "ddp_bf16": 2 + 2 + 0 + 4,  # bfloat16 gradients and moments
    "flatgrad_main_grads": 2 + 4 + (4 + 8) / 2,  # float32 main grads; masters and moments sharded
}


def _mixed_memory_worker(rank: int, world_size: int) -> None:
    """Each variant of the mixed-precision row built alone, two steps: what it counts
    (`held_bytes`) against the oracle, every tensor storage alive in the process less those
    alive before it was built (`test_mixed_precision`'s count), which would also see a
    tensor no role holds: equal here; 1% leaves room for small bookkeeping tensors. AdamW's
    step counts (one float32 scalar per tensor) are in the state, so a variant holds a few
    bytes over its nominal per-parameter figure (82k parameters: 1.00005x)."""
    torch.manual_seed(0)
    model = LlamaLike(vocab=512, dim=64, depth=1, heads=2)
    numel = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(rank)
    batches = [_tokens(gen, 512) for _ in range(MICRO_BATCHES)]
    for name in MIXED_VARIANTS:
        gc.collect()
        before = _live_storages()
        runner = build_mixed(name, model, torch.device("cpu"))
        for _ in range(2):
            runner.step(batches)
        gc.collect()
        live = sum(nbytes for key, nbytes in _live_storages().items() if key not in before)
        held = runner.held_bytes()
        assert set(held) == set(ROLES), name
        counted = sum(held.values())
        assert counted <= live <= 1.01 * counted, (name, counted, live)
        assert _MIXED_BYTES[name] <= counted / numel <= 1.01 * _MIXED_BYTES[name], (name, held)
        del runner


@pytest.mark.distributed
def test_mixed_precision_row_counts_every_byte_it_holds():
    run_ranks(_mixed_memory_worker)


def test_mixed_precision_row_refuses_an_unknown_variant():
    with pytest.raises(
        ValueError, match="variant must be one of ddp_autocast, ddp_bf16, flatgrad_main_grads, got 'fp16'"
    ):
        build_mixed("fp16", nn.Linear(2, 2), torch.device("cpu"))


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
        "--mixed-steps",
        "0",
        "--malloc",
        "pinned",
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
                "optimizer_state_bytes_by_rank",
                "exposed_comm_ms",
                "bucket_launch_ms",
                "backward_ms",
                "bucket_bytes",
            }
            assert record["min_ms"] <= record["median_ms"] <= record["max_ms"]
        assert result_["configs"]["ddp_default"]["ratio_to_ddp_default"] == 1.0
        assert result_["configs"]["flatgrad_ddp_hook"]["collectives_per_step"] == 1
        dp = result_["configs"]["flatgrad_dp"]
        for name in ("flatgrad_zero", *_SHARDED):
            state = result_["configs"][name]["optimizer_state_bytes"]
            assert state <= 0.6 * dp["optimizer_state_bytes"], name
        assert result_["configs"]["fsdp2"]["grad_copies_per_step"] is None  # not among the counted ops
        assert dp["exposed_comm_ms"] >= 0 and len(dp["bucket_launch_ms"]) == len(dp["bucket_bytes"])
    assert {row["case"] for row in report["ops"]} and all(row["ratio"] > 0 for row in report["ops"])
    assert {(row["model"], row["clip"], row["micro_batches"]) for row in report["local"]} == {
        (name, clip, micro)
        for name in ("llama", "small_layers_64", "linear_1024")
        for clip, micro in ((False, 1), (True, 1), (False, 4))
    }
    assert all(set(row) == _LOCAL_KEYS and row["stock_faults"] >= 0 for row in report["local"])
    assert report["environment"]["malloc"] == ("pinned" if platform.libc_ver()[0] == "glibc" else "glibc")
    assert report["mixed_precision"] is None  # --mixed-steps 0
    assert report["local_settings"]["models"] == ["llama", "small_layers_64", "linear_1024"]
    assert "one process: model" in result.stdout
    assert "USDT" not in result.stdout + result.stderr  # ops are counted without the profiler


@pytest.mark.distributed
def test_bench_mixed_precision_row_end_to_end(tmp_path: Path):
    """The mixed-precision row on the bench's Llama (2 ranks, 2 timed steps), beside the
    smallest model row the bench runs."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "flatgrad.bench", "--models", "small_layers", "--configs", "ddp_bucket_view"]
    cmd += ["--steps", "1", "--warmup", "1", "--local-steps", "0", "--op-repeats", "0"]
    cmd += ["--mixed-steps", "2", "--mixed-model", "llama", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mixed precision: llama" in result.stdout
    assert "flatgrad:" not in result.stderr  # the wrap-time warning is about what the row does
    row = json.loads(out.read_text())["mixed_precision"]
    assert (row["model"], row["steps"], row["warmup"], row["micro_batches"]) == ("llama", 2, 1, 4)
    assert row["optimizer"]["name"] == "AdamW" and row["num_parameters"] > 2_000_000
    assert list(row["variants"]) == list(MIXED_VARIANTS)
    for name, record in row["variants"].items():
        assert set(record) == {
            "median_ms",
            "min_ms",
            "max_ms",
            "ratio_to_ddp_autocast",
            "ratio_to_ddp_bf16",
            "bytes_per_parameter",
            "bytes",
            "step_peak_extra_mb",
            "final_loss",
        }, name
        assert 0 < record["min_ms"] <= record["median_ms"] <= record["max_ms"], name
        assert record["ratio_to_ddp_autocast"] > 0 and record["ratio_to_ddp_bf16"] > 0, name
        assert set(record["bytes"]) == set(ROLES) and sum(record["bytes"].values()) > 0, name
        per_parameter = record["bytes_per_parameter"]
        assert _MIXED_BYTES[name] <= per_parameter <= 1.01 * _MIXED_BYTES[name], (name, per_parameter)
        assert 0 < record["final_loss"] < 1e3, name
    variants = row["variants"]
    assert variants["ddp_autocast"]["ratio_to_ddp_autocast"] == 1.0
    mains = variants["flatgrad_main_grads"]["bytes_per_parameter"]
    assert mains < variants["ddp_autocast"]["bytes_per_parameter"]
    assert mains <= 1.1 * (2 + 4 + 12 / 2)


def test_one_process_rows_time_the_control_in_the_same_rotation(monkeypatch):
    from flatgrad.bench import local

    clock = [0.0]
    order: list[str] = []
    monkeypatch.setattr(local.time, "perf_counter", lambda: clock[0])

    def step(name: str, seconds: float) -> local.Step:
        def run(batch: local.Batch) -> None:
            order.append(name)
            clock[0] += seconds * float(batch[0])  # every side slower on a later batch alike

        return run

    batches = [(torch.tensor(float(i + 1)),) for i in range(5)]
    row = local.interleave(step("stock", 1.0), step("control", 2.0), step("ours", 3.0), batches, warmup=2)
    timed = ["stock", "control", "ours", "control", "ours", "stock", "ours", "stock", "control"]
    assert order[6:] == timed  # after the warm-up, each goes first in turn
    assert row["ratio"] == 3.0 and row["control_ratio"] == 2.0
    assert row["stock_ms"] == 4000.0 and row["flatgrad_ms"] == 12000.0  # batches 3, 4, 5: median 4


def _tokens(gen: torch.Generator, vocab: int) -> tuple[torch.Tensor, ...]:
    idx = torch.randint(0, vocab, (2, 17), generator=gen)
    return idx[:, :-1], idx[:, 1:]


def _tiny_tokens(gen: torch.Generator, device: torch.device) -> tuple[torch.Tensor, ...]:
    idx = torch.randint(0, 64, (2, 9), generator=gen)
    return idx[:, :-1].to(device), idx[:, 1:].to(device)


def tiny_llama() -> BenchModel:
    """The bench's Llama-like LM, tiny (a factory for --local-models)."""
    return BenchModel(lambda: LlamaLike(vocab=64, dim=32, depth=1, heads=2), _tiny_tokens)


def test_bench_local_only_end_to_end(tmp_path: Path):
    """The one-process rows alone: no ranks, and the JSON holds those rows and nothing else."""
    out = tmp_path / "local.json"
    tiny = "test_bench:tiny_llama"
    cmd = [
        sys.executable,
        "-m",
        "flatgrad.bench",
        "--local-only",
        "--local-models",
        tiny,
        "--local-steps",
        "2",
        "--local-accumulate",
        "3",
    ]
    cmd += ["--warmup", "1", "--op-repeats", "0", "--out", str(out)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "USDT" not in result.stdout + result.stderr
    assert "one process: model" in result.stdout
    report = json.loads(out.read_text())
    assert set(report) == {"environment", "local_settings", "local", "ops"}
    assert (report["environment"]["backend"], report["environment"]["world_size"]) == (None, 1)
    assert report["local_settings"] == {
        "steps": 2,
        "warmup": 1,
        "models": [tiny],
        "accumulate": 3,
        "threads": report["local_settings"]["threads"],
    }
    rows = [(row["model"], row["clip"], row["micro_batches"]) for row in report["local"]]
    assert rows == [(tiny, False, 1), (tiny, True, 1), (tiny, False, 3)]
    for row in report["local"]:
        assert set(row) == _LOCAL_KEYS
        assert row["stock_ms"] > 0 and row["flatgrad_ms"] > 0 and row["ratio"] > 0
    assert report["ops"] == []


def test_bench_rejects_unknown_model():
    from flatgrad.bench.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--models", "resnet"])
    for bad in (
        ["--local-models", "gpt"],
        ["--compile"],  # (the torch.compile row is gone: docs/performance.md says how to time it by hand)
        ["--mixed-model", "llama,gpt"],
        ["--mixed-variants", "ddp_fp16"],
    ):
        with pytest.raises(SystemExit):
            parse_args(bad)
    args = parse_args(["--local-only", "--local-models", "linear_1024", "--mixed-model", "gpt"])
    assert (args.local_only, args.local_models, args.mixed_model) == (True, ["linear_1024"], "gpt")


def tiny_bench_model():
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


_HEAP_CYCLES = """
import ctypes
import torch
from flatgrad.bench.memory import (
    _M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD, _MMAP_THRESHOLD_MAX, minor_faults, pin_malloc
)
libc = ctypes.CDLL(None)
# A heap that gives any freed top over 128 KiB back (glibc's starting threshold; its
# self-adjusting default gets there or not depending on the process's history).
assert libc.mallopt(_M_TRIM_THRESHOLD, 128 << 10) and libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
def step():  # a step's transients: 128 MiB in 1 MiB tensors
    blocks = [torch.ones(1 << 18) for _ in range(128)]
    del blocks
def second_step_faults():
    step()
    before = minor_faults()
    step()
    return minor_faults() - before
trimming = second_step_faults()
assert pin_malloc()
print(trimming, second_step_faults())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_pinned_malloc_reuses_the_memory_a_step_freed():
    """What ``--malloc pinned`` removes: a heap that gives the memory a step freed back to the
    OS faults it in again page by page in the next step; pinned (over that same setting),
    the next step reuses it. Even so set, glibc does not trim in every process (about one in
    five here, the same code each time, with or without address-space randomisation): such
    a process says nothing about the pin, so another one is started."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    pages = 128 * (1 << 20) // resource.getpagesize()
    seen = []
    for _ in range(8):
        result = subprocess.run(
            [sys.executable, "-c", _HEAP_CYCLES], capture_output=True, text=True, timeout=120, env=env
        )
        assert result.returncode == 0, result.stderr[-2000:]
        trimming, pinned = map(int, result.stdout.split()[-2:])
        seen.append((trimming, pinned))
        if trimming > pages // 2:
            assert pinned < pages // 16, seen
            return
    pytest.fail(f"no process trimmed its heap: (trimming, pinned) faults {seen}")
