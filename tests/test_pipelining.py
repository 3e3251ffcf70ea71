"""`flatgrad.pipelining.PipelineStage` (a DataParallel stage that averages in the step's last
backward) and `ShardedOptimizer` over pipeline stages, against DDP stages.

The mesh, stage modules, batches and schedules are `test_pipeline`'s: four gloo ranks,
("pp", "dp") = 2 x 2, ranks 0 and 1 holding stage 0, ranks 2 and 3 stage 1. The oracle is
the same schedule over ``DDP(copy.deepcopy(stage_module), process_group=<dp group>)`` with
torch's AdamW and ``torch.nn.utils.clip_grad_norm_`` over the stage's parameters (the norm
DDP stages give: each stage's own), 3 steps of 4 micro-batches. In float64 both sides add
the same micro-batch gradients and average the same two halves (dividing by 2 and by 4 is
exact), so they agree to round-off: 1e-12, as in test_pipeline (measured: gradients and
losses equal to the bit). Our norms are flatgrad's chunked float64 norms, torch's one
float64 norm: the same sum in another order (measured: within 2.2e-16, and the parameters
after the clipped AdamW steps too). With ``reduce_dtype=torch.bfloat16`` the oracle's DDP
stages average through DDP's bf16 compress hook (cast, divide, sum, cast back), element for
element what `replicate` sends, so the tolerance stays 1e-12.
"""

from __future__ import annotations

import copy
import re
import types
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import ROUTE_ALL, grad_in_buffers
from dist_utils import average_grads, run_ranks
from oracle import assert_grads_like, assert_params_like
from test_pipeline import NUM_MICROBATCHES, STEPS, TOL, _batch, _loss, _run_step, _shapes, _stage_module
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import flatgrad
from flatgrad import replicate_state

pytestmark = pytest.mark.distributed

pipelining = pytest.importorskip("torch.distributed.pipelining")
import flatgrad.pipelining  # noqa: E402 (after the skip: it imports torch.distributed.pipelining)

MAX_NORM = 0.05  # below every step's norm here: each step clips


def _bf16_hook(process_group, bucket):  # noqa: ANN001, ANN202 (DDP checks annotations that are real types)
    """DDP's bf16_compress_hook (refused by DDP on CPU) over `process_group`."""
    buffer = bucket.buffer()
    wire = buffer.to(torch.bfloat16).div_(dist.get_world_size(process_group))
    future = dist.all_reduce(wire, group=process_group, async_op=True).get_future()
    return future.then(lambda f: buffer.copy_(f.value()[0]))


def _schedule(name: str, stages: list[Any]) -> Any:
    single = name in ("ScheduleGPipe", "Schedule1F1B")
    schedule_class = getattr(pipelining, name)
    return schedule_class(stages[0] if single else stages, n_microbatches=NUM_MICROBATCHES, loss_fn=_loss)


