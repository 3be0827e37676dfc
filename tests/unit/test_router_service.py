"""RouterCore: registration snapshots, the publish protocol (unknown / resync replies),
expiry and routing, without Ray or sockets."""

from __future__ import annotations

import pytest

from kvmesh.kvstore.events import BlockRemoved, BlockStored
from kvmesh.kvstore.hashing import hash_pages
from kvmesh.router import NoWorkerError
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
        "worker_id": wid, "name": name or wid, "address": f"{wid}:1", "model_fp": FP,
        "block_size": BS, "next_seq": next_seq, "pages": cached, "load": {}, **kw,
    }  # fmt: skip


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


def test_routing_prefers_the_cached_worker_and_honours_exclusions():
    core = RouterCore(model_fp=FP, seed=0)
    hs = pages(8)
    ids = list(range(8 * BS + 5))
    core.register(info("a", next_seq=8, cached=hs))
    core.register(info("b", next_seq=0, cached=[]))
    assert core.route(ids, hs).worker_id == "a"
    assert core.route(ids, hs, exclude=["a"]).worker_id == "b"
    with pytest.raises(NoWorkerError, match="excluded"):
        core.route(ids, hs, exclude=["a", "b"])
    core.set_policy("round_robin")
    assert {core.route(ids, hs).worker_id for _ in range(2)} == {"a", "b"}
    with pytest.raises(ValueError, match="accepted"):
        core.set_policy("nope")


def test_other_workers_pages_earn_peer_credit_and_name_the_peer():
    core = RouterCore(model_fp=FP)
    hs = pages(4)
    core.register(info("a", next_seq=4, cached=hs))
    core.register(info("b", next_seq=0, cached=[]))
    assert core.index.match(hs)["b"].peer == 4  # b could fetch a's pages
    core.set_policy("round_robin")
    ds = [core.route(list(range(4 * 16 + 1)), hs) for _ in range(2)]
    d = next(d for d in ds if d.worker_id == "b")
    assert core.peers_for(d) == [core.address_of("a")]
    assert core.peers_for(next(d for d in ds if d.worker_id == "a")) == []  # has them all
    # without peer fetch, another worker's pages are worth nothing and nobody is named
    off = RouterCore(model_fp=FP, peer_fetch=False)
    off.register(info("a", next_seq=4, cached=hs))
    off.register(info("b", next_seq=0, cached=[]))
    assert off.index.match(hs)["b"].pages == 0
    off.set_policy("round_robin")
    assert [off.peers_for(off.route(list(range(65)), hs)) for _ in range(2)] == [[], []]
