"""router.policies: choices on small, hand-built clusters."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvmesh.kvstore.events import BlockStored
from kvmesh.kvstore.hashing import hash_pages
from kvmesh.router import (
    CostModel,
    LoadGuard,
    Match,
    NoWorkerError,
    PrefixIndex,
    RouteRequest,
    WorkerLoad,
    make_policy,
    pick_and_insert,
)

FP = "router-test-fp"
BS = 16
PROMPT = list(range(100, 100 + 64 * BS))  # 1,024 tokens, 64 pages
HASHES = hash_pages(PROMPT, BS, FP)
REQ = RouteRequest(prompt_tokens=len(PROMPT), page_hashes=HASHES, block_size=BS)
BIG_PROMPT = list(range(16 * 1024))  # 16K tokens, 1,024 pages
BIG = RouteRequest(len(BIG_PROMPT), hash_pages(BIG_PROMPT, BS, FP), BS)
IDLE = WorkerLoad()
W3 = ("w0", "w1", "w2")


def idle(workers=W3) -> dict[str, WorkerLoad]:
    return {w: IDLE for w in workers}


def index_with(worker: str, hashes, tier: str = "device") -> PrefixIndex:
    idx = PrefixIndex(peer_tiers={"host"})  # device pages are not peer hits in these tests
    for seq, h in enumerate(hashes):
        idx.apply(worker, BlockStored(seq, "e", h, None, (), BS, tier))
    for w in W3:
        idx.add_worker(w)
    return idx


def test_unknown_policy_names_the_accepted_ones():
    with pytest.raises(ValueError) as e:
        make_policy("cache_aware")
    assert "'cache_aware'" in str(e.value)
    assert "least_loaded, prefix_affinity, round_robin" in str(e.value)


def test_default_policy_is_prefix_affinity():
    assert make_policy().name == "prefix_affinity"


def test_no_workers_is_an_error():
    with pytest.raises(NoWorkerError):
        make_policy().pick(REQ, {}, {})


def test_affinity_wins_when_load_is_equal():
    idx = index_with("w1", HASHES[:40])
    d = make_policy("prefix_affinity", rng=random.Random(0)).pick(REQ, idx.match(HASHES), idle())
    assert d.worker_id == "w1" and d.reason == "affinity" and d.tied == ("w1",)
    s = d.score("w1")
    assert s.match == Match(device=40)
    assert s.cached_tokens == 40 * BS and s.recompute_tokens == 24 * BS
    assert s.total == 24 * BS and d.score("w0").total == 64 * BS


def test_tier_credit_orders_device_host_redis_peer():
    cost = CostModel(host_cost=0.1, redis_cost=0.3, peer_cost=0.5)
    pol = make_policy("prefix_affinity", cost=cost, rng=random.Random(0))
    matches = {"w0": Match(host=64), "w1": Match(redis=64), "w2": Match(peer=64)}
    d = pol.pick(REQ, matches, idle())
    assert d.worker_id == "w0"
    assert [d.score(w).fetch_cost for w in W3] == pytest.approx(
        [0.1 * 1024, 0.3 * 1024, 0.5 * 1024]
    )
    # A device hit beats them all.
    d = pol.pick(REQ, {**matches, "w2": Match(device=64)}, idle())
    assert d.worker_id == "w2" and d.score("w2").total == 0


def test_queued_work_outweighs_a_small_cache_hit():
    cost = CostModel(queue_weight=1.0)
    pol = make_policy("prefix_affinity", cost=cost, rng=random.Random(0))
    loads = {"w0": WorkerLoad(queued_prefill_tokens=2000), "w1": IDLE}
    d = pol.pick(REQ, {"w0": Match(device=64)}, loads)
    assert d.worker_id == "w1"  # 2,000 queued > 1,024 to compute
    loads["w0"] = WorkerLoad(queued_prefill_tokens=500)
    assert pol.pick(REQ, {"w0": Match(device=64)}, loads).worker_id == "w0"


def test_queue_weight_scales_queued_work_against_recompute():
    # Default 0.1 while every worker is busy: 2,000 queued tokens weigh 200, less than the
    # 1,024 a cold worker would recompute, so affinity holds; past 10x the hit (and within
    # the guard) it moves. (w1 decodes one sequence: busy, not idle.)
    busy = WorkerLoad(running=1)
    pol = make_policy("prefix_affinity", rng=random.Random(0))
    loads = {"w0": WorkerLoad(queued_prefill_tokens=2000), "w1": busy}
    d = pol.pick(REQ, {"w0": Match(device=64)}, loads)
    assert d.worker_id == "w0" and d.score("w0").total == pytest.approx(200.0)
    assert d.score("w0").load == 2000  # the unweighted load is what the guard judges
    pol = make_policy("prefix_affinity", guard=LoadGuard(slack_tokens=1e9), rng=random.Random(0))
    loads["w0"] = WorkerLoad(queued_prefill_tokens=11_000)
    assert pol.pick(REQ, {"w0": Match(device=64)}, loads).worker_id == "w1"
    for name in ("queue_weight", "idle_queue_weight"):
        for bad in (-1, float("nan")):
            with pytest.raises(ValueError, match=name):
                CostModel(**{name: bad})


def test_an_idle_worker_beats_a_cache_hit_behind_a_long_queue():
    # w1 is idle: the queue at w0 now weighs 0.25. 6,000 queued tokens (1,500) outweigh the
    # 1,024 the hit saves, so the request goes to the idle worker; 3,000 queued (750) do not.
    pol = make_policy("prefix_affinity", rng=random.Random(0))
    loads = {"w0": WorkerLoad(queued_prefill_tokens=6000), "w1": IDLE}
    d = pol.pick(REQ, {"w0": Match(device=64)}, loads)
    assert d.worker_id == "w1" and d.score("w0").total == pytest.approx(1500.0)
    loads["w0"] = WorkerLoad(queued_prefill_tokens=3000)
    assert pol.pick(REQ, {"w0": Match(device=64)}, loads).worker_id == "w0"
    # the same 6,000 while nobody is idle weigh 0.1 (600): affinity holds
    loads = {"w0": WorkerLoad(queued_prefill_tokens=6000), "w1": WorkerLoad(running=1)}
    assert pol.pick(REQ, {"w0": Match(device=64)}, loads).worker_id == "w0"
    # a worker with one short decode left is not worth leaving for an idle one
    loads["w0"] = WorkerLoad(running=1)
    assert pol.pick(REQ, {"w0": Match(device=64)}, loads).worker_id == "w0"
    assert LoadGuard.from_seconds(5.0, 20_000.0).slack_tokens == 100_000.0
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        LoadGuard.from_seconds(5.0, float("nan"))


def test_decode_load_counts_per_running_sequence():
    pol = make_policy("prefix_affinity", cost=CostModel(decode_cost=8.0), rng=random.Random(0))
    loads = {"w0": WorkerLoad(running=20), "w1": WorkerLoad(running=10)}
    d = pol.pick(REQ, {}, loads)
    assert d.worker_id == "w1" and d.score("w0").load == 160 and d.score("w1").load == 80


def test_load_guard_moves_off_an_overloaded_worker_only():
    guard = LoadGuard(ratio=2.0, slack_tokens=4096)
    pol = make_policy("prefix_affinity", guard=guard, rng=random.Random(0))
    matches = {"w0": Match(device=64)}
    # Merely busier: 3,000 tokens ahead of an idle worker is within the slack. Affinity stays.
    busier = {"w0": WorkerLoad(queued_prefill_tokens=1000), "w1": IDLE}
    d = pol.pick(REQ, matches, busier)
    assert d.worker_id == "w0" and not d.score("w0").overloaded
    # Busier by more than the slack but under 2x the least loaded: still not overloaded.
    busier = {
        "w0": WorkerLoad(queued_prefill_tokens=15_000),
        "w1": WorkerLoad(queued_prefill_tokens=9_000),
    }
    d = pol.pick(BIG, {"w0": Match(device=1024)}, busier)
    assert d.worker_id == "w0" and not d.score("w0").overloaded
    # Overloaded: 10,000 ahead of an idle worker (over the slack and over 2x). Its cache hit
    # would still make it the cheapest (10,000 < 16,384), but the guard skips it.
    hot = {"w0": WorkerLoad(queued_prefill_tokens=10_000), "w1": IDLE}
    d = pol.pick(BIG, {"w0": Match(device=1024)}, hot)
    assert d.score("w0").overloaded and d.score("w0").total < d.score("w1").total
    assert d.worker_id == "w1"


def test_load_guard_is_per_candidate_not_fleet_wide():
    """One hot worker must not flip every request to least-loaded."""
    pol = make_policy("prefix_affinity", guard=LoadGuard(2.0, 4096), rng=random.Random(0))
    loads = {"w0": WorkerLoad(queued_prefill_tokens=50_000), "w1": IDLE, "w2": IDLE}
    # w2 holds the prefix; w1 is as idle. Affinity still decides between the healthy ones.
    d = pol.pick(REQ, {"w2": Match(device=64)}, loads)
    assert d.worker_id == "w2" and d.score("w0").overloaded


def test_ties_are_spread_across_workers():
    pol = make_policy("prefix_affinity", rng=random.Random(1234))
    counts = Counter(pol.pick(REQ, {}, idle()).worker_id for _ in range(3000))
    assert set(counts) == set(W3)
    assert all(800 < n < 1200 for n in counts.values()), counts
    ll = make_policy("least_loaded", rng=random.Random(1234))
    counts = Counter(ll.pick(REQ, {}, idle()).worker_id for _ in range(3000))
    assert all(800 < n < 1200 for n in counts.values()), counts


def test_tie_breaks_repeat_with_the_same_seed():
    a = make_policy(rng=random.Random(7))
    b = make_policy(rng=random.Random(7))
    seq_a = [a.pick(REQ, {}, idle()).worker_id for _ in range(50)]
    seq_b = [b.pick(REQ, {}, idle()).worker_id for _ in range(50)]
    assert seq_a == seq_b and len(set(seq_a)) == 3


def empty_index() -> PrefixIndex:
    idx = PrefixIndex(clock=lambda: 0.0)
    for w in W3:
        idx.add_worker(w)
    return idx


def test_optimistic_insert_keeps_a_burst_together():
    firsts = set()
    for seed in range(20):  # whichever worker the first pick lands on, the burst follows it
        idx = empty_index()
        pol = make_policy(rng=random.Random(seed))
        first = pick_and_insert(idx, pol, REQ, idle())
        assert first.tied == W3
        firsts.add(first.worker_id)
        for _ in range(5):
            d = pick_and_insert(idx, pol, REQ, idle())
            assert d.worker_id == first.worker_id and d.tied == (first.worker_id,)
    assert len(firsts) == 3
    # Without the optimistic insert, the same burst scatters.
    idx = empty_index()
    pol = make_policy(rng=random.Random(0))
    seen = {pol.pick(REQ, idx.match(HASHES), idle()).worker_id for _ in range(30)}
    assert len(seen) == 3


def test_session_sticks_while_not_overloaded():
    guard = LoadGuard(ratio=2.0, slack_tokens=4096)
    pol = make_policy("prefix_affinity", guard=guard, rng=random.Random(0))
    turn = RouteRequest(REQ.prompt_tokens, HASHES, BS, session_key="conv-1")
    first = pol.pick(turn, {"w2": Match(device=64)}, idle())
    assert first.worker_id == "w2" and first.reason == "affinity"
    # Next turn: the index now favours w0 (stale or lagging), the session keeps w2.
    loads = {"w0": IDLE, "w1": IDLE, "w2": WorkerLoad(queued_prefill_tokens=3000)}
    d = pol.pick(turn, {"w0": Match(device=64)}, loads)
    assert d.worker_id == "w2" and d.reason == "session"
    # Overloaded: the session moves, and then sticks to its new worker.
    loads["w2"] = WorkerLoad(queued_prefill_tokens=20_000)
    d = pol.pick(turn, {"w0": Match(device=64)}, loads)
    assert d.worker_id == "w0" and d.reason == "affinity"
    loads["w2"] = IDLE
    d = pol.pick(turn, {"w2": Match(device=64)}, loads)
    assert d.worker_id == "w0" and d.reason == "session"
    # Another conversation is not affected.
    other = RouteRequest(REQ.prompt_tokens, HASHES, BS, session_key="conv-2")
    assert pol.pick(other, {"w1": Match(device=64)}, idle()).worker_id == "w1"


def test_session_table_is_bounded():
    pol = make_policy("prefix_affinity", max_sessions=2, rng=random.Random(0))
    for i in range(5):
        r = RouteRequest(REQ.prompt_tokens, HASHES, BS, session_key=f"s{i}")
        pol.pick(r, {}, idle())
    assert list(pol._sessions) == ["s3", "s4"]


def test_round_robin_cycles_in_worker_order_ignoring_cache():
    pol = make_policy("round_robin")
    matches = {"w2": Match(device=64)}
    picks = [pol.pick(REQ, matches, idle()).worker_id for _ in range(6)]
    assert picks == ["w0", "w1", "w2", "w0", "w1", "w2"]


def test_least_loaded_ignores_cache():
    pol = make_policy("least_loaded", rng=random.Random(0))
    loads = {"w0": WorkerLoad(queued_prefill_tokens=10), "w1": IDLE, "w2": WorkerLoad(running=1)}
    d = pol.pick(REQ, {"w0": Match(device=64)}, loads)
    assert d.worker_id == "w1" and d.reason == "least_loaded"


def test_decision_carries_every_candidates_terms():
    d = make_policy("round_robin").pick(REQ, {"w1": Match(device=10, host=4)}, idle())
    assert [c.worker_id for c in d.candidates] == list(W3)
    s = d.score("w1")
    assert s.cached_tokens == 14 * BS and s.recompute_tokens == 50 * BS
    assert s.fetch_cost == pytest.approx(CostModel().host_cost * 4 * BS)


def test_bad_inputs_name_the_value():
    with pytest.raises(ValueError, match="kv_usage"):
        WorkerLoad(kv_usage=1.5)
    with pytest.raises(ValueError, match="redis_cost"):
        CostModel(redis_cost=2.0)
    with pytest.raises(ValueError, match="do not fit"):
        RouteRequest(prompt_tokens=10, page_hashes=HASHES, block_size=BS)


def test_cost_model_from_bandwidth():
    c = CostModel.from_bandwidth(
        prefill_tokens_per_s=20_000,
        kv_bytes_per_token=128 * 1024,
        host_bytes_per_s=25e9,
        redis_bytes_per_s=10e9,
        peer_bytes_per_s=1e9,
    )
    assert c.host_cost == pytest.approx(128 * 1024 / 25e9 * 20_000)
    assert c.redis_cost == pytest.approx(0.262144)
    assert c.peer_cost == 1.0  # slower than recompute: capped
