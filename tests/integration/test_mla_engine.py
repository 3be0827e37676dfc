"""DeepSeek-V3-style models (multi-head latent attention) over latent KV pages.

No small trained MLA model ships in a package here, so the checkpoints are tiny, randomly
initialised ``DeepseekV3ForCausalLM`` configs with dense MLP layers, saved by the test as
Hugging Face folders. kvmesh's greedy tokens must equal transformers' token for token in
fp32, through chunked prefill, batching, prefix-cache hits and preemption; latent pages
spilled to host RAM and to a real Redis come back byte-exact and give the same tokens.
"""

from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy

from kvmesh.kvstore.codec import decode
from kvmesh.kvstore.redis_tier import redis_key
from kvmesh.worker import LLM, SamplingParams
from kvmesh.worker.attention.mla import MLABackend

VOCAB = 512
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    first_k_dense_replace=3,  # every layer dense: kvmesh runs no mixture-of-experts
    max_position_embeddings=512,
    initializer_range=0.15,
    bos_token_id=1,
    eos_token_id=None,  # ignore_eos in kvmesh == no EOS suppression in transformers
)
CONFIGS = {
    # DeepSeek-V3 shape: low-rank query (q_lora_rank), interleaved rotary pairs
    "v3": dict(q_lora_rank=48),
    # V2-Lite shape (plain q_proj) with YaRN as DeepSeek configs use it (mscale and
    # mscale_all_dim change the softmax scale and cos/sin), rotary halves, biases on
    "v2lite-yarn": dict(
        q_lora_rank=None,
        rope_interleave=False,
        attention_bias=True,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "mscale": 0.8,
            "mscale_all_dim": 1.0,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    ),
}
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _checkpoint(path, name: str, **overrides):
    import transformers

    cfg = transformers.DeepseekV3Config(**{**COMMON, **CONFIGS[name], **overrides})
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():  # random init leaves biases at zero: make them matter
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear) and mod.bias is not None:
                mod.bias.normal_(0, 0.5)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, _checkpoint(path, request.param)


def _prompts(seed: int, lengths, prefix: list[int] | None = None) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    pre = prefix or []
    return [pre + torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_mla_matches_transformers_chunked_batched(ckpt, backend):
    """Four prompts in one batch, prefill chunked at 24 tokens a step: fp32 greedy tokens
    equal transformers', through the engine's default backend here (``cpu``) and ``torch``."""
    name, path, hf = ckpt
    llm = LLM(
        str(path),
        dtype="float32",
        num_pages=64,
        block_size=8,
        max_num_batched_tokens=24,
        attention_backend=backend,
    )
    try:
        eng = llm.engine
        assert eng.layout.attention == "mla" and eng.backend.name == "mla"
        assert eng.backend.kernel == ("torch" if backend == "torch" else "auto")
        assert eng.model.cpu_kernels is None  # MLA models never call the C kernels
        prompts = _prompts(1, (5, 17, 33, 70))
        outs = llm.generate(prompts, GREEDY)
        for ids, out in zip(prompts, outs):
            assert out.token_ids == hf_greedy(hf, ids, GREEDY.max_tokens), (name, len(ids))
    finally:
        llm.close()


@pytest.mark.parametrize("kernel", ["triton", "cpu"])
def test_decode_kernels_in_the_engine(ckpt, kernel):
    """The engine's decode through the Triton latent kernel (interpreted on CPU) and through
    kvmesh's C kernel gives transformers' tokens too."""
    name, path, hf = ckpt
    llm = LLM(str(path), dtype="float32", num_pages=32, block_size=16)
    try:
        backend = MLABackend(kernel)
        assert backend.kernel == kernel, "the C kernels must build here"
        llm.engine.runner.backend = backend
        prompts = _prompts(2, (6, 37))
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        for ids, out in zip(prompts, llm.generate(prompts, params)):
            assert out.token_ids == hf_greedy(hf, ids, 6), (name, len(ids))
    finally:
        llm.close()


def test_mla_prefix_hits_and_preemption(ckpt):
    """Prompts sharing a 40-token prefix hit the cache (the second round wholly); a pool of
    24 pages cannot hold the batch, so requests are preempted and recomputed. Tokens equal
    transformers' throughout."""
    name, path, hf = ckpt
    shared = _prompts(7, (40,))[0]
    prompts = _prompts(8, (9, 30, 21, 50), prefix=shared)
    want = [hf_greedy(hf, ids, GREEDY.max_tokens) for ids in prompts]
    llm = LLM(str(path), dtype="float32", num_pages=24, block_size=8, max_num_batched_tokens=32)
    try:
        first = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in first] == want, name
        assert llm.engine.stats().num_preemptions > 0, "the pool was meant to run out"
        assert max(o.num_cached_tokens for o in first) >= 40, "the shared prefix never hit"
        again = llm.generate(prompts[:1], GREEDY)[0]  # its pages are still cached
        assert again.num_cached_tokens >= 48 and again.token_ids == want[0]
    finally:
        llm.close()


