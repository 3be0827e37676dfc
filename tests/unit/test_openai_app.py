"""The OpenAI-compatible app over a scripted backend (no engine): several prompts times n
choices and their usage, an error before a stream (its status code) and after it began
(OpenAI's error JSON inside the stream, then [DONE]), the 400/404 shapes and the fields
kvmesh rejects by name."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Counter

from kvmesh.protos.kvmesh.v1 import inference_pb2 as ipb
from kvmesh.protos.metrics import add_metrics_route
from kvmesh.protos.openai import APIError, grpc_status_to_http
from kvmesh.protos.openai_app import build_app
from kvmesh.protos.security import BearerTokens
from kvmesh.router.http_api import RouterBackend

QUEUE_FULL, FAILS_MID_STREAM = 900, 901  # first prompt token ids that script a failure
ONE_CHOICE_ERRS = 902  # choice 0 ends with finish_reason error, the others run until closed
TOKENS = ["tenant-a-token-0123456789", "tenant-b-token-9876543210"]


class Tok:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


class Backend:
    """Streams tokens 'a', 'b', ... one per response; prompts starting with the ids above
    fail before the first token or after the second."""

    model = "m"
    tokenizer = Tok()

    def __init__(self) -> None:
        self.seen: list[ipb.GenerateRequest] = []
        self.open: set[str] = set()  # request ids whose stream has not been closed

    def unavailable(self) -> str | None:
        return None

    async def max_model_len(self) -> int | None:
        return 128

    async def generate(self, request: ipb.GenerateRequest, session=None):
        self.seen.append(request)
        ids = list(request.token_ids.ids)
        if ids[0] == QUEUE_FULL:
            raise APIError(429, "the waiting queue is full")
        if ids[0] == ONE_CHOICE_ERRS:
            rid = request.request_id
            self.open.add(rid)
            try:
                if rid.endswith("-0"):
                    await asyncio.sleep(0.01)  # the other choice is running by now
                    yield ipb.GenerateResponse(
                        request_id=rid, finished=True, finish_reason="error", error="boom"
                    )
                    return
                while True:  # a long generation, until its stream is closed (an abort)
                    yield ipb.GenerateResponse(request_id=rid, token_ids=[97], text="a")
                    await asyncio.sleep(0.001)
            finally:
                self.open.discard(rid)
        n = request.sampling.max_tokens
        for k in range(n):
            if ids[0] == FAILS_MID_STREAM and k == 2:
                raise APIError(503, "worker w1 failed: gone")
            msg = ipb.GenerateResponse(
                request_id=request.request_id, token_ids=[97 + k], text=chr(97 + k)
            )
            if k == n - 1:
                msg.finished, msg.finish_reason = True, "length"
                msg.usage.prompt_tokens = len(ids)
                msg.usage.completion_tokens = n
                msg.usage.cached_tokens = 16 if len(ids) > 16 else 0
                msg.usage.cached_tokens_by_tier["device"] = msg.usage.cached_tokens
            yield msg


@pytest.fixture()
def backend():
    return Backend()


@pytest.fixture()
def client(backend):
    with TestClient(build_app(backend)) as c:
        yield c


def events(text: str) -> list[str]:
    return [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]


def test_prompts_times_n_and_their_usage(client, backend):
    body = {"model": "m", "prompt": [[1] * 20, [2] * 5], "n": 2, "max_tokens": 3}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert {c["text"] for c in out["choices"]} == {"abc"}
    # each prompt once, every choice's tokens, the first choice's cached tokens per prompt
    assert out["usage"]["prompt_tokens"] == 25
    assert out["usage"]["completion_tokens"] == 12
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
    assert out["usage"]["cached_tokens_by_tier"] == {"device": 16}
    assert [list(r.token_ids.ids)[0] for r in backend.seen] == [1, 1, 2, 2]
    assert len({r.request_id for r in backend.seen}) == 4


def test_chat_template_and_sampling_reach_the_backend(client, backend):
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_completion_tokens": 2,
        "temperature": 0,
        "seed": 5,
        "n": 2,
        "stop": "x",
        "top_k": 3,
        "ignore_eos": True,
        "min_tokens": 1,
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "ab"}
    first, second = backend.seen
    assert list(first.token_ids.ids) == Tok().encode("<user>hi<assistant>")
    sp = first.sampling
    assert (sp.max_tokens, sp.temperature, sp.top_k, list(sp.stop)) == (2, 0, 3, ["x"])
    assert sp.ignore_eos and sp.min_tokens == 1 and sp.seed == 5
    assert second.sampling.seed == 6  # choice j samples with seed + j


def test_an_error_before_the_stream_keeps_its_status(client):
    for stream in (False, True):
        body = {"model": "m", "prompt": [QUEUE_FULL, 1], "stream": stream}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"


def test_an_error_after_the_stream_began_is_sent_inside_it(client):
    body = {"model": "m", "prompt": [FAILS_MID_STREAM], "max_tokens": 5, "stream": True}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200
    data = events(r.text)
    assert [json.loads(d)["choices"][0]["text"] for d in data[:2]] == ["a", "b"]
    err = json.loads(data[2])["error"]
    assert err["type"] == "service_unavailable_error" and "gone" in err["message"]
    assert data[3:] == ["[DONE]"]


def test_stream_with_usage_and_n(client):
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    data = events(client.post("/v1/chat/completions", json=body).text)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    firsts = [c["choices"][0] for c in chunks[:-1] if "role" in c["choices"][0]["delta"]]
    assert sorted(c["index"] for c in firsts) == [0, 1]
    assert all(c["usage"] is None for c in chunks[:-1])


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "temperature": -0.5}, "temperature"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
        ({"prompt": "x", "frequency_penalty": 1}, "frequency_penalty"),
        ({"prompt": "x", "repetition_penalty": 1.2}, "repetition_penalty"),
        ({"prompt": "x", "logit_bias": {"5": 1}}, "logit_bias"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({}, "prompt"),
    ],
)
def test_completions_rejects_by_name(client, body, param):
    r = client.post("/v1/completions", json={"model": "m", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"messages": []}, "messages"),
    ],
)
def test_chat_rejects_by_name(client, extra, param):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_unknown_model_path_and_fields(client, caplog):
    r = client.post("/v1/completions", json={"model": "other", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = client.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    with caplog.at_level("WARNING", logger="kvmesh.http"):
        r = client.post("/v1/completions", json={"model": "m", "prompt": "x", "frobnicate": 1})
    assert r.status_code == 200 and "frobnicate" in caplog.text


def test_grpc_codes_map_to_http():
    assert [
        grpc_status_to_http(c)
        for c in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED")
    ] == [400, 429, 503, 504]
    assert grpc_status_to_http("INTERNAL") == 500
    assert APIError(503, "x").headers() == {"Retry-After": "1"}
    assert APIError(400, "x").headers() == {}


# ---------------------------------------------------------------- the guard and the bounds


class RouterStub:
    """What ``RouterBackend`` needs of a RouterServer: ``route``, here over the scripted
    backend, keeping ``active`` as the real one does (released in its ``finally``)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.active: set[str] = set()

    async def route(self, ids, sampling, request_id="", *, session=None):
        req = ipb.GenerateRequest(
            token_ids=ipb.TokenIds(ids=ids), sampling=sampling, request_id=request_id
        )
        self.active.add(request_id)
        try:
            async for msg in self.backend.generate(req):
                yield msg
        finally:
            self.active.discard(request_id)  # RouterServer.route: core.release, active


