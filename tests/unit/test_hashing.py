"""kvstore.hashing: the one page identity shared by engine, store and router."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvmesh.kvstore.hashing import PAGE_HASH_BYTES, hash_pages, page_hash, root_hash

FP = "test-fp"
TOKENS = list(range(100, 118))  # 18 tokens: 4 full pages of 4, plus 2 left over

# Computed once, independently, with hashlib.blake2b as kvstore/hashing.py specifies. A change
# here means every prefix index, Redis key and stored page in a running cluster stops matching.
PINNED_ROOT = "7c65872ccbac85476d5f729ea2408698"
PINNED_PAGES = [
    "528fb25458997aeb3261b836bfcff05c",
    "4d06bca9b892da1c9b728e1c3bd372f4",
    "c7e5807c3424d8a37998079f9546bcce",
    "290b355c832642f4e37ee6d4a90f22b7",
]


def test_root_hash_is_pinned_and_sized():
    r = root_hash(FP)
    assert len(r) == PAGE_HASH_BYTES == 16
    assert r.hex() == PINNED_ROOT


def test_page_hashes_are_pinned():
    hs = hash_pages(TOKENS, 4, FP)
    assert [h.hex() for h in hs] == PINNED_PAGES


def test_same_tokens_same_hashes_across_calls():
    a = hash_pages(TOKENS, 4, FP)
    b = hash_pages(list(TOKENS), 4, FP)
    c = hash_pages(tuple(TOKENS), 4, FP)
    assert a == b == c
    assert len(set(a)) == len(a)  # distinct pages, distinct hashes
    assert all(len(h) == PAGE_HASH_BYTES for h in a)


def test_hashes_independent_of_python_hash_seed():
    code = (
        "from kvmesh.kvstore.hashing import hash_pages;"
        f"print(','.join(h.hex() for h in hash_pages({TOKENS!r}, 4, {FP!r})))"
    )
    here = ",".join(h.hex() for h in hash_pages(TOKENS, 4, FP))
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == here


def test_only_full_pages_are_hashed():
    assert len(hash_pages(TOKENS, 4, FP)) == 4  # 18 // 4
    assert hash_pages(TOKENS[:3], 4, FP) == []
    assert hash_pages([], 4, FP) == []
    assert len(hash_pages(TOKENS[:16], 4, FP)) == 4
    # the partial tail page does not affect the full pages' hashes
    assert hash_pages(TOKENS[:16], 4, FP) == hash_pages(TOKENS, 4, FP)
    assert hash_pages(TOKENS[:16] + [7], 4, FP) == hash_pages(TOKENS, 4, FP)


def test_chaining_changing_page0_changes_every_later_hash():
    base = hash_pages(TOKENS, 4, FP)
    changed = list(TOKENS)
    changed[0] += 1
    other = hash_pages(changed, 4, FP)
    assert all(a != b for a, b in zip(base, other, strict=True))


def test_changing_a_later_page_keeps_earlier_hashes():
    base = hash_pages(TOKENS, 4, FP)
    changed = list(TOKENS)
    changed[9] += 1  # page 2
    other = hash_pages(changed, 4, FP)
    assert other[:2] == base[:2]
    assert other[2] != base[2] and other[3] != base[3]


def test_chain_matches_page_hash_definition():
    hs = hash_pages(TOKENS, 4, FP)
    h = root_hash(FP)
    for i, got in enumerate(hs):
        h = page_hash(h, TOKENS[i * 4 : (i + 1) * 4])
        assert got == h


def test_same_page_tokens_at_different_positions_hash_differently():
    tokens = [5, 6, 7, 8] * 3
    hs = hash_pages(tokens, 4, FP)
    assert len(set(hs)) == 3


def test_incremental_equals_whole_sequence():
    whole = hash_pages(TOKENS, 4, FP)
    for k in range(1, 4):
        head = hash_pages(TOKENS[: 4 * k], 4, FP)
        tail = hash_pages(TOKENS, 4, FP, parent=head[-1], start_page=k)
        assert head + tail == whole
    # a parent of root_hash with start_page 0 equals the default
    assert hash_pages(TOKENS, 4, FP, parent=root_hash(FP), start_page=0) == whole


def test_model_fingerprint_separates_hashes():
    a = hash_pages(TOKENS, 4, "model-a")
    b = hash_pages(TOKENS, 4, "model-b")
    assert root_hash("model-a") != root_hash("model-b")
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_block_size_changes_hashes():
    assert hash_pages(TOKENS[:8], 8, FP)[0] not in hash_pages(TOKENS[:8], 4, FP)


def test_token_encoding_is_not_ambiguous():
    # uint32 little-endian: tokens 1 and 256 must not collide with a byte-wise encoding
    parent = root_hash(FP)
    assert page_hash(parent, [1, 0]) != page_hash(parent, [256])
    assert page_hash(parent, [0, 1]) != page_hash(parent, [1, 0])
    assert page_hash(parent, [2**32 - 1]) != page_hash(parent, [0])


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: hash_pages(TOKENS, 0, FP), "block_size"),
        (lambda: hash_pages(TOKENS, -4, FP), "block_size"),
        (lambda: hash_pages(TOKENS, 4, ""), "fingerprint"),
        (lambda: root_hash(""), "fingerprint"),
        (lambda: hash_pages(TOKENS, 4, FP, start_page=2), "parent"),
        (lambda: page_hash(b"short", [1, 2, 3, 4]), "16 bytes"),
        (lambda: hash_pages(TOKENS, 4, FP, parent=b"\0" * 32, start_page=1), "16 bytes"),
    ],
)
def test_bad_arguments_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("bad_token", [-1, 2**32])
def test_out_of_range_token_id_raises_value_error(bad_token):
    # a token id that uint32 cannot encode is bad input like any other: ValueError, not
    # struct.error (which callers catching ValueError would let escape)
    with pytest.raises(ValueError):
        page_hash(root_hash(FP), [1, 2, bad_token, 4])
    with pytest.raises(ValueError):
        hash_pages([1, 2, bad_token, 4], 4, FP)


def test_negative_start_page_raises_value_error():
    # a negative start_page would hash an empty "page" and return more hashes than pages
    parent = root_hash(FP)
    with pytest.raises(ValueError, match="start_page"):
        hash_pages(TOKENS[:4], 4, FP, parent=parent, start_page=-1)


def test_bytes_input_hashes_each_byte_as_one_token():
    # bytes are a sequence of small ints; they must not be read as packed uint32s
    data = bytes(range(8))
    assert hash_pages(data, 4, FP) == hash_pages(list(data), 4, FP)
    assert len(hash_pages(bytearray(data), 4, FP)) == 2


def test_cache_salt_changes_every_page_and_only_equal_salts_match():
    toks = list(range(64))
    plain = hash_pages(toks, 16, "fp")
    a = hash_pages(toks, 16, "fp", cache_salt="tenant-a")
    b = hash_pages(toks, 16, "fp", cache_salt="tenant-b")
    assert hash_pages(toks, 16, "fp", cache_salt=None) == plain  # no salt: the old hashes
    assert hash_pages(toks, 16, "fp", cache_salt="") == plain  # "" is the wire's "unset"
    assert hash_pages(toks, 16, "fp", cache_salt="tenant-a") == a
    # mixed into the first page, and through the chain into every later one
    assert not set(a) & set(plain) and not set(a) & set(b) and not set(b) & set(plain)
    assert a[0] == page_hash(root_hash("fp", "tenant-a"), toks[:16])


def test_salted_roots_are_not_ambiguous():
    # the fingerprint is length-prefixed: moving a character between it and the salt changes
    # the root
    assert root_hash("fpX", "salt") != root_hash("fp", "Xsalt")
    assert root_hash("fp", "s") != root_hash("fp")


def test_incremental_hashing_keeps_the_salt_through_the_parent():
    toks = list(range(48))
    whole = hash_pages(toks, 16, "fp", cache_salt="t")
    first = hash_pages(toks[:16], 16, "fp", cache_salt="t")
    rest = hash_pages(toks, 16, "fp", parent=first[-1], start_page=1)
    assert first + rest == whole
