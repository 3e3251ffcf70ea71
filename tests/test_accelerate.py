"""`flatgrad.accelerate.attach` in one process: the DDP handler it leaves on the accelerator
(what ``accelerator.prepare`` builds DDP from) and its errors. The 2-process run under
``accelerate launch``, against stock Accelerate + DDP, is tests/test_frameworks.py's."""

from __future__ import annotations

import pytest
import torch
from conftest import TiedLM

import flatgrad

accelerate = pytest.importorskip("accelerate", reason="pip install -e '.[dev,frameworks]'")
flatgrad_accelerate = pytest.importorskip("flatgrad.accelerate")


def test_attach_keeps_the_handlers_settings_and_adds_the_wrappers_ddp_kwargs():
    """The handler's DDP arguments are the given handler's plus `ddp_kwargs()` (what the hand-
    written recipe passed), with no comm state among them; the state it returns is the one
    the handler registers, on the wrapper given."""
    flat = flatgrad.FlatGrad(TiedLM().double())
    given = accelerate.DistributedDataParallelKwargs(find_unused_parameters=True, broadcast_buffers=False)
    accelerator = accelerate.Accelerator(cpu=True, kwargs_handlers=[given])
    state = flatgrad_accelerate.attach(accelerator, flat)
    handler = accelerator.ddp_handler
    assert isinstance(handler, flatgrad_accelerate.FlatGradDDPKwargs)
    assert isinstance(handler, accelerate.DistributedDataParallelKwargs)  # Accelerate's own kind
    expected = {**given.to_kwargs(), **flat.ddp_kwargs()}
    assert handler.to_kwargs() == expected == {
        "find_unused_parameters": True, "broadcast_buffers": False, **flat.ddp_kwargs()
    }  # fmt: skip
    assert handler.flatgrad_comm_state is state and state.model is flat and state.num_calls == 0
    plain = accelerate.Accelerator(cpu=True)  # no handler given: Accelerate's defaults
    flatgrad_accelerate.attach(plain, flat, reduce_dtype=torch.bfloat16)
    assert plain.ddp_handler.to_kwargs() == flat.ddp_kwargs()
    assert plain.ddp_handler.flatgrad_comm_state.reduce_dtype is torch.bfloat16


def test_attach_errors():
    flat = flatgrad.FlatGrad(TiedLM().double())
    accelerator = accelerate.Accelerator(cpu=True)
    with pytest.raises(TypeError, match="accelerator must be an accelerate.Accelerator, got TiedLM"):
        flatgrad_accelerate.attach(flat, flat)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="flat must be a flatgrad.FlatGrad, got TiedLM"):
        flatgrad_accelerate.attach(accelerator, TiedLM())  # type: ignore[arg-type]
    hook = accelerate.utils.DDPCommunicationHookType.BF16
    compressing = accelerate.Accelerator(
        cpu=True, kwargs_handlers=[accelerate.DistributedDataParallelKwargs(comm_hook=hook)]
    )
    with pytest.raises(ValueError, match="comm_hook and comm_wrapper must be 'no' with flatgrad's hook"):
        flatgrad_accelerate.attach(compressing, flat)
    with pytest.raises(ValueError, match="reduce_dtype must be"):
        flatgrad_accelerate.attach(accelerator, flat, reduce_dtype=torch.float64)


@pytest.fixture
def fresh_accelerator_state():
    """Accelerate keeps one AcceleratorState per process and refuses another mixed precision
    once it is set: cleared before and after (what accelerate's own test cases do; nothing
    public does it)."""
    accelerate.state.AcceleratorState._reset_state()
    yield
    accelerate.state.AcceleratorState._reset_state()


@pytest.mark.usefixtures("fresh_accelerator_state")
def test_mixed_precision_rewraps_and_unwraps_the_wrappers_forward_as_a_plain_modules():
    """Accelerate's mixed precision wraps ``model.forward.__func__`` in autocast and binds it
    to the model; ``unwrap_model(..., keep_fp32_wrapper=False)`` binds the innermost function
    again. The wrapper's forward (a partial holding the model's signature) takes part as a
    bound method would: the outputs equal the plain model's under each."""
    torch.manual_seed(0)
    plain = TiedLM().double()
    flat = flatgrad.FlatGrad(TiedLM().double())
    flat.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, 13, (2, 6))
    ours = accelerate.Accelerator(cpu=True, mixed_precision="bf16").prepare(flat)
    stock_accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    stock = stock_accelerator.prepare(plain)
    torch.testing.assert_close(ours(tokens), stock(tokens), rtol=0, atol=0)  # the same autocast
    unwrapped = stock_accelerator.unwrap_model(ours, keep_fp32_wrapper=False)
    assert unwrapped is flat
    torch.testing.assert_close(
        flat(tokens), stock_accelerator.unwrap_model(stock, keep_fp32_wrapper=False)(tokens)
    )
