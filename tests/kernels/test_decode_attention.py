"""Paged decode attention: Triton (interpreted) vs its torch twin vs a dense reference."""

import math

import pytest
import torch
from kvsim import KVSim, expected_kv

from kvmesh.kernels.decode_attention import (
    paged_decode_attention_torch,
    paged_decode_attention_triton,
)
from kvmesh.kernels.page_format import FLOAT_FORMATS

TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


def _filled_sim(fmt, Hkv, D, steps, bs=16, seed=0, **kw):
    from kvmesh.kernels.cache_write import write_kv_cache_torch

    sim = KVSim(fmt, H=Hkv, D=D, bs=bs, seed=seed, num_reqs=len(steps[0]), **kw)
    for new in steps:
        write_kv_cache_torch(**sim.step(new))
    return sim


def _dense_decode(q, sim, scale, window=None):
    """Attention of q (B, Hq, D) over expected_kv, one sequence at a time, in fp64."""
    outs = []
    for i, req in enumerate(sim.reqs):
        k, v = expected_kv(sim, req)  # (ctx, Hkv, D)
        ctx = k.shape[0]
        lo = 0 if window is None else max(0, ctx - window)
        k, v = k[lo:].double(), v[lo:].double()
        G = q.shape[1] // k.shape[1]
        kk, vv = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)  # (L, Hq, D)
        s = torch.einsum("hd,lhd->hl", q[i].double(), kk) * scale
        outs.append(torch.einsum("hl,lhd->hd", s.softmax(-1), vv))
    return torch.stack(outs)


def _args(sim, q, scale, window=None, splits=None):
    tables, ctx, slots = sim.read_meta()
    rk, rv = sim.residual_kv()
    return dict(
        q=q,
        fmt=sim.fmt,
        cache=sim.views(),
        residual_k=rk,
        residual_v=rv,
        block_tables=tables,
        context_lens=ctx,
        residual_slots=slots,
        scale=scale,
        sliding_window=window,
        num_splits=splits,
    )


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "fp8", "int8", "int4"])
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (8, 2), (5, 1)])
def test_decode_triton_matches_torch(fmt, Hq, Hkv):
    D = 32
    # odd lengths: a tail page for some, exactly full pages for another, one of one token
    sim = _filled_sim(fmt, Hkv, D, [[37, 32, 1], [1, 0, 0], [1, 16, 0]], seed=Hq)
    g = torch.Generator().manual_seed(Hq * 7 + Hkv)
    q = torch.randn(3, Hq, D, generator=g)
    scale = 1 / math.sqrt(D)
    want = paged_decode_attention_torch(**_args(sim, q, scale))
    for splits in (1, 3):
        got = paged_decode_attention_triton(**_args(sim, q, scale, splits=splits))
        torch.testing.assert_close(got, want, rtol=TOL[torch.float32], atol=TOL[torch.float32])


@pytest.mark.parametrize("fmt", ["fp16", "int8", "int4"])
def test_decode_fp16_queries_sliding_window_many_splits(fmt):
    Hq, Hkv, D = 8, 2, 64
    sim = _filled_sim(fmt, Hkv, D, [[50, 21], [3, 2]], seed=11)
    q = torch.randn(2, Hq, D, generator=torch.Generator().manual_seed(5)).half()
    for window, splits in ((None, 2), (20, 5), (5, 3)):
        args = _args(sim, q, 0.125, window=window, splits=splits)
        want = paged_decode_attention_torch(**args)
        got = paged_decode_attention_triton(**args)
        assert got.dtype == torch.float16
        torch.testing.assert_close(got, want, rtol=TOL[torch.float16], atol=TOL[torch.float16])


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16", "fp8", "int8", "int4"])
def test_decode_torch_twin_matches_dense_reference(fmt):
    """The twin reads exactly the stored tokens: quantized pages plus the residual tail."""
    Hq, Hkv, D = 6, 2, 32
    sim = _filled_sim(fmt, Hkv, D, [[40, 17, 3], [1, 1, 1]], seed=2)
    q = torch.randn(3, Hq, D, generator=torch.Generator().manual_seed(1))
    for window in (None, 9):
        got = paged_decode_attention_torch(**_args(sim, q, 0.2, window=window))
        want = _dense_decode(q, sim, 0.2, window).float()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_decode_null_page_padding_and_out_argument():
    """Padded block-table columns (the null page) are never attended; out is filled in place."""
    sim = _filled_sim("int4", 2, 32, [[5, 33]], seed=4)
    q = torch.randn(2, 4, 32)
    args = _args(sim, q, 0.3, splits=4)
    pad = torch.zeros(2, 3, dtype=torch.int64)  # extra null-page columns
    args["block_tables"] = torch.cat([args["block_tables"], pad], 1)
    out = torch.full_like(q, float("nan"))
    args["out"] = out
    res = paged_decode_attention_triton(**args)
    assert res is out and not out.isnan().any()
    torch.testing.assert_close(out, _dense_decode(q, sim, 0.3).float(), rtol=1e-4, atol=1e-4)


def test_float_formats_need_no_residual():
    assert "fp16" in FLOAT_FORMATS
    sim = _filled_sim("fp16", 1, 32, [[3]], seed=1)
    args = _args(sim, torch.randn(1, 2, 32), 0.5)
    args.update(residual_k=None, residual_v=None, residual_slots=None)
    torch.testing.assert_close(
        paged_decode_attention_triton(**args), paged_decode_attention_torch(**args)
    )


def test_bad_arguments_are_named():
    sim = _filled_sim("int8", 2, 32, [[3]], seed=1)
    args = _args(sim, torch.randn(1, 4, 32), 0.5)
    with pytest.raises(ValueError, match="block_tables must be int64"):
        paged_decode_attention_triton(**{**args, "block_tables": args["block_tables"].int()})
    with pytest.raises(ValueError, match="residual_slots"):
        paged_decode_attention_triton(**{**args, "residual_slots": None})
    with pytest.raises(ValueError, match="multiple of 2"):
        paged_decode_attention_triton(**{**args, "q": torch.randn(1, 3, 32)})


@pytest.mark.parametrize("fmt", ["fp16", "fp8", "int8"])
def test_decode_head_size_not_a_power_of_two(fmt):
    sim = _filled_sim(fmt, 2, 48, [[19, 40]], seed=6)  # BLOCK_D = 64, 16 lanes masked
    q = torch.randn(2, 6, 48, generator=torch.Generator().manual_seed(2))
    args = _args(sim, q, 48**-0.5, splits=2)
    want = paged_decode_attention_torch(**args)
    torch.testing.assert_close(paged_decode_attention_triton(**args), want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(want, _dense_decode(q, sim, 48**-0.5).float(), rtol=1e-4, atol=1e-4)
