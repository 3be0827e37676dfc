"""The KV connector's promotion state machine, driven by the real scheduler without a model:
a request whose prefix is in a tier waits in PROMOTING, is admitted once with its pages on
the device byte for byte, and computes what a failed fetch could not bring."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

import torch

from kvmesh.kernels.page_format import PageLayout
from kvmesh.kvstore.events import BlockStored, EventLog
from kvmesh.kvstore.host import HostTier
from kvmesh.kvstore.store import TieredStore
from kvmesh.kvstore.tier import Tier
from kvmesh.worker.config import SchedulerConfig
from kvmesh.worker.kv_cache import KVCacheManager
from kvmesh.worker.kv_connector import KVConnector
from kvmesh.worker.kv_memory import KVMemory
from kvmesh.worker.request import Request, RequestStatus
from kvmesh.worker.sampling_params import SamplingParams
from kvmesh.worker.scheduler import Scheduler

BS = 4
FP = "ab12"
LAYOUT = PageLayout("fp32", num_layers=1, num_kv_heads=1, head_size=4, block_size=BS)


class BrokenTier(Tier):
    """Claims every page, then fails to read it (a Redis that dies mid-request)."""

    name = "redis"

    def contains(self, hashes):
        return [True] * len(hashes)

    def get(self, hashes):
        raise ConnectionError("redis went away")

    def put(self, items):
        return []  # refused: nothing stored

    def evict(self, hashes):
        pass


class StuckTier(BrokenTier):
    """Claims every page, then never answers ``get`` until ``release`` is set: a call stuck
    past every deadline it has."""

    def __init__(self):
        self.release = threading.Event()
        self.calls = 0

    def get(self, hashes):
        self.calls += 1
        if self.calls == 1:
            self.release.wait()
        raise ConnectionError("redis went away")


def make(tiers, num_pages: int = 8):
    events = EventLog("engine-0")
    memory = KVMemory(LAYOUT, FP, num_pages, dtype=torch.float32, device=torch.device("cpu"))
    kv = KVCacheManager(num_pages, BS, events)
    store = TieredStore(memory.page_spec, tiers, events=events)
    conn = KVConnector(kv, memory, store)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv, conn)
    return sched, conn, memory, events


def make_req(rid: str, tokens) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=8), BS, FP)


def step(sched: Scheduler, conn: KVConnector) -> list[tuple[str, int]]:
    """One engine step without a model: schedule, save evictions, postprocess."""
    out = sched.schedule()
    conn.save_evicted()
    for req, n in out.scheduled:
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:
            req.append_token(1000 + req.num_tokens)
    if not out.scheduled:
        conn.wait_for_promotion(0.5)
    return [(req.request_id, n) for req, n in out.scheduled]


def run_until_scheduled(sched, conn, max_steps: int = 50) -> list[list[tuple[str, int]]]:
    steps = []
    for _ in range(max_steps):
        steps.append(step(sched, conn))
        if steps[-1]:
            return steps
    raise AssertionError(f"nothing was scheduled in {max_steps} steps: {steps}")


def page_bytes(memory: KVMemory, page_id: int) -> bytes:
    return memory.read([page_id])[0]


def test_a_promoted_request_is_admitted_once_with_its_pages_byte_exact():
    host = HostTier(1 << 20)
    sched, conn, memory, events = make([host])
    req = make_req("r", range(10, 19))  # 9 tokens: 2 full pages can be served
    payloads = [bytes([i + 1]) * LAYOUT.page_nbytes for i in range(2)]
    conn.store.put(list(zip(req.page_hashes[:2], payloads)))
    seen = []
    events.subscribe(seen.append)
    sched.add(req)

    first = sched.schedule()
    assert first.scheduled == [] and req.status is RequestStatus.PROMOTING
    assert list(sched.waiting) == [req]  # it waits in the queue, in its own state

    steps = run_until_scheduled(sched, conn)
    assert steps[-1] == [("r", 1)]  # only the last prompt token is computed
    assert req.num_cached_tokens == 8 and req.cached_by_tier == {"host": 8}
    assert sched.running == [req] and list(sched.waiting) == []
    table = sched.kv.page_ids(req)
    assert [page_bytes(memory, p) for p in table[:2]] == payloads
    assert conn.metrics()["offload"]["promoted_pages"] == 2
    # the promoted pages were published as device pages for the router
    stored = [e for e in seen if isinstance(e, BlockStored) and e.tier == "device"]
    assert [e.block_hash for e in stored][:2] == req.page_hashes[:2]
    assert step(sched, conn) == [("r", 1)]  # decoding: admitted once, not twice
    assert req.num_promotions == 1


class GatedHost(HostTier):
    """A host tier whose second ``get`` waits for ``gate``: a restore whose first batch has
    arrived and whose second is still on its way."""

    def __init__(self):
        super().__init__(1 << 20)
        self.gate = threading.Event()
        self.gets = 0

    def get(self, hashes):
        self.gets += 1
        if self.gets == 2:
            assert self.gate.wait(10)
        return super().get(hashes)


def four_pages_in(tier):
    """Request r (17 tokens: 4 full pages can be served) with its 4 pages in ``tier``, read
    in batches of 2 pages: the store's part of its restore comes in two batches."""
    sched, conn, memory, _ = make([tier])
    conn.offloader.fetch_batch_pages = 2
    req = make_req("r", range(10, 27))
    payloads = [bytes([i + 1]) * LAYOUT.page_nbytes for i in range(4)]
    conn.store.put(list(zip(req.page_hashes[:4], payloads)))
    return sched, conn, memory, req, payloads


