"""kvstore/redis_fast.py on canned RESP bytes over a socketpair (no server): the slab pool's
bookkeeping and the reader's bounds on a hostile or confused reply."""

from __future__ import annotations

import socket

import pytest

from kvmesh.kvstore.redis_fast import MgetReplies, RespError, SlabPool, read_mget_reply


def reply_sock(data: bytes) -> socket.socket:
    """A socket from which ``data`` can be read, then end of stream."""
    a, b = socket.socketpair()
    b.sendall(data)
    b.close()
    return a


def bulk(v: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(v), v)


class FailingSecondTake(SlabPool):
    """A pool whose second ``take`` fails (e.g. MemoryError allocating a fresh slab)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.takes = 0

    def take(self, nbytes: int) -> bytearray:
        self.takes += 1
        if self.takes == 2:
            raise MemoryError("no memory for another slab")
        return super().take(nbytes)


def test_a_slab_is_given_back_once_when_taking_the_next_one_fails():
    pool = FailingSecondTake(slab_bytes=100, keep_bytes=1 << 20)
    # two values of 80 bytes: the second does not fit in the first slab
    sock = reply_sock(b"*2\r\n" + bulk(b"a" * 80) + bulk(b"b" * 80))
    with pytest.raises(MemoryError):
        read_mget_reply(sock, 2, pool)
    assert len(pool._slabs) == 1, "the same slab was given back twice"
    # and that slab is free to be handed out again
    sock = reply_sock(b"*1\r\n" + bulk(b"c" * 80))
    assert read_mget_reply(sock, 1, pool) == [b"c" * 80]
    assert pool.reused == 1


def test_a_value_claiming_more_than_the_bound_is_refused_before_any_slab_is_taken():
    pool = SlabPool(slab_bytes=1 << 10, keep_bytes=1 << 20)
    # the server claims 3 GB (and sends nothing of it)
    sock = reply_sock(b"*2\r\n" + bulk(b"a" * 10) + b"$3000000000\r\n")
    with pytest.raises(RespError, match="claims 3000000000 bytes"):
        read_mget_reply(sock, 2, pool, max_value_bytes=1 << 20)
    assert pool.created == 1  # the first value's slab only
    # at the bound itself a value is read
    sock = reply_sock(b"*1\r\n" + bulk(b"z" * 100))
    assert read_mget_reply(sock, 1, pool, max_value_bytes=100) == [b"z" * 100]


def test_bytes_after_the_reply_are_an_error_not_dropped():
    pool = SlabPool(slab_bytes=1 << 10)
    sock = reply_sock(b"*1\r\n" + bulk(b"v") + b"+OK\r\n")  # a second reply nobody asked for
    with pytest.raises(RespError, match="5 unexpected bytes after the MGET reply"):
        read_mget_reply(sock, 1, pool)


def test_resp3_push_frames_before_the_reply_are_read_past():
    pool = SlabPool(slab_bytes=1 << 10)
    push = (
        b">3\r\n$10\r\ninvalidate\r\n*2\r\n$3\r\nk:1\r\n+k:2\r\n%1\r\n:1\r\n_\r\n"
        b">2\r\n$7\r\nmessage\r\n$-1\r\n"
    )
    sock = reply_sock(push + b"*3\r\n" + bulk(b"a" * 50) + b"_\r\n" + bulk(b"b"))
    assert read_mget_reply(sock, 3, pool) == [b"a" * 50, None, b"b"]
    # a push is not the reply: a push of the asked length alone is not taken for one
    sock = reply_sock(b">1\r\n" + bulk(b"x"))
    with pytest.raises(RespError, match="closed the connection"):
        read_mget_reply(sock, 1, pool)


def test_a_slab_is_not_reused_while_a_view_derived_from_a_value_lives():
    import numpy as np

    pool = SlabPool(slab_bytes=1 << 10)
    [value] = read_mget_reply(reply_sock(b"*1\r\n" + bulk(b"k" * 64)), 1, pool)
    derived = np.frombuffer(value[8:], dtype=np.uint8)  # e.g. a decoded payload view
    del value  # the view handed out is gone, the one made from it is not
    [other] = read_mget_reply(reply_sock(b"*1\r\n" + bulk(b"o" * 64)), 1, pool)
    assert pool.created == 2 and pool.reused == 0
    assert bytes(derived) == b"k" * 56, "a slab was reused under a live view"
    del derived, other
    [again] = read_mget_reply(reply_sock(b"*1\r\n" + bulk(b"a" * 64)), 1, pool)
    assert again == b"a" * 64 and pool.reused == 1 and pool.created == 2


def test_pipelined_replies_read_in_one_buffer_keep_the_next_replys_bytes():
    # three replies sent at once: the first read takes the second's (and the third's)
    # header bytes into the shared buffer; each read must start where the last ended
    data = b"*2\r\n" + bulk(b"a" * 40) + b"$-1\r\n"
    data += b"*3\r\n" + b"_\r\n" + bulk(b"c" * 10) + bulk(b"d" * 20)
    data += b"*1\r\n" + bulk(b"b" * 3000)
    pool = SlabPool(slab_bytes=1 << 10, keep_bytes=1 << 20)
    with MgetReplies(reply_sock(data), pool, 1 << 20) as replies:
        first = replies.read(2)
        second = replies.read(3)
        third = replies.read(1)
    assert first == [b"a" * 40, None]
    assert second == [None, b"c" * 10, b"d" * 20]
    assert third == [b"b" * 3000]
    # the values of the first two replies are packed into one slab; the long one took its own
    assert first[0].obj is second[1].obj is second[2].obj
    assert pool.created == 2


def test_bytes_left_after_the_last_pipelined_reply_are_an_error():
    data = b"*1\r\n" + bulk(b"a" * 8) + b"*1\r\n" + bulk(b"b" * 8)
    with pytest.raises(RespError, match="unexpected bytes after"):
        with MgetReplies(reply_sock(data), SlabPool(slab_bytes=1 << 10), 1 << 20) as replies:
            assert replies.read(1) == [b"a" * 8]  # a second reply nobody asked for follows


def test_checking_a_slab_for_live_views_does_not_reallocate_it():
    # the check grows the slab by a byte and back: a slab allocated to size would be
    # reallocated (a 16 MiB copy into fresh memory on its first reuse)
    pool = SlabPool(slab_bytes=1 << 20)
    slab = pool.take(10)
    assert len(slab) == 1 << 20
    alloc = slab.__alloc__()
    pool.give(slab)
    assert pool.take(10) is slab  # reused: the check ran
    assert slab.__alloc__() == alloc
