"""RouterCore: registration snapshots (by tier), the publish protocol (unknown / resync
replies), expiry, routing and the requests it counts in flight, without Ray or sockets."""

from __future__ import annotations

import pytest

from kvmesh.kvstore.events import BlockRemoved, BlockStored
from kvmesh.kvstore.hashing import hash_pages
from kvmesh.router import Match, NoWorkerError
from kvmesh.router.core import RouterCore as CoreModuleRouterCore
from kvmesh.router.service import RouterCore, decode_events, encode_event

FP = "unit-model"
BS = 16


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def pages(n: int, start: int = 0) -> list[bytes]:
    return hash_pages(list(range(start, start + n * BS)), BS, FP)


def info(wid: str, *, next_seq: int, cached: list[bytes], name: str | None = None, **kw) -> dict:
    return {
        "worker_id": wid,
        "name": name or wid,
        "address": f"{wid}:1",
        "model_fp": FP,
        "block_size": BS,
        "next_seq": next_seq,
        "pages": cached,
        "load": {},
        **kw,
    }


def stored(seq: int, h: bytes) -> tuple:
    return encode_event(BlockStored(seq, "x", h, None, (), BS))


def test_events_round_trip_without_tokens():
    h = pages(1)[0]
    evs = decode_events([stored(3, h), encode_event(BlockRemoved(4, "x", h, "host"))], "w", BS)
    assert evs == [BlockStored(3, "w", h, None, (), BS), BlockRemoved(4, "w", h, "host")]
    with pytest.raises(ValueError, match="event kind"):
        decode_events([(0, 7, h, "device")], "w", BS)


def test_a_snapshot_is_credited_and_the_stream_continues_after_it():
    core = RouterCore(model_fp=FP)
    hs = pages(4)
    # 4 pages cached, 6 events so far (two removals among them): stream continues at 6
    assert core.register(info("a", next_seq=6, cached=hs))["status"] == "ok"
    assert core.index.match(hs)["a"].device == 4
    more = pages(2, start=4 * BS)
    reply = core.publish("a", [stored(6, more[0]), stored(7, more[1])], {"running": 1})
    assert reply == {"router_id": core.router_id, "status": "ok"}
    assert core.index.num_pages("a", "device") == 6
    assert core.workers["a"].load.running == 1
    assert core.index.stats.restarts == core.index.stats.gaps == 0


def test_a_snapshot_from_seq_zero_counts_no_restart():
    core = RouterCore(model_fp=FP)
    hs = pages(3)
    core.register(info("a", next_seq=3, cached=hs))
    assert core.index.match(hs)["a"].device == 3
    assert core.publish("a", [stored(3, pages(1, 99)[0])], None)["status"] == "ok"
    assert core.index.stats.restarts == 0


def test_a_fresh_worker_waits_for_seq_zero_without_resyncing():
    core = RouterCore(model_fp=FP)
    core.register(info("a", next_seq=0, cached=[]))
    assert core.publish("a", [], {})["status"] == "ok"  # nothing published yet: no resync
    hs = pages(2)
    assert core.publish("a", [stored(0, hs[0]), stored(1, hs[1])], {})["status"] == "ok"
    assert core.index.match(hs)["a"].device == 2


def test_unknown_workers_and_gaps_are_told_to_register_again():
    core = RouterCore(model_fp=FP)
    assert core.publish("nobody", [], {})["status"] == "unknown"
    hs = pages(3)
    core.register(info("a", next_seq=1, cached=hs[:1]))
    assert core.publish("a", [stored(5, hs[1])], {})["status"] == "resync"  # seq 1..4 lost
    assert core.index.match(hs)["a"].device == 0  # dropped: under-credit, never over
    core.register(info("a", next_seq=7, cached=hs))
    assert core.publish("a", [], {})["status"] == "ok"
    assert core.index.match(hs)["a"].device == 3


def test_a_snapshot_larger_than_its_sequence_keeps_the_newest_pages():
    core = RouterCore(model_fp=FP)
    hs = pages(4)
    core.register(info("a", next_seq=2, cached=hs))
    assert core.index.num_pages("a", "device") == 2


def test_workers_must_serve_the_routers_model_and_block_size():
    core = RouterCore(model_fp=FP)
    with pytest.raises(ValueError, match="fingerprint"):
        core.register({**info("a", next_seq=0, cached=[]), "model_fp": "other"})
    core.register(info("a", next_seq=0, cached=[]))
    with pytest.raises(ValueError, match="block_size"):
        core.register({**info("b", next_seq=0, cached=[]), "block_size": 32})


