"""The Redis tier's read path (kvstore/redis_fast.py) against a real redis-server: values are
received straight into reused slabs, a value still referenced is never overwritten, and a
reply cut or garbled mid-restore is a miss (the engine recomputes, same tokens)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import warnings

import pytest
import redis
from helpers import text_prompts

from kvmesh.kvstore.codec import PageSpec, encode, max_object_bytes
from kvmesh.kvstore.redis_fast import MgetReplies, SlabPool
from kvmesh.kvstore.redis_tier import RedisTier, _pooled_connection
from kvmesh.kvstore.store import TieredStore
from kvmesh.worker import LLM, SamplingParams

SPEC = PageSpec("f00d" * 8, "fp32", 2, 2, 8, 4, 64 << 10)
# two tokens: the first from the (restored or recomputed) prefill, one decode step on it
GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


class Proxy:
    """A loopback TCP proxy to a Redis server that, once armed, damages the server's reply:
    ``cut_after(n)`` closes the connection after ``n`` more reply bytes, ``garble_after(n)``
    overwrites the bytes from there on with ``!``."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.listener.getsockname()[1]}/0"
        self._lock = threading.Lock()
        self._left: int | None = None  # reply bytes until the damage, None: disarmed
        self._mode = "cut"
        self.damaged = 0  # replies damaged so far
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def cut_after(self, n: int) -> None:
        with self._lock:
            self._left, self._mode = n, "cut"

    def garble_after(self, n: int) -> None:
        with self._lock:
            self._left, self._mode = n, "garble"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, reply: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if reply:
                    with self._lock:
                        left, mode = self._left, self._mode
                        if left is not None and left < len(data):
                            self._left = None
                            self.damaged += 1
                        elif left is not None:
                            self._left = left - len(data)
                    if left is not None and left < len(data):
                        if mode == "cut":
                            dst.sendall(data[:left])
                            break
                        data = data[:left] + b"!" * (len(data) - left)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.listener.close()
        for s in self._socks:
            s.close()


@pytest.fixture
def proxy(redis_server):
    p = Proxy(redis_server.port)
    yield p
    p.close()


def make_tier(url: str) -> RedisTier:
    return RedisTier(
        url,
        model_fp=SPEC.model_fp,
        cache_format=SPEC.cache_format,
        timeout_s=5.0,
        backoff_s=0.01,
        max_backoff_s=0.01,
    )


def test_values_land_in_reused_slabs_and_a_kept_value_is_never_overwritten(redis_server):
    tier = make_tier(redis_server.url)
    # slabs of 3 objects: a batch of 8 spans several
    tier._slabs = SlabPool(slab_bytes=3 * (SPEC.page_nbytes + 256), keep_bytes=64 << 20)
    objs = {i: encode(SPEC, os.urandom(SPEC.page_nbytes)) for i in range(16)}
    tier.put([(h(i), o) for i, o in objs.items()])
    first = tier.get([h(i) for i in range(8)])  # kept below while more is read
    assert first == [objs[i] for i in range(8)]
    for _ in range(3):  # reads while `first` is alive must use other slabs
        got = tier.get([h(i) for i in range(8, 16)] + [h(99)])
        assert got == [objs[i] for i in range(8, 16)] + [None]
        del got
    assert first == [objs[i] for i in range(8)], "a slab was reused under a live value"
    assert tier._slabs.reused > 0  # slabs nothing referred to did come back
    created = tier._slabs.created
    del first
    again = tier.get([h(i) for i in range(16)])
    assert again == [objs[i] for i in range(16)]
    assert tier._slabs.created == created  # all from the pool
    assert tier.metrics["errors"] == 0
    tier.close()


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_long_read_is_asked_in_pipelined_mgets_and_comes_back_in_order(
    redis_server, depth, monkeypatch
):
    objs = [encode(SPEC, os.urandom(SPEC.page_nbytes)) for _ in range(11)]
    tier = make_tier(redis_server.url)
    TieredStore(SPEC, [tier])  # bounds max_page_bytes to the longest object: sizes the MGETs
    tier.mget_chunk_bytes, tier.mget_depth = 3 * tier.max_page_bytes, depth
    tier.put([(h(i), o) for i, o in enumerate(objs) if i != 4])  # 4: a miss mid-read
    stats = redis.Redis.from_url(redis_server.url)
    # MGETs sent and not yet read: at most `depth` at once, and `depth` reached
    in_flight, most = [0], [0]
    conn = _pooled_connection(tier._pool, "MGET")
    tier._pool.release(conn)
    send, read = type(conn).send_command, MgetReplies.read

    def counting_send(self, *args, **kwargs):
        if args[:1] == ("MGET",):
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        return send(self, *args, **kwargs)

    def counting_read(self, n_keys):
        in_flight[0] -= 1
        return read(self, n_keys)

    monkeypatch.setattr(type(conn), "send_command", counting_send)
    monkeypatch.setattr(MgetReplies, "read", counting_read)

    def mget_calls() -> int:
        return stats.info("commandstats").get("cmdstat_mget", {}).get("calls", 0)

    before = mget_calls()
    got = tier.get([h(i) for i in range(11)] + [h(99)])
    assert got == [None if i == 4 else objs[i] for i in range(11)] + [None]
    assert mget_calls() - before == 4  # 12 keys in MGETs of 3
    assert most[0] == min(depth, 4) and in_flight[0] == 0
    assert tier.metrics["hits"] == 10 and tier.metrics["misses"] == 2
    assert tier.metrics["errors"] == 0
    # the connection is left in step: a plain read after it is whole
    assert tier.get([h(0), h(10)]) == [objs[0], objs[10]]
    stats.close()
    tier.close()


