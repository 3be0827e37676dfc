"""PagePool, FreePageQueue and KVCacheManager: exact page ids, ref counts and eviction order."""

from __future__ import annotations

import pytest

from kvmesh.kvstore.events import BlockRemoved, BlockStored, EventLog
from kvmesh.kvstore.hashing import hash_pages
from kvmesh.worker.kv_cache import FreePageQueue, KVCacheManager, Page, PagePool
from kvmesh.worker.request import Request
from kvmesh.worker.sampling_params import SamplingParams

BS = 4
FP = "test-fp"


def make_req(rid: str, tokens) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=8), BS, FP)


def make_kv(num_pages: int, prefix_caching: bool = True) -> tuple[KVCacheManager, list]:
    events = EventLog("engine-0")
    log: list = []
    events.subscribe(log.append)
    return KVCacheManager(num_pages, BS, events, prefix_caching), log


def refs(kv: KVCacheManager) -> list[int]:
    return [p.ref_cnt for p in kv.pool.pages]


def hashes(kv: KVCacheManager) -> list[bytes | None]:
    return [p.page_hash for p in kv.pool.pages]


def allocate_prompt(kv: KVCacheManager, req: Request) -> list[int]:
    """Admit ``req`` the way the scheduler does: prefix hits, then the rest of the prompt."""
    computed, num_hit = kv.get_computed_pages(req)
    new = kv.allocate_slots(req, req.num_tokens - num_hit, computed)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    return [p.page_id for p in new]


# ---------------------------------------------------------------- FreePageQueue


def test_free_queue_fifo_order_and_o1_remove():
    pages = [Page(i) for i in range(5)]
    q = FreePageQueue(pages[1:])
    assert q.page_ids() == [1, 2, 3, 4]
    assert len(q) == q.num_free == 4
    q.remove(pages[3])
    assert q.page_ids() == [1, 2, 4]
    assert pages[3].prev is None and pages[3].next is None
    assert q.popleft() is pages[1]
    q.append(pages[3])
    q.append(pages[1])
    assert q.page_ids() == [2, 4, 3, 1]
    assert len(q) == 4


def test_free_queue_errors():
    pages = [Page(i) for i in range(3)]
    q = FreePageQueue(pages[1:])
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(pages[0])
    q.popleft()
    q.popleft()
    with pytest.raises(IndexError):
        q.popleft()
    assert q.page_ids() == [] and len(q) == 0


# ---------------------------------------------------------------- PagePool


def test_pool_null_page_is_reserved():
    pool = PagePool(6, EventLog("e"))
    assert pool.num_pages == 6
    assert pool.null_page is pool.pages[0]
    assert pool.null_page.ref_cnt == 1
    assert pool.free_queue.page_ids() == [1, 2, 3, 4, 5]
    assert pool.num_free == 5
    taken = pool.take(5)
    assert [p.page_id for p in taken] == [1, 2, 3, 4, 5]
    assert all(p.ref_cnt == 1 for p in taken)
    assert pool.num_free == 0
    with pytest.raises(ValueError, match="asked for 1 pages, 0 free"):
        pool.take(1)
    pool.release(reversed(taken))
    assert pool.free_queue.page_ids() == [5, 4, 3, 2, 1]
    assert pool.null_page.ref_cnt == 1


@pytest.mark.parametrize("n", [0, 1])
def test_pool_needs_two_pages(n):
    with pytest.raises(ValueError, match="num_pages must be >= 2"):
        PagePool(n, EventLog("e"))


def test_pool_take_too_many_changes_nothing():
    pool = PagePool(4, EventLog("e"))
    with pytest.raises(ValueError):
        pool.take(4)
    assert pool.free_queue.page_ids() == [1, 2, 3]
    assert [p.ref_cnt for p in pool.pages] == [1, 0, 0, 0]


def test_pool_release_below_zero_is_loud():
    pool = PagePool(3, EventLog("e"))
    (p,) = pool.take(1)
    pool.release([p])
    with pytest.raises(AssertionError, match="negative"):
        pool.release([p])


