"""`flatgrad.ShardedOptimizer` with ``shard_by="tensor"`` (whole parameters per rank): Muon
with AdamW, Adafactor, checkpoints and refusals.

The oracles are stock DDP + the same torch optimizers on a deep copy, and torch's
`ZeroRedundancyOptimizer` (which also gives each rank whole parameters) over a second DDP
copy. 2 and 3 gloo ranks, float64, different data per rank. Each parameter is updated by
the same optimizer code from the same averaged gradient on its owner rank, so the only
difference from stock is the gradient average's summation order (gloo's all-reduce on both
sides): 1e-12 relative. A resume on another world size changes the order of the global
batch's additions: 1e-10.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from oracle import Lockstep, assert_grads_like, assert_params_like
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import flatgrad
from flatgrad._zero import state_bytes
from flatgrad.bench.models import TiedGPT

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon: torch 2.9 on"),
]

TOL = {"rtol": 1e-12, "atol": 1e-12}
RESUME_TOL = {"rtol": 1e-10, "atol": 1e-10}
MUON = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01}
ADAMW = {"lr": 3e-3, "weight_decay": 0.1}


def _gpt() -> nn.Module:
    """A small GPT (torch's encoder layers, causal), its LM head tied to the embedding."""
    torch.manual_seed(0)
    return TiedGPT(vocab=64, dim=16, depth=2, heads=2, block=8).double()


def _gpt_batch(rank: int, step: int, micro: int = 0, rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    tokens = torch.randint(0, 64, (rows, 9), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _muon_split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Muon's recipe: the hidden matrices for Muon, the rest (embeddings and the tied head,
    norms, biases) for AdamW."""
    matrices = [p for name, p in model.named_parameters() if p.dim() == 2 and name.startswith("blocks.")]
    rest = [p for name, p in model.named_parameters() if not (p.dim() == 2 and name.startswith("blocks."))]
    return matrices, rest


def _warmup(step: int) -> float:
    return min(1.0, (step + 1) / 3)


class _Pair:
    """Muon + AdamW over one model, with an LR scheduler on each: ours (two
    ShardedOptimizers over one DataParallel), or stock's over `wrapper` (DDP)."""

    def __init__(self, model: nn.Module, ours: bool, wrapper: Any = None, zero: bool = False) -> None:
        matrices, rest = _muon_split(model)
        if ours:
            self.wrapper = wrapper
            self.opts = [
                flatgrad.ShardedOptimizer(wrapper, torch.optim.Muon, matrices, **MUON),
                flatgrad.ShardedOptimizer(wrapper, torch.optim.AdamW, rest, shard_by="tensor", **ADAMW),
            ]
        elif zero:
            self.wrapper = wrapper
            self.opts = [
                ZeroRedundancyOptimizer(matrices, optimizer_class=torch.optim.Muon, **MUON),
                ZeroRedundancyOptimizer(rest, optimizer_class=torch.optim.AdamW, **ADAMW),
            ]
        else:
            self.wrapper = wrapper
            self.opts = [torch.optim.Muon(matrices, **MUON), torch.optim.AdamW(rest, **ADAMW)]
        self.scheds = [torch.optim.lr_scheduler.LambdaLR(opt, _warmup) for opt in self.opts]
        self.ours = ours

    def step(self, rank: int, step: int) -> torch.Tensor:
        """Two micro-batches (the first under no_sync), clipping, both optimizers, both
        schedulers; the norm before clipping."""
        for opt in self.opts:
            opt.zero_grad()
        with self.wrapper.no_sync():
            self.wrapper(*_gpt_batch(rank, step, 0)).backward()
        self.wrapper(*_gpt_batch(rank, step, 1)).backward()
        if self.ours:  # (one clip over the whole model, as stock's over all parameters)
            norm = self.opts[0].clip_grad_norm_(0.5)
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.wrapper.parameters(), 0.5)
        for opt, sched in zip(self.opts, self.scheds):
            opt.step()
            sched.step()
        return norm


def _muon_adamw_worker(rank: int, world_size: int) -> None:
    model = _gpt()
    stock_model, zero_model = copy.deepcopy(model), copy.deepcopy(model)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model), bucket_cap_mb=0.01)
    ours = _Pair(model, True, dp)
    stock = _Pair(stock_model, False, DDP(stock_model))
    zero = _Pair(zero_model, False, DDP(zero_model), zero=True)
    for step in range(4):
        norms = [pair.step(rank, step) for pair in (ours, stock, zero)]
        torch.testing.assert_close(norms[0], norms[1], **TOL)
        assert_params_like(model, stock_model, **TOL, what=f"stock, step {step}")
        assert_params_like(model, zero_model, **TOL, what=f"ZeroRedundancyOptimizer, step {step}")
    assert [opt.shard_by for opt in ours.opts] == ["tensor", "tensor"]
    assert ours.opts[0].param_groups[0]["lr"] == stock.opts[0].param_groups[0]["lr"]
    # memory: this rank's state is within one largest tensor of 1/world_size of the whole
    ours_bytes = sum(opt.state_bytes() for opt in ours.opts)
    whole = sum(state_bytes(opt) for opt in stock.opts)
    largest = max(2 * p.numel() * p.element_size() for p in model.parameters())  # (AdamW's two moments)
    assert ours_bytes <= whole / world_size + largest, (ours_bytes, whole, largest)
    mine = torch.tensor([ours_bytes], dtype=torch.float64)
    dist.all_reduce(mine)
    assert int(mine) == whole  # every parameter's state on exactly one rank


