"""The engine with a tiered store: evicted prefixes come back from host RAM or a real Redis,
byte-exact, and no tier fault ever fails a request or changes its tokens."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import text_prompts, wait_until

from kvmesh.kvstore.redis_tier import redis_key
from kvmesh.worker import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BS = 16


@pytest.fixture(scope="module")
def prompts(smol_llm, shakespeare):
    # 1,030 tokens: 64 full pages, and the last 6 tokens are always computed
    return text_prompts(smol_llm.tokenizer, shakespeare, [1030, 1030, 1030, 300, 300, 300, 300])


@pytest.fixture(scope="module")
def reference(smol_llm, prompts):
    """Tokens of a run that never evicted anything (the shared engine has no store)."""
    return [o.token_ids for o in smol_llm.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def host_engine(redis_server_module):
    # 66 usable pages: one 1,030-token request (65 pages) fits; the next evicts all of it
    # but its first page
    llm = LLM(
        "smollm2-135m-instruct",
        num_pages=67,
        host_cache_memory="512MiB",
        redis_url=redis_server_module.url,
        max_num_batched_tokens=512,
    )
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def redis_engine(redis_server_module):
    # a host tier smaller than two pages: nearly everything it spills lands in Redis
    llm = LLM(
        "smollm2-135m-instruct",
        kv_cache_memory="256MiB",
        host_cache_memory="1MiB",
        redis_url=redis_server_module.url,
        max_num_batched_tokens=512,
    )
    yield llm
    llm.close()


def _run(llm, prompt):
    before = llm.engine.runner.tokens_computed
    out = llm.generate([prompt], GREEDY)[0]
    return out, llm.engine.runner.tokens_computed - before


def test_evicted_prefix_is_served_from_host(host_engine, prompts, reference):
    a, b = prompts[0], prompts[1]
    first, _ = _run(host_engine, a)
    assert first.token_ids == reference[0]
    assert first.cached_tokens_by_tier == {"device": 0, "host": 0, "redis": 0}
    _run(host_engine, b)  # needs a's pages: the device evicts them and they spill to host
    host_engine.engine.connector.drain()
    out, computed = _run(host_engine, a)
    assert out.cached_tokens_by_tier["host"] >= 1008
    assert out.num_cached_tokens == 1024
    assert out.token_ids == reference[0]
    # only the rest was computed: 6 prompt tokens, then one per generated token but the last
    assert computed == 1030 - 1024 + GREEDY.max_tokens - 1
    m = host_engine.engine.store_metrics()
    assert m["offload"]["spilled_pages"] >= 64 and m["tiers"]["host"]["hits"] >= 63


def test_a_page_the_host_still_holds_is_not_spilled_again(host_engine, prompts, reference):
    # a's pages come back from host; evicting them again (b needs the room) must not copy,
    # encode and store them a second time, and a third round still serves a from host.
    a, b = prompts[0], prompts[1]
    _run(host_engine, a)
    _run(host_engine, b)
    host_engine.engine.connector.drain()
    out, _ = _run(host_engine, a)  # loaded from host
    assert out.cached_tokens_by_tier["host"] >= 1008
    m0 = host_engine.engine.store_metrics()["offload"]
    _run(host_engine, b)  # evicts a's loaded pages again
    host_engine.engine.connector.drain()
    m1 = host_engine.engine.store_metrics()["offload"]
    assert m1["spill_already_stored_pages"] - m0["spill_already_stored_pages"] >= 60
    out, _ = _run(host_engine, a)
    assert out.cached_tokens_by_tier["host"] >= 1008
    assert out.token_ids == reference[0]


def test_reset_prefix_cache_spills_and_device_hit_follows(host_engine, prompts, reference):
    _run(host_engine, prompts[1])
    assert host_engine.reset_prefix_cache() > 0
    out, computed = _run(host_engine, prompts[1])
    assert out.cached_tokens_by_tier["host"] == 1024 and out.token_ids == reference[1]
    again, _ = _run(host_engine, prompts[1])  # promoted pages are device pages now
    assert again.cached_tokens_by_tier["device"] == 1024 and again.token_ids == reference[1]


def test_host_too_small_serves_from_redis(redis_engine, redis_server_module, prompts, reference):
    _run(redis_engine, prompts[2])
    redis_engine.reset_prefix_cache()
    keys = redis_server_module.client().keys("kvmesh:*")
    assert len(keys) >= 62
    out, computed = _run(redis_engine, prompts[2])
    assert out.cached_tokens_by_tier["redis"] >= 992
    assert out.num_cached_tokens == 1024
    assert out.token_ids == reference[2]
    assert computed == 1030 - 1024 + GREEDY.max_tokens - 1


_OTHER_PROCESS = """
import sys
from kvmesh.worker import LLM, SamplingParams
llm = LLM("smollm2-135m-instruct", kv_cache_memory="128MiB", redis_url=sys.argv[1])
ids = [int(t) for t in sys.argv[2].split(",")]
llm.generate([ids], SamplingParams(max_tokens=1))
llm.reset_prefix_cache()   # spill everything it computed to Redis
llm.close()
print("spilled")
"""


def test_second_process_serves_first_process_prefix(redis_server_module, prompts, reference):
    prompt = prompts[3]
    proc = subprocess.run(
        [sys.executable, "-c", _OTHER_PROCESS, redis_server_module.url, ",".join(map(str, prompt))],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and "spilled" in proc.stdout, proc.stderr[-2000:]
    llm = LLM("smollm2-135m-instruct", kv_cache_memory="128MiB", redis_url=redis_server_module.url)
    try:
        out, computed = _run(llm, prompt)
    finally:
        llm.close()
    assert out.cached_tokens_by_tier["redis"] == 288  # 18 full pages of 300 tokens
    assert out.token_ids == reference[3]
    assert computed == 300 - 288 + GREEDY.max_tokens - 1


def _spill_to_redis(llm, prompt) -> list[str]:
    """Compute ``prompt`` and spill it; return its pages' Redis keys in order."""
    _run(llm, prompt)
    llm.reset_prefix_cache()
    req = llm.engine.make_request(prompt)
    eng = llm.engine
    return [redis_key(eng.model_fp, eng.cache_format, h) for h in req.page_hashes]


