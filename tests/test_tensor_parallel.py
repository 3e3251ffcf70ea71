"""FlatGrad and DataParallel on tensor-parallel models: DTensor parameters made by torch's
`parallelize_module` (`ColwiseParallel`, `RowwiseParallel`, `SequenceParallel`) on the "tp"
dimension of a mesh, data parallel over "dp".

Oracles, all float64:
- the same model without tensor parallelism, trained with stock DDP over the data-parallel
  ranks on the same global batch (each data-parallel rank its own micro-batches, the
  tensor-parallel ranks of one group the same ones): gradients, grad norms, losses and
  parameters (`full_tensor()`) within 1e-12. Not bitwise: a row-wise layer's output is a sum
  of partial products all-reduced over "tp", in another order than the plain matmul's.
- the same tensor-parallel model without flatgrad (torch's DTensor autograd, torch's
  `clip_grad_norm_` over the DTensor gradients): gradients bitwise equal, norms within 1e-12.

Every `.grad` of a DTensor parameter is a DTensor with the parameter's mesh and placements
whose local tensor is a view of `flat.grad_buffers` (checked by address).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import flatgrad

tp_api = pytest.importorskip("torch.distributed.tensor.parallel")
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from flatgrad._torch_compat import DTensor  # noqa: E402

ColwiseParallel, RowwiseParallel = tp_api.ColwiseParallel, tp_api.RowwiseParallel
TOL = 1e-12  # float64; see the module docstring for why not bitwise against the plain model
# AdamW at a learning rate of 1e-3: it divides by each element's own gradient scale, so a round-off
# difference in an element whose gradient is near 0 (1e-16 against 1e-7) moves the parameter by
# up to lr times the relative difference: 4e-12 at lr=1e-2 in one element of 256, 4e-13 here.
STEPS, MICRO = 3, 2


class MLP(nn.Module):
    """A column-wise then a row-wise Linear, and a LayerNorm left plain (replicated)."""

    def __init__(self, width: int = 8, norm: bool = True) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.norm = nn.LayerNorm(width) if norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.down(torch.relu(self.up(x))))


MLP_PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}


class Block(nn.Module):
    """A Llama-shaped block: RMSNorm, attention (q/k/v/o, causal), RMSNorm, SwiGLU MLP
    (gate/up/down). Heads are read from the local width (-1), as tensor parallelism splits them."""

    def __init__(self, dim: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.attention_norm = nn.RMSNorm(dim)
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.o = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = nn.RMSNorm(dim)
        self.gate, self.up = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attention_norm(x)  # (under sequence parallelism: this rank's sequence shard)
        q, k, v = (f(h).unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).flatten(2))
        h = self.ffn_norm(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


def _block_plan(sequence_parallel: bool) -> dict[str, object]:
    """torch's documented Llama plan; with `sequence_parallel`, the norms run on sequence
    shards (`SequenceParallel`) and the projections take and give sequence-sharded input."""
    if not sequence_parallel:
        colwise, rowwise = ColwiseParallel(), RowwiseParallel()
        return {"q": colwise, "k": colwise, "v": colwise, "o": rowwise, "gate": colwise, "up": colwise,
                "down": rowwise}  # fmt: skip
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import SequenceParallel

    # The block takes and gives this rank's sequence shard (as torchtitan's blocks, after an
    # embedding with output_layouts=Shard(1)); the projections all-gather it and reduce-scatter back.
    seq = SequenceParallel()
    colwise, rowwise = ColwiseParallel(input_layouts=Shard(1)), RowwiseParallel(output_layouts=Shard(1))
    return {"attention_norm": seq, "ffn_norm": seq, "q": colwise, "k": colwise, "v": colwise, "o": rowwise,
            "gate": colwise, "up": colwise, "down": rowwise}  # fmt: skip


def _labelled(label: str):
    return lambda message: f"{label}: {message}"


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _assert_in_buffers(flat: flatgrad.FlatGrad) -> None:
    """Every `.grad` is a slot: a DTensor parameter's a DTensor with its placements over a
    view of a flat buffer."""
    spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in flat.grad_buffers.values()]
    for name, param in flat.named_parameters():
        if param.grad is None:
            continue
        grad = param.grad
        if isinstance(param, DTensor):
            assert isinstance(grad, DTensor) and grad.placements == param.placements, name
            assert grad.device_mesh == param.device_mesh, name
            grad = grad.to_local()
        assert any(lo <= grad.data_ptr() < hi for lo, hi in spans), f"{name}'s .grad is outside the buffers"


def _batch(step: int, micro: int, dp_rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * dp_rank + 10 * step + micro)
    return torch.randn(*shape, dtype=torch.float64, generator=generator)


def _parallel(model: nn.Module, mesh, plan: dict[str, object]) -> nn.Module:
    return tp_api.parallelize_module(copy.deepcopy(model), mesh, plan)


def _clip_mixed(model: nn.Module, max_norm: float) -> float:
    """torch's clipping of a model with DTensor and plain gradients, written out (torch's
    `clip_grad_norm_` refuses to mix them in one foreach norm)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(_full(g)) for g in grads]))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(float(coef))
    return float(total)


