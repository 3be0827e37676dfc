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

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmesh.kvstore.hashing import hash_pages
from kvmesh.protos.kvmesh.v1 import inference_pb2 as ipb
from kvmesh.protos.kvmesh.v1 import inference_pb2_grpc as ipb_grpc
from kvmesh.protos.serving import Drain, Lifecycle, ServerThread, aio_server, call_in_loop
from kvmesh.router.core import EventRow, RouterCore, decode_events, encode_event
from kvmesh.router.load import to_proto
from kvmesh.router.policies import NoWorkerError

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


class RouterServicer(ipb_grpc.InferenceServicer):
    def __init__(self, server: RouterServer) -> None:
        self.srv = server
        self.core = server.core
        self.active: dict[str, str | None] = {}  # request id -> the worker running it

    async def Generate(
        self, request: ipb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ipb.GenerateResponse]:
        if self.srv.life.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the router is shutting down")
        ids = await self._token_ids(request, context)
        if self.core.block_size is None:  # no worker has ever registered
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is available")
        try:
            # salted exactly as the worker salts them: a tenant's pages match only its own
            salt = request.sampling.cache_salt or None
            hashes = hash_pages(ids, self.core.block_size, self.core.model_fp, cache_salt=salt)
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
        self.srv.life.enter()
        tried: list[str] = []
        sent = False
        code = details = None
        try:
            while code is None:
                try:
                    decision = self.core.assign(
                        rid, ids, hashes, exclude=tried, session_key=session
                    )
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
                        if not sent:
                            self.core.first_token(rid)  # the prefill is done
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
            self.core.release(rid)
            self.active.pop(rid, None)
            self.srv.life.leave()
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
        return to_proto(self.core.aggregate_load(), f"router-{self.core.router_id}")


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
        metrics_port: int | None = None,
        prometheus_sd_file: str | None = None,
        model_name: str = "",
    ) -> None:
        if max_message_mb < 1:  # checked now, not when the server starts
            raise ValueError(f"max_message_mb must be >= 1, got {max_message_mb}")
        if metrics_port is not None and not 0 <= metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535], got {metrics_port}")
        self.core = core
        self.tokenize = tokenize
        self.host, self.port = host, port
        self.max_message_mb = max_message_mb
        self.grace_s = grace_s
        self.housekeeping_s = housekeeping_s
        self.life = Lifecycle()  # draining flag and streams in flight, with the servicer
        self._channels: dict[str, tuple[str, grpc.aio.Channel, ipb_grpc.InferenceStub]] = {}
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._serving: bool | None = None
        self._tasks: list[asyncio.Task] = []
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
        self.metrics_port = metrics_port
        self.metrics_server = None
        self.prometheus_sd_file = prometheus_sd_file
        self.advertise_host: str | None = None  # the host others reach this one at
        self._sd_written: list | None = None

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
        server = aio_server(self.max_message_mb)
        if self.metrics_port is not None:
            from kvmesh.protos.metrics import serve_metrics

            self.metrics_server = serve_metrics(self.metrics.registry, self.host, self.metrics_port)
            self.metrics_port = self.metrics_server.port
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
                for wid in [w for w in self._channels if w not in self.core.workers]:
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
        await self._drain.wait_for(self.life.inflight)
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
