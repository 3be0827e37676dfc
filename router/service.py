"""The router service: the client-facing ``Inference`` gRPC service in front of the workers.

Generate: tokenize (text prompts) -> page hashes (``kvstore.hashing.hash_pages``, exactly as
the workers hash, salted with the request's ``cache_salt``) -> ``RouterCore.assign``
(router/core.py: match, pick, optimistic insert, count in flight) -> the request, as token
ids, to the chosen worker's ``Inference.Generate``, whose responses stream back unchanged: the
final one names the worker and the cached tokens by tier. The first streamed token and the end
of the stream are told to the core (``first_token``, ``release``), so the load it routes by
includes what it has just routed.

``RouterServer`` is the grpc.aio server (Inference, health, reflection) and the channels to
the workers, over a ``RouterCore``. ``call`` runs a core method from another thread (the Ray
actor shell in ``cluster/actors.py`` feeds ``register`` and ``publish`` through it).

Failures: a worker not heard from for ``report_timeout_s`` is dropped (the Ray shell also
pings the actors). A worker whose Generate fails with UNAVAILABLE is dropped at once; when
no token has been streamed yet, the request is routed again among the others, else the
client's stream ends with UNAVAILABLE. A dropped worker that is alive is told to register
on its next publish.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmesh.kvstore.hashing import hash_pages
from kvmesh.protos.kvmesh.v1 import inference_pb2 as ipb
from kvmesh.protos.kvmesh.v1 import inference_pb2_grpc as ipb_grpc
from kvmesh.protos.security import (
    AccessPolicy,
    AuthInterceptor,
    BearerTokens,
    ClusterIdentity,
    TLSConfig,
)
from kvmesh.protos.serving import (
    DEFAULT_DEADLINE_S,
    KEEPALIVE_TIME_S,
    KEEPALIVE_TIMEOUT_S,
    Drain,
    Lifecycle,
    ServerThread,
    aio_server,
    call_in_loop,
    channel_options,
)
from kvmesh.router.core import EventRow, RouterCore, decode_events, encode_event
from kvmesh.router.load import to_proto
from kvmesh.router.policies import NoWorkerError

if TYPE_CHECKING:
    from kvmesh.protos.openai_app import Tokenizer

logger = logging.getLogger("kvmesh.router")

# RouterCore and the event wire format live in router/core.py; their names stay importable
# from here for the code that imported them from the service.
__all__ = [
    "SESSION_METADATA_KEY",
    "EventRow",
    "RouterCore",
    "RouterServer",
    "decode_events",
    "encode_event",
]

SESSION_METADATA_KEY = "kvmesh-session"  # gRPC metadata: sticky-session key for the policy


# ---------------------------------------------------------------- the gRPC service

_INFERENCE = ipb.DESCRIPTOR.services_by_name["Inference"].full_name
_MAX_ATTEMPTS = 3  # workers tried for one request while nothing has been streamed
# what only cluster members may call here: the load (aggregate prefix-cache hits tell
# whether someone sent a prefix)
ROUTER_CLUSTER_ONLY = ("/kvmesh.v1.Inference/GetLoad",)


def _cancelled_from_outside() -> bool:
    """Whether the running task itself is being cancelled (the client left, the server is
    stopping), as opposed to a call it awaits having been cancelled under it."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class RouteError(Exception):
    """A routed request that cannot run or failed: the gRPC status it ends with (the HTTP
    front door maps it to its own)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class RouterServicer(ipb_grpc.InferenceServicer):
    def __init__(self, server: RouterServer) -> None:
        self.srv = server
        self.core = server.core
        self.active = server.active  # request id -> the worker running it

    async def Generate(
        self, request: ipb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ipb.GenerateResponse]:
        if self.srv.life.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the router is shutting down")
        ids = await self._token_ids(request, context)
        session = dict(context.invocation_metadata() or ()).get(SESSION_METADATA_KEY)
        stream = self.srv.route(
            ids,
            request.sampling,
            request.request_id,
            session=session,
            timeout=context.time_remaining(),
        )
        try:
            async for msg in stream:
                yield msg
        except RouteError as e:
            await context.abort(e.code, e.details)
        finally:
            await stream.aclose()  # the client gone: cancels the worker's call

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
            return await self.srv.stub(wid).Abort(request, timeout=10, metadata=self.srv.member_md)
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), f"worker {wid}: {e.details()}")

    async def GetModelInfo(
        self, request: ipb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> ipb.ModelInfo:
        for wid in list(self.core.workers):  # any live worker: they all serve one model
            try:
                return await self.srv.stub(wid).GetModelInfo(
                    request, timeout=10, metadata=self.srv.member_md
                )
            except grpc.aio.AioRpcError as e:
                logger.warning("GetModelInfo from %s failed: %s", wid, e.code().name)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is available")

    async def GetLoad(self, request: ipb.GetLoadRequest, context) -> ipb.Load:
        return to_proto(self.core.aggregate_load(), f"router-{self.core.router_id}")


class RouterServer:
    """The router's gRPC server (Inference, health, reflection) over a ``RouterCore``.

    ``tokenize`` turns a text prompt into token ids exactly as the workers' engines do; None
    accepts token-id prompts only. Health is SERVING while at least one worker is live.
    Use ``start_in_thread()`` / ``stop_in_thread()`` to run it on a uvloop loop of its own,
    and ``call(fn, ...)`` to run a core method on that loop from another thread.

    Access and liveness (docs/security.md): ``identity`` (the cluster secret) goes with
    every call to a worker (workers take ``peer_addresses`` only from a member) and is what
    ``GetLoad`` here needs; ``tokens``, when set, are what the client methods need;
    ``tls`` serves the client port with TLS (``cert``/``key``/``client_ca``) and reaches
    the workers with its ``ca`` (and, under mutual TLS, its certificate). Each routed call
    ends after ``default_deadline_s`` unless the client's deadline is sooner; the channels
    to the workers ping every ``keepalive_s`` (a frozen worker host fails its calls with
    UNAVAILABLE after ``keepalive_timeout_s``), and a worker dropped as dead
    (``RouterCore.remove_worker(..., dead=True)``) has its calls in flight cut: a client
    that had tokens gets UNAVAILABLE at once, one that had none is routed again.
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
        http_port: int | None = None,
        tokenizer: Tokenizer | None = None,
        metrics_port: int | None = None,
        prometheus_sd_file: str | None = None,
        model_name: str = "",
        identity: ClusterIdentity | None = None,
        tokens: BearerTokens | None = None,
        tls: TLSConfig | None = None,
        default_deadline_s: float | None = DEFAULT_DEADLINE_S,
        keepalive_s: float = KEEPALIVE_TIME_S,
        keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S,
    ) -> None:
        if default_deadline_s is not None and not default_deadline_s > 0:
            raise ValueError(f"default_deadline_s must be > 0 or None, got {default_deadline_s}")
        self.identity = identity
        self.tokens = tokens
        self.tls = tls
        self.default_deadline_s = default_deadline_s
        self.member_md = identity.metadata() if identity is not None else None
        self._channel_options = channel_options(max_message_mb, keepalive_s, keepalive_timeout_s)
        self._calls: dict[str, dict[str, grpc.aio.Call]] = {}  # worker -> request id -> call
        self._cut: dict[str, str] = {}  # request id -> why its worker's call was cut
        if max_message_mb < 1:  # checked now, not when the server starts
            raise ValueError(f"max_message_mb must be >= 1, got {max_message_mb}")
        if metrics_port is not None and not 0 <= metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535], got {metrics_port}")
        if prometheus_sd_file:
            import os

            folder = os.path.dirname(os.path.abspath(prometheus_sd_file))
            if not os.path.isdir(folder):
                raise ValueError(
                    f"prometheus_sd_file {prometheus_sd_file!r}: no such directory {folder!r}"
                )
        self.core = core
        self.tokenize = tokenize
        self.host, self.port = host, port
        self.max_message_mb = max_message_mb
        self.grace_s = grace_s
        self.housekeeping_s = housekeeping_s
        self.life = Lifecycle()  # draining flag and streams in flight, with the servicer
        self.active: dict[str, str | None] = {}  # request id -> the worker running it
        # the OpenAI-compatible HTTP API (router/http_api.py) on http_port (0: a free one),
        # on this server's loop; ``tokenizer`` (encode, decode, chat template) is the
        # workers' model's. Built now so routes can be added before start().
        self.http_app = self.http = None
        if http_port is not None:
            from kvmesh.protos.openai_app import HttpServer
            from kvmesh.router.http_api import build_router_app

            # the client port's door: its tokens, TLS and message limit
            self.http_app = build_router_app(
                self,
                model_name or "kvmesh",
                tokenizer,
                tokens=tokens,
                max_body_bytes=max_message_mb * 2**20,
            )
            self.http = HttpServer(self.http_app, host, http_port, tls=tls)
        self._channels: dict[str, tuple[str, grpc.aio.Channel, ipb_grpc.InferenceStub]] = {}
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._serving: bool | None = None
        self._tasks: list[asyncio.Task] = []
        self._health_task: asyncio.Task | None = None  # the last register_worker's update
        self._stopped: asyncio.Event | None = None
        self._drain = Drain()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = ServerThread("kvmesh-router")
        # Prometheus: the core's metrics (router/metrics.py) on their own HTTP port (None: not
        # served; 0: any free port), and the file-based discovery file listing that port and
        # every live worker's /metrics (rewritten by housekeeping when the list changes)
        from kvmesh.router.metrics import RouterMetrics

        self.metrics = RouterMetrics(core, model_name=model_name, run=self._run_on_loop)
        core.metrics = self.metrics
        core.on_dead.append(self._cut_calls)  # after every check: a refused one leaves none
        self.metrics_port = metrics_port
        self.metrics_server = None
        self.prometheus_sd_file = prometheus_sd_file
        self.advertise_host: str | None = None  # the host others reach this one at
        self._sd_written: list | None = None
        if self.http_app is not None:  # the HTTP API's port serves /metrics too
            from kvmesh.protos.metrics import add_metrics_route

            add_metrics_route(self.http_app, self.metrics.registry)

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
            if self.tls is not None:
                creds = self.tls.channel_credentials()
                ch = grpc.aio.secure_channel(addr, creds, options=self._channel_options)
            else:
                ch = grpc.aio.insecure_channel(addr, options=self._channel_options)
            entry = (addr, ch, ipb_grpc.InferenceStub(ch))
            self._channels[worker_id] = entry
        return entry[2]

    async def route(
        self,
        ids: list[int],
        sampling: ipb.SamplingParams,
        request_id: str = "",
        *,
        session: str | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[ipb.GenerateResponse]:
        """Route one request (token ids) and stream the chosen worker's responses: page
        hashes (salted with ``sampling.cache_salt``) -> ``RouterCore.assign`` -> the worker's
        Generate, routed again among the others while nothing has been streamed when a worker
        is UNAVAILABLE. gRPC Generate and the HTTP API both come through here. Raises
        RouteError; closing the iterator early cancels the worker's call (which aborts the
        request there)."""
        if self.life.draining:
            raise RouteError(grpc.StatusCode.UNAVAILABLE, "the router is shutting down")
        if self.default_deadline_s is not None:  # a call with no deadline must still end
            timeout = min(timeout or self.default_deadline_s, self.default_deadline_s)
        core = self.core
        if core.block_size is None:  # no worker has ever registered
            raise RouteError(grpc.StatusCode.UNAVAILABLE, "no worker is available")
        try:
            # salted exactly as the worker salts them: a tenant's pages match only its own
            salt = sampling.cache_salt or None
            hashes = hash_pages(ids, core.block_size, core.model_fp, cache_salt=salt)
        except ValueError as e:  # a token id outside uint32
            raise RouteError(grpc.StatusCode.INVALID_ARGUMENT, f"bad token ids: {e}") from None
        rid = request_id or uuid.uuid4().hex
        if rid in self.active:
            raise RouteError(
                grpc.StatusCode.INVALID_ARGUMENT, f"request id {rid!r} is already in use"
            )
        fwd = ipb.GenerateRequest(
            token_ids=ipb.TokenIds(ids=ids), sampling=sampling, request_id=rid
        )
        self.active[rid] = None
        # an HTTP stream awaits its first token in the handler's task, the rest elsewhere
        inflight = self.life.enter()
        tried: list[str] = []
        sent = False
        code = details = None
        try:
            while code is None:
                try:
                    decision = core.assign(rid, ids, hashes, exclude=tried, session_key=session)
                except NoWorkerError as e:
                    code, details = grpc.StatusCode.UNAVAILABLE, str(e)
                    break
                wid = decision.worker_id
                self.active[rid] = wid
                del fwd.peer_addresses[:]
                fwd.peer_addresses.extend(core.peers_for(decision))
                call = self.stub(wid).Generate(fwd, timeout=timeout, metadata=self.member_md)
                self._calls.setdefault(wid, {})[rid] = call
                try:
                    async for msg in call:
                        if not sent:
                            core.first_token(rid)  # the prefill is done
                        sent = True
                        yield msg
                    return
                except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
                    if isinstance(e, asyncio.CancelledError) and _cancelled_from_outside():
                        raise  # the client left (or the server stops): not the worker's doing
                    cut = self._cut.pop(rid, None)  # the worker was dropped as dead
                    if cut is not None:
                        err_code, err = grpc.StatusCode.UNAVAILABLE, f"dropped as dead: {cut}"
                    elif isinstance(e, asyncio.CancelledError):  # its channel went away
                        err_code, err = grpc.StatusCode.UNAVAILABLE, "the call was cancelled"
                    else:
                        err_code, err = e.code(), e.details()
                    if err_code != grpc.StatusCode.UNAVAILABLE:
                        code, details = err_code, err  # the worker's verdict stands
                        break
                    if cut is None:
                        core.remove_worker(wid, f"Generate failed: UNAVAILABLE {err}")
                    tried.append(wid)
                    if sent or len(tried) >= _MAX_ATTEMPTS:
                        code = grpc.StatusCode.UNAVAILABLE
                        details = f"worker {wid} failed: {err}"
                        break
                    core.retries += 1
                    logger.warning("request %s: worker %s unavailable, routing again", rid, wid)
                finally:
                    self._calls.get(wid, {}).pop(rid, None)
                    self._cut.pop(rid, None)
                    call.cancel()  # a no-op once ended; else (client gone) aborts on the worker
        finally:
            core.release(rid)
            self.active.pop(rid, None)
            self.life.leave(inflight)
        raise RouteError(code, details)

    def _cut_calls(self, worker_id: str, reason: str) -> None:
        """``RouterCore.on_dead``: cancel the calls in flight to a worker dropped as dead;
        ``route`` sees each end and answers UNAVAILABLE (or routes it again)."""
        calls = self._calls.pop(worker_id, {})
        for rid, call in calls.items():
            self._cut[rid] = reason
            call.cancel()
        if calls:
            logger.warning(
                "worker %s dropped (%s): cut %d calls in flight", worker_id, reason, len(calls)
            )

    @property
    def metrics_address(self) -> str | None:
        """host:port of the router's /metrics, while served."""
        srv = self.metrics_server
        if srv is None:
            return None
        return f"{self.advertise_host}:{srv.port}" if self.advertise_host else srv.address

    def _run_on_loop(self, fn: Callable):
        """``fn()`` on the server's loop (the core's thread), from any thread."""
        loop = self._loop
        if loop is None or not loop.is_running():
            return fn()
        try:
            if asyncio.get_running_loop() is loop:
                return fn()
        except RuntimeError:  # no loop in this thread
            pass
        return self.call(fn, timeout=5.0)

    def scrape_targets(self) -> list[dict]:
        """Prometheus file-based discovery groups: this router's /metrics and every live
        worker's (on the core's loop)."""
        groups = []
        if self.metrics_address:
            groups.append({"targets": [self.metrics_address], "labels": {"kvmesh_role": "router"}})
        for rec in sorted(self.core.workers.values(), key=lambda r: r.name):
            if rec.metrics_address:
                labels = {"kvmesh_role": "worker", "kvmesh_worker_name": rec.name}
                groups.append({"targets": [rec.metrics_address], "labels": labels})
        return groups

    def _write_sd_file(self) -> None:
        groups = self.scrape_targets()
        if groups == self._sd_written:
            return
        import json
        import os

        path = self.prometheus_sd_file
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:  # then renamed: Prometheus never reads half a file
            json.dump(groups, f, indent=1)
        os.replace(tmp, path)
        self._sd_written = groups

    async def start(self) -> int:
        """Bind and start serving; returns the bound port. When any part fails to start (a
        port taken), what had started is stopped again before the error is raised."""
        policy = AccessPolicy(self.identity, self.tokens, ROUTER_CLUSTER_ONLY)
        server = aio_server(self.max_message_mb, [AuthInterceptor(policy)])
        asked = (self.port, self.metrics_port)
        try:
            port = await self._start_parts(server)
        except BaseException:
            if self.http is not None:
                await self.http.stop()
            await server.stop(None)
            self._server = self._stopped = self._loop = self._serving = None
            if self.metrics_server is not None:
                await asyncio.to_thread(self.metrics_server.stop)
                self.metrics_server = None
            self.port, self.metrics_port = asked
            raise
        self._tasks.append(asyncio.ensure_future(self._housekeeping()))
        logger.info("router %s serving on %s:%d", self.core.router_id, self.host, port)
        return port

    async def _start_parts(self, server: grpc.aio.Server) -> int:
        """Metrics, gRPC, HTTP, in that order; the gRPC port."""
        if self.metrics_port is not None:
            from kvmesh.protos.metrics import serve_metrics

            self.metrics_server = serve_metrics(self.metrics.registry, self.host, self.metrics_port)
            self.metrics_port = self.metrics_server.port
        ipb_grpc.add_InferenceServicer_to_server(RouterServicer(self), server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        names = [_INFERENCE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
        reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], server)
        target = f"{self.host}:{self.port}"
        try:
            if self.tls is not None and self.tls.serves:
                port = server.add_secure_port(target, self.tls.server_credentials())
            else:
                port = server.add_insecure_port(target)
        except RuntimeError as e:  # grpc's "Failed to bind to address"
            raise OSError(f"cannot bind gRPC {target}: {e}") from None
        if port == 0:
            raise OSError(f"cannot bind gRPC {target}")
        self.port = port
        await self._set_health()
        await server.start()
        self._server = server
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        if self.http is not None:
            await self.http.start()
        return port

    def register_worker(self, info: dict) -> dict:
        """``core.register`` (on the server's loop, through ``call``), with health brought up
        to date at once rather than at the next housekeeping round, which a loaded machine
        can delay well past the moment a client sees the worker listed."""
        reply = self.core.register(info)
        self._health_task = asyncio.get_running_loop().create_task(self._set_health())
        return reply

    async def _set_health(self) -> None:
        serving = bool(self.core.workers) and not self.life.draining
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
                # a departed worker's channel closes once its calls are done: one that left
                # by itself (draining) may still be finishing streams over it
                gone = [w for w in self._channels if w not in self.core.workers]
                for wid in [w for w in gone if not self._calls.get(w)]:
                    _, ch, _ = self._channels.pop(wid)
                    await ch.close(grace=None)
                await self._set_health()
                if self.prometheus_sd_file:
                    self._write_sd_file()
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
        await self._drain.stop(self.grace_s if grace is None else grace, self._drain_and_stop)

    async def _drain_and_stop(self) -> None:
        self.life.draining = True
        await self._health.enter_graceful_shutdown()
        logger.info("router draining: %d in-flight streams", len(self.life.inflight))
        await self._drain.wait_for(self.life.inflight)  # HTTP requests included
        if self.http is not None:
            await self.http.stop()
        await self._server.stop(None)  # once, after the drain (protos.serving.Drain)
        for t in self._tasks:
            t.cancel()
        for _, ch, _ in self._channels.values():
            await ch.close(grace=None)
        self._channels.clear()
        if self.metrics_server is not None:
            await asyncio.to_thread(self.metrics_server.stop)
            self.metrics_server = None
        self._stopped.set()
        logger.info("router stopped")

    async def wait_for_termination(self) -> None:
        if self._stopped is not None:
            await self._stopped.wait()

    # ------------------------------------------------------------ a loop of its own

    def start_in_thread(self) -> int:
        """Serve from a background thread with its own uvloop event loop; returns the port."""
        return self._thread.start(self.start, self.wait_for_termination)

    def stop_in_thread(self, grace: float | None = None, timeout: float = 60.0) -> None:
        self._thread.stop(partial(self.stop, grace), timeout)

    def call(self, fn: Callable, *args, timeout: float = 30.0, **kwargs):
        """Run ``fn(*args, **kwargs)`` on the server's loop (where the core lives) and return
        its result; exceptions are re-raised here."""
        if self._loop is None:
            raise RuntimeError("the router server is not running")
        return call_in_loop(self._loop, fn, *args, timeout=timeout, **kwargs)