@pytest.mark.parametrize("damage", ["garbage", "flipped_byte"])
def test_corrupt_redis_object_is_a_miss_and_is_deleted(
    damage, redis_engine, redis_server_module, prompts, reference
):
    prompt, want = (prompts[4], reference[4]) if damage == "garbage" else (prompts[5], reference[5])
    keys = _spill_to_redis(redis_engine, prompt)
    r = redis_server_module.client()
    bad = keys[5]
    if damage == "garbage":
        r.set(bad, b"not a page at all")
    else:
        obj = bytearray(r.get(bad))
        obj[-100] ^= 0x01  # a payload byte: only the checksum can tell
        r.set(bad, bytes(obj))
    out, _ = _run(redis_engine, prompt)
    assert out.token_ids == want
    assert out.cached_tokens_by_tier["redis"] == 5 * BS  # the run stops at the bad page
    assert r.exists(bad) == 0
    assert redis_engine.engine.store_metrics()["tiers"]["redis"]["corrupt"] >= 1


def test_redis_killed_mid_run_and_restarted(redis_engine, redis_server_module, prompts, reference):
    keys = _spill_to_redis(redis_engine, prompts[6])
    assert keys
    eng = redis_engine.engine
    redis_errors = lambda: eng.store_metrics()["tiers"]["redis"]["errors"]  # noqa: E731
    errors_before = redis_errors()
    # a batch runs; once it has produced tokens Redis dies, and then a request whose prefix
    # only Redis held joins the running batch
    final, produced = {}, False
    ids = [eng.add_request(prompts[i], GREEDY) for i in (4, 5)]
    while not produced:
        outs = eng.step()
        produced = bool(outs)
        final.update((o.request_id, o) for o in outs if o.finished)
    running = [r for r in ids if r not in final]
    redis_server_module.stop()
    ids.append(eng.add_request(prompts[6], GREEDY))
    while eng.has_unfinished_requests():
        final.update((o.request_id, o) for o in eng.step() if o.finished)
    outs = [final[r] for r in ids]
    assert running, "Redis was to die while the batch was running"
    # lookups turned into misses and spills were skipped; no request failed or changed
    assert [o.token_ids for o in outs] == [reference[4], reference[5], reference[6]]
    assert all(o.finish_reason == "length" for o in outs)
    assert outs[2].cached_tokens_by_tier["redis"] == 0  # its pages were in the dead Redis
    assert redis_errors() > errors_before  # the batch did meet the dead server
    redis_engine.reset_prefix_cache()
    out, _ = _run(redis_engine, prompts[6])
    assert out.token_ids == reference[6]
    assert out.cached_tokens_by_tier["redis"] == 0
    redis_server_module.start()  # empty: no persistence

    def redis_serves_again() -> bool:  # once the tier's backoff has passed
        _spill_to_redis(redis_engine, prompts[6])
        out, _ = _run(redis_engine, prompts[6])
        assert out.token_ids == reference[6]
        return out.cached_tokens_by_tier["redis"] >= 256

    assert wait_until(redis_serves_again, timeout=30, every=0.5)


def test_tiny_maxmemory_evicting_keys_is_a_miss(
    redis_engine, redis_server_module, prompts, reference
):
    r = redis_server_module.client()
    r.flushall()
    r.config_set("maxmemory-policy", "allkeys-lru")
    r.config_set("maxmemory", "2mb")  # about two pages: Redis drops most of what it gets
    try:
        _spill_to_redis(redis_engine, prompts[2])
        out, _ = _run(redis_engine, prompts[2])
    finally:
        r.config_set("maxmemory", "0")
    assert out.token_ids == reference[2]
    assert out.cached_tokens_by_tier["redis"] < 1008
