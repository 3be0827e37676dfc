"""The worker's gRPC server: ``Inference`` over one AsyncEngine (``inference_servicer``) and
``KVTransfer`` over a PageSource (``kvstore.peer.servicer``), plus grpc.health.v1 and server
reflection, on ``grpc.aio`` with uvloop; beside them the raw-TCP page data plane
(``kvstore.dataplane``) that ``KVTransfer.DataPlane`` names. Draining and the loop of its own
are ``protos.serving``'s, as for the router.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from functools import partial

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmesh.kvstore.dataplane import DataPlaneServer
from kvmesh.kvstore.peer import PageSource, TierPageSource
from kvmesh.kvstore.peer.servicer import KVTransferServicer
from kvmesh.protos.kvmesh.v1 import inference_pb2 as ipb
from kvmesh.protos.kvmesh.v1 import inference_pb2_grpc as ipb_grpc
from kvmesh.protos.kvmesh.v1 import kv_transfer_pb2 as kpb
from kvmesh.protos.kvmesh.v1 import kv_transfer_pb2_grpc as kpb_grpc
from kvmesh.protos.security import (
    AccessPolicy,
    AuthInterceptor,
    BearerTokens,
    ClusterIdentity,
    TLSConfig,
)
from kvmesh.protos.serving import DEFAULT_DEADLINE_S, Drain, Lifecycle, ServerThread, aio_server
from kvmesh.worker.async_engine import AsyncEngine
from kvmesh.worker.engine import LLMEngine
from kvmesh.worker.flush import DEFAULT_FLUSH_TIMEOUT_S, flush_to_shared
from kvmesh.worker.inference_servicer import InferenceServicer

logger = logging.getLogger("kvmesh.server")

# what only cluster members may call (docs/security.md): every KVTransfer method, and the
# load (it tells whether someone's prefix is cached)
CLUSTER_ONLY_METHODS = ("/kvmesh.v1.KVTransfer/", "/kvmesh.v1.Inference/GetLoad")

__all__ = [
    "InferenceServicer",
    "KVTransferServicer",
    "PageSource",
    "TierPageSource",
    "WorkerServer",
    "serve_worker",
]


class WorkerServer:
    """One worker's gRPC server: ``Inference`` over ``engine`` (omitted when it is None: a
    page server only), ``KVTransfer`` over ``page_source``, health and reflection.

    ``engine`` may be an AsyncEngine (shared; the caller shuts it down) or an LLMEngine (the
    server drives it with its own AsyncEngine and shuts that down on ``stop``).

    The page data plane (raw TCP on ``host``, ``data_plane_port``; 0 = any free port) serves
    the same PageSource as ``Fetch``, several times faster. ``data_plane=None`` (default)
    runs it unless the gRPC port uses TLS (``server_credentials``): its bytes are not
    encrypted, and its token only proves that a client could reach the gRPC service, so a
    TLS deployment gets it only when ``data_plane=True`` says so. ``False``: never. Without
    a page source there is nothing to serve and no data plane.
    Use ``await start()`` / ``await stop()`` in a running loop, or ``start_in_thread()`` /
    ``stop_in_thread()`` to run it on a uvloop loop of its own.

    Access (docs/security.md): ``identity`` is the cluster's secret. ``KVTransfer``,
    ``GetLoad`` and a ``Generate`` that names ``peer_addresses`` need it (UNAUTHENTICATED,
    PERMISSION_DENIED otherwise); without one, they are refused to everyone and there is
    no data plane. ``tokens``: when set, the client methods (``Generate``, ``Abort``,
    ``GetModelInfo``) need one of them (or the cluster identity); health and reflection
    stay open. ``default_deadline_s`` caps how long a ``Generate`` runs (its own deadline,
    when shorter, wins). ``tls``: the process's TLS material; when it serves, the gRPC port
    (``server_credentials`` defaults to its) and the HTTP port serve TLS with it.

    The HTTP API (``http_port``) has the same door as gRPC: ``tokens`` on every path but
    ``GET /health`` (``/metrics`` included), TLS (mutual when ``tls.client_ca`` is set),
    bodies of at most ``max_message_mb``, and ``default_deadline_s`` per request (504).
    """

    def __init__(
        self,
        engine: AsyncEngine | LLMEngine | None = None,
        *,
        page_source: PageSource | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        max_message_mb: int = 64,
        grace_s: float = 10.0,
        own_engine: bool | None = None,
        data_plane: bool | None = None,
        data_plane_port: int = 0,
        http_port: int | None = None,
        server_credentials: grpc.ServerCredentials | None = None,
        metrics_port: int | None = None,
        identity: ClusterIdentity | None = None,
        tokens: BearerTokens | None = None,
        default_deadline_s: float | None = DEFAULT_DEADLINE_S,
        tls: TLSConfig | None = None,
    ) -> None:
        if tls is not None and tls.serves and server_credentials is None:
            server_credentials = tls.server_credentials()
        if default_deadline_s is not None and not default_deadline_s > 0:
            raise ValueError(f"default_deadline_s must be > 0 or None, got {default_deadline_s}")
        if not 0 <= data_plane_port < 65536:
            raise ValueError(f"data_plane_port must be in [0, 65535], got {data_plane_port}")
        if max_message_mb < 1:
            raise ValueError(f"max_message_mb must be >= 1, got {max_message_mb}")
        if grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s}")
        if isinstance(engine, LLMEngine):
            engine, own = AsyncEngine(engine), True
        else:
            own = False
        self.engine: AsyncEngine | None = engine
        self.own_engine = own if own_engine is None else own_engine
        if page_source is None and engine is not None:
            from kvmesh.worker.page_source import EnginePageSource

            page_source = EnginePageSource(engine)  # device pages, then the host tier
        self.page_source = page_source
        if data_plane is None:
            data_plane = server_credentials is None
        self.identity = identity
        self.tokens = tokens
        self.default_deadline_s = default_deadline_s
        # the data plane authenticates with a key derived from the cluster secret
        self.data_plane_enabled = data_plane and page_source is not None and identity is not None
        self.data_plane_port = data_plane_port
        self.data_plane: DataPlaneServer | None = None
        self.server_credentials = server_credentials
        self.host = host
        self.port = port
        self.max_message_mb = max_message_mb
        self.grace_s = grace_s
        self.health = None
        self._server: grpc.aio.Server | None = None
        self._life = Lifecycle()
        self._drain = Drain()
        self._stopped: asyncio.Event | None = None
        self._thread = ServerThread("kvmesh-grpc")
        self.inference: InferenceServicer | None = None
        # the OpenAI-compatible HTTP API (worker/http_api.py) on http_port (0: a free one),
        # same host and loop as gRPC; built now so routes can be added before start()
        self.http_app = None
        self.http = None
        if http_port is not None and engine is not None:
            from kvmesh.protos.openai_app import HttpServer
            from kvmesh.worker.http_api import build_worker_app

            # the same tokens, message limit and deadline as gRPC; TLS when ``tls`` serves
            self.http_app = build_worker_app(
                engine,
                self._life,
                tokens=tokens,
                max_body_bytes=max_message_mb * 2**20,
                deadline_s=default_deadline_s,
            )
            self.http = HttpServer(self.http_app, host, http_port, tls=tls)
            if engine.engine.metrics is not None:  # the HTTP port serves /metrics too
                from kvmesh.protos.metrics import add_metrics_route

                add_metrics_route(self.http_app, engine.engine.metrics.registry)
        # Prometheus /metrics of the engine on its own HTTP port (None: not served; 0: any
        # free port), on the same host as gRPC
        if metrics_port is not None and not 0 <= metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535], got {metrics_port}")
        self.metrics_port = metrics_port
        self.metrics_server = None

    @property
    def address(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "[::]", "::") else self.host
        return f"{host}:{self.port}"

    @property
    def worker_id(self) -> str | None:
        return self.engine.engine.engine_id if self.engine is not None else None

    @property
    def metrics_address(self) -> str | None:
        """host:port of the engine's /metrics, while served."""
        return self.metrics_server.address if self.metrics_server is not None else None

    def _start_metrics(self) -> None:
        eng = self.engine.engine if self.engine is not None else None
        if self.metrics_port is None or eng is None or eng.metrics is None:
            return
        from kvmesh.protos.metrics import serve_metrics

        self.metrics_server = serve_metrics(eng.metrics.registry, self.host, self.metrics_port)
        self.metrics_port = self.metrics_server.port

    async def start(self) -> int:
        """Bind and start serving; returns the bound port. When any part fails to start (a
        port taken), what had started is stopped again before the error is raised."""
        policy = AccessPolicy(self.identity, self.tokens, CLUSTER_ONLY_METHODS)
        server = aio_server(self.max_message_mb, [AuthInterceptor(policy)])
        asked = (self.port, self.data_plane_port, self.metrics_port)
        try:
            port, names = await self._start_parts(server)
        except BaseException:
            await self._undo_start(server)
            self.port, self.data_plane_port, self.metrics_port = asked
            raise
        if self.engine is not None:
            self._watch_engine()
        services, where = ", ".join(names), f"{self.host}:{port}"
        dp = f", page data plane on port {self.data_plane_port}" if self.data_plane else ""
        auth = f"cluster {self.identity.fingerprint}" if self.identity else "no cluster secret"
        auth += ", TLS" if self.server_credentials is not None else ", plaintext"
        auth += f", {len(self.tokens)} client tokens" if self.tokens else ""
        logger.info("worker %s serving %s on %s%s (%s)", self.worker_id, services, where, dp, auth)
        return port

    async def _start_parts(self, server: grpc.aio.Server) -> tuple[int, list[str]]:
        """Metrics, the data plane, gRPC, HTTP, in that order; the gRPC port and the
        services it serves."""
        self._start_metrics()
        names = [kpb.DESCRIPTOR.services_by_name["KVTransfer"].full_name]
        if self.engine is not None:
            self.inference = InferenceServicer(
                self.engine, self._life, identity=self.identity, deadline_s=self.default_deadline_s
            )
            ipb_grpc.add_InferenceServicer_to_server(self.inference, server)
            names.append(ipb.DESCRIPTOR.services_by_name["Inference"].full_name)
        if self.data_plane_enabled:
            self.data_plane = DataPlaneServer(
                self.page_source,
                self.host,
                self.data_plane_port,
                key=self.identity.data_plane_key,
            )
            self.data_plane_port = await asyncio.to_thread(self.data_plane.start)
        port = await self._start_grpc(server, names)
        self._server = server
        self._stopped = asyncio.Event()
        if self.http is not None:
            await self.http.start()
            if self.server_credentials is not None and self.http.ssl is None:
                logger.warning(
                    "the HTTP API on port %d is plaintext beside a TLS gRPC port (pass "
                    "tls=TLSConfig to serve it with TLS too)",
                    self.http.port,
                )
        return port, names

    async def _undo_start(self, server: grpc.aio.Server) -> None:
        """Stop whatever ``_start_parts`` started (each stop is a no-op for a part that did
        not start), so that a failed start leaves no port bound and no thread running."""
        if self.http is not None:
            await self.http.stop()
        await server.stop(None)
        self._server = self._stopped = None
        if self.data_plane is not None:
            await asyncio.to_thread(self.data_plane.stop)
            self.data_plane = None
        if self.metrics_server is not None:
            await asyncio.to_thread(self.metrics_server.stop)
            self.metrics_server = None

    def _watch_engine(self) -> None:
        """A dead engine loop turns health NOT_SERVING (for the whole server, Inference, and
        KVTransfer when it serves the engine's pages): a standalone worker cannot serve again
        until it is restarted."""
        from kvmesh.worker.page_source import EnginePageSource

        loop = asyncio.get_running_loop()
        health_servicer = self.health
        to_mark = ["", ipb.DESCRIPTOR.services_by_name["Inference"].full_name]
        if isinstance(self.page_source, EnginePageSource):  # its reads go through the engine
            to_mark.append(kpb.DESCRIPTOR.services_by_name["KVTransfer"].full_name)

        async def mark(error: BaseException) -> None:
            logger.error("worker %s: the engine loop died (%r): NOT_SERVING", self.worker_id, error)
            for name in to_mark:
                await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

        def on_death(error: BaseException) -> None:  # on the engine thread
            try:
                asyncio.run_coroutine_threadsafe(mark(error), loop)
            except RuntimeError:  # the server's loop is gone: nothing left to mark
                pass

        self.engine.on_death(on_death)

    async def _start_grpc(self, server: grpc.aio.Server, names: list[str]) -> int:
        """Add KVTransfer, health and reflection to ``server``, bind and start it."""
        kpb_grpc.add_KVTransferServicer_to_server(
            KVTransferServicer(self.page_source, self._life, self.data_plane), server
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        for name in names:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        names.append(health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
        reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], server)
        target = f"{self.host}:{self.port}"
        try:
            if self.server_credentials is not None:
                port = server.add_secure_port(target, self.server_credentials)
            else:
                port = server.add_insecure_port(target)
        except RuntimeError as e:  # grpc's "Failed to bind to address"
            raise OSError(f"cannot bind gRPC {target}: {e}") from None
        if port == 0:
            raise OSError(f"cannot bind gRPC {target}")
        self.port = port
        await server.start()
        return port

    async def stop(self, grace: float | None = None) -> None:
        """Drain and stop: health turns NOT_SERVING, new calls are refused with UNAVAILABLE,
        in-flight streams get up to ``grace`` seconds (default ``grace_s``) to finish, then
        are cancelled (which aborts their requests and frees their pages).

        Idempotent; a later call with a shorter grace (a second SIGTERM) ends the drain
        sooner. Returns when the server has stopped."""
        if self._server is None:
            return
        await self._drain.stop(self.grace_s if grace is None else grace, self._drain_and_stop)

    async def _drain_and_stop(self) -> None:
        self._life.draining = True
        dp = self.data_plane
        if dp is not None:
            dp.draining = True  # requests in flight finish; new ones are refused
        await self.health.enter_graceful_shutdown()
        logger.info(
            "worker %s draining: %d in-flight calls, grace %.1fs",
            self.worker_id,
            len(self._life.inflight),
            self._drain.left(),
        )
        # The servicers refuse new work while the in-flight streams (and data-plane
        # requests) finish; our own streams decide when the grace ends early (an open health
        # Watch must not hold it). Then one grpc stop cancels what is left.
        await self._drain.wait_for(self._life.inflight, busy=lambda: dp is not None and dp.busy > 0)
        if dp is not None:
            await asyncio.to_thread(dp.stop)  # what is still in flight ends: clients see misses
        if self.http is not None:
            await self.http.stop()  # its requests were drained with the gRPC ones
            self.http_app.state.backend.release()
        await self._server.stop(None)
        if self.metrics_server is not None:
            await asyncio.to_thread(self.metrics_server.stop)
            self.metrics_server = None
        if self.own_engine and self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)
        self._stopped.set()
        logger.info("worker %s stopped", self.worker_id)

    async def wait_for_termination(self) -> None:
        if self._stopped is not None:
            await self._stopped.wait()

    # ------------------------------------------------------------ a loop of its own

    def start_in_thread(self) -> int:
        """Serve from a background thread with its own uvloop event loop; returns the port."""
        return self._thread.start(self.start, self.wait_for_termination)

    def stop_in_thread(self, grace: float | None = None, timeout: float = 60.0) -> None:
        self._thread.stop(partial(self.stop, grace), timeout)


