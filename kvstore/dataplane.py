"""The page data plane: encoded page objects over a plain TCP connection.

gRPC stays the control plane (``KVTransfer.DataPlane`` tells a client the port and a token);
page bytes move over TCP without protobuf framing, HTTP/2 flow control or an event loop in
between, the way NVIDIA Dynamo's NIXL or Mooncake's transfer engine split the two. grpcio
streams reach ~0.4 GB/s on a loopback that copies 2.5 GB/s. Here the server sends each
object with one ``sendmsg`` (header and object, no join), and the client receives it with
one ``recv_into`` straight into memory it hands to the caller: slices of anonymous mappings
of up to ``ARENA_BYTES``, populated when mapped (``MAP_POPULATE``) and reused once every
object cut from them is gone (up to ``ARENA_KEEP_BYTES`` kept idle per process), the way
RDMA transfer engines receive into registered pools. Touching fresh memory costs as much as
the copy itself (measured on the 2-core dev VM: receiving into a new ``bytes`` per page ran
at half the speed of receiving into memory touched before). Where a mapping's reuse cannot
be detected (no ``mremap``: macOS) or private anonymous mappings cannot be asked for
(Windows), each object is received into a ``bytearray`` of its own instead.

Wire format, version 1 (integers little-endian; docs/grpc.md, "Data plane")::

    request  = "KVDP" | u16 version | u16 0 | 16-byte token | u32 count | count x 16-byte hash
    response = count x (u32 index | u8 found | 3 zero bytes | u64 length | length bytes)

The server answers every requested page, in request order: ``found`` 1 and the page's encoded
object (``kvstore.codec``), or ``found`` 0 and length 0. A connection carries any number of
requests, one after the other. A request with a wrong magic, version or token, too many
hashes, or bytes that are not a request closes the connection; so does a page source that
fails (the client counts the pages it did not get as misses).

Time limits are whole-message deadlines, not per-syscall timeouts: once the first byte of a
request arrived, the rest of it (head and hashes) must arrive within ``request_timeout_s``;
each send (one page's header and object, with the misses before it) must be taken by the
client within ``io_timeout_s``; a connection may wait ``idle_timeout_s`` between requests.
At ``max_connections`` a new connection closes the one that has waited longest between
requests (a client re-opens a pooled connection it finds closed); only when every
connection is busy with a request is the newcomer closed.

Integrity: objects are length-framed, so a truncated one never completes (a miss); TCP's
checksums cover the bytes on the wire; and, as for pages that came through ``Fetch``, the
codec's header and xxh3-128 checksum are checked by whoever decodes the page
(``TieredStore``): a corrupt or foreign object is a miss there, never KV. Like every tier,
the client moves objects as opaque bytes.

The connection is not encrypted, and the token only proves that the client could talk to
the gRPC service; that is why a worker whose gRPC port uses TLS runs no data plane unless
told to.
"""

from __future__ import annotations

import hmac
import logging
import mmap
import secrets
import select
import socket
import struct
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from kvmesh.kvstore.hashing import PAGE_HASH_BYTES

if TYPE_CHECKING:
    from kvmesh.kvstore.peer import PageSource

logger = logging.getLogger(__name__)

MAGIC = b"KVDP"
VERSION = 1
TOKEN_BYTES = 16
MAX_REQUEST_PAGES = 1 << 16  # 1 MiB of hashes: the most one request may name
MAX_OBJECT_BYTES = 1 << 30  # a client refuses an object claiming more than this
REQUEST_HEAD = struct.Struct("<4sHH16sI")  # magic, version, reserved, token, count
PAGE_HEAD = struct.Struct("<IB3xQ")  # index, found, pad, length
MISS, FOUND = 0, 1

ARENA_BYTES = 64 << 20  # receive mappings are 1 MiB to 64 MiB (powers of two), or one object
ARENA_KEEP_BYTES = 512 << 20  # idle receive mappings kept for reuse, per process

# SO_RCVTIMEO/SO_SNDTIMEO take a struct timeval (two longs) on Linux and macOS, a DWORD of
# milliseconds on Windows
_TIMEVAL = struct.Struct("ll")
_WAITALL = getattr(socket, "MSG_WAITALL", 0)
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)
_SENDMSG = hasattr(socket.socket, "sendmsg")  # not on Windows
_E = TypeVar("_E", bound=BaseException)


