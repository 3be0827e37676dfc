"""The Ray actors of a kvmesh cluster: ``WorkerActor`` (one per accelerator) and
``RouterActor`` (one per cluster). Both are plain classes here; ``cluster/serve.py`` turns them
into actors with ``ray.remote(...).options(...)`` (resources, names, ``max_restarts``).

A worker actor runs an engine (AsyncEngine, its store tiers) and its gRPC server (Inference,
KVTransfer, health, reflection) on a free port, and two threads:
- ``load``: measures the engine's load on the engine thread, between steps;
- ``publish``: every ``report_interval_s``, sends the block events gathered since the last
  call and the latest load to the router (``RouterActor.publish``). When the router does
  not know this worker (first start, a router restart, the worker was dropped) or has lost
  track of its stream, it registers again with a snapshot of its cached pages by tier.

The router actor runs ``router.service.RouterServer`` (its own thread and loop) and a health
thread that pings every registered worker actor; one that fails or does not answer within
``ping_timeout_s`` is dropped from routing and from the index. See docs/cluster.md.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import ray

from kvmesh.protos.security import BearerTokens, ClusterIdentity, TLSConfig
from kvmesh.protos.serving import DEFAULT_DEADLINE_S
from kvmesh.router.core import EventRow, RouterCore, encode_event
from kvmesh.router.load import WorkerLoad, to_report
from kvmesh.router.service import RouterServer

logger = logging.getLogger("kvmesh.cluster")


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("kvmesh").setLevel(level.upper())


# ---------------------------------------------------------------- worker


class _EventBuffer:
    """The engine's block events, gathered for the publisher.

    Called on the engine thread (device pages) and the store's threads (host and Redis
    pages); ``EventLog`` subscribers must be cheap and never raise. Bounded: if the router
    stays unreachable, the buffer is dropped and the overflow is remembered, and the worker
    resyncs with a snapshot once the router answers again.
    """

    def __init__(self, limit: int = 500_000) -> None:
        self.lock = threading.Lock()
        self.limit = limit
        self._rows: list[EventRow] = []
        self._overflowed = False
        self._from_seq = 0  # events older than the last snapshot are in it: dropped

    def __call__(self, ev) -> None:
        with self.lock:
            if ev.seq < self._from_seq:
                return
            if len(self._rows) >= self.limit:
                self._rows.clear()
                self._overflowed = True
            self._rows.append(encode_event(ev))

    def take(self) -> tuple[list[EventRow], bool]:
        with self.lock:
            rows, self._rows = self._rows, []
            over, self._overflowed = self._overflowed, False
        return rows, over

    def start_from(self, seq: int) -> None:
        """A snapshot covers every event numbered below ``seq``: forget those, keep the rest
        (a store thread may have numbered an event just before the snapshot was read and
        not yet delivered it, or just after)."""
        with self.lock:
            self._from_seq = seq
            self._rows = [r for r in self._rows if r[0] >= seq]
            self._overflowed = False


def metrics_port_for(host: str) -> int:
    """The worker actor's /metrics port: KVMESH_WORKER_METRICS_PORT, or, when that port
    cannot be bound here (several worker actors on one host share the env), any free port,
    with a warning naming the variable (a PodMonitor on the fixed port misses this one)."""
    import socket

    from kvmesh.worker import envs

    port = envs.worker_metrics_port()
    if port == 0:
        return 0
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            logger.warning(
                "KVMESH_WORKER_METRICS_PORT=%d cannot be bound on %s (%s): another worker "
                "on this host holds it? serving /metrics on a free port instead; run one "
                "worker actor per host (pod) for a fixed port",
                port,
                host,
                e.strerror or e,
            )
            return 0
    return port


class WorkerActor:
    """One engine, its gRPC server, and its reports to the router.

    ``engine_args`` go to ``LLMEngine``. The engine id is ``{name}-{random}``: a restarted
    actor is a new engine to the router (its index entry starts empty), while ``name`` stays
    the same, so the router replaces the old incarnation at once.
    """

    def __init__(
        self,
        name: str,
        router_name: str,
        engine_args: dict,
        *,
        num_threads: int = 1,
        grace_s: float = 10.0,
        report_interval_s: float = 0.25,
        call_timeout_s: float = 10.0,
        log_level: str = "INFO",
        metrics: bool = False,
        identity: ClusterIdentity | None = None,
        tls: TLSConfig | None = None,
        tokens: BearerTokens | None = None,
        default_deadline_s: float | None = DEFAULT_DEADLINE_S,
    ) -> None:
        import torch

        from kvmesh.worker.async_engine import AsyncEngine
        from kvmesh.worker.engine import LLMEngine
        from kvmesh.worker.server import WorkerServer

        _setup_logging(log_level)
        torch.set_num_threads(max(1, num_threads))  # Ray's CPU share, not the whole machine
        self.name = name
        # by name, not by handle: a handle among the constructor arguments would live in the
        # object store, and a restart would depend on it
        self.router_name = router_name
        self.router = None
        self.report_interval_s = report_interval_s
        self.call_timeout_s = call_timeout_s
        engine_args = dict(engine_args)
        peers = engine_args.pop("peers", None)
        if peers:  # static peers (page servers); tiers are built here, never pickled
            from kvmesh.kvstore.peer import PeerTier

            creds = tls.channel_credentials() if tls is not None else None
            engine_args["extra_tiers"] = [PeerTier(peers, identity=identity, credentials=creds)]
        # the cluster identity, for the peers the router names (docs/security.md)
        engine_args.update(peer_identity=identity, peer_tls=tls)
        engine = LLMEngine(engine_id=f"{name}-{uuid.uuid4().hex[:6]}", **engine_args)
        self.worker_id = engine.engine_id
        self.model_fp = engine.model_fp
        self.block_size = engine.cache_config.block_size
        # subscribe before anything is cached: the snapshot logic relies on every cached page
        # having been announced by a numbered event
        self.events = _EventBuffer()
        engine.events.subscribe(self.events)
        self._load: dict = self._measure(engine)  # before the engine thread owns it
        self.aeng = AsyncEngine(engine)
        ip = ray.util.get_node_ip_address()
        # KVTransfer serves the engine's device pages, then its host tier (EnginePageSource)
        # with ``metrics``, the engine's Prometheus /metrics on a free port of its own (the
        # router lists it in its discovery file)
        self.server = WorkerServer(
            self.aeng,
            host=ip,
            grace_s=grace_s,
            metrics_port=metrics_port_for(ip) if metrics else None,
            identity=identity,
            tokens=tokens,
            server_credentials=tls.server_credentials() if tls is not None and tls.serves else None,
            default_deadline_s=default_deadline_s,
        )
        self.server.start_in_thread()
        self.address = self.server.address
        self._stop = threading.Event()
        self._retiring = False
        self._router_id: str | None = None
        self._threads = [
            threading.Thread(target=self._load_loop, name="kvmesh-load", daemon=True),
            threading.Thread(target=self._publish_loop, name="kvmesh-publish", daemon=True),
        ]
        for t in self._threads:
            t.start()
        logger.info("worker %s (%s) serving on %s", self.worker_id, name, self.address)

    # ------------------------------------------------------------ actor methods

    def ready(self) -> dict:
        return {
            "name": self.name,
            "worker_id": self.worker_id,
            "address": self.address,
            "metrics_address": self.server.metrics_address,
        }

    def ping(self) -> str:
        """The router's health check; the engine id tells a restarted actor apart."""
        if self.aeng.error is not None:
            raise RuntimeError(f"the engine loop crashed: {self.aeng.error!r}")
        return self.worker_id

    def stats(self) -> dict:
        return dict(self._load)

    def reset_prefix_cache(self) -> int:
        """Drop every unused cached device page (they spill to the store tiers, if any).
        The removals reach the router as ordinary events."""
        from kvmesh.worker.engine import LLMEngine

        return self.aeng.call(LLMEngine.reset_prefix_cache, timeout=120)

    def shutdown(self, grace: float = 10.0, flush_timeout_s: float = 10.0) -> None:
        """Leave the router, drain the gRPC server for up to ``grace`` seconds, write the
        cache down to Redis (if configured; at most ``flush_timeout_s``, worker/flush.py),
        stop the engine. The caller then kills the actor."""
        from kvmesh.worker.flush import flush_to_shared

        self._stop.set()
        try:
            router = self.router or ray.get_actor(self.router_name)
            ray.get(router.unregister.remote(self.worker_id, "shutdown"), timeout=5)
        except Exception as e:  # the router may be gone already
            logger.info("unregister from the router failed: %r", e)
        self.server.stop_in_thread(grace=grace, timeout=grace + 30)
        self.aeng.shutdown()
        if flush_timeout_s > 0:
            flush_to_shared(self.aeng.engine, flush_timeout_s)
        self.aeng.engine.close()

    def retire(
        self, drain_timeout_s: float = 30.0, flush_timeout_s: float = 30.0, preserve: bool = True
    ) -> dict:
        """Leave the cluster for good, keeping the cache (cluster/autoscale.py). The router
        already routes nothing new here (``begin_retire``). Waits for the requests in flight
        (at most ``drain_timeout_s``), stops serving, writes the device and host pages down
        to Redis (``preserve``; at most ``flush_timeout_s``), reports those pages to the
        router in one last publish, and leaves the router, which keeps them credited. The
        caller then kills the actor. Returns the flush report plus ``drained`` (whether
        every request finished in time) and ``seconds``."""
        from kvmesh.worker.engine import LLMEngine
        from kvmesh.worker.flush import flush_to_shared

        t0 = time.monotonic()
        deadline = t0 + drain_timeout_s
        # sticky: a registration from here on says draining, and the publisher registers
        # no more (a router that dropped us keeps us out of routing)
        self._retiring = True
        busy = True
        while True:
            try:
                busy = self.aeng.call(LLMEngine.has_unfinished_requests, timeout=30)
            except Exception as e:  # the engine is gone: nothing to wait for
                logger.warning("retire: engine check failed: %r", e)
                busy = False
            if not busy or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        # what still runs past the bound is cancelled (the router routes it again when
        # nothing was streamed yet)
        self.server.stop_in_thread(grace=0.5, timeout=30)
        report: dict = {}
        if preserve:
            rep = self.aeng.call(
                lambda e: flush_to_shared(e, flush_timeout_s), timeout=flush_timeout_s + 60
            )
            report = rep.as_dict()
        # the publisher stops; its last batch (the flushed pages) goes from here, in order
        self._stop.set()
        for t in self._threads:
            t.join(self.call_timeout_s + 2)
        router = self.router or ray.get_actor(self.router_name)
        rows, overflowed = self.events.take()
        try:
            if not overflowed:
                ray.get(
                    router.publish.remote(self.worker_id, rows, self._load),
                    timeout=self.call_timeout_s,
                )
        except Exception as e:  # under-credit at worst: the pages are in Redis anyway
            logger.warning("retire: the last publish failed: %r", e)
        try:
            ray.get(
                router.unregister.remote(
                    self.worker_id, "retired by the autoscaler", preserve, True
                ),
                timeout=30,
            )
        except Exception as e:
            logger.warning("retire: unregister failed: %r", e)
        self.aeng.shutdown()
        self.aeng.engine.close()
        report.update(drained=not busy, seconds=round(time.monotonic() - t0, 3))
        logger.info("worker %s retired: %s", self.worker_id, report)
        return report

    # ------------------------------------------------------------ threads

    @staticmethod
    def _measure(engine) -> dict:
        return WorkerActor._report(engine.stats())

    @staticmethod
    def _report(stats) -> dict:
        """The load report the router parses (router/load.py), from an ``EngineStats``."""
        return to_report(WorkerLoad.from_stats(stats))

    def _load_loop(self) -> None:
        """Measure the load on the engine thread, between steps: during a long step the
        publisher re-sends the last measurement (its timestamp says how old it is)."""
        import os

        while not self._stop.is_set():
            if self.aeng.error is not None:
                # a dead engine loop serves nothing: exit so Ray restarts this actor
                logger.error("engine loop crashed (%r); exiting for a restart", self.aeng.error)
                os._exit(1)
            try:
                stats = self.aeng.last_stats  # after the latest step: no wait for the next
                if stats is not None:
                    self._load = self._report(stats)
                else:
                    self._load = self.aeng.call(self._measure, timeout=600)
            except Exception as e:  # shutting down, or the engine died (checked above)
                logger.debug("load measurement failed: %r", e)
            self._stop.wait(self.report_interval_s)

    def _snapshot(self, engine) -> tuple[int, dict[str, list[bytes]]]:
        """On the engine thread: the next event sequence number, then the cached pages by
        tier. In that order: the store's threads keep numbering host and Redis events
        meanwhile, and an event numbered after ``seq`` then reaches the router after the
        snapshot (a page stored twice, or removed, is exact), whereas the other order could
        lose a removal. Device events come from this thread only: none in between."""
        seq = engine.events.next_seq
        pages = engine.cached_pages_by_tier()
        self.events.start_from(seq)
        return seq, pages

    def _register(self) -> dict:
        seq, pages = self.aeng.call(self._snapshot, timeout=600)
        info = {
            "worker_id": self.worker_id,
            "name": self.name,
            "address": self.address,
            "model_fp": self.model_fp,
            "block_size": self.block_size,
            "next_seq": seq,
            "pages": pages,
            "load": self._load,
            "metrics_address": self.server.metrics_address,
            "draining": self._retiring,
        }
        me = ray.get_runtime_context().current_actor
        return ray.get(self.router.register.remote(info, me), timeout=self.call_timeout_s)

    def _publish_loop(self) -> None:
        need_register = True
        failing = False
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                if self.router is None:
                    self.router = ray.get_actor(self.router_name)
                if need_register and self._retiring:
                    # retiring: never come back as a worker to route to; retire() sends
                    # the last batch itself
                    self._stop.wait(self.report_interval_s)
                    continue
                if need_register:
                    reply = self._register()
                    logger.info("registered with router %s", reply["router_id"])
                    self._router_id = reply["router_id"]
                else:
                    rows, overflowed = self.events.take()
                    if overflowed:
                        need_register = True
                        continue
                    reply = ray.get(
                        self.router.publish.remote(self.worker_id, rows, self._load),
                        timeout=self.call_timeout_s,
                    )
                need_register = reply["router_id"] != self._router_id or reply["status"] != "ok"
                if need_register:
                    logger.info(
                        "router %s answered %s: registering again",
                        reply["router_id"],
                        reply["status"],
                    )
                if failing:
                    logger.info("router reachable again")
                failing = False
            except Exception as e:
                # unreachable, restarting, timed out or refused: whatever it applied, a fresh
                # registration makes its view exact again
                need_register = True
                self.router = None  # look it up again: it may have been replaced
                if not failing:
                    logger.warning("reporting to the router failed: %r", e)
                failing = True
                self._stop.wait(1.0)
                continue
            # a finished request changes the load the router routes by: report it at once
            # rather than up to an interval late (a stale "busy" sends the next request
            # with the same prefix elsewhere)
            if self.aeng.request_finished.wait(
                max(0.0, self.report_interval_s - (time.monotonic() - t0))
            ):
                self.aeng.request_finished.clear()
                if self.aeng.last_stats is not None:
                    self._load = self._report(self.aeng.last_stats)


