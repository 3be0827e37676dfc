"""Page identity: the chained page hash shared by the engine, the store and the router.

``h_i = blake2b(h_{i-1} || tokens of page i)`` with ``h_{-1}`` derived from the model
fingerprint. Tokens are encoded canonically as little-endian uint32, so the same prompt gives
the same hashes in every process and on every machine. Only full pages are hashed.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

PAGE_HASH_BYTES = 16
_ROOT_DOMAIN = b"kvmesh/page-hash/v1"


def root_hash(model_fp: str) -> bytes:
    """``h_{-1}``: the parent of a prompt's first page, derived from the model fingerprint."""
    if not model_fp:
        raise ValueError("model fingerprint must be a non-empty string")
    return hashlib.blake2b(
        model_fp.encode("utf-8"), digest_size=PAGE_HASH_BYTES, person=b"kvmesh-root"
    ).digest()


def page_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Hash of one full page given its parent's hash and its token ids."""
    if len(parent) != PAGE_HASH_BYTES:
        raise ValueError(f"parent hash must be {PAGE_HASH_BYTES} bytes, got {len(parent)}")
    h = hashlib.blake2b(digest_size=PAGE_HASH_BYTES, person=b"kvmesh-page")
    h.update(_ROOT_DOMAIN)
    h.update(parent)
    try:
        h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    except struct.error as e:
        raise ValueError(f"token ids must be integers in [0, 2**32): {e}") from None
    return h.digest()


def hash_pages(
    token_ids: Sequence[int],
    block_size: int,
    model_fp: str,
    *,
    parent: bytes | None = None,
    start_page: int = 0,
) -> list[bytes]:
    """Hashes of every full page of ``token_ids`` from ``start_page`` on.

    ``parent`` is the hash of page ``start_page - 1`` (``root_hash(model_fp)`` when
    ``start_page`` is 0), which lets a caller extend a sequence's hashes incrementally.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    h = parent if parent is not None else root_hash(model_fp)
    if start_page < 0:
        raise ValueError(f"start_page must be >= 0, got {start_page}")
    if parent is None and start_page != 0:
        raise ValueError("parent is required when start_page > 0")
    out: list[bytes] = []
    for i in range(start_page, len(token_ids) // block_size):
        h = page_hash(h, token_ids[i * block_size : (i + 1) * block_size])
        out.append(h)
    return out
