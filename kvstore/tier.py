"""The one interface every storage tier implements: batched operations keyed by page hash.

A tier stores *encoded page objects* (``kvstore.codec``: a msgpack header, then the payload),
opaque bytes to the tier itself. Validation (magic, version, model, format, checksum) is the
reader's job, done by ``TieredStore`` with the codec; a tier only moves bytes.

Tiers never raise for an unavailable backend on the read path: a tier that cannot answer
(Redis down, peer gone) answers "miss" and counts the incident. Writes are best effort.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class Tier(ABC):
    """A store of encoded page objects keyed by page hash (bytes)."""

    name: str = "abstract"  # "host", "redis", "peer": the label in metrics and outputs

    @abstractmethod
    def contains(self, hashes: Sequence[bytes]) -> list[bool]:
        """Which of ``hashes`` this tier holds now. Does not change LRU order or contents."""

    @abstractmethod
    def get(self, hashes: Sequence[bytes]) -> list[bytes | None]:
        """The stored objects, ``None`` for a miss. A hit counts as a use (LRU)."""

    @abstractmethod
    def put(self, items: Sequence[tuple[bytes, bytes]]) -> list[bytes]:
        """Store ``(hash, object)`` pairs, evicting by the tier's own policy when full. An
        existing key is overwritten. Never raises for lack of room or a backend fault.
        Returns the hashes it holds once the put is done (what the router may be told)."""

    @abstractmethod
    def evict(self, hashes: Sequence[bytes]) -> None:
        """Drop these keys if present (a corrupt object, or an explicit eviction)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and memory."""


def locate(tiers: Sequence[Tier], hashes: Sequence[bytes]) -> list[str | None]:
    """For every page, the name of the first of ``tiers`` that holds it, or None. Asks each
    tier only for what the tiers before it missed, one ``contains`` batch per tier."""
    where: list[str | None] = [None] * len(hashes)
    pending = list(range(len(hashes)))
    for tier in tiers:
        if not pending:
            break
        found = tier.contains([hashes[i] for i in pending])
        for i, hit in zip(pending, found):
            if hit:
                where[i] = tier.name
        pending = [i for i, hit in zip(pending, found) if not hit]
    return where
