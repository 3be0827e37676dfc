"""Randomly initialised tiny Llama, Qwen2 and Mistral checkpoints, saved as Hugging Face
folders (safetensors) and loaded by kvmesh: greedy outputs equal transformers' in fp32."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy

from kvmesh.worker import LLM, SamplingParams

COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    max_position_embeddings=512,
    initializer_range=0.15,
    bos_token_id=1,
    eos_token_id=2,
)

CONFIGS = {
    # GQA with llama3 rope scaling and tied embeddings
    "llama3-gqa": (
        "LlamaConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_theta=50000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    # MQA: one KV head for all query heads
    "llama-mqa": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=1)),
    # Qwen2: q/k/v projections carry biases
    "qwen2-bias": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2)),
    # Mistral with a sliding window shorter than the prompts
    "mistral-swa": (
        "MistralConfig",
        dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=40),
    ),
}


def _make_checkpoint(tmp_path_factory, name: str):
    import transformers

    cls_name, extra = CONFIGS[name]
    cfg = getattr(transformers, cls_name)(**COMMON, **extra)
    torch.manual_seed(0)
    model_cls = {
        "LlamaConfig": transformers.LlamaForCausalLM,
        "Qwen2Config": transformers.Qwen2ForCausalLM,
        "MistralConfig": transformers.MistralForCausalLM,
    }[cls_name]
    model = model_cls(cfg).eval()
    if name == "qwen2-bias":  # random init leaves biases at zero: make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.5)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return path, model


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tiny_model_matches_transformers(tmp_path_factory, name, backend):
    """``cpu`` (the default on CPU: C decode attention and fused elementwise ops) and
    ``torch`` (the pure torch reference) both equal transformers."""
    path, hf = _make_checkpoint(tmp_path_factory, name)
    llm = LLM(
        str(path),
        dtype="float32",
        num_pages=64,
        block_size=8,
        max_num_batched_tokens=24,
        attention_backend=backend,
    )
    eng = llm.engine
    native = backend == "cpu"
    assert (eng.model.cpu_kernels is not None) == native, "the C kernels must build here"
    assert (eng.backend._native is not None) == native
    assert llm.tokenizer is None  # no tokenizer files: prompts are token ids
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 17, 33, 70)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, ids, 12), f"{name}, prompt of {len(ids)} tokens"
