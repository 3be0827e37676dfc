"""PrefixIndex: which worker holds which pages, in which tier, fed by the workers' block events.

The router hashes a prompt into page hashes (``kvstore.hashing.hash_pages``, the same function
the workers use) and asks ``match`` how many pages, counted from the start of the prompt, each
worker could reuse, split by the tier each page would come from. See docs/router.md for the
rules (tiers, sequence numbers and resync, optimistic entries).

Layout, chosen so ``match`` costs a few dict lookups per prompt page, whatever the number of
workers:
- per worker: one set of page hashes per own tier (device, host, peer), plus the optimistic
  device entries with their expiry. These are the bookkeeping (what to drop on a resync,
  ``num_pages``);
- shared: Redis pages (visible to every worker) with the workers that reported them, and a
  count of how many live workers hold each page in a peer-fetchable tier;
- per page, one int packing all of that: bit 0 "in Redis", bit 1 "a live peer holds it",
  then three bits per worker slot (own device, own host, own peer). One dict lookup per page
  tells every worker's tier at once. Optimistic device pages have their own small dict of
  the same shape (page -> device bits), so routing a 1,024-page prompt touches small tables
  only; ``match`` ORs the two.
``match`` walks the prompt once, and does per-worker work only where a page's packed state
differs from the previous page's (usually a handful of times per prompt).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import compress, groupby, repeat
from operator import not_, or_

from kvmesh.kvstore.events import BlockEvent, BlockRemoved, BlockStored

DEVICE = "device"
HOST = "host"
REDIS = "redis"
PEER = "peer"
TIERS = (DEVICE, HOST, REDIS, PEER)
# the owner of Redis pages a retired worker left there (PrefixIndex.remove_worker)
REDIS_ORPHAN = "(retired)"

WorkerId = Hashable

# Packed per-page state (PrefixIndex._state): two shared flags, then per worker slot its own
# tiers at ``bit << worker.shift``.
_IN_REDIS = 1
_AT_PEER = 2
_DEVICE_BIT, _HOST_BIT, _PEER_BIT = 1, 2, 4
_TIER_BIT = {DEVICE: _DEVICE_BIT, HOST: _HOST_BIT, PEER: _PEER_BIT}

# Tiers of another worker that count as a "peer" hit. DESIGN.md's peer tier is another
# worker's host RAM over KVTransfer.Fetch; device pages are included by default because a
# worker holding a page in device can copy it out for a peer just as well. Pass
# ``peer_tiers={"host"}`` if the worker's Fetch serves only its host tier.
DEFAULT_PEER_TIERS = frozenset({DEVICE, HOST})


@dataclass(frozen=True, slots=True)
class Match:
    """Pages one worker could reuse, consecutive from the start of the prompt, by tier.

    Each page is counted once, in the cheapest tier it is reachable from for this worker:
    own device, then own host, then Redis, then peer (another worker's device or host, or a
    page this worker itself reported in tier "peer").
    """

    device: int = 0
    host: int = 0
    redis: int = 0
    peer: int = 0

    @property
    def pages(self) -> int:
        """Total consecutive pages matched, over all tiers."""
        return self.device + self.host + self.redis + self.peer


NO_MATCH = Match()


@dataclass
class _Worker:
    """One worker's view: its own tiers, its event stream position and its optimistic pages."""

    shift: int = 2  # where this worker's three bits (device, host, peer) sit in a page state
    engine_id: str | None = None
    last_seq: int = -1
    resyncing: bool = True
    device: set[bytes] = field(default_factory=set)  # real pages; optimistic ones are apart
    host: set[bytes] = field(default_factory=set)
    peer: set[bytes] = field(default_factory=set)  # pages it reported in tier "peer"
    redis: set[bytes] = field(default_factory=set)  # pages it reported to Redis
    # Optimistic device pages (never also in ``device``) -> expiry of their latest insertion.
    optimistic: dict[bytes, float] = field(default_factory=dict)
    # (expiry, pages) per insertion, in expiry order (constant TTL, monotonic clock). A page
    # expires with a batch only if that batch's expiry is still its own: it was not inserted
    # again, confirmed or removed since.
    optimistic_batches: deque[tuple[float, list[bytes]]] = field(default_factory=deque)

    def tier_set(self, tier: str) -> set[bytes]:
        if tier == DEVICE:
            return self.device
        if tier == HOST:
            return self.host
        if tier == PEER:
            return self.peer
        return self.redis


