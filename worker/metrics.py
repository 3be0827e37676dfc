"""Prometheus metrics of one engine: vLLM's names under ``kvmesh:``, plus the tiers below the
device. docs/metrics.md lists every metric with its meaning.

Two kinds, chosen by cost:

- what happens to requests (tokens, finish reasons, TTFT, inter-token latency, end-to-end and
  queue time) is recorded on the engine thread as it happens, by ``on_step`` and
  ``on_finished``: a few counter increments and histogram observations per sampled token;
- what the engine already counts (queues, KV usage, prefix-cache queries and hits,
  preemptions, every tier's occupancy, spills, promotions, rejections and faults) is read
  only when Prometheus scrapes, by a collector over ``LLMEngine.stats()`` and the connector's
  counters: nothing on the hot path.

Each engine has its own ``CollectorRegistry`` (not prometheus_client's global one), so several
engines in one process never collide; ``protos.metrics.serve_metrics`` puts one on an HTTP port.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvmesh.worker.engine import LLMEngine
    from kvmesh.worker.request import Request

logger = logging.getLogger("kvmesh.metrics")

PREFIX = "kvmesh:"
SOURCES = ("device", "host", "redis", "peer")  # where a cached prompt token came from
FINISHED_REASONS = ("stop", "length", "abort", "error")

# vLLM's bucket bounds (vllm/v1/metrics/loggers.py), so its dashboards and rules port as is
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# promotion of a prefix from a tier: a host hit takes milliseconds, a Redis or peer run more
PROMOTION_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    out: list[int] = []
    exp = 1
    while True:
        for m in (1, 2, 5):
            v = m * exp
            if v > max_value:
                return out
            out.append(v)
        exp *= 10


class EngineMetrics:
    """The metrics of one ``LLMEngine``, in a registry of their own (``registry``).

    ``on_step`` and ``on_finished`` run on the engine thread; the collector runs on whatever
    thread serves a scrape and reads the engine's state without locking it (see ``_stats``).
    """

    def __init__(self, engine: LLMEngine, *, model_name: str, worker: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = {"model_name": model_name, "worker": worker}
        names, values = list(self.labels), list(self.labels.values())
        reg = self.registry

        def counter(name: str, doc: str, extra: Sequence[str] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*names, *extra], registry=reg)

        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, names, buckets=list(buckets), registry=reg)

        self.prompt_tokens = counter(
            "prompt_tokens", "Prompt tokens of requests that reached their first token."
        ).labels(*values)
        self.generation_tokens = counter("generation_tokens", "Generated tokens.").labels(*values)
        cached = counter(
            "prompt_tokens_cached_by_source",
            "Prompt tokens served from a cache instead of computed, by the tier that held them "
            "(device, host, redis, peer).",
            ["source"],
        )
        self.cached_by_source = {s: cached.labels(*values, s) for s in SOURCES}
        self._cached_family = cached
        success = counter(
            "request_success", "Finished requests, by finish reason.", ["finished_reason"]
        )
        self.success = {r: success.labels(*values, r) for r in FINISHED_REASONS}
        self._success_family = success
        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to first token: arrival to first sampled token.",
            TTFT_BUCKETS,
        ).labels(*values)  # fmt: skip
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between two sampled tokens of one request.",
            ITL_BUCKETS,
        ).labels(*values)  # fmt: skip
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Arrival to finish of a request.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(*values)  # fmt: skip
        self.queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduling of a request (waiting).",
            REQUEST_LATENCY_BUCKETS,
        ).labels(*values)  # fmt: skip
        token_buckets = buckets_1_2_5(engine.max_model_len)
        self.req_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per finished request.", token_buckets
        ).labels(*values)
        self.req_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per finished request.", token_buckets
        ).labels(*values)
        promotion = Histogram(
            PREFIX + "tier_promotion_seconds",
            "Seconds from the start of a prefix promotion to its pages fetched, by the slowest "
            "tier the run came from.",
            [*names, "tier"],
            buckets=list(PROMOTION_BUCKETS),
            registry=reg,
        )
        self.promotion = {t: promotion.labels(*values, t) for t in SOURCES[1:]}
        reg.register(_EngineCollector(engine, self.labels))
        engine.connector.offloader.on_promotion = self.on_promotion

    # ------------------------------------------------------------ engine thread

    def on_step(self, reqs: Sequence[Request], now: float, took: Sequence[bool]) -> None:
        """Each of ``reqs`` was sampled at ``now``; ``took[i]``: ``reqs[i]`` took its token
        (one that failed may have taken it first: a detokenizer or stop-check error; that
        token is in its output and usage, so it is counted here too). Some finished."""
        if not reqs:
            return
        n_tokens = 0
        for req, took_token in zip(reqs, took, strict=True):
            if not took_token:  # failed instead of taking a token (engine._fail)
                if req.status.finished:
                    self.on_finished(req, now)
                continue
            n_tokens += 1
            last = req.last_token_time
            req.last_token_time = now
            if last is not None:
                self.itl.observe(now - last)
            else:  # its first token: the prefill is done
                self.ttft.observe(now - req.arrival_time)
                self.prompt_tokens.inc(req.num_prompt_tokens)
                for src, n in req.cached_by_tier.items():
                    if n:
                        self._cached(src).inc(n)
            if req.status.finished:
                self.on_finished(req, now)
        self.generation_tokens.inc(n_tokens)

    def on_finished(self, req: Request, now: float | None = None) -> None:
        """``req`` finished (any reason, aborts included)."""
        now = time.monotonic() if now is None else now
        reason = req.status.value
        child = self.success.get(reason)
        if child is None:  # a finish reason added later: still counted
            child = self.success[reason] = self._success_family.labels(
                *self.labels.values(), reason
            )
        child.inc()
        self.e2e.observe(now - req.arrival_time)
        if req.first_scheduled_time is not None:
            self.queue_time.observe(req.first_scheduled_time - req.arrival_time)
        self.req_prompt_tokens.observe(req.num_prompt_tokens)
        self.req_generation_tokens.observe(len(req.output_token_ids))

    def _cached(self, source: str) -> Counter:
        child = self.cached_by_source.get(source)
        if child is None:  # a tier of another name (an extra tier): its own series
            child = self._cached_family.labels(*self.labels.values(), source)
            self.cached_by_source[source] = child
        return child

    # ------------------------------------------------------------ fetch thread

    def on_promotion(self, seconds: float, tiers: list[str]) -> None:
        slowest = next((t for t in reversed(SOURCES[1:]) if t in tiers), None)
        if slowest is not None:
            self.promotion[slowest].observe(seconds)


class _EngineGone(Exception):
    """The engine a collector reads was closed and collected: it exports nothing."""


class _EngineCollector(Collector):
    """Scrape-time metrics read from the engine's own counters."""

    def __init__(self, engine: LLMEngine, labels: dict[str, str]) -> None:
        # weak: a registry outlives its engine wherever a /metrics route or server keeps it
        # (FastAPI caches its endpoints' closures), and must not keep a model and a KV pool
        self._engine = weakref.ref(engine)
        self.names = list(labels)
        self.values = list(labels.values())

    def describe(self):  # no describe-time collect: the engine may be busy on its thread
        return []

    @property
    def engine(self) -> LLMEngine:
        engine = self._engine()
        if engine is None:
            raise _EngineGone
        return engine

    def _stats(self):
        """The engine's stats: the driver's after its latest step when an AsyncEngine steps
        it, else read now (retried: the engine thread may change a queue under us)."""
        drv = self.engine.driver
        if drv is not None and drv.last_stats is not None:
            return drv.last_stats
        for _ in range(3):
            try:
                return self.engine.stats()
            except RuntimeError:  # "deque mutated during iteration"
                continue
        return None

    def _family(self, kind, name: str, doc: str, extra: Sequence[str] = ()):
        cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
        return cls(PREFIX + name, doc, labels=[*self.names, *extra])

    def collect(self):
        try:
            e = self.engine
        except _EngineGone:
            return
        v = self.values
        s = self._stats()
        if s is not None:
            for kind, name, doc, value in (
                ("gauge", "num_requests_running", "Requests in the running batch.",
                 s.num_requests_running),
                ("gauge", "num_requests_waiting",
                 "Requests waiting to be scheduled (those being promoted from a tier included).",
                 s.num_requests_waiting),
                ("gauge", "kv_cache_usage_perc",
                 "Fraction of the device KV page pool in use by requests (0-1).",
                 s.kv_cache_usage_perc),
                ("counter", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 s.prefix_cache_queries),
                ("counter", "prefix_cache_hits",
                 "Prompt tokens found in the prefix cache (device, or promoted from a tier).",
                 s.prefix_cache_hits),
                ("counter", "num_preemptions", "Requests preempted for lack of KV pages.",
                 s.num_preemptions),
                ("gauge", "queued_prefill_tokens", "Prompt tokens queued for compute.",
                 s.queued_prefill_tokens),
            ):  # fmt: skip
                f = self._family(kind, name, doc)
                f.add_metric(v, value)
                yield f
            info = self._family(
                "gauge", "cache_config_info", "The KV cache's configuration (value 1).",
                ["kv_cache_dtype", "block_size", "num_pages"],
            )  # fmt: skip
            info.add_metric([*v, s.kv_cache_dtype, str(e.cache_config.block_size),
                             str(s.num_pages)], 1)  # fmt: skip
            yield info
        yield from self._eviction()
        yield from self._tiers(s)

    def _eviction(self):
        """KV eviction (docs/eviction.md): the manager's per-policy counters."""
        ev, v = self.engine.eviction, self.values
        for name, doc, counts in (
            ("kv_compactions", "Compactions of a request's KV cache to its budget, by policy.",
             ev.compactions_by_policy),
            ("kv_evicted_tokens", "Tokens dropped from requests' KV caches by eviction, by policy.",
             ev.evicted_by_policy),
            ("kv_compactions_deferred",
             "Compaction attempts put off for want of free pages (one per step), by policy.",
             ev.deferred_by_policy),
        ):  # fmt: skip
            f = self._family("counter", name, doc, ["policy"])
            for policy, n in list(counts.items()):
                f.add_metric([*v, policy], n)
            yield f

    def _tiers(self, s):
        e, v = self.engine, self.values
        conn = e.connector
        pages = self._family("gauge", "tier_pages", "Pages held per tier.", ["tier"])
        nbytes = self._family("gauge", "tier_bytes", "Bytes of pages held per tier.", ["tier"])
        cap = self._family("gauge", "tier_capacity_bytes", "Byte budget per tier.", ["tier"])
        up = self._family("gauge", "tier_up", "1 while a tier answers, 0 while it is down.",
                          ["tier"])  # fmt: skip
        spilled = self._family(
            "counter", "tier_spilled_pages", "Pages written into a tier by a spill.", ["tier"]
        )
        promoted = self._family(
            "counter", "tier_promoted_pages", "Pages fetched from a tier for promotion.", ["tier"]
        )
        rejected = self._family(
            "counter", "tier_rejected_pages",
            "Objects from a tier that failed the checksum or header check (then dropped).",
            ["tier"],
        )  # fmt: skip
        errors = self._family(
            "counter", "tier_errors", "Faults of a tier (down, timed out, refused).", ["tier"]
        )
        transfer = self._family(
            "counter", "peer_transfer_bytes", "Page object bytes received from peers.",
            ["transport"],
        )  # fmt: skip
        page_bytes = e.page_spec.page_nbytes
        n_dev = len(e.kv.pool.cached)
        pages.add_metric([*v, "device"], n_dev)
        nbytes.add_metric([*v, "device"], n_dev * page_bytes)
        cap.add_metric([*v, "device"], (e.kv.num_pages - 1) * page_bytes)
        up.add_metric([*v, "device"], 1)
        off = conn.offloader
        with off._lock:
            by_tier = dict(off.promoted_by_tier)
            spill = dict(off.metrics)
        seen: dict[str, dict[str, float]] = {}

        def tier_counts(name: str) -> dict[str, float]:
            return seen.setdefault(name, dict.fromkeys(
                ("spilled", "rejected", "errors", "dp", "grpc", "down"), 0))  # fmt: skip

        if conn.store is not None:
            counts = conn.store.metrics()  # per tier: errors, and corrupt (codec and wire)
            for tier in conn.store.tiers:
                m = tier_counts(tier.name)
                own = getattr(tier, "metrics", {})
                m["spilled"] += own.get("puts", 0)
                m["errors"] += counts[tier.name]["errors"]
                m["rejected"] += counts[tier.name]["corrupt"]
                m["dp"] += own.get("data_plane_bytes", 0)
                m["grpc"] += own.get("grpc_bytes", 0)
                m["down"] += not getattr(tier, "healthy", True)
                if hasattr(tier, "used_bytes"):  # a HostTier: its occupancy is its own
                    pages.add_metric([*v, tier.name], tier.num_objects)
                    nbytes.add_metric([*v, tier.name], tier.used_bytes)
                    cap.add_metric([*v, tier.name], tier.budget_bytes)
        # the peers requests named: totals over every peer store the offloader has had, those
        # it closed included, so these counters never go down
        peer = off.peer_counters()
        if peer is not None:
            m = tier_counts("peer")
            m["errors"] += peer["errors"]
            m["rejected"] += peer["corrupt"]
            m["dp"] += peer["data_plane_bytes"]
            m["grpc"] += peer["grpc_bytes"]
            m["down"] += not off.peer_healthy()
        for name, m in seen.items():
            up.add_metric([*v, name], 0 if m["down"] else 1)
            spilled.add_metric([*v, name], m["spilled"])
            rejected.add_metric([*v, name], m["rejected"])
            errors.add_metric([*v, name], m["errors"])
            promoted.add_metric([*v, name], by_tier.get(name, 0))
        dp = sum(m["dp"] for m in seen.values())
        grpc = sum(m["grpc"] for m in seen.values())
        transfer.add_metric([*v, "data_plane"], dp)
        transfer.add_metric([*v, "grpc"], grpc)
        yield from (pages, nbytes, cap, up, spilled, promoted, rejected, errors, transfer)
        skipped = self._family(
            "counter", "spill_dropped_pages",
            "Evicted device pages not spilled (the spill backlog was full) or lost to a spill "
            "error.", ["reason"],
        )  # fmt: skip
        skipped.add_metric([*v, "backlog"], spill["spill_skipped_pages"])
        skipped.add_metric([*v, "error"], spill["spill_errors"])
        yield skipped
        # the two ways a stuck fetch is given up (both logged as they happen, both rare: a
        # call that outlives its own deadline)
        left = self._family(
            "counter", "peer_fetches_left_behind",
            "Peer Fetch calls still being read after their deadline and a cancel, left behind "
            "with their thread (their missing pages are recomputed).",
        )  # fmt: skip
        # the engine's own peer tiers (--peer), plus the offloader's per-request peer stores,
        # closed ones included (peer_counters never decreases)
        n = sum(getattr(t, "metrics", {}).get("fetches_left_behind", 0)
                for t in (conn.store.tiers if conn.store is not None else ()))  # fmt: skip
        n += (off.peer_counters() or {}).get("fetches_left_behind", 0)
        left.add_metric(v, n)
        yield left
        abandoned = self._family(
            "counter", "prefix_fetches_abandoned",
            "Prefix fetches (from host, Redis or peers) still running after the offloader's "
            "fetch_abandon_s, abandoned: the request computed its prefix, later fetches moved "
            "to a new thread.",
        )  # fmt: skip
        abandoned.add_metric(v, spill["fetches_abandoned"])
        yield abandoned


__all__ = ["EngineMetrics", "buckets_1_2_5"]
