"""A Redis MGET whose values land straight in reused buffers: the Redis tier's read path.

redis-py reads a reply 64 KiB at a time into its parser, which builds a fresh ``bytes``
object per value: for a 2,048-token SmolLM2 prefix that is 128 values of ~720 KiB, every
one of them new memory filled at page-fault speed, after two copies. This reader sends the
MGET on one of the tier's pooled connections and reads the reply itself: each value is
received (``recv_into``) directly into a slab, a large buffer the reader keeps and hands out
again once nothing refers to it, so a restore is one copy out of the socket into memory
that is already mapped. The values come back as ``memoryview`` slices of the slabs.

A slab is reused only when no view into it is alive (a bytearray with a live buffer
refuses to be resized, see ``_unexported``), however derived: a caller may keep a value,
or a view or array made from it, as long as it likes; that slab is simply not reused. At
most ``keep_bytes`` of slabs are kept.

A value longer than the caller's bound (``RedisTier.max_page_bytes``) is refused before
any memory is taken for it. Both reply protocols are read (RESP2's ``$-1`` and RESP3's
``_`` nulls); RESP3 push frames before the reply are read past. Anything that is not an
array of bulk strings and nulls of the asked length raises ``RespError``, and so do bytes
after the reply (the connection would be out of step). Any error or timeout mid-reply
leaves the connection in an unknown state, so the caller must disconnect it (``RedisTier``
does).
"""

from __future__ import annotations

import socket
import threading

_LINE_MAX = 1024  # a RESP header line (``$737424``, ``*128``) is a few bytes
_SKIP_DEPTH = 8  # nesting of a skipped push frame
_SKIP_ITEMS = 1 << 16  # items of one skipped aggregate


class RespError(ConnectionError):
    """A reply that is not what an MGET returns, or a connection that closed mid-reply."""


def _unexported(slab: bytearray) -> bool:
    """Whether no buffer (``memoryview``, numpy array, ...) of ``slab`` is alive: a
    bytearray refuses to change its size while any is (``BufferError``), however the view
    was derived. Growing by a byte and back leaves the slab as it was."""
    try:
        slab.append(0)
    except BufferError:
        return False
    slab.pop()
    return True


def _new_slab(nbytes: int) -> bytearray:
    """A zeroed bytearray of ``nbytes`` with room for one more byte: ``_unexported`` grows it
    by a byte and back, which in a bytearray allocated to size reallocates it (at 16 MiB
    from the heap: a new block, copied into at page-fault speed, on the slab's first reuse)."""
    slab = bytearray(nbytes + 1)
    del slab[-1:]  # a bytearray keeps its allocation when it shrinks a little
    return slab


class SlabPool:
    """Large reusable receive buffers (bytearrays). Thread-safe."""

    def __init__(self, slab_bytes: int = 16 << 20, keep_bytes: int = 256 << 20) -> None:
        self.slab_bytes = slab_bytes
        self.keep_bytes = keep_bytes
        self._slabs: list[bytearray] = []
        self._lock = threading.Lock()
        self.created = 0  # slabs allocated so far (tests, metrics)
        self.reused = 0  # slabs handed out again

    def take(self, nbytes: int) -> bytearray:
        """A slab of at least ``nbytes`` that nothing refers to (held or new)."""
        with self._lock:
            for i in range(len(self._slabs)):
                if len(self._slabs[i]) >= nbytes and _unexported(self._slabs[i]):
                    self.reused += 1
                    return self._slabs.pop(i)
            self.created += 1
        return _new_slab(max(nbytes, self.slab_bytes))

    def give(self, slab: bytearray) -> None:
        """Keep ``slab`` for reuse once the views handed out from it are gone."""
        with self._lock:
            if sum(map(len, self._slabs)) + len(slab) <= self.keep_bytes:
                self._slabs.append(slab)


