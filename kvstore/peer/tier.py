"""PeerTier: the tier that reads other workers' pages, the client side of their KVTransfer
service: over a peer's raw-TCP data plane (``kvstore.dataplane``) when it offers one, else
over gRPC ``Fetch``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import grpc

from kvmesh.kvstore.dataplane import TOKEN_BYTES, DataPlaneClient, detached
from kvmesh.kvstore.dataplane import VERSION as DATA_PLANE_VERSION
from kvmesh.kvstore.peer.framing import MAX_PAGE_BYTES, PageAssembler, page_chunks
from kvmesh.kvstore.tier import Tier
from kvmesh.protos.kvmesh.v1 import kv_transfer_pb2 as pb
from kvmesh.protos.kvmesh.v1 import kv_transfer_pb2_grpc as pb_grpc
from kvmesh.protos.security import ClusterIdentity
from kvmesh.protos.serving import channel_options

logger = logging.getLogger(__name__)

# how long a peer's "no data plane" (or a data plane that failed before any page) holds
# before PeerTier asks its DataPlane RPC again
DATA_PLANE_RECHECK_S = 10.0
MAX_PEERS = 8  # addresses one PeerTier may hold (a request names at most MAX_PEER_HINTS)
# how long a failed peer counts as down (``PeerTier.healthy``) without failing again: a peer
# no request names any more (a worker gone for good) must not keep the tier down forever
DOWN_HOLD_S = 60.0
# a streaming Fetch is cancelled by PeerTier itself this long after its gRPC deadline, and
# left a second later: under heavy load one was seen blocked in ``initial_metadata()``
# minutes past its deadline, which held the fetch thread (and the request waiting on it)
FETCH_WATCHDOG_GRACE_S = 2.0


class PeerAuthError(ValueError):
    """A peer answered without proving that it holds the cluster secret."""


class PeerTier(Tier):
    """Other workers' pages, read over their KVTransfer service.

    ``contains`` asks each peer's ``Lookup`` for what the peers before it did not have
    (``timeout`` seconds per peer); ``get`` does the same, over the peer's data plane (plain
    TCP connections the ``DataPlane`` RPC names, pooled between calls) when it offers one and
    ``data_plane`` is on, else with ``Fetch``, all within one deadline of ``timeout``
    seconds per ``get``: the ``DataPlane`` RPC, the data-plane fetch and a ``Fetch`` fallback
    each get what the steps before them left, and pages nobody had time for are misses. A
    data plane that fails before any page arrived for a reason other than a deadline
    (refused, closed, a stale token after a restart) is not used for ``DATA_PLANE_RECHECK_S``
    and the call goes to ``Fetch`` (when time is left). A peer that fails (unreachable,
    deadline, a broken stream, on either path) gives misses, never an exception: pages that
    arrived whole are kept, one warning per incident (the next after it has answered again),
    ``metrics["errors"]`` counts every failed call, and the peer is skipped for
    ``cooldown_s`` so a dead address costs no time. ``healthy`` is False from a peer's fault
    until it answers again, or until ``DOWN_HOLD_S`` pass without another fault (nobody asked
    it). ``metrics["data_plane_pages"]`` /
    ``["grpc_pages"]`` count the pages each path delivered, ``["data_plane_bytes"]`` /
    ``["grpc_bytes"]`` their object bytes. Objects from the data plane are
    memoryviews into a reused receive pool (bytes-like, read by ``codec.decode`` as is; see
    ``DataPlaneClient``; an object longer than ``max_page_bytes`` is refused before memory
    is set aside for it), those from ``Fetch`` are ``bytes``.

    Every call carries the cluster ``identity`` (peers refuse cluster RPCs without it),
    and the peer must prove it too: ``Lookup``, ``Fetch`` and ``DataPlane`` answers count
    only with the peer's proof in their initial metadata, data-plane pages only with their
    MAC (``kvstore.dataplane.protocol``). A peer that cannot prove it is a fault like any
    other (``PeerAuthError``): misses, one warning, a cooldown.

    ``put`` pushes to the first peer when ``push_on_put`` (off by default: a worker's spill
    belongs in its own tiers); ``evict`` is a no-op (another worker's cache is its own).
    Thread-safe.
    """

    name = "peer"

    def __init__(
        self,
        addresses: str | Sequence[str],
        *,
        identity: ClusterIdentity,
        timeout: float = 5.0,
        cooldown_s: float = 1.0,
        push_on_put: bool = False,
        max_message_mb: int = 64,
        credentials: grpc.ChannelCredentials | None = None,
        data_plane: bool = True,
        max_page_bytes: int = MAX_PAGE_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        if not self.addresses:
            raise ValueError("PeerTier needs at least one peer address")
        if len(self.addresses) > MAX_PEERS:
            raise ValueError(f"at most {MAX_PEERS} peer addresses, got {len(self.addresses)}")
        if not isinstance(identity, ClusterIdentity):
            raise ValueError(
                f"identity must be the cluster's ClusterIdentity, got {type(identity).__name__}"
            )
        self.identity = identity
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.timeout = timeout
        self.cooldown_s = cooldown_s
        self.push_on_put = push_on_put
        self.data_plane = data_plane
        self.max_page_bytes = max_page_bytes
        self._clock = clock
        options = channel_options(max_message_mb)  # message limits, keepalive
        self._channels: list[grpc.Channel] = []
        self._stubs: list[pb_grpc.KVTransferStub] = []
        for addr in self.addresses:
            ch = (
                grpc.secure_channel(addr, credentials, options)
                if credentials is not None
                else grpc.insecure_channel(addr, options)
            )
            self._channels.append(ch)
            self._stubs.append(pb_grpc.KVTransferStub(ch))
        self._lock = threading.Lock()
        self._failing_until: dict[str, float] = {}  # address -> end of its cooldown
        self._failing: set[str] = set()  # addresses in an incident (warned once)
        self._last_fault: dict[str, float] = {}  # address in an incident -> its latest fault
        self._dp: dict[str, DataPlaneClient] = {}  # address -> its data plane, once known
        self._dp_recheck_at: dict[str, float] = {}  # address -> when to ask DataPlane again
        self.metrics: dict[str, int] = {
            "hits": 0,
            "misses": 0,
            "bytes_read": 0,
            "corrupt": 0,
            "errors": 0,
            "pushed": 0,
            "data_plane_pages": 0,
            "grpc_pages": 0,
            "data_plane_bytes": 0,  # object bytes received, per transport (Prometheus)
            "grpc_bytes": 0,
            "data_plane_fallbacks": 0,
            "fetches_left_behind": 0,  # Fetch reads abandoned past their deadline (_fetch)
        }

    @property
    def healthy(self) -> bool:
        """False while a peer is down: from a failed call until it answers again, or until
        ``DOWN_HOLD_S`` pass without another failed call. Exported as ``tier_up``."""
        since = self._clock() - DOWN_HOLD_S
        with self._lock:
            return not any(t > since for t in self._last_fault.values())

    # ------------------------------------------------------------ Tier

    def contains(self, hashes: Sequence[bytes]) -> list[bool]:
        found = [False] * len(hashes)
        pending = list(range(len(hashes)))
        for addr, stub in self._peers():
            if not pending:
                break
            try:
                md, nonce = self.identity.challenge()
                resp, call = stub.Lookup.with_call(
                    pb.LookupRequest(hashes=[hashes[i] for i in pending]),
                    timeout=self.timeout,
                    metadata=md,
                )
                self._check_proof(nonce, call)
                if len(resp.tiers) != len(pending):
                    raise ValueError(f"{len(resp.tiers)} answers for {len(pending)} hashes")
            except (grpc.RpcError, ValueError) as e:  # PeerAuthError is a ValueError
                self._fault(addr, "Lookup", e)
                continue
            self._ok(addr)
            for i, tier in zip(pending, resp.tiers):
                if tier:
                    found[i] = True
            pending = [i for i in pending if not found[i]]
        return found

    def get(self, hashes: Sequence[bytes]) -> list[bytes | memoryview | None]:
        out: list[bytes | memoryview | None] = [None] * len(hashes)
        pending = list(range(len(hashes)))
        deadline = time.monotonic() + self.timeout  # the whole call, every peer and path
        for addr, stub in self._peers():
            if not pending or time.monotonic() >= deadline:
                break  # no time left: the rest are misses (no fault of the peers not asked)
            asked = [hashes[i] for i in pending]
            try:
                got, error, what = self._fetch_any(addr, stub, asked, deadline)
            except Exception as e:  # a transport's bug must not become the caller's
                logger.debug("peer %s: get failed", addr, exc_info=e)
                got, error, what = {}, detached(e), "get"  # its frames may hold pages
            for j, obj in got.items():
                out[pending[j]] = obj
            if error is not None:
                self._fault(addr, what, error)
            else:
                self._ok(addr)
            pending = [i for i in pending if out[i] is None]
        hits = len(hashes) - len(pending)
        with self._lock:
            self.metrics["hits"] += hits
            self.metrics["misses"] += len(pending)
            self.metrics["bytes_read"] += sum(len(o) for o in out if o is not None)
        return out

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> list[bytes]:
        if self.push_on_put and items:
            self.push(items)
        return []  # the pages are another worker's, which reports them itself

    def evict(self, hashes: Sequence[bytes]) -> None:
        return None

    def close(self) -> None:
        with self._lock:
            clients, self._dp = list(self._dp.values()), {}
        for client in clients:
            client.close()
        for ch in self._channels:
            ch.close()

    def transport(self, peer: int = 0) -> str:
        """How ``get`` reaches that peer now: ``"data_plane"`` or ``"grpc"`` (before the
        first ``get``, what the peer's ``DataPlane`` RPC would make it; no fault is
        recorded)."""
        addr = self.addresses[peer]
        if not self.data_plane:
            return "grpc"
        with self._lock:
            if addr in self._dp:
                return "data_plane"
        deadline = time.monotonic() + self.timeout
        client, _ = self._data_plane_client(addr, self._stubs[peer], deadline)
        return "data_plane" if client is not None else "grpc"

    # ------------------------------------------------------------ beyond Tier

    def push(self, items: Sequence[tuple[bytes, bytes]], peer: int = 0) -> int:
        """Send pages to one peer's host tier; returns how many it accepted (0 on a fault)."""
        addr, stub = self.addresses[peer], self._stubs[peer]
        chunks = page_chunks((i, h, obj) for i, (h, obj) in enumerate(items))
        try:
            resp = stub.Push(chunks, timeout=self.timeout, metadata=self.identity.metadata())
        except grpc.RpcError as e:
            self._fault(addr, "Push", e)
            return 0
        self._ok(addr)
        with self._lock:
            self.metrics["pushed"] += resp.accepted
        return resp.accepted

    # ------------------------------------------------------------ internals

    def _peers(self) -> Iterator[tuple[str, pb_grpc.KVTransferStub]]:
        now = self._clock()
        for addr, stub in zip(self.addresses, self._stubs):
            with self._lock:
                skip = self._failing_until.get(addr, 0.0) > now
            if not skip:
                yield addr, stub

    def _fetch_any(
        self, addr: str, stub: pb_grpc.KVTransferStub, hashes: list[bytes], deadline: float
    ) -> tuple[dict[int, bytes | memoryview], Exception | None, str]:
        """One peer's objects by position, the fault that ended the call early (if any) and
        what failed: over the data plane when the peer has one, else (or when the data plane
        failed before any page arrived, and time is left) with Fetch; all by ``deadline``."""
        if self.data_plane:
            client, error = self._data_plane_client(addr, stub, deadline)
            if error is not None:
                return {}, error, "DataPlane"
            if client is not None:
                left = deadline - time.monotonic()
                if left <= 0:  # the DataPlane RPC took it all; the data plane is not at fault
                    return {}, TimeoutError(f"no time left of {self.timeout}s"), "data plane"
                res = client.fetch(hashes, left)
                with self._lock:
                    self.metrics["data_plane_pages"] += len(res.objects)
                    self.metrics["data_plane_bytes"] += _nbytes(res.objects)
                if res.error is None:
                    return res.objects, None, "data plane"
                self._forget_data_plane(addr, client, recheck_s=0.0 if res.answered else None)
                if not res.may_retry_elsewhere or time.monotonic() >= deadline:
                    return res.objects, res.error, "data plane"
                with self._lock:
                    self.metrics["data_plane_fallbacks"] += 1
                logger.info(
                    "peer %s: data plane failed before any page (%s); using Fetch", addr, res.error
                )
        left = deadline - time.monotonic()
        if left <= 0:
            return {}, TimeoutError(f"no time left of {self.timeout}s for Fetch"), "Fetch"
        got, error = self._fetch(stub, hashes, left)
        with self._lock:
            self.metrics["grpc_pages"] += len(got)
            self.metrics["grpc_bytes"] += _nbytes(got)
        return got, error, "Fetch"

    def _data_plane_client(
        self, addr: str, stub: pb_grpc.KVTransferStub, deadline: float
    ) -> tuple[DataPlaneClient | None, Exception | None]:
        """The peer's data-plane client, asking its ``DataPlane`` RPC (by ``deadline``) when
        not known yet; ``(None, None)``: it has none (or had one that failed lately), use
        Fetch."""
        with self._lock:
            client = self._dp.get(addr)
            if client is not None:
                return client, None
            if self._dp_recheck_at.get(addr, 0.0) > self._clock():
                return None, None
        host = _host_of(addr)
        if host is None:  # not host:port (a unix socket, a resolver URI): gRPC only
            return None, None
        left = deadline - time.monotonic()
        if left <= 0:
            return None, TimeoutError(f"no time left of {self.timeout}s for DataPlane")
        md, nonce = self.identity.challenge()
        try:
            info, call = stub.DataPlane.with_call(
                pb.DataPlaneRequest(version=DATA_PLANE_VERSION), timeout=left, metadata=md
            )
            self._check_proof(nonce, call)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # a worker older than the data plane
                return self._no_data_plane(addr), None
            return None, e
        except PeerAuthError as e:
            return None, e
        if not info.port or info.version != DATA_PLANE_VERSION or len(info.token) != TOKEN_BYTES:
            return self._no_data_plane(addr), None
        client = DataPlaneClient(
            host,
            info.port,
            info.token,
            key=self.identity.data_plane_key,
            max_pages=info.max_pages or 1,
            connect_timeout=min(self.timeout, 2.0),
            max_object_bytes=self.max_page_bytes,
        )
        with self._lock:
            if self._dp.setdefault(addr, client) is not client:  # another thread won
                client.close()
                client = self._dp[addr]
        return client, None

    def _no_data_plane(self, addr: str) -> None:
        with self._lock:
            self._dp_recheck_at[addr] = self._clock() + DATA_PLANE_RECHECK_S
        return None

    def _forget_data_plane(
        self, addr: str, client: DataPlaneClient, recheck_s: float | None
    ) -> None:
        """Drop a data plane that failed; ask the peer again after ``recheck_s`` (default
        ``DATA_PLANE_RECHECK_S``), so a restarted peer's new port and token are learnt."""
        with self._lock:
            if self._dp.get(addr) is client:
                del self._dp[addr]
            wait = DATA_PLANE_RECHECK_S if recheck_s is None else recheck_s
            self._dp_recheck_at[addr] = self._clock() + wait
        client.close()

    def _fetch(
        self, stub: pb_grpc.KVTransferStub, hashes: list[bytes], timeout: float
    ) -> tuple[dict[int, bytes], Exception | None]:
        """The complete, intact objects of one Fetch by position, and the fault if the call
        failed part-way (what arrived before it is kept: every object is CRC-checked).

        The call is read on a thread of its own, and this one waits for it at most
        ``timeout + FETCH_WATCHDOG_GRACE_S`` (then cancels the call) plus one second more
        (then leaves it): grpc's blocking reads wait on events its core delivers, and a read
        that never gets its event (seen under heavy load, minutes past the deadline, even
        after ``cancel``) must not hold the fetch, and the request waiting on it, with it. A
        read left behind keeps no page it got (only the partial page it may be assembling),
        is counted in ``metrics["fetches_left_behind"]`` and logged."""
        got: dict[int, bytes] = {}
        lock = threading.Lock()  # ``got`` and ``state``: the reader may outlive this call
        state: dict = {"error": None, "left": False}
        finished = threading.Event()
        asm = PageAssembler(self.max_page_bytes)
        md, nonce = self.identity.challenge()
        call = stub.Fetch(pb.FetchRequest(hashes=hashes), timeout=timeout, metadata=md)

        def read() -> None:
            try:
                self._check_proof(nonce, call)  # before a single piece is taken
                for chunk in call:
                    for piece in chunk.pieces:
                        if piece.index >= len(hashes) or piece.hash != hashes[piece.index]:
                            raise ValueError(f"piece for an unrequested page (index {piece.index})")
                        done = asm.add(piece.index, piece)
                        if done is not None and done[0]:
                            with lock:
                                if state["left"]:  # the caller went on without this read
                                    return
                                got[piece.index] = done[1]
            except (grpc.RpcError, ValueError) as e:
                call.cancel()
                state["error"] = e
            except Exception as e:  # a bug here must reach the caller, not kill a thread
                call.cancel()
                state["error"] = detached(e)
            finally:
                if asm.corrupt:
                    with self._lock:
                        self.metrics["corrupt"] += asm.corrupt
                finished.set()

        reader = threading.Thread(target=read, name="kvmesh-peer-fetch", daemon=True)
        reader.start()
        if not finished.wait(timeout + FETCH_WATCHDOG_GRACE_S):
            call.cancel()
            if not finished.wait(1.0):
                with lock:  # the reader keeps nothing it got: the caller owns those pages
                    state["left"] = True
                    kept = dict(got)
                    got.clear()
                with self._lock:
                    self.metrics["fetches_left_behind"] += 1
                    n_left = self.metrics["fetches_left_behind"]
                logger.warning(
                    "a Fetch of %d pages is still being read %.3gs after it began (deadline "
                    "%.3gs), even after a cancel: left behind with its thread (%d so far in "
                    "this process); its %d whole pages are kept, the rest are misses",
                    len(hashes),
                    timeout + FETCH_WATCHDOG_GRACE_S + 1.0,
                    timeout,
                    n_left,
                    len(kept),
                )
                return kept, TimeoutError(
                    f"Fetch still running {timeout + FETCH_WATCHDOG_GRACE_S + 1.0:.3g}s after "
                    f"it began (deadline {timeout:.3g}s), even after a cancel: left behind"
                )
        if state["error"] is not None and not isinstance(
            state["error"], (grpc.RpcError, ValueError)
        ):
            raise state["error"]
        return got, state["error"]

    def _check_proof(self, nonce: str, call) -> None:
        """Raise PeerAuthError unless the call's initial metadata proves the peer a member
        (the call's own error instead, when it failed before sending any)."""
        if self.identity.verify_server(nonce, call.initial_metadata()):
            return
        if isinstance(call, grpc.Future) and call.done() and call.code() != grpc.StatusCode.OK:
            raise call  # a failed streaming call is its own RpcError
        raise PeerAuthError("the peer did not prove that it holds the cluster secret")

    def _fault(self, addr: str, what: str, err: Exception) -> None:
        if isinstance(err, grpc.RpcError):
            code, detail = err.code().name, err.details()
        elif isinstance(err, TimeoutError):  # the data plane's deadline, named as gRPC's
            code, detail = "DEADLINE_EXCEEDED", str(err) or f"no answer within {self.timeout}s"
        elif isinstance(err, PeerAuthError):
            code, detail = "UNAUTHENTICATED_PEER", str(err)
        elif isinstance(err, OSError):  # the data plane's connection: refused, reset, closed
            code, detail = "UNAVAILABLE", str(err)
        else:
            code, detail = "BAD_REPLY", str(err)
        with self._lock:
            self.metrics["errors"] += 1
            now = self._clock()
            self._failing_until[addr] = now + self.cooldown_s
            self._last_fault[addr] = now
            first = addr not in self._failing
            self._failing.add(addr)
        if first:
            logger.warning(
                "peer %s: %s failed (%s: %s); its pages count as misses", addr, what, code, detail
            )
        else:
            logger.debug("peer %s: %s failed again (%s)", addr, what, code)

    def _ok(self, addr: str) -> None:
        if addr in self._failing:
            with self._lock:
                self._failing.discard(addr)
                self._failing_until.pop(addr, None)
                self._last_fault.pop(addr, None)
            logger.info("peer %s answers again", addr)


def _host_of(address: str) -> str | None:
    """The host of a ``host:port`` or ``[v6]:port`` gRPC target; None for other targets."""
    if "/" in address or address.startswith("unix:"):
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]")


def _nbytes(objects: dict[int, bytes | memoryview]) -> int:
    return sum(memoryview(o).nbytes for o in objects.values())
