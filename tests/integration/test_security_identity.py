"""The cluster identity against hostile callers, on a real worker (SmolLM2, real gRPC and
data-plane sockets): a client naming a hostile peer in ``peer_addresses`` is refused and
changes no cached page; even a member naming a peer that cannot prove the cluster secret
gets no page from it (and, as a control, would get poisoned pages if the proof were not
checked); a forged Push is rejected; KVTransfer and GetLoad refuse non-members; a data-plane
client without the secret gets nothing, even with the token."""

from __future__ import annotations

import socket

import grpc
import numpy as np
import pytest
from helpers import TEST_IDENTITY as ID
from helpers import member_channel, text_prompts

from kvmesh.kvstore import dataplane as dp
from kvmesh.kvstore.codec import encode
from kvmesh.kvstore.dataplane.protocol import encode_request
from kvmesh.kvstore.hashing import hash_pages
from kvmesh.kvstore.host import HostTier
from kvmesh.kvstore.peer import PageAssembler, PeerTier, TierPageSource, page_chunks
from kvmesh.kvstore.peer.servicer import KVTransferServicer
from kvmesh.protos.kvmesh.v1 import inference_pb2 as ipb
from kvmesh.protos.kvmesh.v1 import inference_pb2_grpc as ipb_grpc
from kvmesh.protos.kvmesh.v1 import kv_transfer_pb2 as kpb
from kvmesh.protos.kvmesh.v1 import kv_transfer_pb2_grpc as kpb_grpc
from kvmesh.protos.security import ClusterIdentity
from kvmesh.protos.serving import Lifecycle, ServerThread, aio_server
from kvmesh.worker import SamplingParams
from kvmesh.worker.engine import LLMEngine
from kvmesh.worker.server import WorkerServer

MODEL = "smollm2-135m-instruct"
OTHER = ClusterIdentity(b"not-this-clusters-secret-000000000")  # another cluster's
GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=True)


class CountingSource(TierPageSource):
    """The hostile peer's pages, counting what it was asked."""

    def __init__(self, tier) -> None:
        super().__init__(tier)
        self.lookups = self.fetches = 0

    def lookup(self, hashes):
        self.lookups += 1
        return super().lookup(hashes)

    def fetch(self, hashes):
        self.fetches += 1
        return super().fetch(hashes)


