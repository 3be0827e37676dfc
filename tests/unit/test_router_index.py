"""router.prefix_index: event semantics, resync, match by tier, optimistic entries."""

from __future__ import annotations

import pytest

from kvmesh.kvstore.events import BlockRemoved, BlockStored
from kvmesh.kvstore.hashing import hash_pages
from kvmesh.router.prefix_index import Match, PrefixIndex

FP = "router-test-fp"
BS = 4
# Two prompts sharing their first 3 pages, then diverging at page 3.
PROMPT_A = list(range(1000, 1000 + 6 * BS))
PROMPT_B = PROMPT_A[: 3 * BS] + list(range(5000, 5000 + 3 * BS))
A = hash_pages(PROMPT_A, BS, FP)
B = hash_pages(PROMPT_B, BS, FP)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Feeder:
    """Numbers one engine's events like EventLog does."""

    def __init__(self, index: PrefixIndex, worker: str, engine_id: str = "e0") -> None:
        self.index, self.worker, self.engine_id, self.seq = index, worker, engine_id, 0

    def _next(self) -> int:
        self.seq += 1
        return self.seq - 1

    def store(self, hashes, tier: str = "device") -> None:
        parent = None
        for h in hashes:
            ev = BlockStored(self._next(), self.engine_id, h, parent, (), BS, tier)
            self.index.apply(self.worker, ev)
            parent = h

    def remove(self, hashes, tier: str = "device") -> None:
        for h in hashes:
            self.index.apply(self.worker, BlockRemoved(self._next(), self.engine_id, h, tier))


def test_prompts_share_exactly_three_pages():
    assert A[:3] == B[:3] and A[3] != B[3] and len(A) == len(B) == 6


def test_stored_and_removed_by_tier():
    idx = PrefixIndex()
    w = Feeder(idx, "w0")
    w.store(A[:4], "device")
    w.store(A[4:], "host")
    assert idx.match(A)["w0"] == Match(device=4, host=2)
    assert idx.num_pages("w0", "device") == 4 and idx.num_pages("w0", "host") == 2

    w.remove(A[3:4], "device")  # page 3 gone from device and nowhere else: the run stops
    assert idx.match(A)["w0"] == Match(device=3)
    w.store(A[3:4], "host")  # spilled to host: the run reaches the end again
    assert idx.match(A)["w0"] == Match(device=3, host=3)
    w.remove(A[:1], "device")  # the first page is gone: nothing matches from the start
    assert idx.match(A)["w0"] == Match()
    assert idx.stats.gaps == 0 and idx.stats.restarts == 0


def test_page_in_two_tiers_counts_once_in_the_cheaper():
    idx = PrefixIndex()
    w = Feeder(idx, "w0")
    w.store(A[:2], "host")
    w.store(A[:2], "device")
    assert idx.match(A)["w0"] == Match(device=2)
    w.remove(A[:2], "device")
    assert idx.match(A)["w0"] == Match(host=2)


def test_match_on_prefix_that_diverges_midway():
    idx = PrefixIndex(peer_tiers={"host"})  # device pages not peer-visible: own matches only
    Feeder(idx, "w0").store(A)
    Feeder(idx, "w1").store(B)
    m = idx.match(A)
    assert m["w0"] == Match(device=6)
    assert m["w1"] == Match(device=3)  # B leaves A at page 3
    assert idx.match(B) == {"w0": Match(device=3), "w1": Match(device=6)}
    # A prompt that shares no first page matches nothing anywhere.
    other = hash_pages([7] * (4 * BS), BS, FP)
    assert idx.match(other) == {"w0": Match(), "w1": Match()}


def test_match_is_consecutive_from_the_start():
    idx = PrefixIndex()
    Feeder(idx, "w0").store([A[0], A[1], A[3], A[4]])  # hole at page 2
    assert idx.match(A)["w0"] == Match(device=2)


