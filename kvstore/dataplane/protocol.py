"""The data plane's wire format, version 1 (integers little-endian; docs/grpc.md, "Data
plane")::

    request  = "KVDP" | u16 version | u16 0 | 16-byte token | u32 count | count x 16-byte hash
    response = count x (u32 index | u8 found | 3 zero bytes | u64 length | length bytes)

The server answers every requested page, in request order: ``found`` 1 and the page's encoded
object (``kvstore.codec``), or ``found`` 0 and length 0. A connection carries any number of
requests, one after the other. A request with a wrong magic, version or token, too many
hashes, or bytes that are not a request closes the connection.

Integrity: objects are length-framed, so a truncated one never completes (a miss); TCP's
checksums cover the bytes on the wire; and, as for pages that came through ``Fetch``, the
codec's header and xxh3-128 checksum are checked by whoever decodes the page
(``TieredStore``): a corrupt or foreign object is a miss there, never KV.
"""

from __future__ import annotations

import hmac
import struct
from collections.abc import Sequence

from kvmesh.kvstore.hashing import PAGE_HASH_BYTES

MAGIC = b"KVDP"
VERSION = 1
TOKEN_BYTES = 16
MAX_REQUEST_PAGES = 1 << 16  # 1 MiB of hashes: the most one request may name
MAX_OBJECT_BYTES = 1 << 30  # a client refuses an object claiming more than this
REQUEST_HEAD = struct.Struct("<4sHH16sI")  # magic, version, reserved, token, count
PAGE_HEAD = struct.Struct("<IB3xQ")  # index, found, pad, length
MISS, FOUND = 0, 1


class DataPlaneError(ConnectionError):
    """A data-plane connection that could not be opened, was closed early, or carried bytes
    that break the protocol."""


def encode_request(token: bytes, hashes: Sequence[bytes]) -> bytes:
    """A request for ``hashes`` (at most ``MAX_REQUEST_PAGES``; the caller splits)."""
    for h in hashes:
        if len(h) != PAGE_HASH_BYTES:
            raise DataPlaneError(f"page hashes are {PAGE_HASH_BYTES} bytes, got {len(h)}")
    head = REQUEST_HEAD.pack(MAGIC, VERSION, 0, token, len(hashes))
    return b"".join((head, *hashes))


def read_request_head(head: bytes | bytearray, token: bytes, max_pages: int) -> int:
    """The page count of a request head (``REQUEST_HEAD.size`` bytes) that carries this
    server's ``token``; a ``DataPlaneError`` naming what is wrong otherwise."""
    magic, version, _, got, count = REQUEST_HEAD.unpack(head)
    if magic != MAGIC:
        raise DataPlaneError(f"not a data-plane request (magic {magic!r})")
    if version != VERSION:
        raise DataPlaneError(f"protocol version {version}, this server speaks {VERSION}")
    if not hmac.compare_digest(got, token):
        raise DataPlaneError("wrong token")
    if count > max_pages:
        raise DataPlaneError(f"{count} hashes in one request, at most {max_pages}")
    return count


def split_hashes(raw: bytes | bytearray) -> list[bytes]:
    """The page hashes of a request's body (``count * PAGE_HASH_BYTES`` bytes)."""
    return [bytes(raw[i : i + PAGE_HASH_BYTES]) for i in range(0, len(raw), PAGE_HASH_BYTES)]