@pytest.mark.parametrize("world_size", [2, 3])
def test_muon_with_adamw_equals_ddp_and_zero_redundancy_optimizer(world_size):
    """Two ShardedOptimizers by tensor over one DataParallel (Muon for the hidden matrices,
    AdamW for the rest), gradient accumulation, clipping, an LR scheduler on each: the
    parameters of DDP + Muon + AdamW and of ZeroRedundancyOptimizer(Muon) +
    ZeroRedundancyOptimizer(AdamW); each rank holds about 1/world_size of the state."""
    run_ranks(_muon_adamw_worker, world_size=world_size)


# Adafactor's eps1 (its floor under the squared gradient) at 1e-3 instead of float64's
# machine epsilon: the key projection's bias has a gradient that is zero but for round-off
# (attention does not depend on it), which the default floor scales up to the size of an
# update, so one ulp of difference in the average (3 ranks; GEMMs on differently aligned
# memory) would become a 10x relative difference in that bias.
ADAFACTOR = {"lr": 0.01, "eps": (1e-3, 1e-3)}


def _adafactor_worker(rank: int, world_size: int) -> None:
    model = _gpt()
    ref = copy.deepcopy(model)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model), bucket_cap_mb=0.01)
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.Adafactor, **ADAFACTOR)
    assert opt.shard_by == "tensor"
    pair = Lockstep(model, dp, opt, DDP(ref), torch.optim.Adafactor(ref.parameters(), **ADAFACTOR))
    for step in range(3):
        pair.train_step(*_gpt_batch(rank, step))
        pair.assert_params(**TOL, what=f"step {step}")
    # this rank's own state, torch.save-d and loaded into a fresh optimizer, steps on as stock
    saved = opt.state_dict()
    assert all(name in saved["state"] for name in _owned_names(opt, dp))
    model2 = copy.deepcopy(model)
    dp2 = flatgrad.replicate(flatgrad.FlatGrad(model2), bucket_cap_mb=0.01)
    opt2 = flatgrad.ShardedOptimizer(dp2, torch.optim.Adafactor, **ADAFACTOR)
    opt2.load_state_dict(saved)
    pair2 = Lockstep(model2, dp2, opt2, pair.ref, pair.ref_opt)
    for step in range(3, 5):
        pair2.train_step(*_gpt_batch(rank, step))
        pair2.assert_params(**TOL, what=f"resumed, step {step}")


def _owned_names(opt: flatgrad.ShardedOptimizer, dp: flatgrad.ReplicateModule) -> list[str]:
    return [name for name, p in dp.named_parameters() if opt._engine.owns(p)]  # type: ignore[union-attr]


@pytest.mark.parametrize("world_size", [2, 3])
def test_adafactor_equals_ddp_and_resumes_from_its_state_dict(world_size):
    run_ranks(_adafactor_worker, world_size=world_size)


# --- checkpoints on another world size ---------------------------------------------------

GLOBAL_ROWS = 6