def _compare(
    name: str,
    path: str,
    settings: dict[str, Any],
    mesh: tuple[int, int, Any, Any],
    infer: bool,
    meshes: tuple[Any, Any] | None = None,
) -> None:
    """`path` ("data_parallel": AdamW on the model and FlatGrad's clipping; "sharded":
    ShardedOptimizer(dp, AdamW) and its clipping) over flatgrad.pipelining.PipelineStage,
    against DDP stages: losses, norms, gradients (where readable) and parameters. With
    `meshes` (the "pp" and "dp" DeviceMeshes) both clip by the whole pipeline's norm: ours
    with ``pp_mesh=``, DDP's by hand from the stage norms (`_whole_model_clip`)."""
    index, dp_rank, pp_group, dp_group = mesh
    cpu = torch.device("cpu")
    model = _stage_module(index)
    ref_model = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    dp = flatgrad.replicate(flat, process_group=dp_group, **settings)
    ref = DDP(ref_model, process_group=dp_group)
    if settings.get("reduce_dtype") is not None:
        ref.register_comm_hook(dp_group, _bf16_hook)
    shapes = _shapes(index, 2, not infer)
    stage = flatgrad.pipelining.PipelineStage(dp, index, 2, cpu, group=pp_group, **shapes)
    ref_stage = pipelining.PipelineStage(ref, index, 2, cpu, group=pp_group, **_shapes(index, 2, True))
    ours, theirs = _schedule(name, [stage]), _schedule(name, [ref_stage])
    adamw = {"lr": 0.05, "weight_decay": 0.1}
    opt: Any = (
        flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, **adamw)
        if path == "sharded"
        else torch.optim.AdamW(model.parameters(), **adamw)
    )
    ref_opt = torch.optim.AdamW(ref_model.parameters(), **adamw)
    first, last = index == 0, index == 1
    what = f"{name} {path} {settings}"
    for step in range(STEPS):
        batch = _batch(100 * dp_rank + step)
        opt.zero_grad()
        ref_opt.zero_grad()
        losses = _run_step(ours, first, last, batch)
        ref_losses = _run_step(theirs, first, last, batch)
        assert len(losses) == (NUM_MICROBATCHES if last else 0)
        for loss, ref_loss in zip(losses, ref_losses):
            torch.testing.assert_close(loss, ref_loss, **TOL)
        if path == "data_parallel":  # (a ShardedOptimizer's reduce-scattered .grad refuses reads)
            assert_grads_like(model, ref_model, **TOL, what=f"{what} step {step}")
            for param_name, param in model.named_parameters():
                assert grad_in_buffers(flat, param.grad), f"{what} {param_name}: outside"
        clip = opt.clip_grad_norm_ if path == "sharded" else flat.clip_grad_norm_
        if meshes is None:
            norm = clip(MAX_NORM)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), MAX_NORM)
            _check_whole_model_norm(norm, ref_norm, pp_group)
        else:
            norm, ref_norm = clip(MAX_NORM, pp_mesh=meshes[0]), _whole_model_clip(ref_model, pp_group)
            if path == "sharded" and step == 0:
                with pytest.raises(
                    ValueError, match="pp_mesh must hold one rank of each data-parallel group"
                ):
                    opt.clip_grad_norm_(MAX_NORM, pp_mesh=meshes[1])
        assert ref_norm > MAX_NORM, "the step must clip"
        torch.testing.assert_close(norm.double(), ref_norm, **TOL)
        opt.step()
        ref_opt.step()
        assert_params_like(model, ref_model, **TOL, what=f"{what} step {step}")
    # One synchronisation per step: the last backward's (averaging, overlapped), none other.
    assert replicate_state(dp)._engine.num_syncs == STEPS, what
    if "bucket_cap_mb" in settings:  # several buckets: all but the last launched inside that backward
        assert len(replicate_state(dp).buckets) > 2, f"{what}: {len(replicate_state(dp).buckets)} buckets"
        assert (
            replicate_state(dp)._engine.last_round.launched_in_backward
            == len(replicate_state(dp).buckets) - 1
        ), what


def _manual_sharded(mesh: tuple[int, int, Any, Any]) -> None:
    """The manual path with a ShardedOptimizer: torch's own stage over dp, ``dp.no_sync()``
    around the step and ``flat.all_reduce_grads`` after it (no backward averages, so every
    `.grad` stays plain for torch's scale_grads), then its clipping and step: as DDP stages."""
    index, dp_rank, pp_group, dp_group = mesh
    cpu = torch.device("cpu")
    model = _stage_module(index)
    ref_model = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    dp = flatgrad.replicate(flat, process_group=dp_group)
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, lr=0.05)
    ref = DDP(ref_model, process_group=dp_group)
    ours = _schedule("ScheduleGPipe", [pipelining.PipelineStage(dp, index, 2, cpu, group=pp_group)])
    ref_stage = pipelining.PipelineStage(ref, index, 2, cpu, group=pp_group, **_shapes(index, 2, True))
    theirs = _schedule("ScheduleGPipe", [ref_stage])
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=0.05)
    for step in range(STEPS):
        batch = _batch(100 * dp_rank + step)
        opt.zero_grad()
        ref_opt.zero_grad()
        with dp.no_sync():
            _run_step(ours, index == 0, index == 1, batch)
        flat.all_reduce_grads(dp_group)
        _run_step(theirs, index == 0, index == 1, batch)
        norm = opt.clip_grad_norm_(MAX_NORM)
        torch.testing.assert_close(
            norm.double(), torch.nn.utils.clip_grad_norm_(ref_model.parameters(), MAX_NORM), **TOL
        )
        opt.step()
        ref_opt.step()
        assert_params_like(model, ref_model, **TOL, what=f"manual ShardedOptimizer step {step}")
    assert replicate_state(dp)._engine.num_syncs == 0


