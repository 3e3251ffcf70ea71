"""`flatgrad.ReplicateModule`'s overlap when gradients become final in another order than the
buffer's, and when parameters go unused: the launch order learned in the first synchronised
backward (rank 0's, on every rank) and the parameters a backward will not reach, counted
ready at its start. On 2 gloo ranks.

Oracle: DDP(find_unused_parameters=True) on a deep copy stepping the same optimizer (stock
autograd averaged by hand where DDP cannot follow). float64: both sides sum the same per-rank
gradients divided by the world size, so they agree to round-off (1e-10 after several steps).

Overlap is asserted by how many buckets were launched when the backward reached the
embedding, its last node (`_Probe`: deterministic), and by when the first bucket launched
against the backward's length (the blocks' matmuls dominate it by far).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from dist_utils import run_ranks
from oracle import Lockstep, assert_grads_like, assert_params_like, stock
from torch import nn

import flatgrad
from flatgrad import replicate_state
from flatgrad._bucket_sync import plan_buckets
from flatgrad._buffer import GradStore
from flatgrad._comm import cores_to_spare

pytestmark = pytest.mark.distributed

TOL = {"rtol": 1e-10, "atol": 1e-10}
BUCKET_MB = 0.01  # about 1300 float64 elements: a bucket or so per weight, many in all
VOCAB, DIM = 32, 64


class _Probe:
    """Counts the buckets `dp` had launched when the backward reached the embedding's output
    (every gradient but the embedding's final by then)."""

    def __init__(self) -> None:
        self.dp: flatgrad.ReplicateModule | None = None
        self.launched: list[int] = []

    def watch(self, h: torch.Tensor) -> None:
        if self.dp is not None and h.requires_grad:
            dp = self.dp
            h.register_hook(lambda grad: self.launched.append(len(replicate_state(dp).launch_offsets_s)))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(torch.tanh(self.fc1(self.norm(h))))


class _LM(nn.Module):
    """Tied embedding and head, four blocks and a branch used on some steps only, registered
    in the order they run (the buffer's order is backward's); `checkpoint` runs the blocks
    under reentrant activation checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.probe, self.mid = _Probe(), _Probe()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.branch = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.double()

    def forward(
        self, tokens: torch.Tensor, use_branch: bool = True, checkpoint: bool = False
    ) -> torch.Tensor:
        h = self.emb(tokens)
        self.probe.watch(h)
        for index, block in enumerate(self.blocks):
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=True) if checkpoint else block(h)
            if index == 1:
                self.mid.watch(h)  # the backward's middle: blocks 3 and 2 behind it, 1 and 0 ahead
        if use_branch:
            h = h + self.branch(h)
        logits = self.head(h)
        self.aux = logits.square().mean()  # an auxiliary loss, reaching what the loss reaches
        return F.cross_entropy(logits.flatten(0, 1), tokens.flatten())


class _Reordered(nn.Module):
    """Registered head, branch, blocks, embedding; run embedding, blocks, branch, head: the
    buffer (the reverse of registration) starts with the embedding, whose gradient is the
    backward's last."""

    def __init__(self) -> None:
        super().__init__()
        self.probe, self.mid = _Probe(), _Probe()
        self.head = nn.Linear(DIM, VOCAB)
        self.branch = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.emb = nn.Embedding(VOCAB, DIM)
        self.double()

    def forward(self, tokens: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = self.emb(tokens)
        self.probe.watch(h)
        for index, block in enumerate(self.blocks):
            h = block(h)
            if index == 1:
                self.mid.watch(h)
        if use_branch:
            h = h + self.branch(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), tokens.flatten())


class _Swapped(nn.Module):
    """Two blocks run in either order, and a branch: ranks that run them differently see
    their gradients become final in different orders."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.a, self.b = _Block(), _Block()
        self.branch = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.double()

    def forward(self, tokens: torch.Tensor, swap: bool, use_branch: bool) -> torch.Tensor:
        h = self.emb(tokens)
        h = self.a(self.b(h)) if swap else self.b(self.a(h))
        if use_branch:
            h = h + self.branch(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), tokens.flatten())


def _tokens(rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, VOCAB, (8, 64), generator=gen)


def _assert_close(ours: nn.Module, ref: nn.Module, what: str) -> None:
    """Parameters, and `.grad` with their None-ness, equal the oracle's (by name)."""
    assert_params_like(ours, ref, **TOL, what=what)
    assert_grads_like(ours, ref, **TOL, what=f"{what} grad")


def _assert_overlapped(dp: flatgrad.ReplicateModule, model: nn.Module, what: str) -> None:
    """Half the buckets or more launched before the backward's last node, and the first one
    within the backward's first half: counted when the backward reaches the embedding's
    output and the middle block's (positions in the backward, not timings, which a loaded
    machine stretches)."""
    num_buckets = len(replicate_state(dp).buckets)
    probe, mid = model.probe.launched[-1], model.mid.launched[-1]  # type: ignore[union-attr]
    assert probe >= num_buckets / 2, f"{what}: {probe} of {num_buckets} launched"
    assert (
        sum(t < replicate_state(dp).backward_s for t in replicate_state(dp).launch_offsets_s)
        >= num_buckets / 2
    ), what
    assert mid >= 1, f"{what}: no bucket launched in the backward's first half"


# Whether each rank runs the branch, per step: unused on rank 0 in the first (learning)
# step, on rank 1 in the second, on both in the third, used, then unused on one or both.
_BRANCH = [(False, True), (True, False), (False, False), (True, True), (True, False), (False, False)]


def _unused_and_reordered_worker(rank: int, world_size: int, build: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model = build()
    ref, ref_opt = stock(model, torch.optim.SGD, {"find_unused_parameters": True}, lr=0.1, momentum=0.9)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model), bucket_cap_mb=BUCKET_MB)
    model.probe.dp = model.mid.dp = dp  # type: ignore[union-attr]
    assert len(replicate_state(dp).buckets) >= 10
    pair = Lockstep(model, dp, torch.optim.SGD(dp.parameters(), lr=0.1, momentum=0.9), ref, ref_opt)
    for step, used in enumerate(_BRANCH):
        pair.zero_grad()
        pair.backward(_tokens(rank, step), used[rank])
        _assert_close(model, ref.module, f"step {step}")
        if step >= 2:
            _assert_overlapped(dp, model, f"step {step}")
        pair.step()
    _assert_close(model, ref.module, "final")


