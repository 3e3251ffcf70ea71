"""Multi-rank tests: FlatGrad under DDP and with `all_reduce_grads`, against stock DDP.

Two gloo ranks on 127.0.0.1, each feeding different data. The oracle is stock DDP on a deep
copy of the same model in the same process; in float64 with two ranks both sides add the
same two halves, so results agree to round-off (tolerance 1e-12).
"""

from __future__ import annotations

import copy
import logging
import time
import weakref

import pytest
import torch
import torch.distributed as dist
from conftest import ROUTE_ALL
from dist_utils import rank_profile, run_ranks
from oracle import Lockstep, assert_grads_like, assert_params_like, stock
from test_parallel import _NoGrad
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import flatgrad
import flatgrad._comm
import flatgrad._functional

pytestmark = pytest.mark.distributed

TOL = {"rtol": 1e-12, "atol": 1e-12}  # float64 round-off: see the module notes

_COPY_OPS = {"aten::copy_", "aten::clone", "aten::mul_out", "aten::mul", "aten::add_", "aten::_to_copy"}


class _Net(nn.Module):
    """Embedding + Linear layers, an unpatched LayerNorm, a frozen layer, an optional
    branch, and a float32 tail so there are two (dtype, device) buffers when asked."""

    def __init__(self, two_dtypes: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 24)
        self.fc = nn.Linear(24, 24)
        self.norm = nn.LayerNorm(24)
        self.frozen = nn.Linear(24, 24).requires_grad_(False)
        self.branch = nn.Linear(24, 24)
        self.head = nn.Linear(24, 40, bias=False)
        self.double()
        self.tail = nn.Linear(40, 3) if two_dtypes else None

    def forward(self, tokens: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = self.norm(torch.tanh(self.fc(self.emb(tokens))))
        h = self.frozen(h)
        if use_branch:
            h = self.branch(h)
        out = self.head(h)
        if self.tail is not None:
            out = self.tail(out.float()).double()
        return out.square().mean()


def _tokens(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, 40, (4, 6), generator=torch.Generator().manual_seed(100 * rank + step))


def _assert_ranks_agree(module: nn.Module) -> None:
    flat_params = torch.cat([p.detach().reshape(-1).double() for p in module.parameters()])
    gathered = [torch.empty_like(flat_params) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat_params)
    for other in gathered[1:]:
        torch.testing.assert_close(other, gathered[0], rtol=0, atol=0)


def _in_buffers(flat: flatgrad.FlatGrad) -> bool:
    storages = {buf.untyped_storage().data_ptr() for buf in flat.grad_buffers.values()}
    trainable = [p for p in flat.parameters() if p.requires_grad]
    return all(p.grad is not None and p.grad.untyped_storage().data_ptr() in storages for p in trainable)


def _fast_path_worker(rank: int, world_size: int, two_dtypes: bool) -> None:
    torch.manual_seed(0)
    model = _Net(two_dtypes)
    ref, ref_opt = stock(model, torch.optim.Adam, lr=1e-2)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    first_buffers = [weakref.ref(b) for b in flat.grad_buffers.values()]
    ddp = DDP(flat, **flat.ddp_kwargs())
    ddp.register_comm_hook(flat.comm_state(), flatgrad.allreduce_hook)
    pair = Lockstep(model, ddp, torch.optim.Adam(ddp.parameters(), lr=1e-2), ref, ref_opt)
    weight_shapes = {tuple(p.shape) for p in flat.parameters() if p.dim() == 2}
    for step in range(5):
        pair.zero_grad()  # set_to_none=True, torch's default
        loss = ddp(_tokens(rank, step))
        with rank_profile(record_shapes=True) as prof:
            loss.backward()
        ref(_tokens(rank, step)).backward()
        pair.assert_grads(**TOL, what=f"step {step}")
        assert _in_buffers(flat)
        if step >= 2:  # steady state: after DDP's one-time bucket rebuild (iteration 2)
            names = [e.name for e in prof.events()]
            assert names.count("c10d::allreduce_") == len(flat.grad_buffers) == 1 + two_dtypes
            copies = [
                (e.name, e.input_shapes)
                for e in prof.events()
                if e.name in _COPY_OPS and any(tuple(s) in weight_shapes for s in e.input_shapes if s)
            ]
            # A Linear weight's slot off a fresh tensor's alignment (DDP's bucket packs the slots
            # unaligned) gets its product fresh and copied, for stock's bits (`aligned`).
            linears = [m.weight for m in flat.modules() if isinstance(m, nn.Linear)]
            off = sorted(
                tuple(w.shape)
                for w in linears
                if w.requires_grad and not flatgrad._functional.aligned(w.grad)
            )
            assert [name for name, _ in copies] == ["aten::copy_"] * len(off), copies
            assert sorted(tuple(shapes[0]) for _, shapes in copies) == off, copies
            # DDP's bucket *is* the flat buffer: packed, no second full-size allocation alive.
            for (dtype, _), buf in flat.grad_buffers.items():
                trainable = [p for p in flat.parameters() if p.requires_grad and p.dtype == dtype]
                assert buf.numel() == sum(p.numel() for p in trainable)
            assert all(ref() is None for ref in first_buffers)
        pair.step()
        pair.assert_params(**TOL, what=f"step {step}")
    _assert_ranks_agree(flat)


@pytest.mark.parametrize("two_dtypes", [False, True])
def test_fast_path_matches_stock_ddp_with_one_allreduce_and_no_copies(two_dtypes):
    run_ranks(_fast_path_worker, two_dtypes)


def _variant_worker(rank: int, world_size: int, variant: str) -> None:
    torch.manual_seed(0)
    model = _Net()
    kwargs = {
        "default_flags": {},
        "fast_path": {},
        "find_unused": {"find_unused_parameters": True},
        "static_graph": {"static_graph": True},
        "no_sync": {},
    }[variant]
    ref, ref_opt = stock(model, torch.optim.SGD, kwargs, lr=0.1, momentum=0.9)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    extra = flat.ddp_kwargs() if variant != "default_flags" else {}
    ddp = DDP(flat, **kwargs, **extra)
    ddp.register_comm_hook(flat.comm_state(), flatgrad.allreduce_hook)
    pair = Lockstep(model, ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9), ref, ref_opt)
    for step in range(4):
        # find_unused: the branch is unused on rank 1 in odd steps
        use_branch = not (variant == "find_unused" and rank == 1 and step % 2)
        if variant == "no_sync":
            with pair.no_sync():
                pair.backward(_tokens(rank, 50 + step))
        pair.backward(_tokens(rank, step), use_branch)
        pair.assert_grads(**TOL, what=f"step {step}")
        pair.step()
        pair.zero_grad()
        pair.assert_params(**TOL, what=f"step {step}")
    _assert_ranks_agree(flat)