@pytest.mark.parametrize("front", ["worker", "router"])
def test_a_failed_choice_closes_the_others_before_the_error_is_answered(backend, front):
    """n=2, choice 0 ends with finish_reason error: the 500 is answered only once choice 1's
    stream is closed (its request aborted) and, through the router, once route() has
    released both requests. Measured when the app returns, before the loop runs anything
    else (a garbage-collected generator would be closed later, by the loop)."""
    router = RouterStub(backend)
    app = build_app(backend if front == "worker" else RouterBackend(router, "m", Tok()))
    at_return = []

    async def recording(scope, receive, send):
        await app(scope, receive, send)
        if scope["type"] == "http":
            at_return.append((set(backend.open), set(router.active)))

    with TestClient(recording) as c:
        r = c.post("/v1/completions", json={"model": "m", "prompt": [ONE_CHOICE_ERRS], "n": 2})
    assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
    assert at_return == [(set(), set())]
    assert {q.request_id[-2:] for q in backend.seen} == {"-0", "-1"}


def guarded(backend, **kw) -> TestClient:
    app = build_app(backend, **kw)
    registry = CollectorRegistry()
    Counter("kvmesh:prefix_cache_hits", "hits", registry=registry).inc(3)
    add_metrics_route(app, registry)  # added after build_app, as the servers do
    return TestClient(app)


