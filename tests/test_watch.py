"""`flatgrad._watch`: registrations in the wrapped model are seen with no process-wide hook,
and nothing of flatgrad's stays on the model once its wrapper is gone. The oracle is stock
autograd on a deep copy."""

from __future__ import annotations

import copy
import gc
import io
import pickle

import pytest
import torch
from conftest import ROUTE_ALL, TiedLM, assert_same_grads
from torch import nn
from torch.nn.modules import module as torch_module

import flatgrad
from flatgrad._torch_version import torch_release
from flatgrad._watch import is_watched


def _global_hooks() -> tuple[int, int, int, int]:
    return (
        len(torch_module._global_parameter_registration_hooks),
        len(torch_module._global_module_registration_hooks),
        len(torch_module._global_buffer_registration_hooks),
        len(torch_module._global_forward_hooks) + len(torch_module._global_forward_pre_hooks),
    )


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, 13, (3, 5), generator=torch.Generator().manual_seed(step))


def test_no_process_wide_hook_while_wrapped_and_the_model_is_plain_again_once_the_wrapper_is_gone():
    before = _global_hooks()
    model = TiedLM().double()
    oracle = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    assert _global_hooks() == before
    flat(_tokens(0)).backward()
    assert "forward" in model.proj.__dict__  # routed while wrapped
    del flat
    gc.collect()
    assert _global_hooks() == before
    for module in model.modules():
        assert type(module._parameters) is dict and type(module._modules) is dict
        assert "forward" not in module.__dict__, type(module).__name__  # torch's own forward again
    assert not is_watched(model.modules())
    model.zero_grad()
    loss = model(_tokens(1))
    loss.backward()
    oracle(_tokens(1)).backward()
    assert "flatgrad" not in type(model.proj(torch.zeros(1, 8, dtype=torch.float64)).grad_fn).__module__
    for p, q in zip(model.parameters(), oracle.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_a_model_wrapped_again_after_its_wrapper_is_gone_is_watched_and_routed_again():
    model = TiedLM().double()
    oracle = copy.deepcopy(model)
    first = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    first(_tokens(0)).backward()
    del first
    gc.collect()
    model.zero_grad()
    second = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    assert is_watched(model.modules())
    assert "forward" in model.proj.__dict__
    second(_tokens(1)).backward()
    oracle(_tokens(1)).backward()
    assert_same_grads(second, oracle)
    generation = second._engine.watch.generation
    model.extra = nn.Linear(8, 8).double()  # seen by the wrapper alive
    assert second._engine.watch.generation != generation
    del second
    gc.collect()
    assert not is_watched(model.modules())
    assert "forward" not in model.proj.__dict__


class _Grows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.slot = nn.Module()  # no parameters yet: registered into later

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x)
        for name, param in self.slot.named_parameters():
            out = out * param.sum() if name else out
        return out.square().sum()


def test_a_parameter_registered_later_in_a_module_without_parameters_lands_in_the_buffer():
    """A submodule that held no parameter at wrap time is watched too: a parameter registered
    into it afterwards gets a slot at the next forward (no flat op in between)."""
    model = _Grows().double()
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    oracle = copy.deepcopy(model)
    x = torch.randn(3, 4, dtype=torch.float64)
    flat(x).backward()
    for module in (model, oracle):
        module.slot.scale = nn.Parameter(torch.full((2,), 0.5, dtype=torch.float64))
        module.zero_grad()
    flat(x).backward()
    oracle(x).backward()
    assert_same_grads(flat, oracle)


def test_registrations_in_models_flatgrad_does_not_wrap_are_not_seen():
    flat = flatgrad.FlatGrad(TiedLM().double(), config=ROUTE_ALL)
    generation = flat._engine.watch.generation
    other = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    other.append(nn.Linear(3, 3))
    assert flat._engine.watch.generation == generation
    assert not is_watched(other.modules())


def test_copies_and_pickles_of_a_wrapped_model_hold_plain_dicts():
    model = TiedLM().double()
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = [copy.deepcopy(model), pickle.loads(pickle.dumps(model)), torch.load(buffer, weights_only=False)]
    for other in copies:
        assert not is_watched(other.modules())
    twin = copy.deepcopy(flat)  # a copied wrapper watches its own copy of the model
    assert is_watched(twin.module.modules()) and twin.module is not model
    del flat
    gc.collect()
    assert not is_watched(model.modules())


def test_functional_call_is_not_a_change_and_a_module_dict_replaced_whole_is_watched_again():
    """`torch.func.functional_call`'s temporaries are not counted (the layout stays);
    ``del sequential[i]`` replaces the container's ``_modules`` dict as a whole, and the
    next forward watches the new one."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1), nn.Linear(1, 1)).double()
    oracle = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    x = torch.randn(3, 4, dtype=torch.float64)
    generation, store = flat._engine.watch.generation, flat._engine.store
    params = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    torch.func.functional_call(flat, params, (x,)).sum().backward()
    assert flat._engine.watch.generation == generation and flat._engine.store is store
    del model[3]
    del oracle[3]
    flat(x).sum().backward()
    assert is_watched([model])
    generation = flat._engine.watch.generation
    added = nn.Linear(1, 1).double()
    oracle.append(copy.deepcopy(added))
    model.append(added)
    assert flat._engine.watch.generation != generation
    flat.zero_grad()
    flat(x).sum().backward()
    oracle(x).sum().backward()
    assert_same_grads(flat, oracle)


def test_a_container_emptied_by_nothing_then_grown_is_seen_at_the_next_forward():
    """``del seq[n:]`` with nothing to delete writes no key but replaces ``_modules`` as a
    whole: a layer appended afterwards still gets its slot at the next forward."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)).double()
    oracle = copy.deepcopy(model)
    flat = flatgrad.FlatGrad(model, config=ROUTE_ALL)
    x = torch.randn(3, 4, dtype=torch.float64)
    flat(x).sum().backward()
    added = nn.Linear(1, 1).double()
    for module, layer in ((model, added), (oracle, copy.deepcopy(added))):
        del module[2:]
        module.append(layer)
        module.zero_grad()
    flat(x).sum().backward()
    oracle(x).sum().backward()
    assert len(flat._engine.store.params) == 6  # laid out by the forward, before any flat op
    assert_same_grads(flat, oracle)


@pytest.mark.skipif(
    torch_release(torch.__version__) == (2, 4),
    reason="torch 2.4's Dynamo cannot trace torch.func.functional_call under fullgraph=True, "
    "on a stock model too (Unsupported: call_function args: NNModuleVariable() ...)",
)
def test_functional_call_on_a_wrapped_model_compiles_with_fullgraph():
    """Writes that Dynamo traces (functional_call's swaps) are not counted and add no break."""
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    flat = flatgrad.FlatGrad(model)
    params = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    generation = flat._engine.watch.generation

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, p, (x,)).sum()

    compiled = torch.compile(loss, backend="eager", fullgraph=True)
    x = torch.randn(4, 8)
    compiled(params, x).backward()
    expected = {n: torch.autograd.grad(loss(params, x), p)[0] for n, p in params.items()}
    for name, param in params.items():
        torch.testing.assert_close(param.grad, expected[name])
    assert flat._engine.watch.generation == generation
    torch._dynamo.reset()