class DataPlaneError(ConnectionError):
    """A data-plane connection that could not be opened, was closed early, or carried bytes
    that break the protocol."""


class _Closed(Exception):
    """Server side: end the connection quietly (the client is done, the server is draining,
    or the page source failed and that was logged already)."""


# ---------------------------------------------------------------- the server


@dataclass(eq=False)
class _Conn:
    """A served connection; ``idle_since`` is when it began to wait for a request (None
    while one is read or answered), ``evicted`` is set when a newcomer took its slot."""

    sock: socket.socket
    idle_since: float | None
    evicted: bool = False


class DataPlaneServer:
    """Serves page objects from a ``PageSource`` over TCP: one accept thread, one thread per
    connection (plus, once it serves a request of more than ``batch_pages`` pages, a second
    one that asks the source for the next batch), at most ``max_connections`` connections.

    The source is asked for ``batch_pages`` pages at a time, as the gRPC ``Fetch`` asks it,
    the next batch while the connection's thread sends the current one (an engine source
    copies device pages on its engine thread meanwhile); ``None`` serves misses only.
    ``token`` is drawn per server (``secrets``) unless given.

    Deadlines (seconds, whole messages; see the module docstring): ``idle_timeout_s``
    between requests, ``request_timeout_s`` for the rest of a request once its first byte
    arrived, ``io_timeout_s`` for each send. A new connection at ``max_connections`` closes
    the longest-idle one; it is closed itself only when none is idle.
    """

    def __init__(
        self,
        source: PageSource | None,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        token: bytes | None = None,
        max_pages: int = MAX_REQUEST_PAGES,
        batch_pages: int = 32,
        max_connections: int = 64,
        idle_timeout_s: float = 600.0,
        request_timeout_s: float = 10.0,
        io_timeout_s: float = 60.0,
    ) -> None:
        if not 0 <= port < 65536:
            raise ValueError(f"data-plane port must be in [0, 65535], got {port}")
        if token is not None and len(token) != TOKEN_BYTES:
            raise ValueError(f"token must be {TOKEN_BYTES} bytes, got {len(token)}")
        if not 1 <= max_pages <= MAX_REQUEST_PAGES:
            raise ValueError(f"max_pages must be in [1, {MAX_REQUEST_PAGES}], got {max_pages}")
        if batch_pages < 1 or max_connections < 1:
            raise ValueError(
                f"batch_pages and max_connections must be >= 1, got {batch_pages}, "
                f"{max_connections}"
            )
        if min(idle_timeout_s, request_timeout_s, io_timeout_s) <= 0:
            raise ValueError(
                "idle_timeout_s, request_timeout_s and io_timeout_s must be > 0, got "
                f"{idle_timeout_s}, {request_timeout_s}, {io_timeout_s}"
            )
        self.source = source
        self.host = host.strip("[]")
        self.port = port
        self.token = token if token is not None else secrets.token_bytes(TOKEN_BYTES)
        self.max_pages = max_pages
        self.batch_pages = batch_pages
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self.request_timeout_s = request_timeout_s
        self.io_timeout_s = io_timeout_s
        self.draining = False  # set: new requests are refused (their connection is closed)
        self.connections = 0  # connections accepted
        self.rejected = 0  # connections closed for a bad request
        self.evicted = 0  # idle connections closed to make room for a new one
        self.refused = 0  # new connections closed: every slot busy, or no thread for it
        self.timed_out = 0  # connections closed because a deadline passed
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
        self._busy = 0  # requests being answered
        self._closed = False
        self._thread_warned = False

    @property
    def busy(self) -> int:
        """Requests being answered right now."""
        return self._busy

    @property
    def open_connections(self) -> int:
        """Connections being served (each holds a thread)."""
        with self._lock:
            return len(self._conns)

    def start(self) -> int:
        """Bind, listen and start accepting; returns the bound port."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(128)
        except OSError:
            sock.close()
            raise
        self._listener = sock
        self.port = sock.getsockname()[1]
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name="kvmesh-dataplane", daemon=True
        )
        try:
            self._accept_thread.start()
        except BaseException:
            sock.close()
            raise
        logger.info("page data plane on %s:%d", self.host, self.port)
        return self.port

    def stop(self) -> None:
        """Stop accepting and cut every connection (a transfer in flight ends: its client
        counts the pages it did not get as misses). Idempotent; does not wait for page
        source calls in flight."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for conn in self._conns:
                _shutdown(conn.sock)  # wakes the connection's thread
        if self._listener is not None:
            _shutdown(self._listener)  # wakes accept() on Linux
            self._listener.close()
        if self._accept_thread is not None:
            self._accept_thread.join(2.0)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, addr = self._listener.accept()
            except OSError as e:
                if self._closed:
                    return
                logger.warning("data plane: accept failed: %s", e)
                time.sleep(0.1)  # e.g. out of file descriptors: do not spin
                continue
            try:
                self._admit(sock, addr)
            except Exception:  # never let one connection end the accept loop
                logger.exception("data plane: could not serve the connection from %s", addr)
                sock.close()

    def _admit(self, sock: socket.socket, addr) -> None:
        conn = _Conn(sock, time.monotonic())
        with self._lock:
            admit = not self._closed
            if admit and len(self._conns) >= self.max_connections:
                idle = [c for c in self._conns if c.idle_since is not None]
                if idle:  # the longest-idle connection makes room (its client re-opens)
                    victim = min(idle, key=lambda c: c.idle_since)
                    victim.evicted = True
                    self._conns.discard(victim)
                    _shutdown(victim.sock)  # its thread wakes, sees EOF and closes it
                    self.evicted += 1
                else:
                    admit = False
                    self.refused += 1
            if admit:
                self._conns.add(conn)
                self.connections += 1
        if not admit:
            sock.close()
            return
        thread = threading.Thread(
            target=self._serve, args=(conn, addr), name="kvmesh-dataplane-conn", daemon=True
        )
        try:
            thread.start()
        except Exception as e:  # RuntimeError "can't start new thread": out of threads
            with self._lock:
                self._conns.discard(conn)
                self.refused += 1
                warn, self._thread_warned = not self._thread_warned, True
                sock.close()
            if warn:
                logger.warning(
                    "data plane: cannot start a thread for a connection (%s); closing it "
                    "(further ones are logged at debug level)",
                    e,
                )
            else:
                logger.debug("data plane: cannot start a connection thread: %s", e)

    def _serve(self, conn: _Conn, addr) -> None:
        sock = conn.sock
        prefetch = ThreadPoolExecutor(1, thread_name_prefix="kvmesh-dataplane-fetch")
        try:
            sock.setblocking(True)  # timeouts are SO_RCVTIMEO / SO_SNDTIMEO: fewer syscalls
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while not self._closed:
                self._answer_one(conn, prefetch)
        except _Closed:
            pass
        except DataPlaneError as e:
            with self._lock:
                self.rejected += 1
            logger.warning("data plane: closing the connection from %s: %s", addr, e)
        except TimeoutError as e:
            with self._lock:
                self.timed_out += 1
            logger.debug("data plane: connection from %s timed out: %s", addr, e)
        except OSError as e:  # reset, server stopping
            logger.debug("data plane: connection from %s ended: %s", addr, e)
        except Exception:
            logger.exception("data plane: serving %s failed; closing the connection", addr)
        finally:
            prefetch.shutdown(wait=False, cancel_futures=True)
            with self._lock:
                self._conns.discard(conn)
                sock.close()

    def _answer_one(self, conn: _Conn, prefetch: ThreadPoolExecutor) -> None:
        sock = conn.sock
        head = bytearray(REQUEST_HEAD.size)
        view = memoryview(head)
        _set_timeout(sock, socket.SO_RCVTIMEO, self.idle_timeout_s)
        if not _recv_into(sock, view[:1], eof_ok=True):
            raise _Closed()  # the client is done, or a newcomer took this idle slot
        with self._lock:
            if conn.evicted:
                raise _Closed()
            conn.idle_since = None
        deadline = time.monotonic() + self.request_timeout_s  # the rest of the request
        _recv_into(sock, view[1:], deadline=deadline)
        magic, version, _, token, count = REQUEST_HEAD.unpack(head)
        if magic != MAGIC:
            raise DataPlaneError(f"not a data-plane request (magic {magic!r})")
        if version != VERSION:
            raise DataPlaneError(f"protocol version {version}, this server speaks {VERSION}")
        if not hmac.compare_digest(token, self.token):
            raise DataPlaneError("wrong token")
        if count > self.max_pages:
            raise DataPlaneError(f"{count} hashes in one request, at most {self.max_pages}")
        if self.draining or self._closed:
            raise _Closed()
        raw = bytearray(count * PAGE_HASH_BYTES)
        _recv_into(sock, memoryview(raw), deadline=deadline)
        hashes = [bytes(raw[i : i + PAGE_HASH_BYTES]) for i in range(0, len(raw), PAGE_HASH_BYTES)]
        starts = range(0, count, self.batch_pages)
        batches = [hashes[i : i + self.batch_pages] for i in starts]
        with self._lock:
            self._busy += 1
        ahead: Future | None = None
        misses = bytearray()  # headers of misses, sent with the next object or at the end
        try:
            for k, (start, batch) in enumerate(zip(starts, batches)):
                objs = ahead.result() if ahead is not None else self._fetch(batch)
                ahead = None
                if k + 1 < len(batches):
                    try:
                        ahead = prefetch.submit(self._fetch, batches[k + 1])
                    except RuntimeError:  # no thread for it: the next batch is fetched inline
                        ahead = None
                for j, obj in enumerate(objs):
                    if obj is None:
                        misses += PAGE_HEAD.pack(start + j, MISS, 0)
                        continue
                    body = memoryview(obj).cast("B")  # bytes, not items: the framed length
                    page = PAGE_HEAD.pack(start + j, FOUND, body.nbytes)
                    _send_all(sock, [misses, page, body], time.monotonic() + self.io_timeout_s)
                    misses = bytearray()
            if misses:
                _send_all(sock, [misses], time.monotonic() + self.io_timeout_s)
        finally:
            if ahead is not None:
                ahead.cancel()
            with self._lock:
                self._busy -= 1
        with self._lock:
            conn.idle_since = time.monotonic()  # answered: waiting for the next request

    def _fetch(self, batch: list[bytes]) -> list[bytes | None]:
        if self.source is None:
            return [None] * len(batch)
        try:
            objs = self.source.fetch(batch)
            if len(objs) != len(batch):
                raise RuntimeError(f"page source answered {len(objs)} of {len(batch)} pages")
        except Exception:  # the client sees the connection close: the rest are misses
            logger.exception("data plane: page source fetch failed; closing the connection")
            raise _Closed() from None
        return objs


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # not connected any more, or closed
        pass


