"""TieredStore: the engine's one door to every tier below the device pool.

Tiers are ordered fastest first (e.g. host, redis, peer). Writes go to the first tier; a
HostTier first in line writes its LRU victims back to the next tier (write-back spill).
Reads walk the tiers in order and ask each only for what the tiers above it missed, one
batch per tier. The store validates every object with the codec: an object that fails is a
miss, is deleted from the tier that held it, and is counted, so a reader never sees foreign
or corrupted KV.

With an ``EventLog``, the store reports what enters and leaves its host and Redis tiers as
block events (tier-tagged, on the engine's sequence numbers), so the router's prefix index
credits those pages too. Redis may drop keys by its own LRU unseen: the router treats its
Redis entries as hints.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.kvstore.codec import (
    Buffer,
    PageCodecError,
    PageSpec,
    decode,
    encode,
    max_object_bytes,
)
from kvmesh.kvstore.events import EventLog
from kvmesh.kvstore.host import HostTier
from kvmesh.kvstore.tier import Tier, locate

logger = logging.getLogger(__name__)

# tiers whose contents the store reports as block events; a peer tier is another worker's,
# which that worker reports itself
REPORTED_TIERS = frozenset({"host", "redis"})


@dataclass
class FlushResult:
    """What ``TieredStore.flush_down`` did: pages ``written`` to ``tier``, ``already`` there,
    ``left`` behind (the time bound or a tier fault), and whether the time ran out."""

    tier: str | None = None
    written: int = 0
    already: int = 0
    left: int = 0
    timed_out: bool = False


class TieredStore:
    """Pages of one model and cache format (``spec``) across ``tiers``, first = fastest.

    Thread-safe for concurrent callers (the engine thread and a loader thread): the tiers
    are, and the store's own counters are under a lock.
    """

    def __init__(
        self, spec: PageSpec, tiers: Sequence[Tier], *, events: EventLog | None = None
    ) -> None:
        if not tiers:
            raise ValueError("a TieredStore needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique (they label metrics), got {names}")
        self.spec = spec
        self.tiers = list(tiers)
        self.events = events
        self._report_lock = threading.Lock()  # a put or evict and its events, in order
        self._victims: list[tuple[bytes, bytes]] = []  # host victims awaiting write-back
        # host victims on their way down (from the eviction until the next tier's put has
        # returned): in neither tier meanwhile, so locate and get look here too
        self._transit: dict[bytes, bytes] = {}
        self._deferring = False
        # A tier that receives objects from the network (PeerTier) refuses any longer than
        # this store's pages can be, before allocating for them.
        bound = max_object_bytes(spec)
        for t in self.tiers:
            limit = getattr(t, "max_page_bytes", None)
            if isinstance(limit, int) and limit > bound:
                t.max_page_bytes = bound
        first = self.tiers[0]
        if isinstance(first, HostTier) and first.on_evict is None:
            first.set_evict_listener(self._write_back)  # host victims spill one tier down
        self._lock = threading.Lock()
        self._counts = {
            t.name: {"hits": 0, "misses": 0, "corrupt": 0, "bytes": 0} for t in self.tiers
        }

    def put(self, items: Sequence[tuple[bytes, Buffer]]) -> None:
        """Encode each ``(hash, payload)`` once and store it in the first tier."""
        if items:
            self.put_encoded([(h, encode(self.spec, payload)) for h, payload in items])

    def put_encoded(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        """Store ``(hash, object)`` pairs already encoded (and validated) for this store's
        spec in the first tier."""
        if not items:
            return
        first = self.tiers[0]
        # One put and its events at a time: the router hears of a page's removal after its
        # storing, never before. The write-back of a HostTier's victims runs after the lock
        # (a network call to Redis must not stall the other writer).
        with self._report_lock:
            self._deferring = True  # _write_back keeps the victims for after the lock
            try:
                kept = first.put(items)
                self._report(first, stored=kept)
            finally:
                self._deferring = False
                victims, self._victims = self._victims, []
        self._spill_down(victims)

    def _write_back(self, victims: list[tuple[bytes, bytes]]) -> None:
        """A HostTier first in line evicted these by its budget: report them gone now, and
        hand them to the next tier (after ``put_encoded``'s lock when inside it)."""
        self._report(self.tiers[0], removed=[h for h, _ in victims])
        if len(self.tiers) > 1:
            with self._lock:
                self._transit.update(victims)
        if self._deferring:
            self._victims += victims
        else:
            self._spill_down(victims)

    def _spill_down(self, victims: list[tuple[bytes, bytes]]) -> None:
        if victims and len(self.tiers) > 1:
            try:
                self._report(self.tiers[1], stored=self.tiers[1].put(victims))
            finally:  # stored or refused: no longer in transit (unless evicted again since)
                with self._lock:
                    for h, obj in victims:
                        if self._transit.get(h) is obj:
                            del self._transit[h]

    def _in_transit(self, hashes: Sequence[bytes]) -> list[bytes | None]:
        with self._lock:
            return [self._transit.get(h) for h in hashes]

    def _report(self, tier: Tier, stored: Sequence[bytes] = (), removed: Sequence[bytes] = ()):
        if self.events is None or tier.name not in REPORTED_TIERS:
            return
        if removed:
            self.events.removed_from_tier(tier.name, removed)
        if stored:
            self.events.stored_in_tier(tier.name, stored)

    def lookup(self, hashes: Sequence[bytes]) -> list[str]:
        """Tier names of the longest run of pages, from the first, that some tier holds.

        ``len(result)`` is the number of leading pages that can be promoted; the run stops at
        the first page no tier has. ``contains`` only: no LRU change, no validation.
        """
        run: list[str] = []
        for name in self.locate(hashes):
            if name is None:
                break
            run.append(name)
        return run

    def locate(self, hashes: Sequence[bytes]) -> list[str | None]:
        """For every page, the first tier that holds it, or None (``contains`` only). A
        page evicted from a first-in-line HostTier and not yet stored by the next tier is
        reported as the first tier's (it is still in this process's memory)."""
        where = locate(self.tiers[:1], hashes)
        pending = [i for i, w in enumerate(where) if w is None]
        if pending and len(self.tiers) > 1:
            # after the first tier and before the next: a page moves host -> transit ->
            # next tier, so checking in that order cannot miss one that moves meanwhile
            moving = self._in_transit([hashes[i] for i in pending])
            for i, obj in zip(pending, moving):
                if obj is not None:
                    where[i] = self.tiers[0].name
            pending = [i for i, obj in zip(pending, moving) if obj is None]
            below = locate(self.tiers[1:], [hashes[i] for i in pending])
            for i, w in zip(pending, below):
                where[i] = w
        return where

    def get(self, hashes: Sequence[bytes]) -> list[tuple[str, memoryview] | None]:
        """For each hash, ``(tier name, validated payload)`` from the first tier that has a
        valid object, else ``None``. A hit counts as a use in that tier (LRU). Objects that
        fail validation are deleted from their tier and counted as ``corrupt``."""
        out: list[tuple[str, memoryview] | None] = [None] * len(hashes)
        pending = list(range(len(hashes)))
        # after the first tier, the pages in transit from it to the next (see ``locate``):
        # served and counted as the first tier's
        steps: list[Tier | None] = [self.tiers[0]]
        if len(self.tiers) > 1:
            steps += [None, *self.tiers[1:]]
        for step in steps:
            if not pending:
                break
            tier = self.tiers[0] if step is None else step
            if step is None:
                objs = self._in_transit([hashes[i] for i in pending])
            else:
                objs = tier.get([hashes[i] for i in pending])
            still: list[int] = []
            bad: list[bytes] = []
            n_bytes = 0
            for i, obj in zip(pending, objs):
                if obj is None:
                    still.append(i)
                    continue
                try:
                    payload = decode(self.spec, obj)
                except PageCodecError as e:
                    logger.warning(
                        "%s tier: page %s is not valid for this reader (%s); deleted",
                        tier.name,
                        hashes[i].hex(),
                        e,
                    )
                    bad.append(hashes[i])
                    still.append(i)
                    continue
                out[i] = (tier.name, payload)
                n_bytes += payload.nbytes
            if bad and step is None:
                with self._lock:
                    for b in bad:
                        self._transit.pop(b, None)
            elif bad:
                with self._report_lock:
                    tier.evict(bad)
                    self._report(tier, removed=bad)
            with self._lock:
                c = self._counts[tier.name]
                c["hits"] += len(pending) - len(still)
                # the first tier's misses once, after transit (a page found there is a hit)
                if step is None or len(steps) == 1 or step is not self.tiers[0]:
                    c["misses"] += len(still)
                c["corrupt"] += len(bad)
                c["bytes"] += n_bytes
            pending = still
        return out

    def evict(self, hashes: Sequence[bytes]) -> None:
        """Drop these pages from every tier (and from transit between them)."""
        with self._lock:
            for h in hashes:
                self._transit.pop(h, None)
        with self._report_lock:
            for tier in self.tiers:
                tier.evict(hashes)
                self._report(tier, removed=hashes)

    def flush_down(self, timeout_s: float = 30.0, batch: int = 64) -> FlushResult:
        """Copy every page of a first-in-line HostTier to the tier below it (Redis) that it
        does not hold yet, most recently used first, in batches, until ``timeout_s`` runs out
        (a clean shutdown: host RAM dies with the process, the shared tier outlives it). The
        host tier keeps its copies. The pages written are reported as stored in that tier.
        A store whose first tier is not a HostTier, or with nothing below it, has nothing to
        flush. Never raises for a tier fault: what was not written is counted as left."""
        res = FlushResult()
        first = self.tiers[0]
        if not isinstance(first, HostTier) or len(self.tiers) < 2:
            return res
        below = self.tiers[1]
        res.tier = below.name
        deadline = time.monotonic() + timeout_s
        keys = first.keys()[::-1]  # most recently used first: the time bound may cut the rest
        for at in range(0, len(keys), batch):
            if time.monotonic() >= deadline:
                res.left += len(keys) - at
                res.timed_out = True
                break
            part = keys[at : at + batch]
            try:
                there = below.contains(part)
                todo = [h for h, x in zip(part, there) if not x]
                res.already += len(part) - len(todo)
                objs = first.get(todo) if todo else []
                items = [(h, o) for h, o in zip(todo, objs) if o is not None]
                kept = below.put(items) if items else []
            except Exception as e:  # a tier must not turn a shutdown into a crash
                logger.warning("flushing %d pages to %s failed: %r", len(part), below.name, e)
                res.left += len(part)
                continue
            self._report(below, stored=kept)
            res.written += len(kept)
            res.left += len(items) - len(kept)
        return res

    def metrics(self) -> dict[str, dict[str, int]]:
        """Per tier: ``hits``, ``misses`` (pages asked of it by ``get``), ``corrupt`` (objects
        that failed the codec here, plus any the tier dropped itself), ``bytes`` (valid payload
        bytes served), ``errors`` (the tier's own faults), and for a HostTier ``used_bytes``,
        ``budget_bytes``, ``num_objects``."""
        with self._lock:
            out = {name: dict(c) for name, c in self._counts.items()}
        for tier in self.tiers:
            m = out[tier.name]
            own = getattr(tier, "metrics", {})
            m["errors"] = own.get("errors", 0)
            m["corrupt"] += own.get("corrupt", 0)  # e.g. a peer's objects torn on the wire
            if isinstance(tier, HostTier):
                m["used_bytes"] = tier.used_bytes
                m["budget_bytes"] = tier.budget_bytes
                m["num_objects"] = tier.num_objects
        return out

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