def assert_first_batch_only(sched, conn, memory, req, payloads) -> None:
    """Run r until scheduled: pages 0-1 restored byte-exact, the rest computed."""
    steps = run_until_scheduled(sched, conn)
    assert steps[-1] == [("r", 17 - 8)]
    assert req.num_cached_tokens == 8 and req.cached_by_tier == {"host": 8}
    table = sched.kv.page_ids(req)
    assert [page_bytes(memory, p) for p in table[:2]] == payloads[:2]
    assert conn.metrics()["offload"]["promoted_pages"] == 2


def test_a_restore_in_batches_writes_each_batch_as_it_arrives_byte_exact():
    host = GatedHost()
    sched, conn, memory, req, payloads = four_pages_in(host)
    sched.add(req)
    try:
        assert sched.schedule().scheduled == [] and req.status is RequestStatus.PROMOTING
        kv = sched.kv
        for _ in range(20):  # the first batch is written while the second is held up
            assert step(sched, conn) == []
            if kv.cached_page(req.page_hashes[1]) is not None:
                break
        first = [kv.cached_page(h) for h in req.page_hashes[:4]]
        assert all(p is not None for p in first[:2]) and first[2:] == [None, None]
        assert [page_bytes(memory, p.page_id) for p in first[:2]] == payloads[:2]
        assert req.status is RequestStatus.PROMOTING and not host.gate.is_set()
    finally:
        host.gate.set()
    steps = run_until_scheduled(sched, conn)
    assert steps[-1] == [("r", 1)]  # only the last prompt token is computed
    assert req.num_cached_tokens == 16 and req.cached_by_tier == {"host": 16}
    table = sched.kv.page_ids(req)
    assert table[:2] == [p.page_id for p in first[:2]]  # the batch written early, kept
    assert [page_bytes(memory, p) for p in table[:4]] == payloads
    assert conn.metrics()["offload"]["promoted_pages"] == 4


def test_a_corrupt_page_in_a_later_batch_ends_the_run_there():
    host = HostTier(1 << 20)
    sched, conn, memory, req, payloads = four_pages_in(host)
    (obj,) = host.get([req.page_hashes[2]])  # page 2, first of the second batch: torn
    host.put([(req.page_hashes[2], obj[:-1] + bytes([obj[-1] ^ 1]))])
    sched.add(req)
    assert sched.schedule().scheduled == [] and req.status is RequestStatus.PROMOTING
    assert_first_batch_only(sched, conn, memory, req, payloads)
    # nothing past the torn page was promoted (page 3 is valid, but the run ends before it)
    assert set(req.promoted_from) == set(req.page_hashes[:2])
    assert conn.metrics()["tiers"]["host"]["corrupt"] == 1


class FailingSecondGet(HostTier):
    """A host tier whose second ``get`` raises: a restore that fails after its first batch
    was validated (and perhaps written)."""

    def __init__(self):
        super().__init__(1 << 20)
        self.gets = 0

    def get(self, hashes):
        self.gets += 1
        if self.gets == 2:
            raise ConnectionError("the tier went away")
        return super().get(hashes)


