"""The C prefill kernel over two runs of keys (``kvmesh_prefill_attention_runs_f32``), the
own-page view of a chunk over a quantized cache, against its twin: ``own_page_mask`` + SDPA
over ``cat(quantized run, exact run)`` in float64. Every build this host runs (native, AVX2
where the CPU has it, AVX-512 without DQ where it has AVX-512F, portable) and the scalar
loop forced on the native build; W = 1, 2, 3, a restored prefix (``ring_from`` > 0), chunks
that start mid-page, a fresh chunk, a sliding window, G = 1, 3, 4 and 8 (MQA too), D = 32,
64, 80, 96 and 128, block sizes that cut pages. Bound: 2e-5 absolute on unit-normal
inputs, as the causal kernel's tests."""

import pytest
import torch
import torch.nn.functional as F
from builds import avx512_no_dq_builds, host_builds

from kvmesh.kernels.cpu_attention import prefill_attention_runs_cpu
from kvmesh.worker.attention.base import PrefillSpan
from kvmesh.worker.attention.own_page import own_page_geometry, own_page_mask, own_page_ranges

ATOL = 2e-5
BS = 16
BUILDS = [*host_builds(), *avx512_no_dq_builds()]


def _span(q_len: int, ctx: int, W: int, ring_from: int = 0) -> PrefillSpan:
    return PrefillSpan(
        start=0,
        q_len=q_len,
        context_len=ctx,
        block_table=torch.zeros(1, dtype=torch.int64),
        request_slot=0,
        residual_pages=W,
        ring_from=ring_from,
    )


def _case(span, Hq, Hkv, D, window=None, seed=0):
    """q and the two runs for ``span`` (random, unit normal), the ranges, and the float64
    twin: SDPA over cat(A, B) under ``own_page_mask``."""
    lq, _, lx = own_page_geometry(span, BS)
    g = torch.Generator().manual_seed(seed)
    n = span.q_len
    q = torch.randn(n, Hq, D, generator=g)
    ka, va = torch.randn(lq, Hkv, D, generator=g), torch.randn(lq, Hkv, D, generator=g)
    kb, vb = torch.randn(lx, Hkv, D, generator=g), torch.randn(lx, Hkv, D, generator=g)
    mask = own_page_mask(span, BS, torch.device("cpu"), window)  # (n, lq + lx)
    kk, vv = torch.cat([ka, kb]), torch.cat([va, vb])
    qq, kk, vv = (t.double().transpose(0, 1)[None] for t in (q, kk, vv))
    want = F.scaled_dot_product_attention(
        qq, kk, vv, attn_mask=mask, scale=D**-0.5, enable_gqa=True
    )[0].transpose(0, 1)
    return q, (ka, va), (kb, vb), own_page_ranges(span, BS, window), want.float()


