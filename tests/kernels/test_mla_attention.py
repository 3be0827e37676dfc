"""Latent-page decode: the Triton kernel (interpreted) vs its torch twin vs a dense,
expanded multi-head reference in fp64 (which checks the weight absorption itself)."""

from __future__ import annotations

import pytest
import torch

from kvmesh.kernels.mla_attention import (
    absorb_output,
    absorb_query,
    mla_decode_torch,
    mla_decode_triton,
    mla_prefill_torch,
    write_latent,
)

TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


def _setup(dtype, *, B, H, rank, rope, nope, vd, bs, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    D = rank + rope
    pages_per = [-(-n // bs) for n in lens]
    num_pages = 1 + sum(pages_per) + 3  # page 0: the null page; a few never used
    cache = torch.zeros((num_pages, bs, D + 5), dtype=dtype)[..., :D]  # strided like the pool
    ids = torch.randperm(num_pages - 1, generator=g)[: sum(pages_per)] + 1
    tables = torch.zeros((B, max(pages_per)), dtype=torch.int64)
    rows = []
    k = 0
    for b, n in enumerate(lens):
        tables[b, : pages_per[b]] = ids[k : k + pages_per[b]]
        k += pages_per[b]
        lat = torch.randn(n, D, generator=g).to(dtype)
        slots = torch.tensor([tables[b, p // bs] * bs + p % bs for p in range(n)])
        write_latent(cache, lat, slots)
        rows.append(lat)
    w_uk = torch.randn(H, nope, rank, generator=g).to(dtype) / rank**0.5
    w_uv = torch.randn(H, vd, rank, generator=g).to(dtype) / rank**0.5
    q_nope = torch.randn(B, H, nope, generator=g).to(dtype)
    q_pe = torch.randn(B, H, rope, generator=g).to(dtype)
    ctx = torch.tensor(lens, dtype=torch.int64)
    return cache, tables, ctx, rows, w_uk, w_uv, q_nope, q_pe


def _expanded(rows, w_uk, w_uv, q_nope, q_pe, scale):
    """Per-head K and V from each sequence's latents, plain attention in fp64."""
    rank = w_uk.shape[-1]
    outs = []
    for b, lat in enumerate(rows):
        lat = lat.double()
        c, k_pe = lat[:, :rank], lat[:, rank:]
        k = torch.einsum("cr,hnr->hcn", c, w_uk.double())  # (H, ctx, nope)
        v = torch.einsum("cr,hvr->hcv", c, w_uv.double())
        s = torch.einsum("hn,hcn->hc", q_nope[b].double(), k)
        s = s + torch.einsum("hp,cp->hc", q_pe[b].double(), k_pe)
        outs.append(torch.einsum("hc,hcv->hv", (s * scale).softmax(-1), v))
    return torch.stack(outs)  # (B, H, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "H,rank,rope,lens",
    [(4, 32, 8, [1, 17, 40]), (20, 48, 16, [33, 16, 5, 64]), (3, 24, 6, [7])],
    ids=["small", "heads>16-odd-rank", "odd-dims"],
)
def test_triton_twin_and_absorption(dtype, H, rank, rope, lens):
    nope, vd, bs = 16, 12, 16
    B = len(lens)
    cache, tables, ctx, rows, w_uk, w_uv, q_nope, q_pe = _setup(
        dtype, B=B, H=H, rank=rank, rope=rope, nope=nope, vd=vd, bs=bs, lens=lens
    )
    scale = (nope + rope) ** -0.5
    q = absorb_query(q_nope, q_pe, w_uk)  # (B, H, rank + rope)
    kw = dict(q=q, latent_cache=cache, block_tables=tables, context_lens=ctx, kv_rank=rank)
    ref = mla_decode_torch(**kw, scale=scale)
    tri = mla_decode_triton(**kw, scale=scale)
    assert tri.shape == (B, H, rank) and tri.dtype == dtype
    tol = TOL[dtype]
    torch.testing.assert_close(tri.float(), ref.float(), atol=tol, rtol=tol)
    # absorbed decode == attention over per-head expanded K and V
    want = _expanded(rows, w_uk, w_uv, q_nope, q_pe, scale)
    got = absorb_output(ref.float(), w_uv.float()).double()
    torch.testing.assert_close(got, want, atol=5 * tol, rtol=5 * tol)


def test_prefill_expand_equals_absorbed_decode_per_row():
    """The expanded prefill of n rows against a context equals n absorbed decodes."""
    torch.manual_seed(0)
    H, rank, rope, nope, vd, ctx, n = 4, 32, 8, 16, 12, 23, 5
    lat = torch.randn(ctx, rank + rope)
    w_uk, w_uv = torch.randn(H, nope, rank) / 6, torch.randn(H, vd, rank) / 6
    q_nope, q_pe = torch.randn(n, H, nope), torch.randn(n, H, rope)
    kpos, qpos = torch.arange(ctx), torch.arange(ctx - n, ctx)
    mask = kpos[None, :] <= qpos[:, None]
    pre = mla_prefill_torch(
        q_nope=q_nope, q_pe=q_pe, latent=lat, w_uk=w_uk, w_uv=w_uv, scale=0.2, mask=mask
    )
    cache = lat.view(1, ctx, rank + rope)  # one page holding the whole context
    for i in range(n):
        q = absorb_query(q_nope[i : i + 1], q_pe[i : i + 1], w_uk)
        o = mla_decode_torch(
            q=q,
            latent_cache=cache,
            block_tables=torch.zeros((1, 1), dtype=torch.int64),
            context_lens=torch.tensor([ctx - n + i + 1]),
            kv_rank=rank,
            scale=0.2,
        )
        torch.testing.assert_close(absorb_output(o, w_uv)[0], pre[i], atol=1e-5, rtol=1e-5)


def test_bad_arguments_are_named():
    q = torch.zeros(2, 4, 40)
    cache = torch.zeros(3, 16, 40)
    good = dict(q=q, latent_cache=cache, context_lens=torch.tensor([1, 2]), kv_rank=32)
    tables = torch.zeros(2, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="block_tables must be int64"):
        mla_decode_triton(**good, block_tables=torch.zeros(2, 1, dtype=torch.int32), scale=1.0)
    with pytest.raises(ValueError, match="kv_rank must be in"):
        mla_decode_torch(**{**good, "kv_rank": 40}, block_tables=tables, scale=1.0)
    with pytest.raises(ValueError, match="power-of-two block_size"):
        mla_decode_triton(
            **{**good, "latent_cache": torch.zeros(3, 8, 40)},
            block_tables=tables,
            scale=1.0,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cpu_kernel_twin(dtype):
    """The C decode kernel over latent pages (one shared K head, V = K) == the torch twin."""
    from kvmesh.kernels.mla_attention import mla_decode_cpu
    from kvmesh.worker import cpu_kernels

    lib = cpu_kernels.load()
    assert lib is not None, "kvmesh's C kernels must build here (a C compiler is needed)"
    H, rank, rope, lens = 20, 48, 16, [33, 16, 5, 64]
    cache, tables, ctx, _, w_uk, _, q_nope, q_pe = _setup(
        dtype, B=len(lens), H=H, rank=rank, rope=rope, nope=16, vd=12, bs=16, lens=lens
    )
    P, D = cache.shape[0], rank + rope  # page-strided like the pool, rows dense in a page
    pool = torch.zeros((P, 16 * D + 24), dtype=dtype)[:, : 16 * D].unflatten(1, (16, D))
    cache = pool.copy_(cache)
    q = absorb_query(q_nope, q_pe, w_uk)
    kw = dict(q=q, latent_cache=cache, block_tables=tables, context_lens=ctx, kv_rank=rank)
    got = mla_decode_cpu(**kw, scale=0.2, library=lib)
    want = mla_decode_torch(**kw, scale=0.2)
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    assert got.shape == want.shape == (len(lens), H, rank)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_triton_block_size_is_checked_when_the_backend_is_built():
    """A page size the Triton decode cannot tile fails at construction, naming it."""
    from kvmesh.kernels.mla_attention import check_triton_block_size
    from kvmesh.worker.attention.mla import MLABackend

    for bs in (16, 32, 128):
        check_triton_block_size(bs)
    for bs in (8, 24, 0):
        with pytest.raises(ValueError, match=f"power-of-two block_size >= 16, got {bs}"):
            check_triton_block_size(bs)
    with pytest.raises(ValueError, match="got 24"):
        MLABackend("triton", block_size=24)
    with pytest.raises(ValueError, match="got 8"):
        MLABackend("auto", block_size=8, device="cuda:0")  # no GPU needed to refuse
    MLABackend("auto", block_size=8, device="cpu")  # the torch twin takes any page size
    MLABackend("torch", block_size=8, device="cuda")
