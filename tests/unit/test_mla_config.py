"""DeepSeek config parsing: MLA dimension fields are checked by type and range, naming the
field; mixture-of-experts layers are counted as transformers counts them."""

from __future__ import annotations

import pytest
from helpers import tiny_deepseek_config

from kvmesh.worker.models.config import ModelConfig

BASE = tiny_deepseek_config(n_routed_experts=None)


def test_base_parses():
    cfg = ModelConfig.from_hf_dict(BASE)
    assert cfg.is_mla and cfg.kv_lora_rank == 16 and cfg.q_lora_rank is None


@pytest.mark.parametrize(
    "field,value",
    [
        ("kv_lora_rank", 16.0),
        ("kv_lora_rank", True),
        ("kv_lora_rank", "16"),
        ("v_head_dim", 0),
        ("q_lora_rank", 0),
        ("q_lora_rank", 12.5),
        ("q_lora_rank", False),
    ],
)
def test_bad_mla_dimension_is_named(field, value):
    with pytest.raises(ValueError, match=f"{field} must be an integer >= 1, got {value!r}"):
        ModelConfig.from_hf_dict({**BASE, field: value})


def test_moe_layers_ignore_moe_layer_freq_as_transformers():
    # transformers' DeepseekV3/V2 models put a MoE at every layer >= first_k_dense_replace,
    # whatever moe_layer_freq says: layer 1 here is a MoE, refused
    import transformers

    raw = {**BASE, "n_routed_experts": 4, "first_k_dense_replace": 1, "moe_layer_freq": 2}
    model = transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(**{**raw, "n_group": 1, "topk_group": 1})
    )
    assert type(model.model.layers[1].mlp).__name__ == "DeepseekV3MoE"
    with pytest.raises(ValueError, match=r"mixture-of-experts layers \[1\]"):
        ModelConfig.from_hf_dict(raw)
