"""Multi-head latent attention (DeepSeek-V2/V3) over latent pages.

A latent page (``PageLayout(attention="mla")``) holds per token one row of ``D = rank +
rope`` values: the compressed KV latent ``c`` (rank) and the rotary key ``k_pe`` (rope),
viewed as ``latent (num_pages, block_size, D)``. Per head h the keys and values are
``k_h = [W_UK[h] c, k_pe]`` and ``v_h = W_UV[h] c``, with W_UK (H, nope, rank) and W_UV
(H, v, rank) from ``kv_b_proj``.

Decode uses weight absorption: ``q_h . k_h = (W_UK[h]^T q_nope_h) . c + q_pe_h . k_pe``, so
the absorbed query ``[W_UK[h]^T q_nope_h, q_pe_h]`` (H, D) attends over the latent rows
themselves, like multi-query attention with one shared key of size D whose first ``rank``
values are also the value; the output (H, rank) goes through W_UV. Only latent pages are
read. Prefill expands the latents to per-head K and V (``mla_prefill_torch``), which is
cheaper when many query tokens share the keys.

``mla_decode`` dispatches by device: the Triton kernel on CUDA, its torch twin elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope (T, H, nope), q_pe (T, H, rope), W_UK (H, nope, rank) -> (T, H, rank + rope)."""
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk)  # (H, T, rank)
    return torch.cat((q_lat.transpose(0, 1), q_pe), dim=-1)


def absorb_output(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o_lat (T, H, rank), W_UV (H, v, rank) -> (T, H, v)."""
    return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def write_latent(latent_cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor):
    """Store the step's rows ``latent`` (T, D) at flat slots (T,) of ``latent_cache``
    (P, bs, D) (a strided view into the pool). Mutates the cache."""
    bs = latent_cache.shape[1]
    latent_cache[slot_mapping // bs, slot_mapping % bs] = latent.to(latent_cache.dtype)


def _check_decode(q, latent_cache, block_tables, context_lens, kv_rank) -> None:
    if q.dim() != 3 or latent_cache.dim() != 3 or q.shape[-1] != latent_cache.shape[-1]:
        raise ValueError(
            f"expected q (B, H, D) and latent_cache (P, bs, D), got {tuple(q.shape)} and "
            f"{tuple(latent_cache.shape)}"
        )
    if not 0 < kv_rank < q.shape[-1]:
        raise ValueError(f"kv_rank must be in (0, {q.shape[-1]}), got {kv_rank}")
    B = q.shape[0]
    if block_tables.dtype != torch.int64 or block_tables.dim() != 2 or block_tables.shape[0] != B:
        raise ValueError(f"block_tables must be int64 (B={B}, P), got {block_tables.dtype} "
                         f"{tuple(block_tables.shape)}")  # fmt: skip
    if context_lens.dtype != torch.int64 or tuple(context_lens.shape) != (B,):
        raise ValueError(f"context_lens must be int64 ({B},), got {context_lens.dtype} "
                         f"{tuple(context_lens.shape)}")  # fmt: skip
    if latent_cache.stride(-1) != 1:
        raise ValueError("latent_cache rows must be contiguous in their last dimension")


def mla_decode_torch(
    *,
    q: torch.Tensor,  # (B, H, D): absorbed queries
    latent_cache: torch.Tensor,  # (P, bs, D)
    block_tables: torch.Tensor,  # (B, max_pages) int64, padded with the null page
    context_lens: torch.Tensor,  # (B,) int64
    kv_rank: int,
    scale: float,
) -> torch.Tensor:
    """Absorbed decode: (B, H, kv_rank) in q's dtype, computed in fp32 (the reference)."""
    _check_decode(q, latent_cache, block_tables, context_lens, kv_rank)
    B, P = block_tables.shape
    bs, D = latent_cache.shape[1], latent_cache.shape[2]
    kv = latent_cache.index_select(0, block_tables.reshape(-1)).float().view(B, 1, P * bs, D)
    pos = torch.arange(P * bs, device=q.device)
    mask = (pos[None, :] < context_lens[:, None])[:, None, None, :]  # (B, 1, 1, L)
    o = F.scaled_dot_product_attention(
        q.float()[:, None], kv, kv[..., :kv_rank], attn_mask=mask, scale=scale
    )  # (B, 1, H, rank): the heads as the query axis of one shared key/value head
    return o[:, 0].to(q.dtype)


def mla_prefill_torch(
    *,
    q_nope: torch.Tensor,  # (n, H, nope)
    q_pe: torch.Tensor,  # (n, H, rope)
    latent: torch.Tensor,  # (ctx, rank + rope): every key of the chunk, its own included
    w_uk: torch.Tensor,  # (H, nope, rank)
    w_uv: torch.Tensor,  # (H, v, rank)
    scale: float,
    mask: torch.Tensor | None,  # (n, ctx) bool, or None: causal with n == ctx
) -> torch.Tensor:
    """Expanded prefill: per-head K (ctx, H, nope + rope) and V (ctx, H, v) from the
    latents, then attention. Returns (n, H, v) in q's dtype."""
    H, nope, rank = w_uk.shape
    ctx = latent.shape[0]
    c, k_pe = latent[:, :rank].to(q_nope.dtype), latent[:, rank:].to(q_nope.dtype)
    k_nope = torch.einsum("cr,hnr->hcn", c, w_uk)  # (H, ctx, nope)
    v = torch.einsum("cr,hvr->hcv", c, w_uv)  # (H, ctx, v)
    k = torch.cat((k_nope, k_pe[None].expand(H, ctx, k_pe.shape[-1])), dim=-1)
    q = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1)  # (H, n, nope + rope)
    o = F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, is_causal=mask is None, scale=scale
    )  # (1, H, n, v)
    return o[0].transpose(0, 1)


