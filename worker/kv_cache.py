"""The page pool and the KV cache manager: reference counts, prefix caching, LRU eviction.

Page 0 is the reserved null page: it is never handed out, and padding slots point at it.
A page's hash is written once, when the page fills with known tokens; it is cleared only when
the page is evicted for reuse. Pages whose reference count drops to zero go to the tail of an
O(1) doubly-linked free list and keep their hash, so a later request can still hit them;
allocation takes from the head, evicting the least recently freed page first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvmesh.kvstore.events import EventLog
from kvmesh.worker.request import Request

_NEVER = 1 << 62  # a compacted request's hashed-page count: no page of it is hashed again


class Page:
    __slots__ = ("page_id", "ref_cnt", "page_hash", "prev", "next")

    def __init__(self, page_id: int):
        self.page_id = page_id
        self.ref_cnt = 0
        self.page_hash: bytes | None = None
        self.prev: Page | None = None
        self.next: Page | None = None

    def __repr__(self) -> str:
        return f"Page({self.page_id}, ref={self.ref_cnt}, cached={self.page_hash is not None})"


class FreePageQueue:
    """Doubly-linked list of free pages between two sentinels; every operation is O(1)."""

    def __init__(self, pages: Iterable[Page]):
        self._head = Page(-1)
        self._tail = Page(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        for p in pages:
            self.append(p)

    def append(self, page: Page) -> None:
        last = self._tail.prev
        last.next = page
        page.prev, page.next = last, self._tail
        self._tail.prev = page
        self.num_free += 1

    def remove(self, page: Page) -> None:
        if page.prev is None:
            raise ValueError(f"{page} is not in the free queue")
        page.prev.next, page.next.prev = page.next, page.prev
        page.prev = page.next = None
        self.num_free -= 1

    def popleft(self) -> Page:
        first = self._head.next
        if first is self._tail:
            raise IndexError("no free pages")
        self.remove(first)
        return first

    def __len__(self) -> int:
        return self.num_free

    def page_ids(self) -> list[int]:
        out, p = [], self._head.next
        while p is not self._tail:
            out.append(p.page_id)
            p = p.next
        return out


class PagePool:
    """Owns every page, the free queue and the hash -> cached page map. Emits block events."""

    def __init__(self, num_pages: int, events: EventLog):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        self.pages = [Page(i) for i in range(num_pages)]
        self.null_page = self.pages[0]
        self.null_page.ref_cnt = 1  # never freed, never handed out
        self.free_queue = FreePageQueue(self.pages[1:])
        self.cached: dict[bytes, Page] = {}
        self.events = events
        self.evictions = 0
        # called with a cached page about to lose its hash (its bytes still intact): set
        # through ``KVCacheManager.set_evict_listener``
        self.on_evict: Callable[[Page], None] | None = None

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    def usage(self) -> float:
        """Fraction of usable pages in use: held by running requests, or pinned for waiting
        ones (``KVCacheManager.hold``) (0.0 - 1.0)."""
        usable = self.num_pages - 1
        return (usable - self.num_free) / usable

    def take(self, n: int) -> list[Page]:
        """Take ``n`` pages from the LRU head, evicting their cached hashes. Caller checks
        ``num_free`` first."""
        if n > self.num_free:
            raise ValueError(f"asked for {n} pages, {self.num_free} free")
        out = []
        for _ in range(n):
            p = self.free_queue.popleft()
            if p.page_hash is not None:
                self._evict(p)
            p.ref_cnt = 1
            out.append(p)
        return out

    def _evict(self, page: Page) -> None:
        h = page.page_hash
        if self.cached.get(h) is page:
            if self.on_evict is not None:
                self.on_evict(page)
            del self.cached[h]
            self.events.removed(h)
        page.page_hash = None
        self.evictions += 1

    def acquire(self, pages: Iterable[Page]) -> None:
        """Take a reference on cached pages (pulling free ones out of the free queue so they
        cannot be evicted)."""
        for p in pages:
            if p.ref_cnt == 0:
                self.free_queue.remove(p)
            p.ref_cnt += 1

    def release(self, pages: Iterable[Page]) -> None:
        """Drop a reference; pages reaching zero join the free queue's tail in the given order
        (callers pass a request's pages last-first, so its tail is evicted before its prefix)."""
        for p in pages:
            p.ref_cnt -= 1
            if p.ref_cnt < 0:
                raise AssertionError(f"{p}: reference count went negative")
            if p.ref_cnt == 0:
                self.free_queue.append(p)

    def cache_page(self, page: Page, page_hash: bytes, parent: bytes | None, tokens) -> None:
        if page.page_hash is not None:
            raise AssertionError(f"{page} already has a hash; page hashes are write-once")
        if page_hash in self.cached:
            return  # another request computed the same page first: keep that one
        page.page_hash = page_hash
        self.cached[page_hash] = page
        self.events.stored(page_hash, parent, tokens, len(tokens))

    def lookup(self, page_hash: bytes) -> Page | None:
        return self.cached.get(page_hash)

    def reset_prefix_cache(self) -> int:
        """Forget every cached page that no request holds. Returns how many were dropped."""
        dropped = 0
        for p in list(self.cached.values()):
            if p.ref_cnt == 0:
                self._evict(p)
                dropped += 1
        return dropped


class KVCacheManager:
    """Maps requests to pages. ``allocate_slots`` returns the new pages or None when the pool
    cannot hold the request's next tokens; it never preempts (that is the scheduler's call)."""

    def __init__(
        self,
        num_pages: int,
        block_size: int,
        events: EventLog,
        enable_prefix_caching=True,
        num_residual_slots: int = 0,
        residual_pages: int = 1,
    ):
        self.block_size = block_size
        self.pool = PagePool(num_pages, events)
        self.enable_prefix_caching = enable_prefix_caching
        self.req_pages: dict[str, list[Page]] = {}
        # quantized formats: each request holding pages owns one residual slot, a ring of
        # ``residual_pages`` full-precision pages for its last pages (LayerCache)
        self.num_residual_slots = num_residual_slots
        self.residual_pages = residual_pages
        # per request: the first page it computed itself (the ring has no copy of the pages
        # before it: a restored prefix, read quantized)
        self._ring_from: dict[str, int] = {}
        self._free_slots = list(range(num_residual_slots - 1, -1, -1))
        self._req_slot: dict[str, int] = {}
        self._num_hashed: dict[str, int] = {}
        self.prefix_queries = 0  # prompt tokens looked up (Prometheus prefix_cache_queries)
        self.prefix_hits = 0  # of which were found (prefix_cache_hits)
        # pages pinned for waiting requests (see ``hold``), by request id
        self._holds: dict[str, list[Page]] = {}

    def get_computed_pages(self, req: Request) -> tuple[list[Page], int]:
        """The longest run of cached pages from the start of ``req``'s tokens, and how many
        tokens they hold. At least the last token is always left to compute, for its logits.
        This does not modify the cache."""
        if not self.enable_prefix_caching:
            return [], 0
        max_pages = req.max_cached_pages()
        pages = []
        for h in req.page_hashes[:max_pages]:
            p = self.pool.lookup(h)
            if p is None:
                break
            pages.append(p)
        return pages, len(pages) * self.block_size

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        computed: list[Page] | None = None,
        reserve: int = 0,
    ) -> list[Page] | None:
        """Give ``req`` pages for ``num_new_tokens`` more tokens beyond its computed ones (and
        beyond ``computed``, cached pages it reuses). Returns the new pages, or None (and
        changes nothing) when too few pages are free, leaving ``reserve`` pages aside."""
        computed = computed or []
        owned = self.req_pages.get(req.request_id, [])
        total = req.cache_len + len(computed) * self.block_size + num_new_tokens
        needed = -(-total // self.block_size) - len(owned) - len(computed)
        reclaim = sum(1 for p in computed if p.ref_cnt == 0)  # free now, about to be owned
        if needed > self.pool.num_free - reclaim - reserve:
            return None
        if req.request_id not in self.req_pages:
            self.req_pages[req.request_id] = owned = []
            self._num_hashed[req.request_id] = 0
            if self.num_residual_slots:
                if not self._free_slots:
                    raise AssertionError("no residual slot left: more running requests than slots")
                self._req_slot[req.request_id] = self._free_slots.pop()
                self._ring_from[req.request_id] = len(computed)
        self.pool.acquire(computed)
        self.release_hold(req)  # its own references now keep what it uses
        owned.extend(computed)
        self._num_hashed[req.request_id] += len(computed)
        new = self.pool.take(max(needed, 0))
        owned.extend(new)
        if self.enable_prefix_caching:
            self._cache_full_pages(req, owned, total)
        return new

    def _cache_full_pages(self, req: Request, owned: list[Page], num_tokens: int) -> None:
        # Safe before the forward pass: the step that writes these tokens runs before any
        # other request can be scheduled onto the pages.
        bs = self.block_size
        start = self._num_hashed[req.request_id]
        end = min(num_tokens // bs, len(req.page_hashes))
        for i in range(start, end):
            parent = req.page_hashes[i - 1] if i else None
            self.pool.cache_page(
                owned[i], req.page_hashes[i], parent, req.all_token_ids[i * bs : (i + 1) * bs]
            )
        self._num_hashed[req.request_id] = max(start, end)

    def hold(self, req: Request, pages: list[Page]) -> None:
        """Pin ``pages`` (a reference each) for a waiting ``req`` until it is admitted
        (``allocate_slots``) or freed: the KV connector holds the device prefix of a request
        whose rest it promotes, then also the promoted pages, so that other work cannot evict
        them before it runs. Replaces ``req``'s earlier hold. The scheduler gives holds up
        when it needs the room (``release_newest_hold`` before preempting a running request,
        ``release_holds`` when nothing can run)."""
        self.pool.acquire(pages)
        self.release_hold(req)
        if pages:
            self._holds[req.request_id] = list(pages)

    def release_hold(self, req: Request) -> None:
        pages = self._holds.pop(req.request_id, None)
        if pages:
            self.pool.release(reversed(pages))  # its tail is evicted before its prefix

    def release_newest_hold(self) -> bool:
        """Give up the most recent hold (its pages stay cached, now evictable); False when
        there is none."""
        if not self._holds:
            return False
        _, pages = self._holds.popitem()
        self.pool.release(reversed(pages))
        return True

    def release_holds(self) -> int:
        """Give up every hold (the pages stay cached, now evictable). Returns how many
        requests had a hold."""
        n = 0
        while self.release_newest_hold():
            n += 1
        return n

    @property
    def num_holds(self) -> int:
        return len(self._holds)

    def free(self, req: Request) -> None:
        self.release_hold(req)
        pages = self.req_pages.pop(req.request_id, [])
        self._num_hashed.pop(req.request_id, None)
        slot = self._req_slot.pop(req.request_id, None)
        self._ring_from.pop(req.request_id, None)
        if slot is not None:
            self._free_slots.append(slot)
        self.pool.release(reversed(pages))

    # ------------------------------------------------------------ for eviction

    def take_private_pages(self, n: int) -> list[Page] | None:
        """``n`` fresh pages (one reference each, no hash) for a compacted copy of a
        request's cache, or None when fewer are free. Changes nothing on None."""
        if n > self.pool.num_free:
            return None
        return self.pool.take(n)

    def replace_pages(self, req: Request, pages: list[Page]) -> None:
        """``req``'s cache now lives in ``pages`` (from ``take_private_pages``): its old
        pages lose its reference (shared prefix pages stay cached for others, unmodified).
        Its pages are never hashed again: they no longer hold the tokens its page hashes
        name, so they must never be found by a prefix lookup nor spilled under them."""
        old = self.req_pages[req.request_id]
        self.req_pages[req.request_id] = list(pages)
        self._num_hashed[req.request_id] = _NEVER
        self.pool.release(reversed(old))

    # ------------------------------------------------------------ for the connector
    # The KV connector (worker/kv_connector.py) promotes pages from the tiers and spills
    # evicted ones; these calls are all it needs of the pool.

    def set_evict_listener(self, listener: Callable[[bytes, int], None] | None) -> None:
        """Register the one listener called with ``(page hash, page id)`` of every cached page
        about to lose its slot, while its bytes are still intact (the spill hook)."""
        if listener is None:
            self.pool.on_evict = None
        else:
            self.pool.on_evict = lambda page: listener(page.page_hash, page.page_id)

    def cached_page(self, page_hash: bytes) -> Page | None:
        """The cached page with this hash, or None. Does not modify the cache."""
        return self.pool.lookup(page_hash)

    def cached_page_ids(self, hashes: Sequence[bytes]) -> list[int]:
        """Page ids of the cached pages with these hashes, -1 where not cached."""
        return [p.page_id if (p := self.pool.lookup(h)) else -1 for h in hashes]

    def cached_hashes(self) -> list[bytes]:
        """Every page hash cached on the device now (a snapshot)."""
        return list(self.pool.cached)

    def insert_cached_pages(
        self,
        req: Request,
        page_indices: Sequence[int],
        write: Callable[[list[int]], None],
    ) -> list[Page]:
        """Make pages ``page_indices`` of ``req``'s tokens cached pages of the pool, with
        bytes from outside (a promotion): take as many free pages as there are (at most
        ``len(page_indices)``, evicting from the LRU head), call ``write(page_ids)`` to fill
        them, then publish their hashes. Returns the pages in order, each still carrying the
        one reference it was taken with: the caller hands it to a ``hold`` or ``unpin``s it.
        """
        page_indices = list(page_indices)[: self.pool.num_free]
        pages = self.pool.take(len(page_indices))
        if pages:
            write([p.page_id for p in pages])
        bs = self.block_size
        for page, n in zip(pages, page_indices):
            parent = req.page_hashes[n - 1] if n else None
            self.pool.cache_page(
                page, req.page_hashes[n], parent, req.all_token_ids[n * bs : (n + 1) * bs]
            )
        return pages

    def unpin(self, pages: Iterable[Page]) -> None:
        """Drop one reference from each page (last first: its tail is evicted first)."""
        self.pool.release(reversed(list(pages)))

    def reset_prefix_cache(self) -> int:
        """Forget every cached page no request uses (they are evicted: spilled, with a
        listener). Returns how many."""
        return self.pool.reset_prefix_cache()

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    def residual_slot(self, req: Request) -> int:
        return self._req_slot[req.request_id]

    def ring_from(self, req: Request) -> int:
        """The first page of ``req``'s cache that its residual ring may hold (pages before it
        were restored, not computed, and have no full-precision copy)."""
        return self._ring_from[req.request_id]

    def set_ring_from(self, req: Request, page: int) -> None:
        """After a compaction rewrote ``req``'s cache (worker/eviction): the ring holds its
        pages from ``page`` on (those among its last ``residual_pages``)."""
        self._ring_from[req.request_id] = page

    def page_ids(self, req: Request) -> list[int]:
        return [p.page_id for p in self.req_pages.get(req.request_id, [])]

    def num_held_pages(self, req: Request) -> int:
        return len(self.req_pages.get(req.request_id, ()))

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free

    def usage(self) -> float:
        return self.pool.usage()
