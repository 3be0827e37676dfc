"""The worker's OpenAI-compatible HTTP API (``kvmesh worker --http-port``) over one engine.

``build_worker_app`` returns the FastAPI app of ``protos/openai_app.py`` over an
``EngineBackend``: requests run on the AsyncEngine exactly as ``InferenceServicer.Generate``
runs them (the same SamplingParams conversion, the same responses), so an HTTP request and a
gRPC one with the same prompt give the same tokens. ``WorkerServer`` serves it with uvicorn on
its own event loop, beside gRPC, and drains both together.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI

from kvmesh.protos.kvmesh.v1 import inference_pb2 as ipb
from kvmesh.protos.openai import APIError
from kvmesh.protos.openai_app import build_app
from kvmesh.protos.security import BearerTokens
from kvmesh.protos.serving import Lifecycle
from kvmesh.worker.async_engine import AsyncEngine, EngineDeadError
from kvmesh.worker.engine import QueueFullError
from kvmesh.worker.inference_servicer import response_from_output, sampling_from_proto

__all__ = ["EngineBackend", "build_worker_app"]


class EngineBackend:
    """The HTTP app's backend over one AsyncEngine; ``life`` is the gRPC server's, so a
    drain refuses new HTTP requests too and waits for the running ones. ``deadline_s`` caps
    one request as the gRPC ``Generate``'s default deadline does (None: no cap): when it
    passes, the request is aborted (its pages freed) and answered 504."""

    def __init__(
        self,
        engine: AsyncEngine,
        life: Lifecycle | None = None,
        *,
        deadline_s: float | None = None,
    ) -> None:
        if deadline_s is not None and not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0 or None, got {deadline_s}")
        self.aeng = engine
        self.life = life or Lifecycle()
        self.deadline_s = deadline_s
        e = engine.engine
        self.model = e.src.name
        self.tokenizer = e.tokenizer
        self.worker_id = e.engine_id

    def release(self) -> None:
        """Drop the engine once the HTTP server has stopped: FastAPI caches its endpoints
        (and so this backend) for the process's life, which must not keep a model and its
        KV pool alive after the worker is gone."""
        self.aeng = None

    def unavailable(self) -> str | None:
        if self.life.draining:
            return "the worker is shutting down"
        if self.aeng.error is not None:
            return f"the engine loop crashed: {self.aeng.error!r}"
        return None

    async def max_model_len(self) -> int | None:
        return self.aeng.engine.max_model_len  # fixed after construction

    async def generate(
        self, request: ipb.GenerateRequest, session: str | None = None
    ) -> AsyncIterator[ipb.GenerateResponse]:
        why = self.unavailable()
        if why is not None:
            raise APIError(503, why)
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        rid = request.request_id or uuid.uuid4().hex
        stream = self.aeng.generate(list(request.token_ids.ids), params, rid)
        # a stream's first token is awaited in the handler's task, the rest in the response's
        inflight = self.life.enter()
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            self.aeng.abort(rid)  # wakes the stream below with the request's last output

        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.deadline_s, expire) if self.deadline_s else None
        try:
            async for out in stream:
                if expired:
                    break
                yield response_from_output(out, self.worker_id)
            if expired:
                raise APIError(
                    504, f"the server's deadline of {self.deadline_s:g}s for one request passed"
                )
        except QueueFullError as e:
            raise APIError(429, str(e)) from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except EngineDeadError as e:
            raise APIError(503, str(e)) from None
        finally:
            if timer is not None:
                timer.cancel()
            # leaving early (the client went away, another choice failed) aborts the request
            await stream.aclose()
            self.life.leave(inflight)


def build_worker_app(
    engine: AsyncEngine,
    life: Lifecycle | None = None,
    *,
    tokens: BearerTokens | None = None,
    max_body_bytes: int | None = None,
    deadline_s: float | None = None,
) -> FastAPI:
    """The worker's OpenAI-compatible app (docs/http.md); add routes to it as to any app.
    ``tokens``, ``max_body_bytes``: ``build_app``'s; ``deadline_s``: ``EngineBackend``'s."""
    return build_app(
        EngineBackend(engine, life, deadline_s=deadline_s),
        title="kvmesh worker",
        tokens=tokens,
        max_body_bytes=max_body_bytes,
    )
