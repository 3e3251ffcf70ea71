"""Pipeline stages (`torch.distributed.pipelining`) whose submodule is a `FlatGrad`, against
the same pipeline with stock stages.

Four gloo ranks on a 2 x 2 mesh, ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp",
"dp"))`` (torchtitan's order: "pp" outermost): ranks 0 and 1 hold stage 0, ranks 2 and 3
stage 1, and each stage is data parallel over its "dp" pair, which feed different data. The
oracle is the same schedule over stock stages, ``DDP(copy.deepcopy(stage_module),
process_group=<dp group>)``, run on the same ranks after ours each step: gradients before
the step, the last stage's losses and the parameters after AdamW steps are compared. In
float64 both sides add the same micro-batch gradients and average the same two halves, so
they agree to round-off (1e-12; equal to the bit here). The pipeline over FlatGrad alone
(no data parallelism) runs on each "pp" pair against plain stages.

The DDP stages (the oracle's, and flatgrad's DDP hook path) are given their shapes
(``input_args``/``output_args``): torch 2.13's shape inference runs a training forward
through DDP whose reducer is then left prepared, which the GPipe schedule's second step
trips on (stock DDP too). `DataParallel` stages infer theirs.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from conftest import ROUTE_ALL, grad_in_buffers
from dist_utils import average_grads, run_ranks
from oracle import assert_grads_like, assert_params_like
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import flatgrad
from flatgrad import replicate_state

pytestmark = pytest.mark.distributed

pipelining = pytest.importorskip("torch.distributed.pipelining")

TOL = {"rtol": 1e-12, "atol": 1e-12}  # float64 round-off: see the module notes
NUM_MICROBATCHES = 4
STEPS = 3
WIDTH = 16


def _stage_module(index: int, num_stages: int = 2) -> nn.Module:
    """Stage `index` of the model: the same on every rank (seeded by the index). Routed
    Linears (ROUTE_ALL) and a seated LayerNorm; the first stage reads 8 features, the last
    writes 4."""
    torch.manual_seed(index)
    first, last = index == 0, index == num_stages - 1
    return nn.Sequential(
        nn.Linear(8 if first else WIDTH, WIDTH),
        nn.Tanh(),
        nn.LayerNorm(WIDTH),
        nn.Linear(WIDTH, 4 if last else WIDTH),
    ).double()


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(2 * NUM_MICROBATCHES, 8, generator=generator, dtype=torch.float64)
    return inputs, torch.randn(2 * NUM_MICROBATCHES, 4, generator=generator, dtype=torch.float64)


def _shapes(index: int, num_stages: int, static: bool) -> dict[str, torch.Tensor]:
    """A stage's micro-batch input and output, for a stage given its shapes (static mode):
    requires_grad where a gradient crosses between stages. None unless `static` (the
    stage infers them from the first micro-batch)."""
    if not static:
        return {}
    features_in = 8 if index == 0 else WIDTH
    features_out = 4 if index == num_stages - 1 else WIDTH
    return {
        "input_args": torch.empty(2, features_in, dtype=torch.float64, requires_grad=index > 0),
        "output_args": torch.empty(2, features_out, dtype=torch.float64, requires_grad=True),
    }


def _schedule(
    name: str, submods: list[nn.Module], indices: list[int], num_stages: int, group: Any, static: bool
) -> Any:
    """The schedule `name` over one stage per submodule (several for the multi-stage ones)."""
    cpu = torch.device("cpu")
    stages = [
        pipelining.PipelineStage(sub, i, num_stages, cpu, group=group, **_shapes(i, num_stages, static))
        for sub, i in zip(submods, indices)
    ]
    schedule_class = getattr(pipelining, name)
    single = name in ("ScheduleGPipe", "Schedule1F1B")
    return schedule_class(stages[0] if single else stages, n_microbatches=NUM_MICROBATCHES, loss_fn=_loss)


def _run_step(schedule: Any, first: bool, last: bool, batch: tuple[torch.Tensor, torch.Tensor]) -> list[Any]:
    """One schedule step on this rank's stages; the last stage's micro-batch losses."""
    inputs, target = batch
    losses: list[Any] = []
    args = (inputs,) if first else ()
    if last:
        schedule.step(*args, target=target, losses=losses)
    else:
        schedule.step(*args)
    return losses


def _assert_grads_in_buffers(flat: flatgrad.FlatGrad, what: str) -> None:
    for name, param in flat.named_parameters():
        assert param.grad is not None and grad_in_buffers(flat, param.grad), f"{what} {name}: outside"


def _ours(path: str, model: nn.Module, dp_group: Any) -> tuple[flatgrad.FlatGrad, nn.Module, Any]:
    """The stage's submodule on `path`: ``(flat, submodule, what counts the syncs)``."""
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    if path == "ddp_hook":
        ddp = DDP(flat, process_group=dp_group, **flat.ddp_kwargs())
        state = flat.comm_state(dp_group)
        ddp.register_comm_hook(state, flatgrad.allreduce_hook)
        return flat, ddp, state
    dp = flatgrad.replicate(flat, process_group=dp_group)
    return flat, dp, dp


