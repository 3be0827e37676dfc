"""The data plane's client: one peer's page objects over a small pool of persistent TCP
connections, received straight into reused memory (``memory.Arena``).

Time limits are whole-message deadlines (``sockets``): a fetch, connecting included, ends by
its deadline, and what arrived before is kept. Like every tier, the client moves objects as
opaque bytes; whoever decodes them checks them.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from kvmesh.kvstore.dataplane.memory import Arena
from kvmesh.kvstore.dataplane.protocol import (
    FOUND,
    MAC_BYTES,
    MAX_OBJECT_BYTES,
    MAX_REQUEST_PAGES,
    MISS,
    NONCE_BYTES,
    PAGE_HEAD,
    TOKEN_BYTES,
    DataPlaneError,
    check_key,
    encode_request,
    page_mac,
)
from kvmesh.kvstore.dataplane.sockets import recv_into, send_all, still_open, time_left

logger = logging.getLogger(__name__)

_E = TypeVar("_E", bound=BaseException)


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

    Objects come back as memoryviews into receive mappings of at most ``memory.ARENA_BYTES``
    (bytes-like: ``codec.decode`` reads them, ``bytes(obj)`` copies one out). A mapping goes
    back to the pool when the last object cut from it is dropped, so a caller that keeps
    one object keeps its whole mapping from reuse. An object claiming more than
    ``max_object_bytes`` is refused before any memory is set aside for it.

    ``key`` is the cluster's data-plane key: requests carry its MAC, and an object whose
    MAC does not verify (not sent by a cluster member for this request) ends the fetch
    with a ``DataPlaneError`` and is not returned.
    """

    def __init__(
        self,
        host: str,
        port: int,
        token: bytes,
        *,
        key: bytes,
        max_pages: int = MAX_REQUEST_PAGES,
        connect_timeout: float = 2.0,
        max_object_bytes: int = MAX_OBJECT_BYTES,
        max_idle: int = 2,
    ) -> None:
        if len(token) != TOKEN_BYTES:
            raise ValueError(f"token must be {TOKEN_BYTES} bytes, got {len(token)}")
        self.key = check_key(key)
        self.host = host.strip("[]")
        self.port = port
        self.token = token
        self.max_pages = max(1, min(max_pages, MAX_REQUEST_PAGES))
        self.connect_timeout = connect_timeout
        self.max_object_bytes = max_object_bytes
        self.max_idle = max_idle
        self._idle: list[socket.socket] = []
        self._verify_pool: ThreadPoolExecutor | None = None  # checks page MACs
        self._lock = threading.Lock()
        self._closed = False

    def fetch(self, hashes: Sequence[bytes], timeout: float) -> DataPlaneFetch:
        """The objects of ``hashes`` within ``timeout`` seconds (connecting included); never
        raises (network faults, a bad answer, a deadline, even a local failure end up in
        ``error``; what arrived before is kept)."""
        out = DataPlaneFetch()
        deadline = time.monotonic() + timeout
        arena = Arena()
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
            pool, self._verify_pool = self._verify_pool, None
        for sock in idle:
            sock.close()
        if pool is not None:
            pool.shutdown(wait=False)

    # ------------------------------------------------------------ internals

    def _fetch_part(
        self,
        part: Sequence[bytes],
        offset: int,
        total: int,
        deadline: float,
        arena: Arena,
        out: DataPlaneFetch,
    ) -> None:
        nonce = secrets.token_bytes(NONCE_BYTES)
        request = encode_request(self.token, part, self.key, nonce)
        head = bytearray(PAGE_HEAD.size)
        for attempt in range(2):
            sock, reused = self._checkout(deadline)
            answered = False
            pending: list[tuple[int, memoryview, Future]] = []
            try:
                send_all(sock, [request], deadline)
                for i in range(len(part)):
                    recv_into(sock, memoryview(head), deadline=deadline)
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
                    recv_into(sock, obj, deadline=deadline)
                    mac = bytearray(MAC_BYTES)
                    recv_into(sock, memoryview(mac), deadline=deadline)
                    # checked on the verifier thread while the next page arrives
                    ok = self._verifier().submit(
                        _mac_ok, self.key, nonce, bytes(head), part[i], obj, mac
                    )
                    pending.append((offset + i, obj, ok))
                self._keep_verified(pending, out)
            except BaseException as e:
                err: BaseException = e
                try:  # what arrived whole and verified before the fault is kept
                    self._keep_verified(pending, out)
                except DataPlaneError as bad:
                    err = bad
                sock.close()
                # an idle connection the server has closed since: once more on a fresh one
                stale = reused and not answered and not isinstance(err, TimeoutError)
                if attempt == 0 and stale and isinstance(err, OSError):
                    continue
                raise err from None  # e itself, or the bad MAC found while draining
            finally:
                pending.clear()  # no reference to receive memory outlives the call
            self._checkin(sock)
            return

    def _verifier(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._verify_pool is None:
                self._verify_pool = ThreadPoolExecutor(1, thread_name_prefix="kvmesh-dp-verify")
            return self._verify_pool

    @staticmethod
    def _keep_verified(pending: list[tuple[int, memoryview, Future]], out: DataPlaneFetch) -> None:
        """Move the pages whose MACs verified into ``out``, in order, up to the first that
        did not (a ``DataPlaneError``: that page and the rest are dropped)."""
        try:
            for index, obj, ok in pending:
                if not ok.result():
                    raise DataPlaneError(
                        f"page {index}: wrong MAC (not sent by a member of this cluster)"
                    )
                out.objects[index] = obj
        finally:
            pending.clear()

    def _checkout(self, deadline: float) -> tuple[socket.socket, bool]:
        while True:
            with self._lock:
                if self._closed:
                    raise DataPlaneError("the data-plane client is closed")
                sock = self._idle.pop() if self._idle else None
            if sock is None:
                break
            if still_open(sock):
                return sock, True
            sock.close()
        limit = min(self.connect_timeout, time_left(deadline))
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


def _mac_ok(key: bytes, nonce: bytes, head: bytes, page_hash: bytes, obj, mac) -> bool:
    return hmac.compare_digest(page_mac(key, nonce, head, page_hash, obj), bytes(mac))


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
