"""Prefill over a quantized cache reads each query's own page exact (attention/own_page.py):
every query sees the K/V decode would show it, however the prompt is chunked."""

from __future__ import annotations

import pytest
import torch

from kvmesh.worker.attention.base import PrefillSpan
from kvmesh.worker.attention.own_page import exact_own_pages, own_page_geometry, own_page_mask

BS = 4


def _span(q_len: int, ctx: int, start: int = 0, slot: int = -1) -> PrefillSpan:
    return PrefillSpan(
        start=start, q_len=q_len, context_len=ctx, block_table=torch.zeros(1), request_slot=slot
    )


def _decode_view(p: int, window: int | None) -> set[tuple[int, bool]]:
    """(key position, read exact) pairs a decode step at position p reads: pages complete at
    p from the pool, the partial page from the residual; a token completing its page reads
    the page quantized."""
    start = p // BS * BS
    closes = p % BS == BS - 1
    view = {(j, not closes and j >= start) for j in range(p + 1)}
    return {(j, x) for j, x in view if window is None or j > p - window}


def _prefill_views(q_len: int, ctx: int, window: int | None) -> dict[int, set]:
    mask = own_page_mask(_span(q_len, ctx), BS, torch.device("cpu"), window)
    lq, e0, lx = own_page_geometry(_span(q_len, ctx), BS)
    keys = [(j, False) for j in range(lq)] + [(j, True) for j in range(e0, e0 + lx)]
    assert mask.shape == (q_len, len(keys))
    return {
        ctx - q_len + i: {keys[c] for c in row.nonzero().flatten().tolist()}
        for i, row in enumerate(mask)
    }


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("chunk", [1, 3, 4, 5, 11])
def test_every_chunking_gives_each_query_the_decode_view(chunk, window):
    total = 23  # pages complete mid-chunk, chunks start mid-page, a partial last page
    for c0 in range(0, total, chunk):
        n = min(chunk, total - c0)
        for p, view in _prefill_views(n, c0 + n, window).items():
            assert view == _decode_view(p, window), (chunk, p)


def test_exact_pages_take_the_earlier_tokens_from_the_residual_slot():
    H, D = 2, 3
    res_k = torch.randn(3, BS, H, D)
    res_v = torch.randn(3, BS, H, D)
    k = torch.randn(9, H, D, dtype=torch.float64)  # the step's tokens: this span is 2..6
    v = torch.randn(9, H, D, dtype=torch.float64)
    # 6 tokens cached (page 1 holds 2 in slot 2), 5 new: positions 6..10, pages 1 and 2
    span = _span(5, 11, start=2, slot=2)
    xk, xv = exact_own_pages(span, k, v, res_k, res_v, BS)
    assert own_page_geometry(span, BS) == (8, 4, 8)
    assert xk.shape == (8, H, D) and xk.dtype == res_k.dtype
    torch.testing.assert_close(xk[:2], res_k[2, :2])
    torch.testing.assert_close(xv[:2], res_v[2, :2])
    torch.testing.assert_close(xk[2:7], k[2:7].float())
    torch.testing.assert_close(xv[2:7], v[2:7].float())
    assert not xk[7:].any() and not xv[7:].any()


def test_a_chunk_continuing_a_page_needs_its_slot():
    t = torch.zeros(5, 1, 2)
    res = torch.zeros(1, BS, 1, 2)
    with pytest.raises(AssertionError, match="residual slot"):
        exact_own_pages(_span(2, 5), t, t, res, res, BS)