def test_a_restarted_worker_replaces_its_old_incarnation():
    core = RouterCore(model_fp=FP)
    hs = pages(2)
    core.register(info("w0-aaa", name="w0", next_seq=2, cached=hs))
    core.register(info("w0-bbb", name="w0", next_seq=0, cached=[]))
    assert list(core.workers) == ["w0-bbb"]
    assert "w0-aaa" not in core.index.workers()
    assert core.removed[-1]["worker_id"] == "w0-aaa"


def test_silent_workers_expire():
    clock = Clock()
    core = RouterCore(model_fp=FP, report_timeout_s=4.0, clock=clock)
    core.register(info("a", next_seq=0, cached=[]))
    core.register(info("b", next_seq=0, cached=[]))
    clock.t += 3.0
    core.publish("a", [], {})
    clock.t += 2.0
    assert core.expire() == ["b"]
    assert list(core.workers) == ["a"] and core.index.workers() == ["a"]


def test_the_service_module_still_exports_the_core():
    assert RouterCore is CoreModuleRouterCore


def test_routing_prefers_the_cached_worker_and_honours_exclusions():
    core = RouterCore(model_fp=FP, seed=0)
    hs = pages(8)
    ids = list(range(8 * BS + 5))
    core.register(info("a", next_seq=8, cached=hs))
    core.register(info("b", next_seq=0, cached=[]))
    assert core.assign("r1", ids, hs).worker_id == "a"
    assert core.assign("r2", ids, hs, exclude=["a"]).worker_id == "b"
    with pytest.raises(NoWorkerError, match="excluded"):
        core.assign("r3", ids, hs, exclude=["a", "b"])
    core.set_policy("round_robin")
    assert {core.assign(f"rr{i}", ids, hs).worker_id for i in range(2)} == {"a", "b"}
    with pytest.raises(ValueError, match="accepted"):
        core.set_policy("nope")


def test_other_workers_pages_earn_peer_credit_and_name_the_peer():
    core = RouterCore(model_fp=FP)
    hs = pages(4)
    core.register(info("a", next_seq=4, cached=hs))
    core.register(info("b", next_seq=0, cached=[]))
    assert core.index.match(hs)["b"].peer == 4  # b could fetch a's pages
    core.set_policy("round_robin")
    ds = [core.assign(f"r{i}", list(range(4 * 16 + 1)), hs) for i in range(2)]
    d = next(d for d in ds if d.worker_id == "b")
    assert core.peers_for(d) == [core.address_of("a")]
    assert core.peers_for(next(d for d in ds if d.worker_id == "a")) == []  # has them all
    # without peer fetch, another worker's pages are worth nothing and nobody is named
    off = RouterCore(model_fp=FP, peer_fetch=False)
    off.register(info("a", next_seq=4, cached=hs))
    off.register(info("b", next_seq=0, cached=[]))
    assert off.index.match(hs)["b"].pages == 0
    off.set_policy("round_robin")
    assert [off.peers_for(off.assign(f"r{i}", list(range(65)), hs)) for i in range(2)] == [[], []]


# ------------------------------------------------------------ pages by tier


def test_a_snapshot_credits_host_pages_as_host():
    core = RouterCore(model_fp=FP, peer_fetch=False)
    dev, host = pages(2), pages(4)[2:]  # one prefix: 2 pages on device, the next 2 in host
    core.register(info("a", next_seq=4, cached={"device": dev, "host": host}))
    core.register(info("b", next_seq=0, cached=[]))
    assert core.index.match(pages(4))["a"] == Match(device=2, host=2)
    assert core.stats()["workers"]["a"]["index_pages"] == {"device": 2, "host": 2, "redis": 0}
    # the prefix's pages in host still bring the request to a, not to the idle cold b
    assert core.assign("r", list(range(4 * BS + 3)), pages(4)).worker_id == "a"
    with pytest.raises(ValueError, match="accepted: redis, host, device"):
        core.register(info("c", next_seq=1, cached={"disk": pages(1)}))


def test_host_tier_events_move_a_prefix_between_tiers():
    core = RouterCore(model_fp=FP, peer_fetch=False)
    hs = pages(3)
    core.register(info("a", next_seq=3, cached={"device": hs}))
    # the device evicts the prefix into the host tier: removed(device), stored(host)
    rows = [encode_event(BlockRemoved(3 + i, "x", h)) for i, h in enumerate(hs)]
    rows += [
        encode_event(BlockStored(6 + i, "x", h, None, (), 0, "host")) for i, h in enumerate(hs)
    ]
    assert core.publish("a", rows, None)["status"] == "ok"
    assert core.index.match(hs)["a"] == Match(host=3)
    # a snapshot taken now carries the same state
    again = RouterCore(model_fp=FP, peer_fetch=False)
    again.register(info("a", next_seq=9, cached={"device": [], "host": hs}))
    assert again.index.match(hs)["a"] == Match(host=3)