@pytest.mark.parametrize("build", [_LM, _Reordered], ids=["unused_branch", "reordered"])
def test_buckets_launch_during_backward_with_unused_or_reordered_parameters_as_ddp(build):
    """A branch unused on one rank or on both does not hold back the buckets after it, and
    a model registered in another order than it runs launches its buckets while backward
    goes on, from the third step (the first teaches the order, the second shows the unused
    parameters to the ranks that had not seen them); parameters equal DDP's throughout."""
    run_ranks(_unused_and_reordered_worker, build, timeout=240)


def _launch_order(dp: flatgrad.ReplicateModule) -> list[int]:
    """Where each bucket starts in its (one) flat buffer, in launch order."""
    start = min(int(bucket.storage_offset()) for bucket in replicate_state(dp).buckets)
    return [int(bucket.storage_offset()) - start for bucket in replicate_state(dp).buckets]


def _swapped_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = _Swapped()
    ref, ref_opt = stock(model, torch.optim.AdamW, {"find_unused_parameters": True}, lr=0.01)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model), bucket_cap_mb=BUCKET_MB)
    pair = Lockstep(model, dp, torch.optim.AdamW(dp.parameters(), lr=0.01), ref, ref_opt)
    buffer_order = _launch_order(dp)
    for step in range(5):
        swap, use_branch = rank == 1, rank == 1 or step == 3  # rank 0 skips the branch but once
        pair.zero_grad()
        pair.backward(_tokens(rank, step), swap, use_branch)
        _assert_close(model, ref.module, f"step {step}")
        pair.step()
        orders: list[list[int]] = [[] for _ in range(world_size)]
        dist.all_gather_object(orders, _launch_order(dp))
        assert orders[0] == orders[1], f"step {step}: the ranks launch in different orders {orders}"
        assert orders[0] != buffer_order, "rank 0's order is learned (the branch it skips goes last)"
    _assert_close(model, ref.module, "final")


