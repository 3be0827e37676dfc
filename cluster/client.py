"""The kvmesh client SDK: ``Client`` (blocking) and ``AsyncClient`` (asyncio), one shape.

    from kvmesh.cluster import Client

    with Client("localhost:50051") as c:
        for chunk in c.generate("Hello", max_tokens=32, temperature=0):
            print(chunk.text, end="", flush=True)
        print(c.generate_text("Hello", max_tokens=32).text)

Sampling keywords mirror ``kvmesh.worker.SamplingParams``; the server validates them and an
invalid one raises ``InvalidArgument`` with the engine's message. Every failure is a
``KvmeshError`` carrying the gRPC status ``code`` and ``details``.

Retries: a call that fails with UNAVAILABLE before any token arrived is retried (``retries``
times, exponential backoff with jitter from ``backoff_s`` up to ``backoff_max_s``), within the
call's own deadline. Nothing is retried once a token has been received: the caller has seen
part of the answer, and a second attempt could continue differently.

This module imports only grpc and the generated protos (no torch), so clients stay light.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.protos.kvmesh.v1 import inference_pb2 as pb
from kvmesh.protos.kvmesh.v1 import inference_pb2_grpc as pb_grpc
from kvmesh.protos.security import AUTHORIZATION_KEY, ClusterIdentity
from kvmesh.protos.serving import KEEPALIVE_TIME_S, KEEPALIVE_TIMEOUT_S, channel_options

Metadata = Sequence[tuple[str, str]]
Prompt = str | Sequence[int]

SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "logprobs",
    "top_logprobs",
    "min_tokens",
    "include_stop_str_in_output",
    "cache_salt",
    "kv_budget",
    "kv_policy",
)


# ---------------------------------------------------------------- errors


class KvmeshError(Exception):
    """A failed call: ``code`` is the grpc.StatusCode, ``details`` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class InvalidArgument(KvmeshError):
    """The request was rejected as bad input (the message names the bad value)."""


class ResourceExhausted(KvmeshError):
    """The worker's queue is full; retry later or elsewhere."""


class Unavailable(KvmeshError):
    """The server is unreachable or shutting down (retried before the first token)."""


class DeadlineExceeded(KvmeshError):
    """The call's timeout passed; the server aborted the request."""


class Cancelled(KvmeshError):
    """The call was cancelled."""


class Unauthenticated(KvmeshError):
    """The server wants a bearer token (``token=``) or the cluster identity, and got none or
    a wrong one."""


class PermissionDenied(KvmeshError):
    """The call asked for something only a cluster member may (e.g. ``peer_addresses``)."""


_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}


def _error(e: grpc.RpcError) -> KvmeshError:
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = (e.details() if hasattr(e, "details") else None) or str(e)
    return _ERRORS.get(code, KvmeshError)(code, details)


# ---------------------------------------------------------------- results


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)


