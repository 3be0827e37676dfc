"""The OpenAI-compatible HTTP app, shared by the worker's and the router's front doors.

``build_app(backend)`` returns a FastAPI app (add routes to it: the metrics issue mounts
``/metrics`` this way) whose endpoints translate OpenAI requests into the gRPC path's own
``GenerateRequest`` (token ids, ``SamplingParams``) and hand it to a ``Backend``:

- ``worker/http_api.py``: one engine (AsyncEngine), the way ``InferenceServicer`` runs it;
- ``router/http_api.py``: ``RouterServer.route``, the very routing path gRPC ``Generate`` takes.

Both answer with ``GenerateResponse`` messages, which this module turns into OpenAI bodies or
server-sent events (framed by FastAPI's ``format_sse_event``). Text prompts and chat messages
are tokenized here, once, with the model's tokenizer and chat template, so the router hashes
the very tokens the worker computes and ``usage.prompt_tokens`` is exact.

Before any endpoint, one ASGI guard (``_Guard``) checks the client's bearer token when the
server has client tokens (every path but ``GET /health``, ``/metrics`` included: its counters
tell whether someone sent a prefix) and refuses a body larger than the gRPC message limit
before it is parsed.

``HttpServer`` serves an app with uvicorn on the caller's running event loop (uvloop in kvmesh's
servers), beside the gRPC server on that loop, over TLS when the process serves TLS. Field by
field, docs/http.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import ssl
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.sse import format_sse_event
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvmesh.protos.kvmesh.v1 import inference_pb2 as ipb
from kvmesh.protos.openai import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    usage_dict,
)
from kvmesh.protos.security import BearerTokens, TLSConfig, check_bearer

logger = logging.getLogger("kvmesh.http")

__all__ = [
    "MAX_CHOICES",
    "Backend",
    "HttpServer",
    "SESSION_HEADER",
    "Tokenizer",
    "build_app",
    "server_ssl_context",
]

SESSION_HEADER = "kvmesh-session"  # sticky-session key for the router's policy, as over gRPC
_UNLIMITED = 2**31 - 1  # max_tokens when none is given: the engine stops at max_model_len
MAX_CHOICES = 128  # prompts x n of one request: each choice is an engine request of its own
OPEN_PATHS = ("/health",)  # GET only: load balancers' probes carry no token


class Tokenizer(Protocol):
    """What the app needs of a tokenizer (``kvmesh.worker.tokenizer.Tokenizer`` fits)."""

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...
    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True
    ) -> str: ...


class Backend(Protocol):
    """One front door's engine side. ``generate`` raises ``APIError`` for a request that
    cannot run (before or during its stream); leaving its iterator early aborts the request."""

    model: str  # the served model name (``/v1/models``; requests naming another get a 404)
    tokenizer: Tokenizer | None

    def unavailable(self) -> str | None:
        """Why no request can be served now (shutting down, no worker, a dead engine)."""

    async def max_model_len(self) -> int | None: ...

    def generate(
        self, request: ipb.GenerateRequest, session: str | None
    ) -> AsyncIterator[ipb.GenerateResponse]: ...


# ---------------------------------------------------------------- the app


def build_app(
    backend: Backend,
    *,
    title: str = "kvmesh",
    tokens: BearerTokens | None = None,
    max_body_bytes: int | None = None,
    max_choices: int = MAX_CHOICES,
) -> FastAPI:
    """The OpenAI-compatible app over ``backend`` (docs/http.md).

    ``tokens``: when set, every request but ``GET /health`` needs ``Authorization: Bearer
    <one of them>`` (401 otherwise), routes added later (``/metrics``) included.
    ``max_body_bytes``: a larger body is refused with 413 before it is parsed (None: no
    limit). ``max_choices``: the most prompts x ``n`` one request may ask for (400)."""
    if max_body_bytes is not None and max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1 or None, got {max_body_bytes}")
    if max_choices < 1:
        raise ValueError(f"max_choices must be >= 1, got {max_choices}")
    app = FastAPI(title=title, docs_url=None, redoc_url=None)
    api = _Api(backend, max_choices)
    app.state.backend = backend
    app.add_middleware(_Guard, tokens=tokens, max_body_bytes=max_body_bytes)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _api_error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(exc.status_code, str(exc.detail))
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    @app.get("/health")
    async def health() -> Response:
        why = backend.unavailable()
        if why is not None:
            return _api_error_response(APIError(503, why))
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict:
        card: dict[str, Any] = {
            "id": backend.model,
            "object": "model",
            "created": api.created,
            "owned_by": "kvmesh",
            "root": backend.model,
        }
        n = await backend.max_model_len()
        if n is not None:
            card["max_model_len"] = n
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await api.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await api.chat(body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        api.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            text = await api.template(body.messages, body.add_generation_prompt)
        else:
            text = body.prompt
        ids = await api.encode(text)
        out: dict[str, Any] = {"count": len(ids), "tokens": ids}
        n = await backend.max_model_len()
        if n is not None:
            out["max_model_len"] = n
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        api.check_model(body.model)
        tok = api.need_tokenizer("tokens")
        try:
            text = await asyncio.to_thread(tok.decode, body.tokens, False)
        except Exception as e:  # an id outside the vocabulary
            raise APIError(400, f"cannot detokenize: {e}", param="tokens") from None
        return {"prompt": text}

    return app


def _api_error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers())


class _Guard:
    """ASGI middleware in front of every route: the bearer token (when the server has client
    tokens; compared in constant time by ``check_bearer``), then the body's size. A body is
    read here, at most ``max_body_bytes`` of it, and handed on whole; the receive channel is
    the client's again afterwards, so a handler still sees the client disconnect."""

    def __init__(self, app, tokens: BearerTokens | None, max_body_bytes: int | None) -> None:
        self.app = app
        self.tokens = tokens
        self.max_body = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.tokens is not None and not (
            scope["method"] in ("GET", "HEAD") and scope["path"] in OPEN_PATHS
        ):
            auth = _header(scope, b"authorization")
            if not check_bearer(auth, self.tokens):
                why = "a bearer token is required" if not auth else "invalid bearer token"
                err = APIError(
                    401,
                    f"{why}: send 'Authorization: Bearer <token>' (the openai client's api_key)",
                    code="invalid_api_key",
                )
                resp = _api_error_response(err)
                resp.headers["WWW-Authenticate"] = "Bearer"
                await resp(scope, receive, send)
                return
        if self.max_body is None:
            await self.app(scope, receive, send)
            return
        too_big = APIError(
            413,
            f"the request body is larger than this server's limit of {self.max_body} bytes "
            "(the gRPC message limit)",
        )
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            await _api_error_response(too_big)(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # the client left while sending
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                await _api_error_response(too_big)(scope, receive, send)
                return
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _header(scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return v.decode("latin-1")
    return None


def _validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's 422 as OpenAI's 400, naming the first bad field."""
    errs = exc.errors()
    if not errs:
        return APIError(400, "invalid request")
    e = errs[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    # a union's failed branch appears as a location part ("str", "list[int]"): drop those
    loc = [x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int")]
    param = ".".join(loc) or None
    if e.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {e.get('msg')}", param=None)
    msg = e.get("msg", "invalid value")
    return APIError(400, f"{param}: {msg}" if param else msg, param=param)


class _Choice:
    """One choice's stream folded into its final state."""

    __slots__ = ("text", "token_ids", "logprobs", "tops", "finish_reason", "final")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[ipb.TopLogprobs] = []
        self.finish_reason: str | None = None
        self.final: ipb.GenerateResponse | None = None


class _Api:
    def __init__(self, backend: Backend, max_choices: int = MAX_CHOICES) -> None:
        self.b = backend
        self.max_choices = max_choices
        self.created = int(time.time())

    # ------------------------------------------------------------ checks and prompts

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.b.model:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.b.model!r}",
                param="model",
                code="model_not_found",
            )

    def check_choices(self, prompts: int, n: int) -> None:
        """Each choice is an engine request of its own: bound them per HTTP request."""
        if prompts * n > self.max_choices:
            raise APIError(
                400,
                f"{prompts} prompts x n={n} asks for {prompts * n} choices; at most "
                f"{self.max_choices} per request",
                param="prompt" if prompts > self.max_choices or n == 1 else "n",
            )

    def need_tokenizer(self, param: str) -> Tokenizer:
        if self.b.tokenizer is None:
            raise APIError(
                400, "this model has no tokenizer: send prompts as token ids", param=param
            )
        return self.b.tokenizer

    async def encode(self, text: str) -> list[int]:
        tok = self.need_tokenizer("prompt")
        return await asyncio.to_thread(tok.encode, text)  # off the loop: ms for a long one

    async def template(self, messages: list[ChatMessage], add_generation_prompt: bool) -> str:
        tok = self.need_tokenizer("messages")
        rows = []
        for i, m in enumerate(messages):
            if isinstance(m.content, list):
                bad = [p.type for p in m.content if p.type != "text"]
                if bad:
                    raise APIError(
                        400,
                        f"content parts of type {bad[0]!r} are not supported; accepted: text",
                        param=f"messages.{i}.content",
                    )
            if m.tool_calls:
                raise APIError(400, "tool calls are not supported", param=f"messages.{i}")
            rows.append({"role": m.role, "content": m.text()})
        try:
            return await asyncio.to_thread(tok.apply_chat_template, rows, add_generation_prompt)
        except Exception as e:  # no template, or the template refused the messages
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from None

    def sampling(
        self, body, max_tokens: int | None, logprobs: bool, top_logprobs: int = 0
    ) -> ipb.SamplingParams:
        """The gRPC SamplingParams for ``body``; rejects what kvmesh cannot honour."""
        _reject_unsupported(body)
        sp = ipb.SamplingParams(
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            max_tokens=max_tokens if max_tokens is not None else _UNLIMITED,
        )
        # OpenAI's default temperature is 1, as the engine's
        for name in ("temperature", "top_p", "top_k", "seed"):
            v = getattr(body, name)
            if v is not None:
                setattr(sp, name, v)
        sp.stop.extend(body.stop_list())
        if body.stop_token_ids:
            sp.stop_token_ids.extend(body.stop_token_ids)
        if body.cache_salt is not None:
            if not _proto_has("cache_salt"):
                raise APIError(400, "cache_salt is not supported yet", param="cache_salt")
            sp.cache_salt = body.cache_salt
        sp.min_tokens = body.min_tokens
        if body.kv_budget is not None:
            sp.kv_budget = body.kv_budget
        if body.kv_policy is not None:
            sp.kv_policy = body.kv_policy
        return sp

    # ------------------------------------------------------------ the endpoints

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        _warn_extras(body, "/v1/completions")
        for name, bad in (("echo", body.echo), ("suffix", body.suffix is not None)):
            if bad:
                raise APIError(400, f"{name} is not supported", param=name)
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "the prompt is empty", param="prompt")
        self.check_choices(len(prompts), body.n)
        # OpenAI's logprobs=N: each sampled token's logprob and the N most likely tokens
        sp = self.sampling(body, body.max_tokens, body.logprobs is not None, body.logprobs or 0)
        ids_list = []
        for p in prompts:
            ids = await self.encode(p) if isinstance(p, str) else list(p)
            if not ids:
                raise APIError(400, "the prompt is empty", param="prompt")
            ids_list.append(ids)
        rid = f"cmpl-{uuid.uuid4().hex}"
        return await self._respond(request, body, rid, "completion", ids_list, sp)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        _warn_extras(body, "/v1/chat/completions")
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if body.tools:
            raise APIError(400, "tools are not supported", param="tools")
        if body.tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice is not supported", param="tool_choice")
        if body.response_format is not None and body.response_format.type != "text":
            raise APIError(
                400,
                f"response_format {body.response_format.type!r} is not supported; accepted: text",
                param="response_format",
            )
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        self.check_choices(1, body.n)
        max_tokens = body.max_completion_tokens or body.max_tokens
        sp = self.sampling(body, max_tokens, body.logprobs, body.top_logprobs or 0)
        text = await self.template(body.messages, body.add_generation_prompt)
        ids = await self.encode(text)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        return await self._respond(request, body, rid, "chat", [ids], sp)

    # ------------------------------------------------------------ running the choices

    def _streams(
        self, rid: str, ids_list: list[list[int]], sp: ipb.SamplingParams, n: int, session
    ) -> list[AsyncIterator[ipb.GenerateResponse]]:
        """One stream per choice: prompt p's choices are indexes p*n .. p*n+n-1. With a seed
        and n > 1, choice i uses seed + i, so the choices differ but stay reproducible."""
        out = []
        for p, ids in enumerate(ids_list):
            for j in range(n):
                s = ipb.SamplingParams()
                s.CopyFrom(sp)
                if j and sp.HasField("seed"):
                    s.seed = (sp.seed + j) % 2**63
                req = ipb.GenerateRequest(
                    token_ids=ipb.TokenIds(ids=ids), sampling=s, request_id=f"{rid}-{p * n + j}"
                )
                out.append(self.b.generate(req, session))
        return out

    async def _respond(self, request: Request, body, rid, kind, ids_list, sp) -> Response:
        session = request.headers.get(SESSION_HEADER)
        if body.user:
            logger.debug("request %s for user %r", rid, body.user)
        streams = self._streams(rid, ids_list, sp, body.n, session)
        fmt = _Format(self.b.tokenizer, kind, rid, self.b.model, sp.logprobs, body.n)
        events = _merge(streams)
        if not body.stream:
            choices = [_Choice() for _ in streams]
            try:
                await _unless_disconnected(request, _fold(events, choices))
            except _ClientGone:
                logger.info("request %s: the client went away; aborted", rid)
                return Response(status_code=499)
            finally:
                # a choice that failed (finish_reason error) raises out of _fold with the
                # other choices still running: closing aborts them (and, on the router, ends
                # route(), which releases the request) before the error is answered
                await events.aclose()
            return JSONResponse(fmt.full(choices))
        # the first event decides between a stream and an error response: a request refused
        # before any token (queue full, no worker, a prompt too long) gets its status code
        try:
            first = await _unless_disconnected(request, anext(events, None))
        except _ClientGone:
            await events.aclose()
            return Response(status_code=499)
        except BaseException:
            await events.aclose()
            raise
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _sse(fmt, events, first, len(streams), include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )


async def _fold(events: AsyncIterator[tuple[int, ipb.GenerateResponse]], choices) -> None:
    async for i, msg in events:
        c = choices[i]
        c.text.append(msg.text)
        c.token_ids.extend(msg.token_ids)
        c.logprobs.extend(msg.logprobs)
        c.tops.extend(msg.top_logprobs)
        if msg.finished:
            _raise_if_failed(msg)
            c.finish_reason = msg.finish_reason or None
            c.final = msg


def _raise_if_failed(msg: ipb.GenerateResponse) -> None:
    if msg.finish_reason == "error":
        raise APIError(500, f"the request failed on worker {msg.worker_id}: {msg.error}")


async def _sse(fmt, events, first, n_choices: int, include_usage: bool) -> AsyncIterator[bytes]:
    """The stream's events: one chunk per GenerateResponse, the usage chunk when asked, then
    ``[DONE]``. An error after the stream began is sent as OpenAI's error JSON inside it."""
    finals: dict[int, ipb.GenerateResponse] = {}
    started: set[int] = set()
    try:
        item = first
        while item is not None:
            i, msg = item
            if msg.finished:
                _raise_if_failed(msg)
                finals[i] = msg
            yield _event(fmt.chunk(i, msg, i not in started, include_usage))
            started.add(i)
            item = await anext(events, None)
        if include_usage:
            yield _event(fmt.usage_chunk(finals))
    except APIError as e:
        yield _event(e.body())
    except Exception as e:  # a failure mid-stream: the client gets it, the server goes on
        logger.exception("stream %s failed", fmt.rid)
        yield _event(APIError(500, f"internal error: {e!r}").body())
    finally:
        await events.aclose()  # a client gone (cancelled here) aborts every choice
    yield format_sse_event(data_str="[DONE]")


