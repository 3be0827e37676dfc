"""A clean shutdown writes the cache down to Redis (worker/flush.py): ``LLM.close()`` and
``kvmesh worker`` on SIGTERM leave their device and host pages in Redis, and a fresh engine
in another process serves the prefix from there, with the very tokens."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from helpers import free_port, text_prompts, wait_until

from kvmesh.cluster.client import Client, Unavailable
from kvmesh.kvstore.redis_tier import redis_key
from kvmesh.worker import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _keys(llm: LLM, prompt) -> list[str]:
    eng = llm.engine
    req = eng.make_request(prompt)
    return [redis_key(eng.model_fp, eng.cache_format, h) for h in req.page_hashes]


def test_llm_close_writes_device_and_host_pages_to_redis(redis_server, smol_llm, shakespeare):
    # two prompts: one stays on the device, the other is pushed to the host tier first
    on_device, on_host = text_prompts(smol_llm.tokenizer, shakespeare, [200, 200])
    reference = [o.token_ids for o in smol_llm.generate([on_device, on_host], GREEDY)]
    llm = LLM(
        "smollm2-135m-instruct",
        kv_cache_memory="64MiB",
        host_cache_memory="64MiB",  # holds everything: nothing reaches Redis by eviction
        redis_url=redis_server.url,
    )
    r = redis_server.client()
    llm.generate([on_host], GREEDY)
    llm.reset_prefix_cache()  # device -> host
    llm.generate([on_device], GREEDY)
    keys = _keys(llm, on_device) + _keys(llm, on_host)
    assert len(keys) == 24  # 12 full pages each
    assert r.exists(*keys) == 0  # nothing in Redis before the close
    llm.close()
    assert r.exists(*keys) == 24
    llm.close()  # twice is fine

    fresh = LLM("smollm2-135m-instruct", kv_cache_memory="64MiB", redis_url=redis_server.url)
    try:
        outs = fresh.generate([on_device, on_host], GREEDY)
    finally:
        fresh.close(flush_timeout_s=None)
    assert [o.cached_tokens_by_tier.get("redis", 0) for o in outs] == [192, 192]
    assert [o.token_ids for o in outs] == reference


def test_close_without_flush_leaves_redis_empty(redis_server, smol_llm, shakespeare):
    """The control: the same engine closed with the flush off writes nothing."""
    (prompt,) = text_prompts(smol_llm.tokenizer, shakespeare, [200], stride=9000)
    llm = LLM(
        "smollm2-135m-instruct",
        kv_cache_memory="64MiB",
        host_cache_memory="64MiB",
        redis_url=redis_server.url,
    )
    llm.generate([prompt], GREEDY)
    keys = _keys(llm, prompt)
    llm.close(flush_timeout_s=None)
    assert redis_server.client().exists(*keys) == 0


def test_kvmesh_worker_flushes_host_pages_to_redis_on_sigterm(redis_server, smol_llm, shakespeare):
    port = free_port()
    env = {**os.environ, "KVMESH_NUM_THREADS": "1"}
    # a device pool of 13 pages: the second prompt evicts the first into the host tier,
    # which holds it (64 MiB) and would never write it to Redis by itself
    args = (
        f"worker --host 127.0.0.1 --port {port} --kv-cache-memory 10MiB "
        f"--host-cache-memory 64MiB --redis-url {redis_server.url} --flush-timeout 30"
    )
    cmd = [sys.executable, "-m", "kvmesh.cluster.cli", *args.split()]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    first, second = text_prompts(smol_llm.tokenizer, shakespeare, [200, 200], stride=7000)
    reference = [o.token_ids for o in smol_llm.generate([first, second], GREEDY)]
    r = redis_server.client()
    keys = _keys(smol_llm, first)
    try:
        with Client(f"127.0.0.1:{port}", retries=0, timeout=5) as c:

            def up() -> bool:
                try:
                    return c.health() == "SERVING"
                except Unavailable:
                    return proc.poll() is not None

            assert wait_until(up, timeout=180, every=0.5) and proc.poll() is None
            for p in (first, second):
                c.generate_text(p, timeout=120, temperature=0.0, max_tokens=4, ignore_eos=True)
        assert r.exists(*keys) == 0  # in host RAM only, before the signal
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = proc.stdout.read().decode()
    assert "flushed the cache to redis" in log, log[-3000:]
    assert r.exists(*keys) == len(keys) == 12

    fresh = LLM("smollm2-135m-instruct", kv_cache_memory="64MiB", redis_url=redis_server.url)
    try:
        outs = fresh.generate([first, second], GREEDY)
    finally:
        fresh.close(flush_timeout_s=None)
    assert [o.cached_tokens_by_tier.get("redis", 0) for o in outs] == [192, 192]
    assert [o.token_ids for o in outs] == reference
