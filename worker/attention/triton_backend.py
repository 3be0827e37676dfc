"""Attention through kvmesh's paged kernels (``kernels/``): the CUDA backend.

Each op dispatches by device: the Triton kernel on CUDA, its torch twin elsewhere, so this
backend also runs (slowly, as a check of its wiring) on CPU. The kernels walk the block
tables themselves: nothing gathers the cache into a dense copy. Order per layer: write the
step's K/V (quantizing pages that fill), then decode attention for the single-token rows and
prefill attention for the chunks, which reads every key from the cache, its own included
(float formats; over a quantized cache each query reads its own page exact, as in decode,
through the torch ops of ``worker.attention.own_page``: the Triton prefill kernel does not
do that yet).
"""

from __future__ import annotations

import torch

from kvmesh.kernels.cache_write import write_kv_cache
from kvmesh.kernels.decode_attention import paged_decode_attention
from kvmesh.kernels.prefill_attention import paged_prefill_attention
from kvmesh.kernels.quant import hadamard_transform, value_rotation_block
from kvmesh.worker.attention.base import AttentionBackend, AttentionMetadata, LayerCache
from kvmesh.worker.attention.own_page import (
    exact_own_pages,
    own_page_attention,
    own_page_mask,
)


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, sliding_window: int | None = None, num_splits: int | None = None):
        self.sliding_window = sliding_window
        self.num_splits = num_splits  # decode split-KV count; None: the kernel's heuristic
        self._meta: AttentionMetadata | None = None

    def prepare(self, meta: AttentionMetadata) -> None:
        self._meta = meta
        dev = meta.slot_mapping.device
        spans = meta.prefills
        self._prefill = None
        if spans:
            width = max(s.block_table.numel() for s in spans)
            tables = torch.zeros((len(spans), width), dtype=torch.int64, device=dev)  # 0: null
            for i, s in enumerate(spans):
                tables[i, : s.block_table.numel()] = s.block_table
            starts = [s.start for s in spans] + [spans[-1].start + spans[-1].q_len]
            self._prefill = dict(
                cu_seqlens_q=torch.tensor(starts, dtype=torch.int64, device=dev),
                context_lens=torch.tensor(
                    [s.context_len for s in spans], dtype=torch.int64, device=dev
                ),
                block_tables=tables,
                residual_slots=torch.tensor(
                    [s.residual_slot for s in spans], dtype=torch.int64, device=dev
                ),
                max_query_len=max(s.q_len for s in spans),
            )

    def forward(self, q, k, v, cache: LayerCache, scale):
        meta = self._meta
        assert meta is not None, "prepare() must be called before forward()"
        D = q.shape[-1]
        rot = value_rotation_block(cache.cache_format, D)
        if rot is not None:  # int4 keeps V rotated (kernels.quant); the output is turned back
            v = hadamard_transform(v, rot)
        res = dict(residual_k=cache.residual_k, residual_v=cache.residual_v)
        exact = []  # quantized: each prefill chunk's own pages in full precision, pre-write
        if cache.quantized and self._prefill is not None:
            bs = meta.block_size
            exact = [exact_own_pages(s, k, v, *res.values(), bs) for s in meta.prefills]
        if cache.quantized:
            write_kv_cache(
                fmt=cache.cache_format,
                k=k,
                v=v,
                cache=cache.views,
                **res,
                residual_slots=meta.residual_slots,
                complete_pages=meta.complete_pages,
                complete_src=meta.complete_src,
            )
        else:
            write_kv_cache(
                fmt=cache.cache_format,
                k=k,
                v=v,
                cache=cache.views,
                slot_mapping=meta.slot_mapping,
            )
        out = torch.empty_like(q)
        nd = meta.num_decode
        if nd:
            paged_decode_attention(
                q=q[:nd],
                fmt=cache.cache_format,
                cache=cache.views,
                **res,
                block_tables=meta.decode_block_tables,
                context_lens=meta.decode_context_lens,
                residual_slots=meta.decode_residual_slots if cache.quantized else None,
                scale=scale,
                sliding_window=self.sliding_window,
                num_splits=self.num_splits,
                out=out[:nd],
            )
        if exact:  # each query's own page exact (worker.attention.own_page): torch ops
            for span, x in zip(meta.prefills, exact):
                mask = own_page_mask(span, meta.block_size, q.device, self.sliding_window)
                qs = q[span.start : span.start + span.q_len]
                o = own_page_attention(qs, x, cache, span, mask, scale, meta.block_size)
                out[span.start : span.start + span.q_len] = o
        elif self._prefill is not None:
            p = self._prefill
            paged_prefill_attention(
                q=q,
                fmt=cache.cache_format,
                cache=cache.views,
                **res,
                cu_seqlens_q=p["cu_seqlens_q"],
                context_lens=p["context_lens"],
                block_tables=p["block_tables"],
                residual_slots=p["residual_slots"] if cache.quantized else None,
                scale=scale,
                sliding_window=self.sliding_window,
                max_query_len=p["max_query_len"],
                out=out,
            )
        return out if rot is None else hadamard_transform(out, rot)
