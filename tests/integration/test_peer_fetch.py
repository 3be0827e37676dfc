"""KVTransfer over real loopback sockets, served from a HostTier: pages bigger than a chunk
round-trip byte-identical, Push validates before storing, and PeerTier turns a dead peer into
misses (one warning per incident) instead of errors, over the data plane and over Fetch,
within one deadline per get."""

from __future__ import annotations

import logging
import threading
import time
import zlib

import grpc
import pytest
from helpers import TEST_IDENTITY as ID
from helpers import free_port, member_channel

from kvmesh.kvstore.codec import PageSpec, encode
from kvmesh.kvstore.host import HostTier
from kvmesh.kvstore.peer import (
    MAX_CHUNK_BYTES,
    PageAssembler,
    PeerTier,
    TierPageSource,
    page_chunks,
    valid_pushes,
)
from kvmesh.protos.kvmesh.v1 import kv_transfer_pb2 as pb
from kvmesh.protos.kvmesh.v1 import kv_transfer_pb2_grpc as pb_grpc
from kvmesh.worker.server import WorkerServer

# a page object bigger than two chunks, as an fp32 page of a larger model would be
SPEC = PageSpec(
    model_fp="ab12",
    cache_format="fp32",
    num_layers=4,
    num_kv_heads=8,
    head_size=128,
    block_size=80,
    page_nbytes=4 * 2 * 80 * 8 * 128 * 4,
)
OTHER_MODEL = PageSpec(**{**SPEC.__dict__, "model_fp": "cd34"})


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def page(i: int, spec: PageSpec = SPEC) -> bytes:
    """A valid page object whose payload depends on ``i``."""
    return encode(spec, (i.to_bytes(4, "little") * (spec.page_nbytes // 4))[: spec.page_nbytes])


@pytest.fixture(params=[True, False], ids=["data_plane", "grpc"])
def data_plane(request) -> bool:
    """PeerTier's transport: the worker's raw-TCP data plane, or gRPC Fetch only."""
    return request.param


def transport_pages(peer: PeerTier) -> int:
    """Pages delivered over the transport the test asked for (the other one delivers none)."""
    used, unused = ("data_plane_pages", "grpc_pages")
    if not peer.data_plane:
        used, unused = unused, used
    assert peer.metrics[unused] == 0, peer.metrics
    return peer.metrics[used]


@pytest.fixture(scope="module")
def host() -> HostTier:
    return HostTier(64 << 20)


@pytest.fixture(scope="module")
def server(host):
    srv = WorkerServer(page_source=TierPageSource(host, spec=SPEC), grace_s=1.0, identity=ID)
    srv.start_in_thread()
    yield srv
    srv.stop_in_thread(grace=0)


@pytest.fixture(scope="module")
def stub(server):
    with member_channel(server.address) as ch:  # as a cluster member
        yield pb_grpc.KVTransferStub(ch)


def test_page_objects_are_bigger_than_a_chunk():
    assert len(page(1)) > 2 * MAX_CHUNK_BYTES


def test_lookup_names_the_tier(host, stub):
    host.put([(h(1), page(1)), (h(2), page(2))])
    resp = stub.Lookup(pb.LookupRequest(hashes=[h(2), h(99), h(1)]))
    assert list(resp.tiers) == ["host", "", "host"]


def test_fetch_streams_chunks_of_at_most_1mib_and_reassembles_byte_identical(host, stub):
    objs = {i: page(i) for i in (3, 4, 5)}
    host.put([(h(i), o) for i, o in objs.items()])
    asked = [h(3), h(98), h(4), h(5)]
    chunks = list(stub.Fetch(pb.FetchRequest(hashes=asked)))
    assert all(c.ByteSize() <= MAX_CHUNK_BYTES for c in chunks)
    assert len(chunks) >= 3 * (len(objs[3]) // MAX_CHUNK_BYTES)
    asm, got, missing = PageAssembler(), {}, []
    for c in chunks:
        for p in c.pieces:
            assert p.hash == asked[p.index]
            done = asm.add(p.index, p)
            if done is not None:
                (got.__setitem__(p.index, done[1]) if done[0] else missing.append(p.index))
    assert missing == [1]
    assert got == {0: objs[3], 2: objs[4], 3: objs[5]}
    assert asm.corrupt == 0 and asm.incomplete() == []


def test_small_pages_share_a_chunk():
    pages = [(i, h(i), bytes([i]) * 1000) for i in range(50)]
    chunks = list(page_chunks(pages))
    assert len(chunks) == 1 and len(chunks[0].pieces) == 50


def test_assembler_drops_a_corrupted_object():
    obj = page(7)
    pieces = [p for c in page_chunks([(0, h(7), obj)]) for p in c.pieces]
    assert len(pieces) >= 3
    pieces[1].data = bytes([pieces[1].data[0] ^ 0xFF]) + pieces[1].data[1:]
    asm = PageAssembler()
    results = [asm.add(0, p) for p in pieces]
    assert results[-1] == (False, None) and all(r is None for r in results[:-1])
    assert asm.corrupt == 1
    # a piece out of order is dropped as well, at once
    asm2 = PageAssembler()
    pieces = [p for c in page_chunks([(0, h(7), obj)]) for p in c.pieces]
    assert asm2.add(0, pieces[1]) == (False, None) and asm2.corrupt == 1


def test_malformed_hash_is_invalid_argument(stub):
    with pytest.raises(grpc.RpcError) as e:
        stub.Lookup(pb.LookupRequest(hashes=[b"short"]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "16 bytes" in e.value.details()


def test_a_lookup_or_fetch_of_too_many_pages_is_invalid_argument(stub):
    from kvmesh.kvstore.peer.servicer import MAX_LOOKUP_PAGES

    at_limit = [h(i) for i in range(MAX_LOOKUP_PAGES)]
    assert len(stub.Lookup(pb.LookupRequest(hashes=at_limit)).tiers) == MAX_LOOKUP_PAGES
    too_many = at_limit + [h(MAX_LOOKUP_PAGES)]
    for call in (
        lambda: stub.Lookup(pb.LookupRequest(hashes=too_many)),
        lambda: list(stub.Fetch(pb.FetchRequest(hashes=too_many))),
    ):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"at most {MAX_LOOKUP_PAGES}" in e.value.details()


def test_push_stores_valid_pages_and_rejects_the_rest(host, server):
    good = {i: page(i) for i in (10, 11)}
    foreign = page(12, OTHER_MODEL)  # a valid object of another model
    peer = PeerTier(server.address, identity=ID)
    try:
        accepted = peer.push([(h(10), good[10]), (h(12), foreign), (h(11), good[11])])
    finally:
        peer.close()
    assert accepted == 2
    assert host.get([h(10), h(11)]) == [good[10], good[11]]
    assert host.contains([h(12)]) == [False]


def test_push_with_a_torn_object_rejects_it(host, stub):
    obj = page(13)
    pieces = [p for c in page_chunks([(0, h(13), obj)]) for p in c.pieces]
    torn = pb.PageChunk(pieces=pieces[:-1])  # the stream ends before the last piece
    bad_crc = pb.PageChunk(
        pieces=[pb.PagePiece(hash=h(14), found=True, total_size=3, data=b"abc", crc32=1)]
    )
    resp = stub.Push(iter([torn, bad_crc]))
    assert (resp.accepted, resp.rejected) == (0, 2)
    assert host.contains([h(13), h(14)]) == [False, False]


def test_only_page_objects_of_the_spec_under_page_hashes_are_valid_pushes():
    items = [
        (h(1), page(1)),
        (b"short", page(2)),  # not a page hash
        (h(3), page(3, OTHER_MODEL)),  # a valid object of another model
        (h(4), b"junk"),
        (h(5), page(5)),
    ]
    assert valid_pushes(items, SPEC) == [items[0], items[4]]
    # without a spec: any codec object, still under a page hash
    assert valid_pushes(items, None) == [items[0], items[2], items[4]]


def test_peer_tier_contains_and_get_against_a_live_peer(host, server, data_plane):
    objs = {i: page(i) for i in (20, 21)}
    host.put([(h(i), o) for i, o in objs.items()])
    peer = PeerTier(server.address, data_plane=data_plane, identity=ID)
    try:
        assert peer.contains([h(20), h(97), h(21)]) == [True, False, True]
        assert peer.get([h(21), h(97), h(20)]) == [objs[21], None, objs[20]]
        assert peer.metrics["hits"] == 2 and peer.metrics["misses"] == 1
        assert peer.metrics["errors"] == 0 and transport_pages(peer) == 2
        peer.put([(h(22), page(22))])  # no push unless asked for
        peer.evict([h(20)])  # another worker's cache is not ours to evict
        assert host.contains([h(22), h(20)]) == [False, True]
    finally:
        peer.close()


def test_dead_peer_is_misses_with_one_warning(caplog, host, server, data_plane):
    host.put([(h(30), page(30))])
    dead = f"127.0.0.1:{free_port()}"
    peer = PeerTier(
        [dead, server.address], timeout=2.0, cooldown_s=0.0, data_plane=data_plane, identity=ID
    )
    try:
        with caplog.at_level(logging.WARNING, logger="kvmesh.kvstore.peer"):
            for _ in range(3):
                assert peer.contains([h(30), h(96)]) == [True, False]
                assert peer.get([h(30)]) == [host.get([h(30)])[0]]
        warnings = [r for r in caplog.records if dead in r.getMessage()]
        assert len(warnings) == 1
        assert peer.metrics["errors"] == 6 and transport_pages(peer) == 3
    finally:
        peer.close()
    lone = PeerTier(dead, timeout=1.0, data_plane=data_plane, identity=ID)
    try:
        assert lone.contains([h(30)]) == [False]
        assert lone.get([h(30), h(31)]) == [None, None]  # in cooldown: not even asked
        assert lone.metrics["errors"] == 1 and lone.metrics["misses"] == 2
        assert lone.push([(h(30), page(30))]) == 0
    finally:
        lone.close()


def test_crc_is_of_the_whole_object(host, stub):
    obj = page(40)
    host.put([(h(40), obj)])
    pieces = [p for c in stub.Fetch(pb.FetchRequest(hashes=[h(40)])) for p in c.pieces]
    assert {p.crc32 for p in pieces} == {zlib.crc32(obj)}
    assert {p.total_size for p in pieces} == {len(obj)}
    assert [p.offset for p in pieces] == sorted(p.offset for p in pieces)


class FaultySource(TierPageSource):
    """Serves its tier, but stalls (``delay``) or raises after the first ``ok_calls`` fetches."""

    def __init__(self, tier: HostTier, *, delay: float = 0.0, ok_calls: int | None = None):
        super().__init__(tier)
        self.delay, self.ok_calls, self.calls = delay, ok_calls, 0

    def fetch(self, hashes):
        self.calls += 1
        if self.ok_calls is not None and self.calls > self.ok_calls:
            raise OSError("disk on fire")
        time.sleep(self.delay)
        return super().fetch(hashes)


@pytest.fixture
def faulty():
    tier = HostTier(256 << 20)
    source = FaultySource(tier)
    srv = WorkerServer(page_source=source, identity=ID)
    srv.start_in_thread()
    yield tier, source, srv.address
    srv.stop_in_thread(grace=0)


def test_a_peer_past_its_deadline_is_a_miss(faulty, caplog, data_plane):
    tier, source, address = faulty
    tier.put([(h(50), page(50))])
    source.delay = 1.5
    peer = PeerTier(address, timeout=0.3, data_plane=data_plane, identity=ID)
    try:
        with caplog.at_level(logging.WARNING, logger="kvmesh.kvstore.peer"):
            assert peer.get([h(50)]) == [None]  # the 0.3 s deadline, not the 1.5 s reply
        assert peer.metrics["errors"] == 1 and peer.metrics["data_plane_fallbacks"] == 0
        assert any("DEADLINE_EXCEEDED" in r.getMessage() for r in caplog.records)
    finally:
        peer.close()


class SlowThenFailingSource(TierPageSource):
    """Each fetch takes ``delay``; the first one then fails (the data plane closes before
    any page, so PeerTier falls back to Fetch), the next ones serve their tier."""

    def __init__(self, tier: HostTier, delay: float):
        super().__init__(tier)
        self.delay, self.calls = delay, 0

    def fetch(self, hashes):
        self.calls += 1
        time.sleep(self.delay)
        if self.calls == 1:
            raise OSError("disk on fire")
        return super().fetch(hashes)


def test_a_fetch_fallback_gets_only_what_is_left_of_the_deadline(caplog):
    """One deadline per get(): 0.7 s spent on the data plane leaves 0.3 s of the 1.0 s for
    Fetch, whose source needs 0.7 s, so the page is a miss (it would have arrived had Fetch
    been given a deadline of its own)."""
    tier = HostTier(64 << 20)
    tier.put([(h(1), page(1))])
    source = SlowThenFailingSource(tier, delay=0.7)
    srv = WorkerServer(page_source=source, identity=ID)
    srv.start_in_thread()
    peer = PeerTier(srv.address, timeout=1.0, identity=ID)
    try:
        with caplog.at_level(logging.WARNING, logger="kvmesh.kvstore.peer"):
            assert peer.get([h(1)]) == [None]
        assert source.calls == 2  # the data plane's, then Fetch's
        assert peer.metrics["data_plane_fallbacks"] == 1 and peer.metrics["errors"] == 1
        assert any("DEADLINE_EXCEEDED" in r.getMessage() for r in caplog.records)
    finally:
        peer.close()
        srv.stop_in_thread(grace=0)


def test_pages_that_arrived_before_a_fault_are_kept(faulty, data_plane):
    tier, source, address = faulty
    small = {i: bytes([i]) * 2000 for i in range(60, 100)}  # 40 pages: two source batches
    tier.put([(h(i), o) for i, o in small.items()])
    source.ok_calls = 1  # the second batch fails on the server: INTERNAL mid-stream
    peer = PeerTier(address, data_plane=data_plane, identity=ID)
    try:
        got = peer.get([h(i) for i in small])
    finally:
        peer.close()
    first = len([g for g in got if g is not None])
    assert 0 < first < len(small)
    assert got[:first] == [small[60 + j] for j in range(first)]
    assert got[first:] == [None] * (len(small) - first)
    assert peer.metrics["errors"] == 1 and transport_pages(peer) == first


def test_a_worker_without_a_page_store(data_plane):
    srv = WorkerServer(identity=ID)  # neither engine nor page source: every page is a miss
    srv.start_in_thread()
    peer = PeerTier(srv.address, data_plane=data_plane, identity=ID)
    try:
        assert peer.contains([h(1), h(2)]) == [False, False]
        assert peer.get([h(1)]) == [None] and peer.metrics["errors"] == 0
        assert peer.push([(h(1), page(1))]) == 0  # FAILED_PRECONDITION, a fault
        assert peer.metrics["errors"] == 1
    finally:
        peer.close()
        srv.stop_in_thread(grace=0)


def test_a_store_bounds_its_peer_tiers_objects_to_its_page_size():
    # A PeerTier built without knowing the model (static --peer addresses) would accept
    # objects up to its 1 GiB default; the store it joins lowers that to what a page of its
    # spec can take, so a lying peer cannot make the loader set aside more.
    from kvmesh.kvstore.codec import max_object_bytes
    from kvmesh.kvstore.store import TieredStore

    tier = PeerTier(["127.0.0.1:1"], identity=ID)
    try:
        assert tier.max_page_bytes > max_object_bytes(SPEC)
        TieredStore(SPEC, [tier])
        assert tier.max_page_bytes == max_object_bytes(SPEC)
        assert max_object_bytes(SPEC) >= len(encode(SPEC, bytes(SPEC.page_nbytes)))
    finally:
        tier.close()


class _StuckFetchCall:
    """A streaming call that never sends its initial metadata, past its deadline too (seen
    under heavy load from grpc's own calls): only ``cancel`` ends the wait."""

    def __init__(self, nonce: str):
        self._cancelled = threading.Event()

    def initial_metadata(self):
        self._cancelled.wait(60)
        return ()

    def cancel(self):
        self._cancelled.set()
        return True

    def cancelled(self):
        return self._cancelled.is_set()

    def __iter__(self):
        return iter(())


class _DeafFetchCall(_StuckFetchCall):
    """A call whose status arrived but whose initial metadata never does: grpc's rendezvous
    then waits for it forever, and ``cancel`` does nothing (the call is over already)."""

    def cancel(self):
        return False  # the event initial_metadata waits on is never set


class _HalfFetchCall:
    """A proven call that sends page 0, then hangs before page 1 until ``release`` is set
    (cancel does nothing: its status arrived already), then sends page 1."""

    def __init__(self, nonce: str):
        from kvmesh.kvstore.peer.framing import page_chunks

        self.proof = ID.proof(nonce)
        self.release = threading.Event()
        self.sent_second = threading.Event()
        self.chunks = [list(page_chunks([(i, h(i + 1), page(i + 1))])) for i in range(2)]

    def initial_metadata(self):
        from kvmesh.protos.security import PROOF_METADATA_KEY

        return ((PROOF_METADATA_KEY, self.proof),)

    def cancel(self):
        return False

    def __iter__(self):
        yield from self.chunks[0]
        self.release.wait(60)
        self.sent_second.set()
        yield from self.chunks[1]


class _FakeStub:
    """A KVTransfer stub whose Fetch returns ``call_type(nonce)`` (the nonce the request
    asked the peer to prove itself with)."""

    def __init__(self, call_type):
        self.call_type = call_type
        self.calls: list = []

    def Fetch(self, request, timeout, metadata):  # noqa: N802 - gRPC's method name
        from kvmesh.protos.security import NONCE_METADATA_KEY

        self.calls.append(self.call_type(dict(metadata)[NONCE_METADATA_KEY]))
        return self.calls[-1]


@pytest.fixture
def quick_peer(monkeypatch):
    """A gRPC-only PeerTier with a 0.3 s timeout and a 0.2 s watchdog grace; the tests hand
    its ``_fetch`` a fake stub, so its address is never dialled."""
    import kvmesh.kvstore.peer.tier as tier_mod

    monkeypatch.setattr(tier_mod, "FETCH_WATCHDOG_GRACE_S", 0.2)
    peer = PeerTier(f"127.0.0.1:{free_port()}", identity=ID, timeout=0.3, data_plane=False)
    yield peer
    peer.close()


def test_a_fetch_whose_call_outlives_its_deadline_is_cancelled_by_the_watchdog(quick_peer):
    stub = _FakeStub(_StuckFetchCall)
    t0 = time.monotonic()
    got, err = quick_peer._fetch(stub, [h(1)], timeout=0.3)
    took = time.monotonic() - t0
    assert got == {} and err is not None  # misses, never pages or an exception
    assert stub.calls[0].cancelled()
    assert took < 30, f"the stuck call held the fetch {took:.1f}s"  # 60 s without it


def test_a_fetch_whose_read_ignores_the_cancel_is_left_behind(quick_peer):
    stub = _FakeStub(_DeafFetchCall)
    t0 = time.monotonic()
    got, err = quick_peer._fetch(stub, [h(1)], timeout=0.3)
    took = time.monotonic() - t0
    assert got == {} and isinstance(err, TimeoutError) and "left behind" in str(err)
    assert took < 10, f"the deaf call held the fetch {took:.1f}s"  # 60 s without it


def test_a_fetch_left_behind_keeps_its_whole_pages_and_a_late_page_stays_out(quick_peer):
    stub = _FakeStub(_HalfFetchCall)
    before = set(threading.enumerate())  # another test's reader may still be stuck
    got, err = quick_peer._fetch(stub, [h(1), h(2)], timeout=0.3)
    assert isinstance(err, TimeoutError) and "left behind" in str(err)
    assert got == {0: page(1)}  # the page that arrived whole before the hang
    assert quick_peer.metrics["fetches_left_behind"] == 1
    call = stub.calls[0]
    new = set(threading.enumerate()) - before
    (reader,) = [t for t in new if t.name == "kvmesh-peer-fetch"]
    call.release.set()  # the reader wakes up and takes page 1 after the caller left
    reader.join(10)
    assert call.sent_second.is_set() and not reader.is_alive()
    assert got == {0: page(1)}  # nothing the late reader got reached the caller