def test_redis_pages_are_visible_to_every_worker():
    idx = PrefixIndex(peer_tiers={"host"})
    w0, w1 = Feeder(idx, "w0"), Feeder(idx, "w1")
    w0.store(A[:2], "device")
    w0.store(A[:5], "redis")
    w1.store(B[:1], "device")
    m = idx.match(A)
    assert m["w0"] == Match(device=2, redis=3)
    assert m["w1"] == Match(device=1, redis=4)
    # One Redis key serves everyone: removed by any worker, gone for all.
    w1.remove(A[4:5], "redis")
    assert idx.match(A) == {"w0": Match(device=2, redis=2), "w1": Match(device=1, redis=3)}


def test_redis_pages_of_a_dropped_worker_disappear_unless_another_reported_them():
    idx = PrefixIndex()
    Feeder(idx, "w0").store(A[:3], "redis")
    Feeder(idx, "w1").store(A[:1], "redis")
    idx.add_worker("w2")
    assert idx.match(A)["w2"] == Match(redis=3)
    idx.remove_worker("w0")
    assert idx.match(A)["w2"] == Match(redis=1)


def test_other_workers_device_and_host_pages_are_peer_hits():
    idx = PrefixIndex()  # default: device and host of another worker are peer-reachable
    w0 = Feeder(idx, "w0")
    w0.store(A[:2], "device")
    w0.store(A[2:3], "host")
    Feeder(idx, "w1").store(A[:1], "device")
    m = idx.match(A)
    assert m["w0"] == Match(device=2, host=1)
    assert m["w1"] == Match(device=1, peer=2)
    host_only = PrefixIndex(peer_tiers={"host"})
    Feeder(host_only, "w0").store(A[:2], "device")
    host_only.add_worker("w1")
    assert host_only.match(A)["w1"] == Match()


def test_sequence_gap_drops_the_worker_until_seq_zero():
    idx = PrefixIndex()
    w = Feeder(idx, "w0")
    w.store(A[:3])
    Feeder(idx, "w1").store(A[:1])
    w.seq += 1  # one event lost
    w.store(A[3:4])
    assert idx.is_resyncing("w0")
    assert idx.num_pages("w0", "device") == 0
    assert idx.match(A)["w0"] == Match(device=0, peer=1)  # only w1's page, as a peer hit
    assert idx.stats.gaps == 1
    w.store(A[4:5])  # still resyncing: ignored, even though it follows the bad one
    assert idx.num_pages("w0", "device") == 0
    # A fresh stream (seq 0) is trusted again.
    w.seq = 0
    w.store(A[:2])
    assert not idx.is_resyncing("w0")
    assert idx.match(A)["w0"] == Match(device=2)


def test_restart_with_new_engine_id_drops_the_worker():
    idx = PrefixIndex()
    Feeder(idx, "w0", "old").store(A)
    assert idx.match(A)["w0"] == Match(device=6)
    new = Feeder(idx, "w0", "new")
    new.seq = 6  # a new engine whose seq happens to continue: still a restart
    new.store(A[:1])
    assert idx.is_resyncing("w0") and idx.stats.restarts == 1
    assert idx.match(A)["w0"] == Match()


def test_restart_with_seq_going_back_drops_the_worker():
    idx = PrefixIndex()
    w = Feeder(idx, "w0")
    w.store(A)
    w.seq = 2
    w.store(A[:1])
    assert idx.is_resyncing("w0") and idx.match(A)["w0"] == Match()


def test_restart_at_seq_zero_starts_afresh_and_forgets_old_pages():
    idx = PrefixIndex()
    Feeder(idx, "w0", "old").store(A)
    Feeder(idx, "w0", "new").store(B[:2])  # seq 0 of a new engine: a clean restart
    assert not idx.is_resyncing("w0")
    assert idx.match(A)["w0"] == Match(device=2)  # B[:2] == A[:2]; A[2:] was lost
    assert idx.match(B)["w0"] == Match(device=2)
    assert idx.stats.restarts == 1