@dataclass
class GenerateChunk:
    """One streamed response: the tokens and text it adds; the last one has ``finished``
    and carries ``finish_reason``, ``usage`` and ``worker_id``."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[float] | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    worker_id: str | None = None
    error: str | None = None  # why, when finish_reason is "error"


@dataclass
class GenerateResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage | None
    worker_id: str | None
    stop_reason: str | int | None = None
    logprobs: list[float] | None = None
    num_chunks: int = 0
    error: str | None = None  # why, when finish_reason is "error"


@dataclass
class ModelInfo:
    model: str
    fingerprint: str
    max_model_len: int
    block_size: int
    kv_cache_dtype: str
    vocab_size: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    eos_token_ids: list[int]
    worker_id: str


@dataclass
class Load:
    num_requests_running: int
    num_requests_waiting: int
    queued_prefill_tokens: int
    kv_cache_usage_perc: float
    num_free_pages: int
    num_pages: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    worker_id: str


def _chunk(msg: pb.GenerateResponse, want_logprobs: bool) -> GenerateChunk:
    c = GenerateChunk(
        request_id=msg.request_id,
        token_ids=list(msg.token_ids),
        text=msg.text,
        logprobs=list(msg.logprobs) if want_logprobs else None,
    )
    if msg.finished:
        c.finished = True
        c.finish_reason = msg.finish_reason or None
        which = msg.WhichOneof("stop_reason")
        c.stop_reason = getattr(msg, which) if which else None
        u = msg.usage
        c.usage = Usage(
            prompt_tokens=u.prompt_tokens,
            completion_tokens=u.completion_tokens,
            cached_tokens=u.cached_tokens,
            cached_tokens_by_tier=dict(u.cached_tokens_by_tier),
        )
        c.worker_id = msg.worker_id or None
        c.error = msg.error or None
    return c


class _Collector:
    """Folds chunks into a GenerateResult."""

    def __init__(self, want_logprobs: bool) -> None:
        self.result = GenerateResult("", "", [], None, None, None)
        self.result.logprobs = [] if want_logprobs else None
        self.texts: list[str] = []

    def add(self, c: GenerateChunk) -> None:
        r = self.result
        r.request_id = c.request_id
        r.token_ids.extend(c.token_ids)
        self.texts.append(c.text)
        if r.logprobs is not None and c.logprobs:
            r.logprobs.extend(c.logprobs)
        r.num_chunks += 1
        if c.finished:
            r.finish_reason, r.usage, r.worker_id = c.finish_reason, c.usage, c.worker_id
            r.stop_reason, r.error = c.stop_reason, c.error

    def done(self) -> GenerateResult:
        self.result.text = "".join(self.texts)
        return self.result


def _model_info(m: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(
        model=m.model,
        fingerprint=m.fingerprint,
        max_model_len=m.max_model_len,
        block_size=m.block_size,
        kv_cache_dtype=m.kv_cache_dtype,
        vocab_size=m.vocab_size,
        dtype=m.dtype,
        num_layers=m.num_layers,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        eos_token_ids=list(m.eos_token_ids),
        worker_id=m.worker_id,
    )


def _load(m: pb.Load) -> Load:
    return Load(
        num_requests_running=m.num_requests_running,
        num_requests_waiting=m.num_requests_waiting,
        queued_prefill_tokens=m.queued_prefill_tokens,
        kv_cache_usage_perc=m.kv_cache_usage_perc,
        num_free_pages=m.num_free_pages,
        num_pages=m.num_pages,
        prefix_cache_queries=m.prefix_cache_queries,
        prefix_cache_hits=m.prefix_cache_hits,
        worker_id=m.worker_id,
    )


def build_request(prompt: Prompt, request_id: str | None = None, **sampling) -> pb.GenerateRequest:
    """The GenerateRequest for ``prompt`` (text or token ids) and sampling keywords."""
    unknown = set(sampling) - set(SAMPLING_FIELDS)
    if unknown:
        raise TypeError(
            f"unknown sampling parameter(s) {sorted(unknown)}; accepted: {list(SAMPLING_FIELDS)}"
        )
    sp = pb.SamplingParams()
    for name, value in sampling.items():
        if value is None:
            continue
        if name == "stop":
            sp.stop.extend([value] if isinstance(value, str) else list(value))
        elif name == "stop_token_ids":
            sp.stop_token_ids.extend(value)
        else:
            setattr(sp, name, value)
    req = pb.GenerateRequest(sampling=sp, request_id=request_id or "")
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


# ---------------------------------------------------------------- retries


class _RetryPolicy:
    """Which failed attempts are tried again, and after how long: UNAVAILABLE only, only
    before any output, at most ``retries`` times, with exponential backoff and jitter, and
    never past the call's deadline."""

    def __init__(self, retries: int, backoff_s: float, backoff_max_s: float) -> None:
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.retries = retries
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s

    def delay(
        self, error: grpc.RpcError, failures: int, deadline: float | None, got_output: bool
    ) -> float | None:
        """Seconds to wait after the ``failures``-th failed attempt (1-based) of a call,
        None when it is not to be retried."""
        if got_output or error.code() != grpc.StatusCode.UNAVAILABLE or failures > self.retries:
            return None
        delay = min(self.backoff_max_s, self.backoff_s * 2 ** (failures - 1))
        delay *= 0.5 + random.random() / 2
        if deadline is not None and time.monotonic() + delay >= deadline:
            return None
        return delay


