"""Attention over the paged cache in plain torch: the CPU backend and the reference.

Pages are gathered whole (``index_select`` over the page axis copies contiguous
block_size x Hkv x D runs, far cheaper than a per-token gather). Padding entries of a block
table point at the null page (page 0), which holds zeros, so masked positions never read
uninitialised memory.

Decode (one query token per request) folds each KV head's group of query heads into the
query-length axis: q (B, Hkv, G, D) against k (B, Hkv, L, D). Every K/V tile is read once
per group and no repeat of K/V is materialised.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmesh.worker.attention.base import AttentionBackend, AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, sliding_window: int | None = None):
        self.sliding_window = sliding_window
        self._meta: AttentionMetadata | None = None

    def prepare(self, meta: AttentionMetadata) -> None:
        self._meta = meta
        bs = meta.block_size
        dev = meta.slot_mapping.device
        self._decode_mask = None
        if meta.num_decode:
            B, P = meta.decode_block_tables.shape
            pos = torch.arange(P * bs, dtype=torch.int64, device=dev)
            ctx = meta.decode_context_lens[:, None]
            mask = pos[None, :] < ctx  # (B, L)
            if self.sliding_window is not None:
                mask &= pos[None, :] >= ctx - self.sliding_window
            self._decode_mask = mask[:, None, None, :]  # (B, 1, 1, L)
        self._prefill = []
        for span in meta.prefills:
            fresh = span.context_len == span.q_len  # nothing cached: causal over new tokens
            mask = None
            if not fresh or self.sliding_window is not None:
                kpos = torch.arange(span.context_len, device=dev)
                qpos = torch.arange(span.context_len - span.q_len, span.context_len, device=dev)
                mask = kpos[None, :] <= qpos[:, None]  # (q_len, ctx)
                if self.sliding_window is not None:
                    mask &= kpos[None, :] > qpos[:, None] - self.sliding_window
            self._prefill.append((span, fresh, mask))

    def forward(self, q, k, v, k_cache, v_cache, scale):
        meta = self._meta
        assert meta is not None, "prepare() must be called before forward()"
        T, Hq, D = q.shape
        Hkv = k.shape[1]
        G = Hq // Hkv
        bs = meta.block_size
        k_cache.view(-1, Hkv, D).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, Hkv, D).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        out = torch.empty_like(q)
        nd = meta.num_decode
        if nd:
            tables = meta.decode_block_tables  # (B, P)
            B, P = tables.shape
            flat = tables.reshape(-1)
            kk = k_cache.index_select(0, flat).view(B, P * bs, Hkv, D).transpose(1, 2)
            vv = v_cache.index_select(0, flat).view(B, P * bs, Hkv, D).transpose(1, 2)
            qq = q[:nd].view(B, Hkv, G, D)  # a KV head's query group as the query axis
            o = F.scaled_dot_product_attention(
                qq, kk.to(q.dtype), vv.to(q.dtype), attn_mask=self._decode_mask, scale=scale
            )  # (B, Hkv, G, D)
            out[:nd] = o.reshape(B, Hq, D)
        for span, fresh, mask in self._prefill:
            s, n = span.start, span.q_len
            qq = q[s : s + n].transpose(0, 1).unsqueeze(0)  # (1, Hq, n, D)
            if fresh:  # keys are exactly this chunk's: no gather
                # round-trip through the cache dtype so a later cache hit sees the same keys
                kk = k[s : s + n].to(k_cache.dtype).to(q.dtype).transpose(0, 1).unsqueeze(0)
                vv = v[s : s + n].to(v_cache.dtype).to(q.dtype).transpose(0, 1).unsqueeze(0)
            else:
                ctx = span.context_len
                kk = k_cache.index_select(0, span.block_table).view(-1, Hkv, D)[:ctx]
                vv = v_cache.index_select(0, span.block_table).view(-1, Hkv, D)[:ctx]
                kk = kk.transpose(0, 1).unsqueeze(0).to(q.dtype)  # (1, Hkv, ctx, D)
                vv = vv.transpose(0, 1).unsqueeze(0).to(q.dtype)
            o = F.scaled_dot_product_attention(
                qq, kk, vv, attn_mask=mask, is_causal=mask is None, scale=scale,
                enable_gqa=G > 1,
            )  # fmt: skip
            out[s : s + n] = o[0].transpose(0, 1)
        return out
