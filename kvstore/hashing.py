"""Page identity: the chained page hash shared by the engine, the store and the router.

``h_i = blake2b(h_{i-1} || tokens of page i)`` with ``h_{-1}`` derived from the model
fingerprint. Tokens are encoded canonically as little-endian uint32, so the same prompt gives
the same hashes in every process and on every machine. Only full pages are hashed.

A request's ``cache_salt`` (vLLM's per-request salt for tenant isolation) is mixed into
``h_{-1}`` and so into the first page's hash, and through the chain into every later one:
requests share cached pages only when their salts are equal (no salt is its own group).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

PAGE_HASH_BYTES = 16
_ROOT_DOMAIN = b"kvmesh/page-hash/v1"
# A page hasher with the domain already absorbed; each page hash copies it (cheaper than
# constructing a personalised blake2b per page: the router hashes 1,024 pages per 16K prompt).
_PAGE_HASHER = hashlib.blake2b(digest_size=PAGE_HASH_BYTES, person=b"kvmesh-page")
_PAGE_HASHER.update(_ROOT_DOMAIN)
# array typecode of a 4-byte unsigned int ("I" on every common platform).
_U32 = next(t for t in ("I", "L") if array(t).itemsize == 4)


def _encode_tokens(tokens: Sequence[int]) -> memoryview:
    """Token ids as little-endian uint32 bytes; ValueError for ids outside [0, 2**32)."""
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        tokens = list(tokens)  # array() would read raw bytes as packed uint32s
    try:
        a = array(_U32, tokens)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"token ids must be integers in [0, 2**32): {e}") from None
    if sys.byteorder != "little":
        a.byteswap()
    return memoryview(a).cast("B")


def root_hash(model_fp: str, cache_salt: str | None = None) -> bytes:
    """``h_{-1}``: the parent of a prompt's first page, derived from the model fingerprint
    and, when given, the request's cache salt (None and "" are both "no salt")."""
    if not model_fp:
        raise ValueError("model fingerprint must be a non-empty string")
    fp = model_fp.encode("utf-8")
    if not cache_salt:
        return hashlib.blake2b(fp, digest_size=PAGE_HASH_BYTES, person=b"kvmesh-root").digest()
    if not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
    # length-prefixed, under a person of its own: no (fingerprint, salt) pair can produce an
    # unsalted root or another pair's root
    h = hashlib.blake2b(digest_size=PAGE_HASH_BYTES, person=b"kvmesh-salted")
    h.update(len(fp).to_bytes(8, "little"))
    h.update(fp)
    h.update(cache_salt.encode("utf-8", "surrogatepass"))
    return h.digest()


def page_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Hash of one full page given its parent's hash and its token ids."""
    if len(parent) != PAGE_HASH_BYTES:
        raise ValueError(f"parent hash must be {PAGE_HASH_BYTES} bytes, got {len(parent)}")
    h = _PAGE_HASHER.copy()
    h.update(parent)
    h.update(_encode_tokens(tokens))
    return h.digest()


def hash_pages(
    token_ids: Sequence[int],
    block_size: int,
    model_fp: str,
    *,
    parent: bytes | None = None,
    start_page: int = 0,
    cache_salt: str | None = None,
) -> list[bytes]:
    """Hashes of every full page of ``token_ids`` from ``start_page`` on.

    ``parent`` is the hash of page ``start_page - 1`` (``root_hash(model_fp, cache_salt)``
    when ``start_page`` is 0), which lets a caller extend a sequence's hashes incrementally;
    ``cache_salt`` is read only when there is no ``parent``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    h = parent if parent is not None else root_hash(model_fp, cache_salt)
    if start_page < 0:
        raise ValueError(f"start_page must be >= 0, got {start_page}")
    if parent is None and start_page != 0:
        raise ValueError("parent is required when start_page > 0")
    if len(h) != PAGE_HASH_BYTES:
        raise ValueError(f"parent hash must be {PAGE_HASH_BYTES} bytes, got {len(h)}")
    n_pages = len(token_ids) // block_size
    if start_page >= n_pages:
        return []
    # Encode only the pages hashed, once, and feed each page's slice to a copied hasher.
    data = _encode_tokens(token_ids[start_page * block_size : n_pages * block_size])
    step = 4 * block_size
    out: list[bytes] = []
    copy = _PAGE_HASHER.copy
    for off in range(0, len(data), step):
        x = copy()
        x.update(h)
        x.update(data[off : off + step])
        h = x.digest()
        out.append(h)
    return out
