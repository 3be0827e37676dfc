"""The router's OpenAI-compatible HTTP API (``kvmesh serve --http-port``).

``build_router_app`` returns the FastAPI app of ``protos/openai_app.py`` over a
``RouterBackend``, whose ``generate`` is ``RouterServer.route``: the very path gRPC
``Generate`` takes (page hashes of the templated, tokenized prompt -> ``RouterCore.assign`` ->
the chosen worker's gRPC ``Generate``, routed again while nothing has streamed when a worker is
UNAVAILABLE, released at the end). It runs on the router's own event loop (the core is
single-threaded), started and drained by ``RouterServer``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
from fastapi import FastAPI

from kvmesh.protos.kvmesh.v1 import inference_pb2 as ipb
from kvmesh.protos.openai import APIError, grpc_status_to_http
from kvmesh.protos.openai_app import Tokenizer, build_app
from kvmesh.protos.security import BearerTokens

if TYPE_CHECKING:
    from kvmesh.router.service import RouterServer

logger = logging.getLogger("kvmesh.router")

__all__ = ["RouterBackend", "build_router_app"]


class RouterBackend:
    """The HTTP app's backend over a ``RouterServer`` (on its loop)."""

    def __init__(self, server: RouterServer, model: str, tokenizer: Tokenizer | None) -> None:
        self.srv = server
        self.model = model
        self.tokenizer = tokenizer
        self._max_model_len: int | None = None

    def unavailable(self) -> str | None:
        if self.srv.life.draining:
            return "the router is shutting down"
        if not self.srv.core.workers:
            return "no worker is available"
        return None

    async def max_model_len(self) -> int | None:
        """The workers' (they all serve one model), asked once of any live worker."""
        if self._max_model_len is None:
            for wid in list(self.srv.core.workers):
                try:
                    info = await self.srv.stub(wid).GetModelInfo(
                        ipb.GetModelInfoRequest(),
                        timeout=10,
                        metadata=getattr(self.srv, "member_md", None),  # the cluster identity
                    )
                except (grpc.aio.AioRpcError, KeyError) as e:
                    logger.warning("GetModelInfo from %s failed: %r", wid, e)
                    continue
                self._max_model_len = info.max_model_len
                break
        return self._max_model_len

    async def generate(
        self, request: ipb.GenerateRequest, session: str | None = None
    ) -> AsyncIterator[ipb.GenerateResponse]:
        from kvmesh.router.service import RouteError

        stream = self.srv.route(
            list(request.token_ids.ids),
            request.sampling,
            request.request_id,
            session=session,
        )
        try:
            async for msg in stream:
                yield msg
        except RouteError as e:
            raise APIError(grpc_status_to_http(e.code.name), e.details) from None
        finally:
            await stream.aclose()  # the client gone: cancels the worker's call


def build_router_app(
    server: RouterServer,
    model: str,
    tokenizer: Tokenizer | None,
    *,
    tokens: BearerTokens | None = None,
    max_body_bytes: int | None = None,
) -> FastAPI:
    """The router's OpenAI-compatible app (docs/http.md); add routes to it as to any app.
    ``tokens``, ``max_body_bytes``: ``build_app``'s. The deadline is ``route``'s own."""
    return build_app(
        RouterBackend(server, model, tokenizer),
        title="kvmesh router",
        tokens=tokens,
        max_body_bytes=max_body_bytes,
    )
