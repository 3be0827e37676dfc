"""Prefix caching and preemption on the real model: fewer tokens computed, same outputs."""

from __future__ import annotations

from helpers import text_prompts

from kvmesh.worker import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def test_shared_512_token_prefix_is_served_from_cache(smol_llm, shakespeare):
    engine = smol_llm.engine
    tok = smol_llm.tokenizer
    base = text_prompts(tok, shakespeare[200_000:], [512])[0]
    tail = tok.encode(" And then the king spoke to his court of the long winter.")
    first = smol_llm.generate([base + tok.encode(" Now")], GREEDY)[0]
    assert first.num_cached_tokens == 0

    second_prompt = base + tail
    computed_before = engine.runner.tokens_computed
    second = smol_llm.generate([second_prompt], GREEDY)[0]
    computed = engine.runner.tokens_computed - computed_before

    assert second.num_cached_tokens >= 496
    assert second.cached_tokens_by_tier == {"device": second.num_cached_tokens}
    # the model ran only the uncached prompt tokens, then one token per decode step
    assert computed == len(second_prompt) - second.num_cached_tokens + GREEDY.max_tokens - 1

    cold = LLM("smollm2-135m-instruct", kv_cache_memory="64MiB", enable_prefix_caching=False)
    expected = cold.generate([second_prompt], GREEDY)[0]
    assert expected.num_cached_tokens == 0
    assert second.token_ids == expected.token_ids


def test_block_events_report_stored_and_removed_pages(shakespeare):
    from kvmesh.kvstore import BlockRemoved, BlockStored, hash_pages

    llm = LLM("smollm2-135m-instruct", num_pages=12, block_size=16)
    events = []
    llm.engine.events.subscribe(events.append)
    a, b = text_prompts(llm.tokenizer, shakespeare, [80, 100])
    llm.generate([a], SamplingParams(temperature=0, max_tokens=4))
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [e.block_hash for e in stored] == hash_pages(a, 16, llm.engine.model_fp)
    assert stored[0].parent_hash is None and stored[1].parent_hash == stored[0].block_hash
    assert list(stored[0].token_ids) == a[:16]
    # 11 usable pages cannot hold a's cached pages and b: some of a's are evicted
    llm.generate([b], SamplingParams(temperature=0, max_tokens=4))
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert removed and {e.block_hash for e in removed} <= {e.block_hash for e in stored}
    assert [e.seq for e in events] == list(range(len(events)))


def test_preempted_requests_complete_with_identical_tokens(shakespeare):
    tokenizer_llm = LLM("smollm2-135m-instruct", kv_cache_memory="128MiB")
    prompts = text_prompts(tokenizer_llm.tokenizer, shakespeare, [90, 120, 70, 110, 100, 60])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = tokenizer_llm.generate(prompts, params)
    assert tokenizer_llm.engine.scheduler.num_preemptions == 0

    # 6 requests need ~60 pages at their longest; 20 pages (19 usable) force preemption
    small = LLM("smollm2-135m-instruct", num_pages=20, max_num_batched_tokens=128)
    outs = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    for got, want in zip(outs, expected):
        assert got.finish_reason == "length"
        assert got.token_ids == want.token_ids
    assert small.engine.kv.num_free_pages == 19  # everything freed at the end
