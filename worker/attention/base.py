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
    ``(R, block_size, Hkv, D)``, contiguous. Each request owns ``residual_pages`` (W) of
    them, a ring: the request in slot ``r`` keeps page ``j`` of its cache in residual page
    ``residual_page(r, j) = r * W + j % W`` while ``j`` is among its last W pages."""

    cache_format: str
    views: dict[str, torch.Tensor]
    residual_k: torch.Tensor | None = None
    residual_v: torch.Tensor | None = None
    residual_pages: int = 1

    def residual_page(self, slot: int, page: int) -> int:
        return residual_page(slot, page, self.residual_pages)

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
    residual_slot: int = -1  # quantized formats: the residual page of the partial last page
    # quantized formats: the request's residual slot whatever the step leaves in it; before
    # the step's write its ring holds the request's last pages (the chunk's first page's
    # earlier tokens among them), which the chunk's queries read exact (worker.attention.
    # own_page)
    request_slot: int = -1
    residual_pages: int = 1  # W: the ring's length (LayerCache.residual_pages)
    ring_from: int = 0  # the first page the request computed itself: earlier pages (a
    # restored prefix) have no full-precision copy and are read quantized


def residual_page(slot: int, page: int, pages: int) -> int:
    """The residual page (first axis of ``residual_k/v``) holding page ``page`` of the
    request in residual slot ``slot``, with ``pages`` residual pages per slot."""
    return slot * pages + page % pages


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
    # quantized formats only (empty otherwise): a page is quantized when it fills; while it
    # is among the request's last W pages its tokens also live in the request's ring, at
    # residual rows residual_page(r, page) * block_size + offset
    residual_slots: torch.Tensor | None = None  # (T,) int64 residual row per token, or -1
    complete_pages: torch.Tensor | None = None  # (n,) int64 pages that fill this step
    # (n, block_size) int64: where each token of a completing page is in full precision:
    # i < R * block_size is residual row i (from an earlier step), else new token i - R * bs
    complete_src: torch.Tensor | None = None
    # (num_decode, W) int64: entry [b, i] is the residual page holding page last_b - W + 1 + i
    # of decode sequence b (last_b = (context_len - 1) // block_size), -1 where that page is
    # read from the pool (a restored prefix page, or a page index < 0)
    decode_residual_slots: torch.Tensor | None = None


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
