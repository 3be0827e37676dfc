"""The router's OpenAI-compatible HTTP API (``kvmesh serve --http-port``) on a real local Ray
cluster of two workers, driven by the official ``openai`` client and raw ``httpx``: the same
tokens as the gRPC SDK through the same router, prefix-affine placement of chat requests
(the chat template applied before hashing), cached tokens reported, OpenAI-shaped errors, and
a client that leaves mid-stream aborting its request at the worker. One cluster per module."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from helpers import local_cluster, wait_until

from kvmesh.cluster import Client

MODEL = "smollm2-135m-instruct"
ENGINE_ARGS = dict(kv_cache_memory="96MiB", max_num_batched_tokens=512, max_num_seqs=8)
CHAT = [{"role": "user", "content": "What is the capital of Italy?"}]


@pytest.fixture(scope="module")
def cluster(smol_src):
    with local_cluster(ENGINE_ARGS, MODEL, http_port=0) as c:
        yield c


@pytest.fixture(scope="module")
def base(cluster) -> str:
    return f"http://{cluster.http_endpoint}"


@pytest.fixture(scope="module")
def oai(base):
    with openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def sdk(cluster):
    with Client(cluster.endpoint, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tok(smol_src):
    from kvmesh.worker.models.loader import model_fingerprint
    from kvmesh.worker.tokenizer import Tokenizer

    return Tokenizer.load(smol_src, model_fingerprint(smol_src))


def routed(cluster) -> dict[str, int]:
    return {wid: w["routed"] for wid, w in cluster.stats()["workers"].items()}


def test_chat_and_completion_equal_the_grpc_sdk(oai, sdk, tok, base):
    assert httpx.get(base + "/health").status_code == 200
    assert [m.id for m in oai.models.list().data] == [MODEL]
    templated = tok.apply_chat_template(CHAT)
    ref = sdk.generate_text(templated, max_tokens=10, temperature=0)
    out = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    assert out.choices[0].message.content == ref.text
    assert out.usage.prompt_tokens == len(tok.encode(templated)) == ref.usage.prompt_tokens
    assert out.usage.completion_tokens == len(ref.token_ids)
    prompt = "A haiku about the sea:"
    ref = sdk.generate_text(prompt, max_tokens=8, temperature=0, ignore_eos=True)
    out = oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].text == ref.text


def test_shared_prefix_lands_on_one_worker_and_is_cached(cluster, oai, tok):
    system = "You are the archivist of the lighthouse keepers' guild, precise and brief. " * 10
    a = [{"role": "system", "content": system}, {"role": "user", "content": "Who founded it?"}]
    b = [{"role": "system", "content": system}, {"role": "user", "content": "When was it?"}]
    ta, tb = (tok.encode(tok.apply_chat_template(m)) for m in (a, b))
    shared = next(i for i, (x, y) in enumerate(zip(ta, tb)) if x != y)
    shared_pages = shared // 16 * 16
    assert shared_pages >= 96  # a long prefix, and the questions differ

    before = routed(cluster)
    oai.chat.completions.create(model=MODEL, messages=a, max_tokens=2, temperature=0)
    mid = routed(cluster)
    second = oai.chat.completions.create(model=MODEL, messages=b, max_tokens=2, temperature=0)
    after = routed(cluster)
    first_on = [w for w in mid if mid[w] > before.get(w, 0)]
    second_on = [w for w in after if after[w] > mid.get(w, 0)]
    assert len(first_on) == 1 and second_on == first_on
    assert second.usage.prompt_tokens == len(tb)
    assert second.usage.prompt_tokens_details.cached_tokens >= shared_pages
    assert second.usage.model_extra["cached_tokens_by_tier"]["device"] >= shared_pages


def test_stream_n2_with_usage_async(base, oai):
    full = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0)

    async def run():
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as c:
            s = await c.chat.completions.create(
                model=MODEL,
                messages=CHAT,
                max_tokens=6,
                temperature=0,
                n=2,
                stream=True,
                stream_options={"include_usage": True},
            )
            return [ch async for ch in s]

    chunks = asyncio.run(run())
    texts = {0: "", 1: ""}
    for ch in chunks[:-1]:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == {0: full.choices[0].message.content, 1: full.choices[0].message.content}
    usage = chunks[-1].usage
    assert usage.prompt_tokens == full.usage.prompt_tokens
    assert usage.completion_tokens == 2 * full.usage.completion_tokens


def test_errors_through_the_router(base):
    def post(body):
        return httpx.post(base + "/v1/chat/completions", json=body, timeout=60)

    r = post({"model": "other-model", "messages": CHAT})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = post({"model": MODEL, "messages": CHAT, "top_p": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
    # the worker's verdict (a prompt beyond max_model_len) comes back as a 400 too
    r = httpx.post(
        base + "/v1/completions", json={"model": MODEL, "prompt": [1] * 6000}, timeout=60
    )
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_client_disconnect_mid_stream_aborts_at_the_worker(cluster, base):
    def running() -> int:
        workers = cluster.stats()["workers"].values()
        return sum(w["load"]["running"] + w["in_flight"]["requests"] for w in workers)

    body = {
        "model": MODEL,
        "prompt": "Count from one to ten thousand:",
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(4)]
        assert any(g.startswith("data: {") for g in got)
        assert wait_until(lambda: running() >= 1, timeout=10)
    # 3000 tokens would take minutes on this machine: zero running means aborted
    assert wait_until(lambda: running() == 0, timeout=30)


def test_no_worker_is_503_with_retry_after():
    """A router with no worker (none registered yet, or all gone): health and requests
    answer 503 with Retry-After."""
    from kvmesh.router.core import RouterCore
    from kvmesh.router.service import RouterServer

    srv = RouterServer(RouterCore(), http_port=0, model_name=MODEL)
    srv.start_in_thread()
    try:
        base = f"http://127.0.0.1:{srv.http.port}"
        r = httpx.get(base + "/health")
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3]})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert "no worker" in err["message"] and err["type"] == "service_unavailable_error"
    finally:
        srv.stop_in_thread(grace=0)
