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
class PrefillSpan:
    """One request's chunk of ``q_len > 1`` new tokens at ``tokens[start:start + q_len]``."""

    start: int
    q_len: int
    context_len: int  # cached + new tokens: the keys this chunk attends to
    block_table: torch.Tensor  # (num_pages,) int64 page ids covering context_len


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64: flat slot (page * block_size + offset) per new token
    num_decode: int  # the first num_decode tokens are single-token requests
    decode_block_tables: torch.Tensor  # (num_decode, max_pages) int64, padded with the null page
    decode_context_lens: torch.Tensor  # (num_decode,) int64
    prefills: list[PrefillSpan]
    block_size: int


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
        k_cache: torch.Tensor,  # (num_pages, block_size, Hkv, D)
        v_cache: torch.Tensor,  # (num_pages, block_size, Hkv, D)
        scale: float,
    ) -> torch.Tensor:
        """Store k/v at the step's slots (this mutates the caches), then return attention
        output of shape (T, Hq, D)."""
