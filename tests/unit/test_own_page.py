"""Prefill over a quantized cache reads each query's own page exact (attention/own_page.py):
every query sees the K/V decode would show it, however the prompt is chunked."""

from __future__ import annotations

import pytest
import torch

from kvmesh.worker.attention.base import PrefillSpan
from kvmesh.worker.attention.own_page import exact_own_pages, own_page_geometry, own_page_mask

BS = 4


def _span(
    q_len: int, ctx: int, start: int = 0, slot: int = -1, W: int = 1, ring_from: int = 0
) -> PrefillSpan:
    return PrefillSpan(
        start=start,
        q_len=q_len,
        context_len=ctx,
        block_table=torch.zeros(1),
        request_slot=slot,
        residual_pages=W,
        ring_from=ring_from,
    )


def _decode_view(p: int, window: int | None, W: int, ring_from: int) -> set[tuple[int, bool]]:
    """(key position, read exact) pairs a decode step at position p reads: the pages of its
    window (its own and the W - 1 before it, none before ``ring_from``) from the residual
    ring, every earlier page from the pool."""
    first = max(p // BS - W + 1, ring_from, 0)
    view = {(j, j // BS >= first) for j in range(p + 1)}
    return {(j, x) for j, x in view if window is None or j > p - window}


def _prefill_views(q_len: int, ctx: int, window: int | None, W: int, ring_from: int) -> dict:
    span = _span(q_len, ctx, W=W, ring_from=ring_from)
    mask = own_page_mask(span, BS, torch.device("cpu"), window)
    lq, e0, lx = own_page_geometry(span, BS)
    keys = [(j, False) for j in range(lq)] + [(j, True) for j in range(e0, e0 + lx)]
    assert mask.shape == (q_len, len(keys))
    return {
        ctx - q_len + i: {keys[c] for c in row.nonzero().flatten().tolist()}
        for i, row in enumerate(mask)
    }


@pytest.mark.parametrize("W, ring_from", [(1, 0), (2, 0), (3, 0), (2, 2), (3, 1)])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("chunk", [1, 3, 4, 5, 11])
def test_every_chunking_gives_each_query_the_decode_view(chunk, window, W, ring_from):
    """Each query reads the keys decode would show it, exact or quantized, whatever the
    chunking; ``ring_from`` > 0: that many pages were restored from the prefix cache."""
    total = 23  # pages complete mid-chunk, chunks start mid-page, a partial last page
    for c0 in range(ring_from * BS, total, chunk):
        n = min(chunk, total - c0)
        for p, view in _prefill_views(n, c0 + n, window, W, ring_from).items():
            assert view == _decode_view(p, window, W, ring_from), (chunk, p)


def test_exact_pages_take_the_earlier_tokens_from_the_residual_slot():
    H, D = 2, 3
    res_k = torch.randn(3, BS, H, D)
    res_v = torch.randn(3, BS, H, D)
    k = torch.randn(9, H, D, dtype=torch.float64)  # the step's tokens: this span is 2..6
    v = torch.randn(9, H, D, dtype=torch.float64)
    # 6 tokens cached (page 1 holds 2 in slot 2), 5 new: positions 6..10, pages 1 and 2
    span = _span(5, 11, start=2, slot=2)
    xk, xv = exact_own_pages(span, k, v, res_k, res_v, BS)
    assert own_page_geometry(span, BS) == (8, 4, 8)  # pages 0-1 quantized for the last query
    assert xk.shape == (8, H, D) and xk.dtype == res_k.dtype
    torch.testing.assert_close(xk[:2], res_k[2, :2])
    torch.testing.assert_close(xv[:2], res_v[2, :2])
    torch.testing.assert_close(xk[2:7], k[2:7].float())
    torch.testing.assert_close(xv[2:7], v[2:7].float())
    assert not xk[7:].any() and not xv[7:].any()


def test_exact_pages_come_from_the_ring_of_w_pages():
    """W = 2: the request in slot 1 keeps page j in residual page 1 * 2 + j % 2. A chunk at
    positions 6..10 (pages 1 and 2) reads page 0 (residual page 2) and page 1's first two
    tokens (residual page 3) exact from the ring, then its own tokens."""
    H, D = 2, 3
    res_k = torch.randn(4, BS, H, D)
    res_v = torch.randn(4, BS, H, D)
    k = torch.randn(5, H, D)
    v = torch.randn(5, H, D)
    span = _span(5, 11, start=0, slot=1, W=2)
    assert own_page_geometry(span, BS) == (4, 0, 12)  # page 0: quantized for the last query
    xk, xv = exact_own_pages(span, k, v, res_k, res_v, BS)
    for x, res, new in ((xk, res_k, k), (xv, res_v, v)):
        torch.testing.assert_close(x[:4], res[2])
        torch.testing.assert_close(x[4:6], res[3, :2])
        torch.testing.assert_close(x[6:11], new)
        assert not x[11:].any()
    # after a restored prefix of one page, page 0 is read quantized: no ring read for it
    span = _span(5, 11, start=0, slot=1, W=2, ring_from=1)
    assert own_page_geometry(span, BS) == (4, 4, 8)
    xk, _ = exact_own_pages(span, k, v, res_k, res_v, BS)
    torch.testing.assert_close(xk[:2], res_k[3, :2])


def test_a_chunk_continuing_a_page_needs_its_slot():
    t = torch.zeros(5, 1, 2)
    res = torch.zeros(1, BS, 1, 2)
    with pytest.raises(AssertionError, match="residual slot"):
        exact_own_pages(_span(2, 5), t, t, res, res, BS)


def test_a_fresh_chunk_of_whole_pages_reads_its_own_rows_in_place():
    """Nothing before the chunk and whole pages: its exact keys are exactly its new rows, so
    they come back as views of k and v (no copy); a chunk ending inside a page still gets a
    buffer with zeros after its last token."""
    H, D = 2, 3
    k, v = torch.randn(10, H, D), torch.randn(10, H, D)
    res = torch.zeros(2, BS, H, D)
    xk, xv = exact_own_pages(_span(8, 8, start=2, slot=0, W=2), k, v, res, res, BS)
    assert torch.equal(xk, k[2:10]) and torch.equal(xv, v[2:10])
    assert xk.data_ptr() == k[2].data_ptr() and xv.data_ptr() == v[2].data_ptr()
    xk, xv = exact_own_pages(_span(7, 7, start=2, slot=0, W=2), k, v, res, res, BS)
    assert xk.shape == (8, H, D) and torch.equal(xk[:7], k[2:9]) and not xk[7:].any()
    assert xk.data_ptr() != k[2].data_ptr()


@pytest.fixture(scope="module")
def c_kernels():
    from kvmesh.worker import cpu_kernels

    lib = cpu_kernels.load()
    assert lib is not None, "the C kernels did not build (is a C compiler installed?)"
    return lib


@pytest.mark.parametrize("rot", [None, 4, 8])
@pytest.mark.parametrize(
    "q_len, ctx, start, W, ring_from",
    [
        (5, 11, 2, 1, 0),
        (5, 11, 0, 2, 0),
        (3, 14, 1, 3, 0),
        (7, 7, 0, 2, 0),
        (1, 9, 4, 2, 0),
        (6, 13, 3, 2, 0),
        (2, 15, 0, 3, 0),  # the ring's pages out of order: residual pages 1, 2, 0
        (5, 14, 1, 3, 2),  # a restored prefix: the window starts at page 2
    ],
)
def test_exact_rows_gathered_in_c_equal_the_torch_gather(
    c_kernels, q_len, ctx, start, W, ring_from, rot
):
    """The one C call (``kvmesh_exact_rows_f32``) gives the torch gather's bits, k and v read
    in place as column slices of a wider row (the fused qkv output); with ``plain_v`` the
    ring's V rows are turned back by the same rotation (the chunk's own rows untouched)."""
    from kvmesh.kernels.quant import hadamard_transform
    from kvmesh.worker.attention.own_page import _exact_rows_in_c

    H, D = 2, 8
    res_k, res_v = torch.randn(3 * W + 1, BS, H, D), torch.randn(3 * W + 1, BS, H, D)
    qkv = torch.randn(start + q_len + 2, 5 * H * D)
    k = qkv[:, 3 * H * D : 4 * H * D].view(-1, H, D)
    v = qkv[:, 4 * H * D :].view(-1, H, D)
    span = _span(q_len, ctx, start=start, slot=2, W=W, ring_from=ring_from)
    want = exact_own_pages(span, k, v, res_k, res_v, BS, rot)
    calls = []
    import kvmesh.worker.attention.own_page as own_page

    real = own_page._exact_rows_in_c
    own_page._exact_rows_in_c = lambda *a: calls.append(real(*a) is not None) or real(*a)
    try:
        got = exact_own_pages(span, k, v, res_k, res_v, BS, rot, native=True)
    finally:
        own_page._exact_rows_in_c = real
    _, e0, lx = own_page_geometry(span, BS)
    head = ctx - q_len - e0
    # gathered in C (not the torch fallback), or a fresh chunk's views with no call
    assert calls == ([True] if head or lx != q_len else [])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if head and rot:  # the ring's rows plain: the rotation of what the ring holds
        plain = exact_own_pages(span, k, v, res_k, res_v, BS)[1][:head]
        assert torch.equal(got[1][:head], hadamard_transform(plain, rot))
        assert not torch.equal(got[1][:head], plain)
    assert torch.equal(got[1][head : head + q_len], v[start : start + q_len])
    with pytest.raises(ValueError, match="exact rows rejected"):
        _exact_rows_in_c(k[:2], v[:2], res_k, res_v, torch.tensor([len(res_k)]), 1, 4, rot)
