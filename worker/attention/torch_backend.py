"""Attention over the paged cache in plain torch: the CPU backend and the reference.

Pages are gathered whole (``index_select`` over the page axis copies contiguous
block_size x Hkv x D runs, far cheaper than a per-token gather). Padding entries of a block
table point at the null page (page 0), which holds zeros, so masked positions never read
uninitialised memory.

Quantized formats are read by dequantizing the gathered pages (``kernels.quant``), with a
request's partially filled last page taken from its full-precision residual slot instead;
a prefill chunk's queries read their own pages exact (``own_page``).

Decode (one query token per request) folds each KV head's group of query heads into the
query-length axis: q (B, Hkv, G, D) against k (B, Hkv, L, D). Every K/V tile is read once
per group and no repeat of K/V is materialised.

With ``native=True`` (the ``cpu`` backend), decode runs in kvmesh's C kernel
(``kernels.cpu_attention``), which reads the pages in place instead of gathering them
(quantized ones dequantized as it reads them, with an fp32 residual), and a fresh causal
prefill chunk (fp32, no window) runs the C flash kernel where it was measured faster than
SDPA on this machine (``kernels.prefill_tune``); if the kernel cannot be built (no C
compiler), one warning is logged and the torch path runs (``worker.cpu_kernels``).
"""

from __future__ import annotations

import weakref
from functools import partial

import torch
import torch.nn.functional as F