def test_a_connection_without_a_plain_socket_is_read_by_redis_py_chunk_by_chunk(
    redis_server, monkeypatch
):
    objs = [encode(SPEC, os.urandom(SPEC.page_nbytes)) for _ in range(7)]
    tier = make_tier(redis_server.url)
    TieredStore(SPEC, [tier])
    tier.mget_chunk_bytes = 2 * tier.max_page_bytes  # 4 MGETs for 7 keys
    tier.put([(h(i), o) for i, o in enumerate(objs)])
    conn = _pooled_connection(tier._pool, "MGET")
    tier._pool.release(conn)
    monkeypatch.setattr(type(conn), "_get_socket", lambda self: None)
    stats = redis.Redis.from_url(redis_server.url)
    before = stats.info("commandstats").get("cmdstat_mget", {}).get("calls", 0)
    assert tier.get([h(i) for i in range(7)]) == objs
    assert stats.info("commandstats")["cmdstat_mget"]["calls"] - before == 4  # MGETs of 2
    stats.close()
    assert tier.metrics["errors"] == 0
    tier.close()


@pytest.mark.parametrize("protocol", [2, 3])
def test_both_reply_protocols_read_values_and_misses(redis_server, protocol):
    tier = make_tier(f"{redis_server.url}?protocol={protocol}")
    objs = [encode(SPEC, os.urandom(SPEC.page_nbytes)) for _ in range(3)]
    tier.put([(h(i), o) for i, o in enumerate(objs)])
    assert tier.get([h(0), h(7), h(2), h(1)]) == [objs[0], None, objs[2], objs[1]]
    assert tier.metrics["hits"] == 3 and tier.metrics["misses"] == 1
    assert tier.metrics["errors"] == 0
    tier.close()