def test_latent_pages_spill_to_host_and_redis_byte_exact(
    ckpt, redis_server_module, tmp_path_factory
):
    """Latent pages go through the tiers like any page: spilled to host RAM and on to a
    real Redis (host tier smaller than the prompt), restored byte-exact, same tokens."""
    name, path, hf = ckpt
    prompt = _prompts(3, (70,))[0]  # 8 full pages of 8 tokens
    want = hf_greedy(hf, prompt, GREEDY.max_tokens)
    llm = LLM(
        str(path),
        dtype="float32",
        num_pages=40,
        block_size=8,
        host_cache_memory=3 * 3 * 8 * 40 * 4,  # ~3 latent pages (3 layers, 8 rows of 40)
        redis_url=redis_server_module.url,
        redis_namespace=f"mla-{name}",
    )
    try:
        eng = llm.engine
        assert llm.generate([prompt], GREEDY)[0].token_ids == want
        hashes = eng.make_request(prompt).page_hashes
        before = eng.memory.read(eng.kv.cached_page_ids(hashes))
        assert len(before) == 8
        assert llm.reset_prefix_cache() >= 8  # every page leaves the device
        r = redis_server_module.client()
        keys = [redis_key(eng.model_fp, eng.cache_format, h, f"mla-{name}") for h in hashes]
        stored = [r.get(k) for k in keys]
        in_redis = [i for i, obj in enumerate(stored) if obj is not None]
        assert len(in_redis) >= 4, "the small host tier should have pushed pages to Redis"
        assert eng.page_spec.layout == "mla-r32-rope8"
        for i in in_redis:  # the stored object carries the very page bytes
            assert bytes(decode(eng.page_spec, stored[i])) == before[i]
        out = llm.generate([prompt], GREEDY)[0]
        tiers = out.cached_tokens_by_tier
        assert tiers["host"] > 0 and tiers["redis"] > 0 and out.num_cached_tokens == 64, tiers
        assert out.token_ids == want
        after = eng.memory.read(eng.kv.cached_page_ids(hashes))
        assert after == before, "restored latent pages differ from the spilled ones"
    finally:
        llm.close()


def test_latent_bytes_per_token_vs_multi_head_cache(ckpt):
    """The latent cache's bytes per token, from the layout, against the same model's
    multi-head cache (per head K of nope + rope and V of v_head_dim)."""
    name, path, _ = ckpt
    llm = LLM(str(path), dtype="float32", num_pages=8, block_size=16)
    try:
        lay, cfg = llm.engine.layout, llm.engine.model_config
        latent = cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
        mha = cfg.num_layers * cfg.num_heads * (cfg.head_dim + cfg.v_head_dim) * 4
        assert lay.bytes_per_token == latent == 3 * 40 * 4
        assert mha == 3 * 4 * (24 + 12) * 4
        assert lay.bytes_per_token / mha == pytest.approx(40 / 144)
    finally:
        llm.close()


def test_moe_layers_fail_naming_what_is_unsupported(tmp_path):
    _checkpoint(tmp_path, "v3", first_k_dense_replace=1, n_routed_experts=4, n_group=1,
                topk_group=1, num_experts_per_tok=2, moe_intermediate_size=16)  # fmt: skip
    with pytest.raises(ValueError, match=r"mixture-of-experts layers \[1, 2\]"):
        LLM(str(tmp_path), dtype="float32", num_pages=8)


def test_misspelt_attention_backend_is_refused_for_mla(ckpt):
    with pytest.raises(ValueError, match="unknown attention backend 'tritn'"):
        LLM(str(ckpt[1]), dtype="float32", num_pages=8, attention_backend="tritn")


