"""ShardedOptimizer on tensor-parallel models: DTensor parameters (`parallelize_module` over
"tp"), ZeRO-1 over "dp" of a 2 x 2 mesh (4 gloo ranks), by element and by tensor.

Oracles, all float64:
- the same model without tensor parallelism, trained with stock DDP over "dp" and torch's
  AdamW on the same global batch: losses, clipped norms and parameters (`full_tensor()`)
  within 1e-12 (not bitwise: a row-wise layer's output is a sum of partial products
  all-reduced over "tp", in another order than the plain matmul's; see
  tests/test_tensor_parallel.py);
- for optimizers that read a whole tensor (Muon's bfloat16 Newton-Schulz iteration), the same
  tensor-parallel model without flatgrad, its gradients averaged over "dp" by hand, stepped by
  torch's optimizer over the DTensor parameters (the same DTensor ops on the same values:
  bitwise);
- for checkpoints, the uninterrupted run (bitwise) and a plain torch optimizer over the
  tensor-parallel model loading the same DCP checkpoint.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from dist_utils import average_grads, run_ranks
from test_tensor_parallel import (
    MLP,
    MLP_PLAN,
    TOL,
    Block,
    _assert_in_buffers,
    _batch,
    _block_plan,
    _full,
    _parallel,
    accumulate,
    clip_and_step,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import flatgrad

pytest.importorskip("torch.distributed.tensor.parallel")
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from flatgrad._torch_compat import DTensor  # noqa: E402

ColwiseParallel = pytest.importorskip("torch.distributed.tensor.parallel").ColwiseParallel

STEPS, MICRO = 3, 2


def _model(kind: str) -> tuple[nn.Module, dict[str, object], tuple[int, ...]]:
    torch.manual_seed(0)  # (plain parameters the same on every rank, as parallelize_module expects)
    if kind == "mlp":
        return MLP().double(), MLP_PLAN, (4, 8)
    if kind == "mlp_uneven":  # up's 33 rows in shards of 17 and 16: other slot layouts on each "tp" rank
        from torch.distributed.tensor import Replicate

        model = MLP()
        model.up, model.down = nn.Linear(8, 33), nn.Linear(33, 8)
        return model.double(), {"up": ColwiseParallel(output_layouts=Replicate())}, (4, 8)
    return Block().double(), _block_plan(kind == "llama_block_sp"), (2, 6, 16)


def _refuses_reads(dp: nn.Module) -> None:
    """After a reduce-scattering backward a DTensor parameter's `.grad` refuses value reads, at
    the DTensor and at its local tensor, as a plain parameter's does."""
    params = [p for p in dp.parameters() if isinstance(p, DTensor) and p.grad is not None]
    assert params and all(isinstance(p.grad, DTensor) for p in params)
    for read in (lambda g: g.norm(), lambda g: g.to_local().sum(), lambda g: g.full_tensor()):
        with pytest.raises(RuntimeError, match="reduce-scattered"):
            read(params[0].grad)
    with pytest.raises(RuntimeError, match="reduce-scattered"):
        torch.nn.utils.clip_grad_norm_(params, 1.0)


def _against_ddp(mesh, kind: str, shard_by: str) -> None:
    """ShardedOptimizer(AdamW) over DataParallel over "dp" of a tensor-parallel model against
    stock DDP + AdamW of the plain model: micro-batches under no_sync, clipping every step."""
    plain, plan, shape = _model(kind)
    flat = flatgrad.FlatGrad(_parallel(plain, mesh["tp"], plan))
    dp = flatgrad.replicate(flat, device_mesh=mesh["dp"], bucket_cap_mb=0.001)
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, lr=1e-3, weight_decay=0.1, shard_by=shard_by)
    ddp = DDP(copy.deepcopy(plain), process_group=mesh["dp"].get_group())
    oracle = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.1)
    for step in range(STEPS):
        accumulate(dp, ddp, mesh, step, shape, kind == "llama_block_sp")
        if shard_by == "element":
            _refuses_reads(dp)
        else:  # (by tensor every rank holds every average: `.grad` is readable, in the buffers)
            _assert_in_buffers(dp)
            for param, ref in zip(dp.parameters(), ddp.parameters()):
                torch.testing.assert_close(_full(param.grad), ref.grad, rtol=0, atol=TOL)
        clip_and_step(opt.clip_grad_norm_, opt, ddp, oracle, step, 0.5)
    for (name, param), ref in zip(dp.named_parameters(), ddp.parameters()):
        torch.testing.assert_close(_full(param.detach()), ref.detach(), rtol=0, atol=TOL, msg=name)
    assert opt.state_bytes() > 0


