"""The host-RAM tier: encoded page objects in process memory, a byte budget, LRU order."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvmesh.kvstore.tier import Tier

logger = logging.getLogger(__name__)

EvictCallback = Callable[[list[tuple[bytes, bytes]]], None]


class HostTier(Tier):
    """Encoded page objects in RAM under a byte budget, evicted least recently used first.

    Objects are plain ``bytes`` on the CPU. On CUDA machines pinned memory belongs to the
    engine's copies (reused pinned buffers carry spills out of the device; a promotion is
    gathered into pinned memory and moved in one copy), so this tier holds ordinary memory
    and stays usable without CUDA.

    ``on_evict`` receives every ``(hash, object)`` that leaves because of the budget, in LRU
    order, including an object too large to be stored at all: that is the write-back hook
    (``TieredStore`` points it at the next tier). It runs after the tier's lock is released,
    in the thread whose ``put`` caused the eviction. Explicit ``evict`` calls do not reach it.

    Thread-safe: the engine thread, the spill and fetch threads and a gRPC server thread may
    share it.
    """

    name = "host"

    def __init__(self, budget_bytes: int, *, on_evict: EvictCallback | None = None) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"budget_bytes must be an integer >= 0, got {budget_bytes!r}")
        self._budget = budget_bytes
        self.on_evict = on_evict
        self._objects: OrderedDict[bytes, bytes] = OrderedDict()  # oldest first
        self._used = 0
        self._lock = threading.Lock()
        self.metrics: dict[str, int] = {
            "hits": 0,
            "misses": 0,
            "puts": 0,
            "evictions": 0,
            "oversize": 0,
            "bytes_read": 0,
            "bytes_written": 0,
            "errors": 0,
        }

    def set_evict_listener(self, listener: EvictCallback | None) -> None:
        """Register the one write-back listener (as the ``on_evict`` argument does)."""
        self.on_evict = listener

    @property
    def budget_bytes(self) -> int:
        return self._budget

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def num_objects(self) -> int:
        return len(self._objects)

    def contains(self, hashes: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [h in self._objects for h in hashes]

    def refresh(self, hashes: Sequence[bytes]) -> list[bool]:
        """Which pages are stored; those that are become the most recently used (as a put of
        the same object would make them), without counting a read."""
        out: list[bool] = []
        with self._lock:
            for h in hashes:
                stored = h in self._objects
                if stored:
                    self._objects.move_to_end(h)
                out.append(stored)
        return out

    def get(self, hashes: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        with self._lock:
            for h in hashes:
                obj = self._objects.get(h)
                if obj is not None:
                    self._objects.move_to_end(h)
                    self.metrics["bytes_read"] += len(obj)
                out.append(obj)
            hits = sum(o is not None for o in out)
            self.metrics["hits"] += hits
            self.metrics["misses"] += len(out) - hits
        return out

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> list[bytes]:
        victims: list[tuple[bytes, bytes]] = []
        with self._lock:
            for h, obj in items:
                old = self._objects.pop(h, None)
                if old is not None:
                    self._used -= len(old)
                if len(obj) > self._budget:
                    # Can never fit: pass it straight down so the page is not lost.
                    self.metrics["oversize"] += 1
                    victims.append((h, obj))
                    continue
                self._objects[h] = obj
                self._used += len(obj)
                self.metrics["puts"] += 1
                self.metrics["bytes_written"] += len(obj)
                while self._used > self._budget:
                    vh, vobj = self._objects.popitem(last=False)
                    self._used -= len(vobj)
                    self.metrics["evictions"] += 1
                    victims.append((vh, vobj))
            kept = [h for h, _ in items if h in self._objects]
        if victims and self.on_evict is not None:
            try:
                self.on_evict(victims)
            except Exception:
                # A failed write-back loses cache pages, never a request: log and go on.
                with self._lock:
                    self.metrics["errors"] += 1
                logger.exception("host tier: write-back of %d evicted pages failed", len(victims))
        return kept

    def evict(self, hashes: Sequence[bytes]) -> None:
        with self._lock:
            for h in hashes:
                old = self._objects.pop(h, None)
                if old is not None:
                    self._used -= len(old)

    def clear(self) -> None:
        """Drop everything without write-back."""
        with self._lock:
            self._objects.clear()
            self._used = 0

    def close(self) -> None:
        self.clear()

    def keys(self) -> list[bytes]:
        """The stored hashes, least recently used first (a snapshot)."""
        with self._lock:
            return list(self._objects)
