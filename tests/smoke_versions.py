"""Every public path of flatgrad against stock PyTorch, in one short run: the version smoke
that CI runs on the floor torch and on the newest release (see ``.ci/run``).

    python tests/smoke_versions.py

Single process: `FlatGrad` (accumulation, clipping, state_dict), `gather_with_index_add`
and `gather`, an optimizer stepped by post-accumulate-grad hooks inside backward,
`torch.compile(FlatGrad(model), fullgraph=True)` (aot_eager and inductor) and main grads
(``grad_dtype: float32``). On 2 gloo ranks (127.0.0.1): DDP with
`allreduce_hook`, `FlatGrad.all_reduce_grads`, `DataParallel`, `ShardedOptimizer` and a
``torch.distributed.checkpoint`` save and resume. Each is compared with stock PyTorch on a
deep copy of the same float64 model (main grads: a float64 oracle of the same bfloat16
operands), to float64 round-off (1e-10: the same sums, possibly in another order) unless a
check says otherwise. Prints one line per check and a closing ``N passed, N failed`` line;
exits 1 if any check failed. Not collected by pytest (no ``test_`` prefix): it is the short
cross-version run, the test suite is the thorough one.
"""

from __future__ import annotations

import copy
import datetime
import faulthandler
import json
import os
import platform
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import flatgrad
from flatgrad import replicate_state

TOL = {"rtol": 1e-10, "atol": 1e-10}
ROUTE_ALL = {"linear_min_numel": 0}  # every nn.Linear takes flatgrad's backward
VOCAB, DIM = 24, 8