def test_tokens_guard_every_path_but_health(backend):
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    with guarded(backend, tokens=BearerTokens(TOKENS)) as c:
        for headers in (
            {},
            {"Authorization": "Bearer wrong-token-0123456789"},
            {"Authorization": TOKENS[0]},
        ):
            for method, path in [
                ("POST", "/v1/completions"),
                ("GET", "/v1/models"),
                ("POST", "/tokenize"),
                ("GET", "/metrics"),
                ("GET", "/v1/nothing"),
            ]:
                r = c.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (path, headers, r.text)
                err = r.json()["error"]
                assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
                assert set(err) == {"message", "type", "param", "code"}
                assert r.headers["www-authenticate"] == "Bearer"
        assert backend.seen == []  # nothing reached the backend
        assert c.get("/health").status_code == 200  # probes carry no token
        for tok in TOKENS:  # either token of the file; the scheme's case does not matter
            for scheme in ("Bearer", "bearer"):
                h = {"Authorization": f"{scheme} {tok}"}
                assert c.post("/v1/completions", json=body, headers=h).status_code == 200
                r = c.get("/metrics", headers=h)
                assert r.status_code == 200 and "kvmesh:prefix_cache_hits_total 3.0" in r.text
    with guarded(backend) as c:  # no tokens: open, as before
        assert c.post("/v1/completions", json=body).status_code == 200
        assert c.get("/metrics").status_code == 200


def test_a_body_over_the_limit_is_413_before_parsing(backend):
    limit = 1000
    with guarded(backend, max_body_bytes=limit) as c:
        big = {"model": "m", "prompt": "x" * limit, "max_tokens": 2}
        r = c.post("/v1/completions", json=big)
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and str(limit) in err["message"]
        # no Content-Length (chunked): counted while read
        chunks = (b'{"model": "m", "prompt": "' + b"x" * 200 for _ in range(10))
        r = c.post("/v1/completions", content=chunks, headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        # not even valid JSON: the size is checked first
        r = c.post("/v1/chat/completions", content=b"{" * (limit + 1))
        assert r.status_code == 413
        assert backend.seen == []
        ok = {"model": "m", "prompt": "x" * 100, "max_tokens": 2}
        assert c.post("/v1/completions", json=ok).status_code == 200
        assert c.post("/v1/completions", content=b"{nope").status_code == 400


def test_prompts_times_n_is_bounded(backend):
    with guarded(backend, max_choices=8) as c:
        r = c.post("/v1/completions", json={"model": "m", "prompt": [[1]] * 9})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = c.post("/v1/completions", json={"model": "m", "prompt": [[1]] * 3, "n": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 9}
        r = c.post("/v1/chat/completions", json=chat)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        assert backend.seen == []
        r = c.post(
            "/v1/completions", json={"model": "m", "prompt": [[1]] * 4, "n": 2, "max_tokens": 1}
        )
        assert r.status_code == 200 and len(r.json()["choices"]) == 8
    # the default: 128 choices
    with guarded(Backend()) as c:
        r = c.post("/v1/completions", json={"model": "m", "prompt": [[1]] * 65, "n": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
