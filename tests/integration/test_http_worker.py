"""The OpenAI-compatible HTTP API of one worker (``kvmesh worker --http-port``), driven by the
official ``openai`` client (sync and async) and by raw ``httpx`` for the error paths, against
a real WorkerServer (gRPC and HTTP on one loop) with the real SmolLM2 model. The oracle is the
gRPC SDK on the same server: the same prompt gives the same greedy tokens either way."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest
from helpers import wait_until

from kvmesh.cluster import Client
from kvmesh.worker import LLMEngine
from kvmesh.worker.server import WorkerServer

MODEL = "smollm2-135m-instruct"
ENGINE_ARGS = dict(kv_cache_memory="256MiB", max_num_batched_tokens=512, max_num_seqs=64)
PROMPT = "The three primary colors are"
CHAT = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Name a fruit that is yellow."},
]


@pytest.fixture(scope="module")
def server(smol_src):
    srv = WorkerServer(LLMEngine(MODEL, **ENGINE_ARGS), http_port=0, data_plane=False)
    srv.start_in_thread()
    yield srv
    srv.stop_in_thread(grace=0)


@pytest.fixture(scope="module")
def base(server) -> str:
    return f"http://127.0.0.1:{server.http.port}"


@pytest.fixture(scope="module")
def oai(base):
    with openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def grpc_client(server):
    with Client(server.address, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tok(server):
    return server.engine.engine.tokenizer


def engine_stats(server):
    from kvmesh.worker.engine import LLMEngine as E

    return server.engine.call(E.stats)


def aborted(server) -> float:
    """The engine's count of requests finished as aborted (its Prometheus counter)."""
    m = server.engine.engine.metrics
    labels = {**m.labels, "finished_reason": "abort"}
    return m.registry.get_sample_value("kvmesh:request_success_total", labels)


def idle(server, free_pages: int) -> bool:
    s = engine_stats(server)
    return (
        s.num_requests_running == 0
        and s.num_requests_waiting == 0
        and (s.num_free_pages == free_pages)
    )


def assert_error(r: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if param != "any":
        assert err["param"] == param, err
    return err


# ---------------------------------------------------------------- the happy paths


def test_models_health_tokenize(base, oai, tok, server):
    models = oai.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(base + "/health").status_code == 200
    r = httpx.post(base + "/tokenize", json={"prompt": PROMPT}).json()
    assert r["tokens"] == tok.encode(PROMPT) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == server.engine.engine.max_model_len
    r = httpx.post(base + "/tokenize", json={"messages": CHAT}).json()
    assert r["tokens"] == tok.encode(tok.apply_chat_template(CHAT))
    r = httpx.post(base + "/detokenize", json={"tokens": tok.encode(PROMPT)}).json()
    assert r["prompt"] == PROMPT


def test_completion_equals_grpc_and_counts_exactly(oai, grpc_client, tok):
    ref = grpc_client.generate_text(PROMPT, max_tokens=16, temperature=0, ignore_eos=True)
    out = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.object == "text_completion" and len(out.choices) == 1
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(tok.encode(PROMPT))
    assert out.usage.completion_tokens == 16
    assert out.usage.total_tokens == out.usage.prompt_tokens + 16
    assert out.usage.prompt_tokens_details.cached_tokens >= 0
    assert "device" in out.usage.model_extra["cached_tokens_by_tier"]
    # a token-id prompt is the same request
    ids = tok.encode(PROMPT)
    by_ids = oai.completions.create(
        model=MODEL, prompt=ids, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    assert by_ids.choices[0].text == ref.text


def test_chat_equals_grpc_of_the_templated_prompt(oai, grpc_client, tok):
    templated = tok.apply_chat_template(CHAT)
    ref = grpc_client.generate_text(templated, max_tokens=12, temperature=0)
    out = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    msg = out.choices[0].message
    assert out.object == "chat.completion"
    assert msg.role == "assistant" and msg.content == ref.text
    assert out.choices[0].finish_reason == ref.finish_reason
    assert out.usage.prompt_tokens == len(tok.encode(templated))
    assert out.usage.completion_tokens == len(ref.token_ids)
    # max_completion_tokens is max_tokens' newer name
    out2 = oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=3, temperature=0
    )
    assert out2.usage.completion_tokens <= 3
    assert ref.text.startswith(out2.choices[0].message.content)


def test_streams_with_usage_async(base, oai):
    async def run():
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as c:
            chat = await c.chat.completions.create(
                model=MODEL,
                messages=CHAT,
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            chat_chunks = [ch async for ch in chat]
            comp = await c.completions.create(
                model=MODEL,
                prompt=PROMPT,
                max_tokens=10,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            comp_chunks = [ch async for ch in comp]
        return chat_chunks, comp_chunks

    chat_chunks, comp_chunks = asyncio.run(run())
    full_chat = oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, temperature=0
    )
    *deltas, last = chat_chunks
    assert last.choices == [] and last.usage.completion_tokens == full_chat.usage.completion_tokens
    assert last.usage.prompt_tokens == full_chat.usage.prompt_tokens
    assert all(c.usage is None for c in deltas)
    assert deltas[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in deltas)
    assert text == full_chat.choices[0].message.content
    assert deltas[-1].choices[0].finish_reason == full_chat.choices[0].finish_reason
    assert len({c.id for c in chat_chunks}) == 1

    full = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    *deltas, last = comp_chunks
    assert "".join(c.choices[0].text for c in deltas) == full.choices[0].text
    assert last.usage.completion_tokens == full.usage.completion_tokens


def test_raw_stream_ends_with_done(base):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert all(ln.startswith("data: ") for ln in lines)
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_n_and_seed(oai):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, n=2)
    a = oai.completions.create(**kw)
    b = oai.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # reproducible
    assert a.usage.completion_tokens == 16  # both choices counted, the prompt once
    # a streamed n=2 chat gives each choice its own complete stream
    stream = oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, temperature=0, n=2, stream=True
    )
    texts = {0: "", 1: ""}
    finished = set()
    for ch in stream:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1} and texts[0] == texts[1]  # greedy: the same twice