class _Call:
    """One call's deadline (monotonic seconds or None), metadata and failed attempts: what
    every attempt of it shares, whether it blocks or awaits."""

    def __init__(self, policy: _RetryPolicy, deadline: float | None, metadata: Metadata) -> None:
        self.policy = policy
        self.deadline = deadline
        self.metadata = tuple(metadata) or None
        self.failures = 0

    def timeout(self) -> float | None:
        """The time left for the next attempt, as grpc's ``timeout``."""
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.001)

    def retry_delay(self, error: grpc.RpcError, got_output: bool = False) -> float:
        """Seconds to wait before the next attempt; raises ``error`` as a KvmeshError when
        there is to be none."""
        self.failures += 1
        delay = self.policy.delay(error, self.failures, self.deadline, got_output)
        if delay is None:
            raise _error(error) from None
        return delay


# ---------------------------------------------------------------- what both clients share


_channel_options = channel_options  # the parameter of _ClientBase shadows the function


def _pem(value: bytes | str | os.PathLike | None) -> bytes | None:
    """PEM bytes as given, or read from a path."""
    if value is None or isinstance(value, bytes):
        return value
    with open(value, "rb") as f:
        return f.read()


class _Stubs:
    """The stubs of one channel (grpc's or grpc.aio's)."""

    def __init__(self, channel: grpc.Channel | grpc.aio.Channel) -> None:
        self.inference = pb_grpc.InferenceStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)


@dataclass(frozen=True)
class _Unary:
    """A unary RPC of the SDK: the stub method it calls and how the response becomes the
    SDK's result."""

    method: Callable[[_Stubs], Callable]
    result: Callable[[Any], Any]


_ABORT = _Unary(lambda s: s.inference.Abort, lambda r: r.found)
_MODEL_INFO = _Unary(lambda s: s.inference.GetModelInfo, _model_info)
_GET_LOAD = _Unary(lambda s: s.inference.GetLoad, _load)
_HEALTH = _Unary(
    lambda s: s.health.Check,
    lambda r: health_pb2.HealthCheckResponse.ServingStatus.Name(r.status),
)


