"""kvmesh's autoscaler on Ray's real autoscaler (one machine, the fake multi-node provider,
its own head on its own ports: see ray_autoscaling.py).

The head has no room for a worker (0 CPUs). ``--min-workers 1 --max-workers 2``: the first
worker actor is pending until Ray launches a node for it; a burst of load makes kvmesh add
a worker and Ray launch a second node; when the load stops kvmesh retires one worker (the
one whose pages are least unique, after writing them down to Redis) and Ray removes its
idle node. The retired worker's last prompt is then served from Redis, with the very
tokens."""

from __future__ import annotations

import threading
import urllib.request
import uuid

import pytest
from helpers import free_port, wait_until
from ray_autoscaling import OwnAutoscalingCluster, alive_nodes, wait_for_nodes

from kvmesh.cluster import Client
from kvmesh.cluster.autoscale import AutoscaleConfig
from kvmesh.worker.tokenizer import Tokenizer

MODEL = "smollm2-135m-instruct"
PROMPT_TOKENS = 200  # 12 full pages
GEN = dict(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tok(smol_src):
    from kvmesh.worker.models.loader import model_fingerprint

    return Tokenizer.load(smol_src, model_fingerprint(smol_src))


@pytest.fixture
def ray_autoscaling():
    import ray

    cluster = OwnAutoscalingCluster(
        head_resources={"CPU": 0},
        worker_node_types={
            "kvmesh.worker": {
                "resources": {"CPU": 1, "object_store_memory": 80 * 2**20},
                "node_config": {},
                "min_workers": 0,
                "max_workers": 2,
            }
        },
    )
    address = cluster.start()
    try:
        ray.init(address=address, namespace=f"kvmesh-test-{uuid.uuid4().hex[:6]}")
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert cluster.processes() == []  # everything this test started is gone


def test_ray_adds_and_removes_nodes_as_kvmesh_scales(
    ray_autoscaling, redis_server, tok, shakespeare
):
    import ray

    from kvmesh.cluster.serve import Cluster, ClusterConfig

    assert len(alive_nodes()) == 1  # the head alone
    cfg = ClusterConfig(
        model=MODEL,
        engine_args=dict(
            kv_cache_memory="64MiB",
            host_cache_memory="256MiB",
            redis_url=redis_server.url,
            max_num_seqs=2,
            max_num_batched_tokens=256,
        ),
        host="127.0.0.1",
        port=free_port(),
        metrics_port=0,
        grace_s=2.0,
        log_level="WARNING",
        seed=0,
        autoscale=AutoscaleConfig(
            min_workers=1,
            max_workers=2,
            upscale_delay_s=1.0,
            downscale_delay_s=3.0,
            look_back_s=1.0,
            interval_s=0.25,
            waiting_high=1.0,
            waiting_low=0.25,
            queued_tokens_high=300,
            drain_timeout_s=10.0,
            flush_timeout_s=20.0,
        ),
    )

    def prompt(i: int) -> list[int]:
        ids = tok.encode(shakespeare[i * 3000 : i * 3000 + PROMPT_TOKENS * 8])[:PROMPT_TOKENS]
        assert len(ids) == PROMPT_TOKENS
        return ids

    cluster = Cluster.start(cfg, timeout_s=300)  # its one worker waits for a node
    try:
        assert len(alive_nodes()) == 2
        served: dict[int, tuple[str, list[int]]] = {}
        lock = threading.Lock()
        counter = iter(range(1000))
        two = threading.Event()
        after_two = [0]
        errors: list[BaseException] = []

        def client_loop() -> None:
            try:
                with Client(cluster.endpoint, timeout=300) as c:
                    while True:
                        with lock:
                            if after_two[0] >= 8:
                                return
                            i = next(counter)
                            if two.is_set():
                                after_two[0] += 1
                        r = c.generate_text(prompt(i), **GEN)
                        with lock:
                            served[i] = (r.worker_id, r.token_ids)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=client_loop) for _ in range(6)]
        for t in threads:
            t.start()
        # kvmesh asks for a second worker; Ray launches a node for it
        assert wait_until(lambda: len(cluster.stats()["workers"]) == 2, timeout=300), (
            cluster.stats()["autoscale"]
        )
        two.set()
        assert len(alive_nodes()) == 3
        for t in threads:
            t.join(300)
        assert not errors, errors
        (up,) = [d for d in cluster.stats()["autoscale"]["decisions"] if d["action"] == "up"]
        assert up["cause"] == "high_load" and up["from_workers"] == 1 and up["to_workers"] == 2
        assert "waiting/worker" in up["reason"] or "queued" in up["reason"], up
        assert up["inputs"]["samples"] >= 1

        def down():
            ds = [d for d in cluster.stats()["autoscale"]["decisions"] if d["action"] == "down"]
            return ds[0] if ds else None

        d = wait_until(down, timeout=120)
        assert d, cluster.stats()["autoscale"]
        assert d["cause"] == "low_load" and "fewest unique pages" in d["worker_reason"]
        assert d["flush"]["pages_written"] > 0 and d["flush"]["drained"], d
        assert len(cluster.stats()["workers"]) == 1
        with pytest.raises(ValueError):
            ray.get_actor(d["worker"])  # the retired worker's actor exited ...
        assert wait_for_nodes(2, timeout=120), alive_nodes()  # ... and Ray removed its node

        gone = d["worker"]
        mine = [i for i, (w, _) in served.items() if w.rsplit("-", 1)[0] == gone]
        assert mine, (gone, {i: w for i, (w, _) in served.items()})
        i = max(mine)
        with Client(cluster.endpoint, timeout=120) as c:
            r = c.generate_text(prompt(i), **GEN)
        assert r.worker_id.rsplit("-", 1)[0] != gone
        assert r.usage.cached_tokens_by_tier.get("redis", 0) >= 192, r.usage
        assert r.token_ids == served[i][1]

        # the decisions are in the router's Prometheus metrics too (and so in kvmesh top)
        text = urllib.request.urlopen(f"http://{cluster.metrics_address()}/metrics").read()
        text = text.decode()
        assert 'kvmesh:autoscale_decisions_total{action="up",cause="high_load"' in text
        assert 'kvmesh:autoscale_decisions_total{action="down",cause="low_load"' in text
        assert "kvmesh:autoscale_decision_info{" in text
    finally:
        cluster.shutdown(grace=0)
