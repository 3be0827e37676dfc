"""The OpenAI-compatible HTTP API behind the gRPC port's door: client tokens and TLS, end to
end, on a real worker and a real router (the router reaching the worker over TLS as a
cluster member), with the official ``openai`` client and raw ``httpx``, and a CA made here
by the ``openssl`` CLI. Without a token, or with a wrong one, every path but ``GET /health``
is 401 (``/metrics`` included); either token of the file works; plaintext and an unknown CA
are refused; mutual TLS refuses a client without a certificate; a body over the message
limit is 413."""

from __future__ import annotations

import ssl

import httpx
import openai
import pytest
from helpers import TEST_IDENTITY as ID
from helpers import in_process_router, make_test_pki

from kvmesh.cluster import Client
from kvmesh.cluster.serve import ClusterConfig
from kvmesh.protos.security import BearerTokens, TLSConfig
from kvmesh.worker.async_engine import AsyncEngine
from kvmesh.worker.engine import LLMEngine
from kvmesh.worker.server import WorkerServer

MODEL = "smollm2-135m-instruct"
TOKENS = ["http-tenant-a-0123456789", "http-tenant-b-9876543210"]
PROMPT = "The three primary colors are"
GREEDY = dict(max_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA of its own, a server certificate for 127.0.0.1, a client certificate, tokens."""
    return make_test_pki(tmp_path_factory.mktemp("http-pki"), TOKENS, "IP:127.0.0.1")


def trust(pki, client_cert: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    if client_cert:
        ctx.load_cert_chain(pki / "client.pem", pki / "client.key")
    return ctx


@pytest.fixture(scope="module")
def engine(smol_src):
    aeng = AsyncEngine(LLMEngine(MODEL, kv_cache_memory="64MiB"))
    yield aeng
    aeng.shutdown()


@pytest.fixture(scope="module")
def worker(engine, pki):
    """Tokens and TLS on gRPC and HTTP alike; a 1 MiB message limit."""
    srv = WorkerServer(
        engine,
        tls=TLSConfig.from_files(pki / "server.pem", pki / "server.key"),
        tokens=BearerTokens.from_file(pki / "tokens"),
        identity=ID,
        http_port=0,
        max_message_mb=1,
        data_plane=False,
        grace_s=0,
    )
    srv.start_in_thread()
    yield srv
    srv.stop_in_thread(grace=0)


@pytest.fixture(scope="module")
def router(worker, pki):
    eng = worker.engine.engine
    with in_process_router(
        worker,
        name="http-tls-worker",
        tokenizer=eng.tokenizer,
        model_name=MODEL,
        identity=ID,
        tokens=BearerTokens.from_file(pki / "tokens"),
        tls=TLSConfig.from_files(pki / "server.pem", pki / "server.key", ca=pki / "ca.pem"),
        http_port=0,
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(worker, pki) -> str:
    with Client(worker.address, root_certificates=pki / "ca.pem", token=TOKENS[0]) as c:
        return c.generate_text(PROMPT, **GREEDY).text


def https(srv) -> str:
    return f"https://127.0.0.1:{srv.http.port}"


@pytest.mark.parametrize("target", ["worker", "router"])
def test_the_openai_client_with_either_token_over_tls(request, pki, reference, target):
    base = https(request.getfixturevalue(target))
    for token in TOKENS:
        http_client = openai.DefaultHttpxClient(verify=trust(pki))
        with openai.OpenAI(
            base_url=base + "/v1", api_key=token, max_retries=0, http_client=http_client
        ) as c:
            assert [m.id for m in c.models.list().data] == [MODEL]
            out = c.completions.create(model=MODEL, prompt=PROMPT, **GREEDY)
            assert out.choices[0].text == reference
    with openai.OpenAI(
        base_url=base + "/v1",
        api_key="not-a-token-of-the-file",
        max_retries=0,
        http_client=openai.DefaultHttpxClient(verify=trust(pki)),
    ) as c:
        with pytest.raises(openai.AuthenticationError):
            c.completions.create(model=MODEL, prompt=PROMPT, **GREEDY)
        with pytest.raises(openai.AuthenticationError):
            c.models.list()


@pytest.mark.parametrize("target", ["worker", "router"])
def test_every_path_but_health_needs_a_token(request, pki, target):
    srv = request.getfixturevalue(target)
    body = {"model": MODEL, "prompt": PROMPT, **GREEDY}
    with httpx.Client(base_url=https(srv), verify=trust(pki), timeout=120) as c:
        assert c.get("/health").json() == {"status": "ok"}  # probes carry no token
        for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789abc"}):
            for method, path in [
                ("POST", "/v1/completions"),
                ("POST", "/v1/chat/completions"),
                ("GET", "/v1/models"),
                ("POST", "/tokenize"),
                ("GET", "/metrics"),  # its prefix-cache counters tell who sent what
            ]:
                r = c.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (path, r.text)
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}
                assert err["type"] == "authentication_error"
        ok = {"Authorization": f"Bearer {TOKENS[1]}"}
        assert c.post("/v1/completions", json=body, headers=ok).status_code == 200
        r = c.get("/metrics", headers=ok)
        assert r.status_code == 200 and "kvmesh:" in r.text


def test_plaintext_and_an_unknown_ca_are_refused(worker, router, pki):
    for srv in (worker, router):
        with pytest.raises(httpx.TransportError):  # plaintext HTTP to the TLS port
            httpx.get(f"http://127.0.0.1:{srv.http.port}/health", timeout=10)
        with pytest.raises(httpx.ConnectError):  # the system's roots do not know the test CA
            httpx.get(https(srv) + "/health", timeout=10)


def test_mutual_tls_refuses_a_client_without_a_certificate(engine, pki, reference):
    tls = TLSConfig.from_files(pki / "server.pem", pki / "server.key", client_ca=pki / "ca.pem")
    srv = WorkerServer(engine, tls=tls, http_port=0, data_plane=False, grace_s=0)
    srv.start_in_thread()
    try:
        with pytest.raises(httpx.TransportError):
            with httpx.Client(verify=trust(pki), timeout=10) as c:
                c.get(https(srv) + "/health")
        with httpx.Client(base_url=https(srv), verify=trust(pki, True), timeout=120) as c:
            assert c.get("/health").status_code == 200
            body = {"model": MODEL, "prompt": PROMPT, **GREEDY}
            assert c.post("/v1/completions", json=body).json()["choices"][0]["text"] == reference
    finally:
        srv.stop_in_thread(grace=0)


def test_a_body_over_the_message_limit_is_413(worker, pki):
    ok = {"Authorization": f"Bearer {TOKENS[0]}"}
    big = {"model": MODEL, "prompt": "x" * (2**20 + 1)}  # --max-message-mb 1
    with httpx.Client(base_url=https(worker), verify=trust(pki), timeout=60) as c:
        r = c.post("/v1/completions", json=big, headers=ok)
        assert r.status_code == 413, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
        r = c.post("/v1/completions", json=big)  # the token first: no body read before it
        assert r.status_code == 401


def test_a_token_file_and_an_http_port_go_together(pki):
    tokens = BearerTokens.from_file(pki / "tokens")
    cfg = ClusterConfig(tokens=tokens, http_port=0)  # once refused: the HTTP port had no door
    assert cfg.tokens is tokens and cfg.http_port == 0
