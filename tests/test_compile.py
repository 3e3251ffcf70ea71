"""torch.compile with flatgrad: the plain model's graphs, breaks and recompiles, whichever way
the two are combined, and nothing changed for models flatgrad does not wrap.

The oracle is the same model compiled without flatgrad, in the same process. Graph counts
are Dynamo's (`torch._dynamo.utils.counters`), independent of the backend, so the Llama
runs use aot_eager (fast to compile); gradients are checked under inductor too.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import ROUTE_ALL, CompileLM, assert_same_grads
from dist_utils import run_ranks
from torch import nn
from torch._dynamo.utils import counters
from torch.nn.parallel import DistributedDataParallel as DDP

import flatgrad
from flatgrad._flatgrad import engine_of

transformers = pytest.importorskip("transformers")


def _llama() -> nn.Module:
    """A tiny Llama with tied embeddings, built from a config (no download)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config)


def _train(run: Callable[..., Any], steps: int = 12) -> dict[str, int]:
    """`steps` training steps, with an evaluation forward under no_grad after every fourth;
    returns Dynamo's counters: unique graphs compiled and graph breaks."""
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    for step in range(steps):
        run(input_ids=ids, labels=ids).loss.backward()
        if step % 4 == 3:
            with torch.no_grad():
                run(input_ids=ids)
    graphs, breaks = _graphs_and_breaks()
    return {"graphs": graphs, "breaks": breaks}


def _fresh_model() -> nn.Module:
    """A seeded float64 `CompileLM`, with Dynamo's caches and counters cleared."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    return CompileLM().double()


def _graphs_and_breaks() -> tuple[int, int]:
    """Dynamo's counts since the last `counters.clear()`: unique graphs, graph breaks."""
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _compiled_counts(make: Callable[[nn.Module], Callable[..., Any]]) -> dict[str, int]:
    torch._dynamo.reset()
    counters.clear()
    try:
        return _train(make(_llama()))
    finally:
        torch._dynamo.reset()


def _compile(module: nn.Module, fullgraph: bool = False) -> Callable[..., Any]:
    return torch.compile(module, backend="aot_eager", fullgraph=fullgraph)


_KEEP: list[Any] = []  # a FlatGrad alive while another model compiles


@pytest.fixture(scope="module")
def stock_counts() -> dict[str, int]:
    return _compiled_counts(_compile)


@pytest.mark.parametrize(
    "way",
    ["compile_flat", "compile_flat_fullgraph", "flat_of_compiled", "other_model_beside_a_flat"],
)
def test_a_llama_compiles_no_more_graphs_than_stock(way, stock_counts):
    """12 identical steps of a transformers Llama (its forward slices ``self.layers[:n]``,
    a new ModuleList per call): as many graphs as stock compiles (one for training, one for
    the no_grad evaluation), no break, no recompile."""
    stock = stock_counts
    makers: dict[str, Callable[[nn.Module], Callable[..., Any]]] = {
        "compile_flat": lambda m: _compile(flatgrad.FlatGrad(m)),
        "compile_flat_fullgraph": lambda m: _compile(flatgrad.FlatGrad(m), fullgraph=True),
        "flat_of_compiled": lambda m: flatgrad.FlatGrad(_compile(m)),
        "other_model_beside_a_flat": lambda m: (_KEEP.append(flatgrad.FlatGrad(_llama())), _compile(m))[1],
    }
    try:
        ours = _compiled_counts(makers[way])
    finally:
        _KEEP.clear()
    assert stock == {"graphs": 2, "breaks": 0}
    assert ours == stock


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (4, 6), generator=torch.Generator().manual_seed(step))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fullgraph_compile_of_the_wrapper_equals_stock_and_lives_in_the_buffer(backend):
    """`torch.compile(FlatGrad(model), fullgraph=True)`: stock's gradients (float64, the
    same kernels: round-off only), every `.grad` in the buffer from the first step, and an
    evaluation forward under no_grad between steps compiles no extra graph beyond stock's."""
    counts = {}
    for name in ("stock", "flatgrad"):
        model = _fresh_model()
        if name == "stock":
            oracle, run_oracle = model, torch.compile(model, backend=backend, fullgraph=True)
        else:
            model.load_state_dict(oracle.state_dict())
            flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
            run = torch.compile(flat, backend=backend, fullgraph=True)
        for step in range(4):
            if name == "stock":
                oracle.zero_grad()
                run_oracle(_tokens(step)).backward()
            else:
                flat.zero_grad()
                run(_tokens(step)).backward()
                (buffer,) = engine_of(flat).store.buffers.values()  # as backward left them
                assert {p.grad.untyped_storage().data_ptr() for p in model.parameters()} == {
                    buffer.untyped_storage().data_ptr()
                }
            with torch.no_grad():
                (run_oracle if name == "stock" else run)(_tokens(step))
        counts[name] = _graphs_and_breaks()
    torch._dynamo.reset()
    assert_same_grads(flat, oracle)
    assert counts["flatgrad"] == counts["stock"] == (2, 0)


def _ddp_fullgraph_worker(rank: int, world_size: int) -> None:
    """DDP(torch.compile(flat, fullgraph=True)) with the hook against stock DDP of the
    plain model compiled the same way: equal gradients in the buffer, stock's graphs."""
    results = {}
    for name in ("stock", "flatgrad"):
        model = _fresh_model()
        if name == "stock":
            oracle = model
            ddp = DDP(torch.compile(model, backend="aot_eager", fullgraph=True))
        else:
            flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
            compiled = torch.compile(flat, backend="aot_eager", fullgraph=True)
            ddp = DDP(compiled, **flat.ddp_kwargs())
            ddp.register_comm_hook(flat.comm_state(), flatgrad.allreduce_hook)
        for step in range(3):
            ddp.zero_grad()
            ddp(_tokens(10 * step + rank)).backward()
        results[name] = _graphs_and_breaks()
    torch._dynamo.reset()
    assert_same_grads(flat, oracle)
    assert results["flatgrad"] == results["stock"], results


@pytest.mark.distributed
def test_ddp_of_a_fullgraph_compiled_wrapper_equals_stock_ddp():
    run_ranks(_ddp_fullgraph_worker)


def _dataparallel_fullgraph_worker(rank: int, world_size: int) -> None:
    """torch.compile(DataParallel(flat), fullgraph=True): averaged gradients equal stock
    DDP's of the plain model, in the buffer, with stock's graph count."""
    model = _fresh_model()
    oracle = DDP(copy.deepcopy(model))
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    run = torch.compile(flatgrad.replicate(flat), backend="aot_eager", fullgraph=True)
    for step in range(3):
        flat.zero_grad()
        oracle.zero_grad()
        run(_tokens(10 * step + rank)).backward()
        oracle(_tokens(10 * step + rank)).backward()
    graphs, _ = _graphs_and_breaks()
    torch._dynamo.reset()
    assert dist.get_world_size() == world_size
    assert_same_grads(flat, oracle.module)
    assert graphs == 1


@pytest.mark.distributed
def test_a_fullgraph_compiled_dataparallel_equals_stock_ddp():
    run_ranks(_dataparallel_fullgraph_worker)
