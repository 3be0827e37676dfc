"""KVOffloader's spill path on its own: evicted pages leave the pool through reused staging
buffers and reach the host tier byte for byte; loads hand back views of the stored objects."""

from __future__ import annotations

import threading
import time

import torch

from kvmesh.kvstore.codec import PageSpec, decode
from kvmesh.kvstore.host import HostTier
from kvmesh.kvstore.store import TieredStore
from kvmesh.worker.offload import KVOffloader
from kvmesh.worker.request import Request
from kvmesh.worker.sampling_params import SamplingParams

NBYTES = 3 << 20  # 3 MiB pages: five to a 16 MiB staging buffer


def _offloader():
    spec = PageSpec("ab12", "fp32", 2, 1, 4, 16, NBYTES)
    host = HostTier(1 << 30)
    return KVOffloader(TieredStore(spec, [host]), spec), host, spec


def _evict(off, pool, ids):
    for i in ids:
        off.on_evict(bytes([i]) * 32, i)
    off.flush_spills(pool)


def test_spilled_pages_are_byte_exact_and_staging_is_reused():
    off, host, spec = _offloader()
    try:
        g = torch.Generator().manual_seed(0)
        pool = torch.randint(0, 256, (12, NBYTES), dtype=torch.uint8, generator=g)
        assert off._staging.pages_per_buffer == 5
        _evict(off, pool, [3, 7, 1, 0, 9, 4, 11])  # two buffers' worth
        off.drain()
        pool_before = pool.clone()
        pool[[3, 7]] = 0  # the slots are reused at once: the spill already holds a copy
        _evict(off, pool, [2, 5, 6])
        off.drain()
        # the first flush needs 1 or 2 buffers (the spill thread may free the first before the
        # second part is staged); the second flush must reuse an idle one, never make a third
        assert off._staging.created <= 2
        for i in [3, 7, 1, 0, 9, 4, 11, 2, 5, 6]:
            (obj,) = host.get([bytes([i]) * 32])
            assert bytes(decode(spec, obj)) == pool_before[i].numpy().tobytes(), i
        assert off.metrics["spilled_pages"] == 10
    finally:
        off.close()


def test_a_fetch_returns_views_of_the_stored_objects():
    off, host, spec = _offloader()
    try:
        pool = torch.randint(0, 256, (4, NBYTES), dtype=torch.uint8)
        _evict(off, pool, [0, 1])
        off.drain()
        req = Request("r", list(range(40)), SamplingParams(), block_size=16, model_fp="ab12")
        off.start_fetch(req, 0, [bytes([0]) * 32, bytes([1]) * 32], [False, False])
        res = None
        for _ in range(100):
            res = off.take_fetch("r")
            if res is not None:
                break
            off.wait_for_fetch(0.1)
        assert res is not None
        assert res.tiers == ["host", "host"]
        assert [bytes(p) for p in res.payloads] == [pool[i].numpy().tobytes() for i in (0, 1)]
        assert all(isinstance(p, memoryview) for p in res.payloads)
    finally:
        off.close()


def test_spill_backlog_counts_staging_slots_so_a_stalled_store_bounds_memory():
    spec = PageSpec("ab12", "fp32", 2, 1, 4, 16, NBYTES)
    host = HostTier(1 << 30)
    gate = threading.Event()
    put = host.put
    host.put = lambda items: (gate.wait(10), put(items))  # a store that stalls
    off = KVOffloader(TieredStore(spec, [host]), spec, max_spill_backlog=10)
    try:
        assert off._staging.pages_per_buffer == 5
        pool = torch.randint(0, 256, (4, NBYTES), dtype=torch.uint8)
        for i in range(3):  # one page each: each takes a whole 5-page buffer of the 10
            _evict(off, pool, [i])
        assert off.metrics["spill_skipped_pages"] == 1
        assert off._staging.created == 2
        gate.set()
        off.drain()
        assert off.metrics["spilled_pages"] == 2
        _evict(off, pool, [3])  # room again
        off.drain()
        assert off.metrics["spilled_pages"] == 3 and off._staging.created == 2
    finally:
        gate.set()
        off.close()


