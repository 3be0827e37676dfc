"""The raw-TCP page data plane on real loopback sockets: the same bytes as gRPC Fetch, a
persistent connection, bad requests closing only their own connection, gRPC as the fallback
(no data plane, a TLS-style server, a stale token, a closed port), a server killed
mid-transfer turning the rest into misses, and receive memory reused only once released."""

from __future__ import annotations

import logging
import socket
import threading

import grpc
import pytest

from kvmesh.kvstore import dataplane as dp
from kvmesh.kvstore.codec import PageSpec, decode, encode
from kvmesh.kvstore.host import HostTier
from kvmesh.kvstore.peer import MAX_CHUNK_BYTES, PeerTier, TierPageSource
from kvmesh.kvstore.store import TieredStore
from kvmesh.protos.kvmesh.v1 import kv_transfer_pb2 as pb
from kvmesh.protos.kvmesh.v1 import kv_transfer_pb2_grpc as pb_grpc
from kvmesh.worker.server import WorkerServer

# pages bigger than a gRPC chunk, so Fetch has to cut and reassemble them
SPEC = PageSpec(
    model_fp="ab12", cache_format="fp32", num_layers=2, num_kv_heads=8, head_size=128,
    block_size=80, page_nbytes=2 * 2 * 80 * 8 * 128 * 4,
)  # fmt: skip


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def page(i: int) -> bytes:
    return encode(SPEC, (i.to_bytes(4, "little") * (SPEC.page_nbytes // 4))[: SPEC.page_nbytes])


@pytest.fixture(scope="module")
def host() -> HostTier:
    tier = HostTier(256 << 20)
    tier.put([(h(i), page(i)) for i in range(40)])
    return tier


@pytest.fixture(scope="module")
def server(host):
    srv = WorkerServer(page_source=TierPageSource(host, spec=SPEC), grace_s=1.0)
    srv.start_in_thread()
    yield srv
    srv.stop_in_thread(grace=0)


def data_plane_info(address: str, credentials=None) -> pb.DataPlaneInfo:
    ch = (
        grpc.secure_channel(address, credentials)
        if credentials is not None
        else grpc.insecure_channel(address)
    )
    with ch:
        return pb_grpc.KVTransferStub(ch).DataPlane(pb.DataPlaneRequest(version=1), timeout=10)


def closed_by_server(sock: socket.socket, timeout: float = 10.0) -> bool:
    """True when the server closes the connection (EOF or reset) without sending a page."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1 << 16) == b""
    except ConnectionResetError:
        return True


def test_the_rpc_names_the_data_plane(server):
    info = data_plane_info(server.address)
    assert info.port == server.data_plane_port != 0 and info.port != server.port
    assert len(info.token) == dp.TOKEN_BYTES and info.version == dp.VERSION
    assert info.max_pages == dp.MAX_REQUEST_PAGES


def test_data_plane_pages_are_byte_identical_to_fetch_pages(server):
    asked = [h(3), h(99), h(0), h(39), h(98), h(7)]  # misses in between, out of order
    fast = PeerTier(server.address)
    slow = PeerTier(server.address, data_plane=False)
    try:
        assert fast.transport() == "data_plane" and slow.transport() == "grpc"
        over_dp, over_grpc = fast.get(asked), slow.get(asked)
    finally:
        fast.close()
        slow.close()
    assert len(page(3)) > MAX_CHUNK_BYTES
    assert over_grpc == [page(3), None, page(0), page(39), None, page(7)]
    assert [None if o is None else bytes(o) for o in over_dp] == over_grpc
    assert fast.metrics["data_plane_pages"] == 4 and fast.metrics["grpc_pages"] == 0
    assert slow.metrics["grpc_pages"] == 4 and slow.metrics["data_plane_pages"] == 0
    assert fast.metrics["hits"] == 4 and fast.metrics["misses"] == 2
    assert fast.metrics["errors"] == 0 and fast.metrics["data_plane_fallbacks"] == 0
    # what the data plane hands over decodes like any page: the store reads it as is
    store = TieredStore(SPEC, [PeerTier(server.address)])
    try:
        (tier, payload), miss = store.get([h(5), h(97)])
    finally:
        store.close()
    assert (tier, miss) == ("peer", None)
    assert bytes(payload) == bytes(decode(SPEC, page(5)))


def test_one_connection_serves_many_calls(server):
    before = server.data_plane.connections
    peer = PeerTier(server.address)
    try:
        for i in range(5):
            assert bytes(peer.get([h(i)])[0]) == page(i)
    finally:
        peer.close()
    assert server.data_plane.connections - before == 1


def test_a_client_splits_requests_at_the_servers_limit(host):
    srv = dp.DataPlaneServer(TierPageSource(host), max_pages=3)
    srv.start()
    client = dp.DataPlaneClient("127.0.0.1", srv.port, srv.token, max_pages=srv.max_pages)
    try:
        res = client.fetch([h(i) for i in range(10)], timeout=10)
    finally:
        client.close()
        srv.stop()
    assert res.error is None
    assert {i: bytes(o) for i, o in res.objects.items()} == {i: page(i) for i in range(10)}


@pytest.mark.parametrize(
    "request_bytes",
    [
        pytest.param(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(64), id="garbage"),
        pytest.param("wrong-token", id="wrong-token"),
        pytest.param("wrong-version", id="wrong-version"),
        pytest.param("too-many-hashes", id="too-many-hashes"),
    ],
)
def test_a_bad_request_closes_its_connection_and_the_server_keeps_serving(
    server, request_bytes, caplog
):
    token = server.data_plane.token
    if request_bytes == "wrong-token":
        bad = bytes(b ^ 0xFF for b in token)
        request_bytes = dp.REQUEST_HEAD.pack(dp.MAGIC, dp.VERSION, 0, bad, 1) + h(1)
    elif request_bytes == "wrong-version":
        request_bytes = dp.REQUEST_HEAD.pack(dp.MAGIC, 99, 0, token, 1) + h(1)
    elif request_bytes == "too-many-hashes":  # claims 4 GiB of hashes; none are read
        request_bytes = dp.REQUEST_HEAD.pack(dp.MAGIC, dp.VERSION, 0, token, 2**32 - 1)
    rejected = server.data_plane.rejected
    with caplog.at_level(logging.WARNING, logger="kvmesh.kvstore.dataplane"):
        with socket.create_connection(("127.0.0.1", server.data_plane_port)) as sock:
            sock.sendall(request_bytes)
            assert closed_by_server(sock)
    assert server.data_plane.rejected == rejected + 1
    assert any("closing the connection" in r.getMessage() for r in caplog.records)
    peer = PeerTier(server.address)
    try:
        assert bytes(peer.get([h(2)])[0]) == page(2)
        assert peer.metrics["data_plane_pages"] == 1
    finally:
        peer.close()


def test_a_truncated_request_and_a_silent_client_do_not_block_others(server):
    token = server.data_plane.token
    idle = socket.create_connection(("127.0.0.1", server.data_plane_port))  # never sends
    half = socket.create_connection(("127.0.0.1", server.data_plane_port))
    half.sendall(dp.REQUEST_HEAD.pack(dp.MAGIC, dp.VERSION, 0, token, 4) + h(1))  # 1 of 4
    try:
        peer = PeerTier(server.address)
        try:
            assert [bytes(o) for o in peer.get([h(8), h(9)])] == [page(8), page(9)]
        finally:
            peer.close()
    finally:
        half.close()
        idle.close()


def test_a_worker_without_a_data_plane_serves_over_fetch(host):
    srv = WorkerServer(page_source=TierPageSource(host), data_plane=False)
    srv.start_in_thread()
    peer = PeerTier(srv.address)
    try:
        assert data_plane_info(srv.address).port == 0
        assert peer.transport() == "grpc"
        assert peer.get([h(1), h(99)]) == [page(1), None]
        assert peer.metrics["grpc_pages"] == 1 and peer.metrics["data_plane_pages"] == 0
        assert peer.metrics["errors"] == 0
    finally:
        peer.close()
        srv.stop_in_thread(grace=0)


def test_a_secure_grpc_port_runs_no_data_plane_unless_asked(host):
    """TLS stand-in: grpc's local credentials make the gRPC port a secure one."""
    local = grpc.LocalConnectionType.LOCAL_TCP
    for asked, offered in [(None, False), (True, True)]:
        srv = WorkerServer(
            page_source=TierPageSource(host),
            server_credentials=grpc.local_server_credentials(local),
            data_plane=asked,
        )
        srv.start_in_thread()
        creds = grpc.local_channel_credentials(local)
        peer = PeerTier(srv.address, credentials=creds)
        try:
            assert (data_plane_info(srv.address, creds).port != 0) is offered
            assert (srv.data_plane is not None) is offered
            assert bytes(peer.get([h(4)])[0]) == page(4)
            assert peer.transport() == ("data_plane" if offered else "grpc")
        finally:
            peer.close()
            srv.stop_in_thread(grace=0)


def test_a_stale_token_falls_back_to_fetch(host):
    srv = WorkerServer(page_source=TierPageSource(host))
    srv.start_in_thread()
    peer = PeerTier(srv.address)
    try:
        assert bytes(peer.get([h(1)])[0]) == page(1)  # learns port and token
        srv.data_plane.token = bytes(dp.TOKEN_BYTES)  # as if the worker had restarted
        assert peer.get([h(2)]) == [page(2)]  # refused before any page: Fetch serves it
        assert peer.metrics["data_plane_fallbacks"] == 1 and peer.metrics["errors"] == 0
        assert peer.metrics["grpc_pages"] == 1
    finally:
        peer.close()
        srv.stop_in_thread(grace=0)


def test_a_closed_data_plane_port_falls_back_to_fetch(host):
    srv = WorkerServer(page_source=TierPageSource(host))
    srv.start_in_thread()
    peer = PeerTier(srv.address)
    try:
        assert peer.transport() == "data_plane"
        srv.data_plane.stop()  # the port refuses connections; gRPC still answers
        assert peer.get([h(3), h(4)]) == [page(3), page(4)]
        assert peer.metrics["data_plane_fallbacks"] == 1 and peer.metrics["errors"] == 0
        assert peer.get([h(5)]) == [page(5)]  # no second try until DATA_PLANE_RECHECK_S
        assert peer.metrics["data_plane_fallbacks"] == 1
    finally:
        peer.close()
        srv.stop_in_thread(grace=0)


class GatedSource(TierPageSource):
    """Serves two batches at once; the third waits for ``release``. The server asks for a
    batch while it sends the one before, so when the third is asked for, the first has
    been sent whole."""

    def __init__(self, tier):
        super().__init__(tier)
        self.calls = 0
        self.third_batch = threading.Event()
        self.release = threading.Event()

    def fetch(self, hashes):
        self.calls += 1
        if self.calls > 2:
            self.third_batch.set()
            self.release.wait(30)
        return super().fetch(hashes)


def test_a_server_killed_mid_transfer_gives_misses_for_the_rest(caplog):
    tier = HostTier(256 << 20)
    tier.put([(h(i), page(i)) for i in range(100)])
    assert tier.num_objects == 100
    source = GatedSource(tier)
    srv = WorkerServer(page_source=source)
    srv.start_in_thread()
    peer = PeerTier(srv.address, timeout=30.0)
    asked = [h(i) for i in range(100)]  # four batches of the server's 32
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("got", peer.get(asked)))
    try:
        with caplog.at_level(logging.WARNING, logger="kvmesh.kvstore.peer"):
            t.start()
            assert source.third_batch.wait(30), "the transfer never reached its third batch"
            srv.stop_in_thread(grace=0)  # cuts the data-plane connection mid-transfer
            source.release.set()
            t.join(30)
        got = result["got"]
    finally:
        source.release.set()
        peer.close()
    n = next(i for i, o in enumerate(got) if o is None)  # the pages before the cut
    assert 32 <= n < 64
    assert [bytes(o) for o in got[:n]] == [page(i) for i in range(n)]
    assert got[n:] == [None] * (100 - n)  # misses, not an exception
    assert peer.metrics["errors"] == 1 and peer.metrics["data_plane_fallbacks"] == 0
    assert peer.metrics["hits"] == n and peer.metrics["misses"] == 100 - n
    assert len([r for r in caplog.records if srv.address in r.getMessage()]) == 1


def test_receive_memory_is_reused_only_after_every_page_of_it_is_gone():
    pool = dp._MappingPool(keep_bytes=8 << 20)
    a = dp._Arena(pool)
    first = a.take(1000, hint=3000)
    second = a.take(1000, hint=2000)
    first[:3] = b"abc"
    assert (pool.created, pool.reused) == (1, 0)
    del a
    b = dp._Arena(pool)
    b.take(1000, hint=1000)  # `first` and `second` still hold the only mapping: a new one
    assert (pool.created, pool.reused) == (2, 0)
    del first
    assert pool.idle_bytes() == 0  # `second` is alive
    del second, b
    assert pool.idle_bytes() == 2 << 20  # both 1 MiB mappings are back
    c = dp._Arena(pool)
    c.take(5000, hint=5000)
    assert (pool.created, pool.reused) == (2, 1)
