"""Prometheus metrics of the router: its decisions, the prefix index and the worker table.
docs/metrics.md lists every metric with its meaning.

Events (a decision, a worker dropped, a resync asked for) are counted as they happen on the
router's event loop; the state (live workers, index pages per worker and tier, requests in
flight, the index's own counters) is read when Prometheus scrapes, on the loop through
``run`` (the core is single-threaded), so nothing is kept twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvmesh.router.core import RouterCore
    from kvmesh.router.policies import Decision

PREFIX = "kvmesh:"
TIERS = ("device", "host", "redis", "peer")
# a decision is a few dict lookups per prompt page: microseconds to a few milliseconds
DECISION_BUCKETS = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
    0.05, 0.1,
)  # fmt: skip

# RouterCore.remove_worker's reasons, by the start of their text -> the ``cause`` label
_REMOVAL_CAUSES = (
    ("replaced by", "restarted"),
    ("the actor restarted", "restarted"),
    ("no report", "report_timeout"),
    ("no answer to a health ping", "health_check"),
    ("health ping failed", "health_check"),
    ("Generate failed", "unavailable"),
    ("shutdown", "shutdown"),
    ("retired", "retired"),
)


def removal_cause(reason: str) -> str:
    """The ``cause`` label of a removal reason (``other`` when unknown)."""
    return next((c for p, c in _REMOVAL_CAUSES if reason.startswith(p)), "other")


class RouterMetrics:
    """The metrics of one ``RouterCore``, in a registry of its own (``registry``).

    ``run(fn)`` calls ``fn()`` where the core lives (its event loop) and returns the result;
    the default calls it directly (a core driven by one thread, as in the tests).
    """

    def __init__(
        self,
        core: RouterCore,
        *,
        model_name: str = "",
        run: Callable[[Callable[[], Any]], Any] | None = None,
    ) -> None:
        self.core = core
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        reg, m = self.registry, [model_name]
        self.decisions = Counter(
            PREFIX + "router_decisions",
            "Routing decisions, by policy and reason (affinity, session, least_loaded, "
            "round_robin).",
            ["model_name", "policy", "reason"],
            registry=reg,
        )
        self.decision_seconds = Histogram(
            PREFIX + "router_decision_seconds",
            "Seconds to match a prompt against the index and pick a worker.",
            ["model_name"],
            buckets=DECISION_BUCKETS,
            registry=reg,
        ).labels(*m)
        # labelled by engine id, new on every restart: a dropped worker's series is removed
        # (on_removed), so the label set stays that of the live workers
        self.routed = Counter(
            PREFIX + "router_requests",
            "Requests routed to each worker (retries included).",
            ["model_name", "worker"],
            registry=reg,
        )
        self.prompt_tokens = Counter(
            PREFIX + "router_prompt_tokens",
            "Prompt tokens of the requests routed (once per request: retries not counted).",
            ["model_name"],
            registry=reg,
        ).labels(*m)
        matched = Counter(
            PREFIX + "router_matched_tokens",
            "Prompt tokens the chosen worker could reuse at a request's first routing, by the "
            "tier the index placed them in.",
            ["model_name", "tier"],
            registry=reg,
        )
        self.matched = {t: matched.labels(*m, t) for t in TIERS}
        self.removed = Counter(
            PREFIX + "router_workers_removed",
            "Workers dropped from routing, by cause (restarted, report_timeout, health_check, "
            "unavailable, shutdown, other).",
            ["model_name", "cause"],
            registry=reg,
        )
        for cause in sorted({c for _, c in _REMOVAL_CAUSES} | {"other"}):
            self.removed.labels(*m, cause)  # every cause exported from the start (at 0)
        self.resyncs = Counter(
            PREFIX + "router_resyncs",
            "Workers told to register again: their event stream had a gap or restarted "
            "(resync), or the router did not know them (unknown).",
            ["model_name", "status"],
            registry=reg,
        )
        for status in ("resync", "unknown"):
            self.resyncs.labels(*m, status)
        # autoscaling (cluster/autoscale.py): each decision by action (up, down) and cause
        # (the first word of its reason: high_load, low_load, min_workers, max_workers)
        self.scaling = Counter(
            PREFIX + "autoscale_decisions",
            "Autoscaling decisions carried out, by action (up, down) and cause (high_load, "
            "low_load, min_workers, max_workers).",
            ["model_name", "action", "cause"],
            registry=reg,
        )
        self.scaling_flushed = Counter(
            PREFIX + "autoscale_flushed_pages",
            "Pages retired workers wrote down to the shared tier before they left.",
            ["model_name"],
            registry=reg,
        ).labels(*m)
        self.run = run or (lambda fn: fn())
        reg.register(_RouterCollector(self))

    # ------------------------------------------------------------ the core's loop

    def on_decision(
        self,
        decision: Decision,
        seconds: float,
        num_tokens: int,
        block_size: int,
        *,
        retry: bool = False,
    ) -> None:
        """A request was routed; ``retry``: again, after its worker failed. Its prompt and
        matched tokens are counted at its first routing only, so they add up per request."""
        self.decisions.labels(self.model_name, decision.policy, decision.reason).inc()
        self.decision_seconds.observe(seconds)
        self.routed.labels(self.model_name, str(decision.worker_id)).inc()
        if retry:
            return
        self.prompt_tokens.inc(num_tokens)
        match = decision.score(decision.worker_id).match
        for tier in TIERS:
            n = getattr(match, tier)
            if n:
                self.matched[tier].inc(n * block_size)

    def on_removed(self, worker_id: str, reason: str) -> None:
        """A worker was dropped: counted by cause, and its ``router_requests`` series goes
        (a restarted worker comes back under a new id; keeping every id would grow the label
        set without bound)."""
        self.removed.labels(self.model_name, removal_cause(reason)).inc()
        self.routed.remove(self.model_name, str(worker_id))  # a no-op if never routed to

    def on_resync(self, status: str) -> None:
        self.resyncs.labels(self.model_name, status).inc()

    def on_scaling(self, decision: dict) -> None:
        """An autoscaling decision was carried out (``ScaleDecision.as_dict``)."""
        self.scaling.labels(
            self.model_name, str(decision.get("action")), str(decision.get("cause"))
        ).inc()
        flush = decision.get("flush") or {}
        n = int(flush.get("pages_written", 0))
        if n > 0:
            self.scaling_flushed.inc(n)


def _snapshot(core: RouterCore) -> dict:
    """What the collector reads, taken on the core's loop in one go."""
    return {
        "workers": {
            wid: {
                "name": r.name,
                "address": r.address,
                "metrics_address": r.metrics_address or "",
                "in_flight": core.inflight.of(wid).requests,
                "pages": {t: core.index.num_pages(wid, t) for t in ("device", "host", "redis")},
            }
            for wid, r in core.workers.items()
        },
        "index": dict(vars(core.index.stats)),
        "retries": core.retries,
        "policy": core.policy.name,
        "draining": len(core.draining),
        "autoscale": core.autoscale_config,
        "last_scaling": list(core.scaling)[-3:],
    }


