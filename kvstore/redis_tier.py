"""The Redis tier: encoded page objects in a Redis server, batched, and never a failure.

Keys are ``{namespace}:{model_fp}:{cache_format}:{page_hash_hex}``, the namespace ``kvmesh``
by default (DESIGN.md; another one keeps two clusters sharing a Redis apart). ``get`` is
pipelined MGETs of ~``mget_chunk_bytes`` each, ``mget_depth`` in flight on one connection
(their replies read straight into reused buffers, see ``kvstore/redis_fast.py``);
``contains`` is pipelined EXISTS, ``put`` pipelined SET
with PX (a page expires ``DEFAULT_TTL_S``, a day, after it was last written, unless told
otherwise; ``ttl_s=None``: never), ``evict`` one DEL.

The URL may carry a password (``redis://:secret@host:6379/0``): it is never logged; logs and
``RedisTier.url`` show ``redact_url``'s form (``redis://:***@host:6379/0``).

A Redis that is down, slow or full costs cache hits, never a request: any fault turns reads
into misses and skips writes. The first fault of an incident logs one warning; the tier then
stays away from the server for an exponential backoff (``backoff_s`` doubling up to
``max_backoff_s``) and answers at once, and logs one info line when the server answers again.
Keys that Redis drops by its own eviction policy are plain misses. A SET refused with OOM
(``maxmemory`` with ``noeviction``) is skipped and counted; the server stays "up".
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import OutOfMemoryError
from redis.retry import Retry

from kvmesh.kvstore.redis_fast import MgetReplies, SlabPool
from kvmesh.kvstore.tier import Tier

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _pooled_connection(pool: redis.ConnectionPool, command: str):
    """``pool.get_connection`` across redis-py versions: before 5.3 the command name is a
    required argument, from 5.3 on passing it is deprecated (a warning per call)."""
    param = inspect.signature(type(pool).get_connection).parameters.get("command_name")
    if param is not None and param.default is inspect.Parameter.empty:
        return pool.get_connection(command)
    return pool.get_connection()


_SKIPPED = object()  # the call did not reach the server (backoff, or it failed)


DEFAULT_NAMESPACE = "kvmesh"
DEFAULT_TTL_S = 24 * 3600.0  # a page not written again for a day is dropped
DEFAULT_MAX_PAGE_BYTES = 512 << 20  # Redis's own longest value (proto-max-bulk-len)
DEFAULT_MGET_CHUNK_BYTES = 2 << 20  # per MGET of a long read (bench/README.md, issue 21)
DEFAULT_MGET_DEPTH = 2  # MGETs in flight: the server builds the next reply while one is read
_NAMESPACE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def redis_key(
    model_fp: str, cache_format: str, page_hash: bytes, namespace: str = DEFAULT_NAMESPACE
) -> str:
    """The Redis key of one page."""
    return f"{namespace}:{model_fp}:{cache_format}:{page_hash.hex()}"


def redact_url(url: str) -> str:
    """``url`` with its password (in the user part or a ``password=`` query parameter)
    replaced by ``***``, for logs."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable redis url>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, sep, _ = userinfo.partition(":")
        netloc = f"{user}:***@{hostport}" if sep or not user else f"***@{hostport}"
    pairs = [p.partition("=") for p in parts.query.split("&")] if parts.query else []
    query = "&".join(
        f"{k}{eq}***" if k.lower() == "password" else f"{k}{eq}{v}" for k, eq, v in pairs
    )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