class SmokeLM(nn.Module):
    """Tied embedding and head (one parameter used twice), routed Linear, unrouted
    LayerNorm, a `gather_with_index_add` of a per-token bias table and a buffer (which
    DDP and DataParallel broadcast before each forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.fc = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.bias = nn.Parameter(torch.randn(VOCAB, 1))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.fc(self.emb(tokens)))) * self.scale + flatgrad.gather_with_index_add(
            self.bias, tokens
        )
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(1, -1).flatten())


def model64(seed: int = 0) -> SmokeLM:
    torch.manual_seed(seed)
    return SmokeLM().double()


def tokens(seed: int, rank: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(100 * seed + rank))


def same_params(ours: nn.Module, ref: nn.Module) -> None:
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def same_grads(ours: nn.Module, ref: nn.Module) -> None:
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")


# --- one process ------------------------------------------------------------------------------


def check_wrapper() -> None:
    """Two accumulated micro-batches, clipping, SGD, a second step; state_dict keys."""
    model = model64()
    ref = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    opt = torch.optim.SGD(flat.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        for micro in range(2):
            flat(tokens(2 * step + micro)).backward()
            ref(tokens(2 * step + micro)).backward()
        same_grads(model, ref)
        grads = {p.grad.data_ptr() for p in model.parameters()}  # type: ignore[union-attr]
        buffer = next(iter(flat.grad_buffers.values()))
        start = buffer.data_ptr()
        end = start + buffer.numel() * buffer.element_size()
        assert all(start <= ptr < end for ptr in grads), "every .grad must be a view of the buffer"
        norm = flat.clip_grad_norm_(0.5)
        torch.testing.assert_close(norm, nn.utils.clip_grad_norm_(ref.parameters(), 0.5), **TOL)
        opt.step()
        ref_opt.step()
    same_params(model, ref)
    assert flat.state_dict().keys() == ref.state_dict().keys()
    fresh = flatgrad.FlatGrad(model64(seed=1))
    fresh.load_state_dict(flat.state_dict())
    same_params(fresh, ref)
    assert flatgrad.FlatGrad(model) is model and isinstance(model, type(ref))  # applied in place


def check_gathers() -> None:
    """`gather_with_index_add` and `gather` on a wrapped parameter and on a plain tensor."""
    torch.manual_seed(0)
    table = nn.Parameter(torch.randn(6, 4, dtype=torch.float64))
    holder = nn.Module()
    holder.table = table
    flat = flatgrad.FlatGrad(holder)
    rows = torch.tensor([[0, 5, 5], [-1, 2, 0]])
    cols = torch.tensor([[0, 3], [3, 3], [1, 1], [2, 0], [0, 0], [1, 2]])
    weight = torch.randn(2, 3, 4, dtype=torch.float64)
    (flatgrad.gather_with_index_add(table, rows) * weight).sum().backward()
    flatgrad.gather(table, 1, cols).square().sum().backward()
    assert (
        table.grad is not None and table.grad.data_ptr() == next(iter(flat.grad_buffers.values())).data_ptr()
    )
    plain = table.detach().clone().requires_grad_()
    (plain[rows] * weight).sum().backward()
    torch.gather(plain, 1, cols).square().sum().backward()
    torch.testing.assert_close(table.grad, plain.grad, **TOL)
    other = table.detach().clone().requires_grad_()  # not wrapped: a fresh gradient, as stock
    flatgrad.gather(other, 1, cols).square().sum().backward()
    expected = plain.detach().clone().requires_grad_()
    torch.gather(expected, 1, cols).square().sum().backward()
    torch.testing.assert_close(other.grad, expected.grad, **TOL)


def check_optimizer_in_backward() -> None:
    """The optimizer-in-backward recipe: a post-accumulate-grad hook per parameter steps its
    own AdamW and drops its `.grad`, on the routed Linears, the gathered bias and the tied
    embedding, whose gradients flatgrad writes into the slots itself (torch 2.4's
    AccumulateGrad then calls no hook: flatgrad does)."""
    model = model64()
    ref = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    for each in (model, ref):
        optimizers = {p: torch.optim.AdamW([p], lr=0.01, weight_decay=0.1) for p in each.parameters()}

        def step(param: torch.Tensor, optimizers: dict = optimizers) -> None:
            optimizers[param].step()
            optimizers[param].zero_grad()

        for param in each.parameters():
            param.register_post_accumulate_grad_hook(step)
    for seed in range(3):
        flat(tokens(seed)).backward()
        ref(tokens(seed)).backward()
    same_params(model, ref)
    assert all(p.grad is None for p in model.parameters()), "every hook must have run"


def check_compile(backend: str) -> None:
    """``torch.compile(FlatGrad(model), fullgraph=True)`` against the plain model compiled."""
    torch._dynamo.reset()
    model = model64()
    ref = copy.deepcopy(model)
    run = torch.compile(flatgrad.FlatGrad(model, config=ROUTE_ALL), backend=backend, fullgraph=True)
    run_ref = torch.compile(ref, backend=backend, fullgraph=True)
    for step in range(2):
        run(tokens(step)).backward()
        run_ref(tokens(step)).backward()
    same_grads(model, ref)


def check_main_grads() -> None:
    """A bfloat16 Linear, ``grad_dtype: float32``: two micro-batches accumulate in float32,
    against float64 sums of the same bfloat16 operands (float32 round-off: 1e-6 of the
    largest element); `.grad` stays None."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8)).to(torch.bfloat16)
    flat = flatgrad.FlatGrad(model, config={"grad_dtype": "float32", "linear_min_numel": 0})
    exact = {
        "0.weight": torch.zeros(8, 16, dtype=torch.float64),
        "0.bias": torch.zeros(8, dtype=torch.float64),
    }
    for step in range(2):
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
        target = torch.randn(32, 8, generator=torch.Generator().manual_seed(10 + step)).to(torch.bfloat16)
        (flat(x).float() * target.float()).sum().backward()  # d loss / d output = target, exactly
        exact["0.weight"] += target.double().T @ x.double()
        exact["0.bias"] += target.double().sum(0)
    for name, param in model.named_parameters():
        assert param.grad is None, f"{name}: .grad must stay None with main grads"
        main = flat.main_grad(param)
        assert main.dtype == torch.float32, name
        ref = exact[name]
        torch.testing.assert_close(main.double(), ref, rtol=0, atol=1e-6 * float(ref.abs().max()), msg=name)


# --- two gloo ranks ---------------------------------------------------------------------------


