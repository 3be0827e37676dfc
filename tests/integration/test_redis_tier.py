"""RedisTier and TieredStore against a real redis-server: batches, TTL, a server that dies,
hangs, fills up or holds garbage. Every fault must end as a miss, never as an exception."""

from __future__ import annotations

import inspect
import logging
import os
import signal
import time
import types

import pytest

from kvmesh.kvstore.codec import PageSpec, encode
from kvmesh.kvstore.host import HostTier
from kvmesh.kvstore.redis_tier import DEFAULT_TTL_S, RedisTier, redact_url, redis_key
from kvmesh.kvstore.store import TieredStore
from kvmesh.worker.engine import LLMEngine

LOGGER = "kvmesh.kvstore.redis_tier"
SPEC = PageSpec("5eed" * 8, "fp16", 2, 2, 8, 4, 4096)


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def page(i: int, spec: PageSpec = SPEC) -> bytes:
    return (i.to_bytes(4, "big") * (spec.page_nbytes // 4 + 1))[: spec.page_nbytes]


def make_tier(server, **kw) -> RedisTier:
    kw.setdefault("backoff_s", 0.05)
    kw.setdefault("max_backoff_s", 0.2)
    return RedisTier(server.url, model_fp=SPEC.model_fp, cache_format=SPEC.cache_format, **kw)


def warnings_from_tier(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def wait_until(cond, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)


def test_batches_round_trip_under_the_documented_keys(redis_server):
    tier = make_tier(redis_server)
    items = [(h(i), encode(SPEC, page(i))) for i in range(10)]
    tier.put(items)
    client = redis_server.client()
    expected = {redis_key(SPEC.model_fp, "fp16", k).encode() for k, _ in items}
    assert set(client.keys("kvmesh:*")) == expected
    assert next(iter(expected)).startswith(f"kvmesh:{SPEC.model_fp}:fp16:".encode())

    asked = [h(3), h(99), h(0), h(9)]
    assert tier.contains(asked) == [True, False, True, True]
    assert tier.get(asked) == [items[3][1], None, items[0][1], items[9][1]]
    tier.evict([h(0), h(3), h(77)])
    assert tier.contains([h(0), h(3), h(4)]) == [False, False, True]
    assert tier.get([]) == [] and tier.contains([]) == []
    m = tier.metrics
    assert (m["hits"], m["misses"], m["puts"], m["errors"]) == (3, 1, 10, 0)
    assert m["bytes_written"] == sum(len(o) for _, o in items)
    tier.close()


def test_other_model_or_format_never_sees_the_pages(redis_server):
    obj = encode(SPEC, page(1))
    mine = make_tier(redis_server)
    mine.put([(h(1), obj)])
    # positive control: the page is there, for this tier and for any other reader of the
    # same model and format, so the misses below come from the model and the format alone
    same = RedisTier(redis_server.url, model_fp=SPEC.model_fp, cache_format="fp16")
    assert mine.get([h(1)]) == [obj] and same.get([h(1)]) == [obj]
    assert same.contains([h(1)]) == [True]
    other_model = RedisTier(redis_server.url, model_fp="ab" * 16, cache_format="fp16")
    other_format = RedisTier(redis_server.url, model_fp=SPEC.model_fp, cache_format="int8")
    assert other_model.get([h(1)]) == [None] and other_model.contains([h(1)]) == [False]
    assert other_format.get([h(1)]) == [None] and other_format.contains([h(1)]) == [False]


def test_ttl_is_set_when_asked(redis_server):
    client = redis_server.client()
    make_tier(redis_server, ttl_s=30).put([(h(1), b"x")])
    make_tier(redis_server, ttl_s=None).put([(h(2), b"y")])
    make_tier(redis_server).put([(h(3), b"z")])
    assert 0 < client.pttl(redis_key(SPEC.model_fp, "fp16", h(1))) <= 30_000
    assert client.pttl(redis_key(SPEC.model_fp, "fp16", h(2))) == -1  # no expiry
    # the default: a day (docs/security.md), and the engine's default is the tier's
    assert 30_000 < client.pttl(redis_key(SPEC.model_fp, "fp16", h(3))) <= DEFAULT_TTL_S * 1000
    assert inspect.signature(LLMEngine).parameters["redis_ttl_s"].default == DEFAULT_TTL_S


def test_a_namespace_keeps_two_clusters_apart(redis_server):
    client = redis_server.client()
    a, b = make_tier(redis_server), make_tier(redis_server, namespace="blue:kvmesh")
    a.put([(h(1), b"a-page")])
    assert b.get([h(1)]) == [None] and b.contains([h(1)]) == [False]
    b.put([(h(1), b"b-page")])
    assert a.get([h(1)]) == [b"a-page"] and b.get([h(1)]) == [b"b-page"]
    assert client.exists(redis_key(SPEC.model_fp, "fp16", h(1), "blue:kvmesh")) == 1
    with pytest.raises(ValueError, match="namespace"):
        make_tier(redis_server, namespace="has space")


def test_the_redis_password_is_never_logged(redis_server, caplog):
    password = "s3cret-redis-pass"
    redis_server.client().config_set("requirepass", password)
    url = f"redis://:{password}@127.0.0.1:{redis_server.port}/0"
    tier = make_tier(types.SimpleNamespace(url=url))
    assert tier.put([(h(1), b"x")]) == [h(1)] and tier.get([h(1)]) == [b"x"]  # it got in
    assert password not in tier.url and ":***@" in tier.url
    with caplog.at_level(logging.DEBUG, logger="kvmesh.kvstore.redis_tier"):
        redis_server.stop()
        assert tier.get([h(1)]) == [None]  # down: logged, with the URL
    assert any(tier.url in r.getMessage() for r in caplog.records)
    assert password not in caplog.text
    assert redact_url(f"rediss://user:{password}@h:1/0?password={password}") == (
        "rediss://user:***@h:1/0?password=***"
    )


def test_server_killed_then_restarted(redis_server, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    tier = make_tier(redis_server)
    host = HostTier(10 * 8192)
    store = TieredStore(SPEC, [host, tier])
    tier.put([(h(i), encode(SPEC, page(i))) for i in range(4)])
    host.put([(h(9), encode(SPEC, page(9)))])
    assert tier.contains([h(0)]) == [True]

    redis_server.stop()
    for _ in range(5):  # repeated calls in one incident: misses, skips, no exception
        assert tier.get([h(0), h(1)]) == [None, None]
        assert tier.contains([h(2)]) == [False]
        tier.put([(h(5), encode(SPEC, page(5)))])
        tier.evict([h(3)])
        assert store.get([h(9), h(0)])[1] is None
        assert store.lookup([h(9), h(0)]) == ["host"]
    assert len(warnings_from_tier(caplog)) == 1
    assert "unavailable" in warnings_from_tier(caplog)[0].getMessage()
    assert tier.metrics["incidents"] == 1 and tier.metrics["errors"] >= 1
    assert tier.metrics["puts_skipped"] == 5 and tier.metrics["puts"] == 4
    assert not tier.healthy
    assert store.metrics()["redis"]["errors"] == tier.metrics["errors"]

    redis_server.start()  # same port, empty: everything before is gone
    item = (h(7), encode(SPEC, page(7)))

    def recovered() -> bool:
        tier.put([item])
        return tier.contains([h(7)]) == [True]

    wait_until(recovered, "the tier to reach the restarted server")
    assert tier.healthy
    assert tier.get([h(7), h(0)]) == [item[1], None]
    assert len(warnings_from_tier(caplog)) == 1  # still one: recovery logs at info
    assert any("reachable again" in r.getMessage() for r in caplog.records if r.name == LOGGER)

    # A second outage is a second incident, with its own single warning.
    redis_server.stop()
    assert tier.get([h(7)]) == [None]
    assert tier.metrics["incidents"] == 2
    assert len(warnings_from_tier(caplog)) == 2


def test_backoff_keeps_calls_away_from_a_failed_server(redis_server):
    tier = make_tier(redis_server, backoff_s=60, max_backoff_s=60)
    redis_server.stop()
    assert tier.get([h(1)]) == [None]
    assert (tier.metrics["errors"], tier.metrics["calls_skipped"]) == (1, 0)
    redis_server.start()
    # Within the backoff the tier does not even try, although the server is back.
    tier.put([(h(1), b"x")])
    assert tier.contains([h(1)]) == [False]
    assert (tier.metrics["errors"], tier.metrics["calls_skipped"]) == (1, 2)
    assert redis_server.client().dbsize() == 0
    # positive control: the server does take that write and answer that read, for a tier
    # that is not backing off
    fresh = make_tier(redis_server)
    fresh.put([(h(1), b"x")])
    assert fresh.contains([h(1)]) == [True] and fresh.get([h(1)]) == [b"x"]


def test_hung_server_times_out_into_misses(redis_server, caplog):
    tier = make_tier(redis_server, timeout_s=0.2)
    tier.put([(h(1), encode(SPEC, page(1)))])
    os.kill(redis_server.pid, signal.SIGSTOP)  # accepts connections, never answers
    try:
        assert tier.get([h(1)]) == [None]
        assert tier.contains([h(1)]) == [False]
        assert tier.metrics["errors"] >= 1 and tier.metrics["incidents"] == 1
        assert len(warnings_from_tier(caplog)) == 1
        assert "Timeout" in warnings_from_tier(caplog)[0].getMessage()
    finally:
        os.kill(redis_server.pid, signal.SIGCONT)
    wait_until(lambda: tier.contains([h(1)]) == [True], "the tier to recover after SIGCONT")


def test_no_server_at_all_is_just_misses(redis_server):
    redis_server.stop()
    tier = make_tier(redis_server)  # never reachable since construction
    tier.put([(h(1), b"x")])
    assert tier.get([h(1)]) == [None]
    assert tier.metrics["incidents"] == 1
    # positive control: once there is a server, the same tier writes and reads that page
    redis_server.start()

    def works() -> bool:
        tier.put([(h(1), b"x")])
        return tier.get([h(1)]) == [b"x"]

    wait_until(works, "the tier to reach the started server")


@pytest.mark.parametrize("damage", ["garbage", "flipped-byte", "truncated", "other-shape"])
def test_invalid_object_is_a_miss_and_is_deleted(redis_server, damage, caplog):
    tier = make_tier(redis_server)
    store = TieredStore(SPEC, [tier])
    store.put([(h(1), page(1)), (h(2), page(2))])
    key = redis_key(SPEC.model_fp, "fp16", h(1))
    client = redis_server.client()
    good = client.get(key)
    if damage == "garbage":
        bad = b"\x00\x01not a page at all"
    elif damage == "flipped-byte":
        bad = bytearray(good)
        bad[-100] ^= 0x40
    elif damage == "truncated":
        bad = good[:-1]
    else:  # same model and format, other shape: a config mismatch, not foreign KV
        bad = encode(PageSpec(SPEC.model_fp, "fp16", 3, 2, 8, 4, 4096), page(1))
    client.set(key, bytes(bad))

    got = store.get([h(1), h(2)])
    assert got[0] is None
    assert got[1] is not None and got[1][1].tobytes() == page(2)
    assert client.exists(key) == 0  # deleted, so the next writer can fix it
    assert store.metrics()["redis"]["corrupt"] == 1
    field = {
        "garbage": "header",
        "flipped-byte": "checksum",
        "truncated": "payload_len",
        "other-shape": "num_layers",
    }[damage]
    assert f"{field}:" in caplog.text


def test_redis_lru_dropping_keys_is_a_miss(redis_server):
    client = redis_server.client()
    used = client.info("memory")["used_memory"]
    client.config_set("maxmemory", used + 1_000_000)  # room for roughly 20 of 50 pages
    client.config_set("maxmemory-policy", "allkeys-lru")
    spec = PageSpec(SPEC.model_fp, "fp16", 2, 2, 8, 4, 50_000)
    tier = make_tier(redis_server)
    store = TieredStore(spec, [tier])
    for i in range(50):
        store.put([(h(i), page(i, spec))])
    got = store.get([h(i) for i in range(50)])
    kept = [i for i, g in enumerate(got) if g is not None]
    assert 0 < len(kept) < 50  # Redis dropped some on its own
    assert all(got[i][1].tobytes() == page(i, spec) for i in kept)
    assert tier.metrics["errors"] == 0 and tier.metrics["oom"] == 0
    assert store.metrics()["redis"]["corrupt"] == 0
    assert tier.healthy


def test_put_refused_for_memory_is_skipped_and_counted(redis_server, caplog):
    client = redis_server.client()
    tier = make_tier(redis_server)
    tier.put([(h(0), encode(SPEC, page(0)))])
    client.config_set("maxmemory", 1)  # below what the server already uses
    client.config_set("maxmemory-policy", "noeviction")
    for i in range(1, 4):
        tier.put([(h(i), encode(SPEC, page(i))), (h(i + 10), encode(SPEC, page(i)))])
    assert tier.metrics["oom"] == 6 and tier.metrics["puts_skipped"] == 6
    assert tier.metrics["puts"] == 1
    assert len(warnings_from_tier(caplog)) == 1
    assert tier.healthy  # the server answers; only writes are refused
    assert tier.get([h(0), h(1)]) == [encode(SPEC, page(0)), None]  # reads still work


def test_host_writes_back_to_redis_and_lookup_spans_tiers(redis_server):
    one = len(encode(SPEC, page(0)))
    host = HostTier(2 * one)
    tier = make_tier(redis_server)
    store = TieredStore(SPEC, [host, tier])
    hashes = [h(i) for i in range(6)]
    for i in range(5):  # one page at a time, as the engine spills them
        store.put([(hashes[i], page(i))])
    assert host.keys() == hashes[3:5]
    assert tier.contains(hashes) == [True, True, True, False, False, False]
    assert store.lookup(hashes) == ["redis"] * 3 + ["host"] * 2

    got = store.get(hashes)
    assert [g[0] if g else None for g in got] == ["redis"] * 3 + ["host"] * 2 + [None]
    assert [g[1].tobytes() for g in got[:5]] == [page(i) for i in range(5)]

    tier.evict([hashes[1]])  # a hole: the run stops there
    assert store.lookup(hashes) == ["redis"]
    m = store.metrics()
    assert m["redis"]["hits"] == 3 and m["host"]["hits"] == 2
    assert m["host"]["used_bytes"] == 2 * one