def _take(off, request_id, timeout_s):
    """The fetch's result once it is there, or None after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        res = off.take_fetch(request_id)
        if res is not None:
            return res
        off.wait_for_fetch(0.05)
    return None


def test_a_fetch_waits_for_its_own_pages_spills_only():
    spec = PageSpec("ab12", "fp32", 2, 1, 4, 16, NBYTES)
    host = HostTier(1 << 30)
    gate = threading.Event()
    put = host.put
    off = KVOffloader(TieredStore(spec, [host]), spec)
    try:
        pool = torch.randint(0, 256, (8, NBYTES), dtype=torch.uint8)
        _evict(off, pool, [0])  # page 0 reaches the store before the stall
        off.drain()
        host.put = lambda items: (gate.wait(10), put(items))  # a store that stalls
        _evict(off, pool, [5, 6])  # other pages' spill, stalled
        mine = Request("a", list(range(40)), SamplingParams(), block_size=16, model_fp="ab12")
        off.start_fetch(mine, 0, [bytes([0]) * 32], [False])
        res = _take(off, "a", 5.0)  # not queued behind the stalled spill
        assert res is not None and res.tiers == ["host"] and not gate.is_set()
        assert bytes(res.payloads[0]) == pool[0].numpy().tobytes()
        _evict(off, pool, [7])  # this request's own page, stalled too
        own = Request("b", list(range(40)), SamplingParams(), block_size=16, model_fp="ab12")
        off.start_fetch(own, 0, [bytes([7]) * 32], [False])
        assert _take(off, "b", 0.3) is None  # it waits for its page's spill
        gate.set()
        res = _take(off, "b", 5.0)
        assert res is not None and res.tiers == ["host"]  # and then finds it
        assert bytes(res.payloads[0]) == pool[7].numpy().tobytes()
        assert not off._spilling  # every finished spill forgotten
    finally:
        gate.set()
        off.close()


def _peer_offloader():
    from kvmesh.protos.security import ClusterIdentity

    spec = PageSpec("ab12", "fp32", 2, 1, 4, 16, 64)
    off = KVOffloader(None, spec, peer_timeout_s=0.5)
    off.set_peer_auth(ClusterIdentity(b"offload-tests-cluster-secret-0123456789"), None)
    return off


def test_peer_counters_never_go_down_when_a_peer_store_is_closed(monkeypatch):
    monkeypatch.setattr("kvmesh.worker.offload.MAX_PEER_STORES", 2)
    off = _peer_offloader()
    try:
        assert off.peer_counters() is None  # no peer named yet: no peer series
        first = off._peer_store("10.0.0.1:1")
        first.tiers[0].metrics.update(errors=3, corrupt=1, grpc_bytes=500, data_plane_bytes=70)
        second = off._peer_store("10.0.0.2:1")
        second.tiers[0].metrics.update(errors=1, grpc_bytes=20, fetches_left_behind=2)
        before = off.peer_counters()
        assert before == {
            "errors": 4,
            "corrupt": 1,
            "data_plane_bytes": 70,
            "grpc_bytes": 520,
            "fetches_left_behind": 2,
        }
        assert off._peer_store("10.0.0.1:1") is first  # named again: now the most recent
        assert off.peer_counters() == before
        off._peer_store("10.0.0.3:1")  # a third peer: the least recently named (second) goes
        assert len(off.peer_stores()) == 2 and second not in off.peer_stores()
        assert off.peer_counters() == before  # its counts stay in the totals
        first.tiers[0].metrics["errors"] += 1
        assert off.peer_counters()["errors"] == before["errors"] + 1
    finally:
        off.close()


def test_a_failing_peer_is_down_until_it_has_not_failed_for_a_while():
    from kvmesh.kvstore.peer import tier as peer_tier

    off = _peer_offloader()
    now = [1000.0]
    try:
        store = off._peer_store("127.0.0.1:1")  # nothing listens there
        tier = store.tiers[0]
        tier._clock = lambda: now[0]
        assert tier.healthy and off.peer_healthy()
        assert tier.contains([b"\0" * 32]) == [False]  # refused: a fault
        assert tier.metrics["errors"] == 1
        assert not tier.healthy and not off.peer_healthy()
        now[0] += peer_tier.DOWN_HOLD_S - 1
        assert not tier.healthy
        now[0] += 2  # nobody asked it again: no longer counted as down
        assert tier.healthy and off.peer_healthy()
    finally:
        off.close()