def test_page_hashes_are_write_once():
    pool = PagePool(4, EventLog("e"))
    p1, p2 = pool.take(2)
    h = hash_pages([1, 2, 3, 4], BS, FP)[0]
    pool.cache_page(p1, h, None, [1, 2, 3, 4])
    with pytest.raises(AssertionError, match="write-once"):
        pool.cache_page(p1, b"\1" * 16, None, [1, 2, 3, 4])
    assert p1.page_hash == h
    # a second page with the same content does not replace the first one in the map
    pool.cache_page(p2, h, None, [1, 2, 3, 4])
    assert p2.page_hash is None
    assert pool.lookup(h) is p1


# ---------------------------------------------------------------- KVCacheManager


def test_manager_never_hands_out_null_page():
    kv, _ = make_kv(5)
    reqs = [make_req(f"r{i}", range(i * 10, i * 10 + 4)) for i in range(4)]
    got = [allocate_prompt(kv, r) for r in reqs]
    assert got == [[1], [2], [3], [4]]
    assert kv.num_free_pages == 0
    assert kv.allocate_slots(make_req("r4", [9]), 1) is None
    for r in reqs:
        kv.free(r)
    assert 0 not in kv.pool.free_queue.page_ids()
    assert kv.pool.free_queue.page_ids() == [1, 2, 3, 4]
    assert refs(kv)[0] == 1


def test_ref_counts_shared_prefix_and_lru_free_order():
    kv, _ = make_kv(8)  # usable pages 1..7
    prompt = list(range(10, 19))  # 9 tokens: 2 full pages + 1 token
    a = make_req("a", prompt)
    assert allocate_prompt(kv, a) == [1, 2, 3]
    assert kv.page_ids(a) == [1, 2, 3]
    assert refs(kv) == [1, 1, 1, 1, 0, 0, 0, 0]
    assert kv.pool.free_queue.page_ids() == [4, 5, 6, 7]

    b = make_req("b", prompt)
    computed, num_hit = kv.get_computed_pages(b)
    assert [p.page_id for p in computed] == [1, 2]
    assert num_hit == 8
    new = kv.allocate_slots(b, 1, computed)
    assert [p.page_id for p in new] == [4]
    assert kv.page_ids(b) == [1, 2, 4]
    assert refs(kv) == [1, 2, 2, 1, 1, 0, 0, 0]

    kv.free(a)
    assert refs(kv) == [1, 1, 1, 0, 1, 0, 0, 0]
    assert kv.pool.free_queue.page_ids() == [5, 6, 7, 3]
    kv.free(b)
    assert refs(kv) == [1, 0, 0, 0, 0, 0, 0, 0]
    # each request's pages join the tail last-first: its tail is evicted before its prefix
    assert kv.pool.free_queue.page_ids() == [5, 6, 7, 3, 4, 2, 1]
    assert kv.page_ids(a) == [] and kv.page_ids(b) == []


def test_allocation_takes_lru_head_and_evicts_cached_pages():
    kv, log = make_kv(8)
    prompt = list(range(10, 19))
    h0, h1 = hash_pages(prompt, BS, FP)
    a = make_req("a", prompt)
    allocate_prompt(kv, a)  # pages 1, 2 (cached), 3
    kv.free(a)
    assert kv.pool.free_queue.page_ids() == [4, 5, 6, 7, 3, 2, 1]
    # freed pages keep their hashes and stay findable
    assert kv.pool.pages[1].page_hash == h0 and kv.pool.pages[2].page_hash == h1
    assert kv.pool.lookup(h0).page_id == 1 and kv.pool.lookup(h1).page_id == 2
    log.clear()

    c = make_req("c", range(500, 520))  # 20 tokens: 5 pages, no hits
    assert allocate_prompt(kv, c) == [4, 5, 6, 7, 3]
    assert not any(isinstance(e, BlockRemoved) for e in log)  # page 3 held no hash
    assert kv.pool.lookup(h1).page_id == 2

    log.clear()
    d = make_req("d", [900])
    assert allocate_prompt(kv, d) == [2]  # the older request's tail page goes first
    assert log == [BlockRemoved(seq=log[0].seq, engine_id="engine-0", block_hash=h1)]
    assert kv.pool.lookup(h1) is None
    assert kv.pool.pages[2].page_hash is None
    assert kv.pool.lookup(h0).page_id == 1  # the prefix page survives
    assert kv.pool.evictions == 1

    # a later request with the same prompt hits only the surviving first page
    e = make_req("e", prompt)
    computed, num_hit = kv.get_computed_pages(e)
    assert [p.page_id for p in computed] == [1] and num_hit == 4