@dataclass
class IndexStats:
    """Counters that tell a stale index from a bad route (exported as metrics by the service)."""

    events_applied: int = 0
    events_ignored: int = 0  # arrived while the worker was resyncing
    gaps: int = 0
    restarts: int = 0
    optimistic_inserted: int = 0
    optimistic_confirmed: int = 0
    optimistic_expired: int = 0


class PrefixIndex:
    """Per-worker page sets fed by block events; ``match`` scores a prompt against them.

    Not thread-safe: the router applies events and routes from one thread or event loop.
    """

    def __init__(
        self,
        *,
        optimistic_ttl_s: float = 2.0,
        peer_tiers: Iterable[str] = DEFAULT_PEER_TIERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if optimistic_ttl_s < 0:
            raise ValueError(f"optimistic_ttl_s must be >= 0, got {optimistic_ttl_s}")
        peer_tiers = frozenset(peer_tiers)
        if not peer_tiers <= {DEVICE, HOST}:
            raise ValueError(f"peer_tiers must be a subset of {{device, host}}, got {peer_tiers}")
        self.optimistic_ttl_s = optimistic_ttl_s
        self.peer_tiers = peer_tiers
        self._clock = clock
        self._workers: dict[WorkerId, _Worker] = {}
        self._free_shifts: list[int] = []  # slots of removed workers, reused first
        self._next_shift = 2
        # page -> packed state (see the module docstring); absent when nobody has the page
        self._state: dict[bytes, int] = {}
        # page -> device bits of the workers holding it optimistically
        self._opt_state: dict[bytes, int] = {}
        # page -> workers that reported it stored in Redis. One Redis key serves everyone.
        self._redis: dict[bytes, set[WorkerId]] = {}
        # page -> number of (live worker, peer tier) holdings, from real events only: an
        # optimistic page is not there yet, so no peer could fetch it.
        self._peer_holders: dict[bytes, int] = {}
        self.stats = IndexStats()

    # ----------------------------------------------------------------- workers and resync

    def add_worker(self, worker_id: WorkerId) -> None:
        """Register a worker with no pages; it is resyncing until its stream starts (seq 0)."""
        self._worker(worker_id)

    def _worker(self, worker_id: WorkerId) -> _Worker:
        """The worker's entry, created (with a free mask bit) if it is new."""
        w = self._workers.get(worker_id)
        if w is None:
            if self._free_shifts:
                shift = self._free_shifts.pop()
            else:
                shift, self._next_shift = self._next_shift, self._next_shift + 3
            w = self._workers[worker_id] = _Worker(shift=shift)
        return w

    def remove_worker(self, worker_id: WorkerId, *, keep_redis: bool = False) -> None:
        """Forget a worker and every page it reported. Its Redis reports go too, unless
        ``keep_redis``: a worker that left cleanly (retired after writing its cache down to
        Redis) leaves its Redis pages credited to every worker, held by ``REDIS_ORPHAN``
        until some worker reports them gone."""
        w = self._workers.get(worker_id)
        if w is not None:
            if keep_redis:
                for h in w.redis:
                    owners = self._redis.get(h)
                    if owners is not None:
                        owners.add(REDIS_ORPHAN)
                w.redis = set()
            self._drop_pages(worker_id, w, keep_optimistic=False)
            del self._workers[worker_id]
            self._free_shifts.append(w.shift)

    def unique_pages(self, worker_id: WorkerId) -> int:
        """Pages only this worker holds: in its own device or host tier, in no other
        worker's, and not in Redis. What the cluster loses when it goes without a flush
        (the autoscaler retires the worker with the fewest)."""
        w = self._workers.get(worker_id)
        if w is None:
            return 0
        own = (_DEVICE_BIT | _HOST_BIT | _PEER_BIT) << w.shift
        shared = _IN_REDIS | ~(own | _AT_PEER | 3)  # Redis, or any other worker's bits
        n = 0
        state = self._state
        for h in w.device | w.host:
            if not state.get(h, 0) & shared:
                n += 1
        return n

    def reset(self, worker_id: WorkerId, engine_id: str, next_seq: int = 0) -> None:
        """Drop the worker's pages and trust its stream from ``engine_id``'s ``next_seq`` on.

        For a caller that knows the worker's cache from elsewhere (a snapshot it replays as
        events numbered from ``next_seq``). A stream starting at seq 0 does this by itself.
        """
        if next_seq < 0:
            raise ValueError(f"next_seq must be >= 0, got {next_seq}")
        w = self._worker(worker_id)
        self._drop_pages(worker_id, w, keep_optimistic=True)
        w.engine_id = engine_id
        w.last_seq = next_seq - 1
        w.resyncing = False

    def workers(self) -> list[WorkerId]:
        return list(self._workers)

    def is_resyncing(self, worker_id: WorkerId) -> bool:
        """True while the index holds no trustworthy view of the worker (or does not know it)."""
        w = self._workers.get(worker_id)
        return w is None or w.resyncing

    def num_pages(self, worker_id: WorkerId, tier: str) -> int:
        """Pages the index holds for a worker in one tier (device includes optimistic)."""
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}; accepted: {', '.join(TIERS)}")
        w = self._workers.get(worker_id)
        if w is None:
            return 0
        n = len(w.tier_set(tier))
        return n + len(w.optimistic) if tier == DEVICE else n

    # --------------------------------------------------------------------------- events

    def apply(self, worker_id: WorkerId, event: BlockEvent) -> None:
        """Apply one block event from ``worker_id``.

        Resync rule: seq 0 (re)starts the worker's stream: its pages are dropped and events
        are trusted from there on, because a fresh engine numbers its first event 0. Any other
        break (a gap, a seq that goes back, a new engine_id without seq 0) drops the worker's
        pages and ignores its events until the next seq 0 or ``reset``. Optimistic entries
        survive a gap and the worker's first start, not a restart.
        """
        if event.tier not in TIERS:
            raise ValueError(f"unknown tier {event.tier!r}; accepted: {', '.join(TIERS)}")
        w = self._worker(worker_id)
        if event.seq == 0:
            first_start = w.engine_id is None
            if not first_start and not w.resyncing:  # else counted when the break was seen
                self.stats.restarts += 1
            self._drop_pages(worker_id, w, keep_optimistic=first_start)
            w.engine_id = event.engine_id
            w.resyncing = False
        elif w.resyncing:
            self.stats.events_ignored += 1
            return
        elif event.engine_id != w.engine_id or event.seq <= w.last_seq:
            self.stats.restarts += 1
            self._drop_pages(worker_id, w, keep_optimistic=False)
            w.resyncing = True
            self.stats.events_ignored += 1
            return
        elif event.seq != w.last_seq + 1:
            self.stats.gaps += 1
            self._drop_pages(worker_id, w, keep_optimistic=True)
            w.resyncing = True
            self.stats.events_ignored += 1
            return
        w.last_seq = event.seq
        self.stats.events_applied += 1
        if isinstance(event, BlockStored):
            self._stored(worker_id, w, event.block_hash, event.tier)
        elif isinstance(event, BlockRemoved):
            self._removed(w, event.block_hash, event.tier)
        else:
            raise TypeError(f"expected BlockStored or BlockRemoved, got {type(event).__name__}")

    def apply_batch(self, worker_id: WorkerId, events: Iterable[BlockEvent]) -> None:
        """Apply a worker's events in order (as delivered in one message)."""
        for ev in events:
            self.apply(worker_id, ev)

    def _stored(self, worker_id: WorkerId, w: _Worker, h: bytes, tier: str) -> None:
        if tier == REDIS:
            w.redis.add(h)
            owners = self._redis.get(h)
            if owners is None:
                owners = self._redis[h] = set()
                self._set(h, _IN_REDIS)
            owners.add(worker_id)
            return
        if tier == DEVICE and w.optimistic.pop(h, None) is not None:
            # The guess came true: the page is now real, so peers may fetch it.
            self._clear_opt(w, h)
            self.stats.optimistic_confirmed += 1
        elif h in w.tier_set(tier):
            return  # a repeated store changes nothing
        self._add(w, tier, h)
        if tier in self.peer_tiers:
            self._inc_peer(h)

    def _removed(self, w: _Worker, h: bytes, tier: str) -> None:
        if tier == REDIS:
            # One shared key: whoever saw it go, it is gone for everyone.
            owners = self._redis.pop(h, None)
            if owners is not None:
                self._clear(h, _IN_REDIS)
                for wid in owners:
                    ow = self._workers.get(wid)
                    if ow is not None:
                        ow.redis.discard(h)
            return
        if tier == DEVICE and w.optimistic.pop(h, None) is not None:
            self._clear_opt(w, h)
            return  # was only a guess: never counted as a peer holding
        if h not in w.tier_set(tier):
            return  # stored before the stream we trust began
        self._discard(w, tier, h)
        if tier in self.peer_tiers:
            self._dec_peer(h)

    def _set(self, h: bytes, bits: int) -> None:
        state = self._state
        state[h] = state.get(h, 0) | bits

    def _clear(self, h: bytes, bits: int) -> None:
        state = self._state
        m = state.get(h, 0) & ~bits
        if m:
            state[h] = m
        else:
            state.pop(h, None)

    def _clear_opt(self, w: _Worker, h: bytes) -> None:
        opt_state = self._opt_state
        m = opt_state[h] & ~(_DEVICE_BIT << w.shift)
        if m:
            opt_state[h] = m
        else:
            del opt_state[h]

    def _add(self, w: _Worker, tier: str, h: bytes) -> None:
        """Add ``h`` to one of the worker's own tiers (device, host, peer) and its state."""
        w.tier_set(tier).add(h)
        self._set(h, _TIER_BIT[tier] << w.shift)

    def _discard(self, w: _Worker, tier: str, h: bytes) -> None:
        """Take ``h`` out of one of the worker's own tiers and its state (if it is there)."""
        w.tier_set(tier).discard(h)
        self._clear(h, _TIER_BIT[tier] << w.shift)

    def _inc_peer(self, h: bytes) -> None:
        n = self._peer_holders.get(h, 0)
        self._peer_holders[h] = n + 1
        if not n:
            self._set(h, _AT_PEER)

    def _dec_peer(self, h: bytes) -> None:
        n = self._peer_holders[h] - 1
        if n:
            self._peer_holders[h] = n
        else:
            del self._peer_holders[h]
            self._clear(h, _AT_PEER)

    def _drop_pages(self, worker_id: WorkerId, w: _Worker, *, keep_optimistic: bool) -> None:
        """Forget what the worker's events said; optimistic entries stay when the same engine
        is still there (a gap, a first start, a reset): the requests routed to it still are.
        """
        for tier in self.peer_tiers:
            for h in w.tier_set(tier):
                self._dec_peer(h)
        for h in w.redis:
            owners = self._redis.get(h)
            if owners is not None:
                owners.discard(worker_id)
                if not owners:
                    del self._redis[h]
                    self._clear(h, _IN_REDIS)
        for tier in (DEVICE, HOST, PEER):
            bits = _TIER_BIT[tier] << w.shift
            for h in w.tier_set(tier):
                self._clear(h, bits)
        w.device, w.host, w.peer, w.redis = set(), set(), set(), set()
        if not keep_optimistic:
            for h in w.optimistic:
                self._clear_opt(w, h)
            w.optimistic = {}
            w.optimistic_batches.clear()
        w.last_seq = -1

    # ----------------------------------------------------------------- optimistic entries

    def insert_optimistic(self, worker_id: WorkerId, page_hashes: Sequence[bytes]) -> None:
        """Record that ``worker_id`` will soon hold ``page_hashes`` in device.

        Called right after routing a request there, so the next request of a same-prefix
        burst matches it before the worker's events arrive. A matching BlockStored(device)
        confirms an entry; an unconfirmed one expires ``optimistic_ttl_s`` after insertion.
        Pages the worker already holds in device are left as they are. An unknown or
        resyncing worker gets entries too: the guess is about the request just sent there.
        """
        w = self._worker(worker_id)
        now = self._clock()
        self._expire(w, now)
        expiry = now + self.optimistic_ttl_s
        bit = _DEVICE_BIT << w.shift
        # Pages this worker does not hold for real; map/compress/update keep the per-page
        # work in C loops (a 16K-token prompt is 1,024 pages).
        held = map(bit.__and__, map(self._state.get, page_hashes, repeat(0)))
        new = list(compress(page_hashes, map(not_, held)))
        if not new:
            return
        opt_state = self._opt_state
        opt_state.update(zip(new, map(or_, map(opt_state.get, new, repeat(0)), repeat(bit))))
        w.optimistic.update(dict.fromkeys(new, expiry))  # a page already there: new expiry
        w.optimistic_batches.append((expiry, new))
        self.stats.optimistic_inserted += len(new)

    def _expire(self, w: _Worker, now: float) -> None:
        batches, opt = w.optimistic_batches, w.optimistic
        while batches and batches[0][0] <= now:
            expiry, pages = batches.popleft()
            for h in pages:
                if opt.get(h) == expiry:
                    del opt[h]
                    self._clear_opt(w, h)
                    self.stats.optimistic_expired += 1

    # ------------------------------------------------------------------------------ match

    def match(self, page_hashes: Sequence[bytes]) -> dict[WorkerId, Match]:
        """Pages each known worker could reuse from the start of the prompt, by tier.

        Cost: a few dict lookups per prompt page up to the first page no worker can get,
        plus per-worker work only where the set of holders changes along the prompt.
        Resyncing workers are included: their own tiers are empty but Redis and peer pages
        are still reachable from them. This method does not modify the index, except that it
        expires optimistic entries that are past their TTL.
        """
        now = self._clock()
        for w in self._workers.values():
            if w.optimistic_batches:
                self._expire(w, now)
        # Every page's packed state, looked up by C loops (map), not a Python one.
        states = map(self._state.get, page_hashes, repeat(0))
        if self._opt_state:
            states = map(or_, states, map(self._opt_state.get, page_hashes, repeat(0)))
        # counts[wid] = [device, host, redis, peer]; a worker leaves `active` at its first miss
        counts = {wid: [0, 0, 0, 0] for wid in self._workers}
        active = [(w.shift, counts[wid]) for wid, w in self._workers.items()]
        # A run of pages with the same packed state classifies every worker the same way, so
        # each run (groupby) is credited in one go.
        for key, run in groupby(states):
            if not key:
                break  # no worker can get this page: every run ends here
            in_redis, at_peer = key & _IN_REDIS, key & _AT_PEER
            n = len(list(run))
            still = []
            for item in active:
                own = (key >> item[0]) & 7
                c = item[1]
                # the cheapest tier this worker gets the page from; a peer holder found here
                # is another worker (its own tiers are checked first)
                if own & _DEVICE_BIT:
                    c[0] += n
                elif own & _HOST_BIT:
                    c[1] += n
                elif in_redis:
                    c[2] += n
                elif at_peer or own & _PEER_BIT:
                    c[3] += n
                else:
                    continue  # first miss: this worker's run ends here
                still.append(item)
            active = still
            if not active:
                break
        return {wid: Match(*c) if any(c) else NO_MATCH for wid, c in counts.items()}
