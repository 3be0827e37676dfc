"""Greedy outputs equal transformers', token for token, in fp32, on the real SmolLM2 weights."""

import torch
from helpers import hf_greedy, text_prompts

from kvmesh.worker import SamplingParams

LENGTHS = [20, 37, 64, 100, 150, 255, 400, 600]
NEW_TOKENS = 24


def test_continuous_batch_with_chunked_prefill_matches_transformers(smol_llm, hf_smol, shakespeare):
    prompts = text_prompts(smol_llm.tokenizer, shakespeare, LENGTHS)
    engine = smol_llm.engine
    steps_before = engine.runner.tokens_computed
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    steps: list[list[tuple[int, int, int]]] = []  # per step: (prompt length, computed, new)
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        steps.append([(r.num_prompt_tokens, r.num_computed_tokens, n) for r, n in out.scheduled])
        return out

    engine.scheduler.schedule = recording_schedule
    try:
        outs = smol_llm.generate(prompts, params)
    finally:
        del engine.scheduler.schedule
    # 8 prompts, 1,626 prompt tokens, 64 tokens a step: prefill really was chunked
    assert engine.scheduler_config.max_num_batched_tokens == 64
    assert engine.runner.tokens_computed - steps_before >= sum(LENGTHS)
    assert all(sum(n for *_, n in step) <= 64 for step in steps)
    # the 600-token prompt's prefill (what the cache did not hold) came in chunks of <= 64
    chunks_600 = [n for step in steps for p, done, n in step if p == 600 and done < 600]
    assert sum(chunks_600) == 600 - outs[-1].num_cached_tokens
    assert len(chunks_600) >= -(-sum(chunks_600) // 64) >= 9
    # and some step decoded one request while prefilling another: one continuous batch
    assert any(
        any(done >= p for p, done, _ in step) and any(done + n < p for p, done, n in step)
        for step in steps
    )
    for ids, out in zip(prompts, outs):
        assert out.finish_reason == "length"
        assert out.token_ids == hf_greedy(hf_smol, ids, NEW_TOKENS), f"prompt of {len(ids)} tokens"


def test_chat_prompt_text_matches_transformers(smol_llm, hf_smol):
    tok = smol_llm.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = smol_llm.generate(text, SamplingParams(temperature=0, max_tokens=32))[0]
    ref = hf_greedy(hf_smol, tok.encode(text), 32, ignore_eos=False)
    eos = tok.eos_token_id
    # the reference answer is short: the engine must stop at its EOS, not run to 32 tokens
    assert eos in ref, "transformers' answer should end with EOS within 32 tokens"
    assert out.token_ids == ref[: ref.index(eos) + 1]
    assert "Paris" in out.text
    assert out.finish_reason == "stop" and out.stop_reason == eos


def test_hugging_face_folder_loads_same_model_as_gguf(tmp_path, smol_llm, hf_smol):
    """The same weights saved as a HF folder (safetensors + tokenizer files) load through the
    safetensors path and give the GGUF path's tokens; the folder's own tokenizer is used."""
    import json

    from safetensors.torch import save_file

    folder = tmp_path / "smollm2-hf"
    folder.mkdir()
    cfg = hf_smol.config.to_dict()
    cfg.pop("quantization_config", None)  # transformers refuses to re-save a GGUF-loaded model
    cfg["architectures"] = ["LlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    sd = {k: v.contiguous() for k, v in hf_smol.state_dict().items() if k != "lm_head.weight"}
    save_file(sd, str(folder / "model.safetensors"))  # lm_head is tied to the embeddings
    smol_llm.tokenizer.hf.save_pretrained(folder)
    from kvmesh.worker import LLM

    llm = LLM(str(folder), kv_cache_memory="64MiB")
    assert llm.engine.src.kind == "hf" and llm.tokenizer is not None
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = "Good morning! Let me tell you about the weather"
    expected = smol_llm.generate(prompt, params)[0].token_ids
    assert llm.generate(prompt, params)[0].token_ids == expected


def test_half_precision_models_and_caches_run(smol_llm):
    """bf16/fp16 weights, and an fp16 KV cache under fp32 weights, generate sensibly: the
    greedy answer to an easy question stays the fp32 one."""
    from kvmesh.worker import LLM

    tok = smol_llm.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    params = SamplingParams(temperature=0, max_tokens=8)
    cases = [  # (engine args, weights' dtype, cache format and its stored dtype)
        (dict(dtype="bfloat16"), torch.bfloat16, "bf16", torch.bfloat16),
        (dict(dtype="float16"), torch.float16, "fp16", torch.float16),
        (dict(kv_cache_dtype="fp16"), torch.float32, "fp16", torch.float16),
    ]
    for kwargs, weights, fmt, stored in cases:
        llm = LLM("smollm2-135m-instruct", kv_cache_memory="32MiB", **kwargs)
        eng = llm.engine
        # the format took effect: the weights, the cache the engine reports, the pages
        assert {p.dtype for p in eng.model.parameters()} == {weights}, kwargs
        assert eng.cache_format == fmt == eng.stats().kv_cache_dtype, kwargs
        assert {v.dtype for v in eng.memory.layer_caches[0].views.values()} == {stored}, kwargs
        out = llm.generate(text, params)[0]
        assert "Paris" in out.text, (kwargs, out.text)


def test_onednn_at_every_bucket_including_prefill_matches_transformers(hf_smol, shakespeare):
    """Under ``auto`` over a float cache the engine may pick oneDNN (which rounds differently
    from F.linear) for every row bucket, prefill-sized ones (> 256 rows) included. Forced so
    here, deterministically (a tuner whose timer calls oneDNN fastest), greedy outputs still
    equal transformers' token for token in fp32, and oneDNN really ran the prefill chunks."""
    from kvmesh.kernels import autotune
    from kvmesh.kernels.cpu_linear import PackedLinear
    from kvmesh.worker import LLM

    def onednn_fastest(fns, rounds):
        return {n: (1.0 if n == "onednn" else 2.0) for n in fns}

    llm = LLM("smollm2-135m-instruct", kv_cache_memory="128MiB", max_num_batched_tokens=512)
    model = llm.engine.model
    model.set_gemm_tuner(autotune.GemmTuner(None, mode="auto", timer=onednn_fastest))
    rows_by_onednn: list[int] = []
    real = PackedLinear._onednn

    def spy(self, x):
        rows_by_onednn.append(x.shape[0])
        return real(self, x)

    PackedLinear._onednn = spy
    try:
        # one prefill step of 314 rows (bucket 512, past MAX_TUNED_ROWS), then decode steps
        prompts = text_prompts(llm.tokenizer, shakespeare, [24, 290])
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        outs = llm.generate(prompts, params)
    finally:
        PackedLinear._onednn = real
    plans = [lin.plan for lin in model._packed()]
    assert all(set(p.values()) == {"onednn"} for p in plans), plans[:2]
    layer_buckets = set().union(*(p for p in plans[1:]))
    assert {2, autotune.PREFILL_TUNE_ROWS} <= layer_buckets  # decode (2 rows) and prefill
    assert max(rows_by_onednn) == 314  # the whole prefill step went through oneDNN
    for ids, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf_smol, ids, 10), f"prompt of {len(ids)} tokens"