def _share(rank: int, world_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s equal share of the global batch of `step` (the same on any world size)."""
    inputs, targets = _gpt_batch(0, step, rows=GLOBAL_ROWS)
    rows = GLOBAL_ROWS // world_size
    return inputs[rank * rows : (rank + 1) * rows], targets[rank * rows : (rank + 1) * rows]


def _ckpt_setup() -> tuple[nn.Module, flatgrad.ReplicateModule, list[flatgrad.ShardedOptimizer], list[Any]]:
    model = _gpt()
    dp = flatgrad.replicate(flatgrad.FlatGrad(model), bucket_cap_mb=0.01)
    matrices, rest = _muon_split(model)
    opts = [
        flatgrad.ShardedOptimizer(dp, torch.optim.Muon, matrices, **MUON),
        flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, rest, shard_by="tensor", **ADAMW),
    ]
    return model, dp, opts, [torch.optim.lr_scheduler.LambdaLR(opt, _warmup) for opt in opts]


def _ckpt_train(
    dp: Any, opts: list[Any], scheds: list[Any], rank: int, world_size: int, steps: range
) -> None:
    for step in steps:
        for opt in opts:
            opt.zero_grad()
        dp(*_share(rank, world_size, step)).backward()
        opts[0].clip_grad_norm_(0.5)
        for opt, sched in zip(opts, scheds):
            opt.step()
            sched.step()


def _state(dp: Any, opts: list[Any], scheds: list[Any]) -> dict[str, Any]:
    return {"model": dp, "muon": opts[0], "adamw": opts[1], "muon_lr": scheds[0], "adamw_lr": scheds[1]}


def _ckpt_save_worker(rank: int, world_size: int, tmp: str) -> None:
    model, dp, opts, scheds = _ckpt_setup()
    _ckpt_train(dp, opts, scheds, rank, world_size, range(2))
    dcp.save(_state(dp, opts, scheds), checkpoint_id=f"{tmp}/ckpt")
    _ckpt_train(dp, opts, scheds, rank, world_size, range(2, 4))
    if rank == 0:
        with open(f"{tmp}/final.json", "w") as file:
            json.dump({name: p.detach().tolist() for name, p in model.named_parameters()}, file)


def _ckpt_resume_worker(rank: int, world_size: int, tmp: str) -> None:
    model, dp, opts, scheds = _ckpt_setup()
    _ckpt_train(dp, opts, scheds, rank, world_size, range(1))  # state that the load must replace
    dcp.load(_state(dp, opts, scheds), checkpoint_id=f"{tmp}/ckpt")
    _ckpt_train(dp, opts, scheds, rank, world_size, range(2, 4))
    with open(f"{tmp}/final.json") as file:
        final = json.load(file)
    for name, p in model.named_parameters():
        expected = torch.tensor(final[name], dtype=p.dtype)
        torch.testing.assert_close(p.detach(), expected, **RESUME_TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_muon_with_adamw_resumes_from_dcp_on_another_world_size(tmp_path):
    """dcp.save of the model, both optimizers and both schedulers on 2 ranks; dcp.load on 3
    (each rank owns other parameters there) and on 2, then 2 more steps: the uninterrupted
    run's parameters."""
    run_ranks(_ckpt_save_worker, str(tmp_path), world_size=2)
    for world_size in (3, 2):
        run_ranks(_ckpt_resume_worker, str(tmp_path), world_size=world_size, timeout=150)


# --- which optimizers shard how ----------------------------------------------------------


class _ToySGD(torch.optim.Optimizer):
    """SGD whose update of each parameter is `update` (of it, its gradient and all the
    parameters with one): the probe's subjects."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    def update(self, p: torch.Tensor, every: list[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        every = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(self.update(p, every), alpha=-group["lr"])


class _GlobalNormSGD(_ToySGD):
    """SGD on gradients divided by their global norm over every parameter: cross-tensor."""

    def update(self, p: torch.Tensor, every: list[torch.Tensor]) -> torch.Tensor:
        norms = torch.stack([torch.linalg.vector_norm(q.grad) for q in every])  # type: ignore[arg-type]
        return p.grad / torch.linalg.vector_norm(norms)  # type: ignore[operator]


class _TrustRatioSGD(_ToySGD):
    """SGD scaled by each tensor's trust ratio (LARS-like): per-tensor."""

    def update(self, p: torch.Tensor, every: list[torch.Tensor]) -> torch.Tensor:
        return p.grad * torch.linalg.vector_norm(p) / (torch.linalg.vector_norm(p.grad) + 1e-12)  # type: ignore[operator,arg-type]


class _SignSGD(_ToySGD):
    """SGD on the gradient's sign (Lion's update without momentum): element-wise."""

    def update(self, p: torch.Tensor, every: list[torch.Tensor]) -> torch.Tensor:
        return p.grad.sign()  # type: ignore[union-attr]


class _NoisySGD(_ToySGD):
    """SGD plus noise drawn per tensor from the global RNG (as Gravity and DASH draw): on
    ranks holding other tensors the draws differ."""

    def update(self, p: torch.Tensor, every: list[torch.Tensor]) -> torch.Tensor:
        return p.grad + 0.01 * torch.randn_like(p)  # type: ignore[operator]


class _AveragingSGD(_ToySGD):
    """SGD that averages each gradient over the default group in its own step (as nanochat's
    MuonAdamW does when a process group exists)."""

    def update(self, p: torch.Tensor, every: list[torch.Tensor]) -> torch.Tensor:
        grad = p.grad.clone()  # type: ignore[union-attr]
        torch.distributed.all_reduce(grad)
        return grad / torch.distributed.get_world_size()


class _NeedsAnArgument(torch.optim.SGD):
    def step(self, closure: Any = None, *, scale: float) -> None:  # type: ignore[override]
        super().step(closure)


def _kinds_worker(rank: int, world_size: int) -> None:
    def build(cls: Any, **kwargs: Any) -> flatgrad.ShardedOptimizer:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
        return flatgrad.ShardedOptimizer(flatgrad.replicate(flatgrad.FlatGrad(model)), cls, lr=0.1, **kwargs)

    assert build(torch.optim.AdamW).shard_by == "element"
    assert build(torch.optim.AdamW, shard_by="tensor").shard_by == "tensor"
    # A class flatgrad does not know is refused without shard_by; a declaration is checked by
    # a probe that can only refuse it.
    for cls in (_SignSGD, _TrustRatioSGD, _GlobalNormSGD, _NeedsAnArgument):
        with pytest.raises(ValueError, match=f"does not know how {cls.__name__} may be sharded .* shard_by="):
            build(cls)
    assert build(_SignSGD, shard_by="element").shard_by == "element"
    assert build(_SignSGD, shard_by="tensor").shard_by == "tensor"
    assert build(_TrustRatioSGD, shard_by="tensor").shard_by == "tensor"
    with pytest.raises(ValueError, match="cannot shard _TrustRatioSGD by element: a probe compared a tensor"):
        build(_TrustRatioSGD, shard_by="element")
    with pytest.raises(ValueError, match="cannot shard _GlobalNormSGD by tensor: .* reads other tensors"):
        build(_GlobalNormSGD, shard_by="tensor")
    with pytest.raises(ValueError, match="cannot shard _NoisySGD by tensor: .*global RNG per tensor"):
        build(_NoisySGD, shard_by="tensor")
    with pytest.raises(ValueError, match="cannot step _AveragingSGD: its step runs collectives"):
        build(_AveragingSGD, shard_by="tensor")  # (every rank refuses; none waits)
    assert build(_NeedsAnArgument, shard_by="element").shard_by == "element"  # (the user's word)
    with pytest.raises(ValueError, match="Muon updates each tensor as a whole"):
        flatgrad.ShardedOptimizer(
            flatgrad.replicate(flatgrad.FlatGrad(nn.Linear(4, 4, bias=False))),
            torch.optim.Muon,
            shard_by="element",
        )
    with pytest.raises(ValueError, match="cannot step SparseAdam: it takes sparse gradients"):
        build(torch.optim.SparseAdam)
    with pytest.raises(ValueError, match="shard_by must be None, 'element' or 'tensor', got 'row'"):
        build(torch.optim.SGD, shard_by="row")
    with pytest.raises(TypeError, match="optimizer_class must be a torch.optim.Optimizer subclass, got dict"):
        build(dict)
    # Muon refuses a vector (its own check), on every rank before anything moves
    model = nn.Linear(4, 4).double()
    dp = flatgrad.replicate(flatgrad.FlatGrad(model))
    with pytest.raises(ValueError, match="Muon only supports 2D parameters"):
        flatgrad.ShardedOptimizer(dp, torch.optim.Muon, lr=0.1)
    with pytest.raises(ValueError, match="overlap_param_gather=True is not supported with shard_by='tensor'"):
        flatgrad.ShardedOptimizer(dp, torch.optim.Adam, shard_by="tensor", overlap_param_gather=True)
    flatgrad.ShardedOptimizer(dp, torch.optim.Muon, [model.weight], lr=0.1)
    with pytest.raises(ValueError, match="the model already has a ShardedOptimizer"):
        flatgrad.ShardedOptimizer(dp, torch.optim.Adam, [model.bias])  # (by element: reduce-scatters)


def test_each_class_gets_the_sharding_it_allows_or_a_clear_refusal():
    """torch's element-wise classes by element, Muon and Adafactor by tensor; a class flatgrad
    does not know refused without shard_by, and by what the user declares where the probe
    cannot refute it (a trust ratio: by tensor only; a global norm, per-tensor draws from the
    global RNG, a collective in the step: refused; a step the probe cannot run: the user's
    word); what cannot hold refused with its reason."""
    run_ranks(_kinds_worker)


class _NoEmptyGroups(torch.optim.SGD):
    """Refuses a group without parameters, as pytorch-optimizer's AvaGrad's step fails on one."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        if any(not group["params"] for group in self.param_groups):
            raise ValueError("_NoEmptyGroups got an empty group")


class _FailsOnRankOne(torch.optim.SGD):
    """Fails at its first step on rank 1 only (a shard's bad value, memory, a kernel)."""

    def step(self, closure: Any = None) -> Any:
        if dist.get_rank() == 1 and not self.state:
            raise RuntimeError("_FailsOnRankOne failed on rank 1")
        return super().step(closure)


def _one_rank_fails_worker(rank: int, world_size: int) -> None:
    model, _, dp = _small(rank)
    assert dp is not None
    layers = list(model.children())
    groups = [{"params": [p for m in layers[:-1] for p in m.parameters()]}, {"params": [layers[-1].bias]}]
    # By tensor the second group (one bias) is empty on one rank: its inner optimizer refuses
    # there; the other rank raises too.
    either = r"_NoEmptyGroups got an empty group|building the inner optimizer raised on rank\(s\) \[\d\]"
    with pytest.raises((ValueError, RuntimeError), match=either):
        flatgrad.ShardedOptimizer(dp, _NoEmptyGroups, groups, lr=0.1, shard_by="tensor")
    for shard_by in ("element", "tensor"):
        model, _, dp = _small(rank)
        assert dp is not None
        opt = flatgrad.ShardedOptimizer(dp, _FailsOnRankOne, lr=0.1, shard_by=shard_by)
        dp(_batch(rank, 0)).square().sum().backward()
        theirs = r"_FailsOnRankOne.step raised on rank\(s\) \[1\]"
        error = "_FailsOnRankOne failed on rank 1" if rank == 1 else theirs
        with pytest.raises(RuntimeError, match=error):
            opt.step()


def test_an_error_on_one_rank_is_raised_on_every_rank():
    """An inner optimizer that refuses one rank's (empty) group at construction, or whose first
    step fails on one rank: every rank raises, none waits for the others."""
    run_ranks(_one_rank_fails_worker)


# --- the optimizer contracts by tensor ---------------------------------------------------


def _small(
    rank: int, dtype: torch.dtype = torch.float64
) -> tuple[nn.Module, nn.Module, flatgrad.ReplicateModule | None]:
    """A model of several slots, its deep copy (the oracle's), and DataParallel over it
    (float64; None for another dtype: the caller wraps it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 3)).to(dtype)
    ref = copy.deepcopy(model)
    dp = (
        flatgrad.replicate(flatgrad.FlatGrad(model), bucket_cap_mb=0.0002) if dtype == torch.float64 else None
    )
    return model, ref, dp


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(100 * rank + step))


def _square_sum(output: torch.Tensor) -> torch.Tensor:
    return output.square().sum()


def _contracts_worker(rank: int, world_size: int) -> None:
    """A param group added later, a closure, zero_grad(set_to_none=False), and a .grad that
    torch's own clip_grad_norm_ reads (every rank holds every averaged gradient by tensor),
    against DDP(find_unused_parameters=True) + Adam."""
    model, ref, dp = _small(rank)
    first, later = list(model[0].parameters()), [p for m in (model[2], model[4]) for p in m.parameters()]
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.Adam, first, shard_by="tensor", lr=0.05)
    ref_first = list(ref[0].parameters())
    ref_later = [p for m in (ref[2], ref[4]) for p in m.parameters()]
    ref_opt = torch.optim.Adam(ref_first, lr=0.05)
    ddp = DDP(ref, find_unused_parameters=True)
    pair = Lockstep(model, dp, opt, ddp, ref_opt, loss=_square_sum)
    pair.train_step(_batch(rank, 0))
    opt.add_param_group({"params": later, "lr": 0.02})
    ref_opt.add_param_group({"params": ref_later, "lr": 0.02})
    for step in range(1, 4):
        pair.zero_grad(set_to_none=step % 2 == 0)
        pair.backward(_batch(rank, step))
        pair.assert_grads(**TOL, what=f"step {step}")
        norms = [torch.nn.utils.clip_grad_norm_(m.parameters(), 0.3) for m in (model, ref)]
        torch.testing.assert_close(norms[0], norms[1], **TOL)
        pair.step()
        pair.assert_params(**TOL, what=f"step {step}")

    def closure(m: Any, o: torch.optim.Optimizer) -> Any:
        def run() -> torch.Tensor:
            o.zero_grad()
            loss = m(_batch(rank, 9)).square().sum()
            loss.backward()
            return loss

        return run

    losses = [opt.step(closure(dp, opt)), ref_opt.step(closure(ddp, ref_opt))]
    torch.testing.assert_close(losses[0], losses[1], **TOL)
    pair.assert_params(**TOL, what="closure")


def test_param_groups_closure_and_readable_grads_by_tensor_equal_stock():
    run_ranks(_contracts_worker, world_size=3)


def _join_steps(dp: Any, opt: Any, rank: int) -> None:
    from torch.distributed.algorithms import Join, Joinable

    joinables = [dp, opt] if isinstance(opt, Joinable) else [dp]
    with Join(joinables):
        for step in range(2 + rank):
            opt.zero_grad()
            dp(_batch(rank, step)).square().sum().backward()
            opt.step()


def _join_worker(rank: int, world_size: int) -> None:
    """Uneven data (rank r runs 2 + r steps) inside Join([dp, opt]): a joined rank steps the
    parameters it owns with the others' averages and broadcasts them, as stock DDP + Join +
    AdamW ends."""
    model, ref, dp = _small(rank)
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, shard_by="tensor", lr=0.05, weight_decay=0.1)
    ddp = DDP(ref)
    _join_steps(dp, opt, rank)
    _join_steps(ddp, torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1), rank)
    assert_params_like(model, ref, **TOL)


def test_join_with_uneven_batches_by_tensor_equals_stock():
    run_ranks(_join_worker, world_size=3)


def _scaler_worker(rank: int, world_size: int, ours_scaler: str) -> None:
    """float32 (the dtype a GradScaler unscales), flatgrad's GradScaler or torch's own (by
    tensor, every `.grad` is a whole average, which torch's reads), against DDP + AdamW +
    torch's GradScaler: an inf on rank 1 at step 2 skips that step on every rank."""
    model, ref, _ = _small(rank, torch.float32)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model), bucket_cap_mb=0.0002)
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, shard_by="tensor", lr=0.05)
    ddp = DDP(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    make = flatgrad.GradScaler if ours_scaler == "flatgrad" else torch.amp.GradScaler
    sides = [
        (dp, opt, make("cpu", init_scale=2.0**10)),
        (ddp, ref_opt, torch.amp.GradScaler("cpu", init_scale=2.0**10)),
    ]
    for step in range(4):
        poison = float("inf") if (step == 2 and rank == 1) else 1.0
        for wrapper, optimizer, scaler in sides:
            optimizer.zero_grad()
            scaler.scale(wrapper(_batch(rank, step).float()).square().sum() * poison).backward()
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
        assert sides[0][2].get_scale() == sides[1][2].get_scale()
        assert_params_like(model, ref, rtol=0, atol=0, what=f"step {step}")


@pytest.mark.parametrize("ours_scaler", ["flatgrad", "torch"])
def test_a_grad_scaler_by_tensor_skips_and_steps_as_stock(ours_scaler):
    run_ranks(_scaler_worker, ours_scaler)


def _plain_worker(rank: int, world_size: int, tmp: str) -> None:
    """Into and from a plain optimizer: ShardedOptimizer(Muon)'s state through
    get_state_dict / dcp.save loads into DDP + Muon through dcp.load / set_state_dict, and
    the plain one's back into ShardedOptimizer; both then step on as one."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7, bias=False), nn.Tanh(), nn.Linear(7, 3, bias=False)).double()
    ref = copy.deepcopy(model)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model))
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.Muon, **MUON)
    ddp = DDP(ref)
    ref_opt = torch.optim.Muon(ref.parameters(), **MUON)
    pair = Lockstep(model, dp, opt, ddp, ref_opt, loss=_square_sum)
    for step in range(2):
        pair.train_step(_batch(rank, step))
    dcp.save({"optim": opt}, checkpoint_id=f"{tmp}/ours")
    fresh_ref = torch.optim.Muon(ref.parameters(), **MUON)
    fresh_ref.zero_grad()  # (get_state_dict makes a fresh optimizer's state only without grads)
    _, optim_sd = get_state_dict(ddp, fresh_ref)
    dcp.load({"optim": optim_sd}, checkpoint_id=f"{tmp}/ours")
    set_state_dict(ddp, fresh_ref, model_state_dict={}, optim_state_dict=optim_sd)
    for name, state in ref_opt.state_dict()["state"].items():
        torch.testing.assert_close(fresh_ref.state_dict()["state"][name], state, **TOL)
    _, optim_sd = get_state_dict(ddp, ref_opt)
    dcp.save({"optim": optim_sd}, checkpoint_id=f"{tmp}/plain")
    opt2 = flatgrad.ShardedOptimizer(
        flatgrad.replicate(flatgrad.FlatGrad(copy.deepcopy(model))), torch.optim.Muon, **MUON
    )
    dcp.load({"optim": opt2}, checkpoint_id=f"{tmp}/plain")
    for name, state in opt2.state_dict()["state"].items():
        torch.testing.assert_close(state, opt.state_dict()["state"][name], **TOL)
    pair2 = Lockstep(model, dp, opt, ddp, fresh_ref, loss=_square_sum)
    for step in range(2, 4):
        pair2.train_step(_batch(rank, step))
        pair2.assert_params(**TOL, what=f"step {step}")


def test_state_by_tensor_loads_into_and_from_a_plain_optimizer(tmp_path):
    run_ranks(_plain_worker, str(tmp_path), world_size=3)


def _zero_between_worker(rank: int, world_size: int) -> None:
    """``muon.step(); muon.zero_grad(); adamw.step(); adamw.zero_grad()``: each zero_grad
    zeroes its own optimizer's gradients only, as a torch optimizer's does."""
    model = _gpt()
    stock_model = copy.deepcopy(model)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model), bucket_cap_mb=0.01)
    ours = _Pair(model, True, dp)
    stock = _Pair(stock_model, False, DDP(stock_model))
    for step in range(3):
        for pair in (ours, stock):
            pair.wrapper(*_gpt_batch(rank, step)).backward()
            for opt in pair.opts:
                opt.step()
                opt.zero_grad(set_to_none=step != 1)
        assert_params_like(model, stock_model, **TOL, what=f"step {step}")


def test_zero_grad_by_tensor_zeroes_its_own_parameters_only():
    run_ranks(_zero_between_worker)


def _nccl_worker(rank: int, world_size: int) -> None:
    """Muon + AdamW by tensor on CUDA over NCCL (the broadcasts on the GPU's stream):
    DDP + the plain optimizers' parameters."""
    torch.cuda.set_device(rank)
    model = _gpt().cuda()
    stock_model = copy.deepcopy(model)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model), bucket_cap_mb=0.01)
    ours = _Pair(model, True, dp)
    stock = _Pair(stock_model, False, DDP(stock_model, device_ids=[rank]))
    for step in range(3):
        for pair in (ours, stock):
            for opt in pair.opts:
                opt.zero_grad()
            pair.wrapper(*(t.cuda() for t in _gpt_batch(rank, step))).backward()
            for opt in pair.opts:
                opt.step()
        assert_params_like(model, stock_model, rtol=1e-10, atol=1e-12, what=f"step {step}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_muon_with_adamw_by_tensor_on_nccl_equals_ddp():
    run_ranks(_nccl_worker, world_size=torch.cuda.device_count(), backend="nccl")


# --- what the review found ---------------------------------------------------------------


def _replaced_memory_worker(rank: int, world_size: int, shard_by: str) -> None:
    """``param.data = other memory`` after construction: the optimizer would step the slot
    the parameter left (it would never move again); every rank raises at the step."""
    model, _, dp = _small(rank)
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.SGD, lr=0.1, shard_by=shard_by)
    dp(_batch(rank, 0)).square().sum().backward()
    opt.step()
    with torch.no_grad():
        model[0].weight.data = model[0].weight.data.clone()
    opt.zero_grad()
    dp(_batch(rank, 1)).square().sum().backward()
    with pytest.raises(RuntimeError, match=r"a parameter's memory was replaced \(param.data = ...\)"):
        opt.step()