def check_ddp_hook(rank: int) -> None:
    """``DDP(flat, **flat.ddp_kwargs())`` + `allreduce_hook` against stock DDP, SGD."""
    model = model64()
    ref = DDP(copy.deepcopy(model))
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    ddp = DDP(flat, **flat.ddp_kwargs())
    state = flat.comm_state()
    ddp.register_comm_hook(state, flatgrad.allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        for run, optimizer in ((ddp, opt), (ref, ref_opt)):
            optimizer.zero_grad()
            run(tokens(step, rank)).backward()
            optimizer.step()
    assert state.num_calls == 3, state.num_calls
    same_params(model, ref.module)


def check_all_reduce_grads(rank: int) -> None:
    """`flat.all_reduce_grads()` without DDP against stock DDP's averaged gradients."""
    model = model64()
    ref = DDP(copy.deepcopy(model))
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    flat(tokens(0, rank)).backward()
    flat.all_reduce_grads()
    ref(tokens(0, rank)).backward()
    same_grads(model, ref.module)


def check_data_parallel(rank: int) -> None:
    """`DataParallel` (several buckets, a no_sync micro-batch) against stock DDP, AdamW."""
    model = model64()
    ref = DDP(copy.deepcopy(model))
    dp = flatgrad.replicate(flatgrad.FlatGrad(model, config=ROUTE_ALL), bucket_cap_mb=0.0005)
    assert len(replicate_state(dp).buckets) > 1, len(replicate_state(dp).buckets)
    opt = torch.optim.AdamW(dp.parameters(), lr=0.05)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    for step in range(3):
        for run, optimizer in ((dp, opt), (ref, ref_opt)):
            optimizer.zero_grad()
            with run.no_sync():
                run(tokens(10 + step, rank)).backward()
            run(tokens(step, rank)).backward()
            nn.utils.clip_grad_norm_(run.parameters(), 0.5)
            optimizer.step()
    same_params(model, ref.module)


def _sharded(
    seed: int = 0, shard_by: str | None = None
) -> tuple[SmokeLM, flatgrad.ReplicateModule, flatgrad.ShardedOptimizer]:
    model = model64(seed)
    dp = flatgrad.replicate(flatgrad.FlatGrad(model, config=ROUTE_ALL), bucket_cap_mb=0.0005)
    opt = flatgrad.ShardedOptimizer(dp, torch.optim.AdamW, lr=0.05, weight_decay=0.1, shard_by=shard_by)  # type: ignore[arg-type]
    return model, dp, opt


def _sharded_steps(
    dp: flatgrad.ReplicateModule, opt: flatgrad.ShardedOptimizer, rank: int, steps: range
) -> None:
    for step in steps:
        opt.zero_grad()
        dp(tokens(step, rank)).backward()
        opt.clip_grad_norm_(0.5)
        opt.step()


def check_sharded(rank: int, shard_by: str | None = None) -> None:
    """`ShardedOptimizer` (ZeRO-1, AdamW, clipping; by element or, with ``shard_by="tensor"``,
    by whole parameters) against stock DDP + AdamW."""
    model, dp, opt = _sharded(shard_by=shard_by)
    ref = DDP(copy.deepcopy(model64()))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1)
    _sharded_steps(dp, opt, rank, range(3))
    for step in range(3):
        ref_opt.zero_grad()
        ref(tokens(step, rank)).backward()
        nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
    same_params(model, ref.module)


def check_checkpoint(rank: int, tmp: str) -> None:
    """``dcp.save({"model": dp, "optim": opt})`` after 2 steps, 2 more steps; a fresh
    model and optimizer (other weights, one step of their own) ``dcp.load`` it and take
    the same 2 steps: the uninterrupted run's parameters."""
    model, dp, opt = _sharded()
    _sharded_steps(dp, opt, rank, range(2))
    dcp.save({"model": dp, "optim": opt}, checkpoint_id=f"{tmp}/ckpt")
    _sharded_steps(dp, opt, rank, range(2, 4))
    resumed, dp2, opt2 = _sharded(seed=1)
    _sharded_steps(dp2, opt2, rank, range(1))  # state that the load must replace
    dcp.load({"model": dp2, "optim": opt2}, checkpoint_id=f"{tmp}/ckpt")
    _sharded_steps(dp2, opt2, rank, range(2, 4))
    same_params(resumed, model)


RANK_CHECKS: list[tuple[str, Callable[..., None]]] = [
    ("DDP + allreduce_hook", check_ddp_hook),
    ("FlatGrad.all_reduce_grads", check_all_reduce_grads),
    ("DataParallel", check_data_parallel),
    ("ShardedOptimizer", check_sharded),
    ("ShardedOptimizer by tensor", lambda rank: check_sharded(rank, "tensor")),
    ("DCP save/load (ShardedOptimizer)", check_checkpoint),
]


