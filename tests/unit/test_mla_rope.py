"""DeepSeek's rotary scaling: kvmesh's YaRN frequencies, cos/sin factor and softmax scale
equal transformers' for the rope parameters DeepSeek configs use."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_deepseek_config

from kvmesh.worker.models.config import ModelConfig
from kvmesh.worker.models.deepseek import mla_rope, mla_softmax_scale

BASE = tiny_deepseek_config()
YARN = [
    # DeepSeek-V3's own values
    dict(factor=40.0, original_max_position_embeddings=4096 // 40, mscale=1.0, mscale_all_dim=1.0,
         beta_fast=32, beta_slow=1),
    # DeepSeek-V2's (mscale = mscale_all_dim = 0.707)
    dict(factor=40.0, original_max_position_embeddings=128, mscale=0.707, mscale_all_dim=0.707,
         beta_fast=32, beta_slow=1),
    # unequal mscales: cos/sin are scaled too; no truncation of the ramp
    dict(factor=4.0, original_max_position_embeddings=64, mscale=0.8, mscale_all_dim=1.0,
         beta_fast=16, beta_slow=2, truncate=False),
    # an explicit attention factor, no mscale_all_dim: softmax scale unchanged
    dict(factor=8.0, original_max_position_embeddings=64, attention_factor=1.3),
]  # fmt: skip


@pytest.mark.parametrize("params", [None, *YARN], ids=["default", "v3", "v2", "mscales", "af"])
def test_rope_and_softmax_scale_equal_transformers(params):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3RotaryEmbedding,
        yarn_apply_mscale,
    )

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, **params} if params else None
    hf_cfg = transformers.DeepseekV3Config(**BASE, rope_scaling=rope)
    cfg = ModelConfig.from_hf_dict(hf_cfg.to_dict())
    inv, factor = mla_rope(cfg)
    if params is None:
        want_inv = DeepseekV3RotaryEmbedding(hf_cfg).inv_freq
        want_factor = 1.0
    else:
        want_inv, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    torch.testing.assert_close(inv, want_inv.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(want_factor, rel=1e-12)
    want_scale = yarn_apply_mscale(hf_cfg.rope_parameters, (8 + 16) ** -0.5)
    assert mla_softmax_scale(cfg) == pytest.approx(want_scale, rel=1e-12)


def test_unsupported_rope_scaling_is_named():
    with pytest.raises(ValueError, match="unsupported rope scaling 'llama3' for deepseek_v3"):
        ModelConfig.from_hf_dict({**BASE, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_raw_yarn_without_original_length_equals_transformers(key):
    # a config.json as written, not transformers' to_dict(): no
    # original_max_position_embeddings, which transformers takes as max_position_embeddings
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    raw = {**BASE, key: {"type": "yarn", "factor": 4.0, "mscale_all_dim": 0.8}}
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.rope_scaling["original_max_position_embeddings"] == 4096
    hf_cfg = transformers.DeepseekV3Config(**raw)
    want_inv, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    inv, factor = mla_rope(cfg)
    torch.testing.assert_close(inv, want_inv.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(want_factor, rel=1e-12)
    want_scale = yarn_apply_mscale(hf_cfg.rope_parameters, (8 + 16) ** -0.5)
    assert mla_softmax_scale(cfg) == pytest.approx(want_scale, rel=1e-12)


@pytest.mark.parametrize("factor", [{}, {"factor": None}])
def test_yarn_without_factor_is_refused_at_parse(factor):
    rope = {"rope_type": "yarn", "original_max_position_embeddings": 64, **factor}
    with pytest.raises(ValueError, match="rope_scaling.factor is required for yarn"):
        ModelConfig.from_hf_dict({**BASE, "rope_scaling": rope})