@pytest.mark.parametrize("shard_by", ["element", "tensor"])
def test_a_parameter_given_other_memory_after_construction_is_refused(shard_by):
    run_ranks(_replaced_memory_worker, shard_by)


def _second_after_replace_worker(rank: int, world_size: int) -> None:
    model = _gpt()
    dp = flatgrad.replicate(flatgrad.FlatGrad(model), bucket_cap_mb=0.01)
    matrices, rest = _muon_split(model)
    flatgrad.ShardedOptimizer(dp, torch.optim.Muon, matrices, **MUON)
    with torch.no_grad():
        rest[0].data = rest[0].data.clone()
    with pytest.raises(ValueError, match="not views of its first ShardedOptimizer's flat parameter buffers"):
        flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, rest, shard_by="tensor", **ADAMW)


def test_a_second_optimizer_refuses_parameters_moved_out_of_the_first_ones_buffers():
    """It would lay the parameters out in new flat buffers, out of the memory Muon steps."""
    run_ranks(_second_after_replace_worker)


def _subgroup_worker(rank: int, world_size: int) -> None:
    """Over a process group of one rank each (ranks of the group are not global ranks): Muon
    + AdamW's coalesced broadcasts, rooted at the group's rank, equal the plain optimizers."""
    groups = [dist.new_group([r]) for r in range(world_size)]
    model = _gpt()
    stock_model = copy.deepcopy(model)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model), process_group=groups[rank], bucket_cap_mb=0.01)
    ours = _Pair(model, True, dp)
    stock = _Pair(stock_model, False, DDP(stock_model, process_group=groups[rank]))
    for step in range(2):
        ours.step(rank, step)
        stock.step(rank, step)
        assert_params_like(model, stock_model, **TOL, what=f"step {step}")