@pytest.mark.parametrize("variant", ["default_flags", "find_unused", "static_graph", "no_sync"])
def test_ddp_variants_match_stock_ddp(variant):
    run_ranks(_variant_worker, variant)


def _python_reducer_worker(rank: int, world_size: int, compiled: bool) -> None:
    import contextlib

    from torch._dynamo import compiled_autograd

    torch._dynamo.config.optimize_ddp = "python_reducer"  # read by DDP's constructor
    torch.manual_seed(0)
    model = _Net()
    ref, ref_opt = stock(model, torch.optim.AdamW, lr=0.01, weight_decay=0.1)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    ddp = DDP(flat, **flat.ddp_kwargs())
    ddp.register_comm_hook(flat.comm_state(), flatgrad.allreduce_hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.01, weight_decay=0.1)
    pair = Lockstep(model, ddp, opt, ref, ref_opt)
    for step in range(3):
        for net in (ddp, ref):
            backend = torch.compile(backend="aot_eager")
            with compiled_autograd._enable(backend) if compiled else contextlib.nullcontext():
                net(_tokens(rank, step)).backward()
        pair.assert_grads(**TOL, what=f"step {step}")
        pair.step()
        pair.zero_grad()
    pair.assert_params(**TOL)
    _assert_ranks_agree(flat)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled_autograd"])
def test_allreduce_hook_under_ddps_python_reducer_matches_stock(compiled):
    """DDP's Python reducer (``optimize_ddp="python_reducer"``, what compiled autograd needs)
    calls comm hooks per parameter with ``(grad, param)``: the hook averages each gradient
    as DDP does there, so training equals stock DDP under the same reducer."""
    torch._dynamo.reset()
    run_ranks(_python_reducer_worker, compiled, timeout=240, fresh=True)  # sets a Dynamo config


def _slow_path_logs_worker(rank: int, world_size: int) -> None:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("flatgrad").addHandler(handler)
    flat = flatgrad.FlatGrad(_Net(), config=ROUTE_ALL)
    ddp = DDP(flat)  # no ddp_kwargs: DDP copies into its own buckets
    ddp.register_comm_hook(flat.comm_state(), flatgrad.allreduce_hook)
    for step in range(3):
        ddp(_tokens(rank, step)).backward()
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "model.ddp_kwargs()" in warnings[0], warnings


def test_slow_path_says_once_how_to_get_the_fast_path():
    run_ranks(_slow_path_logs_worker)


def _hook_never_registered_worker(rank: int, world_size: int, register: bool) -> None:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("flatgrad").addHandler(handler)
    flat = flatgrad.FlatGrad(_Net(), config=ROUTE_ALL)
    ddp = DDP(flat, **flat.ddp_kwargs())  # as Lightning's DDPStrategy does on CPU: no hook
    if register:
        ddp.register_comm_hook(flat.comm_state(), flatgrad.allreduce_hook)
    for step in range(5):
        ddp(_tokens(rank, step)).backward()
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    if register:
        assert warnings == [], warnings
    else:
        assert len(warnings) == 1 and "allreduce_hook has not run in 2 steps" in warnings[0], warnings


@pytest.mark.parametrize("register", [False, True])
def test_ddp_kwargs_without_the_hook_is_reported_once(register):
    run_ranks(_hook_never_registered_worker, register)


