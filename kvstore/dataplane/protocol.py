"""The data plane's wire format, version 2 (integers little-endian; docs/grpc.md, "Data
plane", and docs/security.md)::

    request  = head | count x 16-byte hash | 32-byte request MAC
    head     = "KVDP" | u16 version | u16 0 | 16-byte token | u32 count | 16-byte nonce
    response = count x (page head | length bytes | 32-byte page MAC if found)
    page head = u32 index | u8 found | 3 zero bytes | u64 length

The server answers every requested page, in request order: ``found`` 1 and the page's encoded
object (``kvstore.codec``), or ``found`` 0 and length 0. A connection carries any number of
requests, one after the other. A request with a wrong magic, version or token, too many
hashes, a wrong MAC, or bytes that are not a request closes the connection.

Authentication: ``key`` is derived from the cluster secret
(``protos.security.ClusterIdentity.data_plane_key``); it never travels. MACs are keyed
BLAKE3 (32 bytes; a keyed hash designed as a MAC, about 3x HMAC-SHA256's speed on the dev
VM, which matters at a page's 737 KB). The request MAC is BLAKE3(key, "request" | head |
hashes), so only a cluster member can ask for pages (the token, learnt over the
authenticated ``KVTransfer.DataPlane`` RPC, only ties a client to one server start). Each
found page's MAC is BLAKE3(key, "page" | nonce | page head | hash | object), so the client
accepts only objects a member sent for this very request (the nonce is the client's, fresh
per request: a recorded answer cannot be replayed). The bytes are not encrypted.

Integrity: objects are length-framed, so a truncated one never completes (a miss); TCP's
checksums cover the bytes on the wire; and, as for pages that came through ``Fetch``, the
codec's header and xxh3-128 checksum are checked by whoever decodes the page
(``TieredStore``): a corrupt or foreign object is a miss there, never KV.
"""

from __future__ import annotations

import hmac
import struct
from collections.abc import Sequence

from blake3 import blake3

from kvmesh.kvstore.hashing import PAGE_HASH_BYTES

MAGIC = b"KVDP"
VERSION = 2
TOKEN_BYTES = 16
NONCE_BYTES = 16
MAC_BYTES = 32  # keyed BLAKE3
KEY_BYTES = 32
MAX_REQUEST_PAGES = 1 << 16  # 1 MiB of hashes: the most one request may name
MAX_OBJECT_BYTES = 1 << 30  # a client refuses an object claiming more than this
REQUEST_HEAD = struct.Struct("<4sHH16sI16s")  # magic, version, reserved, token, count, nonce
PAGE_HEAD = struct.Struct("<IB3xQ")  # index, found, pad, length
MISS, FOUND = 0, 1


class DataPlaneError(ConnectionError):
    """A data-plane connection that could not be opened, was closed early, or carried bytes
    that break the protocol."""


def check_key(key: bytes) -> bytes:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        n = len(key) if isinstance(key, bytes) else type(key).__name__
        raise ValueError(f"the data-plane key must be {KEY_BYTES} bytes, got {n}")
    return key


def encode_request(token: bytes, hashes: Sequence[bytes], key: bytes, nonce: bytes) -> bytes:
    """A request for ``hashes`` (at most ``MAX_REQUEST_PAGES``; the caller splits), MAC'd
    with ``key``; ``nonce`` (``NONCE_BYTES``, fresh per request) binds the answer to it."""
    for h in hashes:
        if len(h) != PAGE_HASH_BYTES:
            raise DataPlaneError(f"page hashes are {PAGE_HASH_BYTES} bytes, got {len(h)}")
    head = REQUEST_HEAD.pack(MAGIC, VERSION, 0, token, len(hashes), nonce)
    body = b"".join((head, *hashes))
    return body + request_mac(key, head, body[len(head) :])


def request_mac(key: bytes, head: bytes | bytearray, raw_hashes: bytes | bytearray) -> bytes:
    m = blake3(b"request", key=key)
    m.update(head)
    m.update(raw_hashes)
    return m.digest()


def request_mac_ok(key: bytes, head: bytes | bytearray, raw_hashes: bytes | bytearray, mac) -> bool:
    """Whether a request's MAC is right (constant-time)."""
    return hmac.compare_digest(request_mac(key, head, raw_hashes), bytes(mac))


def page_mac(key: bytes, nonce: bytes, page_head: bytes, page_hash: bytes, obj) -> bytes:
    """The MAC of one found page of the answer to the request with ``nonce``."""
    m = blake3(b"".join((b"page", nonce, page_head, page_hash)), key=key)
    m.update(obj)
    return m.digest()


def read_request_head(head: bytes | bytearray, token: bytes, max_pages: int) -> tuple[int, bytes]:
    """The page count and nonce of a request head (``REQUEST_HEAD.size`` bytes) that carries
    this server's ``token``; a ``DataPlaneError`` naming what is wrong otherwise. (The MAC
    over the whole request is checked once its hashes are in.)"""
    magic, version, _, got, count, nonce = REQUEST_HEAD.unpack(head)
    if magic != MAGIC:
        raise DataPlaneError(f"not a data-plane request (magic {magic!r})")
    if version != VERSION:
        raise DataPlaneError(f"protocol version {version}, this server speaks {VERSION}")
    if not hmac.compare_digest(got, token):
        raise DataPlaneError("wrong token")
    if count > max_pages:
        raise DataPlaneError(f"{count} hashes in one request, at most {max_pages}")
    return count, nonce


def split_hashes(raw: bytes | bytearray) -> list[bytes]:
    """The page hashes of a request's body (``count * PAGE_HASH_BYTES`` bytes)."""
    return [bytes(raw[i : i + PAGE_HASH_BYTES]) for i in range(0, len(raw), PAGE_HASH_BYTES)]