def _muon(mesh, _kind: str, _shard_by: str) -> None:
    """Muon (by tensor, the block's matrices) and AdamW (by tensor, its norms) as two
    ShardedOptimizers over one DataParallel, against torch's Muon and AdamW over the same
    tensor-parallel model without flatgrad: Muon orthogonalises each DTensor matrix with
    DTensor's matmuls over "tp", which the ranks owning it run together."""
    muon_class = getattr(torch.optim, "Muon", None)
    if muon_class is None:
        pytest.skip("torch.optim.Muon (torch 2.9 on)")
    dp_rank = mesh["dp"].get_local_rank()
    plain, plan, shape = _model("llama_block")
    stock = _parallel(plain, mesh["tp"], plan)
    dp = flatgrad.replicate(flatgrad.FlatGrad(_parallel(plain, mesh["tp"], plan)), device_mesh=mesh["dp"])

    def split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        params = list(model.parameters())
        return [p for p in params if p.dim() == 2], [p for p in params if p.dim() != 2]

    matrices, others = split(dp)
    ours = [
        flatgrad.ShardedOptimizer(dp, muon_class, matrices, lr=2e-2, shard_by="tensor"),
        flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, others, lr=1e-3, shard_by="tensor"),
    ]
    stock_matrices, stock_others = split(stock)
    theirs = [muon_class(stock_matrices, lr=2e-2), torch.optim.AdamW(stock_others, lr=1e-3)]
    for step in range(STEPS):
        x = _batch(step, 0, dp_rank, shape)
        dp(x).pow(2).mean().backward()
        stock(x).pow(2).mean().backward()
        average_grads([stock], mesh["dp"].get_group())
        for optimizer in (*ours, *theirs):
            optimizer.step()
            optimizer.zero_grad()
    owned = [o.optimizer.state for o in ours]
    assert sum(len(state) for state in owned) < len(list(dp.parameters()))  # (each rank owns a part)
    for (name, param), ref in zip(
        dp.named_parameters(), stock.parameters()
    ):  # (the same ops on the same values)
        assert torch.equal(_full(param.detach()), _full(ref.detach())), name


def _mlp_2d(mesh, shard_by: str, kind: str = "mlp") -> tuple[nn.Module, flatgrad.ShardedOptimizer]:
    model, plan, _ = _model(kind)
    dp = flatgrad.replicate(flatgrad.FlatGrad(_parallel(model, mesh["tp"], plan)), device_mesh=mesh["dp"])
    return dp, flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, lr=1e-3, weight_decay=0.1, shard_by=shard_by)


def _global_batch(step: int, mesh) -> torch.Tensor:
    """This data-parallel rank's part of step `step`'s global batch of 8 rows (the 2 x 2 run's
    two data-parallel ranks' batches one after the other)."""
    whole = torch.cat([_batch(step, 0, r, (4, 8)) for r in range(2)])
    return whole.chunk(mesh["dp"].size())[mesh["dp"].get_local_rank()]


def _steps(
    dp: nn.Module, optimizer: torch.optim.Optimizer, steps: range, mesh, by_hand: bool = False
) -> None:
    for step in steps:
        dp(_global_batch(step, mesh)).pow(2).mean().backward()
        if by_hand:  # (a model without flatgrad: its gradients averaged over "dp" here)
            average_grads([dp], mesh["dp"].get_group())
        optimizer.step()
        optimizer.zero_grad()