def test_cached_pages_are_hit_after_free_and_pulled_out_of_free_queue():
    kv, _ = make_kv(8)
    prompt = list(range(10, 22))  # 12 tokens: 3 full pages
    a = make_req("a", prompt)
    allocate_prompt(kv, a)  # [1, 2, 3]
    kv.free(a)
    assert kv.num_free_pages == 7
    b = make_req("b", prompt + [99])  # 13 tokens: all 3 pages can hit
    computed, num_hit = kv.get_computed_pages(b)
    assert [p.page_id for p in computed] == [1, 2, 3] and num_hit == 12
    new = kv.allocate_slots(b, 1, computed)
    assert [p.page_id for p in new] == [4]
    assert kv.page_ids(b) == [1, 2, 3, 4]
    assert kv.num_free_pages == 3
    assert kv.pool.free_queue.page_ids() == [5, 6, 7]
    assert refs(kv)[1:5] == [1, 1, 1, 1]


def test_get_computed_pages_leaves_last_token_to_compute():
    kv, _ = make_kv(8)
    prompt = list(range(10, 18))  # exactly 2 full pages
    allocate_prompt(kv, make_req("a", prompt))
    computed, num_hit = kv.get_computed_pages(make_req("b", prompt))
    assert [p.page_id for p in computed] == [1]
    assert num_hit == 4
    # one token more and both pages hit
    computed, num_hit = kv.get_computed_pages(make_req("c", prompt + [7]))
    assert [p.page_id for p in computed] == [1, 2] and num_hit == 8
    # a one-page prompt can never hit
    assert kv.get_computed_pages(make_req("d", prompt[:4])) == ([], 0)


def test_get_computed_pages_stops_at_first_miss_and_modifies_nothing():
    kv, log = make_kv(8)
    prompt = list(range(10, 22))
    a = make_req("a", prompt)
    allocate_prompt(kv, a)
    kv.free(a)
    before = (refs(kv), hashes(kv), kv.pool.free_queue.page_ids(), len(log))
    diverged = prompt[:4] + [0, 0, 0, 0] + prompt[8:] + [1]
    computed, num_hit = kv.get_computed_pages(make_req("b", diverged))
    assert [p.page_id for p in computed] == [1] and num_hit == 4
    other_model = Request("c", prompt + [1], SamplingParams(), BS, "other-fp")
    assert kv.get_computed_pages(other_model) == ([], 0)
    assert (refs(kv), hashes(kv), kv.pool.free_queue.page_ids(), len(log)) == before


def test_block_stored_events_carry_parent_tokens_and_increasing_seq():
    kv, log = make_kv(8)
    prompt = list(range(10, 23))  # 13 tokens: 3 full pages
    h = hash_pages(prompt, BS, FP)
    a = make_req("a", prompt)
    allocate_prompt(kv, a)
    assert log == [
        BlockStored(0, "engine-0", h[0], None, (10, 11, 12, 13), BS),
        BlockStored(1, "engine-0", h[1], h[0], (14, 15, 16, 17), BS),
        BlockStored(2, "engine-0", h[2], h[1], (18, 19, 20, 21), BS),
    ]
    assert all(e.tier == "device" for e in log)
    # a request reusing those pages stores nothing new
    allocate_prompt(kv, make_req("b", prompt))
    assert len(log) == 3
    kv.free(a)
    kv.pool.reset_prefix_cache()  # still held by b: nothing removed
    assert len(log) == 3
    allocate_prompt(kv, make_req("c", range(100, 108)))
    seqs = [e.seq for e in log]
    assert seqs == list(range(len(log)))
    assert [type(e).__name__ for e in log[3:]] == ["BlockStored", "BlockStored"]


def test_eviction_emits_block_removed_with_next_seq():
    kv, log = make_kv(3)  # usable pages 1, 2
    a = make_req("a", range(10, 18))
    h = hash_pages(a.all_token_ids, BS, FP)
    allocate_prompt(kv, a)
    kv.free(a)
    assert kv.pool.free_queue.page_ids() == [2, 1]
    b = make_req("b", range(50, 55))
    hb = hash_pages(b.all_token_ids, BS, FP)
    assert allocate_prompt(kv, b) == [2, 1]
    assert log[2:] == [
        BlockRemoved(2, "engine-0", h[1]),
        BlockRemoved(3, "engine-0", h[0]),
        BlockStored(4, "engine-0", hb[0], None, (50, 51, 52, 53), BS),
    ]
    assert kv.pool.cached == {hb[0]: kv.pool.pages[2]}


