"""HostTier: byte budget, exact LRU order, write-back of victims, thread safety; and the
TieredStore over host tiers only (Redis-backed cases are in tests/integration)."""

from __future__ import annotations

import threading

import pytest

from kvmesh.kvstore.codec import PageSpec, encode
from kvmesh.kvstore.host import HostTier
from kvmesh.kvstore.store import TieredStore


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def obj(i: int, n: int = 100) -> bytes:
    return bytes([i % 256]) * n


def test_get_put_contains_evict():
    t = HostTier(1000)
    t.put([(h(1), obj(1)), (h(2), obj(2))])
    assert t.contains([h(1), h(2), h(3)]) == [True, True, False]
    assert t.get([h(2), h(3), h(1)]) == [obj(2), None, obj(1)]
    t.evict([h(1), h(3)])
    assert t.contains([h(1), h(2)]) == [False, True]
    assert (t.used_bytes, t.num_objects, t.budget_bytes) == (100, 1, 1000)
    assert t.metrics["hits"] == 2 and t.metrics["misses"] == 1


def test_lru_order_get_refreshes_contains_does_not():
    t = HostTier(300)
    t.put([(h(i), obj(i)) for i in range(3)])
    assert t.keys() == [h(0), h(1), h(2)]
    t.get([h(0)])  # 0 becomes most recent
    t.contains([h(1)])  # no effect on order
    assert t.keys() == [h(1), h(2), h(0)]
    t.put([(h(3), obj(3))])  # over budget by one object: the LRU one (1) goes
    assert t.keys() == [h(2), h(0), h(3)]
    assert t.used_bytes == 300


def test_refresh_moves_stored_pages_to_the_lru_tail_without_counting_a_read():
    t = HostTier(300)
    t.put([(h(i), obj(i)) for i in range(3)])
    assert t.refresh([h(0), h(9)]) == [True, False]
    assert t.keys() == [h(1), h(2), h(0)]
    assert t.metrics["hits"] == 0 and t.metrics["misses"] == 0


def test_overwrite_replaces_and_refreshes():
    t = HostTier(1000)
    t.put([(h(1), obj(1, 100)), (h(2), obj(2, 100))])
    t.put([(h(1), obj(9, 50))])
    assert t.get([h(1)]) == [obj(9, 50)]
    assert (t.used_bytes, t.num_objects) == (150, 2)
    assert t.keys() == [h(2), h(1)]


def test_on_evict_receives_victims_in_lru_order():
    seen: list[list[tuple[bytes, bytes]]] = []
    t = HostTier(250, on_evict=seen.append)
    t.put([(h(0), obj(0)), (h(1), obj(1))])
    assert seen == []
    t.put([(h(2), obj(2)), (h(3), obj(3))])  # needs room for two: 0 then 1 leave
    assert seen == [[(h(0), obj(0)), (h(1), obj(1))]]
    assert t.keys() == [h(2), h(3)]
    assert t.metrics["evictions"] == 2
    t.evict([h(2)])  # explicit eviction is not write-back
    assert len(seen) == 1


def test_oversize_object_is_not_stored_but_passed_down():
    seen: list[list[tuple[bytes, bytes]]] = []
    t = HostTier(150, on_evict=seen.append)
    t.put([(h(1), obj(1))])
    t.put([(h(2), obj(2, 151))])
    assert t.contains([h(1), h(2)]) == [True, False]
    assert seen == [[(h(2), obj(2, 151))]]
    assert t.used_bytes == 100 and t.metrics["oversize"] == 1


def test_zero_budget_stores_nothing_and_never_errors():
    seen: list = []
    t = HostTier(0, on_evict=seen.extend)
    t.put([(h(1), obj(1)), (h(2), obj(2))])
    assert t.num_objects == 0 and t.used_bytes == 0
    assert [k for k, _ in seen] == [h(1), h(2)]


def test_failing_on_evict_does_not_raise_out_of_put(caplog):
    def boom(victims):
        raise RuntimeError("downstream broke")

    t = HostTier(100, on_evict=boom)
    t.put([(h(1), obj(1)), (h(2), obj(2))])
    assert t.contains([h(2)]) == [True]
    assert t.metrics["errors"] == 1
    assert "write-back" in caplog.text


def test_bad_budget_is_rejected():
    with pytest.raises(ValueError, match="budget_bytes"):
        HostTier(-1)


