"""Blocking-socket helpers of the data plane: whole-message deadlines, scatter sends,
receives straight into caller memory, and the shims that make them work on Linux, macOS and
Windows alike.

Deadlines are whole-message, not per-syscall: each call may block only for what is left of
the deadline (SO_RCVTIMEO / SO_SNDTIMEO set before it), so a peer that moves a byte now and
then cannot stretch a transfer.
"""

from __future__ import annotations

import select
import socket
import struct
import sys
import time

from kvmesh.kvstore.dataplane.protocol import DataPlaneError

# SO_RCVTIMEO/SO_SNDTIMEO take a struct timeval (two longs) on Linux and macOS, a DWORD of
# milliseconds on Windows
_TIMEVAL = struct.Struct("ll")
_WAITALL = getattr(socket, "MSG_WAITALL", 0)
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)
_SENDMSG = hasattr(socket.socket, "sendmsg")  # not on Windows


def time_left(deadline: float) -> float:
    """Seconds until ``deadline`` (``time.monotonic``); a ``TimeoutError`` once it passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("data-plane deadline passed")
    return left


def set_timeout(sock: socket.socket, option: int, seconds: float) -> None:
    """SO_RCVTIMEO or SO_SNDTIMEO of a blocking socket (never 0, which means no limit)."""
    if sys.platform == "win32":
        sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("<I", max(1, int(seconds * 1e3))))
        return
    sec = int(seconds)
    usec = int((seconds - sec) * 1e6)
    sock.setsockopt(socket.SOL_SOCKET, option, _TIMEVAL.pack(sec, max(usec, 1 if sec == 0 else 0)))


def send_all(sock: socket.socket, buffers: list, deadline: float) -> None:
    """Send ``buffers`` (bytes-like, in order; ``sendmsg``: usually one call) on a blocking
    socket, all of them by ``deadline``. A call that ran out of time with nothing sent
    (EAGAIN) is a ``TimeoutError``."""
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]
    while views:
        set_timeout(sock, socket.SO_SNDTIMEO, time_left(deadline))
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


def recv_into(
    sock: socket.socket,
    view: memoryview,
    *,
    deadline: float | None = None,
    eof_ok: bool = False,
) -> bool:
    """Fill ``view`` from a blocking socket (``MSG_WAITALL``: usually one call), all of it
    by ``deadline`` when given, else within the socket's SO_RCVTIMEO per call. False for an
    EOF before the first byte when ``eof_ok``; an EOF anywhere else is a ``DataPlaneError``."""
    n = view.nbytes
    got = 0
    while got < n:
        if deadline is not None:
            set_timeout(sock, socket.SO_RCVTIMEO, time_left(deadline))
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


def still_open(sock: socket.socket) -> bool:
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


def shutdown(sock: socket.socket) -> None:
    """Shut both directions down, waking a thread blocked on ``sock``; quiet when the socket
    is not connected any more, or closed."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