def test_loader_is_strict_about_mla_weights(tmp_path):
    from safetensors.torch import load_file, save_file

    _checkpoint(tmp_path, "v3")
    f = next(tmp_path.glob("*.safetensors"))
    tensors = load_file(f)
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    w = tensors.pop(name)
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing weight keys \['model.layers.1.self_attn"):
        LLM(str(tmp_path), dtype="float32", num_pages=8)
    tensors[name] = w
    tensors["model.layers.1.self_attn.k_proj.weight"] = w.clone()
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected weight keys"):
        LLM(str(tmp_path), dtype="float32", num_pages=8)


def test_deepseek_v2_checkpoint_matches_transformers(tmp_path):
    """A checkpoint of transformers' ``DeepseekV2ForCausalLM`` (complex-number rotary on
    interleaved pairs; YaRN with DeepSeek-V2's mscale = mscale_all_dim = 0.707)."""
    import transformers

    kw = {**COMMON, "q_lora_rank": None, "max_position_embeddings": 128}
    kw["rope_scaling"] = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    }
    torch.manual_seed(0)
    hf = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**kw)).eval()
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", num_pages=32, block_size=8, max_num_batched_tokens=24)
    try:
        assert llm.engine.model_config.architecture == "deepseek_v2"
        prompts = _prompts(4, (11, 45))
        for ids, out in zip(prompts, llm.generate(prompts, GREEDY)):
            assert out.token_ids == hf_greedy(hf, ids, GREEDY.max_tokens), len(ids)
    finally:
        llm.close()


def test_latent_pages_travel_over_the_peer_data_plane(ckpt):
    """Worker B pulls the latent pages of a prefix worker A computed over A's page data
    plane: same tokens as transformers, only the rest computed."""
    from helpers import TEST_IDENTITY as ID

    from kvmesh.cluster import Client
    from kvmesh.kvstore.peer import PeerTier
    from kvmesh.worker.async_engine import AsyncEngine
    from kvmesh.worker.engine import LLMEngine
    from kvmesh.worker.page_source import EnginePageSource
    from kvmesh.worker.server import WorkerServer

    name, path, hf = ckpt
    kw = dict(dtype="float32", num_pages=32, block_size=8)
    a_engine = AsyncEngine(LLMEngine(str(path), **kw))
    a = WorkerServer(
        a_engine, page_source=EnginePageSource(a_engine), own_engine=True, grace_s=0, identity=ID
    )
    a.start_in_thread()
    peer = PeerTier([a.address], timeout=30.0, identity=ID)
    b = WorkerServer(LLMEngine(str(path), extra_tiers=[peer], **kw), identity=ID)
    b.start_in_thread()
    try:
        prompt = _prompts(6, (45,))[0]  # 5 full pages
        want = hf_greedy(hf, prompt, 6)
        greedy = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
        with Client(a.address) as ca, Client(b.address) as cb:
            info = ca.model_info()  # the page layout's geometry: one latent row per token
            assert (info.num_kv_heads, info.head_dim) == (1, 32 + 8), name
            assert ca.generate_text(prompt, **greedy).token_ids == want
            before = b.engine.engine.runner.tokens_computed
            on_b = cb.generate_text(prompt, **greedy)
        assert on_b.usage.cached_tokens_by_tier["peer"] == 40, name
        assert on_b.token_ids == want
        assert b.engine.engine.runner.tokens_computed - before == 45 - 40 + 6 - 1
        assert peer.metrics["data_plane_pages"] == 5
    finally:
        b.stop_in_thread(grace=0)
        a.stop_in_thread(grace=0)


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_half_precision_latent_pages_restore_byte_exact(tmp_path, fmt):
    """fp16/bf16 latent pages hold half the bytes of fp32 ones; spilled to host and brought
    back they give the very tokens of the run that computed them."""
    _checkpoint(tmp_path, "v3")
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        kv_cache_dtype=fmt,
        num_pages=32,
        block_size=8,
        host_cache_memory="1MiB",
    )
    try:
        eng = llm.engine
        assert eng.layout.bytes_per_token == 3 * 40 * 2 and eng.page_spec.layout == "mla-r32-rope8"
        prompt = _prompts(5, (50,))[0]
        first = llm.generate([prompt], GREEDY)[0]
        hashes = eng.make_request(prompt).page_hashes
        before = eng.memory.read(eng.kv.cached_page_ids(hashes))
        llm.reset_prefix_cache()
        again = llm.generate([prompt], GREEDY)[0]
        assert again.cached_tokens_by_tier["host"] == 48
        assert again.token_ids == first.token_ids
        assert eng.memory.read(eng.kv.cached_page_ids(hashes)) == before
    finally:
        llm.close()


def test_quantized_latent_pages_are_refused_at_start(tmp_path):
    _checkpoint(tmp_path, "v3")
    with pytest.raises(ValueError, match="'int8' is not offered for MLA latent pages"):
        LLM(str(tmp_path), dtype="float32", kv_cache_dtype="int8", num_pages=8)
