"""PackedLinear (the GEMM each row bucket measured fastest) against its torch twin, F.linear,
with every candidate forced in turn."""

import pytest
import torch
import torch.nn.functional as F

from kvmesh.kernels.autotune import CANDIDATES, GemmTuner
from kvmesh.kernels.cpu_linear import PackedLinear, mkl_packing_available, onednn_available


@pytest.mark.parametrize("mode", [*CANDIDATES, "auto", "exact", "legacy"])
@pytest.mark.parametrize("bias", [False, True])
def test_every_candidate_matches_f_linear(mode, bias):
    """Rows padded to a multiple of 32 (MKL) or run through oneDNN's blocked weight: only
    float rounding differs; ``linear``, ``mkl`` (16 rows up) and ``exact`` are bit-equal."""
    tuner = GemmTuner(None, mode=mode, rounds=1)
    g = torch.Generator().manual_seed(7)
    w = torch.randn(200, 96, generator=g)
    b = torch.randn(200, generator=g) if bias else None
    lin = PackedLinear(w, b, tuner=tuner)
    for rows in (1, 7, 9, 16, 31, 32, 33, 48, 64, 65, 100, 300):
        x = torch.randn(rows, 96, generator=g)
        y = lin(x)
        want = F.linear(x, w, b)
        assert y.shape == (rows, 200) and y.is_contiguous()
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
        if mode in ("linear", "exact") or (mode == "mkl" and rows >= 16):
            assert torch.equal(y, want), f"{mode} at {rows} rows is not bit-equal to F.linear"


def test_strided_rows_are_accepted():
    w = torch.randn(64, 32)
    x = torch.randn(40, 64)[:, ::2]  # (40, 32), not contiguous
    for mode in CANDIDATES:
        lin = PackedLinear(w, tuner=GemmTuner(None, mode=mode))
        torch.testing.assert_close(lin(x), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_packed_paths_exist_and_are_taken_on_this_machine():
    # the CI machines are x86 with torch's MKL/oneDNN build: the fast paths must really run
    assert mkl_packing_available() and onednn_available()
    x = torch.randn(16, 8)
    mkl = PackedLinear(torch.randn(8, 8), tuner=GemmTuner(None, mode="mkl"))
    mkl(x)
    assert mkl.packed is not None and mkl.plan == {16: "mkl"}
    dnn = PackedLinear(torch.randn(8, 8), tuner=GemmTuner(None, mode="onednn"))
    dnn(x)
    assert dnn.onednn_weight is not None and dnn.plan == {16: "onednn"}


def test_other_dtypes_and_empty_batches_fall_back_to_f_linear():
    w = torch.randn(16, 8, dtype=torch.bfloat16)
    lin = PackedLinear(w, tuner=GemmTuner(None, mode="onednn"))
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    assert torch.equal(lin(x), F.linear(x, w))
    assert lin.plan == {} and lin.onednn_weight is None
    f32 = PackedLinear(torch.randn(16, 8), tuner=GemmTuner(None, mode="onednn"))
    assert f32(torch.randn(0, 8)).shape == (0, 16)
