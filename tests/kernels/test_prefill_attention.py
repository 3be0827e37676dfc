"""Paged prefill attention (chunked, over a cached prefix): Triton vs torch twin vs dense."""

import pytest
import torch
from kvsim import KVSim, expected_kv

from kvmesh.kernels.cache_write import write_kv_cache_torch
from kvmesh.kernels.prefill_attention import (
    paged_prefill_attention_torch,
    paged_prefill_attention_triton,
)


def _prefill_case(fmt, Hq, Hkv, D, history, chunk, seed=0, bs=16, dtype=torch.float32):
    """Requests with cached ``history`` steps, then one step of ``chunk`` new tokens each."""
    sim = KVSim(fmt, H=Hkv, D=D, bs=bs, seed=seed, num_reqs=len(chunk), max_pages_per_req=8)
    for new in history:
        write_kv_cache_torch(**sim.step(new))
    write_kv_cache_torch(**sim.step(chunk))
    tables, ctx, slots = sim.read_meta()
    cu = torch.zeros(len(chunk) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(chunk).cumsum(0)
    q = torch.randn(int(cu[-1]), Hq, D, generator=torch.Generator().manual_seed(seed + 1))
    rk, rv = sim.residual_kv()
    args = dict(
        q=q.to(dtype),
        fmt=fmt,
        cache=sim.views(),
        residual_k=rk,
        residual_v=rv,
        cu_seqlens_q=cu,
        context_lens=ctx,
        block_tables=tables,
        residual_slots=slots,
        scale=D**-0.5,
    )
    return sim, args


def _dense_prefill(sim, args, chunk, window=None):
    q, cu = args["q"].double(), args["cu_seqlens_q"].tolist()
    out = torch.zeros_like(q)
    for i, (req, n) in enumerate(zip(sim.reqs, chunk)):
        if n == 0:
            continue
        k, v = (t.double() for t in expected_kv(sim, req))  # (ctx, Hkv, D)
        G = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
        ctx = req.ctx
        qq = q[cu[i] : cu[i] + n]  # (n, Hq, D)
        s = torch.einsum("thd,lhd->htl", qq, k) * args["scale"]
        qpos = torch.arange(ctx - n, ctx)[:, None]
        kpos = torch.arange(ctx)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
        s = s.masked_fill(~mask, float("-inf"))
        out[cu[i] : cu[i] + n] = torch.einsum("htl,lhd->thd", s.softmax(-1), v)
    return out


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "fp8", "int8", "int4"])
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (8, 2), (5, 1)])
def test_prefill_triton_matches_torch(fmt, Hq, Hkv):
    # span 0: a fresh 19-token prompt; span 1: a 7-token chunk after 30 cached tokens (ends
    # in a partial page); span 2: idle this step (0 tokens); span 3: chunk completing a page
    history = [[0, 30, 5, 9]]
    chunk = [19, 7, 0, 23]
    sim, args = _prefill_case(fmt, Hq, Hkv, 32, history, chunk, seed=Hq + Hkv)
    want = paged_prefill_attention_torch(**args)
    for block_m in (16, 64):
        got = paged_prefill_attention_triton(**args, block_m=block_m, max_query_len=max(chunk))
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("fmt", ["fp16", "int8", "int4"])
def test_prefill_fp16_and_sliding_window(fmt):
    chunk = [21, 12]
    sim, args = _prefill_case(fmt, 8, 2, 64, [[5, 33]], chunk, seed=3, dtype=torch.float16)
    for window in (None, 7, 20):
        args["sliding_window"] = window
        want = paged_prefill_attention_torch(**args)
        got = paged_prefill_attention_triton(**args, block_m=32)
        assert got.dtype == torch.float16
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8", "int8", "int4"])
def test_prefill_torch_twin_matches_dense_reference(fmt):
    chunk = [13, 18, 1]
    sim, args = _prefill_case(fmt, 6, 2, 32, [[0, 16, 40]], chunk, seed=5)
    for window in (None, 10):
        args["sliding_window"] = window
        got = paged_prefill_attention_torch(**args)
        torch.testing.assert_close(
            got, _dense_prefill(sim, args, chunk, window).float(), rtol=1e-4, atol=1e-4
        )


def test_prefill_leaves_rows_outside_spans_alone():
    """Spans may start after decode rows: out rows not covered by a span are untouched."""
    chunk = [5, 9]
    sim, args = _prefill_case("int4", 4, 2, 32, [[3, 0]], chunk, seed=9)
    T = args["q"].shape[0]
    q = torch.cat([torch.randn(2, 4, 32), args["q"]])  # two leading rows of other work
    args.update(q=q, cu_seqlens_q=args["cu_seqlens_q"] + 2)
    out = torch.full_like(q, 7.0)
    paged_prefill_attention_triton(**args, out=out)
    assert (out[:2] == 7.0).all()
    want = paged_prefill_attention_torch(**args)
    torch.testing.assert_close(out[2:], want[2:], rtol=2e-5, atol=2e-5)
    assert out.shape[0] == T + 2