def test_decode_tokens_fill_and_cache_pages_incrementally():
    kv, log = make_kv(8)
    req = make_req("a", range(10, 16))  # 6 tokens
    assert allocate_prompt(kv, req) == [1, 2]
    assert len(log) == 1  # only the first page is full
    for tok in (16, 17):
        req.append_token(tok)
        assert kv.allocate_slots(req, 1) == []  # still fits page 2
        req.num_computed_tokens += 1
    h = hash_pages(req.all_token_ids, BS, FP)
    assert req.page_hashes == h
    assert log[1] == BlockStored(1, "engine-0", h[1], h[0], (14, 15, 16, 17), BS)
    req.append_token(18)  # 9th token: needs a third page
    new = kv.allocate_slots(req, 1)
    assert [p.page_id for p in new] == [3]
    assert kv.page_ids(req) == [1, 2, 3]
    assert len(log) == 2


def test_allocate_slots_returns_none_and_changes_nothing():
    kv, log = make_kv(5)  # usable 1..4
    a = make_req("a", range(10, 22))  # 3 pages
    assert allocate_prompt(kv, a) == [1, 2, 3]
    b = make_req("b", range(50, 55))  # needs 2 pages, 1 free
    before = (kv.num_free_pages, refs(kv), hashes(kv), kv.pool.free_queue.page_ids(), len(log))
    assert kv.allocate_slots(b, 5) is None
    assert (kv.num_free_pages, refs(kv), hashes(kv), kv.pool.free_queue.page_ids(), len(log)) == (
        before
    )
    assert kv.page_ids(b) == []
    assert "b" not in kv.req_pages
    # a running request that cannot grow is also left as it was
    a.append_token(1)
    a.append_token(2)
    assert kv.allocate_slots(a, 2) == [kv.pool.pages[4]]
    a.num_computed_tokens = 14
    assert kv.allocate_slots(a, 3) is None  # 17 tokens need a 5th page
    assert kv.page_ids(a) == [1, 2, 3, 4]
    assert kv.num_free_pages == 0


def test_allocate_slots_counts_free_cached_hits_as_not_free():
    # The hit pages sit in the free queue; they cannot also serve as the request's new pages.
    kv, log = make_kv(4)  # usable 1..3
    prompt = list(range(10, 19))  # 9 tokens: pages 1, 2 cached, 3 partial
    a = make_req("a", prompt)
    allocate_prompt(kv, a)
    kv.free(a)
    assert kv.pool.free_queue.page_ids() == [3, 2, 1]
    b = make_req("b", prompt[:8] + [70, 71, 72, 73, 74])  # 13 tokens: 2 hits + 2 new pages
    computed, num_hit = kv.get_computed_pages(b)
    assert [p.page_id for p in computed] == [1, 2] and num_hit == 8
    before = (kv.num_free_pages, refs(kv), hashes(kv), kv.pool.free_queue.page_ids(), len(log))
    assert kv.allocate_slots(b, 5, computed) is None
    after = (kv.num_free_pages, refs(kv), hashes(kv), kv.pool.free_queue.page_ids(), len(log))
    assert after == before
    assert "b" not in kv.req_pages
    # with one token fewer it fits exactly: 2 hits + 1 new page
    c = make_req("c", prompt[:8] + [70, 71, 72, 73])
    computed, _ = kv.get_computed_pages(c)
    assert [p.page_id for p in kv.allocate_slots(c, 4, computed)] == [3]
    assert kv.page_ids(c) == [1, 2, 3] and kv.num_free_pages == 0


def test_usage_accounting():
    kv, _ = make_kv(5)  # 4 usable pages
    assert kv.usage() == 0.0
    prompt = list(range(10, 19))
    a = make_req("a", prompt)
    allocate_prompt(kv, a)  # 3 pages
    assert kv.usage() == 0.75
    b = make_req("b", prompt)
    allocate_prompt(kv, b)  # shares 2, takes 1
    assert kv.usage() == 1.0
    kv.free(a)
    assert kv.usage() == 0.75  # a's private page is free again; shared ones still held
    kv.free(b)
    assert kv.usage() == 0.0  # cached but unreferenced pages count as free
    assert len(kv.pool.cached) == 2


