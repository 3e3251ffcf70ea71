"""flatgrad on a CUDA device (`pytest -m gpu`): what the CPU tests assert, run there, and every
CUDA-only branch of the library run once with evidence that it ran. Each device-parametrized
test also runs on CPU, so the test code itself is exercised without a GPU.

Oracles: stock PyTorch on a deep copy (float64 where the sums are exact up to their order),
the profiler's record of what a backward ran (ops, kernels, memory copies), and
`torch.cuda.set_sync_debug_mode("error")`, which raises on any call that makes the host wait.
Covered elsewhere and not repeated here: `.to("cuda")` after applying FlatGrad (test_flatgrad),
DataParallel's asynchronous buckets without a host sync (test_parallel), the deterministic
gather (test_gather), main grads against both oracles (test_main_grad) and ShardedOptimizer
over NCCL against float32 masters (test_mixed_precision), gloo ranks on one GPU (test_parallel).
"""

from __future__ import annotations

import contextlib
import copy
import json
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import ROUTE_ALL, grad_in_buffers
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import flatgrad
from flatgrad import _bucket_sync
from flatgrad._comm import average_op
from flatgrad._functional import fused_accumulate
from flatgrad.bench.counters import COPY_OPS
from flatgrad.bench.suite import single_rank_group

HAS_CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]
DEVICES = ["cpu", pytest.param("cuda", marks=gpu)]
# CPU ops of a sorting backward: index_put_(accumulate=True) (weight[idx]) and explicit sorts.
SORT_OPS = frozenset({"aten::sort", "aten::argsort", "aten::_index_put_impl_"})


def cuda_only(test: Callable[..., None]) -> Callable[..., None]:
    for mark in reversed(gpu):
        test = mark(test)
    return test