def _train_alone(rank: int, world_size: int, kind: str) -> None:
    """1 x 2: FlatGrad on a tensor-parallel model against the plain model and against the same
    tensor-parallel model without flatgrad, with accumulation and clipping."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model, plan, shape = (
        (MLP(), MLP_PLAN, (4, 8)) if kind == "mlp" else (Block(), _block_plan(False), (2, 6, 16))
    )
    plain = model.double()
    stock_tp = _parallel(plain, mesh, plan)
    flat = flatgrad.FlatGrad(_parallel(plain, mesh, plan), config={"linear_min_numel": 0})
    sides = [(flat, torch.optim.AdamW(flat.parameters(), lr=1e-3, weight_decay=0.1))]
    sides += [(m, torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1)) for m in (stock_tp, plain)]
    for step in range(STEPS):
        losses = [0.0] * 3
        for micro in range(MICRO):
            x = _batch(step, micro, 0, shape)
            for index, (module, _) in enumerate(sides):
                loss = module(x).pow(2).mean()
                loss.backward()
                losses[index] += float(loss)
        assert abs(losses[0] - losses[2]) < TOL and losses[0] == losses[1], losses
        _assert_in_buffers(flat)
        for (name, param), stock, ref in zip(
            flat.named_parameters(), stock_tp.parameters(), plain.parameters()
        ):
            assert step > 0 or torch.equal(_full(param.grad), _full(stock.grad)), name  # the same autograd
            torch.testing.assert_close(
                _full(param.grad), _full(stock.grad), rtol=0, atol=TOL, msg=_labelled(name)
            )
            torch.testing.assert_close(_full(param.grad), ref.grad, rtol=0, atol=TOL, msg=_labelled(name))
        norms = [float(flat.clip_grad_norm_(0.5)), _clip_mixed(stock_tp, 0.5)]
        norms.append(float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)))
        assert abs(norms[0] - norms[1]) < TOL and abs(norms[0] - norms[2]) < TOL, norms
        for _, optimizer in sides:
            optimizer.step()
            optimizer.zero_grad()
    for (name, param), ref in zip(flat.named_parameters(), plain.parameters()):
        torch.testing.assert_close(_full(param.detach()), ref.detach(), rtol=0, atol=TOL, msg=_labelled(name))


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["mlp", "llama_block"])
def test_flatgrad_on_a_tensor_parallel_model_equals_the_plain_model(kind):
    run_ranks(_train_alone, kind, world_size=2)


def accumulate(
    dp: nn.Module, ddp: nn.Module, mesh, step: int, shape: tuple[int, ...], sequence_parallel: bool
) -> None:
    """One step's MICRO micro-batches through `dp` (a data-parallel tensor-parallel model) and
    `ddp` (stock DDP of the plain model), all but the last under no_sync; the losses equal."""
    for micro in range(MICRO):
        x = _batch(step, micro, mesh["dp"].get_local_rank(), shape)
        last = micro == MICRO - 1
        with contextlib.nullcontext() if last else dp.no_sync():
            if sequence_parallel:  # this rank's sequence shard in, its shard out: its part of the mean
                local = x.chunk(2, dim=1)[mesh["tp"].get_local_rank()]
                loss = dp(local).pow(2).sum() / x.numel()
            else:
                loss = dp(x).pow(2).mean()
            loss.backward()
        with contextlib.nullcontext() if last else ddp.no_sync():
            ref_loss = ddp(x).pow(2).mean()
            ref_loss.backward()
        loss = loss.detach()
        if sequence_parallel:
            dist.all_reduce(loss, group=mesh["tp"].get_group())
        assert abs(float(loss) - float(ref_loss.detach())) < TOL


def clip_and_step(
    clip,
    optimizer: torch.optim.Optimizer,
    ddp: nn.Module,
    oracle: torch.optim.Optimizer,
    step: int,
    max_norm: float,
) -> None:
    """Clip both sides (`clip`: flatgrad's; torch's for `ddp`), the norms equal, then step both
    and zero the gradients (to None every other step)."""
    norm, ref_norm = clip(max_norm), torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm)
    assert abs(float(norm) - float(ref_norm)) < TOL, (float(norm), float(ref_norm))
    for side in (optimizer, oracle):
        side.step()
        side.zero_grad(set_to_none=step % 2 == 0)


def _train_2d(rank: int, world_size: int, kind: str, how: str, bucket_cap_mb: float) -> None:
    """2 x 2: DataParallel over "dp" of FlatGrad over a model tensor-parallel over "tp",
    against stock DDP over "dp" of the plain model (no_sync accumulation, clipping)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    if kind == "mlp":
        model, plan, shape = MLP(), MLP_PLAN, (4, 8)
    else:
        model, plan, shape = Block(), _block_plan(kind == "llama_block_sp"), (2, 6, 16)
    plain = model.double()
    flat = flatgrad.FlatGrad(_parallel(plain, mesh["tp"], plan))
    if how == "device_mesh":
        dp = flatgrad.replicate(flat, device_mesh=mesh["dp"], bucket_cap_mb=bucket_cap_mb)
    else:
        dp = flatgrad.replicate(flat, process_group=mesh["dp"].get_group(), bucket_cap_mb=bucket_cap_mb)
    ddp = DDP(copy.deepcopy(plain), process_group=mesh["dp"].get_group())
    optimizer = torch.optim.AdamW(dp.parameters(), lr=1e-3, weight_decay=0.1)
    oracle = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.1)
    for step in range(STEPS):
        accumulate(dp, ddp, mesh, step, shape, sequence_parallel=kind == "llama_block_sp")
        _assert_in_buffers(flat)
        for (name, param), ref in zip(dp.named_parameters(), ddp.parameters()):
            torch.testing.assert_close(_full(param.grad), ref.grad, rtol=0, atol=TOL, msg=_labelled(name))
        clip_and_step(flat.clip_grad_norm_, optimizer, ddp, oracle, step, 1.0)
    for (name, param), ref in zip(dp.named_parameters(), ddp.parameters()):
        torch.testing.assert_close(_full(param.detach()), ref.detach(), rtol=0, atol=TOL, msg=_labelled(name))


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("kind", "how", "bucket_cap_mb"),
    [
        ("mlp", "device_mesh", 25.0),
        ("mlp", "process_group", 0.0005),
        ("llama_block", "device_mesh", 25.0),
        ("llama_block_sp", "process_group", 0.001),
    ],
)
def test_data_parallel_over_dp_of_a_tensor_parallel_model_equals_ddp_of_the_plain_model(
    kind, how, bucket_cap_mb
):
    run_ranks(_train_2d, kind, how, bucket_cap_mb, world_size=4, timeout=240.0)