def test_reset_prefix_cache_drops_only_unreferenced_pages():
    kv, log = make_kv(8)
    a = make_req("a", range(10, 19))  # pages 1, 2 cached
    b = make_req("b", range(50, 59))  # pages 4, 5 cached
    allocate_prompt(kv, a)
    allocate_prompt(kv, b)
    ha, hb = hash_pages(a.all_token_ids, BS, FP), hash_pages(b.all_token_ids, BS, FP)
    kv.free(b)
    free_before = kv.pool.free_queue.page_ids()
    log.clear()
    assert kv.pool.reset_prefix_cache() == 2
    assert {e.block_hash for e in log} == set(hb)
    assert all(isinstance(e, BlockRemoved) for e in log)
    assert set(kv.pool.cached) == set(ha)
    assert kv.pool.lookup(ha[0]).page_id == 1 and kv.pool.lookup(ha[1]).page_id == 2
    assert kv.pool.pages[4].page_hash is None and kv.pool.pages[5].page_hash is None
    assert kv.pool.free_queue.page_ids() == free_before
    assert kv.pool.reset_prefix_cache() == 0
    kv.free(a)
    assert kv.pool.reset_prefix_cache() == 2
    assert kv.pool.cached == {}
    assert kv.get_computed_pages(make_req("c", range(10, 19))) == ([], 0)


def test_prefix_caching_disabled_never_hits_or_emits():
    kv, log = make_kv(8, prefix_caching=False)
    prompt = list(range(10, 22))
    a = make_req("a", prompt)
    assert allocate_prompt(kv, a) == [1, 2, 3]
    b = make_req("b", prompt)
    assert kv.get_computed_pages(b) == ([], 0)
    assert allocate_prompt(kv, b) == [4, 5, 6]
    assert log == [] and kv.pool.cached == {}
    assert all(h is None for h in hashes(kv))


def test_free_unknown_request_is_noop():
    kv, _ = make_kv(4)
    kv.free(make_req("ghost", [1, 2]))
    assert kv.pool.free_queue.page_ids() == [1, 2, 3]


def test_a_hold_pins_cached_pages_until_admission_or_free():
    kv, _ = make_kv(6)  # 5 usable pages
    a = make_req("a", range(10, 19))  # 9 tokens: 2 full pages + 1
    allocate_prompt(kv, a)
    kv.free(a)  # pages 1, 2 cached, 3 plain; all free
    b = make_req("b", range(10, 19))
    computed, _ = kv.get_computed_pages(b)
    assert [p.page_id for p in computed] == [1, 2]
    kv.hold(b, computed)  # b waits (e.g. for a load) with its prefix pinned
    assert refs(kv)[1:3] == [1, 1] and kv.num_holds == 1 and kv.num_free_pages == 3
    c = make_req("c", range(50, 62))  # 12 tokens: all 3 unpinned pages
    allocate_prompt(kv, c)
    assert kv.allocate_slots(make_req("d", [1]), 1) is None  # the held pages are not free
    kv.free(c)
    assert kv.allocate_slots(b, 1, computed) is not None  # admitted: its own refs now
    assert kv.num_holds == 0 and refs(kv)[1:3] == [1, 1]
    kv.free(b)
    assert refs(kv) == [1, 0, 0, 0, 0, 0]


def test_hold_replaces_the_earlier_one_and_release_holds_gives_all_up():
    kv, _ = make_kv(6)
    a = make_req("a", range(10, 19))
    allocate_prompt(kv, a)
    pages = list(kv.pool.pages[1:3])
    kv.free(a)
    b, c = make_req("b", [1]), make_req("c", [2])
    kv.hold(b, pages[:1])
    kv.hold(b, pages)  # a longer run after a load: one reference each, not two
    kv.hold(c, pages[1:])
    assert refs(kv)[1:3] == [1, 2]
    assert kv.release_holds() == 2
    assert refs(kv)[1:3] == [0, 0] and kv.num_holds == 0 and kv.num_free_pages == 5
    kv.hold(c, pages)
    kv.free(c)  # a request freed while waiting lets go of its hold
    assert refs(kv)[1:3] == [0, 0]
