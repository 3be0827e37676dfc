"""Compaction moves kept K/V into fresh pages, in every cache format: float formats byte
for byte, quantized ones recompressed page by page (a full page quantized afresh from the
kept values, the partial last page in the residual at full precision). The source pages
are never written."""

import pytest
import torch
from helpers import fill_request_slots

from kvmesh.kernels.page_format import PageLayout
from kvmesh.kernels.quant import dequantize_pages, quantize_pages
from kvmesh.worker.eviction.compaction import gather_heads, read_layer, write_layer
from kvmesh.worker.kv_memory import KVMemory

BS, H, D, R = 4, 2, 64, 2
FORMATS = ["fp32", "fp16", "bf16", "fp8", "int8", "int4"]


def _fill(cache, table: list[int], k, v, slot: int) -> None:
    fill_request_slots(cache, table, k, v, slot, block_size=BS, residual_slots=R)


def _roundtrip(fmt, k, v):
    """What a quantized full page (1, BS, H, D) reads back as."""
    return dequantize_pages(fmt, quantize_pages(fmt, k, v))


@pytest.mark.parametrize("fmt", FORMATS)
def test_compaction_moves_the_kept_slots_in_every_format(fmt):
    g = torch.Generator().manual_seed(FORMATS.index(fmt))
    layout = PageLayout(fmt, num_layers=1, num_kv_heads=H, head_size=D, block_size=BS)
    mem = KVMemory(
        layout, "test", 12, dtype=torch.float32, device=torch.device("cpu"), num_residual_slots=R
    )
    cache = mem.layer_caches[0]
    n, slot = 10, 1
    k = torch.randn(n, H, D, generator=g)
    v = torch.randn(n, H, D, generator=g)
    table = [3, 7, 5]
    _fill(cache, table, k, v, slot)
    source = mem.buffer[table].clone()
    k0, v0 = read_layer(cache, torch.tensor(table), n, slot, torch.float32)
    if not cache.quantized:
        dt = cache.views["k"].dtype
        assert torch.equal(k0, k.to(dt).float()) and torch.equal(v0, v.to(dt).float())

    keep = torch.stack([torch.sort(torch.randperm(n, generator=g)[:7]).values for _ in range(H)])
    kk, vv = gather_heads(k0, keep), gather_heads(v0, keep)  # (7, H, D)
    for h in range(H):
        assert torch.equal(kk[:, h], k0[keep[h], h])
    new = torch.tensor([9, 2])
    write_layer(cache, kk, vv, new, slot)
    k1, v1 = read_layer(cache, new, 7, slot, torch.float32)
    if not cache.quantized:
        assert torch.equal(k1, kk) and torch.equal(v1, vv)  # bytes as stored
    else:
        # page 9: the first BS kept slots, quantized afresh; the 3 left: residual, exact
        rk, rv = _roundtrip(fmt, kk[None, :BS], vv[None, :BS])
        torch.testing.assert_close(k1[:BS], rk[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(v1[:BS], rv[0], rtol=0, atol=1e-6)
        assert torch.equal(k1[BS:], kk[BS:]) and torch.equal(v1[BS:], vv[BS:])
    assert torch.equal(mem.buffer[table], source)  # the old pages: not one byte written


def test_compacted_pages_are_never_cached_under_the_requests_hashes():
    from kvmesh.kvstore.events import EventLog
    from kvmesh.worker.kv_cache import KVCacheManager
    from kvmesh.worker.request import Request
    from kvmesh.worker.sampling_params import SamplingParams

    kv = KVCacheManager(32, BS, EventLog("e"), enable_prefix_caching=True)
    req = Request("r", list(range(20)), SamplingParams(), BS, "fp")
    assert kv.allocate_slots(req, 20) is not None
    req.num_computed_tokens = 20
    old = kv.page_ids(req)
    assert len(kv.cached_hashes()) == 5  # 20 tokens: 5 full pages, hashed
    new = kv.take_private_pages(2)
    kv.replace_pages(req, new)
    req.num_evicted = 14  # 6 slots kept
    assert kv.page_ids(req) == [p.page_id for p in new]
    # the old pages keep their hashes (their bytes are intact) but the request holds none
    assert all(kv.pool.pages[i].ref_cnt == 0 for i in old)
    assert kv.reset_prefix_cache() == 5 and not kv.cached_hashes()
    # the request grows to 4 full pages of its compacted cache: none may be hashed
    for _ in range(12):
        assert kv.allocate_slots(req, 1) is not None
        req.append_token(7)
        req.num_computed_tokens += 1
    assert req.cache_len == 18 and len(kv.page_ids(req)) == 5  # ceil(18 / BS)
    assert kv.allocate_slots(req, 20) is not None
    assert not kv.cached_hashes()
    assert all(kv.pool.pages[i].page_hash is None for i in kv.page_ids(req))


def test_a_ring_of_two_pages_is_read_exact_and_rewritten_exact():
    """W = 2: the request's last two pages (one complete, one partial) are read from its
    residual ring, exact, and a compaction writes the result's last two pages back to the
    ring (the values it moved: exact where the ring held them), where read_layer finds them.
    A page before the ring, or restored (before ``ring_from``), reads quantized."""
    W, fmt, slot = 2, "int4", 1
    g = torch.Generator().manual_seed(7)
    layout = PageLayout(fmt, num_layers=1, num_kv_heads=H, head_size=D, block_size=BS)
    mem = KVMemory(
        layout,
        "test",
        12,
        dtype=torch.float32,
        device=torch.device("cpu"),
        num_residual_slots=R,
        residual_pages=W,
    )
    cache = mem.layer_caches[0]
    assert cache.residual_k.shape[0] == R * W
    n = 10  # pages 0, 1 complete, page 2 partial: pages 1 and 2 are in the ring
    k = torch.randn(n, H, D, generator=g)
    v = torch.randn(n, H, D, generator=g)
    table = [3, 7, 5]
    for j in range(3):  # the pool: the complete pages quantized
        if (j + 1) * BS <= n:
            comps = quantize_pages(
                fmt, k[None, j * BS : (j + 1) * BS], v[None, j * BS : (j + 1) * BS]
            )
            for name, t in comps.items():
                cache.views[name][table[j]] = t[0]
    for j in (1, 2):  # the ring: residual page slot * W + j % W
        rows = k[j * BS : min((j + 1) * BS, n)]
        cache.residual_k[cache.residual_page(slot, j), : len(rows)] = rows
        cache.residual_v[cache.residual_page(slot, j), : len(rows)] = v[j * BS : j * BS + len(rows)]
    k0, v0 = read_layer(cache, torch.tensor(table), n, slot, torch.float32, ring_from=0)
    assert torch.equal(k0[BS:], k[BS:]) and torch.equal(v0[BS:], v[BS:])  # the ring, exact
    rk, _ = _roundtrip(fmt, k[None, :BS], v[None, :BS])
    torch.testing.assert_close(k0[:BS], rk[0], rtol=0, atol=1e-6)  # page 0: quantized
    # restored pages (before ring_from) are read from the pool even inside the window
    k2, _ = read_layer(cache, torch.tensor(table), n, slot, torch.float32, ring_from=2)
    rk1, _ = _roundtrip(fmt, k[None, BS : 2 * BS], v[None, BS : 2 * BS])
    torch.testing.assert_close(k2[BS : 2 * BS], rk1[0], rtol=0, atol=1e-6)
    assert torch.equal(k2[2 * BS :], k[2 * BS :])
    # compaction keeps slots 1..9 (9 slots: pages 0, 1 complete, page 2 partial)
    keep = torch.arange(1, n).expand(H, -1)
    kk, vv = gather_heads(k0, keep), gather_heads(v0, keep)
    new = torch.tensor([9, 2, 4])
    write_layer(cache, kk, vv, new, slot)
    k1, v1 = read_layer(cache, new, n - 1, slot, torch.float32, ring_from=0)
    assert torch.equal(k1[BS:], kk[BS:]) and torch.equal(v1[BS:], vv[BS:])  # ring, exact
    rk, _ = _roundtrip(fmt, kk[None, :BS], vv[None, :BS])
    torch.testing.assert_close(k1[:BS], rk[0], rtol=0, atol=1e-6)
