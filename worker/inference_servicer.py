"""The worker's ``Inference`` gRPC servicer over one AsyncEngine, and the conversions
between its messages and the engine's types.

Status codes: INVALID_ARGUMENT for bad input (the engine's ValueError message),
RESOURCE_EXHAUSTED when the waiting queue is full, UNAVAILABLE while shutting down (or after
the engine died). A client that cancels, disconnects or runs past its deadline aborts its
request: grpc.aio cancels the handler, which leaves the engine stream, which aborts the
request and frees its pages. A Generate still running after the server's default
deadline (``deadline_s``; the client's own, when shorter, is grpc's to enforce) is aborted
and ends with DEADLINE_EXCEEDED. ``peer_addresses`` are taken only from a cluster member (the
router): from anyone else PERMISSION_DENIED, so no client can make this worker contact a
host or take pages from it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import grpc

from kvmesh.protos.kvmesh.v1 import inference_pb2 as ipb
from kvmesh.protos.kvmesh.v1 import inference_pb2_grpc as ipb_grpc
from kvmesh.protos.security import ClusterIdentity
from kvmesh.protos.serving import Lifecycle, call_deadline
from kvmesh.worker.async_engine import AsyncEngine, EngineDeadError
from kvmesh.worker.engine import LLMEngine, QueueFullError
from kvmesh.worker.outputs import RequestOutput
from kvmesh.worker.sampling_params import SamplingParams

_TORCH_FORMATS = {"torch.float32": "fp32", "torch.float16": "fp16", "torch.bfloat16": "bf16"}


def sampling_from_proto(sp: ipb.SamplingParams) -> SamplingParams:
    """SamplingParams from the wire; unset optional fields keep the engine's defaults.
    Raises ValueError (from SamplingParams) for bad values."""
    kw: dict = {}
    for name in ("temperature", "top_p", "top_k", "max_tokens", "seed", "skip_special_tokens"):
        if sp.HasField(name):
            kw[name] = getattr(sp, name)
    return SamplingParams(
        cache_salt=sp.cache_salt or None,
        kv_budget=sp.kv_budget or None,
        kv_policy=sp.kv_policy or None,
        stop=tuple(sp.stop),
        stop_token_ids=tuple(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        logprobs=sp.logprobs,
        top_logprobs=sp.top_logprobs,
        min_tokens=sp.min_tokens,
        include_stop_str_in_output=sp.include_stop_str_in_output,
        **kw,
    )


def response_from_output(out: RequestOutput, worker_id: str) -> ipb.GenerateResponse:
    """The GenerateResponse for an engine output (gRPC and the HTTP API send the same)."""
    n = len(out.new_token_ids)
    msg = ipb.GenerateResponse(
        request_id=out.request_id, token_ids=out.new_token_ids, text=out.new_text
    )
    if out.logprobs is not None and n:
        msg.logprobs.extend(out.logprobs[-n:])
    if out.top_logprobs and n:
        for alts in out.top_logprobs[-n:]:
            msg.top_logprobs.add(token_ids=[t for t, _ in alts], logprobs=[v for _, v in alts])
    if out.finished:
        msg.finished = True
        msg.finish_reason = out.finish_reason or ""
        if out.error:
            msg.error = out.error
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


class InferenceServicer(ipb_grpc.InferenceServicer):
    def __init__(
        self,
        engine: AsyncEngine,
        life: Lifecycle,
        *,
        identity: ClusterIdentity | None = None,
        deadline_s: float | None = None,
    ) -> None:
        self.aeng = engine
        self.life = life
        self.identity = identity
        self.deadline_s = deadline_s
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
        peers = list(request.peer_addresses)
        if peers and not (
            self.identity is not None and self.identity.authenticates(context.invocation_metadata())
        ):
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                "peer_addresses may be set only by the cluster's router (a cluster member)",
            )
        stream = self.aeng.generate(prompt, params, rid, peers=peers)
        self.life.enter()
        self.active.add(rid)
        code = details = None
        expired = False
        limit = call_deadline(context, self.deadline_s)

        def expire() -> None:
            nonlocal expired
            expired = True
            self.aeng.abort(rid)  # wakes the stream below with the request's last output

        timer = asyncio.get_running_loop().call_later(limit, expire) if limit else None
        try:
            async for out in stream:
                if expired:
                    break
                yield response_from_output(out, self.worker_id)
            if expired:
                code = grpc.StatusCode.DEADLINE_EXCEEDED
                details = f"the server's deadline of {limit:.0f}s for one Generate passed"
        except QueueFullError as e:
            code, details = grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
        except ValueError as e:
            code, details = grpc.StatusCode.INVALID_ARGUMENT, str(e)
        except EngineDeadError as e:
            code, details = grpc.StatusCode.UNAVAILABLE, str(e)
        finally:
            if timer is not None:
                timer.cancel()
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
        return ipb.ModelInfo(
            model=e.src.name,
            fingerprint=e.model_fp,
            max_model_len=e.max_model_len,
            block_size=e.cache_config.block_size,
            kv_cache_dtype=e.cache_format,  # resolved: "auto" is the model dtype's
            vocab_size=cfg.vocab_size,
            dtype=_TORCH_FORMATS.get(str(e.dtype), str(e.dtype)),
            num_layers=cfg.num_layers,
            # the KV page layout's, not the attention heads': MLA pages hold 1 latent row
            num_kv_heads=e.layout.num_kv_heads,
            head_dim=e.layout.head_size,
            eos_token_ids=sorted(e.eos_token_ids),
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
        except QueueFullError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
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