def _mesh_worker(rank: int, world_size: int, cases: list[tuple[str, str]]) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    index, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    for schedule_name, path in cases:
        _compare_with_ddp_stages(schedule_name, path, index, dp_rank, pp_group, dp_group)


def _compare_with_ddp_stages(
    schedule_name: str, path: str, index: int, dp_rank: int, pp_group: Any, dp_group: Any
) -> None:
    """`path` ("data_parallel": the documented no_sync + all_reduce_grads; "per_microbatch":
    DataParallel averaging each micro-batch's backward; "ddp_hook") against DDP stages."""
    model = _stage_module(index)
    ref_model = copy.deepcopy(model)
    flat, submod, counter = _ours(path, model, dp_group)
    ref = DDP(ref_model, process_group=dp_group)
    ours = _schedule(schedule_name, [submod], [index], 2, pp_group, static=path == "ddp_hook")
    theirs = _schedule(schedule_name, [ref], [index], 2, pp_group, static=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=0.05, weight_decay=0.1)
    first, last = index == 0, index == 1
    what = f"{schedule_name} {path}"
    for step in range(STEPS):
        batch = _batch(100 * dp_rank + step)
        opt.zero_grad()
        if path == "data_parallel":
            with submod.no_sync():
                losses = _run_step(ours, first, last, batch)
            flat.all_reduce_grads(dp_group)
        else:
            losses = _run_step(ours, first, last, batch)
        ref_opt.zero_grad()
        ref_losses = _run_step(theirs, first, last, batch)
        assert len(losses) == (NUM_MICROBATCHES if last else 0)
        for loss, ref_loss in zip(losses, ref_losses):
            torch.testing.assert_close(loss, ref_loss, **TOL)
        assert_grads_like(model, ref_model, **TOL, what=f"{what} step {step}")
        _assert_grads_in_buffers(flat, f"{what} step {step}")
        opt.step()
        ref_opt.step()
    assert_params_like(model, ref_model, **TOL, what=what)
    # One synchronisation per step: the hook on DDP's one bucket, once per step (after the
    # last micro-batch's backward); DataParallel averaged no backward under no_sync (the
    # step's one all_reduce_grads did), or each micro-batch's without it.
    syncs = counter.num_calls if path == "ddp_hook" else replicate_state(counter)._engine.num_syncs
    assert syncs == {"ddp_hook": STEPS, "data_parallel": 0, "per_microbatch": STEPS * NUM_MICROBATCHES}[path]