def test_a_fetch_failing_after_its_first_batch_keeps_that_batch_and_stops():
    sched, conn, memory, req, payloads = four_pages_in(FailingSecondGet())
    sched.add(req)
    assert sched.schedule().scheduled == [] and req.status is RequestStatus.PROMOTING
    assert_first_batch_only(sched, conn, memory, req, payloads)
    assert req.num_promotions == 1  # not promoted again for the pages it wrote
    assert conn.metrics()["offload"]["promotion_errors"] == 1


def test_a_batch_published_by_a_replaced_fetch_is_dropped():
    """An abandoned fetch that comes back to life after its request started a new fetch
    (another first page) must not hand its pages to the new one."""
    sched, conn, _, _ = make([HostTier(1 << 20)])
    off = conn.offloader
    req = make_req("r", range(10, 27))
    old = off._fetch_info[req.request_id] = (req, 0)
    off._fetch_info[req.request_id] = (req, 2)  # its successor
    off._publish(req.request_id, old, [("host", memoryview(b"x"))])
    assert off.take_partial(req.request_id) is None
    off._publish(req.request_id, off._fetch_info[req.request_id], [("host", memoryview(b"y"))])
    assert off.take_partial(req.request_id).first_page == 2


def test_a_failed_fetch_computes_the_prefix_instead():
    sched, conn, _, _ = make([BrokenTier()])
    req = make_req("r", range(10, 19))
    sched.add(req)
    assert sched.schedule().scheduled == [] and req.status is RequestStatus.PROMOTING
    steps = run_until_scheduled(sched, conn)
    assert steps[-1] == [("r", 9)]  # every prompt token computed
    assert req.num_cached_tokens == 0 and req.status is RequestStatus.RUNNING
    assert conn.metrics()["offload"]["promotion_errors"] == 1
    assert step(sched, conn) == [("r", 1)]


def stuck_pair():
    """A tier whose first ``get`` hangs (until released), and requests a and b both
    PROMOTING: a's fetch stuck in it, b's queued behind; abandonment after 0.3 s."""
    tier = StuckTier()
    sched, conn, _, _ = make([tier])
    conn.offloader.fetch_abandon_s = 0.3
    a, b = make_req("a", range(10, 19)), make_req("b", range(30, 39))
    sched.add(a)
    sched.add(b)
    assert sched.schedule().scheduled == []
    assert a.status is RequestStatus.PROMOTING and b.status is RequestStatus.PROMOTING
    return tier, sched, conn, a, b


def steps_until(sched, conn, item, steps=None, max_steps: int = 300) -> list:
    """Engine steps (10 ms apart: fetches run on their own thread) until ``item`` ran."""
    steps = [] if steps is None else steps
    for _ in range(max_steps):
        if item in sum(steps, []):
            break
        time.sleep(0.01)
        steps.append(step(sched, conn))
    return sum(steps, [])


def test_a_fetch_stuck_past_its_bound_is_abandoned_and_the_next_fetch_still_runs(caplog):
    tier, sched, conn, a, b = stuck_pair()
    try:
        time.sleep(0.4)  # a's fetch is stuck in the tier; b's is queued behind it
        with caplog.at_level(logging.WARNING, logger="kvmesh.worker.offload"):
            steps = run_until_scheduled(sched, conn)
        # the warning shows where the thread is stuck: the tier's get, waiting on its event
        warned = [r.getMessage() for r in caplog.records if "abandoned" in r.getMessage()]
        assert len(warned) == 1 and "in get" in warned[0] and "release.wait" in warned[0]
        # a computes its whole prompt; b's fetch ran on the new thread (and failed: misses)
        assert ("a", 9) in sum(steps, [])
        assert ("b", 9) in steps_until(sched, conn, ("b", 9), steps)
        assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0
        assert tier.calls == 2  # b's fetch did run, after a's was abandoned
        off = conn.metrics()["offload"]
        assert off["fetches_abandoned"] == 1 and off["promotion_errors"] == 2
    finally:
        tier.release.set()


def test_a_stuck_fetch_is_abandoned_even_after_its_own_request_was_aborted():
    # the client gave up on the hung request: the fetches queued behind it must still run
    tier, sched, conn, a, b = stuck_pair()
    try:
        sched.finish(a, RequestStatus.FINISHED_ABORTED)
        time.sleep(0.4)
        assert ("b", 9) in steps_until(sched, conn, ("b", 9))
        assert tier.calls == 2 and conn.metrics()["offload"]["fetches_abandoned"] == 1
    finally:
        tier.release.set()


