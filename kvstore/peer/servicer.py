"""The server side of KVTransfer: ``KVTransferServicer`` serves a ``PageSource`` to peers
(``Lookup``, ``Fetch``, ``Push``) and names the data plane that serves the same source
faster (``DataPlane``). Its client side is ``PeerTier`` (``peer.tier``).

Source calls run in a thread pool (they may block: an engine source copies pages on its
engine thread). Status codes: INVALID_ARGUMENT for a hash that is not a page hash,
UNAVAILABLE while the server drains, FAILED_PRECONDITION for a Push without a source,
INTERNAL when the source fails.

Every method here is for cluster members only: the server that hosts this servicer
(``worker.server.WorkerServer``) installs ``protos.security.AuthInterceptor``, which refuses
calls without the cluster identity with UNAUTHENTICATED before they reach it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence

import grpc

from kvmesh.kvstore.dataplane import VERSION as DATA_PLANE_VERSION
from kvmesh.kvstore.dataplane import DataPlaneServer
from kvmesh.kvstore.hashing import PAGE_HASH_BYTES
from kvmesh.kvstore.peer.framing import PageAssembler, check_hashes, page_chunks
from kvmesh.kvstore.peer.source import PageSource
from kvmesh.protos.kvmesh.v1 import kv_transfer_pb2 as kpb
from kvmesh.protos.kvmesh.v1 import kv_transfer_pb2_grpc as kpb_grpc
from kvmesh.protos.serving import Lifecycle

logger = logging.getLogger(__name__)

_FETCH_BATCH = 32  # pages asked of the PageSource at a time while streaming a Fetch
_PUSH_FLUSH_BYTES = 8 << 20  # pushed bytes buffered before they are handed to accept()
# hashes one Lookup or Fetch may name: a Lookup is answered on the engine thread between
# steps, so its size is bounded (a 128K-token prompt of 16-token pages has 8,192)
MAX_LOOKUP_PAGES = 16384
PUSH_MAX_PAGE_BYTES = 64 << 20  # a pushed object may claim at most this
PUSH_MAX_PARTIAL_BYTES = 128 << 20  # unfinished pushed objects together, per Push


class KVTransferServicer(kpb_grpc.KVTransferServicer):
    """Serves pages from a PageSource; without one, every page is a miss and Push is
    refused with FAILED_PRECONDITION."""

    def __init__(
        self, source: PageSource | None, life: Lifecycle, data_plane: DataPlaneServer | None = None
    ) -> None:
        self.source = source
        self.life = life
        self.data_plane = data_plane

    async def _hashes(self, hashes: Sequence[bytes], context) -> list[bytes]:
        if len(hashes) > MAX_LOOKUP_PAGES:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"hashes names {len(hashes)} pages; at most {MAX_LOOKUP_PAGES} per call",
            )
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
        asm = PageAssembler(PUSH_MAX_PAGE_BYTES, PUSH_MAX_PARTIAL_BYTES)
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
