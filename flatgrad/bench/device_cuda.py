"""CUDA-only checks: flatgrad's paths on one NCCL rank in this process against a plain stock
model, and every CUDA-specific branch of the library run once with evidence that it ran."""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

import flatgrad
from flatgrad import _bucket_sync
from flatgrad._comm import average_op
from flatgrad.bench.device_base import (
    ROUTE_ALL,
    DeviceRun,
    Outcome,
    device_events,
    profiled,
    single_rank_group,
)
from flatgrad.bench.device_comm import CommNet, batch, flat_dp, paths_outcome, run_paths, stock_plain


def _same(ours: torch.Tensor | None, stock: torch.Tensor | None) -> None:
    """Float64 on both sides: the same sums in another order at most (round-off, 1e-12)."""
    assert ours is not None and stock is not None, "a gradient is missing"
    torch.testing.assert_close(ours, stock, rtol=1e-12, atol=1e-12)


def check_nccl_single_rank(run: DeviceRun) -> Outcome:
    """Every path on one NCCL rank against a plain stock model (world size 1: averaging is
    the identity; the branch is skipped in step 1, so it has no gradient anywhere)."""
    if not run.cuda:
        return skipped_nccl()
    with single_rank_group("nccl", run.device):
        results = run_paths(run.device, oracle=stock_plain)
    return paths_outcome(results, "NCCL world size 1 against a plain stock model")


def skipped_nccl() -> Outcome:
    return Outcome(None, "NCCL needs CUDA; the 2-rank gloo check runs the same paths on CPU")