def test_gpipe_and_1f1b_over_dataparallel_and_the_ddp_hook_equal_ddp_stages():
    cases = [
        (schedule, path)
        for schedule in ("ScheduleGPipe", "Schedule1F1B")
        for path in ("data_parallel", "ddp_hook")
    ]
    cases.append(("Schedule1F1B", "per_microbatch"))
    run_ranks(_mesh_worker, cases, world_size=4, timeout=240.0)


def _split_backward_worker(rank: int, world_size: int) -> None:
    """ScheduleInterleavedZeroBubble (4 virtual stages, 2 per "pp" rank), whose split
    backward computes weight gradients with torch.autograd.grad and assigns `.grad` itself:
    DataParallel with no_sync + all_reduce_grads against plain stages averaged by hand (DDP
    stages average nothing there: see docs/data-parallel.md)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    indices = [pp_rank, pp_rank + 2]
    models = [_stage_module(index, 4) for index in indices]
    refs = [copy.deepcopy(model) for model in models]
    flats = [flatgrad.FlatGrad(model, config=ROUTE_ALL) for model in models]
    dps = [flatgrad.replicate(flat, process_group=dp_group) for flat in flats]
    name = "ScheduleInterleavedZeroBubble"
    ours = _schedule(name, dps, indices, 4, pp_group, static=True)
    theirs = _schedule(name, refs, indices, 4, pp_group, static=True)
    for step in range(2):
        batch = _batch(100 * dp_rank + step)
        for model in models + refs:
            model.zero_grad()
        with dps[0].no_sync(), dps[1].no_sync():
            _run_step(ours, pp_rank == 0, pp_rank == 1, batch)
        for flat in flats:
            flat.all_reduce_grads(dp_group)
        _run_step(theirs, pp_rank == 0, pp_rank == 1, batch)
        average_grads(refs, dp_group)
        for flat, model, ref in zip(flats, models, refs):
            assert_grads_like(model, ref, **TOL, what=f"{name} step {step}")
            _assert_grads_in_buffers(flat, f"{name} step {step}")


def test_a_split_backward_schedule_over_dataparallel_with_one_sync_after_the_step_averages():
    run_ranks(_split_backward_worker, world_size=4, timeout=240.0)


def _flat_alone_worker(rank: int, world_size: int, names: list[str]) -> None:
    """FlatGrad alone on each "pp" pair (ranks 0, 2 and 1, 3 run two pipelines side by side,
    on different data) against plain stages: single-stage schedules over 2 stages, the
    multi-stage ones over 4 (2 per rank; ZB's split backward among them)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_group, pp_rank, dp_rank = mesh.get_group("pp"), mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    for name in names:
        single = name in ("ScheduleGPipe", "Schedule1F1B")
        num_stages = 2 if single else 4
        indices = [pp_rank] if single else [pp_rank, pp_rank + 2]
        models = [_stage_module(index, num_stages) for index in indices]
        refs = [copy.deepcopy(model) for model in models]
        flats = [flatgrad.FlatGrad(model, config=ROUTE_ALL) for model in models]
        ours = _schedule(name, flats, indices, num_stages, pp_group, static=False)
        theirs = _schedule(name, refs, indices, num_stages, pp_group, static=False)
        for step in range(2):
            batch = _batch(100 * dp_rank + step)
            for model in models + refs:
                model.zero_grad()
            losses = _run_step(ours, pp_rank == 0, pp_rank == 1, batch)
            ref_losses = _run_step(theirs, pp_rank == 0, pp_rank == 1, batch)
            for loss, ref_loss in zip(losses, ref_losses):
                torch.testing.assert_close(loss, ref_loss, **TOL)
            for model, ref in zip(models, refs):
                assert_grads_like(model, ref, **TOL, what=f"{name} step {step}")
            if single:
                for flat in flats:
                    _assert_grads_in_buffers(flat, f"{name} step {step}")


def test_flatgrad_stages_without_data_parallelism_equal_plain_stages():
    names = ["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleavedZeroBubble"]
    run_ranks(_flat_alone_worker, names, world_size=4, timeout=240.0)
