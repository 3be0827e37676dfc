"""How kvmesh runs a ``grpc.aio`` server: drained before it stops, and on an event loop of
its own thread when the caller has none (a Ray actor, a test), called into from other
threads.

The worker's server (``worker/server.py``) and the router's (``router/service.py``) both run
this way. Imports only grpc and the standard library (uvloop when a thread of its own is
asked for), so that any kvmesh package may import it.

- ``aio_server``: the server with kvmesh's channel options, keepalive and interceptors;
- ``channel_options``: the options of every channel kvmesh opens (message sizes, keepalive);
- ``call_deadline``: a call's time limit: the client's deadline, capped by the server's
  default one;
- ``Lifecycle``: the draining flag and the RPCs in flight, shared with the servicers;
- ``Drain``: ``stop(grace)`` drains once, however often it is called;
- ``ServerThread``: a uvloop loop on a daemon thread that serves until the server stopped;
- ``call_in_loop``: run a plain function on a server's loop from another thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

import grpc

T = TypeVar("T")


# Keepalive (docs/security.md, "Liveness"). A client pings a silent connection every
# KEEPALIVE_TIME_S and drops it when no answer comes within KEEPALIVE_TIMEOUT_S, so a
# vanished or frozen peer host fails its calls with UNAVAILABLE instead of leaving them
# hanging; servers do the same towards their clients (freeing a gone client's request), and
# accept client pings as often as every SERVER_MIN_PING_S (grpc's default would answer a
# pinging client with GOAWAY "too_many_pings").
KEEPALIVE_TIME_S = 20.0
KEEPALIVE_TIMEOUT_S = 10.0
SERVER_KEEPALIVE_TIME_S = 60.0
SERVER_MIN_PING_S = 5.0
DEFAULT_DEADLINE_S = 3600.0  # a Generate with no deadline of its own ends after this


def channel_options(
    max_message_mb: int = 64,
    keepalive_s: float = KEEPALIVE_TIME_S,
    keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S,
) -> list[tuple[str, int]]:
    """Options of a client channel: message limits both ways and keepalive pings (also
    while no call is in flight: a member's channels are long-lived)."""
    if max_message_mb < 1:
        raise ValueError(f"max_message_mb must be >= 1, got {max_message_mb}")
    if not keepalive_s > 0 or not keepalive_timeout_s > 0:
        raise ValueError(
            f"keepalive_s and keepalive_timeout_s must be > 0, got {keepalive_s}, "
            f"{keepalive_timeout_s}"
        )
    limit = max_message_mb * 2**20
    return [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
        ("grpc.keepalive_time_ms", max(1, round(keepalive_s * 1000))),
        ("grpc.keepalive_timeout_ms", max(1, round(keepalive_timeout_s * 1000))),
        # grpc 1.85 times a keepalive ping's answer out by this one (default 60 s), not
        # by keepalive_timeout_ms alone (seen with a SIGSTOP'd server: 60 s, not 1 s)
        ("grpc.http2.ping_timeout_ms", max(1, round(keepalive_timeout_s * 1000))),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def aio_server(
    max_message_mb: int, interceptors: Sequence[grpc.aio.ServerInterceptor] = ()
) -> grpc.aio.Server:
    """A grpc.aio server that sends and receives messages of up to ``max_message_mb`` MiB,
    with SO_REUSEPORT off (a second server on a port in use fails to bind instead of
    sharing its calls), keepalive towards its clients, and ``interceptors``
    (``protos.security.AuthInterceptor``)."""
    if max_message_mb < 1:
        raise ValueError(f"max_message_mb must be >= 1, got {max_message_mb}")
    limit = max_message_mb * 2**20
    return grpc.aio.server(
        interceptors=list(interceptors) or None,
        options=[
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
            ("grpc.so_reuseport", 0),
            ("grpc.keepalive_time_ms", round(SERVER_KEEPALIVE_TIME_S * 1000)),
            ("grpc.keepalive_timeout_ms", round(KEEPALIVE_TIMEOUT_S * 1000)),
            ("grpc.http2.ping_timeout_ms", round(KEEPALIVE_TIMEOUT_S * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", round(SERVER_MIN_PING_S * 1000)),
            ("grpc.http2.max_ping_strikes", 0),
        ],
    )


def call_deadline(context: grpc.aio.ServicerContext, default_s: float | None) -> float | None:
    """Seconds a call may run: what is left of the client's deadline, capped by the
    server's ``default_s`` (None: no cap), so that a call with no deadline of its own still
    ends."""
    left = context.time_remaining()
    if default_s is None:
        return left
    return default_s if left is None else min(left, default_s)


class Lifecycle:
    """What a server shares with its servicers: ``draining`` (set: they refuse new calls
    with UNAVAILABLE) and ``inflight``, one future per call in flight, done when the call is:
    what a drain waits for. A servicer calls ``enter()`` once it has accepted a call and
    ``leave()`` when it is done, both in the call's task; a call that moves between tasks
    (an HTTP stream: its first token is awaited in the handler, the rest in the response's
    task) passes the handle ``enter()`` returned to ``leave(handle)``."""

    def __init__(self) -> None:
        self.draining = False
        self.inflight: set[asyncio.Future] = set()
        self._by_task: dict[asyncio.Task, asyncio.Future] = {}  # for leave() without handle
        self._task_of: dict[asyncio.Future, asyncio.Task] = {}

    def enter(self) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.inflight.add(fut)
        task = asyncio.current_task()
        if task is not None:
            self._by_task[task] = fut
            self._task_of[fut] = task
        return fut

    def leave(self, handle: asyncio.Future | None = None) -> None:
        if handle is None:
            handle = self._by_task.get(asyncio.current_task())
            if handle is None:
                return
        task = self._task_of.pop(handle, None)
        if task is not None and self._by_task.get(task) is handle:
            del self._by_task[task]
        self.inflight.discard(handle)
        if not handle.done():
            handle.set_result(None)


class Drain:
    """Drain then stop, once.

    ``stop(grace, drain_and_stop)`` starts ``drain_and_stop()`` on its first call; a later
    call (a second SIGTERM) can only bring the drain's deadline nearer. Every call returns
    when ``drain_and_stop`` has returned. Inside it, ``wait_for`` waits for the in-flight
    calls until that deadline. Drain, then one ``grpc.aio`` stop: two overlapping stop()
    calls can crash grpcio 1.85 while it cancels calls, so there is never a second one.
    """

    def __init__(self) -> None:
        self.deadline = float("inf")  # loop time
        self._task: asyncio.Future | None = None

    async def stop(self, grace: float, drain_and_stop: Callable[[], Awaitable[None]]) -> None:
        loop = asyncio.get_running_loop()
        self.deadline = min(self.deadline, loop.time() + grace)
        if self._task is None:
            self._task = asyncio.ensure_future(drain_and_stop())
        await asyncio.shield(self._task)

    def left(self) -> float:
        """Seconds of grace left (negative once the deadline passed)."""
        return self.deadline - asyncio.get_running_loop().time()

    async def wait_for(
        self, tasks: Iterable[asyncio.Task], busy: Callable[[], bool] | None = None
    ) -> None:
        """Until every one of ``tasks`` is done and ``busy()`` (work the server tracks
        outside its tasks, e.g. a data plane's requests) is false, or the deadline passed.
        The tasks are those in flight now: calls accepted later are not waited for."""
        pending = [t for t in tasks if not t.done()]
        while (pending or (busy is not None and busy())) and (left := self.left()) > 0:
            if pending:
                await asyncio.wait(pending, timeout=min(left, 0.1))
            else:
                await asyncio.sleep(min(left, 0.05))
            pending = [t for t in pending if not t.done()]


class ServerThread:
    """A server's own thread and uvloop event loop.

    ``start(start, serve)`` runs ``start()`` on the new loop and returns its result (or
    raises its error) once it has returned; the thread then runs ``serve()`` (until the
    server has stopped), shuts the loop's default executor down and ends. ``stop(stop,
    timeout)`` runs ``stop()`` on that loop and joins the thread; ``call`` runs a plain
    function there.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def alive(self) -> bool:
        return self.loop is not None and self._thread is not None and self._thread.is_alive()

    def start(self, start: Callable[[], Awaitable[T]], serve: Callable[[], Awaitable[Any]]) -> T:
        import uvloop

        started = threading.Event()
        box: list = []

        def run() -> None:
            loop = uvloop.new_event_loop()
            self.loop = loop
            asyncio.set_event_loop(loop)
            try:
                box.append(loop.run_until_complete(start()))
            except BaseException as e:
                box.append(e)
                loop.close()
                started.set()
                return
            started.set()
            loop.run_until_complete(serve())
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()
        started.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def stop(self, stop: Callable[[], Awaitable[Any]], timeout: float) -> None:
        """Run ``stop()`` on the loop and wait (up to ``timeout`` seconds each) for it and
        for the thread to end; nothing when the thread is not running."""
        if not self.alive:
            return
        fut = asyncio.run_coroutine_threadsafe(stop(), self.loop)
        fut.result(timeout)
        self._thread.join(timeout)

    def call(self, fn: Callable[..., T], *args, timeout: float = 30.0, **kwargs) -> T:
        if self.loop is None:
            raise RuntimeError(f"{self.name}: the server is not running")
        return call_in_loop(self.loop, fn, *args, timeout=timeout, **kwargs)


def call_in_loop(
    loop: asyncio.AbstractEventLoop, fn: Callable[..., T], *args, timeout: float, **kwargs
) -> T:
    """Run ``fn(*args, **kwargs)`` on ``loop`` (from another thread) and return its result
    within ``timeout`` seconds; its exceptions are re-raised here."""
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # handed back to the calling thread
            fut.set_exception(e)

    loop.call_soon_threadsafe(run)
    return fut.result(timeout)