@contextmanager
def _no_host_sync() -> Iterator[None]:
    """Raise on any call that makes the host wait for the GPU."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _dp_step(device: torch.device, sharded: bool, use_branch: bool) -> tuple[int, int, list[str]]:
    """One steady synchronised backward (profiled) of DataParallel (or ShardedOptimizer):
    (pinned host-to-device copies, pageable ones, parameters left without .grad). The one
    before it learns the bucket order (a broadcast, once). DataParallel's gradients must
    equal a plain stock backward's (ShardedOptimizer's `.grad` are reduce-scattered shards,
    compared by the NCCL paths check after its steps)."""
    torch.manual_seed(0)
    model = CommNet().double().to(device)
    stock, ours = stock_plain(model, device), flat_dp(model, device, sharded=sharded)
    stock.forward(*batch(0, 0, 0, device), use_branch).backward()
    ours.forward(*batch(0, 0, 0, device), use_branch).backward()
    ours.optimizer.zero_grad()
    loss = ours.forward(*batch(0, 0, 0, device), use_branch)
    with profiled(device) as prof:
        loss.backward()
    missing = [n for n, p in zip(dict(model.named_parameters()), ours.params) if p.grad is None]
    for p, q in zip(ours.params, stock.params):
        assert (p.grad is None) == (q.grad is None), "a .grad is None on one side only"
        if q.grad is not None and not sharded:
            _same(p.grad, q.grad)
    copies = [e["name"] for e in device_events(prof) if e.get("cat") == "gpu_memcpy" and "HtoD" in e["name"]]
    return sum("Pinned" in n for n in copies), sum("Pageable" in n for n in copies), missing


def _pinned_flags(run: DeviceRun) -> str:
    pinned, pageable, missing = _dp_step(run.device, sharded=False, use_branch=False)
    assert pinned >= 1 and pageable == 0, f"used flags: {pinned} pinned, {pageable} pageable HtoD copies"
    assert missing == ["branch.weight", "branch.bias"], f"parameters left without .grad: {missing}"
    return f"{pinned} pinned non-blocking HtoD copy of the used flags, 0 pageable; {missing} stay None"


def _pinned_sharded(run: DeviceRun) -> str:
    pinned, pageable, _ = _dp_step(run.device, sharded=True, use_branch=True)
    assert pinned >= 1 and pageable == 0, f"used flags: {pinned} pinned, {pageable} pageable HtoD copies"
    return f"{pinned} pinned non-blocking HtoD copy of the reduce-scatter's used flags, 0 pageable"


def _nccl_average(run: DeviceRun) -> str:
    op, divide = average_op(torch.ones(1, device=run.device), None)
    assert op == dist.ReduceOp.AVG and not divide, f"average_op on NCCL gave {op}, divide first {divide}"
    return "ReduceOp.AVG inside NCCL, no division pass"


def _async_buckets(run: DeviceRun) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]).double().to(run.device)
    stock = copy.deepcopy(model)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model, config=ROUTE_ALL), bucket_cap_mb=0.6)
    x = torch.randn(16, 256, device=run.device, dtype=torch.float64)
    for _ in range(2):  # the first steps set up (expected counts, buffers); the third must not sync
        dp(x).square().mean().backward()
        dp.zero_grad()
    with _no_host_sync():
        dp(x).square().mean().backward()
    stock(x).square().mean().backward()
    for p, q in zip(model.parameters(), stock.parameters()):
        _same(p.grad, q.grad)
    buckets = len(flatgrad.replicate_state(dp).buckets)
    return f"{buckets} buckets launched asynchronously and waited on by stream, no host sync"


def _clip_multiplies(run: DeviceRun) -> str:
    torch.manual_seed(0)
    flat = flatgrad.FlatGrad(nn.Linear(64, 64).to(run.device), config=ROUTE_ALL)
    flat(torch.randn(8, 64, device=run.device)).sum().backward()
    before = [p.grad.clone() for p in flat.parameters() if p.grad is not None]
    with profiled(run.device) as prof:
        flat.clip_grad_norm_(1e9)  # no clipping: coefficient 1, multiplied anyway on CUDA
    muls = sum(e.name == "aten::_foreach_mul_" for e in prof.events())
    assert muls >= 1, "clip_grad_norm_ on CUDA ran no _foreach_mul_"
    for p, b in zip([p for p in flat.parameters() if p.grad is not None], before):
        assert p.grad is not None and torch.equal(p.grad, b), "a coefficient of 1 changed a gradient"
    return f"{muls} _foreach_mul_ by the on-device coefficient (no host read), gradients unchanged"


def _gather_no_sync(run: DeviceRun) -> str:
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(20, generator=gen, dtype=torch.float64).to(run.device).requires_grad_()
    ref = table.detach().clone().requires_grad_()
    idx = torch.randint(-20, 20, (1000,), generator=gen).to(run.device)
    weight = torch.randn(32, 16, generator=gen, dtype=torch.float64).to(run.device).requires_grad_()
    ref_weight = weight.detach().clone().requires_grad_()
    index = torch.randint(0, 16, (32, 4), generator=gen).to(run.device)
    with _no_host_sync():  # no min/max range check read back on the host
        out = flatgrad.gather_with_index_add(table, idx)
        dim_out = flatgrad.gather(weight, 1, index)
    _same(out, ref[idx])
    out.sum().backward()
    ref[idx].sum().backward()
    dim_out.sum().backward()
    torch.gather(ref_weight, 1, index).sum().backward()
    _same(table.grad, ref.grad)
    _same(weight.grad, ref_weight.grad)
    return "negative indices wrapped on device, no host range check; values and grads equal stock"


def _deterministic_gather(run: DeviceRun) -> str:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 32, generator=gen, dtype=torch.float64).to(run.device)
    index = torch.randint(0, 4, (64, 24), generator=gen).to(run.device)  # repeated positions
    ours = _Gathered(weight, flatgrad.gather)
    flat = flatgrad.FlatGrad(ours, config=ROUTE_ALL)
    stock = _Gathered(weight, torch.gather)
    stock(index).sum().backward()  # float64 atomics: order-dependent only at round-off
    torch.use_deterministic_algorithms(True)
    try:
        out = flat(index)
        with profiled(run.device) as prof:
            out.sum().backward()
    finally:
        torch.use_deterministic_algorithms(False)
    names = [e.name for e in prof.events()]
    assert "aten::index_put_" in names, "deterministic flatgrad.gather backward ran no index_put_"
    _same(ours.weight.grad, stock.weight.grad)
    return "index_put_(accumulate=True) instead of atomics under deterministic algorithms; grads equal"


class _Gathered(nn.Module):
    def __init__(self, weight: torch.Tensor, read: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone())
        self.read = read

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return self.read(self.weight, 1, index)


def _moved_after_wrapping(run: DeviceRun) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8)).double()
    stock = copy.deepcopy(model).to(run.device)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL).to(run.device)
    x = torch.randn(4, 32, dtype=torch.float64, device=run.device)
    flat(x).sum().backward()
    stock(x).sum().backward()
    keys = list(flat.grad_buffers)
    assert all(device.type == "cuda" for _, device in keys), f"grad buffers after .to(cuda): {keys}"
    for p, q in zip(flat.parameters(), stock.parameters()):
        _same(p.grad, q.grad)
    return f"grad buffers {[str(d) for _, d in keys]}; grads equal stock"


def _freq_counts_no_sync(run: DeviceRun) -> str:
    torch.manual_seed(0)
    emb = nn.Embedding(50, 8, padding_idx=3, scale_grad_by_freq=True).double().to(run.device)
    stock = copy.deepcopy(emb)
    flat = flatgrad.FlatGrad(emb, config=ROUTE_ALL)
    idx = torch.randint(0, 50, (16, 12), generator=torch.Generator().manual_seed(0)).to(run.device)
    flat(idx).square().sum().backward()  # (the first backward lays out; the second must not sync)
    flat.zero_grad()
    with _no_host_sync():  # torch.bincount would read index.max() back
        flat(idx).square().sum().backward()
    stock(idx).square().sum().backward()
    _same(emb.weight.grad, stock.weight.grad)
    return "scale_grad_by_freq: rows counted by an int64 scatter-add on the GPU, no host sync; equals stock"


def _wire_on_a_side_stream(run: DeviceRun) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(3)]).to(run.device)
    stock = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    dp = flatgrad.replicate(flat, bucket_cap_mb=0.1, reduce_dtype=torch.bfloat16, check_finite=True)
    x = torch.randn(16, 128, device=run.device)
    marked: list[torch.Tensor] = []
    waited: list[bool] = []
    follow = _bucket_sync.Round._follow_backward

    def spy(round_: _bucket_sync.Round, device: torch.device) -> bool:
        waited.append(follow(round_, device))
        return waited[-1]

    side, main = torch.cuda.Stream(run.device), torch.cuda.current_stream(run.device)
    side.wait_stream(main)  # (built on the default stream, trained on the side one)
    with (
        torch.cuda.stream(side),
        mock.patch.object(_bucket_sync, "read_here", side_effect=_bucket_sync.read_here),
        mock.patch.object(_bucket_sync.Round, "_follow_backward", spy),
    ):
        for _ in range(2):
            dp.zero_grad()
            dp(x).square().mean().backward()
        marked = [call.args[0] for call in _bucket_sync.read_here.call_args_list]  # type: ignore[attr-defined]
    main.wait_stream(side)
    assert any(waited), "no bucket launch waited for the backward's stream"
    stock(x).square().mean().backward()
    for p, q in zip(model.parameters(), stock.parameters()):  # (world size 1: bfloat16 wire only)
        torch.testing.assert_close(p.grad, q.grad, rtol=2**-7, atol=1e-6)
    wires = sum(t.dtype == torch.bfloat16 for t in marked)
    num_buckets = len(flatgrad.replicate_state(dp).buckets)
    assert wires >= 2 * num_buckets, f"{wires} bfloat16 wire tensors marked for {num_buckets} buckets"
    flags, follows = len(marked) - wires, sum(waited)
    return (
        f"trained on a side stream: {follows} of {len(waited)} launches waited for it first; "
        f"{wires} bf16 wire and {flags} finite-flag tensors marked as read by it"
    )


# (where in flatgrad, what the CUDA branch does, the function that runs it and shows it ran)
BRANCHES: tuple[tuple[str, str, Callable[[DeviceRun], str]], ...] = (
    ("buffer.host_tensor via GradStore.flagged", "pinned staging, non_blocking copy", _pinned_flags),
    ("buffer.host_tensor via Round.sync_all", "pinned staging under reduce-scatter", _pinned_sharded),
    ("comm.settle_unused", "reads the used flags back from the GPU", _pinned_flags),
    ("comm.average_op", "ReduceOp.AVG on NCCL", _nccl_average),
    ("parallel: async NCCL buckets, Work.wait in the final callback", "stream waits", _async_buckets),
    ("buffer.scale_", "always multiplies on accelerators", _clip_multiplies),
    ("functional._has_negative, functional.out_of_range", "no host range check on CUDA", _gather_no_sync),
    ("functional.scatter_add_into", "deterministic index_put_ path on CUDA", _deterministic_gather),
    ("wrapper: .to(cuda) after wrapping", "buffers rebuilt on the GPU", _moved_after_wrapping),
    ("functional._read_counts", "scale_grad_by_freq counts without a host sync", _freq_counts_no_sync),
    ("Round._follow_backward, buffer.read_here", "trained on another stream", _wire_on_a_side_stream),
)


def check_cuda_branches(run: DeviceRun) -> Outcome:
    """Run every entry of `BRANCHES` (one NCCL rank in this process); each failure is
    reported with its error, the others still run."""
    if not run.cuda:
        names = "; ".join(f"{where} ({what})" for where, what, _ in BRANCHES)
        return Outcome(None, f"CUDA-only branches, not reachable on CPU: {names}")
    lines, ok = [], True
    with single_rank_group("nccl", run.device):
        for where, what, show in BRANCHES:
            try:
                lines.append(f"ok {where} ({what}): {show(run)}")
            except Exception as error:  # one branch failing must not hide the others
                ok = False
                tail = "".join(traceback.format_exception_only(type(error), error)).strip()
                lines.append(f"FAILED {where} ({what}): {tail}")
    return Outcome(ok, "; ".join(lines))
