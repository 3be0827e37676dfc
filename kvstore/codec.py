"""The page codec: one self-describing object per page, the unit every tier stores.

Layout of an encoded object (all tiers, the wire, every machine)::

    [u32 little-endian: header length H][H bytes: msgpack map][payload: page_nbytes bytes]

The length prefix lets ``decode`` find the payload without scanning; the payload is never
copied on decode (a ``memoryview`` slice of the object). The header names the model, the cache
format and the page shape, so a reader with a different model or format sees a mismatch (a
miss), never foreign KV. The checksum is xxh3-128 of the payload, chosen over blake2b for
speed (docs/formats.md has the measurement); it guards against torn or corrupted objects,
not against an adversary.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

import msgpack
import xxhash

MAGIC = b"KVMP"  # kvmesh page
CODEC_VERSION = 1
CHECKSUM = "xxh3_128"

_LEN = struct.Struct("<I")
# A real header is ~200 bytes; anything far larger is not one of ours (and must not make us
# parse megabytes of garbage as msgpack).
_MAX_HEADER_BYTES = 4096
_HEX = re.compile(r"[0-9a-f]+")
_LAYOUT = re.compile(r"mha|mla-r[0-9]+-rope[0-9]+")

Buffer = bytes | bytearray | memoryview


class PageCodecError(ValueError):
    """An object that is not a valid page for this reader; ``field`` names what mismatched."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class PageSpec:
    """What a reader expects of every page: model, cache format and page shape.

    ``page_nbytes`` is the payload size of one page (for an fp32 page: layers * 2 (K and V)
    * block_size * kv_heads * head_size * 4; quantized formats include their scales).
    """

    model_fp: str  # lowercase hex model fingerprint
    cache_format: str  # auto/fp16/bf16/fp32/fp8/int8/int4: opaque here, compared as a string
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    page_nbytes: int
    # the page's inner layout (kernels.page_format.PageLayout.name): "mha" for per-head K/V,
    # "mla-r{rank}-rope{rope}" for DeepSeek latent pages. Objects written before this field
    # existed carry none and read as "mha"
    layout: str = "mha"

    def __post_init__(self) -> None:
        if not isinstance(self.model_fp, str) or not _HEX.fullmatch(self.model_fp):
            raise ValueError(
                f"model_fp must be a non-empty lowercase hex string, got {self.model_fp!r}"
            )
        if (
            not isinstance(self.cache_format, str)
            or not self.cache_format
            or ":" in self.cache_format
            or self.cache_format != self.cache_format.strip()
        ):
            raise ValueError(
                "cache_format must be a non-empty string without ':' or surrounding spaces "
                f"(e.g. 'fp16', 'int4'), got {self.cache_format!r}"
            )
        if not isinstance(self.layout, str) or not _LAYOUT.fullmatch(self.layout):
            raise ValueError(
                f"layout must be 'mha' or 'mla-r<rank>-rope<dim>', got {self.layout!r}"
            )
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size", "page_nbytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


# Header fields checked against the spec, in the order a reader reports them.
_SHAPE_FIELDS = ("model_fp", "cache_format", "num_layers", "num_kv_heads", "head_size")


def max_object_bytes(spec: PageSpec) -> int:
    """The most bytes a valid object for ``spec`` can take (length prefix, header, payload);
    a transport can refuse anything longer before setting memory aside for it."""
    return _LEN.size + _MAX_HEADER_BYTES + spec.page_nbytes


def checksum(payload: Buffer) -> bytes:
    """The 16-byte xxh3-128 digest stored in the header."""
    return xxhash.xxh3_128_digest(payload)


def encode(spec: PageSpec, payload: Buffer) -> bytes:
    """One stored object for ``payload`` (exactly ``spec.page_nbytes`` bytes).

    Copies the payload once (into the returned object); the header is ~150 bytes.
    """
    view = memoryview(payload).cast("B")  # byte view of any contiguous buffer
    if view.nbytes != spec.page_nbytes:
        raise ValueError(
            f"payload is {view.nbytes} bytes, the page spec says page_nbytes={spec.page_nbytes}"
        )
    header = msgpack.packb(
        {
            "magic": MAGIC,
            "version": CODEC_VERSION,
            "model_fp": spec.model_fp,
            "cache_format": spec.cache_format,
            "num_layers": spec.num_layers,
            "num_kv_heads": spec.num_kv_heads,
            "head_size": spec.head_size,
            "block_size": spec.block_size,
            "layout": spec.layout,
            "payload_len": view.nbytes,
            "checksum": checksum(view),
        }
    )
    return b"".join((_LEN.pack(len(header)), header, view))


def read_header(obj: Buffer) -> tuple[dict, int]:
    """The decoded header of ``obj`` and the offset where its payload starts.

    Checks framing, magic and version only (so the header of a foreign model can still be
    inspected); raises ``PageCodecError`` naming the field.
    """
    view = memoryview(obj).cast("B")
    if view.nbytes < _LEN.size:
        raise PageCodecError("header", f"object of {view.nbytes} bytes is too short for a page")
    (hlen,) = _LEN.unpack_from(view, 0)
    if hlen > _MAX_HEADER_BYTES or _LEN.size + hlen > view.nbytes:
        raise PageCodecError(
            "header", f"header length {hlen} does not fit an object of {view.nbytes} bytes"
        )
    try:
        header = msgpack.unpackb(view[_LEN.size : _LEN.size + hlen], raw=False)
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise PageCodecError("header", f"not a msgpack header ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise PageCodecError("header", f"header is a {type(header).__name__}, not a map")
    if header.get("magic") != MAGIC:
        raise PageCodecError("magic", f"expected {MAGIC!r}, got {header.get('magic')!r}")
    if header.get("version") != CODEC_VERSION:
        raise PageCodecError(
            "version", f"codec version {header.get('version')!r}, this reader reads {CODEC_VERSION}"
        )
    return header, _LEN.size + hlen


def decode(spec: PageSpec, obj: Buffer) -> memoryview:
    """The validated payload of ``obj`` as a zero-copy view into it.

    Raises ``PageCodecError`` naming the first field that does not match: header, magic,
    version, model_fp, cache_format, num_layers, num_kv_heads, head_size, block_size,
    layout, payload_len (including a truncated object), checksum.
    """
    header, start = read_header(obj)
    for name in (*_SHAPE_FIELDS, "block_size"):
        got, want = header.get(name), getattr(spec, name)
        if got != want:
            raise PageCodecError(name, f"object has {got!r}, reader expects {want!r}")
    got = header.get("layout", "mha")  # objects from before the field were all "mha"
    if got != spec.layout:
        raise PageCodecError("layout", f"object has {got!r}, reader expects {spec.layout!r}")
    view = memoryview(obj).cast("B")
    n = header.get("payload_len")
    if n != spec.page_nbytes:
        raise PageCodecError(
            "payload_len", f"object says {n!r} bytes, reader expects {spec.page_nbytes}"
        )
    if view.nbytes - start != n:
        raise PageCodecError(
            "payload_len", f"object carries {view.nbytes - start} payload bytes, header says {n}"
        )
    payload = view[start:]
    if checksum(payload) != header.get("checksum"):
        raise PageCodecError("checksum", f"{CHECKSUM} of the payload does not match the header")
    return payload
