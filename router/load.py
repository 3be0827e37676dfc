"""A worker's load: one type from the engine's counters to the router's cost model.

``WorkerLoad`` is the one shape of "how busy is this worker". Its fields are the engine's own
(``worker.engine.EngineStats``, vLLM's metric names without the prefix) and it crosses every
boundary through one function per direction:

- engine -> load: ``WorkerLoad.from_stats(stats)`` (on the worker, on its engine thread);
- load <-> Ray call: ``to_report(load)`` -> a plain dict; ``from_report(dict)`` parses it,
  clamping what is out of range (a bad report must not take the router down);
- load <-> wire: ``to_proto(load, worker_id)`` -> ``kvmesh.v1.Load``; ``from_proto(msg)``.

The router never imports the worker (imports point kvstore <- router <- cluster), so
``from_stats`` reads the fields by name rather than taking an ``EngineStats`` type.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["WorkerLoad", "from_proto", "from_report", "to_proto", "to_report"]

_COUNTS = (
    "running",
    "waiting",
    "queued_prefill_tokens",
    "num_free_pages",
    "num_pages",
    "prefix_cache_queries",
    "prefix_cache_hits",
)


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's queue and cache occupancy at ``timestamp``.

    ``running`` / ``waiting``: requests in the scheduler's running and waiting queues (a
    request whose pages are being promoted from a tier counts as waiting).
    ``queued_prefill_tokens``: prompt tokens queued for compute, over both queues (not
    those of a request whose pages are being promoted: they come from a tier).
    ``kv_usage``: fraction of the device page pool in use, in [0, 1].
    ``num_free_pages`` / ``num_pages``: the device pool.
    ``prefix_cache_queries`` / ``prefix_cache_hits``: cumulative, in tokens.
    ``timestamp``: when the worker measured it (seconds since the epoch, the worker's clock).
    """

    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    kv_usage: float = 0.0
    num_free_pages: int = 0
    num_pages: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    timestamp: float = 0.0

    def __post_init__(self) -> None:
        for name in _COUNTS:
            if getattr(self, name) < 0:
                raise ValueError(f"WorkerLoad.{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"WorkerLoad.kv_usage must be in [0, 1], got {self.kv_usage}")

    @classmethod
    def from_stats(cls, stats: Any, timestamp: float | None = None) -> WorkerLoad:
        """From the engine's ``EngineStats`` (any object with its field names)."""
        return cls(
            running=stats.num_requests_running,
            waiting=stats.num_requests_waiting,
            queued_prefill_tokens=stats.queued_prefill_tokens,
            kv_usage=min(1.0, max(0.0, float(stats.kv_cache_usage_perc))),
            num_free_pages=stats.num_free_pages,
            num_pages=stats.num_pages,
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            timestamp=time.time() if timestamp is None else timestamp,
        )


def to_report(load: WorkerLoad) -> dict:
    """The dict a worker sends the router over Ray: every field by name, plain numbers."""
    return asdict(load)


def _count(value: Any) -> int:
    try:
        v = int(value)
    except (TypeError, ValueError, OverflowError):  # None, "x", inf, nan
        return 0
    return max(0, v)


def from_report(report: dict | None, now: float = 0.0) -> WorkerLoad:
    """Parse a report dict (``to_report``'s shape). Missing fields are 0, negative counts 0,
    ``kv_usage`` is clamped to [0, 1] (NaN to 0), a missing or non-finite timestamp is
    ``now``; unknown keys are ignored. Never raises on a dict."""
    report = report or {}
    try:
        usage = float(report.get("kv_usage", 0.0))
    except (TypeError, ValueError):
        usage = 0.0
    try:
        ts = float(report.get("timestamp", now))
    except (TypeError, ValueError):
        ts = now
    return WorkerLoad(
        **{name: _count(report.get(name, 0)) for name in _COUNTS},
        kv_usage=min(1.0, max(0.0, usage)) if not math.isnan(usage) else 0.0,
        timestamp=ts if math.isfinite(ts) else now,
    )


def to_proto(load: WorkerLoad, worker_id: str):
    """``kvmesh.v1.Load`` (vLLM's metric names) for ``GetLoad``."""
    from kvmesh.protos.kvmesh.v1 import inference_pb2 as ipb

    return ipb.Load(
        num_requests_running=load.running,
        num_requests_waiting=load.waiting,
        queued_prefill_tokens=load.queued_prefill_tokens,
        kv_cache_usage_perc=load.kv_usage,
        num_free_pages=load.num_free_pages,
        num_pages=load.num_pages,
        prefix_cache_queries=load.prefix_cache_queries,
        prefix_cache_hits=load.prefix_cache_hits,
        worker_id=worker_id,
    )


def from_proto(msg) -> WorkerLoad:
    """A ``kvmesh.v1.Load`` back into a ``WorkerLoad``, clamped like ``from_report`` (the wire
    carries no timestamp: 0)."""
    return from_report(
        {
            "running": msg.num_requests_running,
            "waiting": msg.num_requests_waiting,
            "queued_prefill_tokens": msg.queued_prefill_tokens,
            "kv_usage": msg.kv_cache_usage_perc,
            "num_free_pages": msg.num_free_pages,
            "num_pages": msg.num_pages,
            "prefix_cache_queries": msg.prefix_cache_queries,
            "prefix_cache_hits": msg.prefix_cache_hits,
        }
    )