def test_a_stuck_fetch_thread_does_not_hold_the_process_at_exit():
    code = (
        "import threading\n"
        "from kvmesh.worker.daemon_executor import DaemonExecutor\n"
        "ex = DaemonExecutor('kvmesh-fetch')\n"
        "began = threading.Event()\n"
        "ex.submit(lambda: began.set() or threading.Event().wait())\n"  # never returns
        "began.wait(10)\n"
        "f = ex.submit(lambda: 1)\n"
        "ex2 = DaemonExecutor('kvmesh-fetch')\n"
        "ex.move_queued_to(ex2)\n"
        "assert f.result(timeout=10) == 1\n"
        "print('exiting')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "exiting"


def test_an_abort_while_promoting_drops_the_fetch_and_its_hold():
    host = HostTier(1 << 20)
    sched, conn, _, _ = make([host])
    warm = make_req("warm", range(10, 19))
    sched.add(warm)
    step(sched, conn)
    sched.finish(warm, RequestStatus.FINISHED_LENGTH)
    sched.kv.reset_prefix_cache()  # its 2 pages spill to host
    conn.drain()
    req = make_req("r", range(10, 19))  # its prefix is in host now, not on the device
    sched.add(req)
    sched.schedule()
    assert req.status is RequestStatus.PROMOTING
    sched.finish(req, RequestStatus.FINISHED_ABORTED)
    assert req.status is RequestStatus.FINISHED_ABORTED
    assert sched.kv.num_holds == 0 and conn.num_promoting == 0
    assert not sched.has_unfinished()


def test_a_preempted_request_may_promote_again():
    # b used up its promotions before it ran; once preempted its pages spill like any freed
    # cached page, so on resumption it must be free to promote them back
    sched, conn, _, _ = make([HostTier(1 << 20)], num_pages=6)  # 5 usable pages
    a = make_req("a", range(10, 14))  # 1 page, nothing to promote; grows into a third page
    b = make_req("b", range(50, 59))  # 9 tokens: 3 pages, 2 of them promotable
    sched.add(a)
    assert step(sched, conn) == [("a", 4)]
    sched.add(b)
    for _ in range(50):  # b looks in the (empty) host tier first, then computes
        step(sched, conn)
        if len(sched.running) == 2:
            break
    assert sched.running == [a, b] and b.num_promotions == 1
    b.num_promotions = 3  # as after its last allowed promotion
    for _ in range(10):  # decode until a needs a page that only b's can give
        out = sched.schedule()
        if out.preempted:
            break
        conn.save_evicted()
        for req, n in out.scheduled:
            req.num_computed_tokens += n
            req.append_token(7)
    assert out.preempted == [b]
    sched.kv.reset_prefix_cache()  # b's freed pages leave the device for host
    conn.drain()
    sched.schedule()
    assert b.status is RequestStatus.PROMOTING and b.num_promotions == 1  # a fresh budget


def test_after_close_requests_run_from_the_device_only():
    sched, conn, _, _ = make([HostTier(1 << 20)])
    req = make_req("r", range(10, 19))
    sched.add(req)
    sched.schedule()
    assert req.status is RequestStatus.PROMOTING
    conn.close()
    assert step(sched, conn) == [("r", 9)]  # the dropped fetch: it computes
    late = make_req("late", range(10, 19))
    sched.add(late)
    assert step(sched, conn) == [("r", 1), ("late", 1)]  # device hits, no promotion


def replay(events, tier: str) -> set[bytes]:
    """What a subscriber that applies the events in order believes ``tier`` holds."""
    held: set[bytes] = set()
    for e in events:
        if e.tier == tier:
            (held.add if isinstance(e, BlockStored) else held.discard)(e.block_hash)
    return held


def test_host_pages_are_reported_as_tier_events_in_an_order_that_replays_exactly():
    host = HostTier(3 * (LAYOUT.page_nbytes + 200))  # room for about 3 encoded pages
    sched, conn, _, events = make([host, BrokenTier()])
    seen = []
    events.subscribe(seen.append)
    hashes = make_req("r", range(100, 125)).page_hashes  # 6 pages
    conn.store.put([(h, bytes(LAYOUT.page_nbytes)) for h in hashes[:2]])
    conn.store.put([(h, bytes(LAYOUT.page_nbytes)) for h in hashes[2:]])  # evicts some
    assert 0 < host.num_objects < len(hashes)
    assert replay(seen, "host") == set(host.keys())  # no page reported that is not there
    assert replay(seen, "redis") == set()  # the next tier refused the victims: no credit
    assert [e.seq for e in seen] == list(range(len(seen)))  # one sequence for every tier
