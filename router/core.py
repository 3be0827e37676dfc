"""The routing core: the worker table, the prefix index, the policy and the requests in flight.

Pure and single-threaded (no I/O): ``router/service.py`` runs every method on its gRPC event
loop; the Ray actor shell (``cluster/actors.py``) feeds ``register`` and ``publish`` through
``RouterServer.call``. One request through the core:

    assign(request_id, tokens, page hashes)   match -> pick -> optimistic insert; charge the
                                              chosen worker (router/inflight.py)
    first_token(request_id)                   its prefill is done: only decode is charged
    release(request_id)                       its stream closed: nothing is charged

The worker -> router protocol (see docs/cluster.md):
- ``register``: a worker's address, model fingerprint, block size, and a snapshot of its
  cached pages by tier (device, host) taken on its engine thread at event sequence number
  ``next_seq``. The router forgets what it knew of that worker and trusts its stream from
  ``next_seq`` on.
- ``publish``: the events since the last call (``EventRow``s, each with the engine's
  sequence number) and the worker's latest load (``router.load.to_report``). A worker the
  router does not know, or whose stream the index stopped trusting (a gap), is told to
  register again (a full resync); every reply carries ``router_id`` so a restarted router is
  noticed even when the call succeeds.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

from kvmesh.kvstore.events import BlockEvent, BlockRemoved, BlockStored
from kvmesh.router.inflight import InflightTable, effective_load
from kvmesh.router.load import WorkerLoad, from_report
from kvmesh.router.policies import (
    DEFAULT_POLICY,
    Decision,
    NoWorkerError,
    RouteRequest,
    make_policy,
    pick_and_insert,
)
from kvmesh.router.prefix_index import DEVICE, HOST, REDIS, PrefixIndex

logger = logging.getLogger("kvmesh.router")

__all__ = [
    "REMOVED",
    "STORED",
    "EventRow",
    "RouterCore",
    "WorkerRecord",
    "decode_events",
    "encode_event",
    "snapshot_pages",
]

# ---------------------------------------------------------------- events on the wire

STORED, REMOVED = 0, 1
# (seq, STORED | REMOVED, page hash, tier): what the index reads of an event. The tokens and
# parent hash a BlockStored carries stay on the worker: the router never needs them.
EventRow = tuple[int, int, bytes, str]


def encode_event(ev: BlockEvent) -> EventRow:
    kind = STORED if isinstance(ev, BlockStored) else REMOVED
    return (ev.seq, kind, ev.block_hash, ev.tier)


def decode_events(rows: Iterable[EventRow], engine_id: str, block_size: int) -> list[BlockEvent]:
    out: list[BlockEvent] = []
    for seq, kind, h, tier in rows:
        if kind == STORED:
            out.append(BlockStored(seq, engine_id, h, None, (), block_size, tier))
        elif kind == REMOVED:
            out.append(BlockRemoved(seq, engine_id, h, tier))
        else:
            raise ValueError(f"unknown event kind {kind!r}; accepted: {STORED}, {REMOVED}")
    return out


# A snapshot replays host pages before device ones: when it has to be cut (see ``register``)
# the oldest part goes, and a device page is worth more to the router than a host page.
_SNAPSHOT_ORDER = (REDIS, HOST, DEVICE)


def snapshot_pages(
    pages: Sequence[bytes] | Mapping[str, Sequence[bytes]],
) -> list[tuple[str, bytes]]:
    """A registration's ``pages`` as (tier, hash) in replay order.

    ``pages``: ``{tier: [hash, ...]}`` (what ``LLMEngine.cached_pages_by_tier`` returns), or a
    plain list of device page hashes (what workers sent before tiers were reported).
    """
    if not isinstance(pages, Mapping):
        return [(DEVICE, bytes(h)) for h in pages]
    unknown = set(pages) - set(_SNAPSHOT_ORDER)
    if unknown:
        raise ValueError(
            f"snapshot tiers {sorted(unknown)} are not accepted; accepted: "
            f"{', '.join(_SNAPSHOT_ORDER)}"
        )
    return [(t, bytes(h)) for t in _SNAPSHOT_ORDER for h in pages.get(t, ())]


@dataclass
class WorkerRecord:
    """What the router knows of one live worker (one engine incarnation)."""

    worker_id: str  # the engine id: also the worker_id of every final GenerateResponse
    name: str  # the worker's stable slot name (its Ray actor name); survives restarts
    address: str  # host:port of its Inference and KVTransfer services
    registered_at: float
    last_heard: float  # monotonic time of the last register, publish or health ping
    load: WorkerLoad  # the last report, parsed
    # False only while the worker has published nothing since registering with next_seq 0:
    # the index then waits for its seq 0, and that is no reason to resync
    stream_started: bool = False
    routed: int = 0
    events: int = 0
    metrics_address: str | None = None  # host:port of its Prometheus /metrics, if served


class RouterCore:
    """The worker table, the prefix index, the routing policy and the in-flight requests.
    Not thread-safe: one event loop (the server's) calls every method."""

    def __init__(
        self,
        *,
        model_fp: str | None = None,
        policy: str = DEFAULT_POLICY,
        report_timeout_s: float = 4.0,
        optimistic_ttl_s: float = 2.0,
        peer_fetch: bool = True,
        seed: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if report_timeout_s <= 0:
            raise ValueError(f"report_timeout_s must be > 0, got {report_timeout_s}")
        self.router_id = uuid.uuid4().hex[:12]
        self.model_fp = model_fp
        self.block_size: int | None = None
        self.report_timeout_s = report_timeout_s
        self._clock = clock
        self._seed = seed
        # With peer_fetch, pages another worker holds earn peer credit: the chosen worker is
        # told where they are (GenerateRequest.peer_addresses) and fetches them over
        # KVTransfer. Without it, only a worker's own pages count.
        self.index = PrefixIndex(
            optimistic_ttl_s=optimistic_ttl_s,
            clock=clock,
            **({} if peer_fetch else {"peer_tiers": ()}),
        )
        self.policy = self._make_policy(policy)
        self.workers: dict[str, WorkerRecord] = {}
        self.inflight = InflightTable()
        self.decisions: Counter[str] = Counter()
        self.retries = 0
        self.removed: list[dict] = []  # the most recent removals, with their reasons
        # called with (worker_id, reason) when a worker that is gone or unresponsive is
        # dropped (``remove_worker(..., dead=True)``): the server cancels its calls to it
        self.on_dead: list[Callable[[str, str], None]] = []
        self.metrics = None  # a router.metrics.RouterMetrics, fed as things happen
        # autoscaling (cluster/autoscale.py): workers being retired get no new requests;
        # TTFTs of recent requests (monotonic time, seconds) feed the scale-up signal;
        # the controller's decisions, newest last, with their reasons and inputs
        self.draining: set[str] = set()
        self._assigned_at: dict[str, float] = {}
        self.ttfts: deque[tuple[float, float]] = deque(maxlen=4096)
        self.scaling: deque[dict] = deque(maxlen=64)
        self.scaling_counts: Counter[str] = Counter()
        self.autoscale_config: dict | None = None

    def _make_policy(self, name: str):
        return make_policy(name, rng=random.Random(self._seed))

    # ------------------------------------------------------------ workers

    def register(self, info: dict) -> dict:
        """(Re-)register a worker from its snapshot; see the module docstring.

        ``info``: worker_id, name, address, model_fp, block_size, next_seq, pages (its cached
        pages as ``{tier: [hash, ...]}``, oldest first; a plain list means device pages), load
        (a report dict). Raises ValueError when the worker's model or block size differs from
        the cluster's (hashes would not match), or for a tier the index does not know.
        """
        wid, name = str(info["worker_id"]), str(info.get("name") or info["worker_id"])
        fp, bs = info["model_fp"], int(info["block_size"])
        if self.model_fp is None:
            self.model_fp = fp
        elif fp != self.model_fp:
            raise ValueError(
                f"worker {wid} serves model fingerprint {fp}; this router routes "
                f"{self.model_fp}: every worker must load the router's model"
            )
        if self.block_size is None:
            self.block_size = bs
        elif bs != self.block_size:
            raise ValueError(
                f"worker {wid} has block_size {bs}; the cluster's is {self.block_size}"
            )
        pages = snapshot_pages(info.get("pages") or ())
        for other in [r for r in self.workers.values() if r.name == name and r.worker_id != wid]:
            self.remove_worker(
                other.worker_id, f"replaced by {wid} (the worker restarted)", dead=True
            )
        now = self._clock()
        next_seq = int(info["next_seq"])
        # Every cached page was announced by a numbered event, so next_seq >= len(pages) when
        # the worker subscribed before caching anything; if not, keep the newest pages only
        # (under-crediting is safe).
        if len(pages) > next_seq:
            pages = pages[len(pages) - next_seq :]
        first = next_seq - len(pages)
        # Replay the snapshot as the events numbered first .. next_seq - 1, so the stream
        # continues seamlessly at next_seq. A fresh entry whose replay starts at seq 0 needs
        # no reset: seq 0 is a clean stream start for the index.
        self.index.remove_worker(wid)
        if first > 0:
            self.index.reset(wid, wid, first)
        else:
            self.index.add_worker(wid)
        self.index.apply_batch(
            wid,
            [BlockStored(first + i, wid, h, None, (), bs, t) for i, (t, h) in enumerate(pages)],
        )
        rec = WorkerRecord(
            worker_id=wid,
            name=name,
            address=str(info["address"]),
            registered_at=now,
            last_heard=now,
            load=from_report(info.get("load"), now),
            stream_started=next_seq > 0,
            metrics_address=info.get("metrics_address") or None,
        )
        old = self.workers.get(wid)
        if old is not None:
            rec.routed, rec.events = old.routed, old.events
        self.workers[wid] = rec
        by_tier = Counter(t for t, _ in pages)
        logger.info(
            "worker %s (%s) registered at %s: cached pages %s, stream from seq %d",
            wid,
            name,
            rec.address,
            dict(by_tier) or "none",
            next_seq,
        )
        return {"router_id": self.router_id, "status": "ok"}

    def publish(self, worker_id: str, rows: Sequence[EventRow], report: dict | None) -> dict:
        """Apply a worker's events and record its load. Replies ``status``: ``ok``,
        ``unknown`` (register first) or ``resync`` (the index lost track: register again)."""
        rec = self.workers.get(worker_id)
        if rec is None:
            if self.metrics is not None:
                self.metrics.on_resync("unknown")
            return {"router_id": self.router_id, "status": "unknown"}
        now = self._clock()
        rec.last_heard = now
        if report:
            rec.load = from_report(report, now)
        if rows:
            self.index.apply_batch(worker_id, decode_events(rows, worker_id, self.block_size))
            rec.events += len(rows)
            rec.stream_started = True
        if rec.stream_started and self.index.is_resyncing(worker_id):
            if self.metrics is not None:
                self.metrics.on_resync("resync")
            return {"router_id": self.router_id, "status": "resync"}
        return {"router_id": self.router_id, "status": "ok"}

    def heard_from(self, worker_id: str) -> None:
        """A liveness signal other than a publish (the Ray shell's health ping)."""
        rec = self.workers.get(worker_id)
        if rec is not None:
            rec.last_heard = self._clock()

    def remove_worker(
        self, worker_id: str, reason: str, *, dead: bool = False, keep_redis: bool = False
    ) -> bool:
        """Drop a worker from routing, from the index and from the in-flight counts.
        Returns whether it was known. ``dead``: it is gone or does not answer (a failed
        health check, no report, a restart), so the ``on_dead`` listeners cut the calls in
        flight to it; a worker that leaves by itself (draining) finishes them.
        ``keep_redis``: the pages it wrote to Redis stay credited (a retired worker that
        flushed its cache there)."""
        rec = self.workers.pop(worker_id, None)
        self.draining.discard(worker_id)
        self.index.remove_worker(worker_id, keep_redis=keep_redis)
        self.inflight.drop_worker(worker_id)
        if rec is None:
            return False
        logger.warning("worker %s (%s) removed: %s", worker_id, rec.name, reason)
        if self.metrics is not None:
            self.metrics.on_removed(worker_id, reason)
        self.removed.append(
            {"worker_id": worker_id, "name": rec.name, "reason": reason, "at": time.time()}
        )
        del self.removed[:-32]
        if dead:
            for listener in self.on_dead:
                try:
                    listener(worker_id, reason)
                except Exception:  # a listener's bug must not keep a dead worker routed
                    logger.exception("on_dead listener failed for %s", worker_id)
        return True

    def expire(self) -> list[str]:
        """Drop workers not heard from for ``report_timeout_s``; returns their ids."""
        limit = self._clock() - self.report_timeout_s
        stale = [wid for wid, r in self.workers.items() if r.last_heard < limit]
        for wid in stale:
            self.remove_worker(
                wid, f"no report for more than {self.report_timeout_s:.1f}s", dead=True
            )
        return stale

    # ------------------------------------------------------------ routing

    def load_of(self, worker_id: str) -> WorkerLoad:
        """The load a policy sees: the last report, raised to what is in flight there."""
        return effective_load(self.workers[worker_id].load, self.inflight.of(worker_id))

    def assign(
        self,
        request_id: str,
        token_ids: Sequence[int],
        page_hashes: Sequence[bytes],
        *,
        exclude: Iterable[str] = (),
        session_key: str | None = None,
    ) -> Decision:
        """Choose a worker for a request among the live ones (minus ``exclude``), record its
        pages there optimistically and count it in flight there until ``release``. Assigning
        a request id again (a retry) moves its charge. A call with ``exclude`` is a retry (the
        excluded workers failed it): the metrics do not count its prompt again. Raises
        NoWorkerError when no worker is left."""
        skip = set(exclude)
        loads = {
            wid: self.load_of(wid)
            for wid in self.workers
            if wid not in skip and wid not in self.draining
        }
        if not loads:
            raise NoWorkerError(
                "no worker is available"
                + (f" (excluded after failures: {sorted(skip)})" if skip else "")
            )
        req = RouteRequest(len(token_ids), page_hashes, self.block_size or 1, session_key)
        t0 = time.perf_counter()
        decision = pick_and_insert(self.index, self.policy, req, loads)
        if self.metrics is not None:
            self.metrics.on_decision(
                decision,
                time.perf_counter() - t0,
                len(token_ids),
                self.block_size or 1,
                retry=bool(skip),
            )
        chosen = decision.score(decision.worker_id)
        self.inflight.begin(
            request_id,
            decision.worker_id,
            chosen.recompute_tokens + round(chosen.fetch_cost),
        )
        self.workers[decision.worker_id].routed += 1
        self.decisions[decision.reason] += 1
        self._assigned_at.setdefault(request_id, self._clock())  # a retry keeps its start
        return decision

    def first_token(self, request_id: str) -> None:
        """The request streamed its first token: its prefill no longer loads its worker."""
        self.inflight.first_token(request_id)
        t0 = self._assigned_at.pop(request_id, None)
        if t0 is not None:
            now = self._clock()
            self.ttfts.append((now, now - t0))

    def release(self, request_id: str) -> None:
        """The request's stream closed (finished, failed or aborted)."""
        self.inflight.end(request_id)
        self._assigned_at.pop(request_id, None)

    # ------------------------------------------------------------ autoscaling

    def begin_retire(self, worker_id: str) -> bool:
        """Stop routing new requests to a worker the autoscaler retires (its requests in
        flight finish). Returns whether the worker is known."""
        if worker_id not in self.workers:
            return False
        self.draining.add(worker_id)
        logger.info("worker %s draining: the autoscaler retires it", worker_id)
        return True

    def ttft_p99(self, look_back_s: float) -> float | None:
        """The nearest-rank p99 TTFT (router-side: routing to first token) of the requests
        whose first token came in the last ``look_back_s`` seconds (None: none did)."""
        since = self._clock() - look_back_s
        xs = sorted(t for at, t in self.ttfts if at >= since)
        if not xs:
            return None
        return xs[min(len(xs) - 1, max(0, -(-99 * len(xs) // 100) - 1))]

    def autoscale_view(self, look_back_s: float = 30.0) -> dict:
        """What the autoscaler decides from: the fleet's load over the live (not draining)
        workers, the router's TTFT p99, and per worker its slot name, requests in flight and
        unique pages (``PrefixIndex.unique_pages``)."""
        live = [wid for wid in self.workers if wid not in self.draining]
        loads = {wid: self.load_of(wid) for wid in live}
        return {
            "workers": {
                wid: {
                    "name": self.workers[wid].name,
                    "in_flight": self.inflight.of(wid).requests,
                    "unique_pages": self.index.unique_pages(wid),
                }
                for wid in live
            },
            "draining": sorted(self.draining),
            "waiting": sum(ld.waiting for ld in loads.values()),
            "running": sum(ld.running for ld in loads.values()),
            "queued_prefill_tokens": sum(ld.queued_prefill_tokens for ld in loads.values()),
            "kv_usage": (sum(ld.kv_usage for ld in loads.values()) / len(loads)) if loads else 0.0,
            "ttft_p99_s": self.ttft_p99(look_back_s),
        }

    def record_scaling(self, decision: dict) -> None:
        """Keep an autoscaling decision (``cluster.autoscale.ScaleDecision.as_dict``) for
        ``stats`` and the metrics."""
        self.scaling.append(dict(decision))
        self.scaling_counts[str(decision.get("action"))] += 1
        if self.metrics is not None:
            self.metrics.on_scaling(decision)

    def peers_for(self, decision: Decision, limit: int = 2) -> list[str]:
        """KVTransfer addresses of the workers holding more of this prompt's leading pages
        on their own device or host than the chosen one, most first (the request's hint)."""
        if not self.index.peer_tiers:
            return []
        mine = decision.score(decision.worker_id).match
        own = mine.device + mine.host
        better = sorted(
            (
                c
                for c in decision.candidates
                if c.worker_id != decision.worker_id and c.match.device + c.match.host > own
            ),
            key=lambda c: -(c.match.device + c.match.host),
        )
        return [a for c in better[:limit] if (a := self.address_of(c.worker_id))]

    def set_policy(self, name: str) -> str:
        """Switch the routing policy (a fresh one: cursor and sessions start over)."""
        self.policy = self._make_policy(name)
        logger.info("routing policy: %s", name)
        return name

    def address_of(self, worker_id: str) -> str | None:
        rec = self.workers.get(worker_id)
        return rec.address if rec is not None else None

    # ------------------------------------------------------------ reporting

    def aggregate_load(self) -> WorkerLoad:
        """The fleet's load: sums over the live workers' last reports (kv usage: the mean)."""
        loads = [r.load for r in self.workers.values()]
        return WorkerLoad(
            running=sum(ld.running for ld in loads),
            waiting=sum(ld.waiting for ld in loads),
            queued_prefill_tokens=sum(ld.queued_prefill_tokens for ld in loads),
            kv_usage=sum(ld.kv_usage for ld in loads) / len(loads) if loads else 0.0,
            num_free_pages=sum(ld.num_free_pages for ld in loads),
            num_pages=sum(ld.num_pages for ld in loads),
            prefix_cache_queries=sum(ld.prefix_cache_queries for ld in loads),
            prefix_cache_hits=sum(ld.prefix_cache_hits for ld in loads),
            timestamp=max((ld.timestamp for ld in loads), default=0.0),
        )

    def stats(self) -> dict:
        now = self._clock()
        return {
            "router_id": self.router_id,
            "policy": self.policy.name,
            "model_fp": self.model_fp,
            "block_size": self.block_size,
            "workers": {
                wid: {
                    "name": r.name,
                    "address": r.address,
                    "load": asdict(r.load),
                    "in_flight": asdict(self.inflight.of(wid)),
                    "last_heard_s": round(now - r.last_heard, 3),
                    "routed": r.routed,
                    "events": r.events,
                    "resyncing": self.index.is_resyncing(wid) and r.stream_started,
                    "index_pages": {t: self.index.num_pages(wid, t) for t in (DEVICE, HOST, REDIS)},
                }
                for wid, r in sorted(self.workers.items())
            },
            "index_workers": sorted(map(str, self.index.workers())),
            "index": asdict(self.index.stats),
            "decisions": dict(self.decisions),
            "retries": self.retries,
            "removed": list(self.removed),
            "autoscale": {
                "config": self.autoscale_config,
                "draining": sorted(self.draining),
                "decisions": list(self.scaling)[-16:],
                "counts": dict(self.scaling_counts),
            },
        }
