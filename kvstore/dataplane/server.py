"""The data plane's server: page objects from a ``PageSource`` over plain TCP, one thread
per connection.

Each object goes out with one ``sendmsg`` (header and object, no join). Time limits are
whole-message deadlines (``sockets``): once the first byte of a request arrived, the rest of
it (head and hashes) must arrive within ``request_timeout_s``; each send (one page's header
and object, with the misses before it) must be taken by the client within ``io_timeout_s``;
a connection may wait ``idle_timeout_s`` between requests. At ``max_connections`` a new
connection closes the one that has waited longest between requests (a client re-opens a
pooled connection it finds closed); only when every connection is busy with a request is
the newcomer closed. A page source that fails closes the connection too (the client counts
the pages it did not get as misses).
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmesh.kvstore.dataplane.protocol import (
    FOUND,
    MAC_BYTES,
    MAX_REQUEST_PAGES,
    MISS,
    PAGE_HEAD,
    REQUEST_HEAD,
    TOKEN_BYTES,
    DataPlaneError,
    check_key,
    page_mac,
    read_request_head,
    request_mac_ok,
    split_hashes,
)
from kvmesh.kvstore.dataplane.sockets import recv_into, send_all, set_timeout, shutdown
from kvmesh.kvstore.hashing import PAGE_HASH_BYTES

if TYPE_CHECKING:
    from kvmesh.kvstore.peer.source import PageSource

logger = logging.getLogger(__name__)


class _Closed(Exception):
    """Server side: end the connection quietly (the client is done, the server is draining,
    or the page source failed and that was logged already)."""


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
    ``token`` is drawn per server (``secrets``) unless given. ``key`` is the cluster's
    data-plane key (``ClusterIdentity.data_plane_key``): a request whose MAC it does not
    verify closes the connection before any page is read, and every page sent carries a
    MAC with it (``protocol``).

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
        key: bytes,
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
        self.key = check_key(key)
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
        except OSError as e:  # name the port: a worker binds several
            sock.close()
            why = f"cannot bind data plane {self.host}:{self.port}: {e.strerror}"
            raise OSError(e.errno, why) from None
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
                shutdown(conn.sock)  # wakes the connection's thread
        if self._listener is not None:
            shutdown(self._listener)  # wakes accept() on Linux
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
                    shutdown(victim.sock)  # its thread wakes, sees EOF and closes it
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
        set_timeout(sock, socket.SO_RCVTIMEO, self.idle_timeout_s)
        if not recv_into(sock, view[:1], eof_ok=True):
            raise _Closed()  # the client is done, or a newcomer took this idle slot
        with self._lock:
            if conn.evicted:
                raise _Closed()
            conn.idle_since = None
        deadline = time.monotonic() + self.request_timeout_s  # the rest of the request
        recv_into(sock, view[1:], deadline=deadline)
        count, nonce = read_request_head(head, self.token, self.max_pages)
        raw = bytearray(count * PAGE_HASH_BYTES + MAC_BYTES)
        recv_into(sock, memoryview(raw), deadline=deadline)
        body = memoryview(raw)[: count * PAGE_HASH_BYTES]
        if not request_mac_ok(self.key, head, body, raw[-MAC_BYTES:]):
            raise DataPlaneError("wrong request MAC (not a member of this cluster)")
        if self.draining or self._closed:
            raise _Closed()
        hashes = split_hashes(body)
        starts = range(0, count, self.batch_pages)
        batches = [hashes[i : i + self.batch_pages] for i in starts]
        with self._lock:
            self._busy += 1
        ahead: Future | None = None
        misses = bytearray()  # headers of misses, sent with the next object or at the end
        try:
            for k, start in enumerate(starts):
                frames = (
                    ahead.result() if ahead is not None else self._frames(batches[k], start, nonce)
                )
                ahead = None
                if k + 1 < len(batches):
                    nxt = (batches[k + 1], starts[k + 1], nonce)
                    try:  # fetched and MAC'd while this batch is sent
                        ahead = prefetch.submit(self._frames, *nxt)
                    except RuntimeError:  # no thread for it: the next batch is done inline
                        ahead = None
                for j, frame in enumerate(frames):
                    if frame is None:
                        misses += PAGE_HEAD.pack(start + j, MISS, 0)
                        continue
                    deadline = time.monotonic() + self.io_timeout_s
                    send_all(sock, [misses, *frame], deadline)
                    misses = bytearray()
            if misses:
                send_all(sock, [misses], time.monotonic() + self.io_timeout_s)
        finally:
            if ahead is not None:
                ahead.cancel()
            with self._lock:
                self._busy -= 1
        with self._lock:
            conn.idle_since = time.monotonic()  # answered: waiting for the next request

    def _frames(self, batch: list[bytes], start: int, nonce: bytes) -> list[tuple | None]:
        """Each page of ``batch`` (request positions from ``start``) as what goes on the wire
        after it: ``(page head, object, MAC)``, or None for a miss."""
        frames: list[tuple | None] = []
        for j, obj in enumerate(self._fetch(batch)):
            if obj is None:
                frames.append(None)
                continue
            body = memoryview(obj).cast("B")  # bytes, not items: the framed length
            page = PAGE_HEAD.pack(start + j, FOUND, body.nbytes)
            frames.append((page, body, page_mac(self.key, nonce, page, batch[j], body)))
        return frames

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
