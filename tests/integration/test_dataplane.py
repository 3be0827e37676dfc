"""The raw-TCP page data plane on real loopback sockets: the same bytes as gRPC Fetch, a
persistent connection, bad requests closing only their own connection, gRPC as the fallback
(no data plane, a TLS-style server, a stale token, a closed port), a server killed
mid-transfer turning the rest into misses, receive memory reused only once released, and
the server's limits: whole-message deadlines, idle connections making room for new ones, a
connection thread that cannot start."""

from __future__ import annotations

import gc
import logging
import mmap
import socket
import sys
import threading
import time
import types

import grpc
import pytest
from helpers import TEST_IDENTITY as ID

from kvmesh.kvstore import dataplane as dp
from kvmesh.kvstore.codec import PageSpec, decode, encode
from kvmesh.kvstore.dataplane import memory, sockets
from kvmesh.kvstore.dataplane.protocol import encode_request
from kvmesh.kvstore.host import HostTier
from kvmesh.kvstore.peer import MAX_CHUNK_BYTES, PeerTier, TierPageSource
from kvmesh.kvstore.store import TieredStore
from kvmesh.protos.kvmesh.v1 import kv_transfer_pb2 as pb
from kvmesh.protos.kvmesh.v1 import kv_transfer_pb2_grpc as pb_grpc
from kvmesh.worker import server as worker_server
from kvmesh.worker.server import WorkerServer

KEY = ID.data_plane_key

# pages bigger than a gRPC chunk, so Fetch has to cut and reassemble them
SPEC = PageSpec(
    model_fp="ab12",
    cache_format="fp32",
    num_layers=2,
    num_kv_heads=8,
    head_size=128,
    block_size=80,
    page_nbytes=2 * 2 * 80 * 8 * 128 * 4,
)


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
    srv = WorkerServer(page_source=TierPageSource(host, spec=SPEC), grace_s=1.0, identity=ID)
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
        return pb_grpc.KVTransferStub(ch).DataPlane(
            pb.DataPlaneRequest(version=dp.VERSION), timeout=10, metadata=ID.metadata()
        )


