"""The KV connector: the one door between the engine and every tier below the device pool.

The scheduler never talks to a store. For a waiting request it asks the connector one
question, ``start_promotion``: can the tiers (host RAM, Redis, peers the router named)
supply more of this prompt than the device holds? If so, the request enters
``RequestStatus.PROMOTING`` and stays in the waiting queue, passed over, while the pages are
fetched on a thread. Each step the scheduler asks ``finish_promotion``; once it says yes the
pages are cached in the pool and held for the request, and it is scheduled like any other,
its prefix found on the device. A failed or empty fetch just ends the promotion: the request
computes what it lacks. The other direction needs no question: the pool tells the connector
of every page it evicts (``set_evict_listener``), and ``save_evicted`` copies them out before
the step that reuses their slots runs; a thread encodes them into the first tier.

Promotion, step by step (docs/architecture.md has the same list):

1. ``start_promotion``: the request's device run is shorter than its prompt's full pages.
   Its device pages (and any later ones past a gap) are held, so other work cannot evict
   the prefix the promoted pages continue, and a fetch of the rest starts on the thread.
2. The thread looks the pages up in the store, then in each hinted peer, and fetches the
   longest consecutive run (validated by the codec) as zero-copy views, from the store in
   batches, each handed over as soon as it is validated.
3. ``finish_promotion`` (engine thread): while the fetch runs, the batches validated so far
   are written (the copy into the pool overlaps the reading of the next batch); once it is
   done, the rest. Pages the device gained meanwhile need no copy; the
   rest go into free pages, one copy each, then are published as cached pages and held.
   A run that does not fit beside room for the running requests waits for them to free
   pages, at most ``MAX_DEFER_STEPS`` steps; then (or when nothing runs) what fits goes in.
4. The scheduler admits the request (``KVCacheManager.allocate_slots`` takes over the held
   pages) and credits each page to the tier it came from.

A request is promoted at most ``MAX_PROMOTIONS`` times per admission (a prefix evicted again
and again is computed); a preemption gives it a fresh budget.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvmesh.kvstore.codec import PageSpec
from kvmesh.kvstore.events import EventLog
from kvmesh.kvstore.host import HostTier
from kvmesh.kvstore.store import TieredStore
from kvmesh.kvstore.tier import Tier
from kvmesh.worker.kv_cache import KVCacheManager, Page
from kvmesh.worker.kv_memory import KVMemory
from kvmesh.worker.offload import FetchResult, KVOffloader
from kvmesh.worker.request import Request, RequestStatus

logger = logging.getLogger(__name__)

MAX_PROMOTIONS = 3  # promotions per admission: a prefix evicted again and again is computed
MAX_DEFER_STEPS = 32  # steps a fetched run may wait for room before it is written in part


def make_store(
    spec: PageSpec,
    events: EventLog | None,
    *,
    host_cache_memory: int | None = None,
    redis_url: str | None = None,
    redis_ttl_s: float | None = 24 * 3600.0,
    redis_namespace: str = "kvmesh",
    extra_tiers: Sequence[Tier] = (),
) -> TieredStore | None:
    """The tiers below the device, fastest first, or None when there are none."""
    tiers: list[Tier] = []
    if host_cache_memory is not None:
        tiers.append(HostTier(host_cache_memory))
    if redis_url:
        from kvmesh.kvstore.redis_tier import RedisTier  # redis-py only when used

        tiers.append(
            RedisTier(
                redis_url,
                model_fp=spec.model_fp,
                cache_format=spec.cache_format,
                ttl_s=redis_ttl_s,
                namespace=redis_namespace,
            )
        )
    tiers += list(extra_tiers)
    if not tiers:
        return None
    logger.info("tiered store: %s", " -> ".join(["device"] + [t.name for t in tiers]))
    return TieredStore(spec, tiers, events=events)


class KVConnector:
    """Promotes prefix pages from the tiers into the pool and spills evicted pages down.

    Scheduler-side calls (engine thread): ``start_promotion``, ``finish_promotion``,
    ``on_preempted``, ``on_finished``. Engine-side: ``save_evicted`` once per step after
    scheduling, ``wait_for_promotion`` when nothing could be scheduled. The fetch and spill
    threads live in ``KVOffloader``.

    Without a store the connector still promotes from peers a request names (router hints).
    """

    def __init__(self, kv: KVCacheManager, memory: KVMemory, store: TieredStore | None):
        self.kv = kv
        self.memory = memory
        self.store = store
        self.offloader = KVOffloader(store, memory.page_spec)
        self.block_size = kv.block_size
        # fetched runs waiting for room in the pool, by request id: (result, steps deferred)
        self._fetched: dict[str, tuple[FetchResult, int]] = {}
        self._closed = False
        if store is not None:  # spill evicted pages down the tiers
            kv.set_evict_listener(self.offloader.on_evict)

    # ------------------------------------------------------------ scheduler side

    def start_promotion(self, req: Request, device_pages: list[Page]) -> bool:
        """Start promoting the rest of ``req``'s prefix, after its ``device_pages`` (the
        device's run from the start), if the tiers may hold more. True: ``req`` is now
        PROMOTING; False: schedule it now with what the device has.

        The last prompt token is always computed, so at most ``(num_tokens - 1) //
        block_size`` pages can be served. A request looks again whenever its device run is
        shorter than what it last reached (its pages were evicted and spilled meanwhile)."""
        if self._closed or (self.store is None and not req.peer_hints):
            return False
        max_pages = req.max_cached_pages()
        n_device = len(device_pages)
        if (
            n_device >= max_pages
            or n_device == req.promoted_run  # nothing changed since it last looked
            or req.num_promotions >= MAX_PROMOTIONS
        ):
            return False
        req.num_promotions += 1
        rest = req.page_hashes[n_device:max_pages]
        # device pages past the first gap (an older part of the prompt was evicted first)
        # continue the run once the gap is promoted: hold them too
        later = [self.kv.cached_page(h) for h in rest]
        self.kv.hold(req, list(device_pages) + [p for p in later if p is not None])
        self.offloader.start_fetch(req, n_device, rest, [p is not None for p in later])
        req.status = RequestStatus.PROMOTING
        return True

    def finish_promotion(self, req: Request, room_needed: bool) -> bool:
        """For a PROMOTING request: True once its promoted pages are cached and held (it is
        WAITING again, to be scheduled now); False while its fetch is in flight or its run
        waits for room. ``room_needed``: requests are running and would need free pages."""
        if self._closed:  # its fetch was dropped: it computes what it lacks
            req.status = RequestStatus.WAITING
            return True
        entry = self._fetched.pop(req.request_id, None)
        if entry is None:
            res = self.offloader.take_fetch(req.request_id)
            if res is None:  # still in flight: write the batches validated so far
                part = self.offloader.take_partial(req.request_id)
                if part is not None:
                    self._write(part, 0, room_needed, partial=True)  # or nothing, to wait
                return False
            entry = (res, 0)
        res, deferred = entry
        if not self._write(res, deferred, room_needed):
            self._fetched[req.request_id] = (res, deferred + 1)
            return False
        req.status = RequestStatus.WAITING
        return True

    def _write(
        self, res: FetchResult, deferred: int, room_needed: bool, partial: bool = False
    ) -> bool:
        """Cache a fetched run in the pool and hold it for its request. False (nothing
        written) when it should wait for room. ``partial``: the leading part of a run whose
        fetch goes on (``take_partial``); the request's device pages past it stay held."""
        req, kv = res.request, self.kv
        first, end = res.first_page, res.first_page + len(res.tiers)
        # a part keeps every device page of the prefix held (start_promotion held those past
        # a gap too, and the rest of the run may continue into them)
        hold_end = req.max_cached_pages() if partial else end
        hashes = req.page_hashes[first:end]
        # pages the device has (held since the start, or gained meanwhile) need no copy
        todo = [
            i
            for i, h in enumerate(hashes)
            if res.tiers[i] != "device" and kv.cached_page(h) is None
        ]
        # hold the part of the run the device has before taking pages for the rest, so
        # taking them cannot evict it
        self._hold_run(req, hold_end)
        reserve = kv.num_pages // 8  # room for the running requests' next pages
        if (
            todo
            and len(todo) > kv.num_free_pages - reserve
            and room_needed
            and deferred < MAX_DEFER_STEPS
        ):
            return False
        if not partial:
            req.promoted_run = end  # the run it can now expect

        def write(page_ids: list[int]) -> None:
            self.save_evicted()  # the taken pages' old contents leave first
            self.memory.write(page_ids, [res.payloads[i] for i in todo[: len(page_ids)]])

        pages = kv.insert_cached_pages(req, [first + i for i in todo], write)
        for i in todo[: len(pages)]:
            req.promoted_from[hashes[i]] = res.tiers[i]
        self._hold_run(req, hold_end)
        kv.unpin(pages)  # the hold keeps them now
        return True

    def _hold_run(self, req: Request, end: int) -> None:
        pages = [p for h in req.page_hashes[:end] if (p := self.kv.cached_page(h))]
        self.kv.hold(req, pages)

    def on_preempted(self, req: Request) -> None:
        """A preempted request's pages spill like any freed cached page: on resumption it
        may promote them again, however often it did before."""
        req.num_promotions, req.promoted_run = 0, -1

    def on_finished(self, req: Request) -> None:
        """Forget a request (finished or aborted): its fetch result, if any, is dropped."""
        self.offloader.cancel(req.request_id)
        self._fetched.pop(req.request_id, None)

    @property
    def num_promoting(self) -> int:
        return self.offloader.num_fetching + len(self._fetched)

    # ------------------------------------------------------------ engine side

    def save_evicted(self) -> None:
        """Copy pages the pool evicted out of it, before anything overwrites their slots."""
        self.offloader.flush_spills(self.memory.buffer)

    def wait_for_promotion(self, timeout: float) -> None:
        """Nothing could be scheduled: block until a fetch finishes (or ``timeout``)."""
        if self.offloader.num_fetching:
            self.offloader.wait_for_fetch(timeout)

    def drain(self, timeout: float = 30.0) -> None:
        """Return once every page spilled so far is in the store (TimeoutError after
        ``timeout`` seconds)."""
        self.save_evicted()
        self.offloader.drain(timeout)

    def host_tier(self) -> HostTier | None:
        tiers = self.store.tiers if self.store is not None else []
        return next((t for t in tiers if isinstance(t, HostTier)), None)

    def tier_names(self) -> list[str]:
        return [t.name for t in self.store.tiers] if self.store is not None else []

    def metrics(self) -> dict:
        """The offloader's spill and promotion counters, and per-tier store counters."""
        out = {"offload": dict(self.offloader.metrics)}
        if self.store is not None:
            out["tiers"] = self.store.metrics()
        return out

    def close(self) -> None:
        """Finish pending spills and release the store's threads and connections (once). The
        engine goes on with its device pages only."""
        if self._closed:
            return
        self._closed = True
        self.kv.set_evict_listener(None)
        self.offloader.close()
