"""write_kv_cache: the Triton kernel (interpreted) against its torch twin, byte for byte."""

import pytest
import torch
import triton
import triton.language as tl
from kvsim import KVSim

from kvmesh.kernels.cache_write import (
    _round_to_e4m3,
    write_kv_cache_torch,
    write_kv_cache_triton,
)
from kvmesh.kernels.quant import dequantize_pages

FORMATS = ["fp32", "fp16", "fp8", "int8", "int4"]


@triton.jit
def _round_e4m3_kernel(x_ptr, y_ptr, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(y_ptr + o, _round_to_e4m3(tl.load(x_ptr + o)))


def _run_both(sim, steps, dtype):
    """Apply each step with both twins on twin copies of the state; compare all bytes."""
    buf_t, res_t = sim.buf.clone(), None if sim.residual is None else sim.residual.clone()
    for new in steps:
        kw = sim.step(new, dtype)
        write_kv_cache_torch(**kw)  # on sim.buf / sim.residual
        rk, rv = sim.residual_kv(res_t)
        kw.update(cache=sim.views(buf_t))
        if rk is not None:
            kw.update(residual_k=rk, residual_v=rv)
        write_kv_cache_triton(**kw)
        assert torch.equal(buf_t, sim.buf), f"pool bytes differ after step {new}"
        if res_t is not None:
            assert torch.equal(res_t, sim.residual), f"residual differs after step {new}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_write_matches_torch_bytes(fmt, dtype):
    sim = KVSim(fmt, H=2, D=64, bs=16, seed=hash(fmt) % 1000)
    # a prefill whose tail page stays partial, chunks that complete pages from residual and
    # new tokens at once, single-token decode steps, one request idle (0 tokens)
    _run_both(sim, [[21, 16, 5], [1, 0, 11], [30, 3, 1], [1, 1, 1]], dtype)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_write_odd_head_size_and_small_block(fmt):
    D = 32 if fmt == "int4" else 24  # int4 needs D % 32 == 0 (or D < 32)
    sim = KVSim(fmt, H=3, D=D, bs=8, num_pages=30, seed=3)
    _run_both(sim, [[13, 8, 2], [3, 9, 7]], torch.float32)


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
def test_completed_pages_hold_quantized_full_precision_tokens(fmt):
    """The pages that filled hold exactly quantize_pages of the tokens the requests sent."""
    from kvmesh.kernels.quant import quantize_pages

    sim = KVSim(fmt, H=2, D=64, bs=16, seed=7)
    for new in ([20, 9, 33], [12, 7, 1]):
        write_kv_cache_triton(**sim.step(new))
    views = sim.views()
    for req in sim.reqs:
        full = req.ctx // sim.bs
        ids = torch.tensor(req.pages[:full])
        want = quantize_pages(
            fmt,
            torch.stack(req.k[: full * sim.bs]).view(full, sim.bs, sim.H, sim.D),
            torch.stack(req.v[: full * sim.bs]).view(full, sim.bs, sim.H, sim.D),
        )
        for name, t in want.items():
            assert torch.equal(views[name][ids].view(torch.uint8), t.view(torch.uint8)), name
        k2, _ = dequantize_pages(fmt, {n: vw[ids] for n, vw in views.items()})
        assert k2.shape == (full, sim.bs, sim.H, sim.D)
        tail = req.ctx % sim.bs
        if tail:
            rk, _ = sim.residual_kv()
            got = rk[req.slot, :tail]
            assert torch.equal(got, torch.stack(req.k[full * sim.bs :]))


def test_bad_metadata_is_named():
    sim = KVSim("int8", H=2, D=64)
    kw = sim.step([3, 1, 2])
    kw["residual_slots"] = kw["residual_slots"].to(torch.int32)
    with pytest.raises(ValueError, match="residual_slots must be int64"):
        write_kv_cache_triton(**kw)
    kw = sim.step([1, 1, 1])
    kw["cache"] = {"k": kw["cache"]["k"]}
    with pytest.raises(ValueError, match="needs views"):
        write_kv_cache_torch(**kw)


def test_fp8_rounding_matches_torch_on_every_value_and_tie():
    """The write kernel rounds to e4m3 itself (the interpreter's fp8 cast is wrong); check it
    against torch's cast on all 254 finite values, every midpoint (ties to even) and values
    just beside them."""
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    vals = vals[vals.isfinite()].unique()  # sorted, -448 .. 448
    mids = (vals[1:] + vals[:-1]) / 2
    eps = torch.tensor(2.0**-20)
    x = torch.cat([vals, mids, mids + eps * mids.abs().clamp_min(1e-3), mids * (1 - 2.0**-20)])
    x = x.clamp(-448, 448)
    n = triton.next_power_of_2(x.numel())
    xp = torch.zeros(n)
    xp[: x.numel()] = x
    y = torch.empty(n)
    _round_e4m3_kernel[(1,)](xp, y, N=n)
    torch.testing.assert_close(y[: x.numel()], x.to(torch.float8_e4m3fn).float(), rtol=0, atol=0)
