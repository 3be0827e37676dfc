"""Greedy outputs equal transformers', token for token, in fp32, on the real SmolLM2 weights."""

from conftest import hf_greedy, text_prompts

from kvmesh.worker import SamplingParams

LENGTHS = [20, 37, 64, 100, 150, 255, 400, 600]
NEW_TOKENS = 24


def test_continuous_batch_with_chunked_prefill_matches_transformers(smol_llm, hf_smol, shakespeare):
    prompts = text_prompts(smol_llm.tokenizer, shakespeare, LENGTHS)
    engine = smol_llm.engine
    steps_before = engine.runner.tokens_computed
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = smol_llm.generate(prompts, params)
    # 8 prompts, 1,626 prompt tokens, 64 tokens a step: prefill really was chunked
    assert engine.scheduler_config.max_num_batched_tokens == 64
    assert engine.runner.tokens_computed - steps_before >= sum(LENGTHS)
    for ids, out in zip(prompts, outs):
        assert out.finish_reason == "length"
        assert out.token_ids == hf_greedy(hf_smol, ids, NEW_TOKENS), f"prompt of {len(ids)} tokens"


def test_chat_prompt_text_matches_transformers(smol_llm, hf_smol):
    tok = smol_llm.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = smol_llm.generate(text, SamplingParams(temperature=0, max_tokens=32))[0]
    ref = hf_greedy(hf_smol, tok.encode(text), 32, ignore_eos=False)
    eos = tok.eos_token_id
    expected = ref[: ref.index(eos) + 1] if eos in ref else ref
    assert out.token_ids == expected
    assert "Paris" in out.text
    assert out.finish_reason == "stop" if eos in ref else "length"