@pytest.mark.parametrize("per_mget", [6, 2], ids=["one-mget", "mgets-of-2"])
@pytest.mark.parametrize("damage", ["cut", "garble"])
def test_a_reply_damaged_mid_value_is_a_miss_and_the_next_read_works(
    proxy, damage, per_mget, caplog
):
    objs = [encode(SPEC, os.urandom(SPEC.page_nbytes)) for _ in range(6)]
    tier = make_tier(proxy.url)
    tier.max_page_bytes = len(objs[0])  # as TieredStore bounds it: sizes the MGETs
    tier.mget_chunk_bytes = per_mget * len(objs[0])  # 2: three pipelined MGETs
    hashes = [h(i) for i in range(6)]
    tier.put(list(zip(hashes, objs)))
    # each reply: b"*<k>\r\n", then b"$<n>\r\n<n bytes>\r\n" per value; the fourth
    # value's "$" starts at `fourth` (with MGETs of 2, in the second reply)
    header = len(b"$%d\r\n" % len(objs[0]))
    replies_before = 3 // per_mget + 1
    fourth = replies_before * len(b"*6\r\n") + 3 * (header + len(objs[0]) + 2)
    if damage == "cut":  # the connection closes in the middle of the fourth value's bytes
        proxy.cut_after(fourth + header + len(objs[0]) // 2)
    else:  # the fourth value's header is garbled from its "$" on: not a bulk string
        proxy.garble_after(fourth)
    with caplog.at_level(logging.WARNING, logger="kvmesh.kvstore.redis_tier"):
        assert tier.get(hashes) == [None] * 6  # a fault: all misses, nothing raised
    assert proxy.damaged == 1
    # the reader saw what was damaged (not, say, a timeout)
    # (a cut with the next MGET already sent but unread by the proxy is a reset, not an EOF)
    seen = {
        "cut": ["closed the connection mid-reply", "Connection reset by peer"],
        "garble": ["expected a bulk string", "too long"],
    }
    assert any(m in caplog.text for m in seen[damage]), caplog.text
    assert tier.metrics["errors"] == 1 and not tier.healthy
    # the connection that saw half a reply is gone: the next read (after the backoff) is whole
    for _ in range(100):
        time.sleep(0.02)  # past the backoff
        got = tier.get(hashes)
        if got[0] is not None:
            break
    assert got == objs
    assert tier.healthy
    tier.close()


def test_redis_failing_mid_restore_falls_back_to_recompute(proxy, shakespeare):
    llm = LLM("smollm2-135m-instruct", kv_cache_memory="32MiB", redis_url=proxy.url)
    try:
        # 50 tokens: 3 full pages of 16 restorable (the last token is always computed)
        prompts = text_prompts(llm.tokenizer, shakespeare, [50, 50])
        # computed cold, nothing evicted yet: the reference tokens
        reference = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        llm.reset_prefix_cache()  # no host tier: every page goes to Redis
        llm.engine.connector.drain()
        page = llm.engine.memory.page_spec.page_nbytes
        proxy.cut_after(page + page // 2)  # the restore's reply dies in its second page
        out = llm.generate([prompts[0]], GREEDY)[0]
        assert proxy.damaged == 1
        assert out.token_ids == reference[0]
        assert out.cached_tokens_by_tier["redis"] == 0  # recomputed
        assert llm.engine.store_metrics()["tiers"]["redis"]["errors"] >= 1
        # once Redis answers again the other prefix is restored, byte-exact
        tier = llm.engine.connector.store.tiers[0]
        for _ in range(100):
            time.sleep(0.02)  # past the backoff
            if tier.contains([b"x" * 16]) == [False] and tier.healthy:
                break
        out = llm.generate([prompts[1]], GREEDY)[0]
        assert out.cached_tokens_by_tier["redis"] == 48  # 3 full pages of 50 tokens
        assert out.token_ids == reference[1]
    finally:
        llm.close()


def test_a_value_longer_than_the_store_allows_is_a_miss_not_an_allocation(redis_server):
    tier = make_tier(redis_server.url)
    TieredStore(SPEC, [tier])
    assert tier.max_page_bytes == max_object_bytes(SPEC)  # the store bounds the tier
    good = encode(SPEC, os.urandom(SPEC.page_nbytes))
    tier.put([(h(0), good), (h(1), b"x" * (tier.max_page_bytes + 1))])
    assert tier.get([h(0), h(1)]) == [None, None]  # a fault: the whole batch misses
    assert tier.metrics["errors"] == 1
    for _ in range(100):  # past the backoff, on a fresh connection
        time.sleep(0.02)
        if tier.get([h(0)]) == [good]:
            break
    assert tier.get([h(0)]) == [good]
    tier.close()


def test_a_pooled_connection_is_asked_for_as_each_redis_py_version_wants(redis_server):
    class OldPool:  # redis-py < 5.3: the command name is required
        def get_connection(self, command_name, *keys, **options):
            return ("conn", command_name)

    assert _pooled_connection(OldPool(), "MGET") == ("conn", "MGET")
    pool = redis.BlockingConnectionPool.from_url(redis_server.url, max_connections=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the installed redis-py: no deprecation warning either
        conn = _pooled_connection(pool, "MGET")
    pool.release(conn)
    pool.disconnect()