def _multi_stage(mesh: tuple[int, int, Any, Any], name: str) -> None:
    """A multi-stage schedule with full backwards (4 virtual stages, 2 per "pp" rank): each
    stage averages in its own last backward, against DDP stages."""
    pp_rank, dp_rank, pp_group, dp_group = mesh
    cpu = torch.device("cpu")
    indices = [pp_rank, pp_rank + 2]
    models = [_stage_module(index, 4) for index in indices]
    refs = [copy.deepcopy(model) for model in models]
    dps = [flatgrad.replicate(flatgrad.FlatGrad(m, config=ROUTE_ALL), process_group=dp_group) for m in models]
    ddps = [DDP(ref, process_group=dp_group) for ref in refs]
    ours = _schedule(
        name,
        [
            flatgrad.pipelining.PipelineStage(d, i, 4, cpu, group=pp_group, **_shapes(i, 4, True))
            for d, i in zip(dps, indices)
        ],
    )
    theirs = _schedule(
        name,
        [
            pipelining.PipelineStage(d, i, 4, cpu, group=pp_group, **_shapes(i, 4, True))
            for d, i in zip(ddps, indices)
        ],
    )
    for step in range(2):
        batch = _batch(100 * dp_rank + step)
        for model in models + refs:
            model.zero_grad()
        _run_step(ours, pp_rank == 0, pp_rank == 1, batch)
        _run_step(theirs, pp_rank == 0, pp_rank == 1, batch)
        for model, ref in zip(models, refs):
            assert_grads_like(model, ref, **TOL, what=f"{name} step {step}")
    assert [replicate_state(dp)._engine.num_syncs for dp in dps] == [2, 2], name


