"""TLS and bearer tokens end to end through the SDK, with a CA made here by the ``openssl``
CLI: a client with the CA and a token gets greedy tokens through the router (which reaches
the worker over TLS as a cluster member) and from the worker directly; without the token,
with a wrong one, in plaintext, or trusting other roots, it is refused; health stays open;
mutual TLS refuses a client without a certificate; and the page data plane still serves a
member of a TLS cluster, every page MAC-checked."""

from __future__ import annotations

import pytest
from helpers import TEST_IDENTITY as ID
from helpers import in_process_router, make_test_pki

from kvmesh.cluster import Client
from kvmesh.cluster.client import Unauthenticated, Unavailable
from kvmesh.kvstore.hashing import hash_pages
from kvmesh.kvstore.peer import PeerTier
from kvmesh.protos.security import BearerTokens, TLSConfig, check_bearer
from kvmesh.worker import SamplingParams
from kvmesh.worker.async_engine import AsyncEngine
from kvmesh.worker.engine import LLMEngine
from kvmesh.worker.server import WorkerServer

MODEL = "smollm2-135m-instruct"
GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
TOKENS = ["tenant-a-token-0123456789", "tenant-b-token-9876543210"]
PROMPT = (  # three full pages of 16 tokens and more
    "The quick brown fox jumps over the lazy dog. A wizard's job is to vex chumps quickly "
    "in fog. Pack my box with five dozen liquor jugs, and then the fox"
)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A throwaway CA, a server certificate for 127.0.0.1/localhost, a client one, tokens."""
    return make_test_pki(tmp_path_factory.mktemp("pki"), TOKENS)


@pytest.fixture(scope="module")
def engine(smol_src):
    aeng = AsyncEngine(LLMEngine(MODEL, kv_cache_memory="64MiB"))
    yield aeng
    aeng.shutdown()


@pytest.fixture(scope="module")
def worker(engine, pki):
    """TLS, tokens, the cluster identity, and the data plane asked for explicitly."""
    tls = TLSConfig.from_files(pki / "server.pem", pki / "server.key")
    srv = WorkerServer(
        engine,
        server_credentials=tls.server_credentials(),
        identity=ID,
        tokens=BearerTokens.from_file(pki / "tokens"),
        data_plane=True,
        grace_s=0,
    )
    srv.start_in_thread()
    yield srv
    srv.stop_in_thread(grace=0)


@pytest.fixture(scope="module")
def router(worker, pki):
    with in_process_router(
        worker,
        name="tls-worker",
        identity=ID,
        tokens=BearerTokens.from_file(pki / "tokens"),
        tls=TLSConfig.from_files(pki / "server.pem", pki / "server.key", ca=pki / "ca.pem"),
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(smol_llm):
    return smol_llm.generate([PROMPT], SamplingParams(**GREEDY))[0].token_ids


def test_tls_and_a_token_through_the_router_and_directly(router, worker, pki, reference):
    for address in (router.address, worker.address):
        for token in TOKENS:  # either token of the file
            with Client(address, root_certificates=pki / "ca.pem", token=token, timeout=120) as c:
                res = c.generate_text(PROMPT, **GREEDY)
                assert res.token_ids == reference
                assert res.worker_id == worker.worker_id
                assert c.model_info().model


@pytest.mark.parametrize("target", ["router", "worker"])
def test_without_the_token_or_tls_a_client_is_refused(router, worker, pki, target):
    address = router.address if target == "router" else worker.address
    ca = pki / "ca.pem"
    with Client(address, root_certificates=ca, timeout=30, retries=0) as c:
        with pytest.raises(Unauthenticated, match="bearer token"):
            c.generate_text(PROMPT, **GREEDY)
        with pytest.raises(Unauthenticated):
            c.model_info()
        assert c.health() == "SERVING"  # probes carry no token: health stays open
    with Client(address, root_certificates=ca, token="x" * 24, timeout=30, retries=0) as c:
        with pytest.raises(Unauthenticated):
            c.generate_text(PROMPT, **GREEDY)
    with Client(address, root_certificates=ca, token=TOKENS[0], timeout=30, retries=0) as c:
        with pytest.raises(Unauthenticated, match="cluster members"):
            c.get_load()  # a client's token does not make it a member
    with Client(address, token=TOKENS[0], timeout=10, retries=0) as c:  # plaintext
        with pytest.raises(Unavailable):
            c.generate_text(PROMPT, **GREEDY)
    with Client(address, tls=True, token=TOKENS[0], timeout=10, retries=0) as c:
        with pytest.raises(Unavailable):  # the system's roots do not know the test CA
            c.generate_text(PROMPT, **GREEDY)


def test_mutual_tls_refuses_a_client_without_a_certificate(engine, pki, reference):
    tls = TLSConfig.from_files(pki / "server.pem", pki / "server.key", client_ca=pki / "ca.pem")
    srv = WorkerServer(engine, server_credentials=tls.server_credentials(), grace_s=0)
    srv.start_in_thread()
    try:
        ca = pki / "ca.pem"
        with Client(srv.address, root_certificates=ca, timeout=10, retries=0) as c:
            with pytest.raises(Unavailable):
                c.generate_text(PROMPT, **GREEDY)
        with Client(
            srv.address,
            root_certificates=ca,
            private_key=pki / "client.key",
            certificate_chain=pki / "client.pem",
            timeout=120,
        ) as c:
            assert c.generate_text(PROMPT, **GREEDY).token_ids == reference
    finally:
        srv.stop_in_thread(grace=0)


def test_the_data_plane_serves_a_member_of_a_tls_cluster(worker, pki, reference):
    eng = worker.engine.engine
    with Client(worker.address, root_certificates=pki / "ca.pem", token=TOKENS[1]) as c:
        c.generate_text(PROMPT, **GREEDY)  # cached on the worker's device now
    hashes = hash_pages(eng.tokenize(PROMPT), eng.cache_config.block_size, eng.model_fp)
    assert len(hashes) >= 2
    creds = TLSConfig.from_files(ca=pki / "ca.pem").channel_credentials()
    peer = PeerTier(worker.address, identity=ID, credentials=creds)
    try:
        assert peer.transport() == "data_plane"
        got = peer.get(hashes)
        assert all(o is not None for o in got)
        assert peer.metrics["data_plane_pages"] == len(hashes) and peer.metrics["errors"] == 0
    finally:
        peer.close()


def test_bearer_tokens_are_checked_whole_and_by_scheme():
    tokens = BearerTokens(TOKENS)
    assert check_bearer(f"Bearer {TOKENS[0]}", tokens)
    assert check_bearer(f"bearer {TOKENS[1]}", tokens)
    assert not check_bearer(TOKENS[0], tokens)  # no scheme
    assert not check_bearer(f"Basic {TOKENS[0]}", tokens)
    assert not check_bearer(f"Bearer {TOKENS[0][:-1]}", tokens)  # a prefix is not the token
    assert not check_bearer(None, tokens)
    with pytest.raises(ValueError, match="at least 16"):
        BearerTokens(["short"])
