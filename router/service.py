"""The router service: the client-facing ``Inference`` gRPC service in front of the workers.

Generate: tokenize (text prompts) -> page hashes (``kvstore.hashing.hash_pages``, exactly as
the workers hash) -> ``PrefixIndex.match`` -> ``policy.pick`` -> optimistic insert -> the
request, as token ids, to the chosen worker's ``Inference.Generate``, whose responses stream
back unchanged: the final one names the worker and the cached tokens by tier.

Two layers:
- ``RouterCore``: the worker table, the index and the policy. Pure and single-threaded (no
  I/O); every method runs on the server's event loop.
- ``RouterServer``: the grpc.aio server (Inference, health, reflection) and the channels to
  the workers. ``call`` runs a core method from another thread (the Ray actor shell in
  ``cluster/actors.py`` feeds ``register`` and ``publish`` through it).

The worker -> router protocol (see docs/cluster.md):
- ``register``: a worker's address, model fingerprint, block size, and a snapshot of its
  cached device pages taken on its engine thread at event sequence number ``next_seq``. The
  router forgets what it knew of that worker and trusts its stream from ``next_seq`` on.
- ``publish``: the events since the last call (``EventRow``s, each with the engine's
  sequence number) and the worker's latest load. A worker the router does not know, or whose
  stream the index stopped trusting (a gap), is told to register again (a full resync);
  every reply carries ``router_id`` so a restarted router is noticed even when the call
  succeeds.

Failures: a worker not heard from for ``report_timeout_s`` is dropped (the Ray shell also
pings the actors). A worker whose Generate fails with UNAVAILABLE is dropped at once; when
no token has been streamed yet, the request is routed again among the others, else the
client's stream ends with UNAVAILABLE. A dropped worker that is alive is told to register
on its next publish.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmesh.kvstore.events import BlockEvent, BlockRemoved, BlockStored
from kvmesh.kvstore.hashing import hash_pages
from kvmesh.protos.kvmesh.v1 import inference_pb2 as ipb
from kvmesh.protos.kvmesh.v1 import inference_pb2_grpc as ipb_grpc
from kvmesh.router.policies import (
    DEFAULT_POLICY,
    Decision,
    NoWorkerError,
    RouteRequest,
    WorkerLoad,
    make_policy,
    route,
)
from kvmesh.router.prefix_index import PrefixIndex

logger = logging.getLogger("kvmesh.router")

__all__ = [
    "EventRow",
    "RouterCore",
    "RouterServer",
    "decode_events",
    "encode_event",
]

# ---------------------------------------------------------------- events on the wire

STORED, REMOVED = 0, 1
# (seq, STORED | REMOVED, page hash, tier): what the index reads of an event. The tokens and
# parent hash a BlockStored carries stay on the worker: the router never needs them.
EventRow = tuple[int, int, bytes, str]

SESSION_METADATA_KEY = "kvmesh-session"  # gRPC metadata: sticky-session key for the policy


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


def _load_from(report: dict, now: float) -> WorkerLoad:
    """A WorkerLoad from a worker's report dict; out-of-range values are clamped, never
    fatal (a bad report must not take the router down)."""
    return WorkerLoad(
        running=max(0, int(report.get("running", 0))),
        waiting=max(0, int(report.get("waiting", 0))),
        queued_prefill_tokens=max(0, int(report.get("queued_prefill_tokens", 0))),
        kv_usage=min(1.0, max(0.0, float(report.get("kv_usage", 0.0)))),
        timestamp=float(report.get("timestamp", now)),
    )


# ---------------------------------------------------------------- the core


@dataclass
class WorkerRecord:
    """What the router knows of one live worker (one engine incarnation)."""

    worker_id: str  # the engine id: also the worker_id of every final GenerateResponse
    name: str  # the worker's stable slot name (its Ray actor name); survives restarts
    address: str  # host:port of its Inference and KVTransfer services
    registered_at: float
    last_heard: float  # monotonic time of the last register, publish or health ping
    load: WorkerLoad
    report: dict = field(default_factory=dict)  # the last load report, as sent
    # False only while the worker has published nothing since registering with next_seq 0:
    # the index then waits for its seq 0, and that is no reason to resync
    stream_started: bool = False
    routed: int = 0
    events: int = 0


class RouterCore:
    """The worker table, the prefix index and the routing policy. Not thread-safe: one event
    loop (the server's) calls every method."""

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
        self.decisions: Counter[str] = Counter()
        self.retries = 0
        self.removed: list[dict] = []  # the most recent removals, with their reasons

    def _make_policy(self, name: str):
        import random

        return make_policy(name, rng=random.Random(self._seed))

    # ------------------------------------------------------------ workers

    def register(self, info: dict) -> dict:
        """(Re-)register a worker from its snapshot; see the module docstring.

        ``info``: worker_id, name, address, model_fp, block_size, next_seq, pages (hashes of
        its cached device pages, oldest first), load (a report dict). Raises ValueError when
        the worker's model or block size differs from the cluster's: hashes would not match.
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
        for other in [r for r in self.workers.values() if r.name == name and r.worker_id != wid]:
            self.remove_worker(other.worker_id, f"replaced by {wid} (the worker restarted)")
        now = self._clock()
        next_seq = int(info["next_seq"])
        pages: list[bytes] = list(info.get("pages") or ())
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
            wid, [BlockStored(first + i, wid, h, None, (), bs) for i, h in enumerate(pages)]
        )
        rec = WorkerRecord(
            worker_id=wid,
            name=name,
            address=str(info["address"]),
            registered_at=now,
            last_heard=now,
            load=_load_from(info.get("load") or {}, now),
            report=dict(info.get("load") or {}),
            stream_started=next_seq > 0,
        )
        old = self.workers.get(wid)
        if old is not None:
            rec.routed, rec.events = old.routed, old.events
        self.workers[wid] = rec
        logger.info(
            "worker %s (%s) registered at %s: %d cached pages, stream from seq %d",
            wid, name, rec.address, len(pages), next_seq,
        )  # fmt: skip
        return {"router_id": self.router_id, "status": "ok"}

    def publish(self, worker_id: str, rows: Sequence[EventRow], report: dict | None) -> dict:
        """Apply a worker's events and record its load. Replies ``status``: ``ok``,
        ``unknown`` (register first) or ``resync`` (the index lost track: register again)."""
        rec = self.workers.get(worker_id)
        if rec is None:
            return {"router_id": self.router_id, "status": "unknown"}
        now = self._clock()
        rec.last_heard = now
        if report:
            rec.load = _load_from(report, now)
            rec.report = dict(report)
        if rows:
            self.index.apply_batch(worker_id, decode_events(rows, worker_id, self.block_size))
            rec.events += len(rows)
            rec.stream_started = True
        if rec.stream_started and self.index.is_resyncing(worker_id):
            return {"router_id": self.router_id, "status": "resync"}
        return {"router_id": self.router_id, "status": "ok"}

    def heard_from(self, worker_id: str) -> None:
        """A liveness signal other than a publish (the Ray shell's health ping)."""
        rec = self.workers.get(worker_id)
        if rec is not None:
            rec.last_heard = self._clock()

    def remove_worker(self, worker_id: str, reason: str) -> bool:
        """Drop a worker from routing and from the index. Returns whether it was known."""
        rec = self.workers.pop(worker_id, None)
        self.index.remove_worker(worker_id)
        if rec is None:
            return False
        logger.warning("worker %s (%s) removed: %s", worker_id, rec.name, reason)
        self.removed.append(
            {"worker_id": worker_id, "name": rec.name, "reason": reason, "at": time.time()}
        )
        del self.removed[:-32]
        return True

    def expire(self) -> list[str]:
        """Drop workers not heard from for ``report_timeout_s``; returns their ids."""
        limit = self._clock() - self.report_timeout_s
        stale = [wid for wid, r in self.workers.items() if r.last_heard < limit]
        for wid in stale:
            self.remove_worker(wid, f"no report for more than {self.report_timeout_s:.1f}s")
        return stale

    # ------------------------------------------------------------ routing

    def route(
        self,
        token_ids: Sequence[int],
        page_hashes: Sequence[bytes],
        *,
        exclude: Iterable[str] = (),
        session_key: str | None = None,
    ) -> Decision:
        """Choose a worker among the live ones (minus ``exclude``), and record the request's
        pages there optimistically. Raises NoWorkerError when none is left."""
        skip = set(exclude)
        loads = {wid: r.load for wid, r in self.workers.items() if wid not in skip}
        if not loads:
            raise NoWorkerError(
                "no worker is available" + (f" (excluded after failures: {sorted(skip)})"
                                            if skip else "")
            )  # fmt: skip
        req = RouteRequest(len(token_ids), page_hashes, self.block_size or 1, session_key)
        decision = route(self.index, self.policy, req, loads)
        self.workers[decision.worker_id].routed += 1
        self.decisions[decision.reason] += 1
        return decision

    def peers_for(self, decision: Decision, limit: int = 2) -> list[str]:
        """KVTransfer addresses of the workers holding more of this prompt's leading pages
        on their own device or host than the chosen one, most first (the request's hint)."""
        if not self.index.peer_tiers:
            return []
        mine = decision.score(decision.worker_id).match
        own = mine.device + mine.host
        better = sorted(
            (c for c in decision.candidates
             if c.worker_id != decision.worker_id and c.match.device + c.match.host > own),
            key=lambda c: -(c.match.device + c.match.host),
        )  # fmt: skip
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

    def aggregate_load(self) -> dict:
        """The fleet's load: sums over the live workers' last reports (kv usage: the mean)."""
        recs = list(self.workers.values())
        out = {
            k: sum(int(r.report.get(k, 0)) for r in recs)
            for k in (
                "running", "waiting", "queued_prefill_tokens", "num_free_pages", "num_pages",
                "prefix_cache_queries", "prefix_cache_hits",
            )
        }  # fmt: skip
        out["kv_usage"] = sum(r.load.kv_usage for r in recs) / len(recs) if recs else 0.0
        return out

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
                    "last_heard_s": round(now - r.last_heard, 3),
                    "routed": r.routed,
                    "events": r.events,
                    "resyncing": self.index.is_resyncing(wid) and r.stream_started,
                    "index_pages": {
                        t: self.index.num_pages(wid, t) for t in ("device", "host", "redis")
                    },
                }
                for wid, r in sorted(self.workers.items())
            },
            "index_workers": sorted(map(str, self.index.workers())),
            "index": asdict(self.index.stats),
            "decisions": dict(self.decisions),
            "retries": self.retries,
            "removed": list(self.removed),
        }