def closed_by_server(sock: socket.socket, timeout: float = 10.0) -> bool:
    """True when the server closes the connection (EOF or reset) without sending a page."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1 << 16) == b""
    except ConnectionResetError:
        return True


def wait_for(condition, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def request(token: bytes, hashes: list[bytes], key: bytes = KEY) -> bytes:
    return encode_request(token, hashes, key, bytes(dp.NONCE_BYTES))


def head(token: bytes, count: int, version: int = dp.VERSION) -> bytes:
    return dp.REQUEST_HEAD.pack(dp.MAGIC, version, 0, token, count, bytes(dp.NONCE_BYTES))


class ScriptedServer:
    """A data-plane server of one connection that reads one request and answers it with
    the bytes a test scripts, then closes."""

    def __init__(self, answer: bytes) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._run, args=(answer,), daemon=True)
        self.thread.start()

    def _run(self, answer: bytes) -> None:
        conn, _ = self.listener.accept()
        with conn:
            head = conn.recv(dp.REQUEST_HEAD.size, socket.MSG_WAITALL)
            count = dp.REQUEST_HEAD.unpack(head)[4]
            conn.recv(16 * count + dp.MAC_BYTES, socket.MSG_WAITALL)
            conn.sendall(answer)

    def close(self) -> None:
        self.listener.close()
        self.thread.join(5)


def test_the_rpc_names_the_data_plane(server):
    info = data_plane_info(server.address)
    assert info.port == server.data_plane_port != 0 and info.port != server.port
    assert len(info.token) == dp.TOKEN_BYTES and info.version == dp.VERSION
    assert info.max_pages == dp.MAX_REQUEST_PAGES


def test_data_plane_pages_are_byte_identical_to_fetch_pages(server):
    asked = [h(3), h(99), h(0), h(39), h(98), h(7)]  # misses in between, out of order
    fast = PeerTier(server.address, identity=ID)
    slow = PeerTier(server.address, data_plane=False, identity=ID)
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
    store = TieredStore(SPEC, [PeerTier(server.address, identity=ID)])
    try:
        (tier, payload), miss = store.get([h(5), h(97)])
    finally:
        store.close()
    assert (tier, miss) == ("peer", None)
    assert bytes(payload) == bytes(decode(SPEC, page(5)))


def test_one_connection_serves_many_calls(server):
    before = server.data_plane.connections
    peer = PeerTier(server.address, identity=ID)
    try:
        for i in range(5):
            assert bytes(peer.get([h(i)])[0]) == page(i)
    finally:
        peer.close()
    assert server.data_plane.connections - before == 1


def test_a_client_splits_requests_at_the_servers_limit(host):
    srv = dp.DataPlaneServer(TierPageSource(host), max_pages=3, key=KEY)
    srv.start()
    client = dp.DataPlaneClient("127.0.0.1", srv.port, srv.token, max_pages=srv.max_pages, key=KEY)
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
        pytest.param("wrong-key", id="wrong-mac"),
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
        request_bytes = request(bad, [h(1)])
    elif request_bytes == "wrong-key":  # the right token, but not the cluster's key
        request_bytes = request(token, [h(1)], key=bytes(dp.KEY_BYTES))
    elif request_bytes == "wrong-version":
        request_bytes = head(token, 1, version=99) + h(1)
    elif request_bytes == "too-many-hashes":  # claims 4 GiB of hashes; none are read
        request_bytes = head(token, 2**32 - 1)
    rejected = server.data_plane.rejected
    with caplog.at_level(logging.WARNING, logger="kvmesh.kvstore.dataplane"):
        with socket.create_connection(("127.0.0.1", server.data_plane_port)) as sock:
            sock.sendall(request_bytes)
            assert closed_by_server(sock)
    assert server.data_plane.rejected == rejected + 1
    assert any("closing the connection" in r.getMessage() for r in caplog.records)
    peer = PeerTier(server.address, identity=ID)
    try:
        assert bytes(peer.get([h(2)])[0]) == page(2)
        assert peer.metrics["data_plane_pages"] == 1
    finally:
        peer.close()


def test_a_truncated_request_and_a_silent_client_do_not_block_others(server):
    token = server.data_plane.token
    idle = socket.create_connection(("127.0.0.1", server.data_plane_port))  # never sends
    half = socket.create_connection(("127.0.0.1", server.data_plane_port))
    half.sendall(head(token, 4) + h(1))  # 1 of 4
    try:
        peer = PeerTier(server.address, identity=ID)
        try:
            assert [bytes(o) for o in peer.get([h(8), h(9)])] == [page(8), page(9)]
        finally:
            peer.close()
    finally:
        half.close()
        idle.close()


def test_a_worker_without_a_data_plane_serves_over_fetch(host):
    srv = WorkerServer(page_source=TierPageSource(host), data_plane=False, identity=ID)
    srv.start_in_thread()
    peer = PeerTier(srv.address, identity=ID)
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
            identity=ID,
        )
        srv.start_in_thread()
        creds = grpc.local_channel_credentials(local)
        peer = PeerTier(srv.address, credentials=creds, identity=ID)
        try:
            assert (data_plane_info(srv.address, creds).port != 0) is offered
            assert (srv.data_plane is not None) is offered
            assert bytes(peer.get([h(4)])[0]) == page(4)
            assert peer.transport() == ("data_plane" if offered else "grpc")
        finally:
            peer.close()
            srv.stop_in_thread(grace=0)


def test_a_stale_token_falls_back_to_fetch(host):
    srv = WorkerServer(page_source=TierPageSource(host), identity=ID)
    srv.start_in_thread()
    peer = PeerTier(srv.address, identity=ID)
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
    srv = WorkerServer(page_source=TierPageSource(host), identity=ID)
    srv.start_in_thread()
    peer = PeerTier(srv.address, identity=ID)
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
    srv = WorkerServer(page_source=source, identity=ID)
    srv.start_in_thread()
    peer = PeerTier(srv.address, timeout=30.0, identity=ID)
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
    assert 32 <= n <= 64  # the cut may come while batch 2 is sent, or just after it
    assert [bytes(o) for o in got[:n]] == [page(i) for i in range(n)]
    assert got[n:] == [None] * (100 - n)  # misses, not an exception
    assert peer.metrics["errors"] == 1 and peer.metrics["data_plane_fallbacks"] == 0
    assert peer.metrics["hits"] == n and peer.metrics["misses"] == 100 - n
    assert len([r for r in caplog.records if srv.address in r.getMessage()]) == 1


def test_receive_memory_is_reused_only_after_every_page_of_it_is_gone():
    pool = memory.MappingPool(keep_bytes=8 << 20)
    a = memory.Arena(pool)
    first = a.take(1000, hint=3000)
    second = a.take(1000, hint=2000)
    first[:3] = b"abc"
    assert (pool.created, pool.reused) == (1, 0)
    del a
    b = memory.Arena(pool)
    b.take(1000, hint=1000)  # `first` and `second` still hold the only mapping: a new one
    assert (pool.created, pool.reused) == (2, 0)
    del first
    assert pool.idle_bytes() == 0  # `second` is alive
    del second, b
    assert pool.idle_bytes() == 2 << 20  # both 1 MiB mappings are back
    c = memory.Arena(pool)
    c.take(5000, hint=5000)
    assert (pool.created, pool.reused) == (2, 1)


# ---------------------------------------------------------------- the server's limits


def test_a_request_trickling_in_is_cut_at_the_request_deadline(host):
    """Per-syscall timeouts would let a byte every few seconds hold the thread forever."""
    srv = dp.DataPlaneServer(
        TierPageSource(host), request_timeout_s=0.5, io_timeout_s=30.0, key=KEY
    )
    srv.start()
    req = request(srv.token, [h(1)])
    try:
        with socket.create_connection(("127.0.0.1", srv.port)) as sock:
            assert wait_for(lambda: srv.open_connections == 1)
            sent = 0
            while sent < len(req) and srv.open_connections:
                try:
                    sock.sendall(req[sent : sent + 1])
                except OSError:  # the server has closed it
                    break
                sent += 1
                time.sleep(0.1)
            assert sent < len(req)  # cut before the request was complete
            assert closed_by_server(sock)  # and nothing was answered
        assert srv.timed_out == 1 and srv.open_connections == 0
    finally:
        srv.stop()


def test_a_client_that_reads_too_slowly_is_cut_off(host):
    """Each page must be taken within io_timeout_s as a whole: reading a little now and
    then (here about a page per second for a 0.5 s limit) does not keep the thread."""
    srv = dp.DataPlaneServer(TierPageSource(host), io_timeout_s=0.5, key=KEY)
    srv.start()
    asked = [h(i) for i in range(40)]  # 26 MB: more than the socket buffers hold
    try:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
            sock.connect(("127.0.0.1", srv.port))
            sock.sendall(request(srv.token, asked))
            got = 0
            for _ in range(300):
                time.sleep(0.1)
                if srv.open_connections == 0:
                    break
                got += len(sock.recv(64 << 10))
            assert srv.open_connections == 0 and srv.timed_out == 1
            assert got < len(asked) * len(page(0))
    finally:
        srv.stop()


def test_at_the_connection_limit_a_newcomer_closes_the_longest_idle_connection(host):
    srv = dp.DataPlaneServer(TierPageSource(host), max_connections=2, key=KEY)
    srv.start()
    client = dp.DataPlaneClient("127.0.0.1", srv.port, srv.token, key=KEY)
    socks: list[socket.socket] = []

    def connect() -> socket.socket:
        socks.append(socket.create_connection(("127.0.0.1", srv.port)))
        return socks[-1]

    try:
        first = connect()
        assert wait_for(lambda: srv.open_connections == 1)
        second = connect()
        assert wait_for(lambda: srv.open_connections == 2)
        res = client.fetch([h(1)], timeout=10)  # a third connection: `first` makes room
        assert res.error is None and bytes(res.objects[0]) == page(1)
        assert closed_by_server(first) and srv.evicted == 1
        second.sendall(b"K")  # the first byte of a request: busy, never evicted
        assert wait_for(lambda: sum(c.idle_since is None for c in srv._conns) == 1)
        third = connect()  # the client's pooled connection is the idle one now
        assert wait_for(lambda: srv.evicted == 2)
        res = client.fetch([h(2)], timeout=10)  # re-opens; `third` makes room
        assert res.error is None and bytes(res.objects[0]) == page(2)
        assert closed_by_server(third) and srv.evicted == 3
        second.settimeout(0.2)
        with pytest.raises(TimeoutError):  # still open, waiting for its request
            second.recv(1)
        assert srv.refused == 0
    finally:
        client.close()
        for sock in socks:
            sock.close()
        srv.stop()


def test_at_the_connection_limit_with_every_connection_busy_a_newcomer_is_closed(host):
    srv = dp.DataPlaneServer(TierPageSource(host), max_connections=1, key=KEY)
    srv.start()
    try:
        with socket.create_connection(("127.0.0.1", srv.port)) as busy:
            busy.sendall(request(srv.token, [h(1)])[:10])  # a request under way
            assert wait_for(lambda: any(c.idle_since is None for c in srv._conns))
            with socket.create_connection(("127.0.0.1", srv.port)) as newcomer:
                assert closed_by_server(newcomer)
            assert srv.refused == 1 and srv.evicted == 0
            busy.sendall(request(srv.token, [h(1)])[10:])  # the busy one is served
            n = dp.PAGE_HEAD.size + len(page(1))
            assert busy.recv(n, socket.MSG_WAITALL)[dp.PAGE_HEAD.size :] == page(1)
    finally:
        srv.stop()


def test_a_connection_thread_that_cannot_start_is_closed_and_accepting_goes_on(
    host, monkeypatch, caplog
):
    srv = dp.DataPlaneServer(TierPageSource(host), key=KEY)
    srv.start()
    real_start = threading.Thread.start
    failures = [2]

    def start(thread):
        if thread.name == "kvmesh-dataplane-conn" and failures[0]:
            failures[0] -= 1
            raise RuntimeError("can't start new thread")
        return real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    client = dp.DataPlaneClient("127.0.0.1", srv.port, srv.token, key=KEY)
    try:
        with caplog.at_level(logging.WARNING, logger="kvmesh.kvstore.dataplane"):
            for _ in range(2):
                with socket.create_connection(("127.0.0.1", srv.port)) as sock:
                    assert closed_by_server(sock)
            res = client.fetch([h(3)], timeout=10)  # the accept loop is alive
        assert res.error is None and bytes(res.objects[0]) == page(3)
        assert srv.refused == 2 and srv.open_connections == 1
        assert len([r for r in caplog.records if "cannot start a thread" in r.getMessage()]) == 1
    finally:
        client.close()
        srv.stop()


def test_objects_are_framed_by_their_length_in_bytes():
    """A page source may hand out any buffer, e.g. a memoryview of 4-byte items."""
    obj = bytes(range(256)) * 16

    class ItemSource:
        def fetch(self, hashes):
            return [memoryview(obj).cast("I") for _ in hashes]

    srv = dp.DataPlaneServer(ItemSource(), key=KEY)
    srv.start()
    client = dp.DataPlaneClient("127.0.0.1", srv.port, srv.token, key=KEY)
    try:
        res = client.fetch([h(1), h(2)], timeout=10)
    finally:
        client.close()
        srv.stop()
    assert res.error is None
    assert [bytes(res.objects[i]) for i in (0, 1)] == [obj, obj]


def test_a_server_that_fails_after_its_data_plane_started_stops_it(host, monkeypatch):
    started: list[dp.DataPlaneServer] = []
    real_start = dp.DataPlaneServer.start

    def start(plane):
        started.append(plane)
        return real_start(plane)

    def broken(*args, **kwargs):
        raise RuntimeError("reflection broke")

    monkeypatch.setattr(dp.DataPlaneServer, "start", start)
    monkeypatch.setattr(worker_server.reflection, "enable_server_reflection", broken)
    srv = WorkerServer(page_source=TierPageSource(host), identity=ID)
    with pytest.raises(RuntimeError, match="reflection broke"):
        srv.start_in_thread()
    (plane,) = started
    assert srv.data_plane is None
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", plane.port), timeout=5).close()


# ---------------------------------------------------------------- the client's limits


@pytest.mark.skipif(not memory.mapping_reuse_works(), reason="no reusable receive mappings here")
def test_a_failed_fetch_gives_its_receive_memory_back_at_once(monkeypatch):
    """Closed 1,000 bytes into a 4,096-byte object: the error must not keep the mapping it
    was received into (through its traceback's frames) until the cyclic GC runs."""
    pool = memory.MappingPool(keep_bytes=64 << 20)
    monkeypatch.setattr(memory, "RECEIVE_POOL", pool)
    fake = ScriptedServer(dp.PAGE_HEAD.pack(0, dp.FOUND, 4096) + bytes(1000))
    client = dp.DataPlaneClient("127.0.0.1", fake.port, bytes(dp.TOKEN_BYTES), key=KEY)
    gc.disable()
    try:
        res = client.fetch([h(1), h(2)], timeout=10)
        assert isinstance(res.error, dp.DataPlaneError) and res.objects == {}
        assert res.answered and not res.may_retry_elsewhere
        assert pool.created == 1
        assert pool.idle_bytes() == 1 << 20  # back in the pool without a collection
    finally:
        gc.enable()
        client.close()
        fake.close()


def test_an_object_longer_than_a_page_is_refused_before_memory_is_set_aside(server, monkeypatch):
    pool = memory.MappingPool()
    monkeypatch.setattr(memory, "RECEIVE_POOL", pool)
    fake = ScriptedServer(dp.PAGE_HEAD.pack(0, dp.FOUND, 1 << 40))  # claims 1 TiB
    client = dp.DataPlaneClient("127.0.0.1", fake.port, bytes(dp.TOKEN_BYTES), key=KEY)
    try:
        res = client.fetch([h(1)], timeout=10)
    finally:
        client.close()
        fake.close()
    assert isinstance(res.error, dp.DataPlaneError) and "at most" in str(res.error)
    # PeerTier hands its max_page_bytes down: a page longer than that is refused too
    peer = PeerTier(server.address, max_page_bytes=len(page(1)) - 1, identity=ID)
    try:
        assert peer.get([h(1)]) == [None]
        assert peer.metrics["errors"] == 1 and peer.metrics["data_plane_fallbacks"] == 0
    finally:
        peer.close()
    assert pool.created == 0


def test_a_connect_timeout_is_a_deadline_not_a_reason_to_fall_back():
    with socket.create_server(("127.0.0.1", 0), backlog=0) as full:
        port = full.getsockname()[1]
        held: list[socket.socket] = []
        try:
            for _ in range(16):  # fill the accept queue: further SYNs go unanswered
                held.append(socket.socket())
                held[-1].settimeout(0.2)
                try:
                    held[-1].connect(("127.0.0.1", port))
                except TimeoutError:
                    break
            else:
                pytest.skip("this kernel answers every SYN")
            client = dp.DataPlaneClient("127.0.0.1", port, bytes(16), connect_timeout=0.2, key=KEY)
            res = client.fetch([h(1)], timeout=10)
            client.close()
        finally:
            for sock in held:
                sock.close()
    assert isinstance(res.error, TimeoutError), res.error
    assert not res.may_retry_elsewhere


def test_a_send_the_peer_does_not_take_is_a_timeout():
    a, b = socket.socketpair()
    with a, b:
        with pytest.raises(TimeoutError):  # not BlockingIOError, which is no TimeoutError
            sockets.send_all(a, [bytes(16 << 20)], time.monotonic() + 0.3)


# ---------------------------------------------------------------- other platforms


def test_where_mappings_cannot_be_reused_receive_memory_is_plain_and_not_held(host, monkeypatch):
    class NoMremap(mmap.mmap):  # macOS: no mremap, so a resize fails even when unused
        def resize(self, newsize):
            super().resize(newsize)  # BufferError while exported, as everywhere
            raise SystemError("mmap: resizing not available--no mremap()")

    flags = {"MAP_PRIVATE": mmap.MAP_PRIVATE, "MAP_ANONYMOUS": mmap.MAP_ANONYMOUS}
    if sys.platform.startswith("linux"):
        assert memory.probe_reuse(mmap)
    assert not memory.probe_reuse(types.SimpleNamespace(mmap=NoMremap, **flags))
    assert not memory.probe_reuse(types.SimpleNamespace(mmap=mmap.mmap))  # Windows: no flags
    pool = memory.MappingPool(reuse=False)
    monkeypatch.setattr(memory, "RECEIVE_POOL", pool)
    srv = dp.DataPlaneServer(TierPageSource(host), key=KEY)
    srv.start()
    client = dp.DataPlaneClient("127.0.0.1", srv.port, srv.token, key=KEY)
    try:
        res = client.fetch([h(1), h(99), h(2)], timeout=10)
    finally:
        client.close()
        srv.stop()
    assert res.error is None and sorted(res.objects) == [0, 2]
    assert [bytes(res.objects[i]) for i in (0, 2)] == [page(1), page(2)]
    assert all(isinstance(o.obj, bytearray) for o in res.objects.values())
    assert pool._lent == [] and pool.created == 2  # one buffer per object, none kept


def test_a_local_failure_in_the_data_plane_client_is_a_miss_not_an_exception(server, monkeypatch):
    def no_flags(self, size):  # as on Windows before the probe: no mmap.MAP_PRIVATE
        raise AttributeError("module 'mmap' has no attribute 'MAP_PRIVATE'")

    monkeypatch.setattr(memory.MappingPool, "take", no_flags)
    peer = PeerTier(server.address, identity=ID)
    try:
        assert peer.get([h(1), h(99)]) == [None, None]
        assert peer.metrics["errors"] == 1 and peer.metrics["misses"] == 2
    finally:
        peer.close()


def test_a_page_whose_mac_is_wrong_is_refused():
    """A server without the cluster's key (here one that answers blindly) cannot hand over
    a page: a well-formed page with a MAC that is not the cluster's ends the fetch."""
    obj = page(1)
    fake = ScriptedServer(dp.PAGE_HEAD.pack(0, dp.FOUND, len(obj)) + obj + bytes(dp.MAC_BYTES))
    client = dp.DataPlaneClient("127.0.0.1", fake.port, bytes(dp.TOKEN_BYTES), key=KEY)
    try:
        res = client.fetch([h(1)], timeout=10)
    finally:
        client.close()
        fake.close()
    assert isinstance(res.error, dp.DataPlaneError) and "MAC" in str(res.error)
    assert res.objects == {} and not res.may_retry_elsewhere
