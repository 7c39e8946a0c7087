"""Hadamard: the reference is orthonormal and matches the Sylvester matrix; the Triton
``rotate`` (one kernel, used on Q by the attention backend) is bit-identical to it."""

from __future__ import annotations

import pytest
import torch

from deepwell.kernels.hadamard import fwht, matrix
from deepwell.kernels.hadamard import triton_fn

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("d", [64, 128, 256])
def test_reference_matches_matrix_and_is_an_involution(d):
    x = torch.randn(5, d, dtype=torch.float64)
    assert torch.allclose(fwht(x).double(), x @ matrix(d), atol=1e-5)
    assert torch.allclose(fwht(fwht(x)).double(), x, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_triton_rotate_is_bit_identical(d, dtype):
    gen = torch.Generator().manual_seed(d)
    x = (torch.randn(3, 7, d, generator=gen) * 3).to(dtype).to(DEV)  # 21 rows: a partial block
    got = triton_fn.rotate(x)
    want = fwht(x).to(dtype)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # same bits


def test_triton_rotate_rejects_bad_sizes():
    with pytest.raises(ValueError, match="hadamard size"):
        triton_fn.rotate(torch.zeros(2, 48))


@pytest.mark.parametrize("d", [64, 256])
def test_block_transform_is_one_hadamard_per_16_elements(d):
    """``fwht(x, 16)``: ``I (x) H_16`` (each 16-element block on its own), its own inverse, and the
    same values as the whole transform's first four butterfly stages; the Triton ``rotate`` of
    size 16 gives the same bits."""
    gen = torch.Generator().manual_seed(d + 16)
    x = torch.randn(9, d, generator=gen)
    want = x.double() @ torch.block_diag(*[matrix(16)] * (d // 16))
    got = fwht(x, 16)
    assert torch.allclose(got.double(), want, atol=1e-5)
    assert torch.allclose(fwht(got, 16), x, atol=1e-5)
    assert torch.equal(fwht(x, d), fwht(x))
    assert torch.equal(got.view(9, d // 16, 16), fwht(x.view(9, d // 16, 16)))
    rot = triton_fn.rotate(x.to(torch.bfloat16).to(DEV), 16)
    assert torch.equal(rot.view(torch.uint8), fwht(x.to(torch.bfloat16).to(DEV), 16).to(torch.bfloat16).view(torch.uint8))
    with pytest.raises(ValueError, match="hadamard size"):
        fwht(x, 24)
    with pytest.raises(ValueError, match="hadamard size"):
        triton_fn.rotate(x, 512)
