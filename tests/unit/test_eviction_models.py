"""Which models a kv_budget can run on: not MLA (latent rows) and not sliding-window models
(the kernels' window is in cache slots, which compaction moves)."""

from __future__ import annotations

from kvmesh.worker.engine import _kv_budget_error
from kvmesh.worker.models.config import ModelConfig

LLAMA = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def test_a_plain_gqa_model_takes_a_budget():
    assert _kv_budget_error("m", ModelConfig.from_hf_dict(LLAMA)) is None


def test_a_sliding_window_model_is_refused_naming_the_window():
    cfg = ModelConfig.from_hf_dict({**LLAMA, "architectures": ["MistralForCausalLM"],
                                    "sliding_window": 128})  # fmt: skip
    assert cfg.sliding_window == 128
    why = _kv_budget_error("mistral-tiny", cfg)
    assert why is not None and "kv_budget" in why and "128" in why and "mistral-tiny" in why