# ---------------------------------------------------------------------------------------------
# Triton


@triton.jit
def _mla_decode_kernel(
    q_ptr, s_qb, s_qh,  # (B, H, D) absorbed queries
    kv_ptr, s_kp, s_kt,  # latent pages (P, BS, D), last stride 1
    bt_ptr, s_btb,  # (B, max_pages) int64
    ctx_ptr,  # (B,) int64
    o_ptr, s_ob, s_oh,  # (B, H, RANK) out
    qk_scale, H,
    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    BS: tl.constexpr, BLOCK_H: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    # one program: one sequence and BLOCK_H of its heads; every latent tile is read once
    # for all of them (they share the one key/value row, as in multi-query attention)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    r = tl.arange(0, BLOCK_R)
    rmask = r < RANK
    p = tl.arange(0, BLOCK_P)
    pmask = p < ROPE
    q_row = q_ptr + b * s_qb + h[:, None].to(tl.int64) * s_qh
    q_c = tl.load(q_row + r[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0)
    q_p = tl.load(q_row + RANK + p[None, :], mask=hmask[:, None] & pmask[None, :], other=0.0)
    # the dots run in q's dtype (tensor cores for fp16/bf16) and accumulate in fp32; fp32
    # inputs ask for "ieee" precision (tl.dot's default for fp32 is TF32 on GPUs)
    ctx = tl.load(ctx_ptr + b).to(tl.int32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    n = tl.arange(0, BS)
    for j in range(0, tl.cdiv(ctx, BS)):
        page = tl.load(bt_ptr + b * s_btb + j)
        row = kv_ptr + page * s_kp + n[:, None].to(tl.int64) * s_kt  # (BS, 1)
        c = tl.load(row + r[None, :], mask=rmask[None, :], other=0.0).to(q_c.dtype)  # (BS, R)
        kp = tl.load(row + RANK + p[None, :], mask=pmask[None, :], other=0.0).to(q_c.dtype)
        s = tl.dot(q_c, tl.trans(c), input_precision=DOT_PRECISION) + tl.dot(
            q_p, tl.trans(kp), input_precision=DOT_PRECISION
        )  # (BLOCK_H, BS)
        s = s * qk_scale  # log2 domain
        valid = (j * BS + n) < ctx
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        acc = acc * alpha[:, None] + tl.dot(pr.to(c.dtype), c, input_precision=DOT_PRECISION)
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_row = o_ptr + b * s_ob + h[:, None].to(tl.int64) * s_oh
    tl.store(o_row + r[None, :], o.to(o_ptr.dtype.element_ty), mask=hmask[:, None] & rmask[None, :])


def check_triton_block_size(block_size: int) -> None:
    """The Triton decode's tile is one page: ``block_size`` must be a power of two >= 16."""
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(
            f"the Triton MLA decode needs a power-of-two block_size >= 16, got {block_size}"
        )


def mla_decode_triton(
    *,
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    kv_rank: int,
    scale: float,
) -> torch.Tensor:
    """The Triton twin of ``mla_decode_torch`` (same arguments, same result)."""
    _check_decode(q, latent_cache, block_tables, context_lens, kv_rank)
    if q.stride(-1) != 1:
        q = q.contiguous()
    B, H, D = q.shape
    bs = latent_cache.shape[1]
    check_triton_block_size(bs)
    out = torch.empty((B, H, kv_rank), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    block_h = 16
    grid = (B, triton.cdiv(H, block_h))
    _mla_decode_kernel[grid](
        q, q.stride(0), q.stride(1),
        latent_cache, latent_cache.stride(0), latent_cache.stride(1),
        block_tables, block_tables.stride(0),
        context_lens,
        out, out.stride(0), out.stride(1),
        scale * 1.4426950408889634, H,
        RANK=kv_rank, ROPE=D - kv_rank,
        BLOCK_R=max(16, triton.next_power_of_2(kv_rank)),
        BLOCK_P=max(16, triton.next_power_of_2(D - kv_rank)),
        BS=bs, BLOCK_H=block_h,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
    )  # fmt: skip
    return out


def mla_decode_cpu(
    *,
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    kv_rank: int,
    scale: float,
    library=None,
) -> torch.Tensor:
    """``mla_decode_torch`` through kvmesh's C decode kernel (``kernels.cpu_attention``),
    which reads the pages in place instead of gathering them: the latent rows are one
    shared K head of size D and, with V = K, the first ``kv_rank`` values of each output
    row are the latent output (the rotary tail, 1/9 of a row for DeepSeek, is discarded)."""
    from kvmesh.kernels.cpu_attention import paged_decode_attention_cpu

    _check_decode(q, latent_cache, block_tables, context_lens, kv_rank)
    fmt = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(
        latent_cache.dtype
    )
    if fmt is None:
        raise ValueError(f"latent pages must be fp32/fp16/bf16, got {latent_cache.dtype}")
    kv = latent_cache.unsqueeze(2)  # (P, bs, 1, D): one KV head
    o = paged_decode_attention_cpu(
        q=q,
        fmt=fmt,
        cache={"k": kv, "v": kv},
        block_tables=block_tables,
        context_lens=context_lens,
        scale=scale,
        library=library,
    )  # (B, H, D)
    return o[..., :kv_rank]


def mla_decode(**kw) -> torch.Tensor:
    """Absorbed decode over latent pages: Triton on CUDA, the torch twin elsewhere."""
    if kw["q"].is_cuda:
        return mla_decode_triton(**kw)
    return mla_decode_torch(**kw)
