"""FlatGrad + DataParallel on a 2-D ("dp" x "tp") mesh against torch's own 2-D training, FSDP2
(`fully_shard` over "dp") of the same tensor-parallel model, and checkpoints that resume on
another tensor-parallel size.

Oracles, all float64, 4 gloo ranks, AdamW with 2 accumulated micro-batches and clipping:
- FSDP2 + TP: torch's `fully_shard` over "dp" of the model `parallelize_module` made
  tensor-parallel over "tp" (accumulation with `set_requires_gradient_sync`, torch's clipping
  over the DTensor gradients): losses, gradients and grad norms before each step and the
  parameters after it (`full_tensor()`) within 1e-12 (float64; not bitwise: the two sides
  sum the grad norm in another order, 1 ulp apart, and clipping carries that into the
  parameters). A DCP checkpoint of each run loads into a fresh run of the other kind
  (`get_state_dict` / `set_state_dict`: model and AdamW state), and the next step of both
  equals the uninterrupted flatgrad run within 1e-12.
- Another tensor-parallel size: flatgrad's checkpoint (saved on dp 2 x tp 2) loads into
  FlatGrad + DataParallel on dp 1 x tp 4 and into the plain model on dp 4 (no tensor
  parallelism); a step on the same global batch equals the uninterrupted 2 x 2 run's within
  1e-12 (a row-wise layer sums its partial products over 4 ranks instead of 2).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch
from dist_utils import run_ranks
from test_tensor_parallel import MLP, MLP_PLAN, TOL, Block, _batch, _block_plan, _clip_mixed, _full, _parallel
from torch import nn

import flatgrad

# FSDP2's public `fully_shard` (torch 2.6+; torch.distributed._composable.fsdp before)
fully_shard = getattr(pytest.importorskip("torch.distributed.fsdp"), "fully_shard", None)
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

STEPS, MICRO, DP = 3, 2, 2  # the 2 x 2 runs: the checkpoint is taken before the last step
SHAPES = {"mlp": (4, 8), "llama_block": (2, 6, 16)}
MAX_NORM = 0.25  # below every step's norm (0.51 to 0.85): clipping scales every step


def _model(kind: str) -> tuple[nn.Module, dict[str, object]]:
    """The tiny model (built under seed 0) and its plan. The MLP has no LayerNorm: every
    parameter is a DTensor on the 2-D mesh under FSDP2, so torch's `clip_grad_norm_` takes
    them in one foreach norm; the block's RMSNorm weights are plain (on "dp" alone)."""
    torch.manual_seed(0)
    if kind == "mlp":
        return MLP(norm=False).double(), MLP_PLAN
    return Block().double(), _block_plan(False)