# ---------------------------------------------------------------- the client


@dataclass
class DataPlaneFetch:
    """What one ``DataPlaneClient.fetch`` got: whole objects by position in the request,
    the error that ended it early (if any; without its traceback, so that no receive
    memory stays referenced from it), and whether any page arrived before it."""

    objects: dict[int, memoryview] = field(default_factory=dict)
    error: Exception | None = None
    answered: bool = False

    @property
    def may_retry_elsewhere(self) -> bool:
        """Failed before any page arrived, for a reason other than a deadline (the call's,
        or the connect timeout): a caller may ask the same peer over gRPC instead."""
        return (
            self.error is not None
            and not self.answered
            and not isinstance(self.error, TimeoutError)
        )


class DataPlaneClient:
    """One peer's data plane over a small pool of persistent connections: a call takes an
    idle one (or opens one), and gives it back when the call succeeded; at most
    ``max_idle`` are kept between calls, and a connection that saw any error is closed.
    Thread-safe: concurrent calls use connections of their own.

    Objects come back as memoryviews into receive mappings of at most ``ARENA_BYTES``
    (bytes-like: ``codec.decode`` reads them, ``bytes(obj)`` copies one out). A mapping goes
    back to the pool when the last object cut from it is dropped, so a caller that keeps
    one object keeps its whole mapping from reuse. An object claiming more than
    ``max_object_bytes`` is refused before any memory is set aside for it.
    """

    def __init__(
        self,
        host: str,
        port: int,
        token: bytes,
        *,
        max_pages: int = MAX_REQUEST_PAGES,
        connect_timeout: float = 2.0,
        max_object_bytes: int = MAX_OBJECT_BYTES,
        max_idle: int = 2,
    ) -> None:
        if len(token) != TOKEN_BYTES:
            raise ValueError(f"token must be {TOKEN_BYTES} bytes, got {len(token)}")
        self.host = host.strip("[]")
        self.port = port
        self.token = token
        self.max_pages = max(1, min(max_pages, MAX_REQUEST_PAGES))
        self.connect_timeout = connect_timeout
        self.max_object_bytes = max_object_bytes
        self.max_idle = max_idle
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False

    def fetch(self, hashes: Sequence[bytes], timeout: float) -> DataPlaneFetch:
        """The objects of ``hashes`` within ``timeout`` seconds (connecting included); never
        raises (network faults, a bad answer, a deadline, even a local failure end up in
        ``error``; what arrived before is kept)."""
        out = DataPlaneFetch()
        deadline = time.monotonic() + timeout
        arena = _Arena()
        for start in range(0, len(hashes), self.max_pages):
            part = hashes[start : start + self.max_pages]
            try:
                self._fetch_part(part, start, len(hashes), deadline, arena, out)
            except Exception as e:  # DataPlaneError and TimeoutError are OSErrors
                if not isinstance(e, OSError):
                    logger.debug("data plane %s:%d: fetch failed", self.host, self.port, exc_info=e)
                # a traceback holds the frames that hold the receive memory (a half-filled
                # object, the arena): keep the error without it, so they are freed now
                out.error = detached(e)
                break
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    # ------------------------------------------------------------ internals

    def _fetch_part(
        self,
        part: Sequence[bytes],
        offset: int,
        total: int,
        deadline: float,
        arena: _Arena,
        out: DataPlaneFetch,
    ) -> None:
        request = self._request(part)
        head = bytearray(PAGE_HEAD.size)
        for attempt in range(2):
            sock, reused = self._checkout(deadline)
            answered = False
            try:
                _send_all(sock, [request], deadline)
                for i in range(len(part)):
                    _recv_into(sock, memoryview(head), deadline=deadline)
                    answered = out.answered = True
                    index, found, n = PAGE_HEAD.unpack(head)
                    if index != i or found not in (MISS, FOUND) or (found == MISS and n):
                        raise DataPlaneError(
                            f"bad page header (index {index} for {i}, found {found}, length {n})"
                        )
                    if found == MISS:
                        continue
                    if n > self.max_object_bytes:
                        raise DataPlaneError(
                            f"object of {n} bytes; at most {self.max_object_bytes} accepted"
                        )
                    obj = arena.take(n, hint=n * (total - offset - i))
                    _recv_into(sock, obj, deadline=deadline)
                    out.objects[offset + i] = obj
            except BaseException as e:
                sock.close()
                # an idle connection the server has closed since: once more on a fresh one
                stale = reused and not answered and not isinstance(e, TimeoutError)
                if attempt == 0 and stale and isinstance(e, OSError):
                    continue
                raise
            self._checkin(sock)
            return

    def _request(self, part: Sequence[bytes]) -> bytes:
        for h in part:
            if len(h) != PAGE_HASH_BYTES:
                raise DataPlaneError(f"page hashes are {PAGE_HASH_BYTES} bytes, got {len(h)}")
        head = REQUEST_HEAD.pack(MAGIC, VERSION, 0, self.token, len(part))
        return b"".join((head, *part))

    def _checkout(self, deadline: float) -> tuple[socket.socket, bool]:
        while True:
            with self._lock:
                if self._closed:
                    raise DataPlaneError("the data-plane client is closed")
                sock = self._idle.pop() if self._idle else None
            if sock is None:
                break
            if _still_open(sock):
                return sock, True
            sock.close()
        limit = min(self.connect_timeout, _left(deadline))
        try:
            sock = socket.create_connection((self.host, self.port), timeout=limit)
        except TimeoutError:  # the SYN went unanswered: a deadline, not a refusal
            raise TimeoutError(
                f"connecting to {self.host}:{self.port} timed out after {limit:.3g}s"
            ) from None
        except OSError as e:  # refused, unreachable, unresolvable
            raise DataPlaneError(f"cannot connect to {self.host}:{self.port}: {e}") from e
        try:
            sock.setblocking(True)  # timeouts are SO_RCVTIMEO / SO_SNDTIMEO
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except BaseException:
            sock.close()
            raise
        return sock, False

    def _checkin(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.max_idle:
                self._idle.append(sock)
                return
        sock.close()


def detached(e: _E) -> _E:
    """``e`` with no traceback on it or on the exceptions it was raised from or during (a
    traceback holds its frames, and they hold their locals)."""
    todo, seen = [e], set()
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        x.__traceback__ = None
        todo += [x.__cause__, x.__context__]
    return e


# ---------------------------------------------------------------- receive memory


class _Arena:
    """Receive memory of one fetch: mappings from the pool, handed out in slices."""

    def __init__(self, pool: _MappingPool | None = None) -> None:
        self._pool = pool if pool is not None else RECEIVE_POOL
        self._view: memoryview | None = None
        self._used = 0

    def take(self, n: int, hint: int) -> memoryview:
        """``n`` bytes; another mapping (``hint`` bytes: the most the fetch may still
        need, capped at ``ARENA_BYTES``) when the current one is full. Without reusable
        mappings, a buffer of exactly ``n`` bytes."""
        if n == 0:
            return memoryview(b"")
        if not self._pool.reuses:
            return self._pool.take(n)
        if self._view is None or self._used + n > self._view.nbytes:
            self._view = self._pool.take(max(n, min(ARENA_BYTES, hint)))
            self._used = 0
        view = self._view[self._used : self._used + n]
        self._used += n
        return view


class _MappingPool:
    """Populated anonymous mappings, lent out and taken back once nothing uses them.

    A mapping is back when no buffer of it is exported any more: CPython refuses to resize
    an mmap while any memoryview, numpy array or tensor of it is alive (a resize could move
    the memory under it), so a same-size ``resize`` that succeeds proves it unused. Whether
    that test works here is probed once (``reuse=None``); where it does not (no ``mremap``,
    as on macOS; no ``MAP_PRIVATE``/``MAP_ANONYMOUS``, as on Windows), ``take`` hands out
    plain ``bytearray`` memory and keeps no reference to it. Thread-safe.
    """

    def __init__(self, keep_bytes: int = ARENA_KEEP_BYTES, *, reuse: bool | None = None) -> None:
        self.keep_bytes = keep_bytes
        self._reuse = reuse
        self._lent: list[mmap.mmap] = []
        self._idle: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self.created = 0  # buffers made (each mapping populated: the cost this pool saves)
        self.reused = 0

    @property
    def reuses(self) -> bool:
        """Whether mappings are pooled (else every ``take`` is a new bytearray)."""
        if self._reuse is None:
            self._reuse = _mapping_reuse_works()
        return self._reuse

    def take(self, size: int) -> memoryview:
        """A view of a mapping of at least ``size`` bytes (the smallest idle one that fits,
        else a new one of ``size`` rounded up to a power of two, at least 1 MiB). The
        view exists before the mapping is listed as lent, so no other caller can take it
        back in between. Without reuse: a bytearray of ``size`` bytes."""
        if not self.reuses:
            with self._lock:
                self.created += 1
            return memoryview(bytearray(size))
        with self._lock:
            self._reclaim()
            fits = [m for m in self._idle if len(m) >= size]
            if fits:
                m = min(fits, key=len)
                self._idle.remove(m)
                view = memoryview(m)
                self._lent.append(m)
                self.reused += 1
                return view
        size = max(1 << 20, 1 << (size - 1).bit_length())
        m = mmap.mmap(-1, size, flags=_map_flags(mmap))
        view = memoryview(m)
        with self._lock:
            self._lent.append(m)
            self.created += 1
        return view

    def idle_bytes(self) -> int:
        with self._lock:
            self._reclaim()
            return sum(len(m) for m in self._idle)

    def _reclaim(self) -> None:
        lent: list[mmap.mmap] = []
        idle_bytes = sum(len(m) for m in self._idle)
        for m in self._lent:
            if not _unused(m):
                lent.append(m)
            elif idle_bytes + len(m) <= self.keep_bytes:
                self._idle.append(m)
                idle_bytes += len(m)
            else:
                m.close()
        self._lent = lent


def _unused(m: mmap.mmap) -> bool:
    try:
        m.resize(len(m))
    except BufferError:  # still exported
        return False
    return True


def _map_flags(mm) -> int | None:
    """Flags of a private anonymous mapping, populated where the OS can (Linux); None where
    the mmap module cannot ask for one (Windows)."""
    private, anonymous = getattr(mm, "MAP_PRIVATE", None), getattr(mm, "MAP_ANONYMOUS", None)
    if private is None or anonymous is None:
        return None
    return private | anonymous | getattr(mm, "MAP_POPULATE", 0)


def _probe_reuse(mm=mmap) -> bool:
    """Whether ``_unused`` tells a mapping in use from a free one with this ``mmap``
    module: a same-size resize must fail while a view is exported and succeed after."""
    flags = _map_flags(mm)
    if flags is None:
        return False
    try:
        m = mm.mmap(-1, mmap.PAGESIZE, flags=flags)
    except Exception:
        return False
    try:
        view = memoryview(m)
        try:
            m.resize(len(m))
        except BufferError:
            pass
        else:
            return False  # resizing ignores exports: nothing to tell them apart by
        finally:
            view.release()
        m.resize(len(m))  # no mremap (macOS): SystemError
        return True
    except Exception:
        return False
    finally:
        m.close()


_REUSE: bool | None = None


def _mapping_reuse_works() -> bool:
    global _REUSE
    if _REUSE is None:
        _REUSE = _probe_reuse()
        if not _REUSE:
            logger.info("data plane: receive mappings cannot be reused here; using bytearrays")
    return _REUSE


RECEIVE_POOL = _MappingPool()


# ---------------------------------------------------------------- socket helpers


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("data-plane deadline passed")
    return left


def _set_timeout(sock: socket.socket, option: int, seconds: float) -> None:
    """SO_RCVTIMEO or SO_SNDTIMEO of a blocking socket (never 0, which means no limit)."""
    if sys.platform == "win32":
        sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("<I", max(1, int(seconds * 1e3))))
        return
    sec = int(seconds)
    usec = int((seconds - sec) * 1e6)
    sock.setsockopt(socket.SOL_SOCKET, option, _TIMEVAL.pack(sec, max(usec, 1 if sec == 0 else 0)))