def _dcp_2d(mesh, path: str, out: str, kind: str) -> None:
    """2 x 2: DCP saves {"model": dp, "optim": opt} (by element) after two steps; loaded into
    a fresh ShardedOptimizer by tensor and into torch's AdamW over the tensor-parallel model
    without flatgrad (get_state_dict / set_state_dict), both step on as the uninterrupted
    run. `out` keeps its final parameters for the run on another data-parallel size. With
    `kind` "mlp_uneven" the "tp" ranks' slot layouts differ (shards of 17 and 16 rows): a
    replicated parameter's chunks are cut where any rank's end, so every rank saves the same
    boxes of it (DCP refuses boxes that only overlap)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    dp, opt = _mlp_2d(mesh, "element", kind)
    _steps(dp, opt, range(2), mesh)
    dcp.save({"model": dp, "optim": opt}, checkpoint_id=path)
    _steps(dp, opt, range(2, 4), mesh)
    final = {name: _full(param.detach()) for name, param in dp.named_parameters()}
    if dist.get_rank() == 0:
        torch.save(final, out)
    by_tensor, by_tensor_opt = _mlp_2d(mesh, "tensor", kind)
    dcp.load({"model": by_tensor, "optim": by_tensor_opt}, checkpoint_id=path)
    _steps(by_tensor, by_tensor_opt, range(2, 4), mesh)
    model, plan, _ = _model(kind)
    stock = _parallel(model, mesh["tp"], plan)
    stock_opt = torch.optim.AdamW(stock.parameters(), lr=1e-3, weight_decay=0.1)
    model_state, optim_state = get_state_dict(stock, stock_opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(stock, stock_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _steps(stock, stock_opt, range(2, 4), mesh, by_hand=True)
    for model in (by_tensor, stock):
        for name, param in model.named_parameters():
            torch.testing.assert_close(_full(param.detach()), final[name], rtol=0, atol=TOL, msg=name)


def _dcp_elsewhere(mesh, path: str, out: str, kind: str) -> None:
    """1 x 2 (one data-parallel rank) or 1 x 4 (another tensor-parallel size): the 2 x 2
    checkpoint loads into ShardedOptimizer by element and steps on as the 2 x 2 run did on
    the same global batches (DCP reshards the whole-shape state)."""
    import torch.distributed.checkpoint as dcp

    dp, opt = _mlp_2d(mesh, "element", kind)
    dcp.load({"model": dp, "optim": opt}, checkpoint_id=path)
    _steps(dp, opt, range(2, 4), mesh)
    final = torch.load(out)
    for name, param in dp.named_parameters():
        torch.testing.assert_close(_full(param.detach()), final[name], rtol=0, atol=TOL, msg=name)


def _freeze_and_overlap(mesh, shard_by: str) -> None:
    """ShardedOptimizer with ``overlap_param_gather=True`` (by element), a tensor-parallel
    weight frozen after two steps (its state parked, the layout sharded again), against the
    plain model stepped on each step's whole global batch by torch's AdamW (the average over
    "dp" of the 2 x 2 run's means, to rounding)."""
    plain = _model("mlp")[0]
    oracle = copy.deepcopy(plain)
    dp = flatgrad.replicate(flatgrad.FlatGrad(_parallel(plain, mesh["tp"], MLP_PLAN)), device_mesh=mesh["dp"])
    overlap = shard_by == "element"
    opt = flatgrad.ShardedOptimizer(
        dp, torch.optim.AdamW, lr=1e-3, weight_decay=0.1, shard_by=shard_by, overlap_param_gather=overlap
    )
    oracle_opt = torch.optim.AdamW(oracle.parameters(), lr=1e-3, weight_decay=0.1)
    for step in range(4):
        if step == 2 and shard_by == "element":  # (by tensor a change of layout is refused)
            dp.down.weight.requires_grad_(False)
            oracle.down.weight.requires_grad_(False)
        dp(_global_batch(step, mesh)).pow(2).mean().backward()
        oracle(torch.cat([_batch(step, 0, r, (4, 8)) for r in range(2)])).pow(2).mean().backward()
        opt.clip_grad_norm_(0.5)
        torch.nn.utils.clip_grad_norm_([p for p in oracle.parameters() if p.grad is not None], 0.5)
        for optimizer in (opt, oracle_opt):
            optimizer.step()
            optimizer.zero_grad()
    opt.wait_param_gather()
    for name, param in dp.named_parameters():
        ref = dict(oracle.named_parameters())[name]
        torch.testing.assert_close(_full(param.detach()), ref.detach(), rtol=0, atol=TOL, msg=name)


def _scaler_skips_together(mesh, shard_by: str) -> None:
    """flatgrad.GradScaler over a ShardedOptimizer of a tensor-parallel model: an overflow in
    one "tp" rank's shards only (its loss, and so only its local gradients, made infinite)
    skips the step on every rank of the mesh and backs the scale off alike; the next step
    steps everywhere. (A rank of another "tp" coordinate holds other shards: without the
    agreement over "tp" it would step alone.)"""
    dp, opt = _mlp_2d(mesh, shard_by)
    scaler = flatgrad.GradScaler("cpu", init_scale=2.0**10)
    overflow = mesh["tp"].get_local_rank() == 1 and mesh["dp"].get_local_rank() == 0
    for step in range(2):
        before = [
            param.detach().to_local().clone() for param in dp.parameters() if isinstance(param, DTensor)
        ]
        loss = dp(_global_batch(step, mesh)).pow(2).mean()
        scaler.scale(loss * (float("inf") if overflow and step == 0 else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        after = [param.detach().to_local() for param in dp.parameters() if isinstance(param, DTensor)]
        moved = [not torch.equal(a, b) for a, b in zip(before, after)]
        assert (not any(moved)) if step == 0 else all(moved), (step, moved)
        assert scaler.get_scale() == 2.0**9, scaler.get_scale()  # (halved once, at the skip)


_CASES = {
    "against_ddp": _against_ddp,
    "muon": _muon,
    "freeze_and_overlap": _freeze_and_overlap,
    "scaler_skips_together": _scaler_skips_together,
    "dcp_2d": _dcp_2d,
    "dcp_elsewhere": _dcp_elsewhere,
}


def _run(rank: int, world_size: int, cases: list[tuple[str, ...]], tp: int = 2) -> None:
    mesh = init_device_mesh("cpu", (world_size // tp, tp), mesh_dim_names=("dp", "tp"))
    for name, *args in cases:
        _CASES[name](mesh, *args)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "cases",
    [
        [
            ("against_ddp", "mlp", "element"),
            ("against_ddp", "mlp", "tensor"),
            ("against_ddp", "mlp_uneven", "element"),
        ],
        [("against_ddp", "llama_block_sp", "element"), ("against_ddp", "llama_block", "tensor")],
        [("muon", "llama_block", "tensor")],
        [
            ("freeze_and_overlap", "element"),
            ("freeze_and_overlap", "tensor"),
            ("scaler_skips_together", "element"),
            ("scaler_skips_together", "tensor"),
        ],
    ],
    ids=["mlp", "llama_block", "muon", "freeze_overlap_scaler"],
)
def test_sharded_optimizer_over_dp_of_a_tensor_parallel_model(cases):
    run_ranks(_run, cases, world_size=4, timeout=300.0)


@pytest.mark.distributed
def test_dcp_checkpoints_of_a_sharded_optimizer_on_a_2d_mesh_load_by_tensor_into_torch_and_on_other_sizes(
    tmp_path,
):
    pytest.importorskip("numpy")  # (DCP's object collectives)
    path, out = str(tmp_path / "checkpoint"), str(tmp_path / "final.pt")
    uneven, uneven_out = str(tmp_path / "uneven"), str(tmp_path / "uneven.pt")
    run_ranks(
        _run, [("dcp_2d", path, out, "mlp"), ("dcp_2d", uneven, uneven_out, "mlp_uneven")], world_size=4
    )
    cases = [("dcp_elsewhere", path, out, "mlp"), ("dcp_elsewhere", uneven, uneven_out, "mlp_uneven")]
    run_ranks(_run, cases, 4, world_size=4, timeout=300.0)
    run_ranks(_run, cases[:1], world_size=2, timeout=300.0)