class CheckLM(nn.Module):
    """A tied-embedding LM: the LM head shares the token embedding's weight, the MLP block is
    activation-checkpointed (use_reentrant=False), and `unused` is never called (its
    parameters get no gradient). Shapes keep activations from matching any weight's."""

    def __init__(self, vocab: int = 96, dim: int = 32) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.block = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.mix = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.unused = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx)
        x = x + checkpoint(self.block, x, use_reentrant=False)
        x = x + torch.tanh(self.mix(x))
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def lm_batches(count: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` different (tokens, targets) micro-batches of shape (3, 10)."""
    gen = torch.Generator().manual_seed(7)
    idx = [torch.randint(0, 96, (3, 11), generator=gen) for _ in range(count)]
    return [(i[:, :-1].to(device), i[:, 1:].to(device)) for i in idx]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("dtype", "autocast", "rtol"),
    [
        # the same sums, possibly in another order: round-off
        (torch.float64, False, 1e-12),
        # both sides round GEMM inputs and outputs to bfloat16 (2^-8 relative), flatgrad
        # accumulating in other places: a few roundings over 3 micro-batches stay under 2^-5
        (torch.float32, True, 2**-5),
    ],
    ids=["float64", "bf16-autocast"],
)
def test_a_tied_checkpointed_lm_with_an_unused_branch_matches_stock(device, dtype, autocast, rtol):
    torch.manual_seed(0)
    stock = CheckLM().to(device, dtype)
    flat = flatgrad.FlatGrad(copy.deepcopy(stock), config=ROUTE_ALL)
    batches = lm_batches(3, device)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        computed = stock.mix(stock.tokens(batches[0][0])).dtype
    assert computed == (torch.bfloat16 if autocast else dtype), (
        "the test's premise: autocast computes in bf16"
    )
    for module in (stock, flat):
        for batch in batches:
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                loss = module(*batch)
            loss.backward()
    ours = dict(flat.named_parameters())
    for name, ref in stock.named_parameters():
        grad = ours[name].grad
        if name.startswith("unused."):
            assert ref.grad is None and grad is None, f"{name}: .grad must stay None, as stock's"
            continue
        assert ref.grad is not None and grad is not None and grad_in_buffers(flat, grad), name
        error = float((grad - ref.grad).abs().max()) / (float(ref.grad.abs().max()) or 1.0)
        assert error <= rtol, f"{name}: max |flatgrad - stock| / max |stock| = {error:.3g}"


def device_events(prof: torch.profiler.profile) -> list[dict[str, Any]]:
    """The kernels and memory copies of a CUDA profile (chrome trace events: name, cat, args)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return [e for e in trace.get("traceEvents", []) if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


@contextlib.contextmanager
def profiled(device: str, **kwargs: Any) -> Iterator[torch.profiler.profile]:
    """CPU ops (and CUDA kernels on CUDA), synchronised before the profiler stops; with a
    process group, after a barrier (a gloo work ends its profiler event after completing its
    future: a profiler stopped in between can corrupt the heap)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, **kwargs) as prof:
        yield prof
        if device == "cuda":
            torch.cuda.synchronize()
        if dist.is_initialized():
            dist.barrier()


def profile_backward(loss: torch.Tensor, device: str) -> tuple[list[tuple[str, list]], list[dict[str, Any]]]:
    """One profiled backward: CPU ops as (name, input shapes), and on CUDA its device events."""
    with profiled(device, record_shapes=True) as prof:
        loss.backward(torch.ones_like(loss))
    ops = [(e.name, [tuple(s) for s in e.input_shapes if s]) for e in prof.events()]
    kernels = device_events(prof) if device == "cuda" else []
    # (a profiler that delivered no device activity would pass every "no such kernel" check)
    assert device == "cpu" or any(k.get("cat") == "kernel" for k in kernels), "no CUDA kernel recorded"
    return ops, kernels


def dtod_copies(kernels: list[dict[str, Any]], min_bytes: int) -> list[str]:
    return [
        k["name"]
        for k in kernels
        if k.get("cat") == "gpu_memcpy"
        and "DtoD" in k["name"]
        and k.get("args", {}).get("bytes", 0) >= min_bytes
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_backward_copies_no_weight_sized_gradient(device):
    """Fresh slots, then accumulating: no copy/clone/add/mul op on a weight-shaped tensor but,
    accumulating, the tied table's two uses summed before they are added in, as stock's
    (autograd's add and AccumulateGrad's); on CUDA also no device-to-device memcpy of the
    smallest weight gradient's bytes."""
    torch.manual_seed(0)
    model = CheckLM().to(device)
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() >= 2}
    table = tuple(model.tokens.weight.shape)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    smallest = min(torch.Size(s).numel() for s in shapes) * 4  # float32 bytes
    for accumulating, batch in enumerate(lm_batches(2, device)):
        ops, kernels = profile_backward(flat(*batch), device)
        copies = [(n, ss) for n, ss in ops if n in COPY_OPS and any(s in shapes for s in ss)]
        assert copies == [("aten::add_", [table, table])] * 2 * accumulating
        assert dtod_copies(kernels, smallest) == []


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("align_bytes", [4, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_slot_off_fresh_memorys_alignment_gets_stocks_bits(device, align_bytes, dtype):
    """Slots packed 4 bytes apart (`align_bytes=4`, as DDP's bucket packs them): a GEMM into
    memory off a fresh tensor's alignment may block its sums otherwise (an AVX-512 CPU does;
    cuBLASLt picks its kernel by the pointers' alignment), so such a slot gets the product
    fresh and copied; the bits equal stock's either way."""
    torch.manual_seed(0)
    # odd sizes: every slot after the first starts off a 16-byte boundary
    model = nn.Sequential(nn.Linear(37, 61), nn.Tanh(), nn.Linear(61, 3), nn.Tanh(), nn.Linear(3, 29))
    model = model.to(device, dtype)
    oracle = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(
        model, config=flatgrad.FlatGradConfig(linear_min_numel=0, align_bytes=align_bytes)
    )
    x = torch.randn(300, 37, dtype=dtype, device=device)
    flat(x).square().sum().backward()
    oracle(x).square().sum().backward()
    bits = torch.int32 if dtype == torch.float32 else torch.int64
    offsets = {p.grad.data_ptr() % 64 for p in flat.parameters()}
    assert (offsets == {0}) == (align_bytes == 256)
    for p, q in zip(flat.parameters(), oracle.parameters()):
        assert grad_in_buffers(flat, p.grad)
        assert torch.equal(p.grad.view(bits), q.grad.view(bits))


@pytest.mark.parametrize("device", DEVICES)
def test_the_copy_check_sees_stock_accumulating(device):
    """The plain model's second backward adds each weight's gradient into its `.grad`: the
    check above can fail."""
    torch.manual_seed(0)
    model = CheckLM().to(device)
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() >= 2}
    found = []
    for batch in lm_batches(2, device):
        ops, _ = profile_backward(model(*batch), device)
        found = [(n, ss) for n, ss in ops if n in COPY_OPS and any(s in shapes for s in ss)]
    assert found


class Rows(nn.Module):
    """A parameter read through `read(weight, index)`."""

    def __init__(self, weight: torch.Tensor, read: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        super().__init__()
        self.weight = nn.Parameter(weight.clone())
        self.read = read

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return self.read(self.weight, index)


def _routed_read(case: str, device: str) -> tuple[nn.Module, torch.Tensor]:
    """A routed module reading a table the way `case` says, and its index (sizes at which
    stock's CUDA backward sorts: tens of thousands of rows, indices)."""
    rows, dim, tokens = (32768, 256, 16384) if device == "cuda" else (4096, 64, 8192)
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(rows, dim, generator=gen).to(device)
    if case == "nn.Embedding":
        index = torch.randint(0, rows, (tokens,), generator=gen)
        module: nn.Module = nn.Embedding.from_pretrained(table, freeze=False)
    elif case == "gather_with_index_add":
        index = torch.randint(0, rows * dim, (tokens * 4,), generator=gen)
        module = Rows(table.flatten(), flatgrad.gather_with_index_add)
    else:
        index = torch.randint(0, dim, (rows, dim // 4), generator=gen)
        module = Rows(table, lambda w, i: flatgrad.gather(w, 1, i))
    return flatgrad.FlatGrad(module, config=ROUTE_ALL), index.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["nn.Embedding", "gather_with_index_add", "flatgrad.gather"])
def test_a_routed_backward_does_not_sort(device, case):
    """No sort op (nor weight[idx]'s index_put_) in the backward; on CUDA no radix-sort kernel."""
    module, index = _routed_read(case, device)
    ops, kernels = profile_backward(module(index), device)
    assert [n for n, _ in ops if n in SORT_OPS] == []
    assert [k["name"] for k in kernels if "radix" in k["name"].lower() or "sort" in k["name"].lower()] == []


@pytest.mark.parametrize("device", DEVICES)
def test_the_sort_check_sees_stock_index_put(device):
    """weight[idx] backward is index_put_(accumulate=True), which sorts the indices (on CUDA
    with a radix-sort kernel): the checks above can fail."""
    weight = torch.randn(50, 4, device=device, requires_grad=True)
    ops, kernels = profile_backward(weight[torch.randint(0, 50, (200,), device=device)], device)
    assert [n for n, _ in ops if n in SORT_OPS]
    assert device == "cpu" or [k["name"] for k in kernels if "radix" in k["name"].lower()]


# --- one rank in this process: every data-parallel path against a plain model ------------------

STEPS, MICRO_BATCHES, LR, MAX_NORM = 3, 2, 0.05, 0.5


class CommNet(nn.Module):
    """Embedding, two Linears and a `branch` a forward may skip (no gradient that step)."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(64, 16)
        self.fc = nn.Linear(16, 24)
        self.branch = nn.Linear(24, 24)
        self.out = nn.Linear(24, 64, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = torch.tanh(self.fc(self.tokens(idx)))
        if use_branch:
            h = h + self.branch(h)
        return F.cross_entropy(self.out(h).flatten(0, 1), targets.flatten())


def comm_batch(step: int, micro: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(10 * step + micro))
    return idx[:, :-1].to(device), idx[:, 1:].to(device)


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def _path(name: str, model: nn.Module, device: str) -> dict[str, Any]:
    """flatgrad's data-parallel path `name` on a deep copy of `model`: forward, optimizer,
    clip, no_sync, what follows the backwards, and flatgrad's buffers."""
    flat = flatgrad.FlatGrad(copy.deepcopy(model), config=ROUTE_ALL)
    path: dict[str, Any] = {"forward": flat, "clip": flat.clip_grad_norm_, "no_sync": contextlib.nullcontext}
    path.update(params=list(flat.parameters()), after=lambda: None, buffers=len(flat.grad_buffers))
    if name == "all_reduce_grads":
        path["after"] = flat.all_reduce_grads
    elif name == "DDP + allreduce_hook":
        ddp = DDP(flat, device_ids=[0] if device == "cuda" else None, **flat.ddp_kwargs())
        ddp.register_comm_hook(flat.comm_state(), flatgrad.allreduce_hook)
        path.update(forward=ddp, no_sync=ddp.no_sync)
    else:  # several buckets: launched during backward
        dp = flatgrad.replicate(flat, bucket_cap_mb=0.002)
        path.update(forward=dp, no_sync=dp.no_sync)
        if name.startswith("ShardedOptimizer"):
            by = "tensor" if name.endswith("by tensor") else "element"
            opt = flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, lr=LR, weight_decay=0.1, shard_by=by)
            path.update(optimizer=opt, clip=opt.clip_grad_norm_)
    path.setdefault("optimizer", _adamw(path["params"]))
    return path


def _train(path: dict[str, Any], device: str, step: int, use_branch: bool) -> None:
    path["optimizer"].zero_grad()
    for micro in range(MICRO_BATCHES):
        last = micro == MICRO_BATCHES - 1
        with contextlib.nullcontext() if last else path["no_sync"]():
            path["forward"](*comm_batch(step, micro, device), use_branch).backward()
    path["after"]()
    path["clip"](MAX_NORM)
    path["optimizer"].step()


# (name, whether step 1 may skip the branch: a ShardedOptimizer by element steps a whole
# shard, so a parameter unused everywhere moves where stock skips it; DDP without
# find_unused_parameters needs every parameter used)
PATHS = [
    ("DataParallel", True),
    ("ShardedOptimizer", False),
    ("ShardedOptimizer by tensor", True),
    ("all_reduce_grads", True),
    ("DDP + allreduce_hook", False),
]


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=gpu)], ids=["gloo-cpu", "nccl-cuda"])
@pytest.mark.parametrize(("name", "skip_branch"), PATHS, ids=[p[0] for p in PATHS])
def test_one_rank_trains_every_path_as_the_plain_model(backend, name, skip_branch):
    """World size 1 (averaging is the identity): 3 AdamW steps of 2 micro-batches with
    clipping, float64, against a plain stock model; the branch unused in step 1 where the
    path allows. Under the DDP hook, one all-reduce per gradient buffer per step."""
    device = "cuda" if backend == "nccl" else "cpu"
    torch.manual_seed(0)
    model = CommNet().double().to(device)
    stock = copy.deepcopy(model)
    stock_opt = _adamw(stock.parameters())
    with single_rank_group(backend, torch.device(device, 0) if device == "cuda" else torch.device("cpu")):
        path = _path(name, model, device)
        for step in range(STEPS):
            use_branch = not (skip_branch and step == 1)
            stock_opt.zero_grad()
            for micro in range(MICRO_BATCHES):
                stock(*comm_batch(step, micro, device), use_branch).backward()
            torch.nn.utils.clip_grad_norm_(stock.parameters(), MAX_NORM)
            stock_opt.step()
            with profiled(device) as prof:
                _train(path, device, step, use_branch)
            if name == "DDP + allreduce_hook":
                allreduces = sum(e.name == "c10d::allreduce_" for e in prof.events())
                assert allreduces == path["buffers"], f"step {step}: {allreduces} all-reduces"
        params = path["params"]
        del path  # (a DDP's reducer goes while its group exists: `single_rank_group` collects)
    for p, q in zip(params, stock.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-10)


# --- CUDA-only branches ---------------------------------------------------------------------


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Raise on any call that makes the host wait for the GPU."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@contextlib.contextmanager
def nccl_rank() -> Iterator[None]:
    with single_rank_group("nccl", torch.device("cuda", 0)):
        yield


def _same(ours: torch.Tensor | None, stock: torch.Tensor | None) -> None:
    """Float64 on both sides: the same sums in another order at most (round-off, 1e-12)."""
    assert ours is not None and stock is not None, "a gradient is missing"
    torch.testing.assert_close(ours, stock, rtol=1e-12, atol=1e-12)


def _pinned_flag_copies(sharded: bool, use_branch: bool) -> tuple[int, int, list[str]]:
    """One steady synchronised backward (profiled) of DataParallel (or ShardedOptimizer)
    on NCCL: (pinned host-to-device copies, pageable ones, parameters left without .grad).
    The one before it learns the bucket order. DataParallel's gradients must equal a plain
    stock backward's (ShardedOptimizer's `.grad` are shards)."""
    torch.manual_seed(0)
    model = CommNet().double().cuda()
    stock = copy.deepcopy(model)
    path = _path("ShardedOptimizer" if sharded else "DataParallel", model, "cuda")
    stock(*comm_batch(0, 0, "cuda"), use_branch).backward()
    path["forward"](*comm_batch(0, 0, "cuda"), use_branch).backward()
    path["optimizer"].zero_grad()
    loss = path["forward"](*comm_batch(0, 0, "cuda"), use_branch)
    with profiled("cuda") as prof:
        loss.backward()
    names = list(dict(model.named_parameters()))
    missing = [n for n, p in zip(names, path["params"]) if p.grad is None]
    for p, q in zip(path["params"], stock.parameters()):
        assert (p.grad is None) == (q.grad is None), "a .grad is None on one side only"
        if q.grad is not None and not sharded:
            _same(p.grad, q.grad)
    copies = [e["name"] for e in device_events(prof) if e.get("cat") == "gpu_memcpy" and "HtoD" in e["name"]]
    return sum("Pinned" in n for n in copies), sum("Pageable" in n for n in copies), missing


@cuda_only
def test_used_flags_are_staged_pinned_and_read_back_for_the_unused():
    """`buffer.host_tensor` via `GradStore.flagged`: a pinned, non-blocking copy; then
    `comm.settle_unused` reads the flags back, leaving the skipped branch's .grad None."""
    with nccl_rank():
        pinned, pageable, missing = _pinned_flag_copies(sharded=False, use_branch=False)
    assert pinned >= 1 and pageable == 0, f"used flags: {pinned} pinned, {pageable} pageable HtoD copies"
    assert missing == ["branch.weight", "branch.bias"]


@cuda_only
def test_the_reduce_scatters_used_flags_are_staged_pinned():
    """`buffer.host_tensor` via `Round.sync_all` under a ShardedOptimizer."""
    with nccl_rank():
        pinned, pageable, _ = _pinned_flag_copies(sharded=True, use_branch=True)
    assert pinned >= 1 and pageable == 0, f"used flags: {pinned} pinned, {pageable} pageable HtoD copies"


@cuda_only
def test_nccl_averages_inside_the_reduction():
    """`comm.average_op`: ReduceOp.AVG on NCCL, no division pass."""
    with nccl_rank():
        op, divide = average_op(torch.ones(1, device="cuda"), None)
    assert op == dist.ReduceOp.AVG and not divide


@cuda_only
def test_clipping_multiplies_by_the_coefficient_on_the_device():
    """`buffer.scale_` always multiplies on accelerators (no host read of the coefficient):
    a coefficient of 1 still runs `_foreach_mul_`, and changes nothing."""
    torch.manual_seed(0)
    flat = flatgrad.FlatGrad(nn.Linear(64, 64).cuda(), config=ROUTE_ALL)
    flat(torch.randn(8, 64, device="cuda")).sum().backward()
    grads = [p.grad for p in flat.parameters() if p.grad is not None]
    before = [g.clone() for g in grads]
    with profiled("cuda") as prof:
        flat.clip_grad_norm_(1e9)
    assert sum(e.name == "aten::_foreach_mul_" for e in prof.events()) >= 1
    assert all(torch.equal(g, b) for g, b in zip(grads, before))


@cuda_only
def test_gathers_check_no_index_range_on_the_host():
    """`functional._has_negative`, `functional.out_of_range`: negative indices are wrapped
    on the device, nothing read back; values and gradients equal stock's."""
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(20, generator=gen, dtype=torch.float64).cuda().requires_grad_()
    ref = table.detach().clone().requires_grad_()
    idx = torch.randint(-20, 20, (1000,), generator=gen).cuda()
    weight = torch.randn(32, 16, generator=gen, dtype=torch.float64).cuda().requires_grad_()
    ref_weight = weight.detach().clone().requires_grad_()
    index = torch.randint(0, 16, (32, 4), generator=gen).cuda()
    with no_host_sync():
        out = flatgrad.gather_with_index_add(table, idx)
        dim_out = flatgrad.gather(weight, 1, index)
    _same(out, ref[idx])
    out.sum().backward()
    ref[idx].sum().backward()
    dim_out.sum().backward()
    torch.gather(ref_weight, 1, index).sum().backward()
    _same(table.grad, ref.grad)
    _same(weight.grad, ref_weight.grad)


@cuda_only
def test_scale_grad_by_freq_counts_rows_without_a_host_sync():
    """`functional._read_counts`: an int64 scatter-add on the GPU (torch.bincount would read
    index.max() back); the gradient equals stock's."""
    torch.manual_seed(0)
    emb = nn.Embedding(50, 8, padding_idx=3, scale_grad_by_freq=True).double().cuda()
    stock = copy.deepcopy(emb)
    flat = flatgrad.FlatGrad(emb, config=ROUTE_ALL)
    idx = torch.randint(0, 50, (16, 12), generator=torch.Generator().manual_seed(0)).cuda()
    flat(idx).square().sum().backward()  # (the first backward lays out; the second must not sync)
    flat.zero_grad()
    with no_host_sync():
        flat(idx).square().sum().backward()
    stock(idx).square().sum().backward()
    _same(emb.weight.grad, stock.weight.grad)


@cuda_only
def test_a_replicate_trained_on_a_side_stream_follows_its_backward():
    """Built on the default stream, trained on a side one with a bfloat16 wire and
    check_finite: the bucket launches wait for the backward's stream
    (`Round._follow_backward`), and the wire and finite-flag tensors are marked as read by
    the final callback's (`read_here`)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(3)]).cuda()
    stock = copy.deepcopy(model)
    x = torch.randn(16, 128, device="cuda")
    waited: list[bool] = []
    follow = _bucket_sync.Round._follow_backward

    def spy(round_: _bucket_sync.Round, device: torch.device) -> bool:
        waited.append(follow(round_, device))
        return waited[-1]

    with nccl_rank():
        flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
        dp = flatgrad.replicate(flat, bucket_cap_mb=0.1, reduce_dtype=torch.bfloat16, check_finite=True)
        side, main = torch.cuda.Stream(), torch.cuda.current_stream()
        side.wait_stream(main)
        with (
            torch.cuda.stream(side),
            mock.patch.object(_bucket_sync, "read_here", side_effect=_bucket_sync.read_here) as read_here,
            mock.patch.object(_bucket_sync.Round, "_follow_backward", spy),
        ):
            for _ in range(2):
                dp.zero_grad()
                dp(x).square().mean().backward()
        main.wait_stream(side)
        num_buckets = len(flatgrad.replicate_state(dp).buckets)
    assert any(waited), "no bucket launch waited for the backward's stream"
    marked = [call.args[0] for call in read_here.call_args_list]
    wires = sum(t.dtype == torch.bfloat16 for t in marked)
    assert wires >= 2 * num_buckets, f"{wires} bfloat16 wire tensors marked for {num_buckets} buckets"
    stock(x).square().mean().backward()
    for p, q in zip(model.parameters(), stock.parameters()):  # (world size 1: the bf16 wire only)
        torch.testing.assert_close(p.grad, q.grad, rtol=2**-7, atol=1e-6)


@cuda_only
def test_a_routed_bf16_linear_accumulates_into_its_main_grad_with_an_out_dtype_gemm():
    """Where this torch has ``addmm(..., out_dtype=torch.float32)`` (`fused_accumulate`), the
    second backward of a routed bfloat16 Linear runs one aten::addmm with a float32 input and
    bfloat16 operands on the main grad's shape, no float32 addmm_ fallback, allocates nothing
    of the weight's size and copies no bfloat16 weight's bytes on the device; the main grad
    is within float32 round-off (a CUDA GEMM may split K: 1e-5) of the float64 products."""
    if not fused_accumulate("cuda"):
        pytest.skip(
            f"fused_accumulate('cuda') is False on torch {torch.__version__}: the float32 fallback runs"
        )
    rows, n_in, n_out = 96, 256, 512  # the weight's bytes differ from every activation's
    torch.manual_seed(0)
    layer = nn.Linear(n_in, n_out).to("cuda", torch.bfloat16)
    flat = flatgrad.FlatGrad(layer, config={"grad_dtype": "float32", "linear_min_numel": 0})
    x = torch.randn(rows, n_in, dtype=torch.bfloat16, device="cuda")
    flat(x).float().sum().backward()
    loss = flat(x).float().sum()
    with profiled("cuda", record_shapes=True, profile_memory=True) as prof:
        loss.backward()
    assert prof.profiler is not None and prof.profiler.kineto_results is not None
    events: list[Any] = list(prof.profiler.kineto_results.events())
    ops = [e for e in events if e.name() != "[memory]"]

    def gemms(name: str, dtypes: tuple[str, ...]) -> int:
        return sum(
            e.name() == name and bool(e.shapes()) and tuple(e.shapes()[0]) == (n_out, n_in)
            and tuple(e.dtypes()[:3]) == dtypes
            for e in ops
        )  # fmt: skip

    assert gemms("aten::addmm", ("float", "c10::BFloat16", "c10::BFloat16")) == 1
    assert gemms("aten::addmm_", ("float",) * 3) == 0
    numel = n_in * n_out
    allocated = [
        e.nbytes() for e in events if e.name() == "[memory]" and e.nbytes() in (2 * numel, 4 * numel)
    ]
    assert allocated == [] and dtod_copies(device_events(prof), 2 * numel) == []
    expected = 2 * (torch.ones(rows, n_out, dtype=torch.float64, device="cuda").t() @ x.double())
    error = float((flat.main_grad(layer.weight).double() - expected).abs().max() / expected.abs().max())
    assert error <= 1e-5
