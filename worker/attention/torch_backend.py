"""Attention over the paged cache in plain torch: the CPU backend and the reference.

Keys are gathered per step through slot indices shared by all layers, then handed to torch's
scaled_dot_product_attention with an explicit mask. Padding slots point at the null page
(page 0), which holds zeros, so masked-out positions never read uninitialised memory.
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
        offs = None
        self._decode_idx = self._decode_mask = None
        if meta.num_decode:
            tables = meta.decode_block_tables  # (B, P)
            B, P = tables.shape
            offs = torch.arange(bs, dtype=torch.int64)
            self._decode_idx = (tables[:, :, None] * bs + offs).reshape(B, P * bs)  # (B, L)
            pos = torch.arange(P * bs, dtype=torch.int64)
            ctx = meta.decode_context_lens[:, None]
            mask = pos[None, :] < ctx  # (B, L)
            if self.sliding_window is not None:
                mask &= pos[None, :] >= ctx - self.sliding_window
            self._decode_mask = mask[:, None, None, :]  # (B, 1, 1, L)
        self._prefill = []
        for span in meta.prefills:
            offs = torch.arange(bs, dtype=torch.int64)
            idx = (span.block_table[:, None] * bs + offs).reshape(-1)[: span.context_len]
            kpos = torch.arange(span.context_len)
            qpos = torch.arange(span.context_len - span.q_len, span.context_len)
            mask = kpos[None, :] <= qpos[:, None]  # (q_len, ctx)
            if self.sliding_window is not None:
                mask &= kpos[None, :] > qpos[:, None] - self.sliding_window
            self._prefill.append((span.start, span.q_len, idx, mask))

    def forward(self, q, k, v, k_cache, v_cache, scale):
        meta = self._meta
        assert meta is not None, "prepare() must be called before forward()"
        T, Hq, D = q.shape
        Hkv = k.shape[1]
        flat_k = k_cache.view(-1, Hkv, D)
        flat_v = v_cache.view(-1, Hkv, D)
        flat_k.index_copy_(0, meta.slot_mapping, k.to(flat_k.dtype))
        flat_v.index_copy_(0, meta.slot_mapping, v.to(flat_v.dtype))
        out = torch.empty_like(q)
        gqa = Hq != Hkv
        nd = meta.num_decode
        if nd:
            B, L = self._decode_idx.shape
            kk = flat_k[self._decode_idx.view(-1)].view(B, L, Hkv, D).transpose(1, 2)
            vv = flat_v[self._decode_idx.view(-1)].view(B, L, Hkv, D).transpose(1, 2)
            qq = q[:nd].unsqueeze(2)  # (B, Hq, 1, D)
            o = F.scaled_dot_product_attention(
                qq,
                kk.to(q.dtype),
                vv.to(q.dtype),
                attn_mask=self._decode_mask,
                scale=scale,
                enable_gqa=gqa,
            )  # (B, Hq, 1, D)
            out[:nd] = o.squeeze(2)
        for start, q_len, idx, mask in self._prefill:
            kk = flat_k[idx].transpose(0, 1).unsqueeze(0)  # (1, Hkv, ctx, D)
            vv = flat_v[idx].transpose(0, 1).unsqueeze(0)
            qq = q[start : start + q_len].transpose(0, 1).unsqueeze(0)  # (1, Hq, q_len, D)
            o = F.scaled_dot_product_attention(
                qq, kk.to(q.dtype), vv.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=gqa
            )
            out[start : start + q_len] = o[0].transpose(0, 1)
        return out
