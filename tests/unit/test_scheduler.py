"""Scheduler driven without a model: exact chunk sizes, admission order and preemption."""

from __future__ import annotations

from kvmesh.kvstore.events import EventLog
from kvmesh.kvstore.hashing import hash_pages
from kvmesh.worker.config import SchedulerConfig
from kvmesh.worker.kv_cache import KVCacheManager
from kvmesh.worker.request import Request, RequestStatus
from kvmesh.worker.sampling_params import SamplingParams
from kvmesh.worker.scheduler import Scheduler

BS = 4
FP = "test-fp"


def make_sched(
    num_pages: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    preemption_reserve: float = 0.5,
) -> Scheduler:
    kv = KVCacheManager(num_pages, BS, EventLog("engine-0"))
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        preemption_reserve=preemption_reserve,
    )
    return Scheduler(cfg, kv)


def make_req(rid: str, tokens) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=64), BS, FP)


def step(sched: Scheduler) -> list[tuple[str, int]]:
    """One engine step without a model: schedule, then the engine's postprocess."""
    out = sched.schedule()
    for req, n in out.scheduled:
        req.num_computed_tokens += n
    for req, _ in out.scheduled:
        if req.num_computed_tokens == req.num_tokens:
            req.append_token(1000 + req.num_tokens)
    assert out.num_tokens <= sched.config.max_num_batched_tokens
    assert len(sched.running) <= sched.config.max_num_seqs
    return [(req.request_id, n) for req, n in out.scheduled]


def ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


def test_chunked_prefill_splits_a_long_prompt_by_the_token_budget():
    s = make_sched(max_num_batched_tokens=8)
    a = make_req("a", range(100, 120))  # 20 tokens
    s.add(a)
    assert step(s) == [("a", 8)]
    assert a.num_computed_tokens == 8 and a.output_token_ids == []
    assert s.kv.page_ids(a) == [1, 2]
    assert step(s) == [("a", 8)]
    assert s.kv.page_ids(a) == [1, 2, 3, 4]
    assert a.output_token_ids == []
    assert step(s) == [("a", 4)]
    assert a.num_computed_tokens == 20 and a.output_token_ids == [1020]
    assert s.kv.page_ids(a) == [1, 2, 3, 4, 5]
    assert step(s) == [("a", 1)]
    assert a.output_token_ids == [1020, 1021]
    assert a.num_cached_tokens == 0
    assert a.status == RequestStatus.RUNNING


def test_budget_is_shared_running_first_then_waiting():
    s = make_sched(max_num_batched_tokens=8)
    a = make_req("a", range(100, 110))
    b = make_req("b", range(200, 210))
    s.add(a)
    s.add(b)
    assert step(s) == [("a", 8)]
    assert ids(s.waiting) == ["b"]
    assert step(s) == [("a", 2), ("b", 6)]
    assert step(s) == [("a", 1), ("b", 4)]
    assert step(s) == [("a", 1), ("b", 1)]
    assert a.num_tokens == 13 and b.num_tokens == 12


def test_running_requests_are_scheduled_before_waiting_ones():
    s = make_sched(max_num_batched_tokens=4)
    a = make_req("a", range(100, 104))
    s.add(a)
    assert step(s) == [("a", 4)]
    b = make_req("b", range(200, 206))
    s.add(b)
    assert step(s) == [("a", 1), ("b", 3)]
    assert step(s) == [("a", 1), ("b", 3)]
    assert step(s) == [("a", 1), ("b", 1)]
    assert ids(s.running) == ["a", "b"]


def test_fcfs_a_later_short_request_does_not_jump_the_queue():
    s = make_sched(max_num_batched_tokens=4)
    a = make_req("a", range(100, 110))
    b = make_req("b", range(200, 202))
    s.add(a)
    s.add(b)
    assert step(s) == [("a", 4)]
    assert step(s) == [("a", 4)]
    assert b.status == RequestStatus.WAITING
    assert step(s) == [("a", 2), ("b", 2)]


def test_fcfs_head_of_queue_blocks_when_pages_run_out():
    s = make_sched(num_pages=4)  # 3 usable pages
    x = make_req("x", range(100, 106))  # 2 pages
    s.add(x)
    assert step(s) == [("x", 6)]
    a = make_req("a", range(200, 206))  # needs 2 pages, 1 free
    b = make_req("b", range(300, 302))  # would fit in 1 page
    s.add(a)
    s.add(b)
    assert step(s) == [("x", 1)]
    assert ids(s.waiting) == ["a", "b"]
    assert s.kv.num_free_pages == 1
    assert s.num_preemptions == 0