RANK_DEADLINE_S = 180  # a rank still running then is hung: its stacks are dumped and it ends


def _rank_entry(rank: int, world_size: int, port: int, tmp: str) -> None:
    """Run the distributed checks in order; a check's outcome goes to ``<tmp>/rank<rank>``
    as it ends. The first failure ends the rank (its peer's collectives then fail too, so
    the later checks would say nothing). A rank that finished leaves with ``os._exit``,
    without ``destroy_process_group``: on torch 2.4 gloo's teardown can wait forever for a
    peer that already left (seen here: 1 run in 12, the CI run that timed out). A rank that
    hangs anyway prints every thread's stack and exits after `RANK_DEADLINE_S`."""
    faulthandler.dump_traceback_later(RANK_DEADLINE_S, exit=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
    for name, check in RANK_CHECKS:
        start = time.perf_counter()
        try:
            check(*((rank, tmp) if check is check_checkpoint else (rank,)))
            dist.barrier()
        except Exception:
            _record(tmp, rank, name, time.perf_counter() - start, traceback.format_exc())
            raise
        _record(tmp, rank, name, time.perf_counter() - start, "")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _record(tmp: str, rank: int, name: str, seconds: float, error: str) -> None:
    with open(f"{tmp}/rank{rank}", "a") as file:
        file.write(json.dumps({"name": name, "seconds": seconds, "error": error}) + "\n")


def run_rank_checks() -> list[tuple[str, float, str]]:
    """The distributed checks on 2 gloo ranks in one spawn: (name, seconds, errors)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(_rank_entry, args=(2, port, tmp), nprocs=2, join=False)
        deadline = time.monotonic() + RANK_DEADLINE_S + 30
        try:
            while not context.join(timeout=5):
                if time.monotonic() > deadline:  # (each rank's own deadline should have ended it)
                    print("(the ranks did not end: killed)", flush=True)
                    for process in context.processes:
                        process.kill()
                    break
        except Exception as exc:  # the rank's own traceback is in its record
            print(f"(a rank ended with {type(exc).__name__})", flush=True)
        records: dict[str, list[dict[str, object]]] = {name: [] for name, _ in RANK_CHECKS}
        for rank in (0, 1):
            if os.path.exists(f"{tmp}/rank{rank}"):
                with open(f"{tmp}/rank{rank}") as file:
                    for line in file:
                        record = json.loads(line)
                        records[record["name"]].append({**record, "rank": rank})
    results = []
    for name, _ in RANK_CHECKS:
        done = records[name]
        errors = "".join(f"rank {r['rank']}: {r['error']}" for r in done if r["error"])
        if len(done) < 2:
            errors += f"{2 - len(done)} rank(s) did not finish it\n"
        results.append((name, max((float(r["seconds"]) for r in done), default=0.0), errors))  # type: ignore[arg-type]
    return results


def main() -> int:
    print(f"flatgrad smoke: torch {torch.__version__}, Python {platform.python_version()}", flush=True)
    checks: list[tuple[str, Callable[[], None]]] = [
        ("FlatGrad", check_wrapper),
        ("gather_with_index_add, gather", check_gathers),
        ("optimizer in backward (post-accumulate-grad hooks)", check_optimizer_in_backward),
        ("torch.compile fullgraph (aot_eager)", lambda: check_compile("aot_eager")),
        ("torch.compile fullgraph (inductor)", lambda: check_compile("inductor")),
        ("main grads (grad_dtype float32)", check_main_grads),
    ]
    failed = []
    num_passed = 0

    def report(name: str, error: str, seconds: float) -> None:
        nonlocal num_passed
        print(f"{'FAIL' if error else 'ok  '} {name} ({seconds:.1f} s)", flush=True)
        if error:
            print(error, flush=True)
            failed.append(name)
        else:
            num_passed += 1

    for name, check in checks:
        start = time.perf_counter()
        try:
            check()
            error = ""
        except Exception:
            error = traceback.format_exc()
        report(name, error, time.perf_counter() - start)
    for name, seconds, error in run_rank_checks():
        report(f"{name} (2 gloo ranks)", error, seconds)
    print(f"smoke: {num_passed} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