def test_late_joining_worker_is_ignored_until_reset():
    idx = PrefixIndex()
    idx.apply("w0", BlockStored(41, "e0", A[0], None, (), BS, "device"))
    assert idx.is_resyncing("w0") and idx.match(A)["w0"] == Match()
    idx.reset("w0", "e0", next_seq=42)
    idx.apply("w0", BlockStored(42, "e0", A[0], None, (), BS, "device"))
    assert idx.match(A)["w0"] == Match(device=1)


def test_dropping_a_worker_removes_its_peer_holdings():
    idx = PrefixIndex()
    w0 = Feeder(idx, "w0")
    w0.store(A[:3])
    idx.add_worker("w1")
    assert idx.match(A)["w1"] == Match(peer=3)
    w0.seq += 5
    w0.store(A[3:4])  # gap on w0
    assert idx.match(A)["w1"] == Match()
    Feeder(idx, "w2").store(A[:2])
    idx.remove_worker("w2")
    assert idx.match(A) == {"w0": Match(), "w1": Match()}


def test_unknown_tier_is_rejected():
    idx = PrefixIndex()
    with pytest.raises(ValueError, match="accepted: device, host, redis, peer"):
        idx.apply("w0", BlockStored(0, "e0", A[0], None, (), BS, "disk"))


def test_optimistic_entries_match_then_expire():
    clock = Clock()
    idx = PrefixIndex(optimistic_ttl_s=2.0, clock=clock)
    idx.add_worker("w1")
    idx.insert_optimistic("w0", A)
    assert idx.match(A)["w0"] == Match(device=6)
    # Not real yet, so no other worker may count it as a peer page.
    assert idx.match(A)["w1"] == Match()
    clock.t += 1.9
    assert idx.match(A)["w0"] == Match(device=6)
    clock.t += 0.2
    assert idx.match(A)["w0"] == Match()
    assert idx.stats.optimistic_expired == 6


def test_optimistic_entries_confirmed_by_events_do_not_expire():
    clock = Clock()
    idx = PrefixIndex(optimistic_ttl_s=1.0, clock=clock)
    idx.insert_optimistic("w0", A)
    Feeder(idx, "w0").store(A[:4])  # the engine cached 4 of the 6 pages
    idx.add_worker("w1")
    assert idx.match(A)["w1"] == Match(peer=4)  # confirmed pages are real, peers see them
    clock.t += 5
    assert idx.match(A)["w0"] == Match(device=4)
    assert idx.stats.optimistic_confirmed == 4


def test_optimistic_reinsert_extends_expiry():
    clock = Clock()
    idx = PrefixIndex(optimistic_ttl_s=1.0, clock=clock)
    idx.insert_optimistic("w0", A[:2])
    clock.t += 0.8
    idx.insert_optimistic("w0", A[:1])
    clock.t += 0.5
    assert idx.match(A)["w0"] == Match(device=1)


def test_match_of_long_prompt():
    """1,024 pages (a 16K-token prompt), 8 workers; one holds it all, two hold a quarter.
    Speed is measured in bench/, not asserted here."""
    tokens = [(i * 7919) % 50_000 for i in range(16 * 1024)]
    hashes = hash_pages(tokens, 16, FP)
    idx = PrefixIndex(peer_tiers={"host"})
    for w in range(8):
        held = hashes if w == 0 else hashes[:256] if w < 3 else []
        for seq, h in enumerate(held):
            idx.apply(w, BlockStored(seq, "e", h, None, (), 16, "device"))
        if not held:
            idx.add_worker(w)
    m = idx.match(hashes)
    assert m[0] == Match(device=1024) and m[1] == Match(device=256) and m[7] == Match()