def test_max_num_seqs_caps_running_requests():
    s = make_sched(max_num_seqs=2)
    reqs = [make_req(n, range(i * 100, i * 100 + 4)) for i, n in enumerate("abc")]
    for r in reqs:
        s.add(r)
    assert step(s) == [("a", 4), ("b", 4)]
    assert ids(s.running) == ["a", "b"] and ids(s.waiting) == ["c"]
    assert step(s) == [("a", 1), ("b", 1)]
    s.finish(reqs[0], RequestStatus.FINISHED_LENGTH)
    assert step(s) == [("b", 1), ("c", 4)]
    assert ids(s.running) == ["b", "c"] and not s.waiting


def test_preempts_newest_and_resumes_from_prefix_cache():
    s = make_sched(num_pages=5)  # 4 usable pages
    a = make_req("a", range(10, 17))  # 7 tokens
    b = make_req("b", range(50, 57))
    s.add(a)
    s.add(b)
    assert step(s) == [("a", 7), ("b", 7)]
    assert s.kv.page_ids(a) == [1, 2] and s.kv.page_ids(b) == [3, 4]
    assert step(s) == [("a", 1), ("b", 1)]  # both reach 8 tokens: page 2 (and 4) fill
    assert a.num_tokens == b.num_tokens == 9
    hb = hash_pages(b.all_token_ids, BS, FP)
    assert s.kv.pool.lookup(hb[1]).page_id == 4

    # a needs a third page and none is free: b, the newest, is preempted
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1)]
    assert out.preempted == [b]
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and s.num_preemptions == 1
    assert ids(s.running) == ["a"] and ids(s.waiting) == ["b"]
    assert s.kv.page_ids(b) == []
    assert s.kv.page_ids(a) == [1, 2, 4]  # b's tail page went first ...
    assert s.kv.pool.lookup(hb[1]) is None
    assert s.kv.pool.lookup(hb[0]).page_id == 3  # ... and its prefix is still cached
    assert s.kv.pool.free_queue.page_ids() == [3]
    for req, n in out.scheduled:
        req.num_computed_tokens += n
    a.append_token(1010)

    # b hits page 3 but needs 2 more pages; 1 free page is its own hit: it waits
    assert step(s) == [("a", 1)]
    assert ids(s.waiting) == ["b"]

    s.finish(a, RequestStatus.FINISHED_LENGTH)
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert s.kv.pool.free_queue.page_ids() == [3, 4, 2, 1]
    out = s.schedule()
    # resumes with prompt + both sampled tokens; the cached first page is not recomputed
    assert [(r.request_id, n) for r, n in out.scheduled] == [("b", 5)]
    assert b.num_computed_tokens == 4 and b.num_tokens == 9
    assert b.status == RequestStatus.RUNNING
    assert b.output_token_ids == [1007, 1008]
    assert s.kv.page_ids(b) == [3, 4, 2]
    assert b.num_cached_tokens == 0  # set once, at first scheduling
    assert ids(s.running) == ["b"] and not s.waiting


def test_newest_request_preempts_itself_when_it_cannot_grow():
    s = make_sched(num_pages=4)  # 3 usable pages
    a = make_req("a", range(10, 16))  # 6 tokens: pages 1, 2
    b = make_req("b", range(50, 54))  # 4 tokens: page 3
    s.add(a)
    s.add(b)
    assert step(s) == [("a", 6), ("b", 4)]
    # a still fits its 2 pages; b's 5th token needs a page: b preempts itself
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1)]
    assert out.preempted == [b]
    assert ids(s.running) == ["a"] and ids(s.waiting) == ["b"]
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert s.kv.page_ids(a) == [1, 2]
    assert s.kv.num_free_pages == 1
    assert [p.ref_cnt for p in s.kv.pool.pages] == [1, 1, 1, 0]


def test_preempted_request_goes_back_ahead_of_later_arrivals():
    # optimistic admission throughout (with the reserve, c would wait for room to grow)
    s = make_sched(num_pages=5, preemption_reserve=0.0)
    a = make_req("a", range(10, 17))
    b = make_req("b", range(50, 57))
    s.add(a)
    s.add(b)
    step(s)
    step(s)
    c = make_req("c", [7])
    s.add(c)
    out = s.schedule()
    assert out.preempted == [b]
    assert ids(s.waiting) == ["b", "c"]
    assert [r.request_id for r, _ in out.scheduled] == ["a"]
    s.finish(a, RequestStatus.FINISHED_LENGTH)
    assert step(s) == [("b", 5), ("c", 1)]  # b resumes first (its first page is a hit)