class _Reader:
    """Reads RESP from a socket: header lines through a small buffer, values straight into
    their destination."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray(1 << 16)
        self.view = memoryview(self.buf)
        self.lo = self.hi = 0

    def _recv(self, dest: memoryview) -> int:
        n = self.sock.recv_into(dest)
        if n == 0:
            raise RespError("the server closed the connection mid-reply")
        return n

    def line(self) -> bytes:
        while True:
            end = self.buf.find(b"\r\n", self.lo, self.hi)
            if end >= 0:
                out = bytes(self.view[self.lo : end])
                self.lo = end + 2
                return out
            if self.hi - self.lo > _LINE_MAX:
                raise RespError("a reply header line is too long")
            if self.lo:  # keep the partial line at the front
                rest = self.hi - self.lo
                self.buf[:rest] = self.view[self.lo : self.hi]
                self.lo, self.hi = 0, rest
            self.hi += self._recv(self.view[self.hi :])

    def into(self, dest: memoryview) -> None:
        """Fill ``dest`` exactly: buffered bytes first, then straight from the socket."""
        n = min(len(dest), self.hi - self.lo)
        dest[:n] = self.view[self.lo : self.lo + n]
        self.lo += n
        while n < len(dest):
            n += self._recv(dest[n:])

    def crlf(self) -> None:
        tail = bytearray(2)
        self.into(memoryview(tail))
        if tail != b"\r\n":
            raise RespError("a value is not followed by CRLF")

    def skip(self, head: bytes, max_value_bytes: int, depth: int = 0) -> None:
        """Read past the rest of the RESP value whose header line is ``head`` (a RESP3 push
        frame, which is not part of the reply it comes before)."""
        if depth > _SKIP_DEPTH:
            raise RespError("a pushed value is nested too deep")
        kind = head[:1]
        if kind in b"+-:_#,(" and kind:  # one line, already read
            return
        try:
            n = int(head[1:])
        except ValueError:
            raise RespError(f"bad RESP header {head[:40]!r}") from None
        if kind in b"$!=" and kind:  # bulk: n bytes and CRLF (-1: null)
            if n > max_value_bytes:
                raise RespError(f"a pushed value claims {n} bytes, more than allowed")
            scratch = memoryview(bytearray(min(max(n, 0), 1 << 16)))
            while n > 0:
                step = min(n, len(scratch))
                self.into(scratch[:step])
                n -= step
            if n == 0:
                self.crlf()
            return
        if kind in b"*>~%|" and kind:  # aggregates (a map or attribute: n pairs)
            if n > _SKIP_ITEMS:
                raise RespError(f"a pushed aggregate claims {n} items, more than allowed")
            for _ in range(2 * n if kind in b"%|" else max(n, 0)):
                self.skip(self.line(), max_value_bytes, depth + 1)
            return
        raise RespError(f"unknown RESP type {head[:40]!r}")


class MgetReplies:
    """Reads MGET replies from ``sock`` one after another into slabs of ``slabs``: the
    replies to pipelined MGETs (several sent before the first is read) share one read
    buffer, so bytes of the next reply read along with this one's last line are kept, and
    their values are packed into the same slabs. ``close`` gives the last slab back and
    raises ``RespError`` if bytes beyond the last reply were read (the stream would be out
    of step). Use it as a context manager."""

    def __init__(self, sock: socket.socket, slabs: SlabPool, max_value_bytes: int) -> None:
        self._r = _Reader(sock)
        self._slabs = slabs
        self._max = max_value_bytes
        self._slab: bytearray | None = None
        self._view: memoryview | None = None
        self._used = 0

    def __enter__(self) -> MgetReplies:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(check=exc_type is None)

    def _give_back(self) -> None:
        if self._slab is not None:
            slab, self._slab = self._slab, None  # cleared first: never given back twice
            self._view.release()
            self._view = None
            self._slabs.give(slab)

    def close(self, check: bool = True) -> None:
        self._give_back()
        r = self._r
        if check and r.lo != r.hi:
            raise RespError(f"{r.hi - r.lo} unexpected bytes after the MGET reply")

    def read(self, n_keys: int) -> list[memoryview | None]:
        """The next reply, which must be an array of ``n_keys`` bulk strings or nulls. A
        value claiming more than ``max_value_bytes`` raises ``RespError`` before any memory
        is taken for it (a confused or hostile server cannot make the reader allocate what
        it claims)."""
        r = self._r
        head = r.line()
        while head[:1] == b">":  # a RESP3 push before the reply: not ours, read past it
            r.skip(head, self._max)
            head = r.line()
        if head[:1] == b"-":
            msg = head[1:200].decode(errors="replace")
            raise RespError(f"the server answered MGET with an error: {msg}")
        if head[:1] != b"*" or head[1:] != str(n_keys).encode():
            raise RespError(f"expected an array of {n_keys} values, got {head[:40]!r}")
        out: list[memoryview | None] = []
        for _ in range(n_keys):
            h = r.line()
            if h == b"_" or h == b"$-1":
                out.append(None)
                continue
            if h[:1] != b"$":
                raise RespError(f"expected a bulk string, got {h[:40]!r}")
            try:
                size = int(h[1:])
            except ValueError:
                raise RespError(f"bad bulk string length {h[:40]!r}") from None
            if size < 0:
                raise RespError(f"bad bulk string length {size}")
            if size > self._max:
                raise RespError(f"a value claims {size} bytes, more than the {self._max} allowed")
            if self._view is None or self._used + size > len(self._view):
                self._give_back()
                slab = self._slabs.take(size)
                self._slab, self._view, self._used = slab, memoryview(slab), 0
            dest = self._view[self._used : self._used + size]
            r.into(dest)
            r.crlf()
            out.append(dest)
            self._used += size
        return out


def read_mget_reply(
    sock: socket.socket, n_keys: int, slabs: SlabPool, max_value_bytes: int = 512 << 20
) -> list[memoryview | None]:
    """Read one MGET reply of ``n_keys`` values from ``sock`` into slabs of ``slabs``
    (``MgetReplies`` for one reply)."""
    with MgetReplies(sock, slabs, max_value_bytes) as replies:
        return replies.read(n_keys)
