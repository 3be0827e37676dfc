"""PackedLinear (MKL-prepacked weights) against its torch twin, F.linear."""

import pytest
import torch
import torch.nn.functional as F

from kvmesh.kernels.cpu_linear import PackedLinear, mkl_packing_available


@pytest.mark.parametrize("rows", [1, 7, 9, 16, 31, 32, 33, 48, 64, 65, 100, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias):
    """Rows padded to a multiple of 32 and multiplied 32 at a time: the padding never shows."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 96, generator=g)
    b = torch.randn(200, generator=g) if bias else None
    x = torch.randn(rows, 96, generator=g)
    lin = PackedLinear(w, b)
    y = lin(x)
    assert y.shape == (rows, 200) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_strided_rows_are_accepted():
    w = torch.randn(64, 32)
    x = torch.randn(40, 64)[:, ::2]  # (40, 32), not contiguous
    torch.testing.assert_close(PackedLinear(w)(x), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_packing_is_used_on_this_machine():
    # the CI machines are x86 with torch's MKL build: the fast path must really be taken
    assert mkl_packing_available()
    assert PackedLinear(torch.randn(8, 8)).packed is not None


def test_other_dtypes_fall_back_to_f_linear():
    w = torch.randn(16, 8, dtype=torch.bfloat16)
    lin = PackedLinear(w)
    assert lin.packed is None
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    assert torch.equal(lin(x), F.linear(x, w))
