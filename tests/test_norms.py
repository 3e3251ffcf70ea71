"""`flatgrad._norms`: gradient norms within 1e-6 of the float64 norm at any buffer size.

The oracle is the float64 norm of the same gradient values. A single float32
`vector_norm` over a flat buffer drifts with its size on the CPU (1e-5 at 1M elements,
1e-3 at 20M); chunked partial norms combined in float64 stay within ~1e-9 for float32
gradients and ~1e-7 for bfloat16 ones (a float32 sum of 1Ki squares each). Each case also
checks that the plain norm is off by more than the bound at its size, so the test can fail.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import flatgrad
from flatgrad import _norms


class _Vector(nn.Module):
    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(numel, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(7, dtype=dtype))  # a second slot, after padding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * x).sum() + self.bias.sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("numel", [1_000_000, 6_600_000, 20_000_000], ids=["1M", "6.6M", "20M"])
def test_grad_norm_and_clip_are_within_1e_6_of_the_float64_norm(numel, dtype):
    flat = flatgrad.FlatGrad(_Vector(numel, dtype))
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(dtype) + 0.5
    flat(x).backward()
    grads = [p.grad for p in flat.parameters()]
    exact = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    ours = flat.grad_norm()
    assert ours.dtype == torch.float32  # bfloat16 gradients get a float32 norm, not 3 digits
    assert abs(float(ours) / exact - 1) < 1e-6
    plain = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]))
    if numel >= 6_600_000 or dtype == torch.bfloat16:
        assert abs(float(plain) / exact - 1) > 1e-6  # what one vector_norm per buffer gives
    total = flat.clip_grad_norm_(exact / 2)
    assert abs(float(total) / exact - 1) < 1e-6
    clipped = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2  # bfloat16 rounds the scaled values
    assert abs(clipped / (exact / 2) - 1) < tolerance


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf, -math.inf, 0.0, -1.0])
def test_vector_norm_equals_torchs_for_every_order(norm_type):
    x = torch.randn(
        3 * _norms._CHUNK_NUMEL + 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
    torch.testing.assert_close(
        _norms.vector_norm(x, norm_type), torch.linalg.vector_norm(x, norm_type), rtol=1e-13, atol=0
    )


def test_vector_norm_of_sparse_and_complex_tensors():
    dense = torch.zeros(50, 3, dtype=torch.float64)
    dense[[1, 7, 7]] = torch.randn(3, 3, dtype=torch.float64)
    rows = torch.tensor([[1, 7, 7]])
    sparse = torch.sparse_coo_tensor(rows, dense[[1, 7, 7]], (50, 3), check_invariants=False)  # uncoalesced
    torch.testing.assert_close(_norms.vector_norm(sparse, 2.0), torch.linalg.vector_norm(sparse.to_dense()))
    z = torch.randn(2 * _norms._CHUNK_NUMEL + 1, dtype=torch.complex128)
    torch.testing.assert_close(_norms.vector_norm(z, 2.0), torch.linalg.vector_norm(z), rtol=1e-13, atol=0)
    assert _norms.norm_dtype(torch.complex64) == torch.float32
    assert _norms.norm_dtype(torch.float16) == torch.float32
    assert _norms.norm_dtype(torch.float64) == torch.float64


@pytest.mark.parametrize("numel", [212, 5 * 1024 + 3])
@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0])
def test_complex64_norms_are_taken_in_complex128(norm_type, numel):
    """A complex64 gradient's norm is within 1e-12 of the float64 norm of its values (each
    ``|z|`` taken in float64): in float32, ``|z|`` is one rounding each and the sum of 212
    of them was 2.7e-7 off, less exact than stock's per-tensor norms."""
    z = torch.randn(numel, dtype=torch.complex64, generator=torch.Generator().manual_seed(0)) * 3
    exact = torch.linalg.vector_norm(z.to(torch.complex128), norm_type)
    assert (torch.linalg.vector_norm(z, norm_type).double() - exact).abs() / exact > 1e-9  # (it can fail)
    torch.testing.assert_close(_norms.vector_norm(z, norm_type), exact, rtol=1e-12, atol=0)


def test_bfloat16_is_upcast_exactly():
    x = torch.randn(5000, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    x[:4] = torch.tensor([float("inf"), -0.0, float("nan"), 1e-40])  # specials and a subnormal
    assert torch.equal(_norms._upcast(x).view(torch.int32), x.float().view(torch.int32))
