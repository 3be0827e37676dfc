"""Autoscaling on a real local Ray cluster (real SmolLM2, real Redis, real gRPC): a burst
makes the cluster add a worker; when the load stops it retires the worker whose pages are
least unique, which writes its cache down to Redis first, so a prefix only that worker held
is served to its next request from Redis on the survivor, with the very tokens.

Delays are scaled down from Ray Serve's defaults (30 s up, 600 s down) to seconds."""

from __future__ import annotations

import threading
import urllib.request

import pytest
from helpers import local_cluster, wait_until

from kvmesh.cluster import Client
from kvmesh.cluster.autoscale import AutoscaleConfig
from kvmesh.worker.tokenizer import Tokenizer

MODEL = "smollm2-135m-instruct"
PROMPT_TOKENS = 200  # 12 full pages
GEN = dict(temperature=0, max_tokens=4, ignore_eos=True)


def autoscale_config(preserve_cache: bool = True) -> AutoscaleConfig:
    return AutoscaleConfig(
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
        preserve_cache=preserve_cache,
    )


@pytest.fixture(scope="module")
def tok(smol_src):
    from kvmesh.worker.models.loader import model_fingerprint

    return Tokenizer.load(smol_src, model_fingerprint(smol_src))


def test_burst_scales_up_then_scale_down_keeps_the_retired_workers_cache(
    redis_server, tok, shakespeare
):
    engine_args = dict(
        kv_cache_memory="64MiB",
        host_cache_memory="256MiB",  # holds every prompt here: nothing reaches Redis by spill
        redis_url=redis_server.url,
        max_num_seqs=2,  # a burst queues
        max_num_batched_tokens=256,
    )

    def prompt(i: int) -> list[int]:
        ids = tok.encode(shakespeare[i * 3000 : i * 3000 + PROMPT_TOKENS * 8])[:PROMPT_TOKENS]
        assert len(ids) == PROMPT_TOKENS
        return ids

    with local_cluster(engine_args, MODEL, autoscale=autoscale_config(), metrics_port=0) as cluster:
        assert len(cluster.stats()["workers"]) == 1
        served: dict[int, tuple[str, list[int]]] = {}  # prompt -> (engine id, tokens)
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
                            if after_two[0] >= 8:  # the new worker got its share: stop
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
        assert wait_until(lambda: len(cluster.stats()["workers"]) == 2, timeout=240), (
            cluster.stats()["autoscale"]
        )
        two.set()
        for t in threads:
            t.join(300)
        assert not errors, errors
        st = cluster.stats()["autoscale"]
        (up,) = [d for d in st["decisions"] if d["action"] == "up"]
        assert up["cause"] == "high_load" and up["from_workers"] == 1 and up["to_workers"] == 2
        assert "waiting/worker" in up["reason"] or "queued" in up["reason"], up
        assert up["inputs"]["samples"] >= 1

        # the load stops: one worker goes, the one with the least unique pages
        def down():
            ds = [d for d in cluster.stats()["autoscale"]["decisions"] if d["action"] == "down"]
            return ds[0] if ds else None

        d = wait_until(down, timeout=120)
        assert d, cluster.stats()["autoscale"]
        assert d["cause"] == "low_load" and "fewest unique pages" in d["worker_reason"]
        assert d["flush"]["pages_written"] > 0 and d["flush"]["drained"], d
        assert len(cluster.stats()["workers"]) == 1
        gone = d["worker"]
        mine = [i for i, (w, _) in served.items() if w.rsplit("-", 1)[0] == gone]
        assert mine, (gone, {i: w for i, (w, _) in served.items()})
        import ray

        with pytest.raises(ValueError):  # its actor is gone: Ray can remove its node
            ray.get_actor(gone)

        # the retired worker's last prompt (in its device or host only, until the flush)
        i = max(mine)
        with Client(cluster.endpoint, timeout=120) as c:
            r = c.generate_text(prompt(i), **GEN)
        assert r.worker_id.rsplit("-", 1)[0] != gone
        assert r.usage.cached_tokens_by_tier.get("redis", 0) >= 192, r.usage
        assert r.token_ids == served[i][1]

        # the decisions are in the router's Prometheus metrics too
        text = urllib.request.urlopen(f"http://{cluster.metrics_address()}/metrics").read()
        text = text.decode()
        assert 'kvmesh:autoscale_decisions_total{action="up",cause="high_load"' in text
        assert 'kvmesh:autoscale_decisions_total{action="down",cause="low_load"' in text
        assert "kvmesh:autoscale_flushed_pages_total" in text
