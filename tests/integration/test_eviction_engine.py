"""KV eviction in the engine, on the real SmolLM2 weights (fp32): budgets, compaction,
shared prefix pages, memory bounds, and StreamingLLM against transformers with the same
tokens masked out."""

import math

import pytest
import torch
from helpers import text_prompts

from kvmesh.worker import LLM, SamplingParams
from kvmesh.worker.eviction import policies

BS = 16


@pytest.fixture(scope="module")
def llm_torch():
    """The pure torch backend (the reference), for the compaction test."""
    return LLM(
        "smollm2-135m-instruct",
        dtype="float32",
        kv_cache_memory="16MiB",
        max_num_batched_tokens=64,
        block_size=BS,
        attention_backend="torch",
    )


@pytest.fixture(scope="module")
def llm():
    # the default CPU backend (C decode kernel), chunked prefill of 64 tokens
    return LLM(
        "smollm2-135m-instruct",
        dtype="float32",
        kv_cache_memory="64MiB",
        max_num_batched_tokens=64,
        block_size=BS,
    )


def _greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def _run(llm, ids, params, on_step=None):
    """Step the engine through one request; ``on_step(req)`` after every step."""
    eng = llm.engine
    req = eng.make_request(ids, params)
    eng.add(req)
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
        if on_step is not None and req.num_computed_tokens:
            on_step(req)
    return req, out


def test_budget_at_least_the_prompt_changes_nothing(llm, shakespeare):
    (ids,) = text_prompts(llm.tokenizer, shakespeare, [64])
    base = llm.generate([ids], _greedy(10))[0]
    for policy in policies.POLICIES:
        llm.reset_prefix_cache()
        got = llm.generate([ids], _greedy(10, kv_budget=64, kv_policy=policy))[0]
        assert got.token_ids == base.token_ids, policy


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_a_compaction_that_keeps_everything_changes_nothing(
    request, backend, shakespeare, monkeypatch
):
    """Every step past 32 cached slots copies the whole cache to fresh pages: the tokens
    equal the uncompressed run's (fp32 copies are exact), so slots, tables and the residual
    bookkeeping survive the move."""
    llm = request.getfixturevalue("llm" if backend == "cpu" else "llm_torch")
    (ids,) = text_prompts(llm.tokenizer, shakespeare, [40])
    base = llm.generate([ids], _greedy(16))[0]

    class KeepAll(policies.StreamingLLM):
        def select(self, scores, after_prefill):
            L, H, N = scores.shape
            return torch.arange(N).expand(L, H, N).clone()

    monkeypatch.setattr(
        "kvmesh.worker.eviction.manager.make_policy", lambda name, budget: KeepAll(budget)
    )
    before = llm.engine.eviction.num_compactions
    got = llm.generate([ids], _greedy(16, kv_budget=16, kv_policy="streaming"))[0]
    assert llm.engine.eviction.num_compactions - before >= 16
    assert got.token_ids == base.token_ids


def test_compaction_leaves_shared_prefix_pages_untouched_and_cached(llm, shakespeare):
    eng = llm.engine
    (ids,) = text_prompts(llm.tokenizer, shakespeare, [96])
    llm.reset_prefix_cache()
    first = llm.generate([ids], _greedy(4))[0]
    hashes = eng.make_request(ids).page_hashes  # 6 full pages
    before = eng.read_cached_pages(hashes)
    assert all(b is not None for b in before)

    private: set[int] = set()

    def watch(req):
        if req.num_evicted:
            private.update(eng.kv.page_ids(req))

    req, out = _run(llm, ids, _greedy(20, kv_budget=48, kv_policy="snapkv"), watch)
    # it shared the cached prefix up to its observation window (96 - 32 tokens)...
    assert req.num_cached_tokens == 64
    assert req.num_evicted > 0 and private  # ...and was compacted into pages of its own
    # the shared pages: every byte as before, all still cached under their hashes
    assert eng.read_cached_pages(hashes) == before
    # a compacted page is never registered under a page hash (its bytes are not the page's)
    assert not private & {p.page_id for p in eng.kv.pool.cached.values()}
    again = llm.generate([ids], _greedy(4))[0]
    assert again.num_cached_tokens == 80 and again.token_ids == first.token_ids