from kvmesh.kernels.quant import hadamard_transform, value_rotation_block
from kvmesh.worker.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    LayerCache,
    causal_prefill_mask,
)
from kvmesh.worker.attention.own_page import (
    exact_own_pages,
    own_page_attention,
    own_page_mask,
    own_page_ranges,
)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, sliding_window: int | None = None, native: bool = False):
        self.sliding_window = sliding_window
        self._meta: AttentionMetadata | None = None
        self._native = None
        self._prefill_tuner = None  # fresh causal prefill: SDPA or C, measured (prefill_tune)
        self._hadamard = hadamard_transform  # int4's V rotation (kernels.quant)
        # quantized writes in C: a checked writer per layer cache (id -> (weak reference to
        # the cache, its views, residual K and V, the writer): a cache seen again with other
        # tensors gets a new one, a dead cache's entry is dropped), and the step's indices
        # checked once for every layer (built on first use)
        self._writers: dict = {}  # and ("decode", id) -> (..., the layer's C decoder)
        self._write_idx = self._decode_idx = None
        if native:
            from kvmesh.worker import cpu_kernels

            if cpu_kernels.load() is not None:
                from kvmesh.kernels.cpu_attention import hadamard_cpu, paged_decode_attention_cpu

                self._native = paged_decode_attention_cpu
                self._hadamard = hadamard_cpu  # bit-equal, one C call instead of ~30 torch ops
                from kvmesh.kernels import prefill_tune

                self._prefill_tuner = prefill_tune.default_tuner(cpu_kernels.load())

    def prepare(self, meta: AttentionMetadata) -> None:
        self._meta = meta
        self._write_idx = self._decode_idx = None
        bs = meta.block_size
        dev = meta.slot_mapping.device
        self._page_idx = meta.slot_mapping // bs  # (T,) where each new token is written
        self._page_off = meta.slot_mapping % bs
        quantized = meta.residual_slots is not None
        # the C kernel reads pages (float, or quantized with an fp32 residual) by context
        # length: the torch decode's mask and residual pages are built only where it may run
        # (a quantized cache with another residual dtype builds them in forward, on first use)
        self._torch_decode_ready = False
        self._decode_mask = self._decode_tail = None
        if meta.num_decode and not (self._native is not None and dev.type == "cpu"):
            self._prepare_torch_decode(meta)
        self._prefill = []
        self._own_page_views = {}  # (span index, "mask" | "ranges"): built on first use
        for span in meta.prefills:
            # nothing cached: causal over the new tokens, no gather (float formats only: a
            # quantized page must be read back as stored)
            fresh = span.context_len == span.q_len and not quantized
            mask = None  # quantized: the own-page mask or ranges, built in forward
            if not quantized and (not fresh or self.sliding_window is not None):
                mask = causal_prefill_mask(span, dev, self.sliding_window)  # (q_len, ctx)
            self._prefill.append((span, fresh, mask))

    def _prepare_torch_decode(self, meta: AttentionMetadata) -> None:
        """The torch decode's (B, 1, 1, L) mask and, over a quantized cache, its residual
        pages: once per step, shared by the layers."""
        self._torch_decode_ready = True
        bs, dev = meta.block_size, meta.slot_mapping.device
        B, P = meta.decode_block_tables.shape
        pos = torch.arange(P * bs, dtype=torch.int64, device=dev)
        ctx = meta.decode_context_lens[:, None]
        mask = pos[None, :] < ctx  # (B, L)
        if self.sliding_window is not None:
            mask &= pos[None, :] >= ctx - self.sliding_window
        self._decode_mask = mask[:, None, None, :]  # (B, 1, 1, L)
        dec = meta.decode_residual_slots  # (B, W): residual pages of each one's last W pages
        if meta.residual_slots is not None and dec is not None and bool((dec >= 0).any()):
            rows, i = (dec >= 0).nonzero().unbind(1)
            last = (meta.decode_context_lens[rows] - 1) // meta.block_size
            pages = last - dec.shape[1] + 1 + i  # the page each of those entries holds
            self._decode_tail = (rows, pages, dec[rows, i])

    def _read_pages(self, cache: LayerCache, pages: torch.Tensor, dtype: torch.dtype):
        """K and V of ``pages`` (n,) as (n, bs, Hkv, D) in ``dtype``."""
        if not cache.quantized:
            k = cache.views["k"].index_select(0, pages)
            v = cache.views["v"].index_select(0, pages)
            return k.to(dtype), v.to(dtype)
        from kvmesh.kernels.quant import dequantize_pages

        comps = {name: t.index_select(0, pages) for name, t in cache.views.items()}
        return dequantize_pages(cache.cache_format, comps, dtype)

    def warm_up_prefill(
        self, max_tokens: int, Hq: int, Hkv: int, D: int, dtype, fmt: str, page=None
    ):
        """At engine start: choose SDPA or C for every token bucket a prefill chunk can have
        (up to the step budget), so no request waits on that measurement: a fresh chunk's
        causal attention over float pages, or a chunk's own-page attention over a quantized
        cache. Nothing to choose without the C kernels, for another dtype, or for float
        pages with a window. ``page``: a quantized cache's (block size, residual pages)."""
        from kvmesh.kernels.page_format import QUANT_FORMATS
        from kvmesh.kernels.prefill_tune import MIN_TOKENS, token_bucket

        if self._prefill_tuner is None or dtype != torch.float32:
            return
        kind = "own_page" if fmt in QUANT_FORMATS else "causal"
        if self.sliding_window is not None and kind == "causal":
            return
        n = MIN_TOKENS
        while True:
            self._prefill_tuner.use_c(n, Hq, Hkv, D, kind=kind, page=page)
            if n >= token_bucket(max_tokens):
                return
            n *= 2

    def _own_page_view(self, i: int, span, in_c: bool, device) -> torch.Tensor:
        """Span i's own-page mask (q_len, Lq + Lx) for SDPA, or its ranges (q_len, 4) for
        the C kernel: once per step, shared by the layers."""
        key = (i, "ranges" if in_c else "mask")
        got = self._own_page_views.get(key)
        if got is None:
            bs, sw = self._meta.block_size, self.sliding_window
            got = own_page_ranges(span, bs, sw) if in_c else own_page_mask(span, bs, device, sw)
            self._own_page_views[key] = got
        return got

    def _own_page_in_c(self, native: bool, q, n: int, Hkv: int, cache: LayerCache) -> bool:
        """A chunk over a quantized cache in fp32 (fp32 residual) runs the one-pass C kernel
        where it was measured faster than the masked SDPA (``kernels.prefill_tune``, kind
        ``own_page``)."""
        if not native or self._prefill_tuner is None or q.dtype != torch.float32:
            return False
        if cache.residual_k.dtype != torch.float32:
            return False
        page = (self._meta.block_size, cache.residual_pages)
        return self._prefill_tuner.use_c(n, q.shape[1], Hkv, q.shape[2], "own_page", page)

    def _fresh_in_c(self, native: bool, mask, q, n: int, Hkv: int) -> bool:
        """A fresh causal chunk (no window) in fp32 runs the C kernel where it was measured
        faster than SDPA on this machine (``kernels.prefill_tune``)."""
        if not native or mask is not None or self._prefill_tuner is None:
            return False
        if q.dtype != torch.float32:
            return False
        return self._prefill_tuner.use_c(n, q.shape[1], Hkv, q.shape[2])

    def _context_in_c(self, native: bool, q, n: int, Hkv: int) -> bool:
        """A chunk after cached or earlier-chunk context over float pages (no window): the
        same C kernel, its queries at the end of the context, where it beat SDPA on a fresh
        chunk of this many queries. The SDPA it replaces here is the masked one over every
        context key, which does more work than the fresh chunk's causal SDPA."""
        if self.sliding_window is not None:
            return False
        return self._fresh_in_c(native, None, q, n, Hkv)

    def _layer_obj(self, key, cache: LayerCache, factory):
        """``factory`` (a ``LayerWriter`` or ``QuantLayerDecoder``) over ``cache``'s tensors,
        made and checked once per layer cache and kept under ``key`` while the cache lives
        and holds the same tensors. The entry holds the tensors (the decoder keeps only their
        addresses) but only a weak reference to the cache: when the engine drops a cache (a
        rebuilt pool) its entry goes, and with it the backend's hold on the tensors."""
        got = self._writers.get(key)
        if (
            got is None
            or got[0]() is not cache  # a new cache under a dead one's id
            or got[1] is not cache.views
            or got[2] is not cache.residual_k
            or got[3] is not cache.residual_v
        ):
            obj = factory(
                fmt=cache.cache_format,
                cache=cache.views,
                residual_k=cache.residual_k,
                residual_v=cache.residual_v,
            )
            ref = weakref.ref(cache, partial(_forget_layer_obj, self._writers, key))
            got = self._writers[key] = (ref, cache.views, cache.residual_k, cache.residual_v, obj)
        return got[4]

    def _write_in_c(self, cache: LayerCache, k, v, v_rotation: int | None) -> None:
        """``cpu_quant.write_kv_cache_cpu``, with the layer's writer and the step's indices
        checked once (kernels.cpu_quant.LayerWriter): the same C call."""
        from kvmesh.kernels.cpu_quant import LayerWriter, WriteIndices

        writer = self._layer_obj(id(cache), cache, LayerWriter)
        if self._write_idx is None:
            m = self._meta
            self._write_idx = WriteIndices(
                m.residual_slots, m.complete_pages, m.complete_src, m.block_size
            )
        writer.write(k, v, self._write_idx, v_rotation)

    def _int4_pool(self, cache: LayerCache):
        """The layer's int4 views checked once (``kernels.cpu_attention.Int4Pool``) for the
        own-page kernel, or None for other formats."""
        if cache.cache_format != "int4":
            return None
        from kvmesh.kernels.cpu_attention import Int4Pool

        return self._layer_obj(("int4", id(cache)), cache, lambda cache, **_: Int4Pool(cache))

    def _decode_quant_in_c(self, cache: LayerCache, q, scale, out, rotation) -> None:
        """``cpu_attention.paged_decode_attention_cpu`` over quantized pages, with the layer's
        decoder and the step's tables checked once (kernels.cpu_attention.QuantLayerDecoder):
        the same C call."""
        from kvmesh.kernels.cpu_attention import DecodeIndices, QuantLayerDecoder

        dec = self._layer_obj(("decode", id(cache)), cache, QuantLayerDecoder)
        if self._decode_idx is None:
            m = self._meta
            self._decode_idx = DecodeIndices(
                m.decode_block_tables,
                m.decode_context_lens,
                m.decode_residual_slots,
                bs=m.block_size,
                num_slots=cache.residual_k.shape[0],
            )
        dec.decode(q, self._decode_idx, scale, self.sliding_window, out, rotation)

    def forward(self, q, k, v, cache: LayerCache, scale):
        meta = self._meta
        assert meta is not None, "prepare() must be called before forward()"
        T, Hq, D = q.shape
        Hkv = k.shape[1]
        G = Hq // Hkv
        bs = meta.block_size
        rot = value_rotation_block(cache.cache_format, D)
        native = self._native is not None and q.device.type == "cpu"
        # quantized: whether each prefill chunk's own-page attention runs the one-pass C kernel
        in_c = [
            cache.quantized and self._own_page_in_c(native, q, span.q_len, Hkv, cache)
            for span, _, _ in self._prefill
        ]
        # int4 in C: the write rotates V as it stores it, the decode kernel turns its output
        # back and the own-page kernel its sums over the quantized pages, so neither V nor the
        # output takes a pass of its own (every prefill chunk must run that kernel)
        fused = rot is not None and native and q.dtype == torch.float32 and all(in_c)
        fused = fused and cache.residual_k.dtype == torch.float32 and v.dtype == torch.float32
        if rot is not None and not fused:  # int4 keeps V rotated (kernels.quant); the output
            v = self._hadamard(v, rot)  # is turned back
        plain = rot if fused else None  # the own-page kernel's exact V plain (see above)
        exact = []  # quantized: each prefill chunk's own pages in full precision, pre-write
        if cache.quantized:
            for span, _, _ in self._prefill:
                exact.append(
                    exact_own_pages(
                        span, k, v, cache.residual_k, cache.residual_v, bs, plain, native
                    )
                )
            if native and cache.residual_k.dtype == torch.float32:
                self._write_in_c(cache, k, v, rot if fused else None)
            else:
                from kvmesh.kernels.cache_write import write_kv_cache  # Triton on CUDA

                write_kv_cache(
                    fmt=cache.cache_format,
                    k=k,
                    v=v,
                    cache=cache.views,
                    residual_k=cache.residual_k,
                    residual_v=cache.residual_v,
                    residual_slots=meta.residual_slots,
                    complete_pages=meta.complete_pages,
                    complete_src=meta.complete_src,
                )
        else:
            kc, vc = cache.views["k"], cache.views["v"]
            kc[self._page_idx, self._page_off] = k.to(kc.dtype)
            vc[self._page_idx, self._page_off] = v.to(vc.dtype)
        out = torch.empty_like(q)
        nd = meta.num_decode
        # quantized pages too, dequantized in the kernel, with an fp32 residual
        res = {}
        if cache.quantized:
            res = dict(residual_k=cache.residual_k, residual_v=cache.residual_v)
            res["residual_slots"] = meta.decode_residual_slots
            if fused:
                res["out_rotation"] = rot
        if nd and native and res and cache.residual_k.dtype == torch.float32:
            self._decode_quant_in_c(cache, q[:nd], scale, out[:nd], res.get("out_rotation"))
        elif nd and native and not res:
            self._native(
                q=q[:nd],
                fmt=cache.cache_format,
                cache=cache.views,
                block_tables=meta.decode_block_tables,
                context_lens=meta.decode_context_lens,
                scale=scale,
                sliding_window=self.sliding_window,
                out=out[:nd],
                **res,
            )
        elif nd:
            if not self._torch_decode_ready:
                self._prepare_torch_decode(meta)
            tables = meta.decode_block_tables  # (B, P)
            B, P = tables.shape
            kk, vv = self._read_pages(cache, tables.reshape(-1), q.dtype)  # (B * P, bs, Hkv, D)
            if cache.quantized and self._decode_tail is not None:
                rows, tail_page, slots = self._decode_tail
                kk.view(B, P, bs, Hkv, D)[rows, tail_page] = cache.residual_k[slots].to(q.dtype)
                vv.view(B, P, bs, Hkv, D)[rows, tail_page] = cache.residual_v[slots].to(q.dtype)
            kk = kk.view(B, P * bs, Hkv, D).transpose(1, 2)  # (B, Hkv, L, D)
            vv = vv.view(B, P * bs, Hkv, D).transpose(1, 2)
            qq = q[:nd].view(B, Hkv, G, D)  # a KV head's query group as the query axis
            o = F.scaled_dot_product_attention(
                qq, kk, vv, attn_mask=self._decode_mask, scale=scale
            )  # (B, Hkv, G, D)
            out[:nd] = o.reshape(B, Hq, D)
        for i, (span, fresh, mask) in enumerate(self._prefill):
            s, n = span.start, span.q_len
            qq = q[s : s + n].transpose(0, 1).unsqueeze(0)  # (1, Hq, n, D)
            if fresh:  # keys are exactly this chunk's: no gather
                # round-trip through the cache dtype so a later cache hit sees the same keys
                kdt = cache.views["k"].dtype
                kk, vv = k[s : s + n].to(kdt).to(q.dtype), v[s : s + n].to(kdt).to(q.dtype)
                if self._fresh_in_c(native, mask, q, n, Hkv):
                    from kvmesh.kernels.cpu_attention import prefill_attention_cpu

                    prefill_attention_cpu(q[s : s + n], kk, vv, scale, out=out[s : s + n])
                    continue
                kk, vv = kk.transpose(0, 1).unsqueeze(0), vv.transpose(0, 1).unsqueeze(0)
            elif cache.quantized:  # the complete pages, then the chunk's own pages exact
                view = self._own_page_view(i, span, in_c[i], q.device)
                own_page_attention(
                    q[s : s + n], exact[i], cache, span, None if in_c[i] else view, scale, bs,
                    native=native, ranges=view if in_c[i] else None, out=out[s : s + n],
                    a_rotation=plain, int4_pool=self._int4_pool(cache) if in_c[i] else None,
                )  # fmt: skip
                continue
            else:
                ctx = span.context_len
                kk, vv = self._read_pages(cache, span.block_table, q.dtype)  # (P, bs, Hkv, D)
                kk, vv = kk.view(-1, Hkv, D)[:ctx], vv.view(-1, Hkv, D)[:ctx]  # (ctx, Hkv, D)
                if self._context_in_c(native, q, n, Hkv):
                    from kvmesh.kernels.cpu_attention import prefill_attention_cpu

                    prefill_attention_cpu(q[s : s + n], kk, vv, scale, out=out[s : s + n])
                    continue
                kk, vv = kk.transpose(0, 1).unsqueeze(0), vv.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qq,
                kk,
                vv,
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=G > 1,
            )
            out[s : s + n] = o[0].transpose(0, 1)
        return out if rot is None or fused else self._hadamard(out, rot)


def _forget_layer_obj(objs: dict, key, ref: weakref.ref) -> None:
    """The weak reference's callback when a layer cache dies: drop its entry (unless the key
    already holds a newer one)."""
    if objs.get(key, (None,))[0] is ref:
        objs.pop(key, None)
