"""The engine's public behaviour: streaming, abort, sampling controls, and bad input that is
rejected with a clear error while other requests go on."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from kvmesh.worker import LLM, AsyncEngine, SamplingParams

BAD_PARAMS = [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
]


@pytest.mark.parametrize("kwargs,field", BAD_PARAMS)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def async_engine():
    # its own engine: an engine is driven by one thread, and smol_llm's is the test thread's
    eng = AsyncEngine(model="smollm2-135m-instruct", kv_cache_memory="128MiB")
    yield eng
    eng.shutdown()


async def _collect(eng, prompt, params, request_id=None):
    return [o async for o in eng.generate(prompt, params, request_id)]


def test_bad_requests_beside_good_ones(async_engine):
    too_long = [5] * (async_engine.engine.max_model_len + 1)
    bad = [("", "empty"), ([], "empty"), (too_long, "max_model_len"), ([10**9], "token ids")]
    good = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def main():
        tasks = [asyncio.create_task(_collect(async_engine, "The quick brown fox", good))]
        for prompt, _ in bad:
            tasks.append(asyncio.create_task(_collect(async_engine, prompt, good)))
        tasks.append(asyncio.create_task(_collect(async_engine, "Hello there,", good)))
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(main())
    for (_, needle), res in zip(bad, results[1:-1]):
        assert isinstance(res, ValueError) and needle in str(res), res
    for res in (results[0], results[-1]):
        assert not isinstance(res, BaseException), res
        assert res[-1].finished and len(res[-1].token_ids) == 8


def test_generate_validates_every_prompt_before_running(smol_llm):
    before = smol_llm.engine.runner.tokens_computed
    with pytest.raises(ValueError, match="prompt 1: the prompt is empty"):
        smol_llm.generate(["fine", ""], SamplingParams(max_tokens=4))
    assert smol_llm.engine.runner.tokens_computed == before
    assert not smol_llm.engine.has_unfinished_requests()


def test_streaming_yields_chunks_and_text_matches_offline(async_engine, smol_llm):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = asyncio.run(_collect(async_engine, "Once upon a time", params))
    assert len(outs) == 20 and all(len(o.new_token_ids) == 1 for o in outs)
    assert "".join(o.new_text for o in outs) == outs[-1].text
    offline = smol_llm.generate("Once upon a time", params)[0]
    assert outs[-1].token_ids == offline.token_ids and outs[-1].text == offline.text


def test_leaving_a_stream_aborts_and_frees_pages(async_engine):
    eng = async_engine.engine
    free_before = async_engine.call(lambda e: e.kv.num_free_pages)

    async def main():
        params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        n = 0
        async for _ in async_engine.generate("Tell me a long story.", params, "to-abort"):
            n += 1
            if n == 3:
                break
        await asyncio.sleep(0.2)

    asyncio.run(main())
    assert async_engine.call(lambda e: e.kv.num_free_pages) == free_before
    assert "to-abort" not in eng.requests


def test_seeded_sampling_is_reproducible(smol_llm):
    p = SamplingParams(
        temperature=0.9,
        top_p=0.9,
        top_k=50,
        seed=1234,
        max_tokens=16,
        logprobs=True,
        ignore_eos=True,
    )
    a = smol_llm.generate(["Write a poem about the sea."], p)[0]
    # the same seed, now batched with other requests
    b = smol_llm.generate(["Write a poem about the sea.", "Other words", "More"], p)[0]
    assert a.token_ids == b.token_ids
    assert len(a.logprobs) == 16 and all(lp <= 0 for lp in a.logprobs)


def test_stop_strings_and_stop_token_ids(smol_llm):
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = smol_llm.generate("The capital of France is", base)[0]
    word = full.text.split()[1]
    stopped = smol_llm.generate(
        "The capital of France is",
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[word]),
    )[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == word
    assert word not in stopped.text and full.text.startswith(stopped.text)
    tok = full.token_ids[3]
    by_id = smol_llm.generate(
        "The capital of France is",
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[tok]),
    )[0]
    assert by_id.token_ids == full.token_ids[: full.token_ids.index(tok) + 1]


def test_missing_model_path_names_it(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        LLM(str(missing))


def test_truncated_gguf_is_a_clear_error(tmp_path, smol_src):
    cut = tmp_path / "cut.gguf"
    with open(smol_src.path, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(20_000_000))
    with pytest.raises(ValueError, match="cut.gguf"):
        LLM(str(cut))


def test_truncated_safetensors_is_a_clear_error(tmp_path):
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    folder = tmp_path / "tiny"
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    st = folder / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(str(folder), num_pages=8)
    # a checkpoint with a wrong shape names the key
    shutil.rmtree(folder)
    model = transformers.LlamaForCausalLM(cfg)
    sd = model.state_dict()
    sd["model.norm.weight"] = torch.ones(31)
    model.save_pretrained(folder, state_dict=sd)
    with pytest.raises(ValueError, match="model.norm.weight"):
        LLM(str(folder), num_pages=8)


def test_streamed_text_never_includes_a_stop_string_split_across_tokens(smol_llm):
    """A stop string that spans a token boundary: what was streamed equals the final text."""
    engine = smol_llm.engine
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=["\nT"])
    full = smol_llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    )[0]
    assert "\nT" in full.text  # the greedy continuation really contains the stop string
    rid = engine.add_request("The capital of France is", params)
    streamed, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                streamed.append(out.new_text)
                final = out
    assert final.finish_reason == "stop" and final.stop_reason == "\nT"
    assert "".join(streamed) == final.text == full.text[: full.text.index("\nT")]


def test_special_tokens_streamed_when_asked(smol_llm):
    tok = smol_llm.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Say hi."}])
    params = SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, skip_special_tokens=False
    )
    engine = smol_llm.engine
    engine.add_request(text, params)
    streamed, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed.append(out.new_text)
            final = out
    assert "<|im_end|>" in final.text and "".join(streamed) == final.text


def test_reusing_a_request_id_after_leaving_a_stream(async_engine):
    async def main():
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        async for _ in async_engine.generate("Tell me a long story.", long, "same-id"):
            break
        # the id may be refused while the old request is being aborted, never mixed up
        for _ in range(50):
            try:
                short = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
                return [o async for o in async_engine.generate("Hi there", short, "same-id")]
            except ValueError:
                await asyncio.sleep(0.05)
        raise AssertionError("the request id was never released")

    outs = asyncio.run(main())
    assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 5
    assert all(o.prompt == "Hi there" for o in outs)


def test_offline_batches_are_not_limited_by_the_waiting_queue():
    llm = LLM("smollm2-135m-instruct", kv_cache_memory="32MiB", max_waiting=2)
    outs = llm.generate(["a b", "c d", "e f"], SamplingParams(temperature=0, max_tokens=2))
    assert [len(o.token_ids) for o in outs] == [2, 2, 2]
    assert not llm.engine.requests
