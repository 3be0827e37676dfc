"""The C causal prefill kernel (``kvmesh_prefill_attention_f32`` in kernels/cpu_attention.c)
against its torch twin, SDPA, computed in float64: every build this host runs (native,
AVX2 where the CPU has it, AVX-512 without DQ where it has AVX-512F: exp2's fallback,
portable), odd lengths, later chunks (ctx > n), G = 1, 3 and 8,
D = 64 and 128, block sizes that do not divide the lengths, and the scalar loop forced on a
vector build. Bound: 2e-5 absolute on unit-normal inputs (measured ~1.3e-6); with scores
of ~+-100 (q x 30) twice SDPA's own fp32 error, as fp32 rounding of the scores then
dominates."""

import pytest
import torch
import torch.nn.functional as F
from builds import avx512_no_dq_builds, host_builds

from kvmesh.kernels.cpu_attention import prefill_attention_cpu

ATOL = 2e-5
BUILDS = [*host_builds(), *avx512_no_dq_builds()]


def sdpa_twin(q, k, v, scale):
    """SDPA on (1, H, T, D) in float64: causal (bottom-right when ctx > n), GQA."""
    n, ctx = q.shape[0], k.shape[0]
    qq, kk, vv = (t.double().transpose(0, 1)[None] for t in (q, k, v))
    mask = None
    if ctx > n:
        mask = torch.arange(ctx)[None, :] <= (ctx - n + torch.arange(n))[:, None]
    o = F.scaled_dot_product_attention(
        qq, kk, vv, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
    )
    return o[0].transpose(0, 1).float()


def _qkv(n, ctx, Hq, Hkv, D, seed=0, mult=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, Hq, D, generator=g) * mult
    return q, torch.randn(ctx, Hkv, D, generator=g), torch.randn(ctx, Hkv, D, generator=g)


SHAPES = [  # (n, ctx, Hq, Hkv, D)
    (37, 37, 9, 3, 64),  # odd length, G = 3 (SmolLM2's heads)
    (129, 129, 9, 3, 64),  # one past a block
    (600, 600, 9, 3, 64),  # past two of the default 256-key blocks
    (300, 700, 8, 2, 128),  # G = 4, D = 128, ctx > n, over several 256-key blocks
    (100, 165, 9, 3, 64),  # a later chunk: 65 cached keys
    (64, 64, 4, 4, 128),  # G = 1, D = 128
    (83, 90, 6, 2, 128),  # G = 3, D = 128, ctx > n
    (77, 77, 8, 1, 64),  # G = 8: fewer query tokens per block by default
    (1, 5, 3, 1, 64),  # one query
    (3, 3, 2, 2, 40),  # D off the vector width: the scalar loop
]


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("n,ctx,Hq,Hkv,D", SHAPES)
def test_matches_sdpa(libraries, build, n, ctx, Hq, Hkv, D):
    q, k, v = _qkv(n, ctx, Hq, Hkv, D)
    got = prefill_attention_cpu(q, k, v, D**-0.5, library=libraries[build])
    torch.testing.assert_close(got, sdpa_twin(q, k, v, D**-0.5), rtol=0, atol=ATOL)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("bq,bk", [(7, 64), (1, 128), (50, 192), (32, 16)])
def test_block_sizes(libraries, build, bq, bk):
    """Query blocks that do not divide n, key blocks of 1-3 micro-tiles (a bk the vector
    path cannot take runs the scalar loop), across a later chunk."""
    q, k, v = _qkv(150, 211, 9, 3, 64, seed=1)
    got = prefill_attention_cpu(q, k, v, 0.125, library=libraries[build], block_q=bq, block_k=bk)
    torch.testing.assert_close(got, sdpa_twin(q, k, v, 0.125), rtol=0, atol=ATOL)


@pytest.mark.parametrize("build", BUILDS)
def test_peaked_scores_and_scalar_loop(libraries, build):
    """Large scores (q x 30): most weights underflow exp to 0 and each block's max moves;
    the vector path and the scalar loop forced on the same build both match."""
    q, k, v = _qkv(96, 96, 9, 3, 64, seed=2, mult=30.0)
    want = sdpa_twin(q, k, v, 0.125)
    # scores of ~+-100 carry fp32 rounding into exp: SDPA in fp32 is itself 2.8e-5 off here
    qq, kk, vv = (t.transpose(0, 1)[None] for t in (q, k, v))
    sdpa32 = F.scaled_dot_product_attention(
        qq, kk, vv, is_causal=True, scale=0.125, enable_gqa=True
    )[0].transpose(0, 1)
    bound = max(ATOL, 2 * float((sdpa32 - want).abs().max()))
    lib = libraries[build]
    for force in (False, True):
        got = prefill_attention_cpu(q, k, v, 0.125, library=lib, force_scalar=force)
        torch.testing.assert_close(got, want, rtol=0, atol=bound)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("n,ctx", [(150, 150), (100, 165), (1, 7)])
def test_reads_slices_of_fused_rows(libraries, build, n, ctx):
    """q, k and v as column slices of wider token rows (the fused qkv projection's output,
    which the kernel reads in place): bit for bit the result of contiguous copies, and SDPA's
    within the bound; a later chunk (ctx > n) and a single query too."""
    Hq, Hkv, D = 9, 3, 64
    g = torch.Generator().manual_seed(4)
    qrows = torch.randn(n, (Hq + 2 * Hkv) * D + 8, generator=g)  # (n, W): a wider row
    kvrows = torch.randn(ctx, 2 * Hkv * D + 24, generator=g)
    q = qrows[:, 8 : 8 + Hq * D].view(n, Hq, D)
    k = kvrows[:, : Hkv * D].view(ctx, Hkv, D)
    v = kvrows[:, Hkv * D : 2 * Hkv * D].view(ctx, Hkv, D)
    assert not (k.is_contiguous() or v.is_contiguous()) and (n == 1 or not q.is_contiguous())
    lib = libraries[build]
    got = prefill_attention_cpu(q, k, v, 0.125, library=lib)
    dense = prefill_attention_cpu(
        q.contiguous(), k.contiguous(), v.contiguous(), 0.125, library=lib
    )
    assert torch.equal(got, dense)
    torch.testing.assert_close(got, sdpa_twin(q, k, v, 0.125), rtol=0, atol=ATOL)


def test_out_and_threads(libraries):
    """Writes into ``out``; one thread and two give the same result within rounding."""
    q, k, v = _qkv(300, 300, 9, 3, 64, seed=3)
    out = torch.full_like(q, float("nan"))
    lib = libraries["native"]
    prefill_attention_cpu(q, k, v, 0.125, library=lib, out=out)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = prefill_attention_cpu(q, k, v, 0.125, library=lib)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, one, rtol=0, atol=ATOL)
    torch.testing.assert_close(out, sdpa_twin(q, k, v, 0.125), rtol=0, atol=ATOL)


def test_bad_arguments_are_named(libraries):
    lib = libraries["native"]
    q, k, v = _qkv(8, 8, 9, 3, 64)
    with pytest.raises(ValueError, match="at least as many keys"):
        prefill_attention_cpu(q, k[:4], v[:4], 0.125, library=lib)
    with pytest.raises(ValueError, match="Hq % Hkv"):
        prefill_attention_cpu(q[:, :8], k, v, 0.125, library=lib)
    with pytest.raises(ValueError, match="float32"):
        prefill_attention_cpu(q.double(), k, v, 0.125, library=lib)
    with pytest.raises(ValueError, match=r"\(n, Hq, D\)"):
        prefill_attention_cpu(q[0], k, v, 0.125, library=lib)
