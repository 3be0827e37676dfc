"""Pages between workers: the KVTransfer framing, the PageSource a server serves from, and
PeerTier, the tier that reads another worker's pages: over the peer's raw-TCP data plane
(``kvstore.dataplane``) when it offers one, else over gRPC ``Fetch``.

On the wire a page is its encoded page object (``kvstore.codec``), cut into ``PagePiece``s so
that no ``PageChunk`` message exceeds 1 MiB. Each piece carries the object's total size and
the CRC-32 of the whole object; the receiver reassembles the pieces in order and drops an
object whose size or CRC does not match (a miss, never wrong bytes). The codec's own header
and checksum are checked again by whoever decodes the page (``TieredStore``).
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import Protocol, runtime_checkable

import grpc

from kvmesh.kvstore.codec import PageCodecError, PageSpec, decode, read_header
from kvmesh.kvstore.dataplane import TOKEN_BYTES, DataPlaneClient, detached
from kvmesh.kvstore.dataplane import VERSION as DATA_PLANE_VERSION
from kvmesh.kvstore.hashing import PAGE_HASH_BYTES
from kvmesh.kvstore.tier import Tier
from kvmesh.protos.kvmesh.v1 import kv_transfer_pb2 as pb
from kvmesh.protos.kvmesh.v1 import kv_transfer_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

MAX_CHUNK_BYTES = 1 << 20  # the largest serialized PageChunk either side sends
MAX_PAGE_BYTES = 1 << 30  # a receiver refuses to buffer an object claiming more than this
# bounds on protobuf framing: a piece's tag and length varint inside its chunk, and the same
# for the data field inside a piece (1 + at most 5 bytes each)
_EMBED = 6
_DATA_FIELD = 6
_MIN_PIECE_DATA = 4096  # start a new chunk rather than send a sliver of an object
# how long a peer's "no data plane" (or a data plane that failed before any page) holds
# before PeerTier asks its DataPlane RPC again
DATA_PLANE_RECHECK_S = 10.0


def crc32(obj: bytes | memoryview) -> int:
    return zlib.crc32(obj) & 0xFFFFFFFF


# ---------------------------------------------------------------- the server's page source


@runtime_checkable
class PageSource(Protocol):
    """Where a worker's KVTransfer service finds pages and stores pushed ones.

    Methods are called from a thread pool, never from the event loop, and may block. The
    engine-side source reads device pages on the engine thread; ``TierPageSource`` serves
    any ``Tier``.
    """

    def lookup(self, hashes: Sequence[bytes]) -> list[str | None]:
        """For each hash, the name of the tier that holds it, or ``None``. No LRU change."""

    def fetch(self, hashes: Sequence[bytes]) -> list[bytes | None]:
        """For each hash, its encoded page object, or ``None`` for a miss."""

    def accept(self, items: list[tuple[bytes, bytes]]) -> int:
        """Validate and store pushed ``(hash, object)`` pairs; returns how many were stored."""


class TierPageSource:
    """A PageSource over tiers, first hit wins; pushed pages go to the first tier.

    Pushed objects must be page objects of the codec (framing, magic, version); with a
    ``spec`` they must also decode under it (model, cache format, shape, checksum), so a
    peer can never plant foreign KV in this worker's tiers.
    """

    def __init__(self, tiers: Tier | Sequence[Tier], *, spec: PageSpec | None = None) -> None:
        self.tiers = [tiers] if isinstance(tiers, Tier) else list(tiers)
        if not self.tiers:
            raise ValueError("TierPageSource needs at least one tier")
        self.spec = spec

    def lookup(self, hashes: Sequence[bytes]) -> list[str | None]:
        where: list[str | None] = [None] * len(hashes)
        pending = list(range(len(hashes)))
        for tier in self.tiers:
            if not pending:
                break
            found = tier.contains([hashes[i] for i in pending])
            for i, hit in zip(pending, found):
                if hit:
                    where[i] = tier.name
            pending = [i for i, hit in zip(pending, found) if not hit]
        return where

    def fetch(self, hashes: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = [None] * len(hashes)
        pending = list(range(len(hashes)))
        for tier in self.tiers:
            if not pending:
                break
            objs = tier.get([hashes[i] for i in pending])
            for i, obj in zip(pending, objs):
                out[i] = obj
            pending = [i for i, obj in zip(pending, objs) if obj is None]
        return out

    def accept(self, items: list[tuple[bytes, bytes]]) -> int:
        good = [(h, obj) for h, obj in items if self._valid(h, obj)]
        if good:
            self.tiers[0].put(good)
        return len(good)

    def _valid(self, h: bytes, obj: bytes) -> bool:
        try:
            if self.spec is not None:
                decode(self.spec, obj)
            else:
                read_header(obj)
        except PageCodecError as e:
            logger.warning("pushed page %s rejected: %s", h.hex(), e)
            return False
        return True


# ---------------------------------------------------------------- framing


def page_chunks(
    pages: Iterable[tuple[int, bytes, bytes | None]], max_bytes: int = MAX_CHUNK_BYTES
) -> Iterator[pb.PageChunk]:
    """``(index, hash, object or None)`` -> PageChunks of at most ``max_bytes`` serialized.

    Pieces follow the input order; an object is cut into consecutive pieces (offsets
    increasing) when it does not fit the room left in a chunk. ``None`` becomes a piece with
    ``found=False``.
    """
    chunk = pb.PageChunk()
    size = 0
    for index, h, obj in pages:
        if obj is None:
            piece = pb.PagePiece(hash=h, index=index, found=False)
            need = piece.ByteSize() + _EMBED
            if size + need > max_bytes and chunk.pieces:
                yield chunk
                chunk, size = pb.PageChunk(), 0
            chunk.pieces.append(piece)
            size += need
            continue
        view = memoryview(obj).cast("B")
        total = view.nbytes
        crc = crc32(view)
        offset = 0
        while True:
            header = pb.PagePiece(
                hash=h, index=index, found=True, total_size=total, offset=offset, crc32=crc
            )
            room = max_bytes - size - header.ByteSize() - _DATA_FIELD - _EMBED
            left = total - offset
            whole_fits_alone = offset == 0 and left <= max_bytes - header.ByteSize() - 64
            if chunk.pieces and (
                room < min(left, _MIN_PIECE_DATA) or (whole_fits_alone and room < left)
            ):  # a page that fits a chunk of its own is not split: one piece, no joins
                yield chunk
                chunk, size = pb.PageChunk(), 0
                continue
            if room < 1 and left > 0:
                raise ValueError(f"max_bytes={max_bytes} leaves no room for page data")
            n = min(left, room)
            header.data = view[offset : offset + n].tobytes()
            chunk.pieces.append(header)
            size += header.ByteSize() + _EMBED
            offset += n
            if offset >= total:
                break
    if chunk.pieces:
        yield chunk


class PageAssembler:
    """Reassembles pieces into objects, keyed by whatever the caller chooses (the index in a
    Fetch, the hash in a Push). Pieces of one object must arrive in order."""

    def __init__(self, max_page_bytes: int = MAX_PAGE_BYTES) -> None:
        self.max_page_bytes = max_page_bytes
        self._partial: dict[Hashable, tuple[bytearray, int, int]] = {}
        self.corrupt = 0  # objects dropped: out-of-order piece, size or CRC mismatch

    def add(self, key: Hashable, piece: pb.PagePiece) -> tuple[bool, bytes | None] | None:
        """Feed one piece. Returns None while the object is incomplete, ``(True, object)``
        when it is complete and intact, ``(False, None)`` for a miss or a dropped object."""
        if not piece.found:
            self._partial.pop(key, None)
            return False, None
        if piece.offset == 0 and len(piece.data) == piece.total_size and key not in self._partial:
            # the whole object in one piece (the usual case): no reassembly copies
            if piece.total_size > self.max_page_bytes:
                return self._drop(key, f"object of {piece.total_size} bytes is too big")
            if crc32(piece.data) != piece.crc32:
                return self._drop(key, "CRC-32 mismatch")
            return True, piece.data
        buf, total, crc = self._partial.get(key) or (bytearray(), piece.total_size, piece.crc32)
        if (
            piece.offset != len(buf)
            or piece.total_size != total
            or piece.crc32 != crc
            or total > self.max_page_bytes
            or len(buf) + len(piece.data) > total
        ):
            return self._drop(key, f"bad piece at offset {piece.offset} of {total} bytes")
        buf += piece.data
        if len(buf) < total:
            self._partial[key] = (buf, total, crc)
            return None
        self._partial.pop(key, None)
        obj = bytes(buf)
        if crc32(obj) != crc:
            return self._drop(key, "CRC-32 mismatch")
        return True, obj

    def _drop(self, key: Hashable, why: str) -> tuple[bool, None]:
        self._partial.pop(key, None)
        self.corrupt += 1
        logger.warning("page transfer: dropping object %r: %s", key, why)
        return False, None

    def incomplete(self) -> list[Hashable]:
        """Keys whose objects were started but never finished."""
        return list(self._partial)


# ---------------------------------------------------------------- the peer tier


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
    ``cooldown_s`` so a dead address costs no time. ``metrics["data_plane_pages"]`` /
    ``["grpc_pages"]`` count the pages each path delivered. Objects from the data plane are
    memoryviews into a reused receive pool (bytes-like, read by ``codec.decode`` as is; see
    ``DataPlaneClient``; an object longer than ``max_page_bytes`` is refused before memory
    is set aside for it), those from ``Fetch`` are ``bytes``.

    ``put`` pushes to the first peer when ``push_on_put`` (off by default: a worker's spill
    belongs in its own tiers); ``evict`` is a no-op (another worker's cache is its own).
    Thread-safe.
    """

    name = "peer"

    def __init__(
        self,
        addresses: str | Sequence[str],
        *,
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
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.timeout = timeout
        self.cooldown_s = cooldown_s
        self.push_on_put = push_on_put
        self.data_plane = data_plane
        self.max_page_bytes = max_page_bytes
        self._clock = clock
        limit = max_message_mb * 2**20
        options = [
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
        ]
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
            "data_plane_fallbacks": 0,
        }

    # ------------------------------------------------------------ Tier

    def contains(self, hashes: Sequence[bytes]) -> list[bool]:
        found = [False] * len(hashes)
        pending = list(range(len(hashes)))
        for addr, stub in self._peers():
            if not pending:
                break
            try:
                resp = stub.Lookup(
                    pb.LookupRequest(hashes=[hashes[i] for i in pending]), timeout=self.timeout
                )
                if len(resp.tiers) != len(pending):
                    raise ValueError(f"{len(resp.tiers)} answers for {len(pending)} hashes")
            except (grpc.RpcError, ValueError) as e:
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

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        if not self.push_on_put or not items:
            return
        self.push(items)

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
            resp = stub.Push(chunks, timeout=self.timeout)
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
        try:
            info = stub.DataPlane(pb.DataPlaneRequest(version=DATA_PLANE_VERSION), timeout=left)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # a worker older than the data plane
                return self._no_data_plane(addr), None
            return None, e
        if not info.port or info.version != DATA_PLANE_VERSION or len(info.token) != TOKEN_BYTES:
            return self._no_data_plane(addr), None
        client = DataPlaneClient(
            host,
            info.port,
            info.token,
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
        failed part-way (what arrived before it is kept: every object is CRC-checked)."""
        got: dict[int, bytes] = {}
        asm = PageAssembler(self.max_page_bytes)
        call = stub.Fetch(pb.FetchRequest(hashes=hashes), timeout=timeout)
        try:
            for chunk in call:
                for piece in chunk.pieces:
                    if piece.index >= len(hashes) or piece.hash != hashes[piece.index]:
                        raise ValueError(f"piece for an unrequested page (index {piece.index})")
                    done = asm.add(piece.index, piece)
                    if done is not None and done[0]:
                        got[piece.index] = done[1]
        except (grpc.RpcError, ValueError) as e:
            call.cancel()
            return got, e
        finally:
            if asm.corrupt:
                with self._lock:
                    self.metrics["corrupt"] += asm.corrupt
        return got, None

    def _fault(self, addr: str, what: str, err: Exception) -> None:
        if isinstance(err, grpc.RpcError):
            code, detail = err.code().name, err.details()
        elif isinstance(err, TimeoutError):  # the data plane's deadline, named as gRPC's
            code, detail = "DEADLINE_EXCEEDED", str(err) or f"no answer within {self.timeout}s"
        elif isinstance(err, OSError):  # the data plane's connection: refused, reset, closed
            code, detail = "UNAVAILABLE", str(err)
        else:
            code, detail = "BAD_REPLY", str(err)
        with self._lock:
            self.metrics["errors"] += 1
            self._failing_until[addr] = self._clock() + self.cooldown_s
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
            logger.info("peer %s answers again", addr)


def _host_of(address: str) -> str | None:
    """The host of a ``host:port`` or ``[v6]:port`` gRPC target; None for other targets."""
    if "/" in address or address.startswith("unix:"):
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]")


def check_hashes(hashes: Sequence[bytes]) -> None:
    """Raise ValueError naming the first hash that is not a page hash."""
    for i, h in enumerate(hashes):
        if len(h) != PAGE_HASH_BYTES:
            raise ValueError(f"hash {i} is {len(h)} bytes; page hashes are {PAGE_HASH_BYTES} bytes")