class HostilePeer:
    """A KVTransfer server that answers anyone (no interceptor, so no proof either) and
    serves forged, codec-valid pages, over Fetch and over a data plane keyed by another
    cluster's secret."""

    def __init__(self, source: CountingSource) -> None:
        self.source = source
        self.data_plane = dp.DataPlaneServer(source, key=OTHER.data_plane_key)
        self._thread = ServerThread("hostile-peer")
        self._server = None

    async def _start(self) -> int:
        self._server = aio_server(64)
        servicer = KVTransferServicer(self.source, Lifecycle(), self.data_plane)
        kpb_grpc.add_KVTransferServicer_to_server(servicer, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        return port

    def start(self) -> str:
        self.data_plane.start()
        port = self._thread.start(self._start, lambda: self._server.wait_for_termination())
        self.address = f"127.0.0.1:{port}"
        return self.address

    def stop(self) -> None:
        self.data_plane.stop()
        self._thread.stop(lambda: self._server.stop(0), timeout=30)


@pytest.fixture(scope="module")
def worker(smol_src):
    engine = LLMEngine(MODEL, kv_cache_memory="64MiB", host_cache_memory="64MiB", peer_identity=ID)
    srv = WorkerServer(engine, identity=ID, grace_s=0)
    srv.start_in_thread()
    yield srv
    srv.stop_in_thread(grace=0)


@pytest.fixture(scope="module")
def prompts(worker, shakespeare):
    return text_prompts(worker.engine.engine.tokenizer, shakespeare, [81, 81, 81])


@pytest.fixture(scope="module")
def reference(smol_llm, prompts):
    return [o.token_ids for o in smol_llm.generate(prompts, SamplingParams(**GREEDY))]


def _start_hostile(worker, prompts) -> HostilePeer:
    """Forged pages (random KV, valid codec objects of the worker's spec) under the page
    hashes of every prompt."""
    eng = worker.engine.engine
    spec = eng.page_spec
    rng = np.random.default_rng(0)
    tier = HostTier(256 << 20)
    for ids in prompts:
        for h in hash_pages(ids, eng.cache_config.block_size, eng.model_fp):
            payload = rng.standard_normal(spec.page_nbytes // 4).astype(np.float32).tobytes()
            tier.put([(h, encode(spec, payload))])
    peer = HostilePeer(CountingSource(tier))
    peer.start()
    return peer


@pytest.fixture(scope="module")
def hostile(worker, prompts):
    peer = _start_hostile(worker, prompts)
    yield peer
    peer.stop()


@pytest.fixture
def fresh_hostile(worker, prompts):
    """A hostile peer at an address the worker never met: the module's one is in the worker's
    failure cooldown after a test it failed, and would not be asked at all."""
    peer = _start_hostile(worker, prompts)
    yield peer
    peer.stop()


def generate(channel, ids: list[int], peers: list[str], rid: str) -> list[ipb.GenerateResponse]:
    req = ipb.GenerateRequest(
        token_ids=ipb.TokenIds(ids=ids),
        request_id=rid,
        sampling=ipb.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        peer_addresses=peers,
    )
    return list(ipb_grpc.InferenceStub(channel).Generate(req, timeout=300))


def tokens(msgs) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


def test_a_client_cannot_name_peers(worker, hostile, prompts):
    with grpc.insecure_channel(worker.address) as ch, pytest.raises(grpc.RpcError) as e:
        generate(ch, prompts[0], [hostile.address], "client-names-a-peer")
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "peer_addresses" in e.value.details()
    with OTHER_CLUSTER(worker.address) as ch, pytest.raises(grpc.RpcError) as e:
        generate(ch, prompts[0], [hostile.address], "wrong-secret-names-a-peer")
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # the worker never contacted the hostile peer, and cached nothing of the prompt
    assert hostile.source.lookups == 0 and hostile.source.fetches == 0
    assert hostile.data_plane.connections == 0
    eng = worker.engine.engine
    hashes = set(hash_pages(prompts[0], eng.cache_config.block_size, eng.model_fp))
    cached = worker.engine.call(LLMEngine.cached_pages_by_tier)
    assert not hashes & {h for pages in cached.values() for h in pages}


def test_a_member_naming_a_peer_that_cannot_prove_the_secret_gets_no_page(
    worker, hostile, prompts, reference
):
    with member_channel(worker.address) as ch:  # as the router would
        msgs = generate(ch, prompts[0], [hostile.address], "member-names-a-hostile-peer")
    assert tokens(msgs) == reference[0]
    assert msgs[-1].usage.cached_tokens_by_tier.get("peer", 0) == 0
    assert hostile.source.lookups >= 1  # it was asked, and its answer was not believed
    assert hostile.source.fetches == 0


def test_control_without_the_proof_check_the_forged_pages_poison_the_output(
    worker, fresh_hostile, prompts, reference, monkeypatch
):
    """Shows what the check above prevents: believing any peer, the worker caches the
    forged pages and answers wrongly (a fresh prompt: the first is computed and cached)."""
    monkeypatch.setattr(ClusterIdentity, "verify_server", lambda self, nonce, md: True)
    with member_channel(worker.address) as ch:
        msgs = generate(ch, prompts[1], [fresh_hostile.address], "control-believes-anyone")
    assert msgs[-1].usage.cached_tokens_by_tier.get("peer", 0) >= 64
    assert tokens(msgs) != reference[1]


def test_cluster_rpcs_refuse_non_members(worker):
    probes = [
        lambda s: s.Lookup(kpb.LookupRequest(hashes=[bytes(16)]), timeout=30),
        lambda s: list(s.Fetch(kpb.FetchRequest(hashes=[bytes(16)]), timeout=30)),
        lambda s: s.DataPlane(kpb.DataPlaneRequest(version=dp.VERSION), timeout=30),
        lambda s: s.Push(iter([]), timeout=30),
    ]
    for make in (
        lambda: grpc.insecure_channel(worker.address),
        lambda: OTHER_CLUSTER(worker.address),
    ):
        with make() as ch:
            stub = kpb_grpc.KVTransferStub(ch)
            for probe in probes:
                with pytest.raises(grpc.RpcError) as e:
                    probe(stub)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as e:
                ipb_grpc.InferenceStub(ch).GetLoad(ipb.GetLoadRequest(), timeout=30)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with member_channel(worker.address) as ch:  # the positive control
        assert kpb_grpc.KVTransferStub(ch).Lookup(
            kpb.LookupRequest(hashes=[bytes(16)]), timeout=30
        ).tiers == [""]
        assert ipb_grpc.InferenceStub(ch).GetLoad(ipb.GetLoadRequest(), timeout=30).num_pages > 0


def test_a_forged_push_is_rejected(worker):
    spec = worker.engine.engine.page_spec
    forged, genuine = b"forged-page-hash", b"genuine-pagehash"
    obj = encode(spec, bytes(spec.page_nbytes))
    for make in (
        lambda: grpc.insecure_channel(worker.address),
        lambda: OTHER_CLUSTER(worker.address),
    ):
        with make() as ch, pytest.raises(grpc.RpcError) as e:
            kpb_grpc.KVTransferStub(ch).Push(page_chunks([(0, forged, obj)]), timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    member = PeerTier(worker.address, identity=ID)
    try:
        assert member.push([(genuine, obj)]) == 1  # a member's push is stored
    finally:
        member.close()
    with member_channel(worker.address) as ch:
        where = kpb_grpc.KVTransferStub(ch).Lookup(
            kpb.LookupRequest(hashes=[forged, genuine]), timeout=30
        )
    assert list(where.tiers) == ["", "host"]


def test_a_data_plane_client_without_the_secret_gets_nothing(worker, prompts, reference):
    eng = worker.engine.engine
    with grpc.insecure_channel(worker.address) as ch:  # the token is not handed out ...
        with pytest.raises(grpc.RpcError) as e:
            kpb_grpc.KVTransferStub(ch).DataPlane(kpb.DataPlaneRequest(version=dp.VERSION))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(worker.address) as ch:  # the prompt is cached (as a client)
        assert tokens(generate(ch, prompts[2], [], "cache-it")) == reference[2]
    hashes = hash_pages(prompts[2], eng.cache_config.block_size, eng.model_fp)
    # ... and even with it (leaked), a request without the key's MAC is cut unanswered
    token, plane = worker.data_plane.token, worker.data_plane
    rejected = plane.rejected
    with socket.create_connection(("127.0.0.1", worker.data_plane_port)) as sock:
        sock.sendall(encode_request(token, hashes, OTHER.data_plane_key, bytes(16)))
        sock.settimeout(30)
        assert sock.recv(1 << 16) == b""  # closed, not a byte of a page
    assert plane.rejected == rejected + 1
    # the positive control: the same request with the cluster's key gets the pages
    client = dp.DataPlaneClient("127.0.0.1", worker.data_plane_port, token, key=ID.data_plane_key)
    try:
        res = client.fetch(hashes, timeout=30)
    finally:
        client.close()
    assert res.error is None and len(res.objects) == len(hashes)


def test_unfinished_pushed_objects_are_bounded():
    """A sender that starts objects and never finishes them holds at most max_partial_bytes
    of the receiver's memory."""
    big = bytes(3 << 20)  # three pieces each
    asm = PageAssembler(max_partial_bytes=7 << 20)
    firsts = [
        next(p for c in page_chunks([(0, bytes([i]) * 16, big)]) for p in c.pieces)
        for i in range(4)
    ]
    assert [asm.add(i, p) for i, p in enumerate(firsts)] == [
        None,
        None,
        (False, None),
        (False, None),
    ]
    assert asm.over_limit == 2 and len(asm.incomplete()) == 2


def OTHER_CLUSTER(address: str):  # noqa: N802  (reads like the channel it makes)
    """A channel that proves another cluster's secret."""
    return member_channel(address, OTHER)
