"""Compaction and the tiers: the private pages a compaction takes may be cached pages the
pool evicts for it, queued for the host tier under their hashes. Their old bytes must leave
before compaction overwrites them, or the host (and Redis) would hold compacted KV under
another prompt's page hashes and serve it as that prompt's prefix."""

from __future__ import annotations

from helpers import text_prompts

from kvmesh.worker import LLM, SamplingParams

BS = 16


def _greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def test_pages_taken_for_compaction_spill_their_old_bytes_first(shakespeare):
    # 14 pages: P caches 6 (96 tokens); Q's 160-token prompt takes the 8 empty pages and
    # 3 of P's, then its SnapKV compaction (32 tokens: 2 pages) evicts 2 more of P's
    llm = LLM(
        "smollm2-135m-instruct",
        dtype="float32",
        num_pages=14,
        block_size=BS,
        max_num_batched_tokens=64,
        host_cache_memory="64MiB",
    )
    try:
        tok = llm.engine.tokenizer
        P, Q = text_prompts(tok, shakespeare, [97, 160])
        ref = llm.generate([P], _greedy(8))[0]
        llm.generate([Q], _greedy(2, kv_budget=32, kv_policy="snapkv"))
        assert llm.engine.eviction.num_compactions >= 1, "the compaction did not run"
        llm.engine.reset_prefix_cache()  # what is left on the device goes to host as well
        again = llm.generate([P], _greedy(8))[0]
        # P's prefix comes back from the host tier, whole, and gives the very same tokens
        assert again.num_cached_tokens == 96
        assert again.token_ids == ref.token_ids
    finally:
        llm.close()