def test_logprobs_equal_grpc(oai, grpc_client, tok):
    ref = grpc_client.generate_text(
        PROMPT, max_tokens=6, temperature=0, ignore_eos=True, logprobs=True
    )
    out = oai.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in ref.token_ids]
    assert lp.text_offset[0] == 0
    chat = oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(c.logprob <= 0 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content


def test_top_logprobs(oai):
    out = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert len(lp.top_logprobs) == len(lp.tokens) == 4
    for tok_text, tok_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3  # two ids may decode to the same text
        best = max(top.values())
        assert top[tok_text] == pytest.approx(tok_lp) == pytest.approx(best)  # greedy
    chat = oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    for item in chat.choices[0].logprobs.content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert item.top_logprobs[0].token == item.token
        assert item.top_logprobs[1].logprob <= item.top_logprobs[0].logprob


def test_min_tokens_holds_eos_back(oai):
    short = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=64, temperature=0)
    n = short.usage.completion_tokens
    assert short.choices[0].finish_reason == "stop" and n < 60  # it ends on EOS
    held = oai.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=n + 12,
        temperature=0,
        extra_body={"min_tokens": n + 6},
    )
    assert held.usage.completion_tokens >= n + 6
    # the first n - 1 tokens are the same: the mask only touches EOS and stop ids
    assert held.choices[0].message.content.startswith(short.choices[0].message.content[:10])


def test_stop(oai):
    full = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    text = full.choices[0].text
    word = text.split()[2]  # a word from the middle of the greedy continuation
    out = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[word, "zzzz"]
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[: text.index(word)]


def test_cached_tokens_of_a_repeated_prefix(oai, tok):
    system = "You answer questions about the history of the printing press. " * 8
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "When?"}]
    first = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
    second = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
    n = first.usage.prompt_tokens
    full_pages = (n - 1) // 16 * 16  # the last token is always computed
    assert second.usage.prompt_tokens_details.cached_tokens >= full_pages > 0
    assert second.usage.model_extra["cached_tokens_by_tier"]["device"] >= full_pages


def test_64_concurrent_streams(base, oai):
    prompts = [f"Here is a list of {k} animals:" for k in range(2, 10)]
    refs = {
        p: oai.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0)
        .choices[0]
        .text
        for p in prompts
    }

    async def one(c, p: str) -> str:
        s = await c.completions.create(
            model=MODEL, prompt=p, max_tokens=6, temperature=0, stream=True
        )
        return "".join([ch.choices[0].text async for ch in s])

    async def run():
        limits = httpx.Limits(max_connections=64)
        async with openai.AsyncOpenAI(
            base_url=base + "/v1",
            api_key="x",
            max_retries=0,
            http_client=openai.DefaultAsyncHttpxClient(limits=limits),
        ) as c:
            work = [prompts[i % len(prompts)] for i in range(64)]
            return work, await asyncio.gather(*(one(c, p) for p in work))

    work, outs = asyncio.run(run())
    assert [refs[p] for p in work] == outs