def _event(obj: dict) -> bytes:
    return format_sse_event(data_str=json.dumps(obj, separators=(",", ":")))


async def _merge(
    streams: list[AsyncIterator[ipb.GenerateResponse]],
) -> AsyncIterator[tuple[int, ipb.GenerateResponse]]:
    """(choice index, message) from every stream as they come. Closing the merged iterator
    (or an error in one stream) closes every stream, which aborts their requests."""
    if len(streams) == 1:
        s = streams[0]
        try:
            async for msg in s:
                yield 0, msg
        finally:
            await s.aclose()
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: AsyncIterator) -> None:
        try:
            async for msg in s:
                q.put_nowait((i, msg, None))
            q.put_nowait((i, None, None))
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            q.put_nowait((i, None, e))
        finally:
            await s.aclose()

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, msg, err = await q.get()
            if err is not None:
                raise err
            if msg is None:
                left -= 1
                continue
            yield i, msg
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _ClientGone(Exception):
    pass


async def _unless_disconnected(request: Request, aw):
    """Await ``aw`` unless the client disconnects first: then cancel it (which aborts its
    requests) and raise _ClientGone. The body has been read, so the next ASGI message is
    the disconnect."""
    work = asyncio.ensure_future(aw)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
            with contextlib.suppress(BaseException):
                await work
            watch.cancel()
            raise _ClientGone
        watch.cancel()
    return work.result()