SPANS = [  # (q_len, context_len, W, ring_from)
    (300, 300, 2, 0),  # a fresh chunk: twice fp32's keys in the masked SDPA
    (200, 333, 2, 0),  # a later chunk starting mid-page, a partial last page
    (77, 500, 1, 0),  # W = 1: the own page only
    (150, 411, 3, 0),  # W = 3
    (90, 250, 2, 10),  # a restored prefix: pages before 10 read quantized
    (37, 219, 3, 11),  # restored, the window cut at ring_from, mid-page start
    (5, 21, 2, 0),  # a short chunk
    (256, 1000, 2, 0),  # a late chunk: run A over several 256-key blocks
]


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("q_len,ctx,W,ring_from", SPANS)
@pytest.mark.parametrize("Hq,Hkv,D", [(9, 3, 64), (4, 4, 128)])
def test_matches_masked_sdpa(libraries, build, q_len, ctx, W, ring_from, Hq, Hkv, D):
    span = _span(q_len, ctx, W, ring_from)
    q, a, b, ranges, want = _case(span, Hq, Hkv, D)
    got = prefill_attention_runs_cpu(q, a, b, ranges, D**-0.5, library=libraries[build])
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("q_len,ctx,W,ring_from", [SPANS[3], SPANS[5]])
@pytest.mark.parametrize(
    "Hq,Hkv,D", [(8, 1, 64), (16, 2, 64), (12, 2, 80), (6, 2, 96), (8, 4, 32)]
)  # MQA, G = 8, and the head sizes other model families use
def test_head_geometries(libraries, build, q_len, ctx, W, ring_from, Hq, Hkv, D):
    span = _span(q_len, ctx, W, ring_from)
    q, a, b, ranges, want = _case(span, Hq, Hkv, D, seed=1)
    got = prefill_attention_runs_cpu(q, a, b, ranges, D**-0.5, library=libraries[build])
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("window", [1, 20, 64, 100])
def test_sliding_window(libraries, build, window):
    """A window cuts both runs (and may leave a query only its own key)."""
    span = _span(130, 290, 2)
    q, a, b, ranges, want = _case(span, 6, 2, 128, window=window, seed=1)
    got = prefill_attention_runs_cpu(q, a, b, ranges, 128**-0.5, library=libraries[build])
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


@pytest.mark.parametrize("bq,bk", [(7, 64), (1, 128), (50, 192), (32, 16), (64, 32)])
def test_block_sizes_and_scalar_loop(libraries, bq, bk):
    """Query and key blocks that cut pages and ranges (a bk the vector path cannot take runs
    the scalar loop), and the scalar loop forced on the native build."""
    span = _span(150, 411, 2, 3)
    q, a, b, ranges, want = _case(span, 9, 3, 64, seed=2)
    lib = libraries["native"]
    got = prefill_attention_runs_cpu(q, a, b, ranges, 0.125, library=lib, block_q=bq, block_k=bk)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    got = prefill_attention_runs_cpu(q, a, b, ranges, 0.125, library=lib, force_scalar=True)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


def test_ranges_are_the_mask():
    """``own_page_ranges`` selects exactly the keys ``own_page_mask`` does."""
    for q_len, ctx, W, ring_from in SPANS:
        span = _span(q_len, ctx, W, ring_from)
        lq, _, lx = own_page_geometry(span, BS)
        for window in (None, 7, 40):
            r = own_page_ranges(span, BS, window)
            j = torch.arange(lq + lx)[None, :]
            from_ranges = ((j >= r[:, :1]) & (j < r[:, 1:2])) | (
                (j >= lq + r[:, 2:3]) & (j < lq + r[:, 3:4])
            )
            assert torch.equal(from_ranges, own_page_mask(span, BS, torch.device("cpu"), window))


def test_bad_ranges_are_named(libraries):
    lib = libraries["native"]
    span = _span(20, 60, 2)
    q, a, b, ranges, _ = _case(span, 9, 3, 64)
    bad = ranges.clone()
    bad[3, 3] = b[0].shape[0] + 1  # past run B
    with pytest.raises(ValueError, match="within the runs"):
        prefill_attention_runs_cpu(q, a, b, bad, 0.125, library=lib)
    bad = ranges.clone()
    bad[0] = torch.tensor([2, 2, 5, 5])  # a query reading nothing
    with pytest.raises(ValueError, match="at least one key"):
        prefill_attention_runs_cpu(q, a, b, bad, 0.125, library=lib)
    with pytest.raises(ValueError, match=r"\(20, 4\) int64"):
        prefill_attention_runs_cpu(q, a, b, ranges.int(), 0.125, library=lib)
    with pytest.raises(ValueError, match="float32"):
        prefill_attention_runs_cpu(q.double(), a, b, ranges, 0.125, library=lib)
    with pytest.raises(ValueError, match="KV heads"):
        prefill_attention_runs_cpu(q, a, (b[0][:, :1], b[1][:, :1]), ranges, 0.125, library=lib)