def test_optimistic_entries_survive_a_gap_but_not_a_restart():
    idx = PrefixIndex(clock=Clock())
    w = Feeder(idx, "w0")
    w.store(B)
    idx.insert_optimistic("w0", A[3:5])  # A[3:] is not in B
    w.seq += 3
    w.store(B[:1])  # gap: real pages dropped, the request just routed there is still there
    assert idx.num_pages("w0", "device") == 2
    assert idx.match(A[3:])["w0"] == Match(device=2)
    assert idx.match(B)["w0"] == Match()
    Feeder(idx, "w0", "new").store(B[3:4])  # a new engine: everything goes
    assert idx.num_pages("w0", "device") == 1
    assert idx.match(A)["w0"] == Match()


def _reference_match(index: PrefixIndex, hashes) -> dict:
    """The plain per-worker walk over the index's bookkeeping sets (the masks' meaning)."""
    out = {}
    for wid, w in index._workers.items():
        n = [0, 0, 0, 0]
        for h in hashes:
            if h in w.device or h in w.optimistic:
                n[0] += 1
            elif h in w.host:
                n[1] += 1
            elif h in index._redis:
                n[2] += 1
            elif h in index._peer_holders or h in w.peer:
                n[3] += 1
            else:
                break
        out[wid] = Match(*n)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_match_equals_a_per_worker_walk_under_random_events(seed):
    # Random stores, removals, gaps, restarts, optimistic inserts, expiries and worker
    # removals: the per-page worker masks must stay in step with the per-worker sets, and
    # match must equal the straightforward per-worker walk.
    import random

    rng = random.Random(seed)
    clock = Clock()
    index = PrefixIndex(optimistic_ttl_s=1.0, clock=clock)
    # a small universe of chained prompts sharing prefixes, so runs and tier changes overlap
    prompts = [
        hash_pages([p % 3] * BS + list(range(p * 97, p * 97 + 11 * BS)), BS, FP) for p in range(6)
    ]
    pages = [h for p in prompts for h in p]
    seqs: dict[str, int] = {}
    engines: dict[str, str] = {}
    for _ in range(600):
        wid = f"w{rng.randrange(5)}"
        op = rng.random()
        if op < 0.45:
            tier = rng.choice(["device", "device", "host", "redis", "peer"])
            cls = BlockStored if rng.random() < 0.7 else BlockRemoved
            seq = seqs.get(wid, 0)
            if rng.random() < 0.03:
                seq += 2  # a gap
            eng = engines.setdefault(wid, "e0")
            if cls is BlockStored:
                ev = BlockStored(seq, eng, rng.choice(pages), None, (), BS, tier)
            else:
                ev = BlockRemoved(seq, eng, rng.choice(pages), tier)
            index.apply(wid, ev)
            seqs[wid] = seq + 1
        elif op < 0.6:
            index.insert_optimistic(wid, prompts[rng.randrange(6)][: rng.randrange(1, 12)])
        elif op < 0.63:
            engines[wid] = f"e{rng.randrange(100)}"  # restart: next event starts at seq 0
            seqs[wid] = 0
        elif op < 0.65:
            index.remove_worker(wid)
            seqs[wid] = 0
        else:
            clock.t += rng.random() * 0.5
        prompt = prompts[rng.randrange(6)][: rng.randrange(12)]
        got = index.match(prompt)
        assert got == _reference_match(index, prompt)
        # the packed per-page state is exactly what the bookkeeping sets say
        derived: dict[bytes, int] = {}
        for h in index._redis:
            derived[h] = derived.get(h, 0) | 1
        for h in index._peer_holders:
            derived[h] = derived.get(h, 0) | 2
        for w in index._workers.values():
            for bit, tier in ((1, "device"), (2, "host"), (4, "peer")):
                for h in w.tier_set(tier):
                    derived[h] = derived.get(h, 0) | bit << w.shift
        assert index._state == derived
        opt: dict[bytes, int] = {}
        for w in index._workers.values():
            assert not (w.device & w.optimistic.keys())
            for h in w.optimistic:
                opt[h] = opt.get(h, 0) | 1 << w.shift
        assert index._opt_state == opt