def test_muon_with_adamw_over_a_process_group_that_is_not_the_world():
    run_ranks(_subgroup_worker)


def _two_scalers_worker(rank: int, world_size: int) -> None:
    """One loss scaler over Muon's and AdamW's ShardedOptimizers: each unscales its own
    gradients once (the whole model's before, so every gradient twice), as torch's scaler
    over two torch optimizers."""
    torch.manual_seed(0)
    model = TiedGPT(vocab=64, dim=16, depth=2, heads=2, block=8)  # float32, as a scaler takes
    stock_model = copy.deepcopy(model)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model), bucket_cap_mb=0.01)
    ours, stock = _Pair(model, True, dp), _Pair(stock_model, False, DDP(stock_model))
    scalers = [
        flatgrad.GradScaler("cpu", init_scale=2.0**10),
        torch.amp.GradScaler("cpu", init_scale=2.0**10),
    ]
    for step in range(2):
        for pair, scaler in zip((ours, stock), scalers):
            for opt in pair.opts:
                opt.zero_grad()
            scaler.scale(pair.wrapper(*_gpt_batch(rank, step))).backward()
            for opt in pair.opts:
                scaler.unscale_(opt)
            for opt in pair.opts:
                scaler.step(opt)
            scaler.update()
        assert_params_like(model, stock_model, rtol=1e-5, atol=1e-6, what=f"step {step}")


