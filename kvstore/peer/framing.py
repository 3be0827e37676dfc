"""KVTransfer's page framing: an encoded page object (``kvstore.codec``) cut into
``PagePiece``s so that no ``PageChunk`` message exceeds 1 MiB, and put back together.

Each piece carries the object's total size and the CRC-32 of the whole object; the receiver
reassembles the pieces in order and drops an object whose size or CRC does not match (a
miss, never wrong bytes). The codec's own header and checksum are checked again by whoever
decodes the page (``TieredStore``).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Hashable, Iterable, Iterator, Sequence

from kvmesh.kvstore.hashing import PAGE_HASH_BYTES
from kvmesh.protos.kvmesh.v1 import kv_transfer_pb2 as pb

logger = logging.getLogger(__name__)

MAX_CHUNK_BYTES = 1 << 20  # the largest serialized PageChunk either side sends
MAX_PAGE_BYTES = 1 << 30  # a receiver refuses to buffer an object claiming more than this
# bounds on protobuf framing: a piece's tag and length varint inside its chunk, and the same
# for the data field inside a piece (1 + at most 5 bytes each)
_EMBED = 6
_DATA_FIELD = 6
_MIN_PIECE_DATA = 4096  # start a new chunk rather than send a sliver of an object


def crc32(obj: bytes | memoryview) -> int:
    return zlib.crc32(obj) & 0xFFFFFFFF


def check_hashes(hashes: Sequence[bytes]) -> None:
    """Raise ValueError naming the first hash that is not a page hash."""
    for i, h in enumerate(hashes):
        if len(h) != PAGE_HASH_BYTES:
            raise ValueError(f"hash {i} is {len(h)} bytes; page hashes are {PAGE_HASH_BYTES} bytes")


def page_chunks(
    pages: Iterable[tuple[int, bytes, bytes | None]], max_bytes: int = MAX_CHUNK_BYTES
) -> Iterator[pb.PageChunk]:
    """``(index, hash, object or None)`` -> PageChunks of at most ``max_bytes`` serialized.

    Pieces follow the input order; an object is cut into consecutive pieces (offsets
    increasing) when it does not fit the room left in a chunk. ``None`` becomes a piece with
    ``found=False``.
    """
    chunk = pb.PageChunk()
    size = 0
    for index, h, obj in pages:
        if obj is None:
            piece = pb.PagePiece(hash=h, index=index, found=False)
            need = piece.ByteSize() + _EMBED
            if size + need > max_bytes and chunk.pieces:
                yield chunk
                chunk, size = pb.PageChunk(), 0
            chunk.pieces.append(piece)
            size += need
            continue
        view = memoryview(obj).cast("B")
        total = view.nbytes
        crc = crc32(view)
        offset = 0
        while True:
            header = pb.PagePiece(
                hash=h, index=index, found=True, total_size=total, offset=offset, crc32=crc
            )
            room = max_bytes - size - header.ByteSize() - _DATA_FIELD - _EMBED
            left = total - offset
            whole_fits_alone = offset == 0 and left <= max_bytes - header.ByteSize() - 64
            if chunk.pieces and (
                room < min(left, _MIN_PIECE_DATA) or (whole_fits_alone and room < left)
            ):  # a page that fits a chunk of its own is not split: one piece, no joins
                yield chunk
                chunk, size = pb.PageChunk(), 0
                continue
            if room < 1 and left > 0:
                raise ValueError(f"max_bytes={max_bytes} leaves no room for page data")
            n = min(left, room)
            header.data = view[offset : offset + n].tobytes()
            chunk.pieces.append(header)
            size += header.ByteSize() + _EMBED
            offset += n
            if offset >= total:
                break
    if chunk.pieces:
        yield chunk


class PageAssembler:
    """Reassembles pieces into objects, keyed by whatever the caller chooses (the index in a
    Fetch, the hash in a Push). Pieces of one object must arrive in order.

    Bounds: an object may claim at most ``max_page_bytes``; the objects started and not
    finished may together claim at most ``max_partial_bytes`` (None: no bound beyond the
    first), so a sender that starts many objects and never finishes them cannot make the
    receiver hold more than that: a piece that would go beyond is dropped."""

    def __init__(
        self, max_page_bytes: int = MAX_PAGE_BYTES, max_partial_bytes: int | None = None
    ) -> None:
        self.max_page_bytes = max_page_bytes
        self.max_partial_bytes = max_partial_bytes
        self._partial: dict[Hashable, tuple[bytearray, int, int]] = {}
        self._partial_bytes = 0  # sum of the sizes the unfinished objects claim
        self.corrupt = 0  # objects dropped: out-of-order piece, size or CRC mismatch
        self.over_limit = 0  # objects dropped for max_partial_bytes

    def add(self, key: Hashable, piece: pb.PagePiece) -> tuple[bool, bytes | None] | None:
        """Feed one piece. Returns None while the object is incomplete, ``(True, object)``
        when it is complete and intact, ``(False, None)`` for a miss or a dropped object."""
        if not piece.found:
            self._forget(key)
            return False, None
        if piece.offset == 0 and len(piece.data) == piece.total_size and key not in self._partial:
            # the whole object in one piece (the usual case): no reassembly copies
            if piece.total_size > self.max_page_bytes:
                return self._drop(key, f"object of {piece.total_size} bytes is too big")
            if crc32(piece.data) != piece.crc32:
                return self._drop(key, "CRC-32 mismatch")
            return True, piece.data
        started = self._partial.get(key)
        buf, total, crc = started or (bytearray(), piece.total_size, piece.crc32)
        if (
            started is None
            and self.max_partial_bytes is not None
            and total <= self.max_page_bytes
            and self._partial_bytes + total > self.max_partial_bytes
        ):
            self.over_limit += 1
            return self._drop(key, f"unfinished objects would claim over {self.max_partial_bytes}")
        if (
            piece.offset != len(buf)
            or piece.total_size != total
            or piece.crc32 != crc
            or total > self.max_page_bytes
            or len(buf) + len(piece.data) > total
        ):
            return self._drop(key, f"bad piece at offset {piece.offset} of {total} bytes")
        buf += piece.data
        if len(buf) < total:
            if started is None:
                self._partial_bytes += total
            self._partial[key] = (buf, total, crc)
            return None
        self._forget(key)
        obj = bytes(buf)
        if crc32(obj) != crc:
            return self._drop(key, "CRC-32 mismatch")
        return True, obj

    def _forget(self, key: Hashable) -> None:
        started = self._partial.pop(key, None)
        if started is not None:
            self._partial_bytes -= started[1]

    def _drop(self, key: Hashable, why: str) -> tuple[bool, None]:
        self._forget(key)
        self.corrupt += 1
        logger.warning("page transfer: dropping object %r: %s", key, why)
        return False, None

    def incomplete(self) -> list[Hashable]:
        """Keys whose objects were started but never finished."""
        return list(self._partial)
