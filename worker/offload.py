"""The KV connector's threads: spill evicted pages down, fetch prefix pages for promotion.

Spill is write-back. When the page pool evicts a cached page to reuse its slot, the page's
bytes are copied out (before the step that overwrites the slot runs) through reused staging
buffers and handed to a spill thread, which encodes them and puts them into the first tier.

Fetches run on their own thread, so the step loop never waits on Redis or a peer while other
requests could run: for a request being promoted, the fetch thread asks the store (then the
peers the request names) for the longest run of consecutive pages any of them holds and
fetches them, validated by the codec. The connector (worker/kv_connector.py) writes them
into the pool on the engine thread. The store's part of a run is fetched in batches of about
``FETCH_BATCH_BYTES``; each validated batch is handed over at once (``take_partial``), so
the engine copies batch i into the pool while the fetch thread reads and checks batch i + 1.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from kvmesh.kernels.page_format import read_pages
from kvmesh.kvstore.codec import PageSpec, max_object_bytes
from kvmesh.kvstore.host import HostTier
from kvmesh.kvstore.store import TieredStore
from kvmesh.worker.daemon_executor import DaemonExecutor
from kvmesh.worker.request import Request

logger = logging.getLogger("kvmesh.offload")

MAX_PEER_STORES = 32  # peers' connections kept open (least recently named closed first)
# the peer tier's counters the metrics export (worker/metrics.py): faults, objects rejected
# by the codec or on the wire, object bytes received per transport
PEER_COUNTERS = ("errors", "corrupt", "data_plane_bytes", "grpc_bytes", "fetches_left_behind")
# a fetch still running this long after it started is abandoned (its request computes what
# it lacks): every call it makes has its own deadline (a peer's ``timeout``, Redis's socket
# timeouts), so only a call stuck past its own deadline gets here
FETCH_ABANDON_MIN_S = 60.0
FETCH_ABANDON_PEER_TIMEOUTS = 3  # ... or this many peer timeouts, if longer
# a store fetch is read and checked in batches of about this many bytes, each handed to the
# engine as it is validated (one Redis MGET each): the copy into the pool overlaps the rest
FETCH_BATCH_BYTES = 16 << 20
# after handing a batch over, the fetch thread sleeps this long: the engine thread it woke
# needs the GIL to start copying, and a thread that keeps running Python (a host fetch's
# checks) lets it in only after the interpreter's 5 ms switch interval
PUBLISH_YIELD_S = 0.0002


@dataclass
class FetchResult:
    request: Request
    first_page: int  # index in the request's page_hashes of the first fetched page
    tiers: list[str]  # per page of the run, the tier it came from ("device": not fetched)
    # per page, its validated payload: a zero-copy view of the stored object, so the engine
    # thread's copy into the pool is the only one; None where the device holds it
    payloads: list[memoryview | None]


class KVOffloader:
    """Owns the spill and fetch threads for one engine. Engine-thread methods: ``on_evict``,
    ``flush_spills``, ``start_fetch``, ``take_fetch``."""

    def __init__(
        self,
        store: TieredStore | None,
        spec: PageSpec,
        max_spill_backlog: int = 1024,
        peer_timeout_s: float = 10.0,
    ):
        self.store = store  # None: no tiers of its own, only peers a request names
        self.spec = spec
        self.page_nbytes = spec.page_nbytes
        self.peer_timeout_s = peer_timeout_s
        # hinted address -> its one-tier store, least recently named first (fetch thread)
        self._peer_stores: OrderedDict[str, TieredStore] = OrderedDict()
        # the counters of peer stores closed so far: a store's counts outlive it, so the
        # exported totals never go down (Prometheus would read a drop as a reset)
        self._closed_peer_counts = dict.fromkeys(PEER_COUNTERS, 0)
        self._peer_identity = None  # set_peer_auth: without it, no peer is contacted
        self._peer_tls = None
        self.max_spill_backlog = max_spill_backlog
        self._spill_pool = ThreadPoolExecutor(1, thread_name_prefix="kvmesh-spill")
        # a daemon thread: a fetch stuck in a library must not hold the process's exit
        self._fetch_pool = DaemonExecutor("kvmesh-fetch")
        self.fetch_abandon_s = max(
            FETCH_ABANDON_MIN_S, FETCH_ABANDON_PEER_TIMEOUTS * peer_timeout_s
        )
        self._evicted: list[tuple[bytes, int]] = []  # (hash, page id) awaiting a copy
        self._fetches: dict[str, Future] = {}
        self._fetch_info: dict[str, tuple[Request, int]] = {}  # request id -> (it, first page)
        # pages per batch of a store fetch (at least 1): whole stored objects (header
        # included) per batch, so a batch read from Redis fits one 16 MiB receive slab
        self.fetch_batch_pages = max(1, FETCH_BATCH_BYTES // max_object_bytes(spec))
        # request id -> the validated leading part of its run so far, while its fetch runs
        # (fetch thread writes, engine thread reads: whole lists swapped under the lock)
        self._partial: dict[str, list[tuple[str, memoryview] | None]] = {}
        self._partial_taken: dict[str, int] = {}  # request id -> pages already handed out
        self._news = False  # a batch arrived since the engine last waited
        # (request id, start) of the fetch the fetch thread runs now, None between fetches
        self._running: tuple[str, float] | None = None
        self._peer_lock = threading.Lock()  # _peer_store: an abandoned thread may still run
        # page hash -> the future of the spill batch carrying it, until that batch is stored
        self._spilling: dict[bytes, Future] = {}
        # set once a fetch's future is done (its done-callback: set from inside the fetch,
        # the engine thread could wake before the result is there and sleep a full timeout)
        self._done = threading.Event()
        self._backlog = 0  # pages copied out but not yet put (spill thread)
        self._lock = threading.Lock()
        self._staging = _StagingBuffers(self.page_nbytes, max_pages=max_spill_backlog)
        self.metrics = dict.fromkeys(
            (
                "spilled_pages",
                "spill_skipped_pages",
                "spill_already_stored_pages",
                "spill_errors",
                "promotions",
                "promoted_pages",
                "promotion_errors",
                "fetches_abandoned",
            ),
            0,
        )
        self.promoted_by_tier: dict[str, int] = {}  # pages fetched for promotion, by tier
        # called on the fetch thread after each fetch that brought pages: (seconds from
        # start_fetch, the run's tiers); the metrics hook (worker/metrics.py)
        self.on_promotion: Callable[[float, list[str]], None] | None = None

    # ------------------------------------------------------------ spill

    def on_evict(self, page_hash: bytes, page_id: int) -> None:
        """The pool is about to reuse page ``page_id``'s slot; its bytes are still intact."""
        self._evicted.append((page_hash, page_id))

    def flush_spills(self, kv_buffer: torch.Tensor) -> None:
        """Copy the evicted pages out of the pool now (before anything overwrites them) and
        hand them to the spill thread. Pages past the backlog limit are dropped, not queued:
        a spill is an optimisation, never worth stalling the engine for."""
        if not self._evicted:
            return
        evicted, self._evicted = self._evicted, []
        first = self.store.tiers[0] if self.store is not None else None
        if isinstance(first, HostTier):
            # A page promoted from host (or spilled before) and evicted again is still
            # there, byte for byte (same hash, same bytes): copying, encoding and storing it
            # again would only cost; refreshing it keeps the LRU order a put would have
            # given. In multi-turn chat most evictions are such pages. Asked of the in-memory
            # host tier only; a remote first tier is never asked on this thread.
            present = first.refresh([h for h, _ in evicted])
            kept = [e for e, x in zip(evicted, present) if not x]
            if len(kept) < len(evicted):
                with self._lock:
                    self.metrics["spill_already_stored_pages"] += len(evicted) - len(kept)
                evicted = kept
        # the backlog counts staging slots: a buffer in flight takes all of its slots, however
        # few pages it carries, so the staging memory stays within the backlog's pages
        per = self._staging.pages_per_buffer
        parts = [evicted[at : at + per] for at in range(0, len(evicted), per)]
        with self._lock:
            room = max(self.max_spill_backlog - self._backlog, 0) // per
            if len(parts) > room:
                self.metrics["spill_skipped_pages"] += sum(map(len, parts[room:]))
                parts = parts[:room]
            self._backlog += len(parts) * per
        pinned = kv_buffer.device.type == "cuda"
        for k, part in enumerate(parts):
            ids = torch.tensor([pid for _, pid in part], dtype=torch.int64)
            buf = self._staging.take(pinned)
            try:
                # synchronous even from CUDA: the slots may be overwritten by the next step
                read_pages(kv_buffer, ids, out=buf[: len(part)])
            except BaseException:
                self._staging.give(buf, pinned)
                with self._lock:
                    self._backlog -= (len(parts) - k) * per
                raise
            hashes = [h for h, _ in part]
            fut = self._spill_pool.submit(self._spill, hashes, buf, pinned)
            with self._lock:
                for h in hashes:
                    self._spilling[h] = fut
            fut.add_done_callback(lambda f, hs=hashes: self._spilled(hs, f))

    def _spilled(self, hashes: list[bytes], fut: Future) -> None:
        """A spill batch is in the store: its pages no longer hold up fetches."""
        with self._lock:
            for h in hashes:
                if self._spilling.get(h) is fut:
                    del self._spilling[h]

    def _spill(self, hashes: list[bytes], buf: torch.Tensor, pinned: bool) -> None:
        try:
            rows = buf.numpy()
            self.store.put([(h, memoryview(rows[i])) for i, h in enumerate(hashes)])  # copies
            with self._lock:
                self.metrics["spilled_pages"] += len(hashes)
        except Exception:
            logger.exception("spilling %d pages failed; they will be recomputed", len(hashes))
            with self._lock:
                self.metrics["spill_errors"] += 1
        finally:
            self._staging.give(buf, pinned)
            with self._lock:
                self._backlog -= self._staging.pages_per_buffer

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until every spill handed over so far is in the store (tests, shutdown);
        ``TimeoutError`` after ``timeout`` seconds (the spills go on)."""
        self._spill_pool.submit(lambda: None).result(max(0.0, timeout))

    # ------------------------------------------------------------ fetch

    def start_fetch(
        self, req: Request, first_page: int, hashes: Sequence[bytes], on_device: Sequence[bool]
    ) -> None:
        """Look up ``hashes`` (the request's pages after its device hits) in the store and
        fetch the longest consecutive run, on the fetch thread. ``on_device[i]``: page i is
        on the device (held for the request) and needs no fetch, only to continue the run."""
        # pages of this request evicted up to now may still be on their way to the store:
        # the fetch looks up only after their spills are in. Spills of other pages do not
        # hold it up (behind a burst of evictions they would queue a restore for seconds).
        with self._lock:
            spilled = {self._spilling[h] for h in hashes if h in self._spilling}
        # before the thread may start; this tuple is also the fetch's identity: a batch
        # published by an older fetch of the same request (abandoned, back to life after
        # the request started another) is not this one's (``_publish``)
        info = self._fetch_info[req.request_id] = (req, first_page)
        fut = self._fetch_pool.submit(
            self._fetch, req, first_page, list(hashes), list(on_device), spilled,
            time.monotonic(), info,
        )  # fmt: skip
        self._fetches[req.request_id] = fut
        fut.add_done_callback(lambda _: self._done.set())

    def set_peer_auth(self, identity, tls) -> None:
        """The cluster identity (``protos.security.ClusterIdentity``) and TLS material
        (``TLSConfig``) to fetch from the peers requests name with; without an identity no
        peer is contacted."""
        self._peer_identity = identity
        self._peer_tls = tls

    def _peer_store(self, address: str) -> TieredStore:
        """The peer's store, made on first use (fetch thread; serialised, since a thread
        abandoned by ``take_fetch`` may come back to life beside its successor)."""
        with self._peer_lock:
            return self._peer_store_locked(address)

    def _peer_store_locked(self, address: str) -> TieredStore:
        """The one-tier store of a peer (fetch thread only). At most ``MAX_PEER_STORES``
        are kept: workers that restart come back on new ports, and the oldest go."""
        store = self._peer_stores.get(address)
        if store is not None:
            with self._lock:  # a scrape may be reading the dict (peer_counters)
                self._peer_stores.move_to_end(address)  # most recently used last
            return store
        from kvmesh.kvstore.peer import PeerTier  # grpc only when a peer is named

        tls = self._peer_tls
        tier = PeerTier(
            [address],
            identity=self._peer_identity,
            timeout=self.peer_timeout_s,
            credentials=tls.channel_credentials() if tls is not None else None,
        )
        store = TieredStore(self.spec, [tier])
        while len(self._peer_stores) >= MAX_PEER_STORES:
            self._close_peer_store(next(iter(self._peer_stores)))
        with self._lock:
            self._peer_stores[address] = store
        return store

    def _close_peer_store(self, address: str) -> None:
        """Close a peer's store, its counters folded into the running totals first (in one
        step under the lock, so a scrape sees them either in the store or in the totals)."""
        with self._lock:
            store = self._peer_stores.pop(address)
            for k, v in _peer_counts(store).items():
                self._closed_peer_counts[k] += v
        store.close()

    def _fetch_run(
        self,
        store: TieredStore,
        hashes: list[bytes],
        on_device: list[bool],
        publish: Callable[[list], None] | None = None,
    ) -> list[tuple[str, memoryview] | None]:
        """The longest run from the start of ``hashes`` in which every page is on the device
        (``None`` in the result: nothing to fetch) or valid in ``store``. Read in batches of
        ``fetch_batch_pages``; after each, ``publish`` gets the validated leading part of
        the run so far (a new list each time)."""
        where = store.locate([h for h, d in zip(hashes, on_device) if not d])
        it = iter(where)
        n = 0
        for d in on_device:
            if not d and next(it) is None:
                break
            n += 1
        need = [i for i in range(n) if not on_device[i]]
        out: list[tuple[str, memoryview] | None] = [None] * n
        step = self.fetch_batch_pages
        for at in range(0, len(need), step):
            part = need[at : at + step]
            got = store.get([hashes[i] for i in part])
            for i, g in zip(part, got):
                if g is None:  # vanished or corrupt since the lookup: the run ends before it
                    return out[:i]
                out[i] = g
            if publish is not None and at + step < len(need):  # the last: the result itself
                publish(out[: need[at + step]])
        return out

    def _fetch(self, req: Request, *args) -> FetchResult:
        """``_fetch_run_all`` on the fetch thread, which ``take_fetch`` watches through
        ``_running`` (an abandoned thread, if its call ever returns, clears only its own)."""
        mine = (req.request_id, time.monotonic())
        with self._lock:
            self._running = mine
        try:
            return self._fetch_run_all(req, *args)
        finally:
            with self._lock:
                if self._running is mine:
                    self._running = None

    def _fetch_run_all(
        self,
        req: Request,
        first_page: int,
        hashes: list[bytes],
        on_device: list[bool],
        spilled: Collection[Future] = (),
        started: float | None = None,
        fetch: tuple | None = None,
    ) -> FetchResult:
        tiers: list[str] = []
        payloads: list[memoryview | None] = []
        got: list = []
        try:
            wait(spilled)  # the spills of this request's own pages
            if self.store is not None:
                rid = req.request_id
                got = self._fetch_run(
                    self.store, hashes, on_device, lambda part: self._publish(rid, fetch, part)
                )
            if self._peer_identity is None:
                hints = []  # a member may fetch only as a member; make_request refuses them
            else:
                hints = req.peer_hints
            for address in hints:  # the rest, from peers the router named
                if len(got) == len(hashes):
                    break
                rest = slice(len(got), None)
                got += self._fetch_run(self._peer_store(address), hashes[rest], on_device[rest])
        except Exception:  # a tier bug must not fail the request: it computes the rest
            logger.exception("fetching %s's prefix failed; computing it", req.request_id)
            with self._lock:
                self.metrics["promotion_errors"] += 1
                if not got and fetch is not None and self._fetch_info.get(req.request_id) is fetch:
                    # the batches validated before the failure (the engine may have
                    # written them already): the run keeps them, or it would look
                    # shorter than the device's and be promoted again at once
                    got = list(self._partial.get(req.request_id, ()))
        for g in got:
            tiers.append("device" if g is None else g[0])  # device: held, not fetched
            payloads.append(None if g is None else g[1])
        fetched = [t for t in tiers if t != "device"]
        with self._lock:
            self.metrics["promotions"] += 1
            self.metrics["promoted_pages"] += len(fetched)
            for t in fetched:
                self.promoted_by_tier[t] = self.promoted_by_tier.get(t, 0) + 1
        hook = self.on_promotion
        if hook is not None and fetched and started is not None:
            hook(time.monotonic() - started, tiers)
        return FetchResult(req, first_page, tiers, payloads)

    def _publish(self, request_id: str, fetch: tuple | None, part: list) -> None:
        """A validated leading part of a run, for ``take_partial`` (fetch thread). ``fetch``:
        the ``_fetch_info`` entry this run was started with; the part is dropped once that
        fetch was cancelled or replaced by a newer one of the same request (whose first
        page may differ: the old part under the new hashes would cache wrong bytes)."""
        with self._lock:
            if fetch is None or self._fetch_info.get(request_id) is not fetch:
                return
            self._partial[request_id] = part
            self._news = True
        self._done.set()  # wake an engine waiting for it
        time.sleep(PUBLISH_YIELD_S)  # and let it have the GIL

    def take_partial(self, request_id: str) -> FetchResult | None:
        """While this request's fetch runs: the validated leading part of its run that has
        arrived since the last call (from the run's start, as a ``FetchResult``), or None
        when nothing new has. Engine thread."""
        with self._lock:
            part = self._partial.get(request_id)
            if part is None or len(part) <= self._partial_taken.get(request_id, 0):
                return None
            self._partial_taken[request_id] = len(part)
            req, first = self._fetch_info[request_id]
        tiers = ["device" if g is None else g[0] for g in part]
        return FetchResult(req, first, tiers, [None if g is None else g[1] for g in part])

    def peer_stores(self) -> list[TieredStore]:
        """The one-tier stores of the peers requests have named lately (one per address, at
        most ``MAX_PEER_STORES``)."""
        with self._lock:
            return list(self._peer_stores.values())

    def peer_counters(self) -> dict[str, int] | None:
        """The peer tier's ``PEER_COUNTERS`` summed over every peer store this offloader has
        had, closed ones included, so none ever decreases; None before any request named a
        peer. Any thread."""
        with self._lock:
            stores = list(self._peer_stores.values())
            if not stores and not any(self._closed_peer_counts.values()):
                return None
            out = dict(self._closed_peer_counts)
            for store in stores:
                for k, v in _peer_counts(store).items():
                    out[k] += v
        return out

    def peer_healthy(self) -> bool:
        """False while a peer store's tier reports itself down (``PeerTier.healthy``)."""
        return all(getattr(t, "healthy", True) for s in self.peer_stores() for t in s.tiers)

    @property
    def num_fetching(self) -> int:
        return len(self._fetches)

    def cancel(self, request_id: str) -> None:
        """Forget a request's fetch (aborted); its result, if any, is dropped."""
        self._fetches.pop(request_id, None)
        with self._lock:
            self._fetch_info.pop(request_id, None)
            self._partial.pop(request_id, None)
            self._partial_taken.pop(request_id, None)

    def take_fetch(self, request_id: str) -> FetchResult | None:
        """The finished fetch of this request (once), or None while it is in flight. A
        fetch running past ``fetch_abandon_s`` is abandoned: an empty result (the request
        computes its prefix), and the fetches queued behind it move to a fresh thread."""
        f = self._fetches.get(request_id)
        if f is None:
            return None
        if not f.done():
            self._abandon_if_stuck()  # whichever request's fetch holds the thread
            f = self._fetches[request_id]
            if not f.done():
                return None
        self.cancel(request_id)
        return f.result()

    def _abandon_if_stuck(self) -> None:
        """Abandon the fetch thread when its current fetch has run ``fetch_abandon_s``: that
        fetch's request (if it still waits) gets an empty result, the fetches queued behind
        it move to a fresh thread. Engine thread."""
        with self._lock:
            cur = self._running
            if cur is None or time.monotonic() - cur[1] < self.fetch_abandon_s:
                return
            self._running = None
            self.metrics["fetches_abandoned"] += 1
            self.metrics["promotion_errors"] += 1
        rid = cur[0]
        stuck, self._fetch_pool = self._fetch_pool, DaemonExecutor("kvmesh-fetch")
        logger.warning(
            "the prefix fetch of %s is still running after %.1fs (past every deadline its "
            "calls have): abandoned, the request computes its prefix; later fetches move "
            "to a new thread. The stuck thread is at:\n%s",
            rid,
            self.fetch_abandon_s,
            stuck.stack() or "(its stack is not available)",
        )
        stuck.move_queued_to(self._fetch_pool)
        info = self._fetch_info.get(rid)
        if rid in self._fetches and info is not None:  # its request still waits: it computes
            empty: Future = Future()
            empty.set_result(FetchResult(info[0], info[1], [], []))
            self._fetches[rid] = empty
            self._done.set()

    def wait_for_fetch(self, timeout: float) -> None:
        """Block until some fetch finishes or hands over a batch (``take_partial``), or
        ``timeout``: for an engine with nothing else to run."""
        if self._fetches and not self._news and not any(f.done() for f in self._fetches.values()):
            self._done.wait(timeout)
        # a batch published between the wait and here is not lost: the engine steps next
        # and every PROMOTING request it reaches asks for what has arrived
        self._done.clear()
        self._news = False

    def close(self) -> None:
        self._fetch_pool.shutdown(cancel_futures=True)
        self._spill_pool.shutdown(wait=True)
        if self.store is not None:
            self.store.close()
        while self._peer_stores:
            self._close_peer_store(next(iter(self._peer_stores)))


def _peer_counts(store: TieredStore) -> dict[str, int]:
    """``PEER_COUNTERS`` of a peer's one-tier store."""
    tier = store.tiers[0]
    counts = store.metrics()[tier.name]
    own = getattr(tier, "metrics", {})
    return {
        "errors": counts["errors"],
        "corrupt": counts["corrupt"],
        "data_plane_bytes": own.get("data_plane_bytes", 0),
        "grpc_bytes": own.get("grpc_bytes", 0),
        "fetches_left_behind": own.get("fetches_left_behind", 0),
    }


class _StagingBuffers:
    """Reused host buffers that carry evicted pages from the pool to the spill thread.

    A page must leave the pool before the step that reuses its slot, and it stays in host
    memory until the spill thread has encoded it. A new buffer each time would be filled at
    page-fault speed; these are faulted in once and then reused (pinned on CUDA, so the copy
    out of the device is one DMA). Each holds ``pages_per_buffer`` pages (about 16 MiB, at
    most ``max_pages``); at most ``keep_bytes`` of idle buffers are kept. How many are in
    flight at once is bounded by the offloader's spill backlog. On CUDA, a pinned buffer
    given up goes back to torch's caching host allocator, which keeps it for the next
    pinned allocation. Thread-safe.
    """

    def __init__(
        self,
        page_nbytes: int,
        max_pages: int = 1 << 30,
        buffer_bytes: int = 16 << 20,
        keep_bytes: int = 256 << 20,
    ):
        self.page_nbytes = page_nbytes
        self.pages_per_buffer = max(1, min(buffer_bytes // page_nbytes, max_pages))
        self.keep = max(1, keep_bytes // (self.pages_per_buffer * page_nbytes))
        self._idle: dict[bool, list[torch.Tensor]] = {False: [], True: []}  # by pinned
        self._lock = threading.Lock()
        self.created = 0

    def take(self, pinned: bool) -> torch.Tensor:
        """A (pages_per_buffer, page_nbytes) uint8 buffer, idle or new."""
        with self._lock:
            if self._idle[pinned]:
                return self._idle[pinned].pop()
            self.created += 1
        shape = (self.pages_per_buffer, self.page_nbytes)
        return torch.empty(shape, dtype=torch.uint8, pin_memory=pinned)

    def give(self, buf: torch.Tensor, pinned: bool) -> None:
        """Return a buffer from ``take(pinned)``."""
        with self._lock:
            if len(self._idle[False]) + len(self._idle[True]) < self.keep:
                self._idle[pinned].append(buf)