def test_thread_safety_smoke():
    # Four threads hammer overlapping keys; the books must balance afterwards.
    evicted: list[tuple[bytes, bytes]] = []
    lock = threading.Lock()

    def on_evict(victims):
        with lock:
            evicted.extend(victims)

    t = HostTier(64 * 100, on_evict=on_evict)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for r in range(300):
                keys = [h((seed * 7 + r + j) % 200) for j in range(4)]
                t.put([(k, obj(k[-1])) for k in keys])
                for k, v in zip(keys, t.get(keys)):
                    assert v is None or v == obj(k[-1])
                t.contains(keys)
                if r % 10 == 0:
                    t.evict(keys[:1])
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert t.used_bytes == 100 * t.num_objects <= t.budget_bytes
    assert t.used_bytes == sum(len(v) for v in t.get(t.keys()))


# ------------------------------------------------------------------ TieredStore, host only
SPEC = PageSpec("ab" * 16, "fp16", 2, 1, 4, 4, 64)


def page(i: int) -> bytes:
    return bytes([i % 256]) * SPEC.page_nbytes


def test_store_round_trip_and_write_back_between_host_tiers():
    one = len(encode(SPEC, page(0)))
    near, far = HostTier(2 * one), HostTier(100 * one)
    far.name = "far"  # two host tiers stand in for host -> redis
    store = TieredStore(SPEC, [near, far])
    store.put([(h(i), page(i)) for i in range(5)])
    assert near.keys() == [h(3), h(4)]
    assert far.keys() == [h(0), h(1), h(2)]  # victims written back, oldest first
    got = store.get([h(i) for i in range(6)])
    assert [g[0] if g else None for g in got] == ["far", "far", "far", "host", "host", None]
    assert all(g[1].tobytes() == page(i) for i, g in enumerate(got[:5]))
    m = store.metrics()
    assert m["host"]["hits"] == 2 and m["host"]["misses"] == 4
    assert m["far"]["hits"] == 3 and m["far"]["bytes"] == 3 * SPEC.page_nbytes
    assert m["host"]["used_bytes"] == 2 * one and m["host"]["budget_bytes"] == 2 * one


def test_store_lookup_is_the_longest_leading_run():
    near, far = HostTier(10_000), HostTier(10_000)
    far.name = "far"
    store = TieredStore(SPEC, [near, far])
    near.put([(h(0), encode(SPEC, page(0))), (h(3), encode(SPEC, page(3)))])
    far.put([(h(1), encode(SPEC, page(1))), (h(4), encode(SPEC, page(4)))])
    # 0 host, 1 far, 2 nowhere: the run stops at 2 even though 3 and 4 exist
    assert store.lookup([h(0), h(1), h(2), h(3), h(4)]) == ["host", "far"]
    assert store.lookup([h(2), h(0)]) == []
    assert store.lookup([]) == []


def test_store_drops_corrupt_objects_and_counts_them(caplog):
    near = HostTier(10_000)
    store = TieredStore(SPEC, [near])
    store.put([(h(1), page(1))])
    other = PageSpec("cd" * 16, "fp16", 2, 1, 4, 4, 64)  # another model's page, same key
    near.put([(h(2), encode(other, page(2))), (h(3), b"garbage")])
    assert store.get([h(1), h(2), h(3)])[1:] == [None, None]
    assert near.keys() == [h(1)]  # the bad ones were deleted
    assert store.metrics()["host"]["corrupt"] == 2
    assert "model_fp" in caplog.text and "header" in caplog.text


def test_store_rejects_duplicate_tier_names():
    with pytest.raises(ValueError, match="unique"):
        TieredStore(SPEC, [HostTier(1), HostTier(1)])


class SlowTier(HostTier):
    """A far tier whose puts wait until released (a Redis SET in flight)."""

    name = "far"

    def __init__(self, budget: int) -> None:
        super().__init__(budget)
        self.entered, self.release = threading.Event(), threading.Event()

    def put(self, items):
        self.entered.set()
        assert self.release.wait(10)
        return super().put(items)


def test_a_page_on_its_way_down_is_found_until_the_next_tier_has_it():
    one = len(encode(SPEC, page(0)))
    near, far = HostTier(2 * one), SlowTier(100 * one)
    store = TieredStore(SPEC, [near, far])
    store.put([(h(i), page(i)) for i in range(2)])
    spill = threading.Thread(target=store.put, args=([(h(2), page(2))],))
    spill.start()  # evicts page 0 from the host, whose put to `far` then waits
    try:
        assert far.entered.wait(10)
        assert not near.contains([h(0)])[0] and not far.contains([h(0)])[0]
        assert store.locate([h(0), h(1), h(9)]) == ["host", "host", None]
        got = store.get([h(0), h(9)])
        assert got[0][0] == "host" and got[0][1].tobytes() == page(0) and got[1] is None
        assert store.metrics()["host"]["misses"] == 1  # h(9), counted once
    finally:
        far.release.set()
        spill.join()
    assert store.locate([h(0)]) == ["far"] and store._transit == {}
    assert store.get([h(0)])[0][1].tobytes() == page(0)
