"""kv_budget on an MLA model is refused with a clear error, never run.

Eviction scores and compacts per-KV-head K/V rows; MLA pages hold one shared latent row per
token, which eviction does not handle, so both a request's kv_budget and an engine default
kv_budget are refused on a DeepSeek (MLA) checkpoint.
"""

from __future__ import annotations

import pytest
import transformers
from helpers import tiny_deepseek_config

from kvmesh.worker import LLM, SamplingParams

CFG = tiny_deepseek_config(
    vocab_size=256,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    qk_rope_head_dim=8,
    first_k_dense_replace=1,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=None,
)


@pytest.fixture(scope="module")
def mla_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("mla-evict")
    transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**CFG)).save_pretrained(path)
    return str(path)


def test_request_kv_budget_on_mla_is_refused(mla_ckpt):
    llm = LLM(mla_ckpt, dtype="float32", num_pages=16, block_size=8)
    prompt = list(range(2, 40))
    with pytest.raises(ValueError, match="kv_budget.*MLA"):
        llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, kv_budget=16)
        )
    # the engine is unharmed: a request without a budget still runs
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4


def test_engine_default_kv_budget_on_mla_fails_at_start(mla_ckpt):
    with pytest.raises(ValueError, match="kv_budget.*MLA"):
        LLM(mla_ckpt, dtype="float32", num_pages=16, block_size=8, kv_budget=16)