def test_holds_are_given_up_when_nothing_else_can_run():
    # pages pinned for a waiting request (a load it has not used yet) must not wedge the
    # engine: with nothing running and the head of the queue unable to fit, they go
    s = make_sched(num_pages=5)  # 4 usable pages
    a = make_req("a", range(10, 19))  # 9 tokens: 3 pages
    s.add(a)
    step(s)
    s.finish(a, RequestStatus.FINISHED_LENGTH)
    b = make_req("b", range(50, 63))  # 13 tokens: needs all 4 pages
    c = make_req("c", range(10, 19))
    s.kv.hold(c, s.kv.get_computed_pages(c)[0])  # c's 2 cached pages pinned for it
    s.add(b)
    out = s.schedule()
    assert out.scheduled == [] and s.kv.num_holds == 0  # b could not fit: holds released
    assert step(s) == [("b", 13)]


def test_a_running_request_takes_held_pages_before_anyone_is_preempted():
    s = make_sched(num_pages=6)  # 5 usable pages
    old = make_req("old", range(10, 19))  # 9 tokens: 2 full pages cached after it ends
    s.add(old)
    step(s)
    s.finish(old, RequestStatus.FINISHED_LENGTH)
    w = make_req("w", range(10, 19))
    s.kv.hold(w, s.kv.get_computed_pages(w)[0])  # pinned for w, as for a load
    a = make_req("a", range(50, 56))  # 6 tokens: 2 pages, then a third for its 9th
    s.add(a)
    assert step(s) == [("a", 6)]
    assert s.kv.num_free_pages == 1 and s.kv.num_holds == 1
    b = make_req("b", [5])
    s.add(b)
    assert step(s) == [("a", 1), ("b", 1)]  # b takes the last free page
    assert step(s) == [("a", 1), ("b", 1)]
    assert s.kv.num_free_pages == 0 and a.num_tokens == 9
    out = s.schedule()  # a needs a third page: w's hold goes, nobody is preempted
    assert out.preempted == [] and s.kv.num_holds == 0
    assert [r.request_id for r, _ in out.scheduled] == ["a", "b"]


def test_prefix_hits_set_num_cached_tokens_and_metrics():
    s = make_sched()
    prompt = list(range(10, 22))  # 12 tokens
    a = make_req("a", prompt)
    s.add(a)
    assert step(s) == [("a", 12)]
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    b = make_req("b", prompt)
    s.add(b)
    assert step(s) == [("b", 4)]  # 2 of 3 pages hit: the last token is always computed
    assert b.num_cached_tokens == 8
    assert s.kv.page_ids(b) == [1, 2, 4]
    assert s.kv.prefix_queries == 24 and s.kv.prefix_hits == 8


def test_finish_frees_pages_at_once():
    s = make_sched(num_pages=8)
    a = make_req("a", range(10, 20))
    b = make_req("b", range(50, 60))
    s.add(a)
    s.add(b)
    step(s)
    assert s.kv.num_free_pages == 1
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    assert s.kv.num_free_pages == 4
    assert s.kv.page_ids(a) == []
    assert ids(s.running) == ["b"]
    assert a.status == RequestStatus.FINISHED_ABORTED and a.status.finished
    # finishing a waiting request removes it from the queue
    c = make_req("c", range(70, 75))
    s.add(c)
    s.finish(c, RequestStatus.FINISHED_ABORTED)
    assert not s.waiting
    s.finish(b, RequestStatus.FINISHED_LENGTH)
    assert s.kv.num_free_pages == 7
    assert not s.has_unfinished()
    assert step(s) == []


def test_many_requests_run_to_completion_under_pressure():
    # Invariants under pressure: every request finishes, ref counts return to zero, and
    # the free queue ends up holding every usable page exactly once.
    s = make_sched(num_pages=7, max_num_seqs=4, max_num_batched_tokens=10)
    reqs = [make_req(f"r{i}", range(i * 7, i * 7 + 3 + i)) for i in range(6)]
    for r in reqs:
        s.add(r)
    for _ in range(200):
        if not s.has_unfinished():
            break
        step(s)
        for r in list(s.running):
            if len(r.output_token_ids) >= 6:
                s.finish(r, RequestStatus.FINISHED_LENGTH)
    assert not s.has_unfinished()
    assert all(len(r.output_token_ids) == 6 for r in reqs)
    assert s.num_preemptions > 0
    assert [p.ref_cnt for p in s.kv.pool.pages] == [1, 0, 0, 0, 0, 0, 0]
    assert sorted(s.kv.pool.free_queue.page_ids()) == [1, 2, 3, 4, 5, 6]