def test_one_loss_scaler_over_two_optimizers_by_tensor_unscales_each_gradient_once():
    run_ranks(_two_scalers_worker)


def _no_trace_worker(rank: int, world_size: int) -> None:
    """The probe of a class torch does not know leaves the random generators as they were,
    and the class's own error for a bad argument comes first."""
    model, _, dp = _small(rank)
    before = torch.get_rng_state()
    flatgrad.ShardedOptimizer(dp, _SignSGD, lr=0.1, shard_by="element")
    with pytest.raises(ValueError, match="global RNG per tensor"):  # (its probe draws)
        flatgrad.ShardedOptimizer(dp, _NoisySGD, lr=0.1, shard_by="tensor")
    assert torch.equal(torch.get_rng_state(), before)
    with pytest.raises(TypeError, match="unexpected keyword argument 'lrr'"):
        flatgrad.ShardedOptimizer(flatgrad.replicate(flatgrad.FlatGrad(_small(rank)[1])), _SignSGD, lrr=0.1)


def test_the_probe_leaves_no_trace_and_bad_arguments_get_the_class_error():
    run_ranks(_no_trace_worker)


def _disagree_worker(rank: int, world_size: int) -> None:
    """Ranks that chose different shard_by (a probe step that failed on one rank only)
    raise the same error on every rank instead of running other collectives."""
    from unittest import mock

    _, _, dp = _small(rank)
    chosen = "tensor" if rank == world_size - 1 else "element"
    with (
        mock.patch("flatgrad._sharded.shard_kind", return_value=chosen),
        pytest.raises(ValueError, match="ranks chose different shard_by for the same optimizer"),
    ):
        flatgrad.ShardedOptimizer(dp, _SignSGD, lr=0.1)