# ------------------------------------------------------------ requests in flight


def prompt(tenant: int, n_pages: int = 8) -> tuple[list[int], list[bytes]]:
    ids = list(range(tenant * 10_000, tenant * 10_000 + n_pages * BS + 7))
    return ids, hash_pages(ids, BS, FP)


@pytest.mark.parametrize("n_workers", [2, 4])
def test_concurrent_cold_requests_with_different_prefixes_go_to_different_idle_workers(
    n_workers,
):
    # Every worker reports idle and no report arrives in between: only the router's own
    # count of what it routed can spread the burst. Seeds vary the random tie-breaks.
    for seed in range(20):
        core = RouterCore(model_fp=FP, seed=seed)
        for w in range(n_workers):
            core.register(info(f"w{w}", next_seq=0, cached=[]))
        chosen = [core.assign(f"r{t}", *prompt(t)).worker_id for t in range(n_workers)]
        assert sorted(chosen) == sorted(core.workers), (seed, chosen)


def test_in_flight_requests_charge_prefill_until_the_first_token_then_decode_until_release():
    core = RouterCore(model_fp=FP, seed=0)
    cached = pages(8)
    core.register(info("a", next_seq=8, cached=cached))
    ids = list(range(8 * BS + 5))
    core.assign("r1", ids, cached)  # 8 pages cached at a: 5 tokens to compute
    assert core.stats()["workers"]["a"]["in_flight"] == {"requests": 1, "prefill_tokens": 5}
    cold_ids, cold = prompt(1)
    core.assign("r2", cold_ids, cold)
    assert core.inflight.of("a").prefill_tokens == 5 + len(cold_ids)
    assert core.load_of("a").running == 2
    assert core.load_of("a").queued_prefill_tokens == 5 + len(cold_ids)
    core.first_token("r2")
    core.first_token("r2")  # idempotent
    assert core.load_of("a").queued_prefill_tokens == 5 and core.load_of("a").running == 2
    core.release("r1")
    core.release("r2")
    core.release("r2")  # a second close is ignored
    assert core.load_of("a") == core.workers["a"].load
    assert len(core.inflight) == 0


def test_a_retried_request_moves_its_charge_and_a_removed_worker_takes_its_charges():
    core = RouterCore(model_fp=FP, seed=0)
    core.register(info("a", next_seq=0, cached=[]))
    core.register(info("b", next_seq=0, cached=[]))
    ids, hs = prompt(0)
    first = core.assign("r", ids, hs).worker_id
    other = "b" if first == "a" else "a"
    assert core.assign("r", ids, hs, exclude=[first]).worker_id == other
    assert core.inflight.of(first).requests == 0 and core.inflight.of(other).requests == 1
    core.remove_worker(other, "test")
    assert len(core.inflight) == 0


def test_a_report_of_more_work_than_the_router_sent_still_counts():
    # b is busy with work the router did not send (another router, a direct client): its
    # report wins over the router's empty count, and a cold request goes to a.
    core = RouterCore(model_fp=FP, seed=0)
    core.register(info("a", next_seq=0, cached=[]))
    core.register(info("b", next_seq=0, cached=[]))
    core.publish("b", [], {"running": 3, "queued_prefill_tokens": 4000})
    for t in range(5):
        ids, hs = prompt(t)
        assert core.assign(f"r{t}", ids, hs).worker_id == "a"
        core.release(f"r{t}")
    # and the router's own count wins over an older, smaller report
    core.publish("b", [], {"running": 0, "queued_prefill_tokens": 0})
    ids, hs = prompt(9)
    d = core.assign("x", ids, hs)
    assert core.load_of(d.worker_id).queued_prefill_tokens == len(ids)


def test_a_busy_cached_worker_keeps_a_request_only_while_its_queue_is_shorter_than_the_saving():
    core = RouterCore(model_fp=FP, seed=0, peer_fetch=False)  # b could not fetch a's pages
    ids, hs = prompt(0, n_pages=32)  # 519 tokens, 512 of them cached at a
    core.register(info("a", next_seq=32, cached=hs))
    core.register(info("b", next_seq=0, cached=[]))
    # a is busy with two cold 263-token prompts: waiting behind them costs less than the
    # 512 tokens its cache saves
    for i in range(2):
        core.assign(f"busy{i}", *prompt(1 + i, n_pages=16), exclude=["b"])
    assert core.assign("r1", ids, hs).worker_id == "a"
    core.release("r1")
    # eight cold prompts queued there (8 x 263 > 4 x 512), and b sits idle
    for i in range(2, 8):
        core.assign(f"busy{i}", *prompt(1 + i, n_pages=16), exclude=["b"])
    assert core.assign("r2", ids, hs).worker_id == "b"