def _refusals(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    flat = flatgrad.FlatGrad(_parallel(MLP().double(), mesh["tp"], MLP_PLAN))
    with pytest.raises(ValueError, match="process_group must hold one rank of each tensor-parallel group"):
        flatgrad.replicate(flat)  # the default group crosses "tp"
    with pytest.raises(ValueError, match="process_group must hold one rank of each tensor-parallel group"):
        flatgrad.replicate(flat, device_mesh=mesh["tp"])
    with pytest.raises(ValueError, match="device_mesh must be 1-D"):
        flatgrad.replicate(flat, device_mesh=mesh)
    with pytest.raises(ValueError, match="process_group or device_mesh, not both"):
        flatgrad.replicate(flat, process_group=mesh["dp"].get_group(), device_mesh=mesh["dp"])
    with pytest.raises(ValueError, match="DTensor parameters .* which DDP does not take"):
        flat.ddp_kwargs()
    with pytest.raises(ValueError, match="DTensor parameters .* which DDP does not take"):
        flat.comm_state()
    with pytest.raises(ValueError, match="process_group must hold one rank"):
        flat.all_reduce_grads()
    flat(torch.randn(4, 8, dtype=torch.float64)).sum().backward()
    with pytest.raises(ValueError, match="norm_type must be positive or inf"):
        flat.grad_norm(0)
    # A pipeline's stage mesh (pp_mesh: the norm over every stage) must not cross "tp".
    with pytest.raises(ValueError, match="pp_mesh must hold one rank of each tensor-parallel group"):
        flat.grad_norm(pp_mesh=mesh["tp"])
    with pytest.raises(ValueError, match="pp_mesh must be 1-D"):
        flat.clip_grad_norm_(1.0, pp_mesh=mesh)
    with pytest.raises(TypeError, match="pp_mesh must be a DeviceMesh"):
        flat.grad_norm(pp_mesh=mesh["dp"].get_group())
    with pytest.raises(ValueError, match="norm_type must be positive or inf with pp_mesh"):
        flatgrad.FlatGrad(MLP().double()).grad_norm(0, pp_mesh=mesh["dp"])
    # Parameters on two meshes, on a 2-D mesh, and main grads: refused at wrap time.
    two = MLP().double()
    tp_api.parallelize_module(two.up, mesh["tp"], ColwiseParallel())
    tp_api.parallelize_module(two.down, mesh["dp"], RowwiseParallel())
    with pytest.raises(ValueError, match="must live on one mesh, got 2"):
        flatgrad.FlatGrad(two)
    from torch.distributed.tensor import Replicate, distribute_tensor

    odd = nn.Linear(4, 4).double()
    odd.weight = nn.Parameter(distribute_tensor(odd.weight.detach(), mesh, [Replicate(), Replicate()]))
    with pytest.raises(ValueError, match="mesh must have one dimension"):
        flatgrad.FlatGrad(odd)
    with pytest.raises(ValueError, match="grad_dtype must be None for a model with DTensor parameters"):
        flatgrad.FlatGrad(_parallel(MLP().bfloat16(), mesh["tp"], MLP_PLAN), config={"grad_dtype": "float32"})


@pytest.mark.distributed
def test_what_cannot_work_on_dtensor_parameters_is_refused_at_wrap_time_on_every_rank():
    run_ranks(_refusals, world_size=4)


def _torch_clip_reads_the_slots(rank: int, world_size: int) -> None:
    """torch's own clip_grad_norm_ over the DTensor `.grad` (a user's loop that never calls
    flatgrad's) clips the slots in place, and zero_grad(set_to_none=False) keeps them."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    plain = MLP(norm=False).double()  # (every parameter a DTensor: torch's clipping mixes no plain one)
    flat = flatgrad.FlatGrad(_parallel(plain, mesh, MLP_PLAN))
    x = _batch(0, 0, 0, (4, 8))
    flat(x).pow(2).sum().backward()
    plain(x).pow(2).sum().backward()
    ours = float(flat.grad_norm())
    total = torch.nn.utils.clip_grad_norm_(flat.parameters(), 0.1)
    assert abs(float(_full(total)) - ours) < TOL
    _assert_in_buffers(flat)
    assert abs(float(flat.grad_norm()) - 0.1) < 1e-6  # clipped in the buffers themselves
    flat.zero_grad(set_to_none=False)
    assert all(float(b.abs().sum()) == 0 for b in flat.grad_buffers.values())
    _assert_in_buffers(flat)
    flat(x).pow(2).sum().backward()  # after zeroing in place: taken, not added to stale values
    torch.testing.assert_close(float(flat.grad_norm()), ours, rtol=0, atol=TOL)


@pytest.mark.distributed
def test_torch_clip_grad_norm_over_dtensor_grads_clips_the_buffers():
    run_ranks(_torch_clip_reads_the_slots, world_size=2)


def _train_steps(dp: nn.Module, optimizer: torch.optim.Optimizer, steps: range, dp_rank: int) -> None:
    for step in steps:
        dp(_batch(step, 0, dp_rank, (4, 8))).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _save_2d(rank: int, world_size: int, path: str, out: str) -> None:
    """2 x 2: save model and AdamW state with DCP after two steps (and, in `out`, the whole
    parameters); a fresh FlatGrad + DataParallel loads it and steps on as the uninterrupted
    run (bitwise), and a model tensor-parallel without flatgrad loads the same parameters."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    plain = MLP().double()

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        dp = flatgrad.replicate(
            flatgrad.FlatGrad(_parallel(plain, mesh["tp"], MLP_PLAN)), device_mesh=mesh["dp"]
        )
        return dp, torch.optim.AdamW(dp.parameters(), lr=1e-3)

    dp, optimizer = build()
    _train_steps(dp, optimizer, range(2), dp_rank)
    model_state, optim_state = get_state_dict(dp, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    saved = {name: _full(param.detach()) for name, param in dp.named_parameters()}  # (collectives)
    if rank == 0:
        torch.save(saved, out)
    resumed, resumed_optimizer = build()
    model_state, optim_state = get_state_dict(resumed, resumed_optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        resumed, resumed_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    stock = _parallel(plain, mesh["tp"], MLP_PLAN)
    stock_state = {"model": stock.state_dict()}
    dcp.load(stock_state, checkpoint_id=path)
    stock.load_state_dict(stock_state["model"])
    for (name, param), loaded in zip(dp.named_parameters(), stock.parameters()):
        assert torch.equal(_full(param.detach()), _full(loaded.detach())), name
    _train_steps(dp, optimizer, range(2, 4), dp_rank)
    _train_steps(resumed, resumed_optimizer, range(2, 4), dp_rank)
    for (name, param), other in zip(dp.named_parameters(), resumed.parameters()):
        assert torch.equal(_full(param.detach()), _full(other.detach())), name


def _load_on_one_dp_rank(rank: int, world_size: int, path: str, out: str) -> None:
    """1 x 2 (another data-parallel size): the 2 x 2 checkpoint loads into FlatGrad alone and
    into the model tensor-parallel without flatgrad, both the saved parameters exactly."""
    import torch.distributed.checkpoint as dcp

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    expected = torch.load(out)
    for model in (
        flatgrad.FlatGrad(_parallel(MLP().double(), mesh, MLP_PLAN)),
        _parallel(MLP().double(), mesh, MLP_PLAN),
    ):
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        for name, param in model.named_parameters():
            assert torch.equal(_full(param.detach()), expected[name]), name


@pytest.mark.distributed
def test_dcp_checkpoints_on_a_2d_mesh_resume_and_load_on_another_data_parallel_size(tmp_path):
    pytest.importorskip("numpy")  # (DCP's object collectives)
    path, out = str(tmp_path / "checkpoint"), str(tmp_path / "saved.pt")
    run_ranks(_save_2d, path, out, world_size=4, timeout=240.0)
    run_ranks(_load_on_one_dp_rank, path, out, world_size=2)


def _unused_layer(rank: int, world_size: int) -> None:
    """A tensor-parallel layer the forward never calls: `.grad` None as stock leaves it (also
    after zero_grad(set_to_none=False)), the norm the used layers'."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    torch.manual_seed(0)  # (the plain LayerNorm the same on both ranks, as parallelize_module expects)
    model = MLP().double()
    model.unused = nn.Linear(8, 8).double()
    model.unused_plain = nn.LayerNorm(8).double()  # (unseated with the DTensor ones: one foreach)
    plan = {**MLP_PLAN, "unused": ColwiseParallel()}
    flat = flatgrad.FlatGrad(_parallel(model, mesh, plan))
    x = _batch(0, 0, 0, (4, 8))
    flat(x).pow(2).sum().backward()
    model(x).pow(2).sum().backward()
    assert all(p.grad is None for name, p in flat.named_parameters() if name.startswith("unused"))
    norm = torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])
    )
    torch.testing.assert_close(float(flat.grad_norm()), float(norm), rtol=0, atol=TOL)
    flat.zero_grad(set_to_none=False)  # zeroes what has a .grad, as stock's
    _assert_in_buffers(flat)
    assert flat.unused.weight.grad is None
    assert all(float(p.grad.to_local().abs().sum()) == 0 for p in flat.up.parameters())


@pytest.mark.distributed
def test_an_unused_tensor_parallel_layer_keeps_no_grad():
    run_ranks(_unused_layer, world_size=2)
