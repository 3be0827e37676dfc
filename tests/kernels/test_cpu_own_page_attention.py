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

from kvmesh.kernels.cpu_attention import Int4Pool, Int4Run, prefill_attention_runs_cpu
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


def _int4_run(span, Hkv, D, lib, seed=0):
    """Run A of ``span`` as int4 pool pages (out of order in a larger pool, real quantized
    K/V), and the same pages dequantized by ``dequantize_pages`` (the torch twin)."""
    from kvmesh.kernels.cpu_quant import quantize_pages_into
    from kvmesh.kernels.page_format import PageLayout
    from kvmesh.kernels.quant import dequantize_pages

    lq, _, _ = own_page_geometry(span, BS)
    n = lq // BS
    layout = PageLayout("int4", 2, Hkv, D, BS)
    views = layout.views(layout.allocate(n + 7), 1)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, BS, Hkv, D, generator=g) * 2 + torch.randn(Hkv, D, generator=g)
    v = torch.randn(n, BS, Hkv, D, generator=g)
    ids = torch.randperm(n + 7, generator=g)[:n]
    if n:
        quantize_pages_into("int4", k, v, views, ids, library=lib)
    ka, va = dequantize_pages("int4", {c: t[ids] for c, t in views.items()})
    return Int4Run(views, ids), (ka.reshape(-1, Hkv, D), va.reshape(-1, Hkv, D))


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize(
    "q_len,ctx,W,ring_from", [SPANS[0], SPANS[1], SPANS[4], SPANS[6], SPANS[7]]
)  # SPANS[6]: no complete page read quantized (no int4 page at all)
@pytest.mark.parametrize("Hq,Hkv,D", [(9, 3, 64), (4, 2, 128), (6, 3, 32)])
def test_int4_pages_read_in_the_kernel_equal_the_dequantized_run(
    libraries, build, q_len, ctx, W, ring_from, Hq, Hkv, D
):
    """Run A as int4 pages (``Int4Run``, dequantized inside the kernel) gives the bits of the
    float kernel over the same pages dequantized by the torch twin; and the scalar loop's."""
    lib = libraries[build]
    span = _span(q_len, ctx, W, ring_from)
    q, _, b, ranges, _ = _case(span, Hq, Hkv, D, seed=5)
    run, a = _int4_run(span, Hkv, D, lib, seed=6)
    want = prefill_attention_runs_cpu(q, a, b, ranges, D**-0.5, library=lib)
    got = prefill_attention_runs_cpu(q, run, b, ranges, D**-0.5, library=lib)
    assert torch.equal(got, want)
    # one query a block and G = 1: a scratch smaller than a page's K tile but for the guard
    if (Hq, Hkv, D) == (4, 2, 128):
        q2 = torch.cat([q, q], dim=1)[:, :2]
        kw = dict(library=lib, block_q=1)
        want = prefill_attention_runs_cpu(q2, a, b, ranges, D**-0.5, **kw)
        assert torch.equal(prefill_attention_runs_cpu(q2, run, b, ranges, D**-0.5, **kw), want)
    want = prefill_attention_runs_cpu(q, a, b, ranges, D**-0.5, library=lib, force_scalar=True)
    got = prefill_attention_runs_cpu(q, run, b, ranges, D**-0.5, library=lib, force_scalar=True)
    assert torch.equal(got, want)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("force_scalar", [False, True])
def test_runs_read_in_place_as_views_of_wider_rows(libraries, build, force_scalar):
    """q and the exact run as column slices of one fused (T, (Hq + 2 Hkv) D) tensor, as the
    engine hands them over, and run A's k and v as slices of rows of two other widths: the
    same bits as contiguous copies, in the vector kernel and the scalar loop."""
    lib = libraries[build]
    span = _span(300, 300, 2)
    q, (ka, va), (kb, vb), ranges, _ = _case(span, 9, 3, 64, seed=3)
    kb, vb = kb[:300], vb[:300]  # the fresh chunk's own rows (the run's last page is padding)
    fused = torch.cat([t.reshape(300, -1) for t in (q, kb, vb)], dim=1)
    qv = fused[:, :576].view(300, 9, 64)
    kv, vv = fused[:, 576:768].view(300, 3, 64), fused[:, 768:].view(300, 3, 64)
    la = ka.shape[0]
    kav = torch.cat([ka.reshape(la, -1), torch.randn(la, 7)], dim=1)[:, :192].view(la, 3, 64)
    vav = torch.cat([torch.randn(la, 64), va.reshape(la, -1)], dim=1)[:, 64:].view(la, 3, 64)
    assert not any(t.is_contiguous() for t in (qv, kv, vv, kav, vav))
    assert kav.stride(0) != vav.stride(0) != kv.stride(0)
    kw = dict(library=lib, force_scalar=force_scalar)
    want = prefill_attention_runs_cpu(q, (ka, va), (kb, vb), ranges, 0.125, **kw)
    got = prefill_attention_runs_cpu(qv, (kav, vav), (kv, vv), ranges, 0.125, **kw)
    assert torch.equal(got, want)
    run, a = _int4_run(span, 3, 64, lib, seed=4)
    want = prefill_attention_runs_cpu(q, a, (kb, vb), ranges, 0.125, **kw)
    got = prefill_attention_runs_cpu(qv, run, (kv, vv), ranges, 0.125, **kw)
    assert torch.equal(got, want)