class _ClientBase:
    """Options, channel, stubs and the start of every call; ``Client`` and ``AsyncClient``
    add only the blocking or the awaiting half."""

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        tls: bool = False,
        root_certificates: bytes | str | os.PathLike | None = None,
        private_key: bytes | str | os.PathLike | None = None,
        certificate_chain: bytes | str | os.PathLike | None = None,
        max_message_mb: int = 64,
        retries: int = 3,
        backoff_s: float = 0.1,
        backoff_max_s: float = 2.0,
        channel_options: Sequence[tuple[str, object]] | None = None,
        token: str | None = None,
        identity: ClusterIdentity | None = None,
        keepalive_s: float = KEEPALIVE_TIME_S,
        keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S,
    ) -> None:
        self._retry = _RetryPolicy(retries, backoff_s, backoff_max_s)
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds or None, got {timeout}")
        if max_message_mb < 1:
            raise ValueError(f"max_message_mb must be >= 1, got {max_message_mb}")
        self._target = target
        self._timeout = timeout
        self._metadata = tuple(metadata or ())
        if token is not None:
            if not token or any(c.isspace() for c in token):
                raise ValueError("token must be a non-empty string without whitespace")
            self._metadata += ((AUTHORIZATION_KEY, f"Bearer {token}"),)
        if identity is not None:
            if not isinstance(identity, ClusterIdentity):
                raise ValueError(f"identity must be a ClusterIdentity, got {type(identity)}")
            self._metadata += identity.metadata()
        self._channel_options = [
            *_channel_options(max_message_mb, keepalive_s, keepalive_timeout_s),
            *(channel_options or ()),
        ]
        if credentials is None and (tls or root_certificates or private_key or certificate_chain):
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_pem(root_certificates),
                private_key=_pem(private_key),
                certificate_chain=_pem(certificate_chain),
            )
        self._credentials = credentials
        self._channel = None
        self._stubs: _Stubs | None = None
        self._init_channel()

    def _init_channel(self) -> None:
        """Open the channel now or leave it for later (AsyncClient: its event loop)."""
        raise NotImplementedError

    @property
    def target(self) -> str:
        return self._target

    def _open(self, channel_module) -> _Stubs:
        """The stubs, opening the channel with ``channel_module`` (grpc or grpc.aio) first
        when none is open."""
        if self._stubs is None:
            if self._credentials is not None:
                self._channel = channel_module.secure_channel(
                    self._target, self._credentials, self._channel_options
                )
            else:
                self._channel = channel_module.insecure_channel(self._target, self._channel_options)
            self._stubs = _Stubs(self._channel)
        return self._stubs

    def _call(self, timeout: float | None, metadata: Metadata | None) -> _Call:
        """A call under the client's defaults: ``timeout`` replaces the client's, ``metadata``
        adds to it."""
        t = self._timeout if timeout is None else timeout
        deadline = time.monotonic() + t if t is not None else None
        return _Call(self._retry, deadline, self._metadata + tuple(metadata or ()))


# ---------------------------------------------------------------- the blocking client


