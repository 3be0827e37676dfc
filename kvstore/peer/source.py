"""The server side's pages: ``PageSource``, what a worker's KVTransfer service and data plane
serve from and store pushed pages into; ``TierPageSource``, a PageSource over tiers; and
``valid_pushes``, the one check a pushed page passes before any source stores it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

from kvmesh.kvstore.codec import Buffer, PageCodecError, PageSpec, decode, read_header
from kvmesh.kvstore.hashing import PAGE_HASH_BYTES
from kvmesh.kvstore.tier import Tier, locate

logger = logging.getLogger(__name__)


@runtime_checkable
class PageSource(Protocol):
    """Where a worker's KVTransfer service finds pages and stores pushed ones.

    Methods are called from a thread pool, never from the event loop, and may block. The
    engine-side source reads device pages on the engine thread; ``TierPageSource`` serves
    any ``Tier``.
    """

    def lookup(self, hashes: Sequence[bytes]) -> list[str | None]:
        """For each hash, the name of the tier that holds it, or ``None``. No LRU change."""

    def fetch(self, hashes: Sequence[bytes]) -> list[bytes | None]:
        """For each hash, its encoded page object, or ``None`` for a miss."""

    def accept(self, items: list[tuple[bytes, bytes]]) -> int:
        """Validate (``valid_pushes``) and store pushed ``(hash, object)`` pairs; returns how
        many were stored."""


def valid_pushes(
    items: Iterable[tuple[bytes, Buffer]], spec: PageSpec | None
) -> list[tuple[bytes, Buffer]]:
    """The pushed ``(hash, object)`` pairs a worker may store, in order: the hash is a page
    hash (``PAGE_HASH_BYTES``) and the object a page object of the codec (framing, magic,
    version) that, given ``spec``, also decodes under it (model, cache format, shape,
    checksum), so that a peer can never plant foreign KV. Each rejected pair is logged."""
    good: list[tuple[bytes, Buffer]] = []
    for h, obj in items:
        why = None
        if len(h) != PAGE_HASH_BYTES:
            why = f"its hash is {len(h)} bytes; page hashes are {PAGE_HASH_BYTES} bytes"
        else:
            try:
                if spec is not None:
                    decode(spec, obj)
                else:
                    read_header(obj)
            except PageCodecError as e:
                why = str(e)
        if why is not None:
            logger.warning("pushed page %s rejected: %s", h.hex(), why)
            continue
        good.append((h, obj))
    return good


class TierPageSource:
    """A PageSource over tiers, first hit wins; pushed pages go to the first tier.

    Pushed objects must pass ``valid_pushes``: page objects of the codec, and with a
    ``spec`` objects that decode under it.
    """

    def __init__(self, tiers: Tier | Sequence[Tier], *, spec: PageSpec | None = None) -> None:
        self.tiers = [tiers] if isinstance(tiers, Tier) else list(tiers)
        if not self.tiers:
            raise ValueError("TierPageSource needs at least one tier")
        self.spec = spec

    def lookup(self, hashes: Sequence[bytes]) -> list[str | None]:
        return locate(self.tiers, hashes)

    def fetch(self, hashes: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = [None] * len(hashes)
        pending = list(range(len(hashes)))
        for tier in self.tiers:
            if not pending:
                break
            objs = tier.get([hashes[i] for i in pending])
            for i, obj in zip(pending, objs):
                out[i] = obj
            pending = [i for i, obj in zip(pending, objs) if obj is None]
        return out

    def accept(self, items: list[tuple[bytes, bytes]]) -> int:
        good = valid_pushes(items, self.spec)
        if good:
            self.tiers[0].put(good)
        return len(good)
