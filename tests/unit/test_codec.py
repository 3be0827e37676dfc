"""The page codec: byte-exact round trips, and every mismatch a named rejection."""

from __future__ import annotations

import dataclasses
import random
import struct

import msgpack
import pytest

from kvmesh.kvstore.codec import CODEC_VERSION, PageCodecError, PageSpec, decode, encode

# SmolLM2-135M fp32: 30 layers * 2 (K, V) * 16 tokens * 3 kv heads * 64 * 4 bytes
SMOL = PageSpec("0123abcd" * 4, "fp32", 30, 3, 64, 16, 30 * 2 * 16 * 3 * 64 * 4)
SMALL = PageSpec("ab" * 16, "int4", 2, 1, 8, 4, 300)


def rand_bytes(rng: random.Random, n: int) -> bytes:
    return rng.randbytes(n)


def rewrite_header(obj: bytes, **changes) -> bytes:
    """``obj`` with header fields replaced, the payload kept as is."""
    (hlen,) = struct.unpack_from("<I", obj)
    header = msgpack.unpackb(obj[4 : 4 + hlen])
    header.update(changes)
    new = msgpack.packb(header)
    return struct.pack("<I", len(new)) + new + obj[4 + hlen :]


@pytest.mark.parametrize("spec", [SMOL, SMALL], ids=["smollm2-fp32", "small-int4"])
def test_round_trip_is_byte_identical(spec):
    rng = random.Random(0)
    for _ in range(5):
        payload = rand_bytes(rng, spec.page_nbytes)
        obj = encode(spec, payload)
        out = decode(spec, obj)
        assert isinstance(out, memoryview)
        assert out.tobytes() == payload


def test_accepts_any_contiguous_buffer_and_decodes_without_copy():
    import numpy as np

    arr = np.arange(SMALL.page_nbytes // 4, dtype=np.int32)  # (75,) int32 = 300 bytes
    obj = encode(SMALL, memoryview(arr))
    assert encode(SMALL, bytearray(arr.tobytes())) == obj
    out = decode(SMALL, obj)
    assert out.obj is obj  # a view into the stored object, not a copy
    assert np.array_equal(np.frombuffer(out, dtype=np.int32), arr)


def test_encode_rejects_wrong_payload_size():
    with pytest.raises(ValueError, match="page_nbytes=300"):
        encode(SMALL, b"x" * 299)


@pytest.mark.parametrize(
    "field,value",
    [
        ("model_fp", "ff" * 16),
        ("cache_format", "fp16"),
        ("num_layers", 3),
        ("num_kv_heads", 2),
        ("head_size", 16),
        ("block_size", 8),
    ],
)
def test_reader_with_other_spec_rejects_naming_the_field(field, value):
    obj = encode(SMALL, bytes(SMALL.page_nbytes))
    reader = dataclasses.replace(SMALL, **{field: value})
    with pytest.raises(PageCodecError) as e:
        decode(reader, obj)
    assert e.value.field == field


@pytest.mark.parametrize(
    "field,value",
    [
        ("magic", b"XXXX"),
        ("version", CODEC_VERSION + 1),
        ("model_fp", "ee" * 16),
        ("cache_format", "int8"),
        ("num_layers", 99),
        ("num_kv_heads", 99),
        ("head_size", 99),
        ("block_size", 99),
        ("payload_len", 299),
        ("checksum", b"\0" * 16),
    ],
)
def test_every_header_field_is_checked(field, value):
    obj = rewrite_header(encode(SMALL, bytes(range(256)) + bytes(44)), **{field: value})
    with pytest.raises(PageCodecError) as e:
        decode(SMALL, obj)
    assert e.value.field == field
    assert field in str(e.value)


def test_foreign_codec_version_is_rejected_before_anything_else():
    # A future version may lay out its header differently: nothing else is trusted.
    obj = rewrite_header(encode(SMALL, bytes(300)), version=2, model_fp="x", num_layers="?")
    with pytest.raises(PageCodecError, match="version") as e:
        decode(SMALL, obj)
    assert e.value.field == "version"


@pytest.mark.parametrize("cut", [1, 100, SMALL.page_nbytes - 1])
def test_truncated_object_is_rejected(cut):
    obj = encode(SMALL, bytes(SMALL.page_nbytes))
    with pytest.raises(PageCodecError) as e:
        decode(SMALL, obj[:-cut])
    assert e.value.field == "payload_len"


def test_object_with_extra_bytes_is_rejected():
    obj = encode(SMALL, bytes(SMALL.page_nbytes))
    with pytest.raises(PageCodecError) as e:
        decode(SMALL, obj + b"\0")
    assert e.value.field == "payload_len"


def test_truncated_header_is_rejected():
    obj = encode(SMALL, bytes(SMALL.page_nbytes))
    for n in (0, 3, 4, 20):
        with pytest.raises(PageCodecError) as e:
            decode(SMALL, obj[:n])
        assert e.value.field == "header"


def test_any_flipped_payload_byte_fails_the_checksum():
    rng = random.Random(1)
    payload = rand_bytes(rng, SMOL.page_nbytes)
    obj = encode(SMOL, payload)
    start = len(obj) - SMOL.page_nbytes
    for pos in (start, start + 12345, len(obj) - 1):
        bad = bytearray(obj)
        bad[pos] ^= 0x01
        with pytest.raises(PageCodecError) as e:
            decode(SMOL, bytes(bad))
        assert e.value.field == "checksum"


@pytest.mark.parametrize(
    "garbage",
    [
        b"",
        b"hello",
        b"\x10\x00\x00\x00" + b"\xc1" * 16 + bytes(300),  # 0xc1: never valid msgpack
        struct.pack("<I", 5) + msgpack.packb([1, 2]) + bytes(300),  # msgpack, not a map
        struct.pack("<I", 0xFFFFFFFF) + bytes(400),  # absurd header length
        random.Random(2).randbytes(1000),
    ],
    ids=["empty", "short", "not-msgpack", "not-a-map", "huge-length", "random"],
)
def test_garbage_is_rejected_not_crashed_on(garbage):
    with pytest.raises(PageCodecError) as e:
        decode(SMALL, garbage)
    assert e.value.field in {"header", "magic"}


def test_pagecodecerror_is_a_valueerror_with_field_and_message():
    err = PageCodecError("checksum", "mismatch")
    assert isinstance(err, ValueError)
    assert (err.field, err.message, str(err)) == ("checksum", "mismatch", "checksum: mismatch")


@pytest.mark.parametrize(
    "change,match",
    [
        ({"model_fp": ""}, "model_fp"),
        ({"model_fp": "XYZ"}, "model_fp"),
        ({"cache_format": ""}, "cache_format"),
        ({"cache_format": "fp:16"}, "cache_format"),
        ({"num_layers": 0}, "num_layers"),
        ({"head_size": 2.0}, "head_size"),
        ({"block_size": True}, "block_size"),
        ({"page_nbytes": -1}, "page_nbytes"),
    ],
)
def test_pagespec_validates(change, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(SMALL, **change)