class Client(_ClientBase):
    """A blocking client of a kvmesh worker (or router): ``target`` is ``host:port``.

    ``timeout`` and ``metadata`` are defaults for every call, each call may override or add
    to them. TLS: pass ``credentials``, or ``tls=True`` and/or PEM ``root_certificates``
    (client auth: ``private_key`` and ``certificate_chain``); each PEM is bytes or a path.
    ``token``: a bearer token sent with every call (``authorization: Bearer <token>``; use
    TLS, a token on a plaintext channel can be read off the network). ``identity``: the
    cluster secret, for an operator's client that calls what only members may (``GetLoad``).
    The channel pings the server every ``keepalive_s`` and fails its calls with UNAVAILABLE
    when no answer comes within ``keepalive_timeout_s`` (a frozen or vanished host).
    Thread-safe; close it (or use ``with``) to release the channel.
    """

    def _init_channel(self) -> None:
        # opened here, not on first use, so that threads sharing the client share one channel
        self._open(grpc)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompt: Prompt,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **sampling,
    ) -> Iterator[GenerateChunk]:
        """Stream a completion as GenerateChunks. Stopping the iteration early (break,
        ``close()``) cancels the call, which aborts the request on the server."""
        req = build_request(prompt, request_id, **sampling)
        want_lp = bool(sampling.get("logprobs"))
        call = self._call(timeout, metadata)
        while True:
            stream = self._stubs.inference.Generate(
                req, timeout=call.timeout(), metadata=call.metadata
            )
            got_any = False
            try:
                for msg in stream:
                    got_any = True
                    yield _chunk(msg, want_lp)
                return
            except grpc.RpcError as e:
                delay = call.retry_delay(e, got_output=got_any)
            finally:
                stream.cancel()  # a no-op once the call has ended
            time.sleep(delay)

    def generate_text(
        self,
        prompt: Prompt,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **sampling,
    ) -> GenerateResult:
        """Run a completion to the end and return it whole."""
        col = _Collector(bool(sampling.get("logprobs")))
        for c in self.generate(
            prompt, request_id=request_id, timeout=timeout, metadata=metadata, **sampling
        ):
            col.add(c)
        return col.done()

    def _unary(self, rpc: _Unary, request, timeout: float | None, metadata: Metadata | None):
        method = rpc.method(self._stubs)
        call = self._call(timeout, metadata)
        while True:
            try:
                response = method(request, timeout=call.timeout(), metadata=call.metadata)
                break
            except grpc.RpcError as e:
                delay = call.retry_delay(e)
            time.sleep(delay)
        return rpc.result(response)

    def abort(
        self, request_id: str, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> bool:
        """Abort a running request; True when the server was running it."""
        return self._unary(_ABORT, pb.AbortRequest(request_id=request_id), timeout, metadata)

    def model_info(
        self, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> ModelInfo:
        return self._unary(_MODEL_INFO, pb.GetModelInfoRequest(), timeout, metadata)

    def get_load(self, *, timeout: float | None = None, metadata: Metadata | None = None) -> Load:
        return self._unary(_GET_LOAD, pb.GetLoadRequest(), timeout, metadata)

    def health(
        self,
        service: str = "",
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> str:
        """The grpc.health.v1 status of ``service`` ("" = the whole server): "SERVING",
        "NOT_SERVING", ... Raises KvmeshError (NOT_FOUND for an unknown service)."""
        req = health_pb2.HealthCheckRequest(service=service)
        return self._unary(_HEALTH, req, timeout, metadata)


# ---------------------------------------------------------------- the asyncio client


class AsyncClient(_ClientBase):
    """The asyncio twin of ``Client``: same arguments, ``async for`` over ``generate`` and
    ``await`` on the rest. It belongs to the event loop it is first used in; the channel is
    opened lazily there. Close it with ``await close()`` or ``async with``."""

    def _init_channel(self) -> None:
        pass  # a grpc.aio channel binds to the running event loop: opened on first use

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stubs = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def generate(
        self,
        prompt: Prompt,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **sampling,
    ) -> AsyncIterator[GenerateChunk]:
        """Stream a completion; leaving the loop early cancels the call and aborts the
        request on the server."""
        stubs = self._open(grpc.aio)
        req = build_request(prompt, request_id, **sampling)
        want_lp = bool(sampling.get("logprobs"))
        call = self._call(timeout, metadata)
        while True:
            stream = stubs.inference.Generate(req, timeout=call.timeout(), metadata=call.metadata)
            got_any = False
            try:
                async for msg in stream:
                    got_any = True
                    yield _chunk(msg, want_lp)
                return
            except grpc.RpcError as e:
                delay = call.retry_delay(e, got_output=got_any)
            finally:
                stream.cancel()
            await asyncio.sleep(delay)

    async def generate_text(
        self,
        prompt: Prompt,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **sampling,
    ) -> GenerateResult:
        col = _Collector(bool(sampling.get("logprobs")))
        async for c in self.generate(
            prompt, request_id=request_id, timeout=timeout, metadata=metadata, **sampling
        ):
            col.add(c)
        return col.done()

    async def _unary(self, rpc: _Unary, request, timeout: float | None, metadata: Metadata | None):
        method = rpc.method(self._open(grpc.aio))
        call = self._call(timeout, metadata)
        while True:
            try:
                response = await method(request, timeout=call.timeout(), metadata=call.metadata)
                break
            except grpc.RpcError as e:
                delay = call.retry_delay(e)
            await asyncio.sleep(delay)
        return rpc.result(response)

    async def abort(
        self, request_id: str, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> bool:
        return await self._unary(_ABORT, pb.AbortRequest(request_id=request_id), timeout, metadata)

    async def model_info(
        self, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> ModelInfo:
        return await self._unary(_MODEL_INFO, pb.GetModelInfoRequest(), timeout, metadata)

    async def get_load(
        self, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> Load:
        return await self._unary(_GET_LOAD, pb.GetLoadRequest(), timeout, metadata)

    async def health(
        self,
        service: str = "",
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> str:
        req = health_pb2.HealthCheckRequest(service=service)
        return await self._unary(_HEALTH, req, timeout, metadata)
