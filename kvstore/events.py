"""Block events: what a worker's page pool tells the router's prefix index.

Each event carries a per-engine, strictly increasing sequence number, so a subscriber detects a
gap (lost events) or a restart (a new ``engine_id`` or a sequence number that went back).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass
class EventLog:
    """Numbers events and fans them out to subscribers (callables taking one event).

    Subscribers are called synchronously on the engine thread; they must be cheap (append to
    a queue) and must not raise.
    """

    engine_id: str
    next_seq: int = 0
    _subscribers: list = field(default_factory=list)

    def subscribe(self, callback) -> None:
        self._subscribers.append(callback)

    def unsubscribe(self, callback) -> None:
        self._subscribers.remove(callback)

    def _take_seq(self) -> int:
        seq = self.next_seq
        self.next_seq += 1
        return seq

    def stored(self, block_hash: bytes, parent_hash: bytes | None, token_ids, block_size: int):
        if not self._subscribers:
            return
        ev = BlockStored(
            self._take_seq(), self.engine_id, block_hash, parent_hash, tuple(token_ids), block_size
        )
        for cb in self._subscribers:
            cb(ev)

    def removed(self, block_hash: bytes):
        if not self._subscribers:
            return
        ev = BlockRemoved(self._take_seq(), self.engine_id, block_hash)
        for cb in self._subscribers:
            cb(ev)