# ---------------------------------------------------------------- errors


def test_invalid_requests_are_400_in_openai_shape(base):
    post = lambda path, body: httpx.post(base + path, json=body, timeout=60)  # noqa: E731
    chat = {"model": MODEL, "messages": CHAT}
    assert_error(post("/v1/chat/completions", {**chat, "temperature": -1}), 400, "temperature")
    assert_error(post("/v1/chat/completions", {**chat, "max_tokens": "x"}), 400, "max_tokens")
    assert_error(post("/v1/chat/completions", {"model": MODEL}), 400, "messages")
    err = assert_error(post("/v1/chat/completions", {**chat, "logit_bias": {"1": 5}}), 400)
    assert err["param"] == "logit_bias" and err["type"] == "invalid_request_error"
    assert_error(post("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 2}), 400, "top_p")
    assert_error(post("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}), 400, "n")
    assert_error(post("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 21}), 400)
    too_few = {"model": MODEL, "prompt": "x", "max_tokens": 2, "min_tokens": 3}
    assert "min_tokens" in assert_error(post("/v1/completions", too_few), 400)["message"]
    no_lp = {**chat, "top_logprobs": 2}
    assert_error(post("/v1/chat/completions", no_lp), 400, "top_logprobs")
    img = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    assert_error(
        post("/v1/chat/completions", {"model": MODEL, "messages": [img]}),
        400,
        "messages.0.content",
    )
    # bad JSON and a body that is not an object
    r = httpx.post(
        base + "/v1/completions", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert_error(r, 400)
    assert_error(post("/v1/completions", [1, 2]), 400)
    # unknown model: 404
    err = assert_error(post("/v1/completions", {"model": "gpt-4", "prompt": "x"}), 404, "model")
    assert err["code"] == "model_not_found"
    # a prompt longer than the model's context: the engine's verdict, before any stream
    ids = [1] * 6000
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2}
    assert "max_model_len" in assert_error(post("/v1/completions", body), 400)["message"]
    assert_error(post("/v1/completions", {**body, "stream": True}), 400)
    # an out-of-vocabulary token id
    assert_error(post("/v1/completions", {"model": MODEL, "prompt": [10**6]}), 400)
    # the openai client raises its own typed errors on these
    with openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as c:
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model=MODEL, prompt="x", presence_penalty=1.5)
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model="nope", prompt="x")


def test_client_disconnect_aborts_the_request(base, server):
    """A client that goes away mid-stream, or while waiting for a non-streamed answer, frees
    its pages at once: the engine stops computing its tokens (it asked for 2000)."""
    free = engine_stats(server).num_free_pages
    before = engine_stats(server).tokens_computed
    n_aborted = aborted(server)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True}
    with httpx.stream(
        "POST", base + "/v1/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few events: the request is decoding
        assert any(g.startswith("data: {") for g in got)
    assert wait_until(lambda: idle(server, free), timeout=30)
    assert engine_stats(server).tokens_computed - before < 1000
    assert aborted(server) == n_aborted + 1

    before = engine_stats(server).tokens_computed
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    assert wait_until(lambda: idle(server, free), timeout=30)
    assert engine_stats(server).tokens_computed - before < 1000
    assert aborted(server) == n_aborted + 2


# ---------------------------------------------------------------- a full queue, a dead engine


@pytest.fixture(scope="module")
def tiny(smol_src):
    """A worker whose queue is full with two requests: one running, one waiting."""
    srv = WorkerServer(
        LLMEngine(MODEL, kv_cache_memory="64MiB", max_num_seqs=1, max_waiting=1),
        http_port=0,
        data_plane=False,
    )
    srv.start_in_thread()
    yield srv
    srv.stop_in_thread(grace=0)


def test_full_queue_429_then_dead_engine_503(tiny):
    base = f"http://127.0.0.1:{tiny.http.port}"
    long = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True}

    def waiting() -> int:
        return engine_stats(tiny).num_requests_waiting

    async def run():
        async with httpx.AsyncClient(base_url=base, timeout=60) as c:
            req = c.build_request("POST", "/v1/completions", json={**long, "stream": True})
            running = await c.send(req, stream=True)  # headers come with its first token
            # the second waits in the queue (its headers wait for its first token)
            queued = asyncio.ensure_future(c.post("/v1/completions", json=long))
            assert await asyncio.to_thread(wait_until, waiting, 30)
            busy = await c.post("/v1/completions", json={**long, "max_tokens": 2})
            busy_stream = await c.post(
                "/v1/completions", json={**long, "max_tokens": 2, "stream": True}
            )
            queued.cancel()
            await running.aclose()
            return busy, busy_stream

    busy, busy_stream = asyncio.run(run())
    for r in (busy, busy_stream):
        err = assert_error(r, 429)
        assert err["type"] == "rate_limit_error" and int(r.headers["retry-after"]) >= 1

    # the engine loop dies: health and every request say 503, with Retry-After
    eng = tiny.engine.engine

    def crash():
        raise RuntimeError("injected engine failure")

    eng.step = crash
    tiny.engine._wake.set()  # the idle loop steps once more, and dies
    assert wait_until(lambda: tiny.engine.error is not None, timeout=10)
    r = httpx.get(base + "/health")
    assert_error(r, 503)
    assert int(r.headers["retry-after"]) >= 1
    r = httpx.post(base + "/v1/completions", json={**long, "max_tokens": 2}, timeout=10)
    assert "crashed" in assert_error(r, 503)["message"]


def test_a_drain_finishes_http_streams_and_refuses_new_requests(smol_src):
    """SIGTERM's drain: a stream already running gets its grace and ends whole; a new
    request meanwhile is refused with 503."""
    srv = WorkerServer(
        LLMEngine(MODEL, kv_cache_memory="64MiB"), http_port=0, data_plane=False, grace_s=60
    )
    srv.start_in_thread()
    base = f"http://127.0.0.1:{srv.http.port}"
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "ignore_eos": True}
    stopper = threading.Thread(target=srv.stop_in_thread, kwargs={"grace": 60, "timeout": 120})
    try:
        with httpx.stream(
            "POST", base + "/v1/completions", json={**body, "stream": True}, timeout=120
        ) as r:
            lines = r.iter_lines()
            assert next(ln for ln in lines if ln).startswith("data: {")
            stopper.start()
            assert wait_until(lambda: srv._life.draining, timeout=10)
            refused = httpx.post(base + "/v1/completions", json=body, timeout=30)
            rest = [ln for ln in lines if ln]
        assert_error(refused, 503)
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        stopper.join(120)
        assert not stopper.is_alive()
    finally:
        if not stopper.is_alive() and not stopper.ident:
            srv.stop_in_thread(grace=0)


# ---------------------------------------------------------------- the default deadline

DEADLINE_S = 4.0  # far shorter than 4000 tokens take here, far longer than a first token


@pytest.fixture(scope="module")
def hasty(smol_src):
    """A worker whose every request must end within DEADLINE_S (``--request-timeout``)."""
    srv = WorkerServer(
        LLMEngine(MODEL, kv_cache_memory="64MiB"),
        http_port=0,
        data_plane=False,
        default_deadline_s=DEADLINE_S,
    )
    srv.start_in_thread()
    yield srv
    srv.stop_in_thread(grace=0)


def test_the_default_deadline_aborts_the_request_with_504(hasty):
    """As gRPC's Generate: past the server's deadline the request is aborted (its pages
    freed) and answered 504; in a stream that began, the error JSON and then [DONE]."""
    base = f"http://127.0.0.1:{hasty.http.port}"
    free = engine_stats(hasty).num_free_pages
    n_aborted = aborted(hasty) or 0
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True}
    err = assert_error(httpx.post(base + "/v1/completions", json=body, timeout=120), 504)
    assert err["type"] == "timeout_error" and "deadline" in err["message"]
    assert wait_until(lambda: idle(hasty, free), timeout=30)
    assert aborted(hasty) == n_aborted + 1

    stream = {**body, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=stream, timeout=120) as r:
        assert r.status_code == 200  # the first token came well within the deadline
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["type"] == "timeout_error"
    assert len(lines) > 3 and json.loads(lines[0][6:])["choices"][0]["text"] is not None
    assert wait_until(lambda: idle(hasty, free), timeout=30)
    assert aborted(hasty) == n_aborted + 2