def test_ranks_that_choose_different_shard_by_raise_on_every_rank():
    run_ranks(_disagree_worker)


def _masters_worker(rank: int, world_size: int) -> None:
    """bfloat16 parameters with float32 main grads (``grad_dtype="float32"``), Muon + AdamW
    by tensor, stepping float32 masters: the parameters, to the bit, of a written-out
    reference (plain Muon + AdamW over float32 masters, stepped from `flat.main_grad` after
    DataParallel's average, rounded into the parameters); a state_dict round trip into
    fresh optimizers keeps the masters; a step with no backward since zero_grad moves
    nothing."""
    torch.manual_seed(0)
    model = TiedGPT(vocab=64, dim=16, depth=2, heads=2, block=8).to(torch.bfloat16)
    reference = copy.deepcopy(model)
    config = {"grad_dtype": "float32"}
    dp = flatgrad.replicate(flatgrad.FlatGrad(model, config=config), bucket_cap_mb=0.01)
    matrices, rest = _muon_split(model)

    def ours() -> list[flatgrad.ShardedOptimizer]:
        return [
            flatgrad.ShardedOptimizer(dp, torch.optim.Muon, matrices, **MUON),
            flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, rest, shard_by="tensor", **ADAMW),
        ]

    opts = ours()
    ref_flat = flatgrad.FlatGrad(reference, config=config)
    ref_dp = flatgrad.replicate(ref_flat, bucket_cap_mb=0.01)
    masters = {name: p.detach().float().requires_grad_() for name, p in reference.named_parameters()}
    names = {id(p): n for n, p in reference.named_parameters()}
    ref_matrices, ref_rest = _muon_split(reference)
    ref_opts = [
        torch.optim.Muon([masters[names[id(p)]] for p in ref_matrices], **MUON),
        torch.optim.AdamW([masters[names[id(p)]] for p in ref_rest], **ADAMW),
    ]
    for step in range(4):
        if step == 2:  # this rank's own state, into fresh optimizers (over the same flat buffers)
            saved = [opt.state_dict() for opt in opts]
            opts = ours()
            for opt, state in zip(opts, saved):
                opt.load_state_dict(state)
        for opt in (*opts, *ref_opts):
            opt.zero_grad()
        ref_flat.zero_grad()
        dp(*_gpt_batch(rank, step)).backward()
        ref_dp(*_gpt_batch(rank, step)).backward()
        for name, p in reference.named_parameters():
            masters[name].grad = ref_flat.main_grad(p).clone()
        for opt in (*opts, *ref_opts):
            opt.step()
        with torch.no_grad():
            for name, p in reference.named_parameters():
                p.copy_(masters[name])
        assert_params_like(model, reference, rtol=0, atol=0, what=f"step {step}")
    before = [p.detach().clone() for p in model.parameters()]
    for opt in opts:
        opt.zero_grad()
        opt.step()  # (no backward since: main grads hold nothing to step from)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_bfloat16_with_float32_masters_by_tensor_equals_the_written_out_reference():
    run_ranks(_masters_worker)


# --- parameters frozen and unfrozen between steps (a GAN's toggle_optimizer) ------------------


