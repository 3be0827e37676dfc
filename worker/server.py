"""The worker's gRPC servers: ``Inference`` over one AsyncEngine and ``KVTransfer`` over a
PageSource, plus grpc.health.v1 and server reflection, on ``grpc.aio`` with uvloop; beside
them the raw-TCP page data plane (``kvstore.dataplane``) that ``KVTransfer.DataPlane`` names.

Status codes: INVALID_ARGUMENT for bad input (the engine's ValueError message),
RESOURCE_EXHAUSTED when the waiting queue is full, UNAVAILABLE while shutting down (or after
the engine died). A client that cancels, disconnects or runs past its deadline aborts its
request: grpc.aio cancels the handler, which leaves the engine stream, which aborts the
request and frees its pages.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import uuid
from collections.abc import AsyncIterator, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmesh.kvstore.dataplane import VERSION as DATA_PLANE_VERSION
from kvmesh.kvstore.dataplane import DataPlaneServer
from kvmesh.kvstore.hashing import PAGE_HASH_BYTES
from kvmesh.kvstore.peer import PageAssembler, PageSource, TierPageSource, check_hashes, page_chunks
from kvmesh.protos.kvmesh.v1 import inference_pb2 as ipb
from kvmesh.protos.kvmesh.v1 import inference_pb2_grpc as ipb_grpc
from kvmesh.protos.kvmesh.v1 import kv_transfer_pb2 as kpb
from kvmesh.protos.kvmesh.v1 import kv_transfer_pb2_grpc as kpb_grpc
from kvmesh.worker.async_engine import AsyncEngine, EngineDeadError
from kvmesh.worker.engine import LLMEngine, QueueFullError
from kvmesh.worker.outputs import RequestOutput
from kvmesh.worker.sampling_params import SamplingParams

logger = logging.getLogger("kvmesh.server")

__all__ = [
    "InferenceServicer",
    "KVTransferServicer",
    "PageSource",
    "TierPageSource",
    "WorkerServer",
    "serve_worker",
]

_FETCH_BATCH = 32  # pages asked of the PageSource at a time while streaming a Fetch
_PUSH_FLUSH_BYTES = 8 << 20  # pushed bytes buffered before they are handed to accept()
_TORCH_FORMATS = {"torch.float32": "fp32", "torch.float16": "fp16", "torch.bfloat16": "bf16"}


def sampling_from_proto(sp: ipb.SamplingParams) -> SamplingParams:
    """SamplingParams from the wire; unset optional fields keep the engine's defaults.
    Raises ValueError (from SamplingParams) for bad values."""
    kw: dict = {}
    for name in ("temperature", "top_p", "top_k", "max_tokens", "seed", "skip_special_tokens"):
        if sp.HasField(name):
            kw[name] = getattr(sp, name)
    return SamplingParams(
        stop=tuple(sp.stop),
        stop_token_ids=tuple(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        logprobs=sp.logprobs,
        include_stop_str_in_output=sp.include_stop_str_in_output,
        **kw,
    )


def _response(out: RequestOutput, worker_id: str) -> ipb.GenerateResponse:
    n = len(out.new_token_ids)
    msg = ipb.GenerateResponse(
        request_id=out.request_id, token_ids=out.new_token_ids, text=out.new_text
    )
    if out.logprobs is not None and n:
        msg.logprobs.extend(out.logprobs[-n:])
    if out.finished:
        msg.finished = True
        msg.finish_reason = out.finish_reason or ""
        if isinstance(out.stop_reason, str):
            msg.stop_str = out.stop_reason
        elif isinstance(out.stop_reason, int):
            msg.stop_token_id = out.stop_reason
        msg.usage.prompt_tokens = len(out.prompt_token_ids)
        msg.usage.completion_tokens = len(out.token_ids)
        msg.usage.cached_tokens = out.num_cached_tokens
        for tier, n_tok in out.cached_tokens_by_tier.items():
            msg.usage.cached_tokens_by_tier[tier] = n_tok
        msg.worker_id = worker_id
    return msg


class _Lifecycle:
    """What the servicers share with the server: the draining flag and in-flight RPCs."""

    def __init__(self) -> None:
        self.draining = False
        self.inflight: set[asyncio.Task] = set()

    def enter(self) -> None:
        task = asyncio.current_task()
        if task is not None:
            self.inflight.add(task)

    def leave(self) -> None:
        self.inflight.discard(asyncio.current_task())


class InferenceServicer(ipb_grpc.InferenceServicer):
    def __init__(self, engine: AsyncEngine, life: _Lifecycle) -> None:
        self.aeng = engine
        self.life = life
        self.worker_id = engine.engine.engine_id
        self.active: set[str] = set()

    async def _refuse_if_unavailable(self, context: grpc.aio.ServicerContext) -> None:
        if self.life.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
        if self.aeng.error is not None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"the engine loop crashed: {self.aeng.error!r}"
            )

    async def Generate(
        self, request: ipb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ipb.GenerateResponse]:
        await self._refuse_if_unavailable(context)
        which = request.WhichOneof("prompt")
        if which is None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "the request has no prompt: set text or token_ids"
            )
        prompt = request.text if which == "text" else list(request.token_ids.ids)
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rid = request.request_id or uuid.uuid4().hex
        if rid in self.active:  # the engine checks too; this keeps `active` exact for Abort
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"request id {rid!r} is already in use"
            )
        stream = self.aeng.generate(prompt, params, rid, peers=list(request.peer_addresses))
        self.life.enter()
        self.active.add(rid)
        code = details = None
        try:
            async for out in stream:
                yield _response(out, self.worker_id)
        except QueueFullError as e:
            code, details = grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
        except ValueError as e:
            code, details = grpc.StatusCode.INVALID_ARGUMENT, str(e)
        except EngineDeadError as e:
            code, details = grpc.StatusCode.UNAVAILABLE, str(e)
        finally:
            # leaving the engine stream early (cancel, disconnect, deadline) aborts the request
            await stream.aclose()
            self.active.discard(rid)
            self.life.leave()
        if code is not None:
            await context.abort(code, details)

    async def Abort(
        self, request: ipb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> ipb.AbortResponse:
        found = request.request_id in self.active
        if found:
            self.aeng.abort(request.request_id)
        return ipb.AbortResponse(found=found)

    async def GetModelInfo(
        self, request: ipb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> ipb.ModelInfo:
        e = self.aeng.engine  # everything read here is fixed after construction
        cfg = e.model_config
        eos = set(cfg.eos_token_ids)
        if e.tokenizer is not None and e.tokenizer.eos_token_id is not None:
            eos.add(e.tokenizer.eos_token_id)
        # the resolved cache format ("auto" is the model dtype's format)
        kv_fmt = getattr(e, "cache_format", None) or e.cache_config.kv_cache_dtype
        return ipb.ModelInfo(
            model=e.src.name,
            fingerprint=e.model_fp,
            max_model_len=e.max_model_len,
            block_size=e.cache_config.block_size,
            kv_cache_dtype=kv_fmt,
            vocab_size=cfg.vocab_size,
            dtype=_TORCH_FORMATS.get(str(e.dtype), str(e.dtype)),
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            eos_token_ids=sorted(eos),
            worker_id=self.worker_id,
        )

    async def GetLoad(
        self, request: ipb.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> ipb.Load:
        await self._refuse_if_unavailable(context)
        try:
            # the engine's state belongs to its thread: read it there, between steps
            s = await asyncio.to_thread(self.aeng.call, LLMEngine.stats, 10.0)
        except TimeoutError:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine thread did not answer")
        return ipb.Load(
            num_requests_running=s.num_requests_running,
            num_requests_waiting=s.num_requests_waiting,
            queued_prefill_tokens=s.queued_prefill_tokens,
            kv_cache_usage_perc=s.kv_cache_usage_perc,
            num_free_pages=s.num_free_pages,
            num_pages=s.num_pages,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            worker_id=self.worker_id,
        )


class KVTransferServicer(kpb_grpc.KVTransferServicer):
    """Serves pages from a PageSource; without one, every page is a miss and Push is
    refused with FAILED_PRECONDITION."""

    def __init__(
        self, source: PageSource | None, life: _Lifecycle, data_plane: DataPlaneServer | None = None
    ) -> None:
        self.source = source
        self.life = life
        self.data_plane = data_plane

    async def _hashes(self, hashes: Sequence[bytes], context) -> list[bytes]:
        hashes = list(hashes)
        try:
            check_hashes(hashes)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return hashes

    async def _call(self, context, fn, *args):
        try:
            return await asyncio.to_thread(fn, *args)
        except Exception as e:
            logger.exception("page source %s failed", fn.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"page source {fn.__name__}: {e!r}")

    async def Lookup(
        self, request: kpb.LookupRequest, context: grpc.aio.ServicerContext
    ) -> kpb.LookupResponse:
        if self.life.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
        hashes = await self._hashes(request.hashes, context)
        if self.source is None or not hashes:
            return kpb.LookupResponse(tiers=[""] * len(hashes))
        where = await self._call(context, self.source.lookup, hashes)
        if len(where) != len(hashes):
            await context.abort(
                grpc.StatusCode.INTERNAL, f"page source answered {len(where)} of {len(hashes)}"
            )
        return kpb.LookupResponse(tiers=[t or "" for t in where])

    async def Fetch(
        self, request: kpb.FetchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kpb.PageChunk]:
        if self.life.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
        hashes = await self._hashes(request.hashes, context)
        self.life.enter()
        try:
            for start in range(0, len(hashes), _FETCH_BATCH):
                batch = hashes[start : start + _FETCH_BATCH]
                if self.source is None:
                    objs: list[bytes | None] = [None] * len(batch)
                else:
                    objs = await self._call(context, self.source.fetch, batch)
                pages = ((start + j, h, o) for j, (h, o) in enumerate(zip(batch, objs)))
                # the final chunk of a batch may be small; a chunk never spans batches
                for chunk in page_chunks(pages):
                    yield chunk
        finally:
            self.life.leave()

    async def DataPlane(
        self, request: kpb.DataPlaneRequest, context: grpc.aio.ServicerContext
    ) -> kpb.DataPlaneInfo:
        if self.life.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
        dp = self.data_plane
        # version 0: a client that did not say, read as 1; below ours: none both speak
        if dp is None or 0 < request.version < DATA_PLANE_VERSION:
            return kpb.DataPlaneInfo()
        return kpb.DataPlaneInfo(
            port=dp.port, token=dp.token, version=DATA_PLANE_VERSION, max_pages=dp.max_pages
        )

    async def Push(
        self, request_iterator: AsyncIterator[kpb.PageChunk], context: grpc.aio.ServicerContext
    ) -> kpb.PushResponse:
        if self.life.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
        if self.source is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "this worker has no page store to push to"
            )
        self.life.enter()
        asm = PageAssembler()
        ready: list[tuple[bytes, bytes]] = []
        ready_bytes = accepted = rejected = 0
        try:
            async for chunk in request_iterator:
                for piece in chunk.pieces:
                    done = asm.add(piece.hash, piece)
                    if done is None:
                        continue
                    ok, obj = done
                    if not ok or len(piece.hash) != PAGE_HASH_BYTES:
                        rejected += 1
                        continue
                    ready.append((piece.hash, obj))
                    ready_bytes += len(obj)
                if ready_bytes >= _PUSH_FLUSH_BYTES:
                    n = await self._call(context, self.source.accept, ready)
                    accepted, rejected = accepted + n, rejected + len(ready) - n
                    ready, ready_bytes = [], 0
            if ready:
                n = await self._call(context, self.source.accept, ready)
                accepted, rejected = accepted + n, rejected + len(ready) - n
            rejected += len(asm.incomplete())
        finally:
            self.life.leave()
        return kpb.PushResponse(accepted=accepted, rejected=rejected)


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
        server_credentials: grpc.ServerCredentials | None = None,
    ) -> None:
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
        self.data_plane_enabled = data_plane and page_source is not None
        self.data_plane_port = data_plane_port
        self.data_plane: DataPlaneServer | None = None
        self.server_credentials = server_credentials
        self.host = host
        self.port = port
        self.max_message_mb = max_message_mb
        self.grace_s = grace_s
        self.health = None
        self._server: grpc.aio.Server | None = None
        self._life = _Lifecycle()
        self._stopped: asyncio.Event | None = None
        self._stop_task: asyncio.Future | None = None
        self._drain_deadline = float("inf")
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.inference: InferenceServicer | None = None

    @property
    def address(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "[::]", "::") else self.host
        return f"{host}:{self.port}"

    @property
    def worker_id(self) -> str | None:
        return self.engine.engine.engine_id if self.engine is not None else None

    async def start(self) -> int:
        """Bind and start serving; returns the bound port."""
        limit = self.max_message_mb * 2**20
        server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", limit),
                ("grpc.max_receive_message_length", limit),
                ("grpc.so_reuseport", 0),
            ]
        )
        names = [kpb.DESCRIPTOR.services_by_name["KVTransfer"].full_name]
        if self.engine is not None:
            self.inference = InferenceServicer(self.engine, self._life)
            ipb_grpc.add_InferenceServicer_to_server(self.inference, server)
            names.append(ipb.DESCRIPTOR.services_by_name["Inference"].full_name)
        asked_port = self.data_plane_port
        if self.data_plane_enabled:
            self.data_plane = DataPlaneServer(self.page_source, self.host, self.data_plane_port)
            self.data_plane_port = await asyncio.to_thread(self.data_plane.start)
        try:
            port = await self._start_grpc(server, names)
        except BaseException:  # nothing serves: the data plane must not outlive the attempt
            if self.data_plane is not None:
                self.data_plane.stop()
                self.data_plane, self.data_plane_port = None, asked_port
            raise
        self._server = server
        self._stopped = asyncio.Event()
        logger.info(
            "worker %s serving %s on %s:%d%s", self.worker_id, ", ".join(names), self.host, port,
            f", page data plane on port {self.data_plane_port}" if self.data_plane else "",
        )  # fmt: skip
        return port

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
        if self.server_credentials is not None:
            port = server.add_secure_port(target, self.server_credentials)
        else:
            port = server.add_insecure_port(target)
        if port == 0:
            raise OSError(f"cannot bind {self.host}:{self.port}")
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
        loop = asyncio.get_running_loop()
        grace = self.grace_s if grace is None else grace
        self._drain_deadline = min(self._drain_deadline, loop.time() + grace)
        if self._stop_task is None:
            self._stop_task = asyncio.ensure_future(self._drain_and_stop())
        await asyncio.shield(self._stop_task)

    async def _drain_and_stop(self) -> None:
        loop = asyncio.get_running_loop()
        self._life.draining = True
        dp = self.data_plane
        if dp is not None:
            dp.draining = True  # requests in flight finish; new ones are refused
        await self.health.enter_graceful_shutdown()
        logger.info(
            "worker %s draining: %d in-flight calls, grace %.1fs",
            self.worker_id, len(self._life.inflight), self._drain_deadline - loop.time(),
        )  # fmt: skip
        # The servicers refuse new work while the in-flight streams finish; our own streams
        # decide when the grace ends early (an open health Watch must not hold it). Then one
        # grpc stop cancels what is left: two overlapping grpc.aio stop() calls can crash
        # grpcio 1.85 while it cancels calls, so there is never a second one.
        pending = [t for t in self._life.inflight if not t.done()]
        while (pending or (dp and dp.busy)) and (left := self._drain_deadline - loop.time()) > 0:
            if pending:
                await asyncio.wait(pending, timeout=min(left, 0.1))
            else:
                await asyncio.sleep(min(left, 0.05))
            pending = [t for t in pending if not t.done()]
        if dp is not None:
            await asyncio.to_thread(dp.stop)  # what is still in flight ends: clients see misses
        await self._server.stop(None)
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
        import uvloop

        started = threading.Event()
        box: list = []

        def run() -> None:
            loop = uvloop.new_event_loop()
            self._loop = loop
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

        self._thread = threading.Thread(target=run, name="kvmesh-grpc", daemon=True)
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
    **engine_args,
) -> None:
    """Load the model, serve until SIGTERM/SIGINT, drain, exit (``kvmesh worker``).

    A first signal drains for up to ``grace_s`` seconds; a second one stops at once.
    """
    import uvloop

    if model is not None:
        engine_args["model"] = model
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
