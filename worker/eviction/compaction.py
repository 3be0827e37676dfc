"""Reading a request's cached K/V per layer, and writing a compacted copy into new pages.

A request's cache is ``N`` slots: slot ``j`` lives in page ``table[j // bs]`` at offset
``j % bs``; for quantized formats the partial last page (``N % bs`` slots) is in the
request's full-precision residual ring instead (``LayerCache.residual_page``), and so are
copies of its complete pages among its last W. Compaction never writes into a page the
request already holds (it may be a shared prefix-cache page): the kept slots go to fresh
pages, and the caller then drops the old ones.

Quantized formats are recompressed at page granularity: the kept values are dequantized,
gathered, and every full page of the result is quantized afresh (its own scales), exactly as
a page filling in decode is; the result's last W pages (the partial one included) also go to
the residual ring in full precision, with the values the compaction moved (exact where the
old cache's ring held them, dequantized from the pool elsewhere). A page of the result whose
kept tokens are exactly one old full page's, in order, for every KV head
(``unchanged_pages``), is not requantized: its bytes (codes and scales) are copied as
stored, so a page that survives compactions unchanged is never requantized. A decode
compaction drops ``block_size`` tokens, so the pages past the last dropped one move whole:
StreamingLLM copies every page but the sinks' page, H2O every page before the first and
after the last token any head of the layer dropped. int4 keeps V Hadamard-rotated in the
pages and the residual alike, so values move in the rotated domain and no rotation is
applied here.
"""

from __future__ import annotations

import torch

from kvmesh.worker.attention.base import LayerCache


def read_layer(
    cache: LayerCache,
    table: torch.Tensor,
    n: int,
    residual_slot: int,
    dtype: torch.dtype,
    keys_only: bool = False,
    ring_from: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """K and V of a request's first ``n`` slots: (n, Hkv, D) each, in ``dtype`` (V None with
    ``keys_only``). table: (P,) int64 page ids covering the n slots. Quantized formats: the
    pages the request's residual ring holds are read from it, exact: its last
    ``cache.residual_pages`` pages from ``ring_from`` on (``KVCacheManager.ring_from``);
    None: only the partial last page (a cache whose complete pages were never put in a
    ring)."""
    bs = cache.views["k"].shape[1]
    pages = table[: -(-n // bs)]
    sides = ("k",) if keys_only else ("k", "v")
    out = {}
    if not cache.quantized:
        for s in sides:
            out[s] = cache.views[s].index_select(0, pages).to(dtype)
    else:
        from kvmesh.kernels.quant import dequantize_k, dequantize_v

        comps = {name: t.index_select(0, pages) for name, t in cache.views.items()}
        residual = {"k": cache.residual_k, "v": cache.residual_v}
        last = (n - 1) // bs
        if ring_from is None:  # the partial last page only: it is not (yet) in the pool
            ring = [last] if n % bs else []
        else:
            ring = list(range(max(ring_from, last - cache.residual_pages + 1, 0), last + 1))
        res_pages = [cache.residual_page(residual_slot, j) for j in ring]
        for s in sides:
            x = (dequantize_k if s == "k" else dequantize_v)(cache.cache_format, comps)
            x = x.to(dtype)  # (P, bs, Hkv, D)
            if ring:
                x[ring] = residual[s][res_pages].to(dtype)
            out[s] = x
    H, D = out["k"].shape[-2:]
    k = out["k"].reshape(-1, H, D)[:n]
    v = out["v"].reshape(-1, H, D)[:n] if "v" in out else None
    return k, v


def gather_heads(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """x: (N, Hkv, D), keep: (Hkv, K) slots per head -> (K, Hkv, D)."""
    idx = keep.t().unsqueeze(-1).expand(-1, -1, x.shape[-1])  # (K, Hkv, D)
    return x.gather(0, idx)


def unchanged_pages(keep: torch.Tensor, n: int, bs: int) -> torch.Tensor:
    """Which full pages of a compacted copy hold exactly an old full page's tokens.

    keep: (Hkv, K) kept slots per head (ascending) of an ``n``-slot cache. Returns (K // bs,)
    int64: for result page ``j``, the index (in the request's page table) of the old page
    whose ``bs`` slots, in order, every head keeps as its slots ``j*bs .. j*bs+bs-1``; -1
    where there is none (the page's contents changed, or it came from the partial tail,
    which is in the residual, not in a page)."""
    full = keep.shape[-1] // bs
    if full == 0:
        return torch.zeros(0, dtype=torch.int64, device=keep.device)
    pages = keep[:, : full * bs].reshape(keep.shape[0], full, bs)  # (Hkv, full, bs)
    start = pages[..., 0]
    same = (pages == start[..., None] + torch.arange(bs, device=keep.device)).all(-1)
    same &= (start % bs == 0) & (start + bs <= (n // bs) * bs)
    same &= (start == start[:1]).all(0, keepdim=True)  # every head: the same old page
    ok = same.all(0)
    return torch.where(ok, start[0] // bs, torch.full_like(start[0], -1))


def write_layer(
    cache: LayerCache,
    k: torch.Tensor,
    v: torch.Tensor,
    pages: torch.Tensor,
    residual_slot: int,
    copy_src: torch.Tensor | None = None,
) -> None:
    """Store k, v (K, Hkv, D) as slots 0..K-1 of ``pages`` (ceil(K / bs),) int64.

    copy_src (quantized formats; (K // bs,) int64 page ids, -1 for none): result page ``j``
    is a byte copy of page ``copy_src[j]`` (which holds exactly those tokens) instead of
    being quantized afresh from k, v. Best passed on the CPU: which pages are copied is
    worked out there, and only integer index tensors go to the device (no sync per layer)."""
    bs = cache.views["k"].shape[1]
    K = k.shape[0]
    dev = k.device
    j = torch.arange(K, device=dev)
    if not cache.quantized:
        kc, vc = cache.views["k"], cache.views["v"]
        kc[pages[j // bs], j % bs] = k.to(kc.dtype)
        vc[pages[j // bs], j % bs] = v.to(vc.dtype)
        return
    from kvmesh.kernels.cache_write import write_kv_cache  # Triton on CUDA

    full = K // bs
    R = cache.residual_k.shape[0]
    src = (R * bs + torch.arange(full * bs, device=dev)).view(full, bs)
    complete_pages, complete_src = pages[:full], src
    if copy_src is not None and full:
        cs = copy_src[:full].cpu()
        copied = cs >= 0
        if copied.any():  # on the CPU: no device sync
            dst = pages.index_select(0, copied.nonzero().flatten().to(dev))
            frm = cs[copied].to(dev)
            for t in cache.views.values():  # codes and scales alike, as stored
                t[dst] = t[frm]
            requant = (~copied).nonzero().flatten().to(dev)
            complete_pages, complete_src = pages.index_select(0, requant), src[requant]
    # the ring: the last W pages of the result (LayerCache.residual_page's rows)
    W = cache.residual_pages
    ring_page = residual_slot * W + (j // bs) % W
    in_ring = j >= ((K - 1) // bs - W + 1) * bs
    res = torch.where(in_ring, ring_page * bs + j % bs, torch.full_like(j, -1))
    dt = cache.residual_k.dtype
    write_kv_cache(
        fmt=cache.cache_format,
        k=k.to(dt).contiguous(),
        v=v.to(dt).contiguous(),
        cache=cache.views,
        residual_k=cache.residual_k,
        residual_v=cache.residual_v,
        residual_slots=res,
        complete_pages=complete_pages.contiguous(),
        complete_src=complete_src.contiguous(),
    )
