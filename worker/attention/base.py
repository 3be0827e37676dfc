"""The attention backend interface, and the per-step metadata every backend reads.

A step's tokens are one flat batch of ``T`` tokens. The model runner puts requests with a
single new token (decode, or the last token of a fully cached prompt) first, so they form
one batched group ``tokens[:num_decode]``; every longer chunk (prefill) follows as its own
contiguous span. Backends must not reorder tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class LayerCache:
    """One layer's slice of the page pool, as typed in-place views (see
    ``kernels.page_format``): ``views[name]`` is ``(num_pages, *shape)`` with a page stride of
    the whole page, so it is strided, not contiguous. Quantized formats add the residual, the
    full-precision tail pages of running requests: ``residual_k``/``residual_v``
    ``(R, block_size, Hkv, D)``, contiguous."""

    cache_format: str
    views: dict[str, torch.Tensor]
    residual_k: torch.Tensor | None = None
    residual_v: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.residual_k is not None


@dataclass
class PrefillSpan:
    """One request's chunk of ``q_len > 1`` new tokens at ``tokens[start:start + q_len]``."""

    start: int
    q_len: int
    context_len: int  # cached + new tokens: the keys this chunk attends to
    block_table: torch.Tensor  # (num_pages,) int64 page ids covering context_len
    residual_slot: int = -1  # quantized formats: the slot holding the partial last page
    # quantized formats: the request's residual slot whatever the step leaves in it; before
    # the step's write it holds the chunk's first page's earlier tokens, which the chunk's
    # queries read exact (see own_page_attention_mask)
    request_slot: int = -1


def causal_prefill_mask(
    span: PrefillSpan, device: torch.device, sliding_window: int | None = None
) -> torch.Tensor:
    """(q_len, context_len) bool: the span's new tokens, the last q_len of its context, see
    the keys at or before their own position (and within ``sliding_window`` if set)."""
    kpos = torch.arange(span.context_len, device=device)
    qpos = torch.arange(span.context_len - span.q_len, span.context_len, device=device)
    mask = kpos[None, :] <= qpos[:, None]
    if sliding_window is not None:
        mask &= kpos[None, :] > qpos[:, None] - sliding_window
    return mask


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64: flat slot (page * block_size + offset) per new token
    num_decode: int  # the first num_decode tokens are single-token requests
    decode_block_tables: torch.Tensor  # (num_decode, max_pages) int64, padded with the null page
    decode_context_lens: torch.Tensor  # (num_decode,) int64
    prefills: list[PrefillSpan]
    block_size: int
    # quantized formats only (empty otherwise): a page is quantized when it fills; until then
    # its tokens live in the request's residual slot r, rows r * block_size + offset
    residual_slots: torch.Tensor | None = None  # (T,) int64 residual row per token, or -1
    complete_pages: torch.Tensor | None = None  # (n,) int64 pages that fill this step
    # (n, block_size) int64: where each token of a completing page is in full precision:
    # i < R * block_size is residual row i (from an earlier step), else new token i - R * bs
    complete_src: torch.Tensor | None = None
    decode_residual_slots: torch.Tensor | None = None  # (num_decode,) int64, -1 if no tail


class AttentionBackend(ABC):
    """Writes a layer's new K/V into the paged cache and computes attention for the step."""

    name: str = "abstract"

    @abstractmethod
    def prepare(self, meta: AttentionMetadata) -> None:
        """Build per-step state shared by all layers (gather indices, masks). Called once per
        step before the first layer; it does not touch the cache."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # (T, Hq, D)
        k: torch.Tensor,  # (T, Hkv, D)
        v: torch.Tensor,  # (T, Hkv, D)
        cache: LayerCache,
        scale: float,
    ) -> torch.Tensor:
        """Store k/v at the step's slots (this mutates the cache), then return attention
        output of shape (T, Hq, D)."""