def _whole_model_clip(model: nn.Module, pp_group: Any) -> torch.Tensor:
    """Clipping by the whole pipeline's norm, by hand, as torchtitan does for its pipelined
    models: the stage's norm, its square summed over "pp", each gradient scaled by torch's
    factor ``min(1, max_norm / (norm + 1e-6))``; returns that norm."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    square = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).square()
    dist.all_reduce(square, group=pp_group)
    total = square.sqrt()
    coef = torch.clamp(MAX_NORM / (total + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coef)
    return total


def _check_whole_model_norm(norm: torch.Tensor, ref_norm: torch.Tensor, pp_group: Any) -> None:
    """The whole model's norm from the stages' (what clipping by it needs): one all-reduce
    of the squared stage norms over "pp", for flatgrad's and DDP's stages alike."""
    squares = torch.stack([norm.double(), ref_norm]).square()
    dist.all_reduce(squares, group=pp_group)
    torch.testing.assert_close(squares[0], squares[1], **TOL)


def _split_backward(
    mesh: tuple[int, int, Any, Any],
    sharded: bool,
    check_finite: bool,
    name: str = "ScheduleInterleavedZeroBubble",
) -> None:
    """A split-backward schedule `name` (4 virtual stages, 2 per "pp" rank; the V-shaped
    ones put stages 0 and 3 on rank 0), whose weight gradients no AccumulateGrad hook
    sees: the stage averages with one all_reduce_grads after each stage's last backward.
    Oracle: plain stages averaged by hand (DDP stages average nothing there, see
    docs/data-parallel.md); with `sharded`, AdamW steps on both. With `check_finite`, the
    check the stage runs before that all-reduce passes, and then raises on every rank
    once one rank holds a NaN."""
    pp_rank, dp_rank, pp_group, dp_group = mesh
    cpu = torch.device("cpu")
    v_shape = name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")  # rank 0: stages 0 and 3
    indices = [pp_rank, 3 - pp_rank] if v_shape else [pp_rank, pp_rank + 2]
    first, last = pp_rank == 0, pp_rank == (0 if v_shape else 1)
    models = [_stage_module(index, 4) for index in indices]
    refs = [copy.deepcopy(model) for model in models]
    flats = [flatgrad.FlatGrad(model, config=ROUTE_ALL) for model in models]
    dps = [flatgrad.replicate(flat, process_group=dp_group, check_finite=check_finite) for flat in flats]
    calls = [0]
    for flat in flats:  # counts the stage's all-reduces
        flat.all_reduce_grads = _counting(flat.all_reduce_grads, calls)
    stages = [
        flatgrad.pipelining.PipelineStage(dp, i, 4, cpu, group=pp_group, **_shapes(i, 4, True))
        for dp, i in zip(dps, indices)
    ]
    ref_stages = [
        pipelining.PipelineStage(ref, i, 4, cpu, group=pp_group, **_shapes(i, 4, True))
        for ref, i in zip(refs, indices)
    ]
    ours, theirs = _schedule(name, stages), _schedule(name, ref_stages)
    opts = [flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, lr=0.05) for dp in dps] if sharded else []
    ref_opts = [torch.optim.AdamW(ref.parameters(), lr=0.05) for ref in refs] if sharded else []
    for step in range(2):
        batch = _batch(100 * dp_rank + step)
        for model in models + refs:
            model.zero_grad()
        for opt in opts:
            opt.zero_grad()
        _run_step(ours, first, last, batch)
        _run_step(theirs, first, last, batch)
        average_grads(refs, dp_group)
        for flat, model, ref in zip(flats, models, refs):
            assert_grads_like(model, ref, **TOL, what=f"{name} step {step}")
            for param in model.parameters():
                assert grad_in_buffers(flat, param.grad), f"{name} step {step}: outside"
        for opt in opts + ref_opts:
            opt.step()
        for model, ref in zip(models, refs):
            assert_params_like(model, ref, **TOL, what=f"{name} sharded={sharded} step {step}")
    assert calls[0] == 2 * len(flats), "one all_reduce_grads per stage and step"
    assert all(replicate_state(dp)._engine.num_syncs == 0 for dp in dps), "no backward averaged besides"
    if check_finite:
        if dp_rank == 1:
            next(models[0].parameters()).grad[0] = float("nan")
        match = re.escape("rank 1 (this rank) in ['0.weight']" if dp_rank == 1 else "rank(s) [1]")
        with pytest.raises(RuntimeError, match=r"check_finite=True\): a non-finite gradient .* on " + match):
            stages[0]._all_reduce()  # (what the step's last weight backward runs)


def _counting(method: Any, calls: list[int]) -> Any:
    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return method(*args, **kwargs)

    return counted


def _refusals(mesh: tuple[int, int, Any, Any]) -> None:
    pp_rank, _, pp_group, dp_group = mesh
    cpu = torch.device("cpu")
    flat = flatgrad.FlatGrad(_stage_module(pp_rank), config=ROUTE_ALL)
    with pytest.raises(TypeError, match="submodule must be one flatgrad.replicate .*, got a Sequential"):
        flatgrad.pipelining.PipelineStage(flat, pp_rank, 2, cpu, group=pp_group)
    dp = flatgrad.replicate(flat, process_group=dp_group)
    with pytest.raises(ValueError, match="dw_builder must be None for flatgrad.pipelining.PipelineStage"):
        flatgrad.pipelining.PipelineStage(dp, pp_rank, 2, cpu, group=pp_group, dw_builder=lambda: None)
    # A schedule that scales with no backward marked the step's last (last_backward=True):
    # the gradients were not averaged, and scale_grads says so.
    stage = flatgrad.pipelining.PipelineStage(dp, pp_rank, 2, cpu, group=pp_group)
    with pytest.raises(
        RuntimeError, match="scaled the gradients before any backward it called the step's last"
    ):
        stage.scale_grads(NUM_MICROBATCHES)


def _worker(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_group, dp_group = device_mesh.get_group("pp"), device_mesh.get_group("dp")
    mesh = (device_mesh.get_local_rank("pp"), device_mesh.get_local_rank("dp"), pp_group, dp_group)
    for name in ("ScheduleGPipe", "Schedule1F1B"):
        for path in ("data_parallel", "sharded"):
            _compare(name, path, {}, mesh, infer=name == "ScheduleGPipe")
    _compare(
        "Schedule1F1B", "data_parallel", {"check_finite": True, "bucket_cap_mb": 0.0003}, mesh, infer=False
    )
    _compare("Schedule1F1B", "sharded", {"reduce_dtype": torch.bfloat16}, mesh, infer=False)
    for path in ("data_parallel", "sharded"):  # clipped by the whole pipeline's norm
        _compare("Schedule1F1B", path, {}, mesh, infer=False, meshes=(device_mesh["pp"], device_mesh["dp"]))
    _manual_sharded(mesh)
    _multi_stage(mesh, "ScheduleInterleaved1F1B")
    _split_backward(mesh, sharded=False, check_finite=True)
    _split_backward(mesh, sharded=True, check_finite=False)
    for name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
        _split_backward(mesh, sharded=False, check_finite=False, name=name)
    _refusals(mesh)


def test_stages_average_in_the_last_backward_and_equal_ddp_stages():
    run_ranks(_worker, world_size=4, timeout=300.0)


def test_an_older_torch_stage_is_refused(monkeypatch: pytest.MonkeyPatch):
    old = types.SimpleNamespace(PipelineStage=type("PipelineStage", (nn.Module,), {}))
    monkeypatch.setattr(flatgrad.pipelining, "pipelining", old)
    with pytest.raises(RuntimeError, match=r"needs torch's PipelineStage.forward_maybe_with_nosync, which"):
        flatgrad.pipelining._check_torch_stage()