def _send_all(sock: socket.socket, buffers: list, deadline: float) -> None:
    """Send ``buffers`` (bytes-like, in order; ``sendmsg``: usually one call) on a blocking
    socket, all of them by ``deadline``: each call may block only for what is left of it
    (SO_SNDTIMEO), so a peer that reads a byte now and then cannot stretch the send. A call
    that ran out of time with nothing sent (EAGAIN) is a ``TimeoutError``."""
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]
    while views:
        _set_timeout(sock, socket.SO_SNDTIMEO, _left(deadline))
        try:
            sent = sock.sendmsg(views) if _SENDMSG else sock.send(views[0])
        except BlockingIOError:  # SO_SNDTIMEO ran out with nothing sent
            raise TimeoutError("the data-plane peer took nothing in time") from None
        while sent:
            if sent >= views[0].nbytes:
                sent -= views.pop(0).nbytes
            else:
                views[0] = views[0][sent:]
                sent = 0


def _recv_into(
    sock: socket.socket,
    view: memoryview,
    *,
    deadline: float | None = None,
    eof_ok: bool = False,
) -> bool:
    """Fill ``view`` from a blocking socket (``MSG_WAITALL``: usually one call), all of it
    by ``deadline`` when given (each call blocks only for what is left of it), else within
    the socket's SO_RCVTIMEO per call. False for an EOF before the first byte when
    ``eof_ok``; an EOF anywhere else is a ``DataPlaneError``."""
    n = view.nbytes
    got = 0
    while got < n:
        if deadline is not None:
            _set_timeout(sock, socket.SO_RCVTIMEO, _left(deadline))
        try:
            k = sock.recv_into(view[got:], n - got, _WAITALL)
        except BlockingIOError:  # SO_RCVTIMEO ran out with nothing read
            raise TimeoutError("no data from the data-plane connection in time") from None
        if k == 0:
            if eof_ok and got == 0:
                return False
            raise DataPlaneError(f"connection closed after {got} of {n} bytes")
        got += k
    return True


def _still_open(sock: socket.socket) -> bool:
    """An idle connection the server has not closed (it never sends unasked)."""
    try:
        if _DONTWAIT:
            sock.recv(1, socket.MSG_PEEK | _DONTWAIT)  # b"": EOF; any byte: out of step
            return False
        readable, _, _ = select.select([sock], [], [], 0)
        return not readable
    except BlockingIOError:
        return True  # nothing to read: open and idle
    except (OSError, ValueError):
        return False