def _global_batch(step: int, rank: int, size: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
    """Data-parallel rank `rank` of `size`'s micro-batches of the 2 x 2 runs' global batch
    (`DP` ranks of `MICRO` micro-batches each), in order."""
    batches = [(dp_rank, micro) for dp_rank in range(DP) for micro in range(MICRO)]
    share = len(batches) // size
    return [
        _batch(step, micro, dp_rank, shape) for dp_rank, micro in batches[rank * share : (rank + 1) * share]
    ]


@contextlib.contextmanager
def _fsdp2_sync(model: nn.Module, last: bool) -> Iterator[None]:
    """FSDP2's accumulation: reduce-scatter only in the last micro-batch's backward."""
    model.set_requires_gradient_sync(last)
    yield


# A run: its model, optimizer, the accumulation context of a micro-batch's backward (given
# whether it is the last) and its clipping (returning the norm).
Side = tuple[
    nn.Module,
    torch.optim.Optimizer,
    Callable[[bool], contextlib.AbstractContextManager[None]],
    Callable[[], float],
]


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def _flatgrad_side(dp: flatgrad.ReplicateModule) -> Side:
    def sync(last: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext() if last else dp.no_sync()

    return dp, _adamw(dp), sync, lambda: float(dp.clip_grad_norm_(MAX_NORM))


def _fsdp2_side(plain: nn.Module, mesh, plan: dict[str, object]) -> Side:
    """torchtitan's composition: tensor parallel over "tp", then `fully_shard` over "dp" of
    each Linear and of the root; torch's clipping over the DTensor gradients."""
    model = _parallel(plain, mesh["tp"], plan)
    for child in model.children():
        if isinstance(child, nn.Linear):
            fully_shard(child, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, _adamw(model), lambda last: _fsdp2_sync(model, last), lambda: _torch_clip(model)


def _torch_clip(model: nn.Module) -> float:
    """torch's `clip_grad_norm_`; written out (`_clip_mixed`) where the gradients live on two
    meshes (FSDP2's "dp" for a plain parameter, "dp" x "tp" for a tensor-parallel one), which
    torch's foreach norm refuses (`aten.stack.default must have the same mesh`)."""
    if len({p.grad.device_mesh for p in model.parameters()}) > 1:
        return _clip_mixed(model, MAX_NORM)
    return float(_full(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))


def _step(
    side: Side, batches: list[torch.Tensor], scale: float = 1.0
) -> tuple[float, float, list[torch.Tensor]]:
    """One AdamW step accumulating `batches`, the loss scaled by `scale`; returns the summed
    loss, the norm the clipping gives, and the unclipped gradients (whole)."""
    model, optimizer, sync, clip = side
    total = 0.0
    for index, x in enumerate(batches):
        with sync(index == len(batches) - 1):
            loss = model(x).pow(2).mean() * scale
            loss.backward()
        total += float(loss)
    grads = [_full(p.grad).clone() for p in model.parameters()]
    norm = clip()
    optimizer.step()
    optimizer.zero_grad()
    return total, norm, grads


def _save(side: Side, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(*side[:2])
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)


def _load(side: Side, path: str) -> Side:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer = side[:2]
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return side


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [_full(p.detach()) for p in model.parameters()]


def _assert_close(ours: list[torch.Tensor], theirs: list[torch.Tensor], what: str) -> None:
    for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        torch.testing.assert_close(a, b, rtol=0, atol=TOL, msg=lambda m, i=index: f"{what} {i}: {m}")


def _against_fsdp2(rank: int, world_size: int, kind: str, path: str, out: str) -> None:
    """2 x 2: FlatGrad + DataParallel over "dp" against FSDP2 over "dp", each of the model
    tensor-parallel over "tp". Before the last step each saves a DCP checkpoint (flatgrad's
    to `path`) and a fresh run of the other kind loads it (the parameters bitwise); both step
    on as the flatgrad run. `out` receives the last step's norm and parameters (whole) for
    `_resume`."""
    mesh = init_device_mesh("cpu", (DP, world_size // DP), mesh_dim_names=("dp", "tp"))
    plain, plan = _model(kind)

    def data_parallel() -> flatgrad.ReplicateModule:
        return flatgrad.replicate(
            flatgrad.FlatGrad(_parallel(plain, mesh["tp"], plan)), device_mesh=mesh["dp"]
        )

    sides = [_flatgrad_side(data_parallel()), _fsdp2_side(plain, mesh, plan)]
    for step in range(STEPS):
        if step == STEPS - 1:
            _save(sides[0], path)
            _save(sides[1], f"{path}-fsdp2")
            sides.append(_load(_fsdp2_side(plain, mesh, plan), path))
            sides.append(_load(_flatgrad_side(data_parallel()), f"{path}-fsdp2"))
            for (saved, *_), (loaded, *_) in zip(sides[:2], sides[2:]):
                for index, (a, b) in enumerate(zip(_params(saved), _params(loaded))):
                    assert torch.equal(a, b), (type(loaded).__name__, index)
        batches = _global_batch(step, mesh["dp"].get_local_rank(), DP, SHAPES[kind])
        (loss, norm, grads), *others = [_step(side, batches) for side in sides]
        for other_loss, other_norm, other_grads in others:
            assert abs(loss - other_loss) < TOL and abs(norm - other_norm) < TOL, (loss, other_loss, norm)
            _assert_close(grads, other_grads, f"step {step} gradient")
        params = _params(sides[0][0])
        for other, *_ in sides[1:]:
            _assert_close(params, _params(other), f"step {step} parameter")
    if rank == 0:
        torch.save({"norm": norm, "params": params}, out)


def _resume(rank: int, world_size: int, kind: str, path: str, out: str, dp_size: int) -> None:
    """The 2 x 2 checkpoint on dp `dp_size` x tp ``world_size // dp_size`` (tp 1: the plain
    model, no tensor parallelism): the last step on the same global batch (the loss scaled
    by ``dp_size / DP``, exact, so that the average over `dp_size` ranks is the 2 x 2 run's
    gradient) gives the 2 x 2 run's norm and parameters."""
    plain, plan = _model(kind)
    tp_size = world_size // dp_size
    if tp_size == 1:
        dp, dp_rank = flatgrad.replicate(flatgrad.FlatGrad(plain)), rank
    else:
        mesh = init_device_mesh("cpu", (dp_size, tp_size), mesh_dim_names=("dp", "tp"))
        flat = flatgrad.FlatGrad(_parallel(plain, mesh["tp"], plan))
        dp, dp_rank = flatgrad.replicate(flat, device_mesh=mesh["dp"]), mesh["dp"].get_local_rank()
    side = _flatgrad_side(dp)
    _load(side, path)
    _, norm, _ = _step(side, _global_batch(STEPS - 1, dp_rank, dp_size, SHAPES[kind]), scale=dp_size / DP)
    expected = torch.load(out)
    assert abs(norm - expected["norm"]) < TOL, (norm, expected["norm"])
    _assert_close(_params(dp), expected["params"], f"dp {dp_size} x tp {tp_size} parameter")


@pytest.mark.distributed
@pytest.mark.skipif(fully_shard is None, reason="torch.distributed.fsdp.fully_shard is torch 2.6+")
@pytest.mark.parametrize(
    ("kind", "dp_sizes"), [("mlp", ()), ("llama_block", (1, 4))], ids=["mlp", "llama_block-resume_tp4_tp1"]
)
def test_fsdp2_tp_equals_flatgrad_dp_their_checkpoints_interchange_and_resume_on_other_tp_sizes(
    tmp_path, kind, dp_sizes
):
    pytest.importorskip("numpy")  # (DCP's object collectives)
    path, out = str(tmp_path / "checkpoint"), str(tmp_path / "run.pt")
    run_ranks(_against_fsdp2, kind, path, out, world_size=4, timeout=240.0)
    for dp_size in dp_sizes:
        run_ranks(_resume, kind, path, out, dp_size, world_size=4, timeout=240.0)