class _GAN(nn.Module):
    """A generator and a discriminator; the forward returns the loss of the phase it is told
    (the generator's, or the discriminator's on real data and detached fakes), as a
    LightningModule's training step runs both networks through one wrapper."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 4)).double()
        self.discriminator = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1)).double()

    def forward(self, noise: torch.Tensor, real: torch.Tensor, phase: str) -> torch.Tensor:
        if phase == "generator":
            return nn.functional.softplus(-self.discriminator(self.generator(noise))).mean()
        fake = self.generator(noise).detach()
        return (
            nn.functional.softplus(-self.discriminator(real)).mean()
            + nn.functional.softplus(self.discriminator(fake)).mean()
        )


def _toggled(opts: list[torch.optim.Optimizer], opt: torch.optim.Optimizer) -> dict[nn.Parameter, bool]:
    """Lightning's ``toggle_optimizer(opt)``: every parameter of the other optimizers that
    `opt` does not hold is frozen; returns their flags, which `_untoggled` restores."""
    mine = {p for group in opt.param_groups for p in group["params"]}
    flags = {}
    for other in opts:
        for group in other.param_groups:
            for param in group["params"]:
                if param not in mine:
                    flags[param] = param.requires_grad
                    param.requires_grad_(False)
    return flags


def _untoggled(flags: dict[nn.Parameter, bool]) -> None:
    for param, requires_grad in flags.items():
        param.requires_grad_(requires_grad)


def _gan_batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    noise, real = torch.randn(2, 3, 4, dtype=torch.float64, generator=generator)
    return noise, real


def _gan_worker(rank: int, world_size: int) -> None:
    """Each step: the generator's phase (the discriminator frozen; a micro-batch under
    no_sync, then one averaging), then the discriminator's (the generator frozen), each
    optimizer stepped and zeroed inside its phase, as a LightningModule with
    ``toggle_optimizer``/``untoggle_optimizer`` does. The discriminator's phase also calls
    the generator's step, which has no gradients there (skipped, its state kept)."""
    model = _GAN()
    ref = DDP(copy.deepcopy(model), find_unused_parameters=True)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model), bucket_cap_mb=0.0002)
    generator, discriminator = model.generator.parameters(), model.discriminator.parameters()
    ours = [
        flatgrad.ShardedOptimizer(dp, torch.optim.Adam, generator, shard_by="tensor", lr=1e-2),
        flatgrad.ShardedOptimizer(dp, torch.optim.SGD, discriminator, shard_by="tensor", **_SGD_MOMENTUM),
    ]
    stock = [
        torch.optim.Adam(ref.module.generator.parameters(), lr=1e-2),
        torch.optim.SGD(ref.module.discriminator.parameters(), **_SGD_MOMENTUM),
    ]
    sides = ((dp, ours), (ref, stock))
    for step in range(4):
        for phase, index in (("generator", 0), ("discriminator", 1)):
            flags = [_toggled(opts, opts[index]) for _, opts in sides]
            for wrapper, _ in sides:
                if phase == "generator":
                    with wrapper.no_sync():
                        wrapper(*_gan_batch(rank, step, 0), phase).backward()
                wrapper(*_gan_batch(rank, step, 1), phase).backward()
            assert_grads_like(model, ref.module, rtol=GAN_TOL, atol=GAN_TOL, what=f"step {step}, {phase}")
            for _, opts in sides:
                for opt in opts[: index + 1]:  # (the discriminator's phase: the generator's step skips)
                    opt.step()
                opts[index].zero_grad()
            for side_flags in flags:
                _untoggled(side_flags)
            assert_params_like(model, ref.module, rtol=GAN_TOL, atol=GAN_TOL, what=f"step {step}, {phase}")
    assert all(p.requires_grad for p in model.parameters())
    # every parameter's state on exactly one rank, kept while it was frozen
    held = torch.tensor([sum(len(opt.optimizer.state) for opt in ours)])
    dist.all_reduce(held)
    assert int(held) == len(list(model.parameters()))


GAN_TOL = 1e-10
_SGD_MOMENTUM = {"lr": 0.1, "momentum": 0.9}


def test_a_gan_toggling_requires_grad_between_two_optimizers_by_tensor_equals_ddp():
    """Two ShardedOptimizers by tensor over one DataParallel (Adam for the generator, SGD
    with momentum for the discriminator), each network frozen while the other steps, as
    Lightning's ``toggle_optimizer`` does: each optimizer keeps its state while its
    parameters are frozen and resumes with it. Oracle: DDP(find_unused_parameters=True) (each
    network goes without gradients in the other's backward) + the same torch optimizers.
    Tolerance 1e-10: float64, the same averaged gradients, each parameter stepped by the
    same torch code on its owner rank; only the all-reduce's summation order may differ."""
    run_ranks(_gan_worker)


def _unfrozen_without_a_slot_worker(rank: int, world_size: int) -> None:
    """A layer frozen when the optimizer was built (in its group: stock would step it once
    unfrozen) has no slot in its flat parameter buffers and no owner: unfrozen, it is
    refused at the step, on every rank, rather than left unstepped."""
    model, _, dp = _small(rank)
    model[0].requires_grad_(False)
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.SGD, model.parameters(), lr=0.1, shard_by="tensor")
    model[0].requires_grad_(True)
    dp(_batch(rank, 0)).square().sum().backward()
    with pytest.raises(RuntimeError, match="unfrozen where they were frozen .* shard by element"):
        opt.step()


def test_a_parameter_frozen_at_construction_and_unfrozen_since_is_refused_by_tensor():
    run_ranks(_unfrozen_without_a_slot_worker)
