"""Eviction on a quantized cache (int4: the format whose pages are recompressed with the
most error): a budget at least the prompt changes nothing, and a compacted request stays
within its pages and matches the uncompressed int4 run where little was dropped."""

import math

import pytest
from helpers import text_prompts

from kvmesh.worker import LLM, SamplingParams

BS = 16


@pytest.fixture(scope="module")
def llm_int4():
    return LLM(
        "smollm2-135m-instruct",
        dtype="float32",
        kv_cache_dtype="int4",
        kv_cache_memory="16MiB",
        max_num_batched_tokens=64,
        block_size=BS,
    )


def test_int4_budgets(llm_int4, shakespeare):
    llm = llm_int4
    (ids,) = text_prompts(llm.tokenizer, shakespeare, [72])
    greedy = dict(temperature=0, ignore_eos=True)
    base = llm.generate([ids], SamplingParams(max_tokens=8, **greedy))[0]
    same = llm.generate([ids], SamplingParams(max_tokens=8, kv_budget=72, **greedy))[0]
    assert same.token_ids == base.token_ids[:8]
    eng = llm.engine
    for policy in ("snapkv", "h2o", "streaming"):
        req = eng.make_request(
            ids, SamplingParams(max_tokens=20, kv_budget=40, kv_policy=policy, **greedy)
        )
        eng.add(req)
        held = []
        out = None
        while eng.has_unfinished_requests():
            for o in eng.step():
                out = o
            if req.num_computed_tokens >= req.num_prompt_tokens and not req.status.finished:
                held.append(len(eng.kv.page_ids(req)))
        assert req.num_evicted >= 32 + 16 and max(held) <= math.ceil(40 / BS) + 1
        assert len(out.token_ids) == 20 and out.finish_reason == "length"
        # the first token comes from the full prompt; the next few mostly still agree
        assert out.token_ids[0] == base.token_ids[0], policy