class _RouterCollector(Collector):
    def __init__(self, metrics: RouterMetrics) -> None:
        self.m = metrics

    def describe(self):
        return []

    def collect(self):
        m = self.m
        try:
            snap = m.run(lambda: _snapshot(m.core))
        except Exception:  # the router is stopping: export the event counters only
            return
        mn = [m.model_name]
        live = GaugeMetricFamily(
            PREFIX + "router_workers",
            "Live workers (registered and reporting).",
            labels=["model_name"],
        )
        live.add_metric(mn, len(snap["workers"]))
        yield live
        info = GaugeMetricFamily(
            PREFIX + "router_worker_info",
            "One series per live worker (value 1): its gRPC and /metrics addresses.",
            labels=["model_name", "worker", "name", "address", "metrics_address"],
        )
        pages = GaugeMetricFamily(
            PREFIX + "router_index_pages",
            "Pages the prefix index holds for a worker, by tier.",
            labels=["model_name", "worker", "tier"],
        )
        inflight = GaugeMetricFamily(
            PREFIX + "router_requests_in_flight",
            "Requests routed to a worker whose streams are still open.",
            labels=["model_name", "worker"],
        )
        for wid, w in snap["workers"].items():
            info.add_metric([*mn, wid, w["name"], w["address"], w["metrics_address"]], 1)
            inflight.add_metric([*mn, wid], w["in_flight"])
            for tier, n in w["pages"].items():
                pages.add_metric([*mn, wid, tier], n)
        yield from (info, pages, inflight)
        policy = GaugeMetricFamily(
            PREFIX + "router_policy_info", "The routing policy in use (value 1).",
            labels=["model_name", "policy"],
        )  # fmt: skip
        policy.add_metric([*mn, snap["policy"]], 1)
        yield policy
        retries = CounterMetricFamily(
            PREFIX + "router_retries",
            "Requests routed again after their worker failed before streaming a token.",
            labels=["model_name"],
        )
        retries.add_metric(mn, snap["retries"])
        yield retries
        events = CounterMetricFamily(
            PREFIX + "router_index_events",
            "Block events the prefix index applied, or ignored while a worker was resyncing.",
            labels=["model_name", "outcome"],
        )
        events.add_metric([*mn, "applied"], snap["index"]["events_applied"])
        events.add_metric([*mn, "ignored"], snap["index"]["events_ignored"])
        yield events
        stale = CounterMetricFamily(
            PREFIX + "router_index_stale_streams",
            "Event streams the index stopped trusting: a sequence gap, or a worker restart.",
            labels=["model_name", "kind"],
        )
        stale.add_metric([*mn, "gap"], snap["index"]["gaps"])
        stale.add_metric([*mn, "restart"], snap["index"]["restarts"])
        yield stale
        opt = CounterMetricFamily(
            PREFIX + "router_optimistic_pages",
            "Pages the router recorded at a worker when routing there, by what became of them "
            "(inserted, confirmed by an event, expired).",
            labels=["model_name", "outcome"],
        )
        for outcome in ("inserted", "confirmed", "expired"):
            opt.add_metric([*mn, outcome], snap["index"][f"optimistic_{outcome}"])
        yield opt
        draining = GaugeMetricFamily(
            PREFIX + "autoscale_draining_workers",
            "Workers the autoscaler is retiring (no new requests; flushing their cache).",
            labels=["model_name"],
        )
        draining.add_metric(mn, snap["draining"])
        yield draining
        cfg = snap["autoscale"]
        if cfg:
            bounds = GaugeMetricFamily(
                PREFIX + "autoscale_bounds",
                "The autoscaler's worker bounds (bound: min, max).",
                labels=["model_name", "bound"],
            )
            bounds.add_metric([*mn, "min"], cfg["min_workers"])
            bounds.add_metric([*mn, "max"], cfg["max_workers"])
            yield bounds
        last = GaugeMetricFamily(
            PREFIX + "autoscale_decision_info",
            "The latest autoscaling decisions (at most 3), value: when (unix seconds), with "
            "their action, worker counts, cause, reason and the worker retired or started.",
            labels=["model_name", "action", "from_workers", "to_workers", "cause", "reason",
                    "worker"],
        )  # fmt: skip
        for d in snap["last_scaling"]:
            last.add_metric(
                [*mn, str(d.get("action")), str(d.get("from_workers")), str(d.get("to_workers")),
                 str(d.get("cause")), str(d.get("reason")), str(d.get("worker") or "")],
                float(d.get("at", 0.0)),
            )  # fmt: skip
        yield last


__all__ = ["RouterMetrics", "removal_cause"]