def test_bad_int4_runs_are_named(libraries):
    lib = libraries["native"]
    span = _span(40, 100, 2)
    q, _, b, ranges, _ = _case(span, 9, 3, 64)
    run, _ = _int4_run(span, 3, 64, lib)
    with pytest.raises(ValueError, match="page ids"):
        bad = Int4Run(run.views, run.pages.clone().fill_(run.views["k"].shape[0]))
        prefill_attention_runs_cpu(q, bad, b, ranges, 0.125, library=lib)
    pool = Int4Pool(run.views)  # checked once, as the engine keeps it: the same bits
    want = prefill_attention_runs_cpu(q, run, b, ranges, 0.125, library=lib)
    got = prefill_attention_runs_cpu(q, Int4Run(pool, run.pages), b, ranges, 0.125, library=lib)
    assert torch.equal(got, want)
    for bad_id in (-1, run.views["k"].shape[0]):  # the kernel checks the ids
        with pytest.raises(ValueError, match=r"page ids in \[0, \d+\) and ranges"):
            bad = Int4Run(pool, run.pages.clone().fill_(bad_id))
            prefill_attention_runs_cpu(q, bad, b, ranges, 0.125, library=lib)
    with pytest.raises(ValueError, match="heads of"):
        prefill_attention_runs_cpu(
            q[:, :3], Int4Run(pool, run.pages), tuple(t[:, :1] for t in b), ranges, 0.125
        )
    with pytest.raises(ValueError, match="heads"):
        prefill_attention_runs_cpu(q, run, tuple(t[:, :1] for t in b), ranges, 0.125, library=lib)
    with pytest.raises(ValueError, match="missing"):
        views = {c: t for c, t in run.views.items() if c != "k_zero"}
        prefill_attention_runs_cpu(q, Int4Run(views, run.pages), b, ranges, 0.125, library=lib)
    with pytest.raises(ValueError, match="integer page ids"):
        prefill_attention_runs_cpu(
            q, Int4Run(run.views, run.pages.float()), b, ranges, 0.125, library=lib
        )
    with pytest.raises(ValueError, match="k_scale"):
        views = dict(run.views, k_scale=run.views["k_scale"].float())
        prefill_attention_runs_cpu(q, Int4Run(views, run.pages), b, ranges, 0.125, library=lib)
    bad = ranges.clone()
    bad[0, 1] = run.pages.numel() * BS + 1  # past the pages' keys
    with pytest.raises(ValueError, match="within the runs"):
        prefill_attention_runs_cpu(q, run, b, bad, 0.125, library=lib)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize(
    "q_len,ctx,W,ring_from", [SPANS[1], SPANS[4], SPANS[6], SPANS[7]]
)  # SPANS[6]: no quantized page, so nothing to turn back; SPANS[7]: run A over key blocks
@pytest.mark.parametrize("Hq,Hkv,D,rot", [(9, 3, 64, 64), (4, 2, 128, 128), (6, 3, 32, 16)])
def test_run_a_rotated_v_turned_back_in_the_kernel(
    libraries, build, q_len, ctx, W, ring_from, Hq, Hkv, D, rot
):
    """``a_rotation``: run A's V rotated (int4 pages as the engine stores them), run B's V
    plain, the output plain; the twin is the engine's unfused path: run B's V rotated too,
    the output rotated back after. Within float rounding, with float and int4 runs A; one
    span under a sliding window."""
    from kvmesh.kernels.quant import hadamard_transform

    lib = libraries[build]
    span = _span(q_len, ctx, W, ring_from)
    window = 40 if (q_len, ctx) == (200, 333) else None
    q, a, (kb, vb), ranges, _ = _case(span, Hq, Hkv, D, window=window, seed=7)
    run, a4 = _int4_run(span, Hkv, D, lib, seed=8)
    rotated_b = (kb, hadamard_transform(vb, rot))
    # the scalar loop on the native build (the portable build runs it anyway)
    for force_scalar in (False, True) if build == "native" else (False,):
        kw = dict(library=lib, force_scalar=force_scalar)
        for run_a in (a, run, a4):
            want = hadamard_transform(
                prefill_attention_runs_cpu(q, run_a, rotated_b, ranges, D**-0.5, **kw), rot
            )
            got = prefill_attention_runs_cpu(
                q, run_a, (kb, vb), ranges, D**-0.5, a_rotation=rot, **kw
            )
            torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    with pytest.raises(ValueError, match="a_rotation must be a power of two"):
        prefill_attention_runs_cpu(q, run, (kb, vb), ranges, D**-0.5, a_rotation=3, **kw)