# ---------------------------------------------------------------- the gRPC service

_INFERENCE = ipb.DESCRIPTOR.services_by_name["Inference"].full_name
_MAX_ATTEMPTS = 3  # workers tried for one request while nothing has been streamed


class RouterServicer(ipb_grpc.InferenceServicer):
    def __init__(self, server: RouterServer) -> None:
        self.srv = server
        self.core = server.core
        self.active: dict[str, str | None] = {}  # request id -> the worker running it

    async def Generate(
        self, request: ipb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ipb.GenerateResponse]:
        if self.srv.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the router is shutting down")
        ids = await self._token_ids(request, context)
        if self.core.block_size is None:  # no worker has ever registered
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is available")
        try:
            hashes = hash_pages(ids, self.core.block_size, self.core.model_fp)
        except ValueError as e:  # a token id outside uint32
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad token ids: {e}")
        rid = request.request_id or uuid.uuid4().hex
        if rid in self.active:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"request id {rid!r} is already in use"
            )
        fwd = ipb.GenerateRequest(
            token_ids=ipb.TokenIds(ids=ids), sampling=request.sampling, request_id=rid
        )
        session = dict(context.invocation_metadata() or ()).get(SESSION_METADATA_KEY)
        self.active[rid] = None
        task = asyncio.current_task()
        self.srv.inflight.add(task)
        tried: list[str] = []
        sent = False
        code = details = None
        try:
            while code is None:
                try:
                    decision = self.core.route(ids, hashes, exclude=tried, session_key=session)
                except NoWorkerError as e:
                    code, details = grpc.StatusCode.UNAVAILABLE, str(e)
                    break
                wid = decision.worker_id
                self.active[rid] = wid
                del fwd.peer_addresses[:]
                fwd.peer_addresses.extend(self.core.peers_for(decision))
                call = self.srv.stub(wid).Generate(fwd, timeout=context.time_remaining())
                try:
                    async for msg in call:
                        sent = True
                        yield msg
                    return
                except grpc.aio.AioRpcError as e:
                    if e.code() != grpc.StatusCode.UNAVAILABLE:
                        code, details = e.code(), e.details()  # the worker's verdict stands
                        break
                    self.core.remove_worker(wid, f"Generate failed: UNAVAILABLE {e.details()}")
                    tried.append(wid)
                    if sent or len(tried) >= _MAX_ATTEMPTS:
                        code = grpc.StatusCode.UNAVAILABLE
                        details = f"worker {wid} failed: {e.details()}"
                        break
                    self.core.retries += 1
                    logger.warning("request %s: worker %s unavailable, routing again", rid, wid)
                finally:
                    call.cancel()  # a no-op once ended; else (client gone) aborts on the worker
        finally:
            self.active.pop(rid, None)
            self.srv.inflight.discard(task)
        await context.abort(code, details)

    async def _token_ids(self, request: ipb.GenerateRequest, context) -> list[int]:
        which = request.WhichOneof("prompt")
        if which is None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "the request has no prompt: set text or token_ids"
            )
        if which == "token_ids":
            ids = list(request.token_ids.ids)
        else:
            if self.srv.tokenize is None:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "this router has no tokenizer: send the prompt as token_ids",
                )
            try:  # off the loop: a long prompt takes milliseconds
                ids = await asyncio.to_thread(self.srv.tokenize, request.text)
            except Exception as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot tokenize: {e}")
        if not ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty")
        return ids

    async def Abort(
        self, request: ipb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> ipb.AbortResponse:
        wid = self.active.get(request.request_id)
        if wid is None or self.core.address_of(wid) is None:
            return ipb.AbortResponse(found=False)
        try:
            return await self.srv.stub(wid).Abort(request, timeout=10)
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), f"worker {wid}: {e.details()}")

    async def GetModelInfo(
        self, request: ipb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> ipb.ModelInfo:
        for wid in list(self.core.workers):  # any live worker: they all serve one model
            try:
                return await self.srv.stub(wid).GetModelInfo(request, timeout=10)
            except grpc.aio.AioRpcError as e:
                logger.warning("GetModelInfo from %s failed: %s", wid, e.code().name)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is available")

    async def GetLoad(self, request: ipb.GetLoadRequest, context) -> ipb.Load:
        agg = self.core.aggregate_load()
        return ipb.Load(
            num_requests_running=agg["running"],
            num_requests_waiting=agg["waiting"],
            queued_prefill_tokens=agg["queued_prefill_tokens"],
            kv_cache_usage_perc=agg["kv_usage"],
            num_free_pages=agg["num_free_pages"],
            num_pages=agg["num_pages"],
            prefix_cache_queries=agg["prefix_cache_queries"],
            prefix_cache_hits=agg["prefix_cache_hits"],
            worker_id=f"router-{self.core.router_id}",
        )


class RouterServer:
    """The router's gRPC server (Inference, health, reflection) over a ``RouterCore``.

    ``tokenize`` turns a text prompt into token ids exactly as the workers' engines do; None
    accepts token-id prompts only. Health is SERVING while at least one worker is live.
    Use ``start_in_thread()`` / ``stop_in_thread()`` to run it on a uvloop loop of its own,
    and ``call(fn, ...)`` to run a core method on that loop from another thread.
    """

    def __init__(
        self,
        core: RouterCore,
        *,
        tokenize: Callable[[str], list[int]] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        max_message_mb: int = 64,
        grace_s: float = 10.0,
        housekeeping_s: float = 0.25,
    ) -> None:
        if max_message_mb < 1:
            raise ValueError(f"max_message_mb must be >= 1, got {max_message_mb}")
        self.core = core
        self.tokenize = tokenize
        self.host, self.port = host, port
        self.max_message_mb = max_message_mb
        self.grace_s = grace_s
        self.housekeeping_s = housekeeping_s
        self.draining = False
        self.inflight: set[asyncio.Task] = set()
        self._channels: dict[str, tuple[str, grpc.aio.Channel, ipb_grpc.InferenceStub]] = {}
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._serving: bool | None = None
        self._tasks: list[asyncio.Task] = []
        self._stopped: asyncio.Event | None = None
        self._stop_task: asyncio.Future | None = None
        self._drain_deadline = float("inf")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "[::]", "::") else self.host
        return f"{host}:{self.port}"

    def stub(self, worker_id: str) -> ipb_grpc.InferenceStub:
        """The Inference stub of a live worker (one channel per worker address)."""
        addr = self.core.address_of(worker_id)
        if addr is None:
            raise KeyError(f"unknown worker {worker_id!r}")
        entry = self._channels.get(worker_id)
        if entry is None or entry[0] != addr:
            limit = self.max_message_mb * 2**20
            ch = grpc.aio.insecure_channel(
                addr,
                options=[
                    ("grpc.max_send_message_length", limit),
                    ("grpc.max_receive_message_length", limit),
                ],
            )
            entry = (addr, ch, ipb_grpc.InferenceStub(ch))
            self._channels[worker_id] = entry
        return entry[2]

    async def start(self) -> int:
        limit = self.max_message_mb * 2**20
        server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", limit),
                ("grpc.max_receive_message_length", limit),
                ("grpc.so_reuseport", 0),
            ]
        )
        ipb_grpc.add_InferenceServicer_to_server(RouterServicer(self), server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        names = [_INFERENCE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
        reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], server)
        port = server.add_insecure_port(f"{self.host}:{self.port}")
        if port == 0:
            raise OSError(f"cannot bind {self.host}:{self.port}")
        self.port = port
        await self._set_health()
        await server.start()
        self._server = server
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        self._tasks.append(asyncio.ensure_future(self._housekeeping()))
        logger.info("router %s serving on %s:%d", self.core.router_id, self.host, port)
        return port

    async def _set_health(self) -> None:
        serving = bool(self.core.workers) and not self.draining
        if serving == self._serving:
            return
        self._serving = serving
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", _INFERENCE):
            await self._health.set(name, status)

    async def _housekeeping(self) -> None:
        """Expire silent workers, close channels of departed ones, keep health current."""
        while True:
            await asyncio.sleep(self.housekeeping_s)
            try:
                self.core.expire()
                for wid in [w for w in self._channels if w not in self.core.workers]:
                    _, ch, _ = self._channels.pop(wid)
                    await ch.close(grace=None)
                await self._set_health()
            except asyncio.CancelledError:
                raise
            except Exception:  # housekeeping must outlive any one bad round
                logger.exception("router housekeeping failed")

    async def stop(self, grace: float | None = None) -> None:
        """Drain and stop: health NOT_SERVING, new calls get UNAVAILABLE, in-flight streams
        get up to ``grace`` seconds, then are cancelled (which aborts them on the workers).
        Idempotent; a later call with a shorter grace ends the drain sooner."""
        if self._server is None:
            return
        loop = asyncio.get_running_loop()
        grace = self.grace_s if grace is None else grace
        self._drain_deadline = min(self._drain_deadline, loop.time() + grace)
        if self._stop_task is None:
            self._stop_task = asyncio.ensure_future(self._drain_and_stop())
        await asyncio.shield(self._stop_task)

    async def _drain_and_stop(self) -> None:
        loop = asyncio.get_running_loop()
        self.draining = True
        await self._health.enter_graceful_shutdown()
        logger.info("router draining: %d in-flight streams", len(self.inflight))
        pending = [t for t in self.inflight if not t.done()]
        while pending and (left := self._drain_deadline - loop.time()) > 0:
            await asyncio.wait(pending, timeout=min(left, 0.1))
            pending = [t for t in pending if not t.done()]
        # one grpc stop, never two overlapping (see worker/server.py)
        await self._server.stop(None)
        for t in self._tasks:
            t.cancel()
        for _, ch, _ in self._channels.values():
            await ch.close(grace=None)
        self._channels.clear()
        self._stopped.set()
        logger.info("router stopped")

    async def wait_for_termination(self) -> None:
        if self._stopped is not None:
            await self._stopped.wait()

    # ------------------------------------------------------------ a loop of its own

    def start_in_thread(self) -> int:
        """Serve from a background thread with its own uvloop event loop; returns the port."""
        import uvloop

        started = threading.Event()
        box: list = []

        def run() -> None:
            loop = uvloop.new_event_loop()
            asyncio.set_event_loop(loop)
            try:
                box.append(loop.run_until_complete(self.start()))
            except BaseException as e:
                box.append(e)
                loop.close()
                started.set()
                return
            started.set()
            loop.run_until_complete(self.wait_for_termination())
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

        self._thread = threading.Thread(target=run, name="kvmesh-router", daemon=True)
        self._thread.start()
        started.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def stop_in_thread(self, grace: float | None = None, timeout: float = 60.0) -> None:
        if self._loop is None or self._thread is None or not self._thread.is_alive():
            return
        fut = asyncio.run_coroutine_threadsafe(self.stop(grace), self._loop)
        fut.result(timeout)
        self._thread.join(timeout)

    def call(self, fn: Callable, *args, timeout: float = 30.0, **kwargs):
        """Run ``fn(*args, **kwargs)`` on the server's loop (where the core lives) and return
        its result; exceptions are re-raised here."""
        if self._loop is None:
            raise RuntimeError("the router server is not running")
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:  # handed back to the calling thread
                fut.set_exception(e)

        self._loop.call_soon_threadsafe(run)
        return fut.result(timeout)