def _accumulation_worker(rank: int, world_size: int, register: bool) -> None:
    """4 micro-batches per step (3 under no_sync) and a no_grad evaluation forward between
    them: neither is a step without the hook."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("flatgrad").addHandler(handler)
    flat = flatgrad.FlatGrad(_Net(), config=ROUTE_ALL)
    ddp = DDP(flat, **flat.ddp_kwargs())
    state = flat.comm_state()
    if register:
        ddp.register_comm_hook(state, flatgrad.allreduce_hook)
    num_warnings = []
    for step in range(4):
        for micro in range(4):
            with torch.no_grad():
                ddp(_tokens(rank, 50 + micro))
            if micro < 3:
                with ddp.no_sync():
                    ddp(_tokens(rank, 4 * step + micro)).backward()
            else:
                ddp(_tokens(rank, 4 * step + micro)).backward()
        num_warnings.append(sum(r.levelno == logging.WARNING for r in records))
    assert state.num_calls == (4 if register else 0)  # one bucket: one call per synchronised step
    # Without the hook: two synchronised steps pass unnoticed, the third forward warns, once.
    assert num_warnings == ([0, 0, 0, 0] if register else [0, 0, 1, 1]), [r.getMessage() for r in records]


@pytest.mark.parametrize("register", [False, True])
def test_hook_warning_ignores_no_sync_and_no_grad_forwards(register):
    run_ranks(_accumulation_worker, register)


class _FakeDDP:
    def __init__(self, sync: bool) -> None:
        self.require_backward_grad_sync = sync


def _count(
    monkeypatch: pytest.MonkeyPatch, active: object, times: int, num_forwards: int = 0
) -> list[int | None]:
    monkeypatch.setattr(DDP, "_active_ddp_module", active)
    counts: list[int | None] = []
    count: int | None = num_forwards
    for _ in range(times):
        assert count is not None, "counting stopped early"
        count = flatgrad._comm.note_forward_without_hook(count)
        counts.append(count)
    return counts


def test_note_forward_without_hook_warns_once_at_the_third_synchronised_forward(monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="flatgrad"):
        assert _count(monkeypatch, _FakeDDP(sync=True), 3) == [1, 2, None]
    assert len(caplog.records) == 1
    assert "allreduce_hook has not run in 2 steps" in caplog.records[0].getMessage()
    assert "register it yourself on CPU" in caplog.records[0].getMessage()


@pytest.mark.parametrize("case", ["no_grad", "no_sync", "outside_ddp"])
def test_note_forward_without_hook_skips_forwards_without_a_sync(monkeypatch, caplog, case):
    active = None if case == "outside_ddp" else _FakeDDP(sync=case != "no_sync")
    with caplog.at_level(logging.WARNING, logger="flatgrad"), torch.set_grad_enabled(case != "no_grad"):
        assert _count(monkeypatch, active, 5, num_forwards=1) == [1] * 5
    assert caplog.records == []


class _GAN(nn.Module):
    """A generator and a discriminator trained in turn, the other frozen meanwhile (what
    Lightning's `toggle_optimizer` does), through one DDP."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
        self.disc = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.double()

    def forward(self, noise: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
        fake = self.gen(noise)
        if real is None:
            return nn.functional.softplus(-self.disc(fake)).mean()
        loss_real = nn.functional.softplus(-self.disc(real)).mean()
        return loss_real + nn.functional.softplus(self.disc(fake.detach())).mean()


def _toggled_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = _GAN()
    ref = DDP(copy.deepcopy(model), find_unused_parameters=True)
    flat = flatgrad.FlatGrad(model)
    ddp = DDP(flat, find_unused_parameters=True, **flat.ddp_kwargs())
    ddp.register_comm_hook(flat.comm_state(), flatgrad.allreduce_hook)
    sides = [(ddp, flat, flat.clip_grad_norm_), (ref, ref.module, None)]
    opts = []
    for module in (flat, ref.module):
        gen, disc = module.gen.parameters(), module.disc.parameters()
        opts.append((torch.optim.Adam(gen), torch.optim.SGD(disc, lr=0.1)))
    addresses = []
    generator = torch.Generator().manual_seed(rank)
    for step in range(5):
        noise, real = (torch.randn(6, n, generator=generator, dtype=torch.float64) for n in (4, 8))
        for (wrapped, module, clip), (opt_gen, opt_disc) in zip(sides, opts):
            module.disc.requires_grad_(False)
            wrapped(noise).backward()
            if clip is not None:
                clip(0.05)
            else:
                torch.nn.utils.clip_grad_norm_(module.gen.parameters(), 0.05)
            opt_gen.step()
            opt_gen.zero_grad()
            module.disc.requires_grad_(True)
            module.gen.requires_grad_(False)
            wrapped(noise, real).backward()
            opt_disc.step()
            opt_disc.zero_grad()
            module.gen.requires_grad_(True)
        assert_params_like(flat, ref.module, **TOL, what=f"step {step}")
        if step >= 2:  # (after DDP's one-time bucket rebuild) its bucket is still the buffer
            (buffer,) = flat.grad_buffers.values()
            assert buffer.numel() == sum(p.numel() for p in flat.parameters())
            addresses.append(buffer.data_ptr())
    assert len(set(addresses)) == 1, addresses
    _assert_ranks_agree(flat)


def test_parameters_frozen_in_turn_keep_ddps_bucket_as_the_buffer():
    """A GAN's two halves trained in turn, each frozen while the other steps (Lightning's
    `toggle_optimizer`), clipped with the model's norm while the discriminator is frozen:
    equal to stock DDP, and DDP's bucket stays the flat buffer (a frozen parameter keeps
    its slot, as it keeps DDP's). It was laid out again without the frozen half, off DDP's
    bucket: copies every step, and under Lightning's manual optimization (the backward
    inside DDP's forward) DDP's own error at the next backward."""
    run_ranks(_toggled_worker)


def _all_reduce_grads_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = _Net()
    ref = DDP(copy.deepcopy(model), find_unused_parameters=True)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    for step in range(3):
        use_branch = not (rank == 1 and step == 1)
        flat(_tokens(rank, step), use_branch).backward()
        ref(_tokens(rank, step), use_branch).backward()
        with rank_profile() as prof:
            flat.all_reduce_grads()
        assert [e.name for e in prof.events()].count("c10d::allreduce_") == 1
        assert_grads_like(model, ref.module, **TOL, what=f"step {step}")
        assert _in_buffers(flat)
        flat.zero_grad()
        ref.zero_grad()


def test_all_reduce_grads_without_ddp_matches_stock_ddp():
    run_ranks(_all_reduce_grads_worker)


def _compression_worker(rank: int, world_size: int, reduce_dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = _Net()
    ref = DDP(copy.deepcopy(model))
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    ddp = DDP(flat, **flat.ddp_kwargs())
    ddp.register_comm_hook(flat.comm_state(reduce_dtype=reduce_dtype), flatgrad.allreduce_hook)
    for step in range(3):
        ddp(_tokens(rank, step)).backward()
        ref(_tokens(rank, step)).backward()
        for p, q in zip(flat.parameters(), ref.parameters()):
            if q.grad is None:
                continue
            # One rounding of each rank's half to the wire dtype: relative error <= 2^-8 (bf16)
            # or 2^-11 (fp16) of the values, so bound by the gradient's scale.
            scale = q.grad.abs().max().item() + 1e-30
            assert (p.grad - q.grad).abs().max().item() <= 2**-7 * scale
        assert _in_buffers(flat)
        ddp.zero_grad()
        ref.zero_grad()


@pytest.mark.parametrize("reduce_dtype", [torch.bfloat16, torch.float16])
def test_wire_compression_close_to_stock(reduce_dtype):
    run_ranks(_compression_worker, reduce_dtype)


def test_comm_state_rejects_bad_wire_dtype():
    flat = flatgrad.FlatGrad(nn.Linear(2, 2), config=ROUTE_ALL)
    with pytest.raises(
        ValueError, match="reduce_dtype must be torch.bfloat16, torch.float16 or None, got torch.int8"
    ):
        flat.comm_state(reduce_dtype=torch.int8)


def test_all_reduce_grads_needs_a_process_group():
    flat = flatgrad.FlatGrad(nn.Linear(2, 2), config=ROUTE_ALL)
    with pytest.raises(RuntimeError, match="initialised default process group"):
        flat.all_reduce_grads()


def test_ddp_kwargs_one_bucket_per_buffer():
    flat = flatgrad.FlatGrad(nn.Linear(1024, 1024), config=ROUTE_ALL)
    kwargs = flat.ddp_kwargs()
    assert kwargs["gradient_as_bucket_view"] is True
    largest = max(b.numel() * b.element_size() for b in flat.grad_buffers.values())
    assert kwargs["bucket_cap_mb"] * 2**20 >= largest


def _raising_worker(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    time.sleep(600)  # rank 0 would wait here far past the test's deadline without the harness


def test_a_failing_rank_fails_fast():
    start = time.monotonic()
    with pytest.raises(Exception, match="rank 1 fails on purpose"):
        run_ranks(_raising_worker, timeout=60)
    assert time.monotonic() - start < 60


def _nccl_worker(rank: int, world_size: int) -> None:
    torch.cuda.set_device(rank)
    model = _Net().cuda()
    ref = DDP(copy.deepcopy(model), device_ids=[rank])
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    ddp = DDP(flat, device_ids=[rank], **flat.ddp_kwargs())
    ddp.register_comm_hook(flat.comm_state(), flatgrad.allreduce_hook)
    for step in range(4):
        ddp(_tokens(rank, step).cuda()).backward()
        ref(_tokens(rank, step).cuda()).backward()
        for p, q in zip(flat.parameters(), ref.parameters()):
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)
        assert _in_buffers(flat)
        ddp.zero_grad()
        ref.zero_grad()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nccl_fast_path_matches_stock_ddp():
    run_ranks(_nccl_worker, world_size=torch.cuda.device_count(), backend="nccl")


def _globally_unused_worker(rank: int, world_size: int) -> None:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("flatgrad").addHandler(handler)
    torch.manual_seed(0)
    flat = flatgrad.FlatGrad(_Net(), config=ROUTE_ALL)
    ddp = DDP(flat, find_unused_parameters=True, **flat.ddp_kwargs())
    ddp.register_comm_hook(flat.comm_state(), flatgrad.allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(4):
        opt.zero_grad()
        ddp(_tokens(rank, step), False).backward()  # the branch is unused on every rank
        opt.step()
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert not warnings, warnings
    storages = {buf.untyped_storage().data_ptr() for buf in flat.grad_buffers.values()}
    for name, p in flat.named_parameters():
        if p.requires_grad and p.grad is not None:
            assert p.grad.untyped_storage().data_ptr() in storages, name


def test_fast_path_kept_with_a_parameter_unused_everywhere():
    run_ranks(_globally_unused_worker)


def _unused_everywhere_worker(rank: int, world_size: int, sync: str, route_all: bool) -> None:
    """A parameter no rank uses keeps `.grad` None, as under stock DDP, so AdamW's weight
    decay leaves it alone (a zero `.grad` would move it). The branch is unused on rank 1 in
    step 1 and on every rank in steps 0, 2 and 3; with static_graph on every rank always, or
    (static_graph_one_rank) used on rank 0 only: a parameter some rank used has its
    averaged `.grad` on every rank."""
    torch.manual_seed(0)
    model = _Net(two_dtypes=True)
    static = sync.startswith("static_graph")
    flags = {"static_graph": True} if static else {"find_unused_parameters": True}
    ref = DDP(copy.deepcopy(model), **flags)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL if route_all else None)
    trained: nn.Module = flat
    if sync != "all_reduce_grads":
        trained = DDP(flat, **flags, **flat.ddp_kwargs())
        trained.register_comm_hook(flat.comm_state(), flatgrad.allreduce_hook)
    opt = torch.optim.AdamW(trained.parameters(), lr=0.1, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.1)
    pair = Lockstep(model, trained, opt, ref, ref_opt)
    tol = {"rtol": 1e-6, "atol": 1e-6}  # the float32 tail
    for step in range(4):
        use_branch = rank == 0 and (step == 1 or sync == "static_graph_one_rank")
        use_branch = use_branch and sync != "static_graph"
        trained(_tokens(rank, step), use_branch).backward()
        if sync == "all_reduce_grads":
            with rank_profile() as prof:
                flat.all_reduce_grads()
            # the used flags travel in the buffers' all-reduces: one per (dtype, device)
            assert [e.name for e in prof.events()].count("c10d::allreduce_") == 2
        ref(_tokens(rank, step), use_branch).backward()
        pair.assert_grads(**tol, what=f"step {step}")
        pair.step()
        pair.zero_grad()
        pair.assert_params(**tol, what=f"step {step}")


@pytest.mark.parametrize("route_all", [False, True], ids=["default", "route-all"])
@pytest.mark.parametrize("sync", ["find_unused", "static_graph", "static_graph_one_rank", "all_reduce_grads"])
def test_a_parameter_no_rank_uses_keeps_grad_none_like_stock_ddp(sync, route_all):
    run_ranks(_unused_everywhere_worker, sync, route_all)


class _Stopped(nn.Module):
    """`b` reaches the loss only through `_NoGrad`: its AccumulateGrad runs, with no
    gradient, on every rank (DDP's reducer hook runs too, and finds `.grad` undefined)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(4, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 1)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.a(x)) + 0 * _NoGrad.apply(self.b(x)))
        return self.head(h).square().mean()


def _stopped_worker(rank: int, world_size: int, config: object, fast: bool, accumulate: bool) -> None:
    torch.manual_seed(0)
    model = _Stopped()
    ref = DDP(copy.deepcopy(model), find_unused_parameters=True)
    flat = flatgrad.FlatGrad(model, config=config)
    ddp = DDP(flat, find_unused_parameters=True, **(flat.ddp_kwargs() if fast else {}))
    if fast:
        ddp.register_comm_hook(flat.comm_state(), flatgrad.allreduce_hook)
    opts = [torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=0.1) for net in (ddp, ref)]
    pair = Lockstep(model, ddp, opts[0], ref, opts[1])
    for step in range(4):  # past DDP's bucket rebuild (iteration 2) and the hook's adoption
        x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(step * 2 + rank))
        pair.zero_grad()
        if accumulate:  # a micro-batch under no_sync() first (DDP's reducer still runs its hooks)
            with pair.no_sync():
                pair.backward(x.flip(0))
        pair.backward(x)
        pair.assert_grads(**TOL, what=f"step {step}")
        pair.step()
    if fast:
        storages = {buf.untyped_storage().data_ptr() for buf in flat.grad_buffers.values()}
        held = [p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None]
        assert set(held) <= storages
    pair.assert_params(**TOL)


@pytest.mark.parametrize(
    ("config", "fast", "accumulate"),
    [(None, True, False), (ROUTE_ALL, True, False), (None, True, True), (None, False, True)],
    ids=["seated", "routed", "seated-no_sync", "own_flags-no_sync"],
)
def test_a_parameter_whose_gradient_is_stopped_everywhere_keeps_grad_none_under_ddp(config, fast, accumulate):
    run_ranks(_stopped_worker, config, fast, accumulate)


def _direct_call_worker(rank: int, world_size: int, fast: bool, direct_first: bool) -> None:
    """A loss that adds the wrapped model called directly (``ddp.module(x)``, past DDP's
    forward) to DDP's output: DDP's reducer still places that backward's gradients, so
    nothing is seated, whichever output the backward reaches first."""
    torch.manual_seed(0)
    model = _Stopped()
    ref = DDP(copy.deepcopy(model), find_unused_parameters=True, gradient_as_bucket_view=fast)
    flat = flatgrad.FlatGrad(model)  # (its small Linears unrouted: `b`'s slots would be seated)
    ddp = DDP(flat, find_unused_parameters=True, **(flat.ddp_kwargs() if fast else {}))
    if fast:
        ddp.register_comm_hook(flat.comm_state(), flatgrad.allreduce_hook)
    opts = [torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=0.1) for net in (ddp, ref)]
    pair = Lockstep(model, ddp, opts[0], ref, opts[1])
    for step in range(4):
        x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(step * 2 + rank))
        pair.zero_grad()
        for net in (ddp, ref):
            # The backward reaches the output made last first (its nodes are the newest).
            if direct_first:
                out = net(x)
                loss = out + net.module(2 * x)
            else:
                direct = net.module(2 * x)
                loss = direct + net(x)
            loss.backward()
        pair.assert_grads(**TOL, what=f"step {step}")
        pair.step()
    pair.assert_params(**TOL)


@pytest.mark.parametrize("direct_first", [False, True], ids=["ddp_first", "direct_first"])
@pytest.mark.parametrize("fast", [False, True], ids=["own_flags", "ddp_kwargs"])
def test_the_wrapped_model_called_past_ddp_in_the_same_loss_matches_stock(fast, direct_first):
    run_ranks(_direct_call_worker, fast, direct_first)


class _Strided(nn.Module):
    """Parameters whose strides are not the contiguous ones: a channels_last conv weight
    and a transposed matrix (DDP's bucket views follow them)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1).double().to(memory_format=torch.channels_last)
        self.t = nn.Parameter(torch.randn(4, 3, dtype=torch.float64).t())  # (3, 4), strides (1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x.contiguous(memory_format=torch.channels_last))  # (2, 3, 4, 4)
        return (h.mean((2, 3)) @ self.t).square().mean()


def _strided_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = _Strided()
    ref, ref_opt = stock(model, torch.optim.SGD, {"gradient_as_bucket_view": True}, lr=0.1)
    flat = flatgrad.FlatGrad(model)
    ddp = DDP(flat, **flat.ddp_kwargs())
    ddp.register_comm_hook(flat.comm_state(), flatgrad.allreduce_hook)
    pair = Lockstep(model, ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), ref, ref_opt)
    for step in range(4):  # DDP's bucket adopted at step 0, and again after its rebuild (step 1)
        x = torch.randn(
            2, 2, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(step * 2 + rank)
        )
        pair.zero_grad()
        pair.backward(x)
        norms = flat.clip_grad_norm_(0.5), torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        torch.testing.assert_close(norms[0], norms[1], **TOL)
        for (name, p), q in zip(model.named_parameters(), ref.module.parameters()):
            assert p.grad.stride() == q.grad.stride() == p.stride(), (step, name)
        pair.assert_grads(**TOL, what=f"step {step}")
        pair.step()
    pair.assert_params(**TOL)


def test_parameters_with_strides_of_their_own_get_their_gradients_under_the_ddp_hook():
    run_ranks(_strided_worker)


def _checkpoint_names_worker(rank: int, world_size: int, tmp: str) -> None:
    """torch.distributed.checkpoint under DDP(flat) and flatgrad.ReplicateModule keys model and
    optimizer state as for DDP(model), so a checkpoint saved by one loads into the other;
    DDP's parameters_to_ignore matches the plain model's names."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def trained(wrap: str) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model: nn.Module = _Net()
        if wrap != "stock":
            flat = flatgrad.FlatGrad(model)
            model = flatgrad.replicate(flat) if wrap == "dp" else DDP(flat, **flat.ddp_kwargs())
        else:
            model = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
        for step in range(2):
            model(_tokens(rank, step)).backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    states = {wrap: get_state_dict(*trained(wrap)) for wrap in ("stock", "ddp", "dp")}
    ref_model, ref_optim = states["stock"]
    for wrap in ("ddp", "dp"):
        model_sd, optim_sd = states[wrap]
        assert model_sd.keys() == ref_model.keys(), wrap
        assert optim_sd["state"].keys() == ref_optim["state"].keys(), wrap
        assert optim_sd["param_groups"][0]["params"] == ref_optim["param_groups"][0]["params"], wrap
        for key, value in optim_sd["state"].items():
            for name, tensor in value.items():
                torch.testing.assert_close(tensor, ref_optim["state"][key][name], rtol=1e-12, atol=1e-12)
    # saved from DDP(flat), loaded into DDP(model): the next step equals continuing stock
    model, opt = trained("ddp")
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    torch.manual_seed(1)
    fresh = DDP(_Net())
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1, weight_decay=0.1)
    fresh_sd, fresh_optim_sd = get_state_dict(fresh, fresh_opt)
    state = {"model": fresh_sd, "optim": fresh_optim_sd}
    dcp.load(state, checkpoint_id=tmp)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    ref, ref_opt = trained("stock")
    for module, optimizer in ((fresh, fresh_opt), (ref, ref_opt)):
        module(_tokens(rank, 9)).backward()
        optimizer.step()
    assert_params_like(fresh.module, ref.module, **TOL)
    # parameters_to_ignore by the plain model's names: that gradient is not averaged
    torch.manual_seed(0)
    flat = flatgrad.FlatGrad(_Net())
    local = copy.deepcopy(flat)  # (a model with FlatGrad applied, its own buffers)
    DDP._set_params_and_buffers_to_ignore_for_model(flat, ["head.weight"])
    ddp = DDP(flat)
    for module in (ddp, local):
        module(_tokens(rank, 0)).backward()
    torch.testing.assert_close(flat.head.weight.grad, local.head.weight.grad, rtol=0, atol=0)
    assert not torch.equal(flat.fc.weight.grad, local.fc.weight.grad)


def test_distributed_checkpoints_and_ignored_parameters_use_the_plain_names(tmp_path):
    run_ranks(_checkpoint_names_worker, str(tmp_path))


def _complex_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 4, dtype=torch.complex128)
    unused = nn.Parameter(torch.randn(3, dtype=torch.complex128))
    model.register_parameter("unused", unused)
    ref = DDP(copy.deepcopy(model), find_unused_parameters=True)
    flat = flatgrad.FlatGrad(model)
    x = torch.randn(2, 4, dtype=torch.complex128, generator=torch.Generator().manual_seed(rank))
    flat(x).abs().sum().backward()
    flat.all_reduce_grads()
    ref(x).abs().sum().backward()
    assert_grads_like(model, ref.module, **TOL)


def test_all_reduce_grads_of_complex_parameters_matches_stock_ddp():
    run_ranks(_complex_worker)


# --- the user's own DDP flags: DDP(FlatGrad(m), ...) without ddp_kwargs() ----------------
# Modelled on PyTorch's test_output_unused_in_loss_tuple_module,
# test_undefined_grad_parity_unused_parameters and test_ddp_build_debug_param_to_name_mapping
# (torch/testing/_internal/distributed/distributed_test.py).


class _TwoOutputs(nn.Module):
    """Two outputs; the loss may leave `a`'s unused (and `c` is never used)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(10, 10, bias=False)
        self.b = nn.Linear(10, 10, bias=False)
        self.c = nn.Linear(5, 5, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x)


class _Undefined(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))).softmax(dim=1)


def _own_flags_worker(rank: int, world_size: int, hook: bool, bucket_view: bool, config: object) -> None:
    def wrap(model: nn.Module) -> nn.Module:
        flat = flatgrad.FlatGrad(model, config=config)
        ddp = DDP(flat, find_unused_parameters=True, gradient_as_bucket_view=bucket_view)
        if hook:
            ddp.register_comm_hook(flat.comm_state(), flatgrad.allreduce_hook)
        return ddp

    torch.manual_seed(0)
    model = _Undefined().double()
    ref = DDP(copy.deepcopy(model), find_unused_parameters=True, gradient_as_bucket_view=bucket_view)
    ours = wrap(model)
    x = torch.ones(1, 2, dtype=torch.float64)
    for module in (ours, ref):  # every gradient undefined: stock leaves every .grad None
        torch._C._functions.UndefinedGrad()(module(x).sum()).backward()
    assert_grads_like(model, ref.module, **TOL, what="undefined gradient:")

    model = _TwoOutputs().double()
    ref = DDP(copy.deepcopy(model), find_unused_parameters=True, gradient_as_bucket_view=bucket_view)
    ours = wrap(model)
    x = torch.randn(10, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    for module in (ours, ref):
        module(x)[1].sum().backward()  # the output `a` unused in the loss
    assert_grads_like(model, ref.module, **TOL, what="output unused:")
    for step in range(5):  # no zero_grad: a's .grad (once it has one) must stay untouched
        for module in (ours, ref):
            a, b = module(x)
            (a @ b if step < 2 else b).sum().backward()
        assert_grads_like(model, ref.module, **TOL, what=f"step {step}:")


@pytest.mark.parametrize("config", [None, ROUTE_ALL], ids=["seated", "routed"])
@pytest.mark.parametrize("bucket_view", [False, True], ids=["copies", "bucket_view"])
@pytest.mark.parametrize("hook", [False, True], ids=["no_hook", "allreduce_hook"])
def test_unused_and_undefined_gradients_keep_grad_none_under_the_users_own_ddp_flags(
    hook, bucket_view, config
):
    run_ranks(_own_flags_worker, hook, bucket_view, config)


class _TwoLin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(10, 10, bias=False)
        self.b = nn.Linear(10, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def _ignored_before_wrapping_worker(rank: int, world_size: int, fast: bool) -> None:
    torch.manual_seed(0)
    model = _TwoLin().double()
    local = copy.deepcopy(model)
    ref_model = copy.deepcopy(model)
    for module in (model, ref_model):  # set on the plain model, as libraries do, before wrapping
        DDP._set_params_and_buffers_to_ignore_for_model(module, ["a.weight"])
    flat = flatgrad.FlatGrad(model)
    ours = DDP(flat, **flat.ddp_kwargs()) if fast else DDP(flat)
    if fast:
        ours.register_comm_hook(flat.comm_state(), flatgrad.allreduce_hook)
    ref = DDP(ref_model)
    params, _ = ours._build_params_for_reducer()
    assert ours._build_debug_param_to_name_mapping(params) == {0: "b.weight"}
    assert ours.parameters_to_ignore == {"a.weight"}
    x = torch.randn(4, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    for module in (ours, ref, local):
        module(x).sum().backward()
    # the ignored weight keeps its local gradient, as under stock DDP; the other is averaged
    torch.testing.assert_close(model.a.weight.grad, ref_model.a.weight.grad, rtol=0, atol=0)
    torch.testing.assert_close(model.a.weight.grad, local.a.weight.grad, rtol=0, atol=0)
    torch.testing.assert_close(model.b.weight.grad, ref_model.b.weight.grad, rtol=1e-12, atol=1e-12)
    assert not torch.equal(model.b.weight.grad, local.b.weight.grad)


@pytest.mark.parametrize("fast", [False, True], ids=["own_flags", "ddp_kwargs"])
def test_parameters_ignored_on_the_model_before_wrapping_are_ignored_by_ddp(fast):
    run_ranks(_ignored_before_wrapping_worker, fast)


class _Uneven(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc(x))).square().mean()


def _join_worker(rank: int, world_size: int, by_initial: bool) -> None:
    """`Join` with uneven inputs. `divide_by_initial_world_size=False`: once a rank joined,
    DDP averages over the ranks left, which it leaves to a comm hook; the oracle is stock
    DDP without one (torch's own allreduce_hook divides by the world size there)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.algorithms.join import Join

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("flatgrad").addHandler(handler)
    torch.manual_seed(0)
    model = _Uneven().double()
    ref = DDP(copy.deepcopy(model))
    if by_initial:
        ref.register_comm_hook(None, allreduce_hook)
    flat = flatgrad.FlatGrad(model)
    ours = DDP(flat, **flat.ddp_kwargs())
    ours.register_comm_hook(flat.comm_state(), flatgrad.allreduce_hook)
    batches = 2 + 3 * rank  # rank 0 runs out of inputs first and joins
    for module in (ours, ref):
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        with Join([module], divide_by_initial_world_size=by_initial):
            for step in range(batches):
                x = torch.randn(
                    4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * rank + step)
                )
                module(x).backward()
                opt.step()
                opt.zero_grad()
    assert_params_like(model, ref.module, **TOL)
    assert not [r.getMessage() for r in records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("by_initial", [True, False], ids=["by_initial_world_size", "by_ranks_left"])
def test_join_with_uneven_inputs_matches_ddp_without_a_warning(by_initial):
    run_ranks(_join_worker, by_initial)


def _sparse_worker(rank: int, world_size: int, fast: bool) -> None:
    from test_flatgrad import _Recommender, _recommender_batch

    torch.manual_seed(0)
    model = _Recommender()
    ref = DDP(copy.deepcopy(model))
    flat = flatgrad.FlatGrad(model)
    ours = DDP(flat, **flat.ddp_kwargs()) if fast else DDP(flat)
    if fast:
        ours.register_comm_hook(flat.comm_state(), flatgrad.allreduce_hook)

    def optimizers(m: nn.Module) -> list[torch.optim.Optimizer]:
        tables = [m.bag.weight, m.emb.weight]
        return [torch.optim.SparseAdam(tables, lr=0.1), torch.optim.AdamW(m.mlp.parameters(), lr=0.1)]

    opts = {id(ours): optimizers(model), id(ref): optimizers(ref.module)}
    for step in range(3):
        for module in (ours, ref):
            module(*_recommender_batch(10 * rank + step)).backward()
            assert module.module.bag.weight.grad.is_sparse
            if module is ours and fast and step == 2:  # the dense rest: one adopted bucket
                storages = {b.untyped_storage().data_ptr() for b in flat.grad_buffers.values()}
                assert {p.grad.untyped_storage().data_ptr() for p in model.mlp.parameters()} <= storages
            for opt in opts[id(module)]:
                opt.step()
            module.zero_grad()
    assert_params_like(model, ref.module, **TOL)
    with pytest.raises(ValueError, match="replicate averages the flat buffers only.*sparse"):
        flatgrad.replicate(flatgrad.FlatGrad(_Recommender()))
    with pytest.raises(ValueError, match="all_reduce_grads averages the flat buffers only.*DDP"):
        flat.all_reduce_grads()


@pytest.mark.parametrize("fast", [False, True], ids=["own_flags", "ddp_kwargs"])
def test_sparse_embeddings_under_ddp_match_stock_and_flatgrads_own_syncs_refuse_them(fast):
    run_ranks(_sparse_worker, fast)