def run_long_prompts(reserve: float) -> tuple[Scheduler, int]:
    """Sixteen requests of 512 prompt tokens and 64 output tokens, prefilled in chunks of
    128, in 360 usable pages of 16 tokens: the pool holds 10 of them at their final 36
    pages, and many more at their first chunk. Returns the scheduler and the tokens it had
    computed (prompts recomputed after a preemption count again)."""
    kv = KVCacheManager(361, 16, EventLog("engine-0"), enable_prefix_caching=False)
    cfg = SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=128, preemption_reserve=reserve)
    s = Scheduler(cfg, kv)
    reqs = [
        Request(f"r{i}", list(range(i * 600, i * 600 + 512)), SamplingParams(max_tokens=64), 16, FP)
        for i in range(16)
    ]
    for r in reqs:
        s.add(r)
    computed = 0
    for _ in range(2000):
        if not s.has_unfinished():
            break
        out = s.schedule()
        for req, n in out.scheduled:
            req.num_computed_tokens += n
            computed += n
        for req, _ in out.scheduled:
            if req.num_computed_tokens == req.num_tokens:
                req.append_token(1)
        for r in list(s.running):
            if len(r.output_token_ids) >= r.params.max_tokens:
                s.finish(r, RequestStatus.FINISHED_LENGTH)
    assert not s.has_unfinished()
    assert all(len(r.output_token_ids) == 64 for r in reqs)
    return s, computed


def test_admission_after_a_preemption_keeps_room_for_the_running_requests_to_grow():
    # Optimistic admission lets a request in when its first chunk fits; the running ones
    # grow, the newest is preempted (its prompt computed for nothing) and is let in again
    # as soon as its first chunk fits: it thrashes. After the first preemption the reserve
    # admits only what the pool can carry to the end.
    least = 16 * (512 + 63)  # every prompt once, every output token but the last
    thrash, thrash_computed = run_long_prompts(0.0)
    s, computed = run_long_prompts(0.5)
    assert thrash.num_preemptions >= 5 and thrash_computed > least + 1000
    assert s.num_preemptions <= 2 and computed <= least + 2 * 512
    assert s.reserve_ratio == 0.0  # the queue drained: optimistic admission again
    assert sorted(s.kv.pool.free_queue.page_ids()) == list(range(1, 361))


def test_the_reserve_counts_a_kv_budget_as_the_most_a_request_can_hold():
    s = make_sched(num_pages=64)
    s.reserve_ratio = 1.0
    s.mean_output = 1000.0  # finished requests ran long: max_tokens is what bounds these
    r = Request("b", list(range(40)), SamplingParams(max_tokens=100), BS, FP)
    assert s._pages_to_grow(r, 10) == 25  # 40 + 99 written tokens at the end: 35 pages
    r.kv_budget = 20
    # not compacted yet: its 10 prompt pages, then a copy of the 6 it keeps
    assert s._pages_to_grow(r, 3) == 10 + 6 - 3
    r.num_evicted = 20  # compacted: never more than ceil(20 / 4) + 1 = 6 pages
    assert s._pages_to_grow(r, 3) == 3
    r.kv_budget, r.num_evicted = None, 0
    s.reserve_ratio = 0.5
    assert s._pages_to_grow(r, 10) == 13  # 40 + 50 tokens: 23 pages
    s.mean_output = 30.0  # requests stop after ~30 tokens: 15 of the remaining 99 counted
    assert s._pages_to_grow(r, 10) == 14 - 10  # 40 + 15 tokens: 14 pages
    for t in range(28):  # 28 done: 2 more expected, at least a page's worth (4) counted
        r.append_token(t)
    assert s._pages_to_grow(r, 17) == 1  # 68 + ceil(3 / 2) tokens: 18 pages


def test_a_standing_queue_of_requests_without_max_tokens_keeps_its_concurrency():
    # Chat requests without max_tokens (the HTTP API's default) stop at EOS, here after 64
    # tokens. Counting their whole max_model_len after a preemption would run a few at
    # a time; the finished requests' mean output bounds what is counted.
    def run(reserve: float) -> tuple[float, int]:
        kv = KVCacheManager(1025, 16, EventLog("engine-0"), enable_prefix_caching=False)
        cfg = SchedulerConfig(
            max_num_seqs=128, max_num_batched_tokens=512, preemption_reserve=reserve
        )
        s = Scheduler(cfg, kv)
        unlimited = SamplingParams(max_tokens=2**31 - 1)
        for i in range(200):
            s.add(Request(f"r{i}", list(range(i * 300, i * 300 + 256)), unlimited, 16, FP))
        running, steps = 0, 0
        while s.has_unfinished():
            out = s.schedule()
            steps += 1
            running += len(s.running)
            for req, n in out.scheduled:
                req.num_computed_tokens += n
            for req, _ in out.scheduled:
                if req.num_computed_tokens == req.num_tokens:
                    req.append_token(1)
            for r in list(s.running):
                if len(r.output_token_ids) >= 64:
                    s.finish(r, RequestStatus.FINISHED_STOPPED)
        return running / steps, s.num_preemptions

    optimistic, _ = run(0.0)
    reserved, preemptions = run(0.5)
    assert preemptions >= 1  # the reserve was armed
    assert reserved >= 0.8 * optimistic