# ---------------------------------------------------------------- response bodies


class _Format:
    """OpenAI's bodies for one request: ``kind`` is ``completion`` or ``chat``."""

    def __init__(
        self, tok: Tokenizer | None, kind: str, rid: str, model: str, logprobs: bool, n: int
    ) -> None:
        self.tok = tok
        self.n = n  # choices per prompt
        self.kind = kind
        self.rid = rid
        self.model = model
        self.want_logprobs = logprobs
        self.created = int(time.time())
        self.obj = "text_completion" if kind == "completion" else "chat.completion"
        self._offsets: dict[int, int] = {}  # completions' text_offset, per choice

    def _token_text(self, tid: int) -> str:
        return self.tok.decode([tid], skip_special_tokens=False) if self.tok else ""

    def _logprobs(
        self, i: int, token_ids: Sequence[int], lps: Sequence[float], tops: Sequence
    ) -> dict | None:
        """OpenAI's logprobs of choice ``i``'s new tokens; ``tops``: their TopLogprobs."""
        if not self.want_logprobs:
            return None
        texts = [self._token_text(t) for t in token_ids]
        alts = [
            [(self._token_text(t), v) for t, v in zip(top.token_ids, top.logprobs)] for top in tops
        ]
        if self.kind == "chat":
            return {
                "content": [
                    {
                        "token": s,
                        "logprob": lp,
                        "bytes": list(s.encode()),
                        "top_logprobs": [
                            {"token": a, "logprob": v, "bytes": list(a.encode())}
                            for a, v in (alts[j] if j < len(alts) else ())
                        ],
                    }
                    for j, (s, lp) in enumerate(zip(texts, lps))
                ]
            }
        offsets = []
        at = self._offsets.get(i, 0)
        for s in texts:
            offsets.append(at)
            at += len(s)
        self._offsets[i] = at
        return {
            "tokens": texts,
            "token_logprobs": list(lps),
            # the legacy shape: per position, {token text: logprob} of the most likely tokens
            "top_logprobs": [dict(a) for a in alts] if alts else None,
            "text_offset": offsets,
        }

    def _usage(self, finals: dict[int, ipb.GenerateResponse]) -> dict:
        """Each prompt counts once (OpenAI's way for n > 1), with its first choice's cached
        tokens; completion tokens are the sum over every choice."""
        firsts: dict[int, ipb.GenerateResponse] = {}
        for i in sorted(finals):
            firsts.setdefault(i // self.n, finals[i])
        tiers: dict[str, int] = {}
        for f in firsts.values():
            for t, k in f.usage.cached_tokens_by_tier.items():
                tiers[t] = tiers.get(t, 0) + k
        return usage_dict(
            sum(f.usage.prompt_tokens for f in firsts.values()),
            sum(f.usage.completion_tokens for f in finals.values()),
            sum(f.usage.cached_tokens for f in firsts.values()),
            tiers,
        )

    def full(self, choices: list[_Choice]) -> dict:
        out = []
        for i, c in enumerate(choices):
            lp = self._logprobs(i, c.token_ids, c.logprobs, c.tops)
            text = "".join(c.text)
            if self.kind == "chat":
                out.append(
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": lp,
                        "finish_reason": c.finish_reason,
                    }
                )
            else:
                out.append(
                    {"index": i, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}
                )
        usage = self._usage({i: c.final for i, c in enumerate(choices) if c.final is not None})
        return {
            "id": self.rid,
            "object": self.obj,
            "created": self.created,
            "model": self.model,
            "choices": out,
            "usage": usage,
        }

    def chunk(self, i: int, msg: ipb.GenerateResponse, first: bool, include_usage: bool) -> dict:
        lp = self._logprobs(i, msg.token_ids, msg.logprobs, msg.top_logprobs)
        finish = (msg.finish_reason or None) if msg.finished else None
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if msg.text or first:
                delta["content"] = msg.text
            choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": i, "text": msg.text, "logprobs": lp, "finish_reason": finish}
            obj = "text_completion"
        out = {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, finals: dict[int, ipb.GenerateResponse]) -> dict:
        return {
            "id": self.rid,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": self._usage(finals),
        }


