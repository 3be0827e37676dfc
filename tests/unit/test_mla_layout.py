"""Latent (MLA) pages: the layout's bytes per token, and a codec that never reads an MLA
page as a GQA page (or the other way round), while objects written before the layout
field existed still read as GQA pages."""

from __future__ import annotations

import random
import struct

import msgpack
import pytest
import torch

from kvmesh.kernels.page_format import PageLayout
from kvmesh.kvstore.codec import PageCodecError, PageSpec, decode, encode
from kvmesh.worker.models.config import ModelConfig

# DeepSeek-V3's attention: 61 layers, 128 heads, latent 512 + rope 64, nope 128, v 128
V3 = dict(
    architectures=["DeepseekV3ForCausalLM"],
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=None,
    rope_scaling={
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32,
        "beta_slow": 1,
    },
)


def test_v3_latent_page_is_93_percent_smaller_than_its_multi_head_cache():
    cfg = ModelConfig.from_hf_dict(V3)
    assert cfg.is_mla and cfg.rope_scaling["rope_type"] == "yarn"
    lay = cfg.page_layout("bf16", 16)
    assert (lay.attention, lay.num_kv_heads, lay.head_size, lay.rope_dim) == ("mla", 1, 576, 64)
    assert lay.bytes_per_token == 61 * 576 * 2  # 70,272 bytes
    mha = 61 * 128 * (192 + 128) * 2  # per head K (nope + rope) and V, bf16
    assert lay.bytes_per_token / mha == pytest.approx(576 / (128 * 320))
    assert lay.bytes_per_token / mha < 0.02
    assert lay.bits_per_value == 16
    assert lay.name == "mla-r512-rope64"


def test_latent_layout_views_one_row_per_token():
    lay = PageLayout("fp16", 2, 1, 40, 8, attention="mla", rope_dim=8)
    buf = lay.allocate(3)
    v = lay.views(buf, 1)["latent"]
    assert tuple(v.shape) == (3, 8, 40) and v.dtype == torch.float16
    v[2, 5] = 1.5
    assert lay.views(buf, 1)["latent"][2, 5, 39].item() == 1.5
    assert lay.views(buf, 0)["latent"].abs().sum() == 0


@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4"])
def test_quantized_latent_pages_are_refused_naming_the_accepted_formats(fmt):
    with pytest.raises(ValueError, match="not offered for MLA latent pages; accepted: fp32"):
        PageLayout(fmt, 2, 1, 40, 8, attention="mla", rope_dim=8)


def test_mla_layout_rejects_bad_shapes():
    with pytest.raises(ValueError, match="num_kv_heads 1"):
        PageLayout("fp16", 2, 2, 40, 8, attention="mla", rope_dim=8)
    with pytest.raises(ValueError, match="unknown page attention layout"):
        PageLayout("fp16", 2, 1, 40, 8, attention="gqa")


# the same byte size and header shape fields: only the layout tells the two apart
MLA = PageSpec("ab" * 16, "fp16", 2, 1, 40, 8, 1280, layout="mla-r32-rope8")
GQA = PageSpec("ab" * 16, "fp16", 2, 1, 40, 8, 1280)


def test_mla_page_is_never_read_as_a_gqa_page():
    payload = random.Random(0).randbytes(1280)
    assert decode(MLA, encode(MLA, payload)).tobytes() == payload
    with pytest.raises(PageCodecError) as e:
        decode(GQA, encode(MLA, payload))
    assert e.value.field == "layout"
    with pytest.raises(PageCodecError) as e:
        decode(MLA, encode(GQA, payload))
    assert e.value.field == "layout"
    other_split = PageSpec(**{**MLA.__dict__, "layout": "mla-r24-rope16"})
    with pytest.raises(PageCodecError, match="layout"):
        decode(other_split, encode(MLA, payload))


def test_objects_without_a_layout_field_read_as_gqa_and_miss_for_mla():
    payload = random.Random(1).randbytes(1280)
    obj = encode(GQA, payload)
    (hlen,) = struct.unpack_from("<I", obj)
    header = msgpack.unpackb(obj[4 : 4 + hlen])
    del header["layout"]  # as codec version 1 wrote it before MLA existed
    new = msgpack.packb(header)
    old = struct.pack("<I", len(new)) + new + obj[4 + hlen :]
    assert decode(GQA, old).tobytes() == payload
    with pytest.raises(PageCodecError, match="layout"):
        decode(MLA, old)


def test_page_spec_rejects_an_unknown_layout():
    with pytest.raises(ValueError, match="layout must be"):
        PageSpec("ab" * 16, "fp16", 2, 1, 40, 8, 1280, layout="mla")
