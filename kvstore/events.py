"""Block events: what a worker's page pool tells the router's prefix index.

Each event carries a per-engine, strictly increasing sequence number, so a subscriber detects a
gap (lost events) or a restart (a new ``engine_id`` or a sequence number that went back).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

DEVICE_TIER = "device"


@dataclass(frozen=True)
class BlockStored:
    """A full page became reusable under ``block_hash`` in ``tier``."""

    seq: int
    engine_id: str
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    tier: str = DEVICE_TIER


@dataclass(frozen=True)
class BlockRemoved:
    """The page ``block_hash`` is no longer held in ``tier``."""

    seq: int
    engine_id: str
    block_hash: bytes
    tier: str = DEVICE_TIER


BlockEvent = BlockStored | BlockRemoved


class EventLog:
    """Numbers events and fans them out to subscribers (callables taking one event).

    The engine thread reports device pages; the store's threads report host and Redis pages
    (``TieredStore``). Numbering and fan-out happen under one lock, so subscribers see the
    sequence numbers in order; they must be cheap (append to a queue) and must not raise.
    """

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self.next_seq = 0
        self._subscribers: list = []
        self._lock = threading.Lock()

    def subscribe(self, callback) -> None:
        with self._lock:
            self._subscribers.append(callback)

    def unsubscribe(self, callback) -> None:
        with self._lock:
            self._subscribers.remove(callback)

    def _emit(self, make) -> None:
        with self._lock:
            if not self._subscribers:
                return
            ev = make(self.next_seq)
            self.next_seq += 1
            for cb in self._subscribers:
                cb(ev)

    def stored(
        self,
        block_hash: bytes,
        parent_hash: bytes | None,
        token_ids,
        block_size: int,
        tier: str = DEVICE_TIER,
    ) -> None:
        if self._subscribers:
            tokens = tuple(token_ids)
            self._emit(
                lambda seq: BlockStored(
                    seq, self.engine_id, block_hash, parent_hash, tokens, block_size, tier
                )
            )

    def removed(self, block_hash: bytes, tier: str = DEVICE_TIER) -> None:
        if self._subscribers:
            self._emit(lambda seq: BlockRemoved(seq, self.engine_id, block_hash, tier))

    def stored_in_tier(self, tier: str, hashes: Iterable[bytes]) -> None:
        """Pages that entered a lower tier (host, redis): no parent or tokens, the router
        needs only the hash."""
        if self._subscribers:
            for h in hashes:
                self._emit(lambda seq, h=h: BlockStored(seq, self.engine_id, h, None, (), 0, tier))

    def removed_from_tier(self, tier: str, hashes: Iterable[bytes]) -> None:
        if self._subscribers:
            for h in hashes:
                self._emit(lambda seq, h=h: BlockRemoved(seq, self.engine_id, h, tier))