def test_ranks_whose_gradients_become_final_in_other_orders_launch_in_rank_0s_order():
    """Rank 1 runs the blocks in the other order and a branch rank 0 skips: every rank
    launches in rank 0's learned order (no hang), and parameters equal DDP's."""
    run_ranks(_swapped_worker, timeout=240)


def _manual_average(module: nn.Module) -> None:
    for q in module.parameters():
        if q.grad is not None:
            dist.all_reduce(q.grad)
            q.grad.div_(dist.get_world_size())


def _assert_grads_match(ours: nn.Module, ref: nn.Module, what: str) -> None:
    """`.grad` None-ness and values equal the oracle's (float32 ones to float32 round-off)."""
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), f"{what} {name}"
        if q.grad is not None:
            tol = TOL if q.dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
            torch.testing.assert_close(p.grad, q.grad, **tol, msg=lambda m, n=f"{what} {name}": f"{n}: {m}")


def _rebuild_worker(rank: int, world_size: int) -> None:
    """Oracle: stock autograd on a copy changed the same way, averaged by one all-reduce per
    gradient (DDP's reducer keeps the buckets it was built with)."""
    torch.manual_seed(0)
    model = _Reordered()
    ref = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model)
    dp = flatgrad.replicate(flat, bucket_cap_mb=BUCKET_MB)
    model.probe.dp = dp
    learning = True  # the first backward, and the first after each rebuild
    for step, change in enumerate(["", "", "freeze", "", "float", "double", ""]):
        for module in (model, ref):
            if change == "freeze":  # fewer slots: the buckets are cut again
                module.blocks[1].fc1.requires_grad_(False)
            elif change:
                getattr(module, change)()
        dp.zero_grad()
        ref.zero_grad()
        dp(_tokens(rank, step)).backward()
        ref(_tokens(rank, step)).backward()
        _manual_average(ref)
        _assert_grads_match(model, ref, f"step {step}")
        if learning or change:  # it launches in buffer order: nothing before the embedding's gradient
            assert model.probe.launched[-1] == 0, f"step {step}"
        else:
            assert model.probe.launched[-1] >= len(replicate_state(dp).buckets) / 2, (
                f"step {step}: not re-learned"
            )
        learning = False
        with torch.no_grad():
            for p, q in zip(model.parameters(), ref.parameters()):
                if p.grad is not None:
                    p.sub_(0.1 * p.grad)
                    q.sub_(0.1 * q.grad)


def test_a_rebuild_learns_the_launch_order_again():
    """Freezing a layer (other buckets) and converting to float32 and back (new buffers)
    lay the buffers out again: the next synchronised backward launches in buffer order and
    teaches the order anew, and the one after overlaps again; gradients equal the oracle's."""
    run_ranks(_rebuild_worker, timeout=240)


def _checkpointed_worker(rank: int, world_size: int) -> None:
    """Oracle: stock autograd averaged by hand (DDP with find_unused_parameters=True refuses
    reentrant checkpoints); the branch's use is the same on both ranks."""
    torch.manual_seed(0)
    model = _LM()
    ref = copy.deepcopy(model)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model), bucket_cap_mb=BUCKET_MB)
    for step, use_branch in enumerate([True, False, True, False]):
        dp.zero_grad()
        ref.zero_grad()
        dp(_tokens(rank, step), use_branch, True).backward()
        ref(_tokens(rank, step), use_branch, True).backward()
        _manual_average(ref)
        _assert_grads_match(model, ref, f"step {step}")


def test_parameters_reached_only_by_a_reentrant_checkpoint_are_not_counted_unused():
    """The blocks' parameters run only in the nested backwards of reentrant checkpoints
    (the engine cannot see them from the backward's start): a model that has shown an
    unused branch counts only that branch ready early, and the blocks' gradients are
    averaged as they arrive."""
    run_ranks(_checkpointed_worker, timeout=240)


