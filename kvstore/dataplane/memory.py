"""Receive memory of the data plane's client: populated anonymous mappings of up to
``ARENA_BYTES``, cut into one slice per received object and reused once every object cut
from them is gone (up to ``ARENA_KEEP_BYTES`` kept idle per process), the way RDMA transfer
engines receive into registered pools.

Why: touching fresh memory costs as much as the copy itself (measured on the 2-core dev VM:
receiving into a new ``bytes`` per page ran at half the speed of receiving into memory
touched before). Where a mapping's reuse cannot be detected (no ``mremap``: macOS) or
private anonymous mappings cannot be asked for (Windows), each object is received into a
``bytearray`` of its own instead.
"""

from __future__ import annotations

import logging
import mmap
import threading

logger = logging.getLogger(__name__)

ARENA_BYTES = 64 << 20  # receive mappings are 1 MiB to 64 MiB (powers of two), or one object
ARENA_KEEP_BYTES = 512 << 20  # idle receive mappings kept for reuse, per process


class Arena:
    """Receive memory of one fetch: mappings from the pool, handed out in slices."""

    def __init__(self, pool: MappingPool | None = None) -> None:
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


class MappingPool:
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
            self._reuse = mapping_reuse_works()
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


def probe_reuse(mm=mmap) -> bool:
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


_REUSE: bool | None = None  # the probe's answer, once asked


def mapping_reuse_works() -> bool:
    """Whether receive mappings can be reused in this process (probed once)."""
    global _REUSE
    if _REUSE is None:
        _REUSE = probe_reuse()
        if not _REUSE:
            logger.info("data plane: receive mappings cannot be reused here; using bytearrays")
    return _REUSE


RECEIVE_POOL = MappingPool()  # the process's pool: every fetch's Arena takes from it
