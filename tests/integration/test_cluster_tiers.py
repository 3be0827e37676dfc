"""The router sees the workers' host tiers: a real local Ray cluster of two workers with a
host-RAM tier each (the real SmolLM2 model, real gRPC, the client SDK).

A prefix evicted from a worker's device into its host tier is still that worker's: the
worker publishes the host-tier events (and a snapshot by tier when it registers), the
router's index credits them, and prefix_affinity sends the prefix back there, where it is
promoted from host RAM instead of recomputed.
"""

from __future__ import annotations

import pytest
from helpers import local_cluster, restart_router, wait_until

from kvmesh.cluster import Client
from kvmesh.worker.tokenizer import Tokenizer

MODEL = "smollm2-135m-instruct"
# a small device pool (evictions spill to host) and a host tier that holds every prefix here
ENGINE_ARGS = dict(
    kv_cache_memory="96MiB",
    host_cache_memory="256MiB",
    max_num_batched_tokens=512,
    max_num_seqs=8,
)
SHORT = dict(temperature=0, max_tokens=2, ignore_eos=True)
PREFIX_TOKENS = 256  # 16 full pages


@pytest.fixture(scope="module")
def cluster(smol_src):
    with local_cluster(ENGINE_ARGS, MODEL) as c:
        yield c


@pytest.fixture(scope="module")
def tok(smol_src):
    from kvmesh.worker.models.loader import model_fingerprint

    return Tokenizer.load(smol_src, model_fingerprint(smol_src))


def test_a_prefix_evicted_to_host_still_routes_to_its_worker(cluster, tok, shakespeare):
    def ids(i: int, n: int) -> list[int]:
        out = tok.encode(shakespeare[i * 9000 : i * 9000 + n * 8])[:n]
        assert len(out) == n
        return out

    prefixes = [ids(40 + p, PREFIX_TOKENS) for p in range(6)]
    with Client(cluster.endpoint, timeout=120) as client:
        # cold prefixes, one at a time: each lands on some worker (ties: random), which
        # computes it and caches it in its device pool
        home = {}
        for p, prefix in enumerate(prefixes):
            home[p] = client.generate_text(prefix + ids(60 + p, 16), **SHORT).worker_id
        assert len(set(home.values())) == 2, home  # both workers hold some prefixes
        # every cached device page spills to its worker's host tier; the router's index
        # follows the events: no device page, the prefixes' pages in host
        cluster.reset_prefix_caches()

        def in_host():
            ws = cluster.stats()["workers"]
            return all(ws[w]["index_pages"]["host"] >= PREFIX_TOKENS // 16 for w in home.values())

        assert wait_until(in_host, timeout=30), cluster.stats()["workers"]
        for p, prefix in enumerate(prefixes):
            r = client.generate_text(prefix + ids(70 + p, 16), **SHORT)
            assert r.worker_id == home[p], (p, home, cluster.stats()["decisions"])
            # promoted from host RAM on that worker, not recomputed, not fetched from a peer
            assert r.usage.cached_tokens_by_tier.get("host", 0) > 0, r.usage
            assert r.usage.cached_tokens_by_tier.get("peer", 0) == 0, r.usage


def test_a_worker_registers_its_host_pages(cluster):
    """After a router restart, each worker's snapshot carries its host pages by tier."""
    before = cluster.stats()["workers"]
    host_before = {w: v["index_pages"]["host"] for w, v in before.items()}
    assert any(host_before.values()), before
    assert restart_router(cluster)  # a crash: Ray restarts the actor

    def registered():
        ws = cluster.stats()["workers"]
        return len(ws) == 2 and ws

    ws = wait_until(registered, timeout=30)
    assert ws, "the workers did not register with the restarted router"
    for w, n in host_before.items():
        # the snapshot replays the host tier: the same pages (a spill may have added some)
        assert ws[w]["index_pages"]["host"] >= n, (w, n, ws[w]["index_pages"])