def _aux_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = _LM()
    ref, ref_opt = stock(model, torch.optim.SGD, {"find_unused_parameters": True}, lr=0.1, momentum=0.9)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model), bucket_cap_mb=BUCKET_MB)
    pair = Lockstep(model, dp, torch.optim.SGD(dp.parameters(), lr=0.1, momentum=0.9), ref, ref_opt)
    # (loss backwarded, whether each rank runs the branch): the branch unused on both ranks
    # first, then the auxiliary loss alone, which reaches none of dp's outputs.
    steps = [
        ("main", (True, False)),
        ("main", (False, False)),
        ("aux", (False, True)),
        ("aux", (False, False)),
    ]
    for step, (which, used) in enumerate([*steps, ("main", (False, False))]):
        pair.zero_grad()
        for module, inner in ((dp, model), (ref, ref.module)):
            loss = module(_tokens(rank, step), used[rank])
            (inner.aux if which == "aux" else loss).backward()
        _assert_close(model, ref.module, f"step {step} {which}")
        pair.step()


def test_a_backward_opened_by_a_parameters_hook_counts_no_parameter_ready_early():
    """A model that has shown an unused branch, then an auxiliary loss backwarded alone (the
    first AccumulateGrad hook opens that backward, so nothing is counted ready before its
    own hook runs): gradients and parameters equal DDP's, with the branch unused on one rank
    and on both."""
    run_ranks(_aux_worker, timeout=240)


def _sharded_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = _Reordered()
    ref, ref_opt = stock(model, torch.optim.AdamW, {"find_unused_parameters": True}, lr=0.01)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model), bucket_cap_mb=BUCKET_MB)
    pair = Lockstep(model, dp, flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, lr=0.01), ref, ref_opt)
    # A parameter no rank used is stepped with a zero gradient by a ShardedOptimizer (its
    # shard holds others), skipped under DDP: here some rank uses the branch in every step.
    for step, used in enumerate([(False, True), (True, False), (True, True), (True, False), (False, True)]):
        pair.backward(_tokens(rank, step), used[rank])
        pair.step()
        pair.zero_grad()
        pair.assert_params(**TOL, what=f"step {step}")


def test_a_sharded_optimizer_steps_as_ddp_whatever_order_the_buckets_launch_in():
    """Reduce-scatter in the learned order: each bucket's shard is still this rank's piece
    of that bucket, and the parameters equal DDP's with AdamW after every step."""
    run_ranks(_sharded_worker, timeout=240)


@pytest.mark.parametrize(
    ("threads", "local_ranks", "cores", "spare"),
    [(1, 2, 2, False), (2, 2, 2, False), (1, 2, 4, True), (4, 4, 16, False), (1, 4, 16, True)],
)
def test_cores_to_spare_counts_the_threads_of_every_rank_on_the_host(
    monkeypatch: pytest.MonkeyPatch, threads: int, local_ranks: int, cores: int, spare: bool
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert cores_to_spare(None) is spare


def test_a_cpu_buffer_without_a_spare_core_gets_a_first_bucket_of_half_a_bucket() -> None:
    """Without a spare core an early 1 MiB bucket costs gloo more than it hides: the first
    bucket is half a bucket, never below 1 MiB (a buffer up to that is one bucket); with
    one, DDP's 1 MiB. Buckets stay whole slots."""
    store = GradStore([nn.Parameter(torch.zeros(1 << 16)) for _ in range(12)], 256)  # 256 KiB each

    def sizes(bucket_cap_mb: float, small_first: bool) -> list[int]:
        return [len(bucket.params) for bucket in plan_buckets(store, bucket_cap_mb, small_first).buckets]

    assert sizes(4.0, True) == [4, 8]  # 1 MiB first (as DDP), then up to 4 MiB
    assert sizes(4.0, False) == [8, 4]  # 2 MiB first
    assert sizes(8.0, False) == [12]  # 3 MiB: below half a bucket, one
    assert sizes(8.0, True) == [4, 8]
    assert sizes(1.0, False) == sizes(1.0, True) == [4, 4, 4]  # (half of 1 MiB: still 1 MiB)
    assert sizes(0.5, False) == [2] * 6  # (below 1 MiB: the bucket size, as DDP's)