def serve_worker(
    model: str | None = None,
    *,
    port: int = 50051,
    host: str = "0.0.0.0",
    max_message_mb: int = 64,
    grace_s: float = 10.0,
    page_source: PageSource | None = None,
    data_plane: bool | None = None,
    data_plane_port: int = 0,
    http_port: int | None = None,
    metrics_port: int | None = None,
    identity: ClusterIdentity | None = None,
    tokens: BearerTokens | None = None,
    tls: TLSConfig | None = None,
    default_deadline_s: float | None = DEFAULT_DEADLINE_S,
    flush_timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S,
    **engine_args,
) -> None:
    """Load the model, serve until SIGTERM/SIGINT, drain, flush, exit (``kvmesh worker``).

    A first signal drains for up to ``grace_s`` seconds; a second one stops at once. Then,
    with a Redis tier, the cached pages are written down to Redis for at most
    ``flush_timeout_s`` seconds (0: no flush).
    """
    import uvloop

    if model is not None:
        engine_args["model"] = model
    engine_args.setdefault("peer_identity", identity)  # for the peers a router names
    engine_args.setdefault("peer_tls", tls)
    engine = LLMEngine(**engine_args)  # the slow part, before the loop starts
    server = WorkerServer(
        engine,
        page_source=page_source,
        host=host,
        port=port,
        max_message_mb=max_message_mb,
        grace_s=grace_s,
        data_plane=data_plane,
        data_plane_port=data_plane_port,
        http_port=http_port,
        metrics_port=metrics_port,
        tls=tls,
        identity=identity,
        tokens=tokens,
        default_deadline_s=default_deadline_s,
    )

    async def main() -> None:
        await server.start()
        loop = asyncio.get_running_loop()
        signals = 0
        stopping: list[asyncio.Task] = []

        def on_signal(sig: signal.Signals) -> None:
            nonlocal signals
            signals += 1
            if signals == 1:
                logger.info("%s: draining (again to stop now)", sig.name)
                stopping.append(asyncio.ensure_future(server.stop()))
            else:
                logger.info("%s: stopping now", sig.name)
                stopping.append(asyncio.ensure_future(server.stop(0)))

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        await server.wait_for_termination()
        await asyncio.gather(*stopping)

    uvloop.run(main())
    # the engine loop has stopped: write the cache down to Redis, bounded (worker/flush.py),
    # so a rolling restart loses nothing Redis can hold
    if flush_timeout_s > 0:
        flush_to_shared(engine, flush_timeout_s)
    engine.close()