class RedisTier(Tier):
    """Encoded page objects in Redis under ``{namespace}:{model_fp}:{cache_format}:{hash
    hex}``, each expiring ``ttl_s`` seconds after it was written (``None``: never; then only
    Redis's own eviction policy bounds them).

    ``metrics`` counters: ``hits``, ``misses`` (including reads answered during a backoff),
    ``puts``, ``puts_skipped``, ``oom`` (SETs refused for memory), ``evictions`` (keys sent
    to DEL), ``bytes_read``, ``bytes_written``, ``errors`` (failed round trips and refused
    commands), ``incidents`` (up -> down transitions), ``calls_skipped`` (batches not sent
    during a backoff). Thread-safe: redis-py's pool hands each thread its own connection.
    """

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        model_fp: str,
        cache_format: str,
        ttl_s: float | None = DEFAULT_TTL_S,
        namespace: str = DEFAULT_NAMESPACE,
        timeout_s: float = 0.5,
        max_connections: int = 8,
        backoff_s: float = 0.1,
        max_backoff_s: float = 4.0,
        max_page_bytes: int = DEFAULT_MAX_PAGE_BYTES,
        mget_chunk_bytes: int = DEFAULT_MGET_CHUNK_BYTES,
        mget_depth: int = DEFAULT_MGET_DEPTH,
    ) -> None:
        if not model_fp or ":" in model_fp:
            raise ValueError(f"model_fp must be a non-empty string without ':', got {model_fp!r}")
        if not cache_format or ":" in cache_format:
            raise ValueError(
                f"cache_format must be a non-empty string without ':', got {cache_format!r}"
            )
        if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
            raise ValueError(
                f"namespace must be 1-64 characters of letters, digits and _.:-, got {namespace!r}"
            )
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 seconds or None, got {ttl_s!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections!r}")
        if not 0 < backoff_s <= max_backoff_s:
            raise ValueError(
                f"need 0 < backoff_s <= max_backoff_s, got {backoff_s!r} and {max_backoff_s!r}"
            )
        if max_page_bytes < 1:
            raise ValueError(f"max_page_bytes must be >= 1, got {max_page_bytes!r}")
        # A value read back longer than this is a fault (a miss), refused before memory is
        # taken for it; TieredStore lowers it to the longest object its page spec allows.
        self.max_page_bytes = max_page_bytes
        self.url = redact_url(url)  # what logs show: the real one stays in the pool
        self.namespace = namespace
        self.model_fp = model_fp
        self.cache_format = cache_format
        self._px = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self._backoff_base = backoff_s
        self._backoff_cap = max_backoff_s
        # Retries are ours (the backoff below); redis-py's own would multiply every timeout.
        self._pool = redis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout_s,  # waiting for a free pooled connection
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._client = redis.Redis(connection_pool=self._pool)
        self._slabs = SlabPool()  # reused receive buffers of the MGET path
        if mget_chunk_bytes < 1 or mget_depth < 1:
            raise ValueError(
                f"need mget_chunk_bytes >= 1 and mget_depth >= 1, got {mget_chunk_bytes!r} "
                f"and {mget_depth!r}"
            )
        self.mget_chunk_bytes = mget_chunk_bytes  # bytes asked per MGET of a long read
        self.mget_depth = mget_depth  # MGETs in flight at once
        self._value_bytes = 0  # the longest value read so far: sizes the next chunks
        self._lock = threading.Lock()  # guards metrics and the health state
        self._down_since: float | None = None  # monotonic time of the incident's first fault
        self._retry_at = 0.0
        self._backoff = 0.0
        self._oom_warned = False
        self.metrics: dict[str, int] = dict.fromkeys(
            (
                "hits",
                "misses",
                "puts",
                "puts_skipped",
                "oom",
                "evictions",
                "bytes_read",
                "bytes_written",
                "errors",
                "incidents",
                "calls_skipped",
            ),
            0,
        )

    # ------------------------------------------------------------------ health
    @property
    def healthy(self) -> bool:
        """False from a fault until the server answers again."""
        return self._down_since is None

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self.metrics[k] += v

    def _call(self, op: str, fn: Callable[[], T]) -> T | object:
        """``fn()``, or ``_SKIPPED`` if in a backoff or the call failed (counted, logged)."""
        with self._lock:
            if self._down_since is not None and time.monotonic() < self._retry_at:
                self.metrics["calls_skipped"] += 1
                return _SKIPPED
        try:
            result = fn()
        except Exception as e:  # any fault of any kind: the tier must not raise
            self._on_fault(op, e)
            return _SKIPPED
        self._on_success()
        return result

    def _on_fault(self, op: str, e: Exception) -> None:
        now = time.monotonic()
        with self._lock:
            self.metrics["errors"] += 1
            first = self._down_since is None
            if first:
                self.metrics["incidents"] += 1
                self._down_since = now
                self._backoff = self._backoff_base
            else:
                self._backoff = min(2 * self._backoff, self._backoff_cap)
            self._retry_at = now + self._backoff
            backoff = self._backoff
        if first:
            logger.warning(
                "redis tier %s unavailable (%s during %s: %s): reads are misses and writes "
                "are skipped until it answers again",
                self.url,
                type(e).__name__,
                op,
                e,
            )
        else:
            logger.debug(
                "redis tier %s still unavailable (%s); next try in %.2fs", self.url, e, backoff
            )
        # Pooled sockets to a restarted server are dead; drop the idle ones so the next try
        # reconnects instead of failing once per stale connection.
        try:
            self._pool.disconnect(inuse_connections=False)
        except Exception:
            pass

    def _on_success(self) -> None:
        if self._down_since is None:  # fast path, no lock: the common case
            return
        with self._lock:
            if self._down_since is None:
                return
            down_for = time.monotonic() - self._down_since
            self._down_since = None
            self._backoff = 0.0
        logger.info("redis tier %s reachable again after %.1fs", self.url, down_for)

    # -------------------------------------------------------------- operations
    def _keys(self, hashes: Sequence[bytes]) -> list[str]:
        return [redis_key(self.model_fp, self.cache_format, h, self.namespace) for h in hashes]

    def contains(self, hashes: Sequence[bytes]) -> list[bool]:
        if not hashes:
            return []

        def run() -> list:
            pipe = self._client.pipeline(transaction=False)
            for k in self._keys(hashes):
                pipe.exists(k)
            return pipe.execute()

        result = self._call("EXISTS", run)
        if result is _SKIPPED:
            return [False] * len(hashes)
        return [bool(n) for n in result]

    def get(self, hashes: Sequence[bytes]) -> list[bytes | None]:
        if not hashes:
            return []
        keys = self._keys(hashes)
        result = self._call("MGET", lambda: self._mget(keys))
        if result is _SKIPPED:
            self._count(misses=len(hashes))
            return [None] * len(hashes)
        hits = [v for v in result if v is not None]
        self._count(
            hits=len(hits),
            misses=len(result) - len(hits),
            bytes_read=sum(len(v) for v in hits),
        )
        return list(result)

    def _chunks(self, keys: list[str]) -> list[list[str]]:
        """``keys`` in MGETs of about ``mget_chunk_bytes`` each, sized by the longest value
        this tier has read, or else by ``max_page_bytes`` (TieredStore sets it to the
        longest object its pages make); one MGET while neither is known."""
        hint = min(self.max_page_bytes, self._value_bytes or self.max_page_bytes)
        if hint >= DEFAULT_MAX_PAGE_BYTES:  # no bound and nothing read yet: sizes unknown
            return [keys]
        per = max(1, self.mget_chunk_bytes // max(hint, 1))
        return [keys[i : i + per] for i in range(0, len(keys), per)]

    def _mget(self, keys: list[str]) -> list:
        """MGET on a pooled connection, each value received straight into a reused slab
        (``redis_fast``; values are ``memoryview`` slices). Falls back to redis-py's MGET
        where the connection has no plain socket to read.

        Many keys are asked in MGETs of about ``mget_chunk_bytes``, ``mget_depth`` of them
        in flight: the server builds each reply in output buffers it frees once sent, so
        small replies reuse the same few MiB of its memory where one large reply takes (and
        page-faults) the whole run's worth; with the next MGET already queued it builds the
        next reply while this one is read."""
        chunks = self._chunks(keys)
        conn = _pooled_connection(self._pool, "MGET")
        try:
            conn.send_command("MGET", *chunks[0])  # connects a connection not yet connected
            sent = 1
            sock = conn._get_socket() if hasattr(conn, "_get_socket") else None
            if sock is None:  # not a socket connection: let redis-py read the replies
                out: list = list(conn.read_response())
                for chunk in chunks[1:]:
                    conn.send_command("MGET", *chunk, check_health=False)
                    out += conn.read_response()
                return out
            out = []
            with MgetReplies(sock, self._slabs, self.max_page_bytes) as replies:
                for i, chunk in enumerate(chunks):
                    while sent < min(len(chunks), i + self.mget_depth):
                        # no health-check PING: it would be read as the next reply
                        conn.send_command("MGET", *chunks[sent], check_health=False)
                        sent += 1
                    out += replies.read(len(chunk))
            longest = max((len(v) for v in out if v is not None), default=0)
            self._value_bytes = max(self._value_bytes, longest)  # a read of small values
            return out  # must not make the next read of pages one huge MGET
        except BaseException:
            conn.disconnect()  # mid-reply: the connection's state is unknown
            raise
        finally:
            self._pool.release(conn)

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> list[bytes]:
        if not items:
            return []

        def run() -> list:
            pipe = self._client.pipeline(transaction=False)
            for (_, obj), k in zip(items, self._keys([h for h, _ in items])):
                pipe.set(k, obj, px=self._px)
            # Per-command refusals (OOM) come back as exception objects, not raised.
            return pipe.execute(raise_on_error=False)

        result = self._call("SET", run)
        if result is _SKIPPED:
            self._count(puts_skipped=len(items))
            return []
        stored = [not isinstance(r, Exception) for r in result]
        n_ok = sum(stored)
        refused = [r for r in result if isinstance(r, Exception)]
        n_oom = sum(isinstance(r, OutOfMemoryError) for r in refused)
        self._count(
            puts=n_ok,
            bytes_written=sum(len(obj) for (_, obj), ok in zip(items, stored) if ok),
            puts_skipped=len(refused),
            oom=n_oom,
            errors=len(refused) - n_oom,
        )
        if refused and not self._oom_warned:
            self._oom_warned = True  # one warning until a batch is stored in full again
            logger.warning(
                "redis tier %s refused %d of %d SETs (%s); those pages are not cached there",
                self.url,
                len(refused),
                len(items),
                refused[0],
            )
        elif not refused and self._oom_warned:
            self._oom_warned = False
            logger.info("redis tier %s accepts writes again", self.url)
        return [h for (h, _), ok in zip(items, stored) if ok]

    def evict(self, hashes: Sequence[bytes]) -> None:
        if not hashes:
            return
        keys = self._keys(hashes)
        if self._call("DEL", lambda: self._client.delete(*keys)) is not _SKIPPED:
            self._count(evictions=len(keys))

    def close(self) -> None:
        self._pool.disconnect()


def redis_throughput(
    url: str, n_pages: int = 64, page_nbytes: int = 737_280, *, repeats: int = 3
) -> dict:
    """Batched put/get throughput of one ``RedisTier`` against the server at ``url``.

    Writes ``n_pages`` encoded random pages in one ``put``, reads them back in one ``get``
    (checked byte-equal), deletes them; best of ``repeats``. GB/s counts object bytes (header
    included) over wall time, 1 GB = 1e9 bytes.
    """
    from kvmesh.kvstore.codec import PageSpec, encode

    model_fp = os.urandom(8).hex()  # a fresh key space: never touches real pages
    spec = PageSpec(model_fp, "bench", 1, 1, 1, 1, page_nbytes)
    tier = RedisTier(url, model_fp=model_fp, cache_format="bench", timeout_s=10.0)
    items = [(os.urandom(16), encode(spec, os.urandom(page_nbytes))) for _ in range(n_pages)]
    hashes = [h for h, _ in items]
    total = sum(len(o) for _, o in items)
    put_s, get_s = [], []
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            tier.put(items)
            t1 = time.perf_counter()
            got = tier.get(hashes)
            t2 = time.perf_counter()
            if got != [o for _, o in items]:
                raise RuntimeError(f"redis tier lost or changed pages: metrics {tier.metrics}")
            tier.evict(hashes)
            put_s.append(t1 - t0)
            get_s.append(t2 - t1)
    finally:
        tier.evict(hashes)
        tier.close()
    return {
        "n_pages": n_pages,
        "page_nbytes": page_nbytes,
        "batch_bytes": total,
        "repeats": repeats,
        "put_s": min(put_s),
        "get_s": min(get_s),
        "put_gbps": total / min(put_s) / 1e9,
        "get_gbps": total / min(get_s) / 1e9,
        "errors": tier.metrics["errors"],
    }
