"""The fused elementwise C ops (kernels/cpu_ops.c) against their torch twins, native, AVX2
(native with AVX-512 off: the compiler's AVX2 code for the same loops) and portable builds;
and the engine's C path against the pure torch path on a tiny model."""

import pytest
import torch
from builds import host_builds

from kvmesh.kernels import cpu_native, cpu_ops
from kvmesh.worker import envs

_FLAGS = host_builds()  # native, AVX2 where the CPU has it, portable


@pytest.fixture(scope="module", params=list(_FLAGS))
def lib(request, tmp_path_factory):
    flags = _FLAGS[request.param]
    d = tmp_path_factory.getbasetemp() / "cpu-kernels"  # shared with the other kernel tests
    return cpu_native.CpuLibrary(
        cpu_native.compile_library(build_dir=d, cc=envs.c_compiler(), flags=flags)
    )


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("T,H", [(1, 576), (37, 64), (300, 576)])  # 300 x 576: threaded
def test_rmsnorm_and_residual_add(lib, T, H):
    x, y, w = _randn(T, H, seed=1), _randn(T, H, seed=2) * 3, _randn(H, seed=3)
    want = cpu_ops.rmsnorm_torch(x, w, 1e-5)
    torch.testing.assert_close(
        cpu_ops.rmsnorm_cpu(x, w, 1e-5, library=lib), want, rtol=1e-5, atol=1e-5
    )
    res = x.clone()
    got = cpu_ops.add_rmsnorm_cpu(res, y, w, 1e-6, library=lib)
    assert torch.equal(res, x + y)  # the residual stream, updated in place, bit for bit
    torch.testing.assert_close(got, cpu_ops.rmsnorm_torch(x + y, w, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T,heads,D,W", [(5, 12, 64, 960), (130, 3, 32, 160), (1, 1, 2, 2)])
def test_rotary_in_place_is_bit_equal(lib, T, heads, D, W):
    x = _randn(T, W, seed=4)
    ang = _randn(T, D // 2, seed=5)
    emb = torch.cat((ang, ang), -1)
    cos, sin = emb.cos(), emb.sin()
    sin[:, : D // 2].neg_()
    want = cpu_ops.rotary_torch(x[:, : heads * D].view(T, heads, D), cos[:, None], sin[:, None])
    got = x.clone()
    cpu_ops.rotary_cpu_(got, heads, D, cos[:, None], sin[:, None], library=lib)
    assert torch.equal(got[:, : heads * D].view(T, heads, D), want)
    assert torch.equal(got[:, heads * D :], x[:, heads * D :])  # the v part is untouched


@pytest.mark.parametrize("T,I", [(3, 1536), (64, 1536), (7, 5)])
def test_silu_mul(lib, T, I):
    gu = _randn(T, 2 * I, seed=6) * 4
    torch.testing.assert_close(
        cpu_ops.silu_mul_cpu(gu, library=lib), cpu_ops.silu_mul_torch(gu), rtol=2e-6, atol=2e-6
    )


def test_bad_inputs_are_named(lib):
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="x must be a 2-d float32"):
        cpu_ops.rmsnorm_cpu(x.double(), torch.ones(8), 1e-5, library=lib)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_ops.rmsnorm_cpu(x.t(), torch.ones(4), 1e-5, library=lib)
    with pytest.raises(ValueError, match="weight has 7 values"):
        cpu_ops.rmsnorm_cpu(x, torch.ones(7), 1e-5, library=lib)
    with pytest.raises(ValueError, match="shapes differ"):
        cpu_ops.add_rmsnorm_cpu(x, torch.randn(4, 7), torch.ones(8), 1e-5, library=lib)
    with pytest.raises(ValueError, match="must fit rows"):
        cpu_ops.rotary_cpu_(x, 3, 4, torch.ones(4, 4), torch.ones(4, 4), library=lib)
    with pytest.raises(ValueError, match="even width"):
        cpu_ops.silu_mul_cpu(torch.randn(2, 5), library=lib)
