"""The pure parts of kvmesh.protos.security: secrets never printed, keys independent, the
server proof, who may call what, and the data plane's MACs."""

from __future__ import annotations

import pickle

import pytest

from kvmesh.kvstore.dataplane import protocol as dp
from kvmesh.protos.kvmesh.v1 import inference_pb2, kv_transfer_pb2
from kvmesh.protos.security import (
    AccessPolicy,
    BearerTokens,
    ClusterIdentity,
    TLSConfig,
    _derive,
)
from kvmesh.router.service import ROUTER_CLUSTER_ONLY
from kvmesh.worker.server import CLUSTER_ONLY_METHODS

SECRET = b"unit-test-cluster-secret-0123456789"


def test_the_secret_and_its_keys_are_never_printed_and_survive_pickling():
    ident = ClusterIdentity(SECRET)
    for text in (repr(ident), str(ident)):
        assert SECRET.decode() not in text and ident.credential not in text
    # independent keys, none of them the secret, all 32 bytes
    keys = [
        bytes.fromhex(ident.credential),
        ident.data_plane_key,
        ident._proof_key,
        _derive(SECRET, "another-purpose"),
        SECRET,
    ]
    assert len(set(keys)) == len(keys)
    assert all(len(k) == 32 for k in keys[:-1])
    assert pickle.loads(pickle.dumps(ident)) == ident  # Ray hands it to the actors
    assert ClusterIdentity(SECRET[:-1] + b"x") != ident


def test_a_short_secret_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(b"  short\n")
    with pytest.raises(ValueError, match="secret"):
        ClusterIdentity.from_file(path)
    path.write_text(SECRET.decode() + "\n")  # whitespace around it is not part of it
    assert ClusterIdentity.from_file(path) == ClusterIdentity(SECRET)


def test_the_server_proof_is_bound_to_the_nonce_and_the_secret():
    ident, other = ClusterIdentity(SECRET), ClusterIdentity(b"another-clusters-secret-000")
    md, nonce = ident.challenge()
    assert ident.authenticates(md) and not other.authenticates(md)
    proof = [("kvmesh-cluster-proof", ident.proof(nonce))]
    assert ident.verify_server(nonce, proof)
    assert not ident.verify_server(nonce + "0", proof)  # a replayed proof of another nonce
    assert not ident.verify_server(nonce, [("kvmesh-cluster-proof", other.proof(nonce))])
    assert not ident.verify_server(nonce, [])


def test_the_access_policy():
    ident = ClusterIdentity(SECRET)
    member = ident.metadata()
    client = [("authorization", "Bearer tenant-token-0123456789")]
    open_ = AccessPolicy(ident, None, CLUSTER_ONLY_METHODS)  # the worker's real list
    locked = AccessPolicy(ident, BearerTokens(["tenant-token-0123456789"]), CLUSTER_ONLY_METHODS)
    lonely = AccessPolicy(None, None, CLUSTER_ONLY_METHODS)
    fetch, generate = "/kvmesh.v1.KVTransfer/Fetch", "/kvmesh.v1.Inference/Generate"
    health = "/grpc.health.v1.Health/Check"
    assert open_.verdict(fetch, member) is None
    assert "cluster members" in open_.verdict(fetch, client)
    assert "no cluster secret" in lonely.verdict(fetch, member)
    assert open_.verdict("/kvmesh.v1.Inference/GetLoad", ()) is not None
    assert open_.verdict(generate, ()) is None  # no token file: open
    assert "bearer token" in locked.verdict(generate, ())
    assert locked.verdict(generate, client) is None
    assert locked.verdict(generate, member) is None  # members may call client methods
    assert locked.verdict(health, ()) is None  # probes carry no token


def _methods(pb2, service: str) -> list[str]:
    svc = pb2.DESCRIPTOR.services_by_name[service]
    return [f"/{svc.full_name}/{m.name}" for m in svc.methods]


def test_the_servers_cluster_only_lists_cover_kvtransfer_and_the_load():
    """The worker's and the router's real lists (docs/security.md, "What needs what"): every
    KVTransfer method and GetLoad are for members only, the client methods are not."""
    worker = AccessPolicy(ClusterIdentity(SECRET), None, CLUSTER_ONLY_METHODS)
    router = AccessPolicy(ClusterIdentity(SECRET), None, ROUTER_CLUSTER_ONLY)
    kv = _methods(kv_transfer_pb2, "KVTransfer")
    assert {m.rsplit("/", 1)[1] for m in kv} >= {"Lookup", "Fetch", "Push", "DataPlane"}
    for method in kv:
        assert worker.is_cluster_only(method), method
    get_load = "/kvmesh.v1.Inference/GetLoad"
    assert worker.is_cluster_only(get_load) and router.is_cluster_only(get_load)
    for method in _methods(inference_pb2, "Inference"):
        if method != get_load:  # Generate, Abort, GetModelInfo: clients' methods
            assert not worker.is_cluster_only(method), method
            assert not router.is_cluster_only(method), method


def test_tls_material_must_come_in_pairs():
    with pytest.raises(ValueError, match="key"):
        TLSConfig(cert=b"pem")
    with pytest.raises(ValueError, match="client_ca"):
        TLSConfig(client_ca=b"pem")
    assert TLSConfig.from_files() is None
    assert "the-private-key" not in repr(TLSConfig(cert=b"c", key=b"the-private-key"))


def test_data_plane_macs_bind_key_nonce_and_bytes():
    key, other = bytes(range(32)), bytes(32)
    nonce = bytes(16)
    req = dp.encode_request(bytes(16), [bytes(16)], key, nonce)
    head, body, mac = req[: dp.REQUEST_HEAD.size], req[dp.REQUEST_HEAD.size : -32], req[-32:]
    assert dp.request_mac_ok(key, head, body, mac)
    assert not dp.request_mac_ok(other, head, body, mac)
    assert not dp.request_mac_ok(key, head, bytes([1]) + body[1:], mac)
    page = dp.PAGE_HEAD.pack(0, dp.FOUND, 3)
    m = dp.page_mac(key, nonce, page, bytes(16), b"abc")
    assert m != dp.page_mac(key, bytes([1]) * 16, page, bytes(16), b"abc")  # another request
    assert m != dp.page_mac(key, nonce, page, bytes(16), b"abd")
    with pytest.raises(ValueError, match="32 bytes"):
        dp.check_key(b"short")