@pytest.mark.parametrize("policy", policies.POLICIES)
def test_a_request_holds_at_most_its_budget_in_pages(llm, shakespeare, policy):
    (ids,) = text_prompts(llm.tokenizer, shakespeare, [100])
    budget = 40
    held = []

    def watch(req):
        if req.num_computed_tokens >= req.num_prompt_tokens:
            held.append(len(llm.engine.kv.page_ids(req)))

    req, out = _run(llm, ids, _greedy(24, kv_budget=budget, kv_policy=policy), watch)
    assert out.finish_reason == "length" and len(out.token_ids) == 24
    assert held and max(held) <= math.ceil(budget / BS) + 1, held
    assert req.num_evicted >= 100 - budget


def test_streaming_generates_4x_its_budget_in_flat_memory(llm, shakespeare):
    (ids,) = text_prompts(llm.tokenizer, shakespeare, [24])
    budget = 16
    held = []
    req, out = _run(
        llm,
        ids,
        _greedy(4 * budget + 8, kv_budget=budget, kv_policy="streaming"),
        lambda r: held.append(len(llm.engine.kv.page_ids(r))),
    )
    assert len(out.token_ids) == 4 * budget + 8
    assert max(held) <= math.ceil(budget / BS) + 1
    # flat: the second half of the run holds what the first half did at most
    assert max(held[len(held) // 2 :]) == max(held[: len(held) // 2])
    assert req.cache_len <= budget + BS and req.num_evicted >= 3 * budget


def test_streaming_matches_transformers_with_the_evicted_tokens_masked(llm, hf_smol, shakespeare):
    """Keys keep their positions through compaction: the engine's tokens equal transformers'
    when each query of the reference sees exactly the tokens the engine still held for it."""
    P, budget, sinks, n_new = 40, 24, 4, 40
    (ids,) = text_prompts(llm.tokenizer, shakespeare, [P])
    out = llm.generate([ids], _greedy(n_new, kv_budget=budget, kv_policy="streaming"))[0]
    seq = ids + out.token_ids[:-1]
    T = len(seq)
    allowed = torch.zeros(T, T, dtype=torch.bool)
    for j in range(P):  # the prompt: causal over all of it
        allowed[j, : j + 1] = True
    kept = list(range(P))  # the engine's rule: compact after the prompt, then at budget + BS
    first = True
    for p in range(P, T + 1):
        if len(kept) > budget and (first or len(kept) >= budget + BS):
            kept = kept[:sinks] + kept[-(budget - sinks) :]
        first = False
        if p == T:
            break
        kept.append(p)
        allowed[p, kept] = True
    mask = torch.zeros(1, 1, T, T)
    mask[0, 0][~allowed] = float("-inf")
    with torch.no_grad():
        logits = hf_smol(
            torch.tensor([seq]), attention_mask=mask, position_ids=torch.arange(T)[None]
        ).logits[0]
    ref = logits[P - 1 :].argmax(-1).tolist()
    assert out.token_ids == ref


def test_a_prefix_cache_hit_leaves_the_observed_queries_to_compute(llm, shakespeare):
    """SnapKV reads its window's attention, H2O every query's: a cached page is not
    recomputed, so a prefix hit stops short of them (it served the whole prompt but the
    last token before, and SnapKV then saw 1 to 16 of its 32 window queries)."""
    P, budget = 120, 48
    (ids,) = text_prompts(llm.tokenizer, shakespeare, [P])
    _run(llm, ids, _greedy(2))  # caches the prompt's pages
    full, _ = _run(llm, ids, _greedy(2))
    assert full.num_cached_tokens == (P - 1) // BS * BS
    snap, _ = _run(llm, ids, _greedy(2, kv_budget=budget, kv_policy="snapkv"))
    window = policies.SnapKV(budget).window
    assert 0 < snap.num_cached_tokens <= P - window
    h2o, _ = _run(llm, ids, _greedy(2, kv_budget=budget, kv_policy="h2o"))
    assert h2o.num_cached_tokens == 0
    streaming, _ = _run(llm, ids, _greedy(2, kv_budget=budget, kv_policy="streaming"))
    assert streaming.num_cached_tokens == full.num_cached_tokens