# ---------------------------------------------------------------- field checks

_PENALTIES = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}


def _reject_unsupported(body) -> None:
    for name, neutral in _PENALTIES.items():
        v = getattr(body, name)
        if v is not None and v != neutral:
            raise APIError(
                400, f"{name} is not supported (only its neutral value {neutral})", param=name
            )
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of is not supported (only best_of == n)", param="best_of")


def _warn_extras(body, endpoint: str) -> None:
    extra = sorted(body.model_extra or ())
    if body.stream_options is not None:
        extra += [f"stream_options.{k}" for k in sorted(body.stream_options.model_extra or ())]
    if extra:
        logger.warning("%s: ignoring fields kvmesh does not know: %s", endpoint, extra)


def _proto_has(field: str) -> bool:
    return field in ipb.SamplingParams.DESCRIPTOR.fields_by_name


# ---------------------------------------------------------------- serving


class _Server:
    """uvicorn's Server, minus its signal handling: the process that hosts the gRPC server
    owns SIGTERM and drains both."""

    def __new__(cls, config):
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                yield

        return Server(config)


def server_ssl_context(tls: TLSConfig) -> ssl.SSLContext:
    """The HTTP port's TLS: ``tls``'s certificate and key, and, when the gRPC side requires
    client certificates (``client_ca``), the same requirement (mutual TLS). The ssl module
    loads a certificate chain from files only: the PEM bytes pass through a private
    temporary directory, removed at once."""
    if not tls.serves:
        raise ValueError("serving TLS needs a certificate and its key")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory(prefix="kvmesh-tls-") as d:  # mode 0700
        cert, key = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
        for path, data in ((cert, tls.cert), (key, tls.key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        ctx.load_cert_chain(cert, key)
    if tls.client_ca is not None:
        ctx.load_verify_locations(cadata=tls.client_ca.decode())
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class HttpServer:
    """Serve ``app`` with uvicorn on the running event loop (``await start()`` from that
    loop, e.g. beside a gRPC server on its ServerThread). ``port`` 0 picks a free one.
    ``tls``: when it serves (a certificate and key), HTTPS with it, requiring client
    certificates when it has a ``client_ca``."""

    def __init__(
        self, app, host: str = "127.0.0.1", port: int = 0, tls: TLSConfig | None = None
    ) -> None:
        self.app = app
        self.host, self.port = host, port
        self.ssl = server_ssl_context(tls) if tls is not None and tls.serves else None
        self._server = None
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        import uvicorn

        family = socket.AF_INET6 if ":" in self.host.strip("[]") else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host.strip("[]"), self.port))
        except OSError as e:
            sock.close()
            raise OSError(f"cannot bind HTTP {self.host}:{self.port}: {e}") from None
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            loop="none",  # the caller's loop (uvloop)
            lifespan="off",
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=1,
            timeout_keep_alive=30,
            ssl_context_factory=(lambda config, default: self.ssl) if self.ssl else None,
        )
        self._server = _Server(config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # its error
                raise OSError(f"the HTTP server on {self.host}:{self.port} did not start")
            await asyncio.sleep(0.01)
        scheme = "HTTPS" if self.ssl is not None else "HTTP"
        logger.info("%s (OpenAI API) serving on %s:%d", scheme, self.host, self.port)
        return self.port

    async def stop(self) -> None:
        """Stop accepting, close connections (open streams are cancelled after uvicorn's
        1 s grace: the caller drains first), and return when stopped. Idempotent."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await self._task
        self._server = None