# ---------------------------------------------------------------- router


class RouterActor:
    """The router: ``RouterServer`` on ``host:port`` plus a health thread over the workers.

    The tokenizer and model fingerprint come from ``model`` (the workers' model): text
    prompts are tokenized here and sent to the workers as token ids, so the page hashes the
    router computes are the ones the workers compute.
    """

    def __init__(
        self,
        model: str,
        *,
        host: str = "0.0.0.0",
        port: int = 50051,
        policy: str = "prefix_affinity",
        grace_s: float = 10.0,
        health_interval_s: float = 1.0,
        ping_timeout_s: float = 2.0,
        report_timeout_s: float = 4.0,
        seed: int | None = None,
        log_level: str = "INFO",
        metrics_port: int | None = None,
        prometheus_sd_file: str | None = None,
        http_port: int | None = None,
        identity: ClusterIdentity | None = None,
        tls: TLSConfig | None = None,
        tokens: BearerTokens | None = None,
        default_deadline_s: float | None = DEFAULT_DEADLINE_S,
    ) -> None:
        from kvmesh.worker.models.loader import model_fingerprint, resolve_model
        from kvmesh.worker.tokenizer import Tokenizer

        _setup_logging(log_level)
        src = resolve_model(model)
        fp = model_fingerprint(src)
        tok = Tokenizer.load(src, fp)
        self.core = RouterCore(
            model_fp=fp, policy=policy, report_timeout_s=report_timeout_s, seed=seed
        )
        self.server = RouterServer(
            self.core,
            tokenize=tok.encode if tok is not None else None,
            host=host,
            port=port,
            grace_s=grace_s,
            metrics_port=metrics_port,
            prometheus_sd_file=prometheus_sd_file,
            model_name=src.name,
            http_port=http_port,  # the OpenAI-compatible API (router/http_api.py)
            tokenizer=tok,
            identity=identity,
            tokens=tokens,
            tls=tls,
            default_deadline_s=default_deadline_s,
        )
        ip = ray.util.get_node_ip_address() if host in ("0.0.0.0", "::", "[::]") else host
        self.server.advertise_host = ip  # what the discovery file names
        self.server.start_in_thread()
        self.endpoint_address = f"{ip}:{self.server.port}"
        http = self.server.http
        self.http_address = f"{ip}:{http.port}" if http is not None else None
        self.health_interval_s = health_interval_s
        self.ping_timeout_s = ping_timeout_s
        self._handles: dict[str, object] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._health_loop, name="kvmesh-health", daemon=True).start()
        logger.info("router %s: endpoint %s", self.core.router_id, self.endpoint_address)

    # ------------------------------------------------------------ called by workers

    def register(self, info: dict, handle) -> dict:
        reply = self.server.call(self.server.register_worker, info)
        with self._lock:
            self._handles[str(info["worker_id"])] = handle
        return reply

    def publish(self, worker_id: str, rows: list, load: dict) -> dict:
        return self.server.call(self.core.publish, worker_id, rows, load)

    def unregister(
        self,
        worker_id: str,
        reason: str = "unregistered",
        keep_redis: bool = False,
        retired: bool = False,
    ) -> bool:
        with self._lock:
            self._handles.pop(worker_id, None)
        return self.server.call(
            lambda: self.core.remove_worker(
                worker_id, reason, keep_redis=keep_redis, retired=retired
            )
        )

    def in_flight(self, worker_id: str) -> int:
        """Requests the router has routed to a worker and not seen end."""
        return self.server.call(lambda: self.core.inflight.of(worker_id).requests)

    # ------------------------------------------------------------ autoscaling

    def autoscale_view(self, look_back_s: float = 30.0) -> dict:
        return self.server.call(self.core.autoscale_view, look_back_s)

    def retire_candidate(self) -> dict | None:
        return self.server.call(self.core.retire_candidate)

    def begin_retire(self, worker_id: str) -> bool:
        return self.server.call(self.core.begin_retire, worker_id)

    def record_scaling(self, decision: dict) -> None:
        self.server.call(self.core.record_scaling, decision)

    def set_autoscale_config(self, cfg: dict | None) -> None:
        def apply() -> None:
            self.core.autoscale_config = cfg

        self.server.call(apply)

    # ------------------------------------------------------------ operations

    def endpoint(self) -> str:
        return self.endpoint_address

    def http_endpoint(self) -> str | None:
        """host:port of the OpenAI-compatible HTTP API (None: not served)."""
        return self.http_address

    def metrics_address(self) -> str | None:
        """host:port of the router's Prometheus /metrics (None: not served)."""
        return self.server.metrics_address

    def ping(self) -> str:
        return self.core.router_id

    def set_policy(self, name: str) -> str:
        return self.server.call(self.core.set_policy, name)

    def stats(self) -> dict:
        return self.server.call(self.core.stats)

    def drain(self, grace: float = 10.0) -> None:
        """Stop serving: new requests get UNAVAILABLE, in-flight ones get ``grace`` s."""
        self._stop.set()
        self.server.stop_in_thread(grace=grace, timeout=grace + 30)

    # ------------------------------------------------------------ health

    def _health_loop(self) -> None:
        """Ping every registered worker actor. A dead actor fails at once; one restarting or
        hung does not answer within ``ping_timeout_s``; a restarted one answers with a new
        engine id. Each is dropped (a live one registers again on its next publish)."""
        while not self._stop.wait(self.health_interval_s):
            with self._lock:
                handles = dict(self._handles)
            if not handles:
                continue
            refs = {h.ping.remote(): wid for wid, h in handles.items()}
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=self.ping_timeout_s)
            ready_set = set(ready)
            for ref, wid in refs.items():
                reason = None
                if ref not in ready_set:
                    reason = f"no answer to a health ping within {self.ping_timeout_s:.1f}s"
                else:
                    try:
                        answer = ray.get(ref)
                        if answer != wid:
                            reason = f"the actor restarted (now engine {answer})"
                    except Exception as e:
                        reason = f"health ping failed: {type(e).__name__}"
                try:
                    if reason is None:
                        self.server.call(self.core.heard_from, wid)
                    else:
                        with self._lock:
                            self._handles.pop(wid, None)
                        self.server.call(self.core.remove_worker, wid, reason, dead=True)
                except Exception:  # the server is stopping
                    return
