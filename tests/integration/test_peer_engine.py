"""Two worker servers on loopback: B serves a prefix A computed by pulling A's pages over A's
page data plane (PeerTier's default; ``KVTransfer.Fetch`` when B is told not to use it), with
output identical to a cold run; A dying mid-fetch only means B computes more."""

from __future__ import annotations

import threading
import time

import pytest
from helpers import TEST_IDENTITY as ID
from helpers import member_channel, text_prompts

from kvmesh.cluster import Client
from kvmesh.kvstore.peer import PeerTier
from kvmesh.worker.async_engine import AsyncEngine
from kvmesh.worker.engine import LLMEngine
from kvmesh.worker.page_source import EnginePageSource
from kvmesh.worker.server import WorkerServer

GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=True)


class SlowSource:
    """A's page source, able to stall each Fetch batch so the test can kill A mid-fetch."""

    def __init__(self, inner):
        self.inner = inner
        self.delay_s = 0.0
        self.fetching = threading.Event()

    def lookup(self, hashes):
        return self.inner.lookup(hashes)

    def fetch(self, hashes):
        self.fetching.set()
        time.sleep(self.delay_s)
        return self.inner.fetch(hashes)

    def accept(self, items):
        return self.inner.accept(items)


@pytest.fixture(scope="module")
def cluster():
    a_engine = AsyncEngine(LLMEngine("smollm2-135m-instruct", kv_cache_memory="128MiB"))
    source = SlowSource(EnginePageSource(a_engine))
    a = WorkerServer(a_engine, page_source=source, own_engine=True, grace_s=0, identity=ID)
    a.start_in_thread()
    peer = PeerTier([a.address], timeout=30.0, identity=ID)
    b_engine = LLMEngine("smollm2-135m-instruct", kv_cache_memory="128MiB", extra_tiers=[peer])
    b = WorkerServer(b_engine, identity=ID)
    b.start_in_thread()
    yield a, b, source, peer
    b.stop_in_thread(grace=0)
    a.stop_in_thread(grace=0)


@pytest.fixture(scope="module")
def prompts(smol_llm, shakespeare):
    return text_prompts(smol_llm.tokenizer, shakespeare, [1030, 1030])


@pytest.fixture(scope="module")
def reference(smol_llm, prompts):
    from kvmesh.worker import SamplingParams

    outs = smol_llm.generate(prompts, SamplingParams(**GREEDY))
    return [o.token_ids for o in outs]


def _computed(server: WorkerServer) -> int:
    return server.engine.engine.runner.tokens_computed


def test_b_pulls_a_prefix_from_a(cluster, prompts, reference):
    a, b, _, peer = cluster
    with Client(a.address) as ca, Client(b.address) as cb:
        on_a = ca.generate_text(prompts[0], **GREEDY)
        assert on_a.token_ids == reference[0]
        before = _computed(b)
        on_b = cb.generate_text(prompts[0], **GREEDY)
    assert on_b.usage.cached_tokens_by_tier["peer"] >= 1008
    assert on_b.usage.cached_tokens == 1024
    assert on_b.token_ids == reference[0]  # identical to a cold run
    assert _computed(b) - before == 1030 - 1024 + GREEDY["max_tokens"] - 1  # only the rest
    assert on_b.worker_id != on_a.worker_id
    # the pages came over A's data plane, not over gRPC
    assert peer.metrics["data_plane_pages"] >= 1008 // 16 and peer.metrics["grpc_pages"] == 0


def test_a_request_naming_a_peer_pulls_its_pages(cluster, prompts, reference, shakespeare):
    """No static peer: the request itself names A (the router's hint), sent as the router
    sends it: as a cluster member."""
    from kvmesh.protos.kvmesh.v1 import inference_pb2 as ipb
    from kvmesh.protos.kvmesh.v1 import inference_pb2_grpc as ipb_grpc

    a, _, _, _ = cluster
    # no tiers at all; the cluster identity to fetch from the peers a request names
    c = LLMEngine("smollm2-135m-instruct", kv_cache_memory="128MiB", peer_identity=ID)
    server = WorkerServer(c, identity=ID)
    server.start_in_thread()
    try:
        prompt = prompts[0]  # A computed it in the first test
        req = ipb.GenerateRequest(
            token_ids=ipb.TokenIds(ids=prompt),
            request_id="hinted",
            sampling=ipb.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
            peer_addresses=[a.address],
        )
        with member_channel(server.address) as ch:
            msgs = list(ipb_grpc.InferenceStub(ch).Generate(req, timeout=300))
    finally:
        server.stop_in_thread(grace=0)
    tokens = [t for m in msgs for t in m.token_ids]
    assert tokens == reference[0]
    assert msgs[-1].usage.cached_tokens_by_tier["peer"] >= 1008


def test_a_static_peer_without_the_data_plane_serves_over_fetch(cluster, prompts, reference):
    """B2 reads A through gRPC Fetch only: the same prefix, the same tokens."""
    a, _, _, _ = cluster
    grpc_only = PeerTier([a.address], timeout=30.0, data_plane=False, identity=ID)
    b2 = LLMEngine("smollm2-135m-instruct", kv_cache_memory="128MiB", extra_tiers=[grpc_only])
    server = WorkerServer(b2)
    server.start_in_thread()
    try:
        with Client(server.address) as c:
            out = c.generate_text(prompts[0], **GREEDY)  # A computed it in the first test
    finally:
        server.stop_in_thread(grace=0)
    assert out.token_ids == reference[0]
    assert out.usage.cached_tokens_by_tier["peer"] >= 1008
    assert grpc_only.metrics["grpc_pages"] >= 1008 // 16
    assert grpc_only.metrics["data_plane_pages"] == 0


def test_a_killed_mid_fetch_means_recompute_on_b(cluster, prompts, reference):
    a, b, source, peer = cluster
    with Client(a.address) as ca:
        assert ca.generate_text(prompts[1], **GREEDY).token_ids == reference[1]
    source.delay_s = 2.0
    source.fetching.clear()
    result = {}

    def run_on_b():
        with Client(b.address) as cb:
            result["out"] = cb.generate_text(prompts[1], timeout=300, **GREEDY)

    t = threading.Thread(target=run_on_b)
    t.start()
    assert source.fetching.wait(120), "B never started fetching from A"
    a.stop_in_thread(grace=0)  # A goes away while B waits for its pages
    t.join(300)
    out = result["out"]
    assert out.token_ids == reference[1]  # not an error: B computed what it could not fetch
    assert out.usage.cached_tokens_by_tier.get("peer", 0) < 1008
    assert peer.metrics["errors"] >= 1
