"""Quantized page formats: round-trip error bounds, bit-exact nibbles, in-pool byte identity."""

import pytest
import torch

from kvmesh.kernels import quant
from kvmesh.kernels.page_format import PageLayout
from kvmesh.kernels.quant import (
    MIN_SCALE,
    dequantize_pages,
    pack_int4,
    quant_components,
    quantize_pages,
    unpack_int4,
)

FORMATS = ["fp8", "int8", "int4"]


def _pages(n=5, bs=16, H=3, D=64, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    # per-channel offsets and scales, like real keys (outlier channels are why K is per channel)
    k = torch.randn(n, bs, H, D, generator=g) * torch.rand(H, D, generator=g) * 4
    k = k + torch.randn(H, D, generator=g) * 3
    v = torch.randn(n, bs, H, D, generator=g)
    return k.to(dtype), v.to(dtype)


def test_pack_unpack_is_bit_exact_and_documented_order():
    q = torch.arange(256, dtype=torch.int32).remainder(16).to(torch.uint8).view(4, 64)
    q = q[:, torch.randperm(64, generator=torch.Generator().manual_seed(1))]
    p = pack_int4(q)
    assert p.shape == (4, 32)
    assert torch.equal(unpack_int4(p), q)
    # element 2j is the low nibble, element 2j+1 the high nibble
    assert pack_int4(torch.tensor([3, 10], dtype=torch.uint8)).item() == 3 | (10 << 4)
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(pack_int4(unpack_int4(every_byte)), every_byte)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_components_match_quant_components(fmt, dtype):
    n, bs, H, D = 3, 16, 2, 64
    comps = quantize_pages(fmt, *_pages(n, bs, H, D, dtype))
    spec = quant_components(fmt, bs, H, D)
    assert list(comps) == [c.name for c in spec]
    for c in spec:
        assert comps[c.name].shape == (n, *c.shape), c.name
        assert comps[c.name].dtype == c.dtype, c.name
    assert all(c.name[0] in "kv" for c in spec)


def test_int8_round_trip_within_half_a_step():
    k, v = _pages()
    comps = quantize_pages("int8", k, v)
    k2, v2 = dequantize_pages("int8", comps, torch.float32)
    for x, x2, s in ((k, k2, comps["k_scale"]), (v, v2, comps["v_scale"])):
        bound = s.float().unsqueeze(-1) * 0.5 * (1 + 1e-5)
        assert ((x - x2).abs() <= bound).all()
        assert (s.float() >= MIN_SCALE).all()


def test_fp8_round_trip_within_e4m3_precision():
    k, v = _pages()
    comps = quantize_pages("fp8", k, v)
    k2, v2 = dequantize_pages("fp8", comps, torch.float32)
    for x, x2, s in ((k, k2, comps["k_scale"]), (v, v2, comps["v_scale"])):
        s = s.float().unsqueeze(-1)
        # 3 mantissa bits: half an ulp is <= 2^-4 relative; subnormal steps are 2^-9 * scale
        bound = 2**-4 * x.abs() + 2**-10 * s + 1e-6
        assert ((x - x2).abs() <= bound).all()
        assert (x2.abs() <= 448 * s + 1e-6).all()


def test_int4_round_trip_within_half_a_step(monkeypatch):
    k, v = _pages()
    comps = quantize_pages("int4", k, v)
    k2, v2 = dequantize_pages("int4", comps, torch.float32)
    ks, kz = comps["k_scale"].float().unsqueeze(1), comps["k_zero"].float().unsqueeze(1)
    kbound = 0.51 * ks + 2**-11 * kz.abs() + 1e-6  # (n, 1, H, D) per channel
    assert ((k - k2).abs() <= kbound).all()
    n, bs, H, D = v.shape
    vs = comps["v_scale"].float().repeat_interleave(32, -1)  # (n, bs, H, D)
    vz = comps["v_zero"].float().repeat_interleave(32, -1)
    # values may be clipped to the group's chosen range; inside it, half a step
    inside = (v >= vz - 1e-6) & (v <= vz + 15 * vs + 1e-6)
    assert inside.float().mean() > 0.9
    err = (v - v2).abs()
    assert (err[inside] <= (0.51 * vs + 2**-11 * vz.abs() + 1e-6)[inside]).all()
    # the clipping search never does worse than the plain min/max range (its first candidate)
    monkeypatch.setattr(quant, "INT4_V_CLIP_STEPS", 1)
    _, v_plain = dequantize_pages("int4", quantize_pages("int4", k, v), torch.float32)
    plain = (v_plain - v).view(n, bs, H, D // 32, 32).square().sum(-1)
    chosen = (v2 - v).view(n, bs, H, D // 32, 32).square().sum(-1)
    assert (chosen <= plain).all() and (chosen < plain).any()
    # keys are grouped per channel over the page's tokens: one scale per (head, dim)
    assert comps["k_scale"].shape == (n, H, D)


def test_int4_bytes_follow_the_documented_formula(monkeypatch):
    """docs/formats.md's int4 contract computed by hand for one page: zero = fp16(min),
    scale = fp16((max - zero) / 15), q = floor((x - zero) / scale + 0.5), low nibble first.
    Values follow the same formula once the clipping search is limited to its first factor
    (1.0, the full range); the search itself is the round-trip test's subject."""
    monkeypatch.setattr(quant, "INT4_V_CLIP_STEPS", 1)
    g = torch.Generator().manual_seed(3)
    k = torch.randn(1, 16, 1, 64, generator=g) * 3 + 5  # (n, bs, H, D)
    v = torch.randn(1, 16, 1, 64, generator=g)
    comps = quantize_pages("int4", k, v)

    def expected(x, dim):
        zero = x.amin(dim, keepdim=True).half()
        scale = ((x.amax(dim, keepdim=True) - zero.float()) / 15).clamp_min(2**-14).half()
        q = torch.floor((x - zero.float()) / scale.float() + 0.5).clamp(0, 15).to(torch.uint8)
        return q, scale, zero

    qk, sk, zk = expected(k, 1)  # per channel over the 16 tokens
    assert torch.equal(comps["k_scale"], sk.squeeze(1)) and torch.equal(
        comps["k_zero"], zk.squeeze(1)
    )
    assert torch.equal(comps["k"], (qk[..., 0::2] | (qk[..., 1::2] << 4)))
    vg = v.view(1, 16, 1, 2, 32)  # per token, two groups of 32 dims
    qv, sv, zv = expected(vg, -1)
    assert torch.equal(comps["v_scale"], sv.squeeze(-1)) and torch.equal(
        comps["v_zero"], zv.squeeze(-1)
    )
    qv = qv.view(1, 16, 1, 64)
    assert torch.equal(comps["v"], (qv[..., 0::2] | (qv[..., 1::2] << 4)))
    assert (qv.view(1, 16, 1, 2, 32).amax(-1) == 15).all()  # every group's max is a code 15
    assert (qv.view(1, 16, 1, 2, 32).amin(-1) == 0).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_page_stays_zero(fmt):
    z = torch.zeros(1, 16, 2, 64)
    k2, v2 = dequantize_pages(fmt, quantize_pages(fmt, z, z), torch.float32)
    assert torch.equal(k2, z) and torch.equal(v2, z)


@pytest.mark.parametrize("fmt", FORMATS)
def test_constant_groups_are_exact_enough(fmt):
    x = torch.full((1, 16, 2, 64), -1.5)
    k2, v2 = dequantize_pages(fmt, quantize_pages(fmt, x, x), torch.float32)
    assert torch.allclose(k2, x, atol=1e-3) and torch.allclose(v2, x, atol=1e-3)


@pytest.mark.parametrize("fmt", FORMATS)
def test_components_stored_in_pool_read_back_byte_identical(fmt):
    n_pages, bs, H, D, L = 9, 16, 3, 64, 2
    layout = PageLayout(fmt, L, H, D, bs)
    buf = layout.allocate(n_pages)
    ids = torch.tensor([7, 2, 5])
    written = {}
    for layer in range(L):
        comps = quantize_pages(fmt, *_pages(len(ids), bs, H, D, seed=layer))
        views = layout.views(buf, layer)
        for name, t in comps.items():
            views[name][ids] = t
        written[layer] = comps
    snapshot = buf.clone()
    restored = layout.allocate(n_pages)
    restored[ids] = snapshot[ids]  # a page is one contiguous run of bytes: spill + restore
    for layer in range(L):
        views = layout.views(restored, layer)
        for name, t in written[layer].items():
            got = views[name][ids]
            assert torch.equal(got.view(torch.uint8), t.contiguous().view(torch.uint8)), name
        k_a, v_a = dequantize_pages(fmt, {nm: vw[ids] for nm, vw in views.items()})
        k_b, v_b = dequantize_pages(fmt, written[layer])
        assert torch.equal(k_a, k_b) and torch.equal(v_a, v_b)
    untouched = torch.ones(n_pages, dtype=torch.bool)
    untouched[ids] = False
    assert (restored[untouched] == 0).all()


def test_int4_bits_per_value_is_5_5_at_block_16():
    layout = PageLayout("int4", num_layers=30, num_kv_heads=3, head_size=64, block_size=16)
    assert layout.bits_per_value == 5.5
    assert PageLayout("int8", 30, 3, 64, 16).bits_per_value == 8.25
    assert PageLayout("fp8", 30, 3, 64, 16).bits_per_value == 8.25


def test_bad_format_and_head_size_are_named():
    with pytest.raises(ValueError, match="'int3'"):
        quant_components("int3", 16, 1, 64)
    with pytest.raises(ValueError, match="48"):
        quant_components("int4", 16, 1, 48)


def test_hadamard_transform_is_an_orthonormal_self_inverse_and_batch_invariant():
    import math

    from kvmesh.kernels.quant import hadamard_transform, value_rotation_block

    x = torch.randn(7, 3, 64)
    h = torch.ones(1, 1)
    while h.shape[0] < 64:  # Sylvester's construction, normalized
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = h / math.sqrt(64)
    assert torch.allclose(hadamard_transform(x, 64), x @ h, atol=1e-6)
    assert torch.allclose(hadamard_transform(hadamard_transform(x, 32), 32), x, atol=1e-6)
    # bitwise the same row by row, whatever the batch: the engine and the oracle agree
    assert torch.equal(hadamard_transform(x, 64)[2:3], hadamard_transform(x[2:3], 64))
    assert value_rotation_block("int4", 64) == 64 and value_rotation_block("int4", 96) == 32
    assert value_rotation_block("int8", 64) is None
    with pytest.raises(ValueError, match="power of two"):
        hadamard_transform(x, 48)
