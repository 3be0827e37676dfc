"""Paged decode attention: one new query token per sequence against its cached keys.

GQA-aware: one program owns a KV head and folds that head's group of query heads into the
M dimension of the dot, so every K/V tile is read (and dequantized) once per group.
Split-KV (flash-decoding): a sequence's pages are divided among ``num_splits`` programs,
each writing a partial output and its log-sum-exp; a second kernel merges them.

Keys are the ``context_lens[b]`` cached positions, the new token's own included (the
write op ran first). Quantized formats fuse dequantization into the tile load and read the
pages that ``residual_slots`` names from the residual instead of the pool: (B,) the partial
last page, or (B, W) the last W pages of each sequence, -1 entries from the pool (see
``kernels.paged_kv.residual_page_slots``). With a sliding window of w keys, keys at
positions ``< ctx - w`` are masked.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvmesh.kernels.page_format import QUANT_FORMATS
from kvmesh.kernels.paged_kv import (
    NO_WINDOW,
    check_cache,
    check_query,
    check_seq_index,
    check_tile_block_size,
    fmt_code,
    gather_kv_torch,
    kv_args,
    load_kv_tile,
    online_softmax_step,
    residual_kwargs,
    residual_page_slots,
)


def _check_decode_args(
    *, q, fmt, cache, residual_k, residual_v, block_tables, context_lens, residual_slots, out
) -> tuple[int, int, int]:
    bs, Hkv, D = check_cache(fmt, cache, residual_k, residual_v)
    check_query(q, out, num_kv_heads=Hkv, head_size=D, rows="B")
    check_seq_index(
        fmt,
        num_seqs=q.shape[0],
        block_tables=block_tables,
        context_lens=context_lens,
        residual_slots=residual_slots,
        residual_pages=True,
    )
    return bs, Hkv, D


# ---------------------------------------------------------------------------------------------
# torch twin


def paged_decode_attention_torch(
    *,
    q: torch.Tensor,
    fmt: str,
    cache: dict[str, torch.Tensor],
    residual_k: torch.Tensor | None = None,
    residual_v: torch.Tensor | None = None,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    residual_slots: torch.Tensor | None = None,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (B, Hq, D) -> (B, Hq, D) in q's dtype, computed in fp32. ``num_splits`` only
    matters to the Triton twin (the math is the same)."""
    bs, Hkv, D = _check_decode_args(
        q=q,
        fmt=fmt,
        cache=cache,
        residual_k=residual_k,
        residual_v=residual_v,
        block_tables=block_tables,
        context_lens=context_lens,
        residual_slots=residual_slots,
        out=out,
    )
    B, Hq, _ = q.shape
    # (B, L, Hkv, D) fp32 each
    k, v = gather_kv_torch(
        fmt=fmt,
        cache=cache,
        residual_k=residual_k,
        residual_v=residual_v,
        block_tables=block_tables,
        context_lens=context_lens,
        residual_slots=residual_slots,
    )
    L = k.shape[1]
    pos = torch.arange(L, device=q.device)
    ctx = context_lens.to(torch.int64)[:, None]
    mask = pos[None, :] < ctx  # (B, L)
    if sliding_window is not None:
        mask &= pos[None, :] >= ctx - sliding_window
    o = F.scaled_dot_product_attention(
        q.float().view(B, Hkv, Hq // Hkv, D),  # a KV head's query group as the query axis
        k.transpose(1, 2),  # (B, Hkv, L, D)
        v.transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        scale=scale,
    )  # (B, Hkv, G, D)
    o = o.reshape(B, Hq, D).to(q.dtype)
    if out is None:
        return o
    out.copy_(o)
    return out


# ---------------------------------------------------------------------------------------------
# Triton


@triton.jit
def _decode_split_kernel(
    q_ptr, s_qb, s_qh,  # (B, Hq, D)
    k_ptr, ks_ptr, kz_ptr, s_kp, s_kt, s_kh, s_ksp, s_kst, s_ksh, s_ksd,  # K views
    v_ptr, vs_ptr, vz_ptr, s_vp, s_vt, s_vh, s_vsp, s_vst, s_vsh, s_vsd,  # V views
    rk_ptr, rv_ptr, s_rkp, s_rkt, s_rkh, s_rvp, s_rvt, s_rvh,  # residual (R, BS, Hkv, D)
    bt_ptr, s_btb,  # (B, P) int64
    ctx_ptr, rslot_ptr, s_rsb,  # (B,), (B, RES_PAGES) int64 (residual_page_slots)
    o_ptr, lse_ptr,  # partials (B, Hq, NUM_SPLITS, D) fp32, (B, Hq, NUM_SPLITS) fp32
    qk_scale, window, Hq, D,
    FMT: tl.constexpr, QUANT: tl.constexpr, K_DIV: tl.constexpr, V_DIV: tl.constexpr,
    BS: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr,
    NUM_SPLITS: tl.constexpr, RES_PAGES: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b).to(tl.int32)
    n_pages = tl.cdiv(ctx, BS)
    first = tl.maximum(ctx - window, 0) // BS  # pages wholly outside the window are skipped
    per = tl.cdiv(n_pages - first, NUM_SPLITS)
    start = first + split * per
    end = tl.minimum(start + per, n_pages)

    g = tl.arange(0, GP)  # query rows: the KV head's group, padded to GP (>= 16 for tl.dot)
    heads = hk * GROUP + g
    gmask = g < GROUP
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(
        q_ptr + b * s_qb + heads[:, None] * s_qh + d[None, :],
        mask=gmask[:, None] & dmask[None, :],
        other=0.0,
    )  # (GP, BLOCK_D)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, BLOCK_D], tl.float32)
    n = tl.arange(0, BS)
    # quantized: the last RES_PAGES pages, from ring (first page index ring0), go by their slots
    ring0 = (ctx + BS - 1) // BS - RES_PAGES  # (ctx - 1) // BS - RES_PAGES + 1, ctx >= 0
    if QUANT:
        pool_end = tl.minimum(end, ring0)
    else:
        pool_end = end
    for j in range(start, pool_end):
        page = tl.load(bt_ptr + b * s_btb + j)
        kT = load_kv_tile(
            k_ptr, ks_ptr, kz_ptr, page, hk, n[None, :], d[:, None], dmask[:, None],
            s_kp, s_kt, s_kh, s_ksp, s_kst, s_ksh, s_ksd, FMT, K_DIV,
        )  # fmt: skip  # (BLOCK_D, BS)
        vt = load_kv_tile(
            v_ptr, vs_ptr, vz_ptr, page, hk, n[:, None], d[None, :], dmask[None, :],
            s_vp, s_vt, s_vh, s_vsp, s_vst, s_vsh, s_vsd, FMT, V_DIV,
        )  # fmt: skip  # (BS, BLOCK_D)
        pos = j * BS + n
        valid = (pos < ctx) & (pos >= ctx - window)
        m_i, l_i, acc = online_softmax_step(q, kT, vt, valid[None, :], m_i, l_i, acc, qk_scale)
    if QUANT:
        for i in tl.static_range(RES_PAGES):
            j = ring0 + i
            if (j >= start) & (j < end) & (j >= 0):
                slot = tl.load(rslot_ptr + b * s_rsb + i)
                pos = j * BS + n
                valid = (pos < ctx) & (pos >= ctx - window)
                if slot >= 0:  # the page is in the residual, in full precision
                    kT = load_kv_tile(
                        rk_ptr, rk_ptr, rk_ptr, slot, hk, n[None, :], d[:, None], dmask[:, None],
                        s_rkp, s_rkt, s_rkh, 0, 0, 0, 0, 0, 1,
                    )  # fmt: skip
                    vt = load_kv_tile(
                        rv_ptr, rv_ptr, rv_ptr, slot, hk, n[:, None], d[None, :], dmask[None, :],
                        s_rvp, s_rvt, s_rvh, 0, 0, 0, 0, 0, 1,
                    )  # fmt: skip
                else:  # not in the ring (e.g. restored from a prefix cache): the pool page
                    page = tl.load(bt_ptr + b * s_btb + j)
                    kT = load_kv_tile(
                        k_ptr, ks_ptr, kz_ptr, page, hk, n[None, :], d[:, None], dmask[:, None],
                        s_kp, s_kt, s_kh, s_ksp, s_kst, s_ksh, s_ksd, FMT, K_DIV,
                    )  # fmt: skip
                    vt = load_kv_tile(
                        v_ptr, vs_ptr, vz_ptr, page, hk, n[:, None], d[None, :], dmask[None, :],
                        s_vp, s_vt, s_vh, s_vsp, s_vst, s_vsh, s_vsd, FMT, V_DIV,
                    )  # fmt: skip
                m_i, l_i, acc = online_softmax_step(
                    q, kT, vt, valid[None, :], m_i, l_i, acc, qk_scale
                )
    has = l_i > 0  # an empty split leaves l = 0: output 0, lse -1e30 (weight 0 in the merge)
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, -1e30)
    row = (b * Hq + heads) * NUM_SPLITS + split  # (GP,) int64
    tl.store(o_ptr + row[:, None] * D + d[None, :], o, mask=gmask[:, None] & dmask[None, :])
    tl.store(lse_ptr + row, lse, mask=gmask)


@triton.jit
def _merge_splits_kernel(
    o_ptr, lse_ptr,  # (B, Hq, NUM_SPLITS, D) fp32, (B, Hq, NUM_SPLITS) fp32
    out_ptr, s_ob, s_oh,  # (B, Hq, D)
    Hq, D, NUM_SPLITS: tl.constexpr, SP: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, SP)
    smask = s < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    row = (b * Hq + h) * NUM_SPLITS + s  # (SP,)
    lse = tl.load(lse_ptr + row, mask=smask, other=-1e30)
    w = tl.exp(lse - tl.max(lse, 0))  # (SP,): empty splits (lse -1e30) weigh 0
    o = tl.load(
        o_ptr + row[:, None] * D + d[None, :], mask=smask[:, None] & dmask[None, :], other=0.0
    )  # (SP, BLOCK_D): masked lanes must be 0, not garbage, since 0 * NaN is NaN
    res = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(out_ptr + b * s_ob + h * s_oh + d, res.to(out_ptr.dtype.element_ty), mask=dmask)


def default_num_splits(num_programs: int, max_pages: int, device: torch.device) -> int:
    """Enough splits for about two waves over the SMs, at most 16, at most one per page."""
    sms = 108
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(16, max_pages, -(-2 * sms // max(num_programs, 1))))


def paged_decode_attention_triton(
    *,
    q: torch.Tensor,
    fmt: str,
    cache: dict[str, torch.Tensor],
    residual_k: torch.Tensor | None = None,
    residual_v: torch.Tensor | None = None,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    residual_slots: torch.Tensor | None = None,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``paged_decode_attention_torch``'s Triton twin."""
    bs, Hkv, D = _check_decode_args(
        q=q,
        fmt=fmt,
        cache=cache,
        residual_k=residual_k,
        residual_v=residual_v,
        block_tables=block_tables,
        context_lens=context_lens,
        residual_slots=residual_slots,
        out=out,
    )
    check_tile_block_size(bs)
    B, Hq, _ = q.shape
    group = Hq // Hkv
    if out is None:
        out = torch.empty_like(q)
    if B == 0:
        return out
    if num_splits is None:
        num_splits = default_num_splits(B * Hkv, block_tables.shape[1], q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    k_args, v_args = kv_args(fmt, cache, "k"), kv_args(fmt, cache, "v")
    if fmt in QUANT_FORMATS:
        residual_slots = residual_page_slots(
            residual_slots, context_lens, bs=bs, num_slots=residual_k.shape[0]
        )  # (B, W)
    o_part = torch.empty((B, Hq, num_splits, D), dtype=torch.float32, device=q.device)
    lse = torch.empty((B, Hq, num_splits), dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(D))  # tl.dot needs K >= 16
    _decode_split_kernel[(B, Hkv, num_splits)](
        q_ptr=q,
        s_qb=q.stride(0),
        s_qh=q.stride(1),
        **k_args.kwargs("k"),
        **v_args.kwargs("v"),
        **residual_kwargs(
            fmt,
            cache,
            residual_k=residual_k,
            residual_v=residual_v,
            residual_slots=residual_slots,
            block_tables=block_tables,
        ),
        bt_ptr=block_tables,
        s_btb=block_tables.stride(0),
        ctx_ptr=context_lens,
        s_rsb=residual_slots.stride(0) if fmt in QUANT_FORMATS else 0,
        o_ptr=o_part,
        lse_ptr=lse,
        qk_scale=scale * math.log2(math.e),
        window=NO_WINDOW if sliding_window is None else int(sliding_window),
        Hq=Hq,
        D=D,
        FMT=fmt_code(fmt),
        QUANT=fmt in QUANT_FORMATS,
        K_DIV=k_args.scale_div,
        V_DIV=v_args.scale_div,
        BS=bs,
        BLOCK_D=block_d,
        GROUP=group,
        GP=max(16, triton.next_power_of_2(group)),
        NUM_SPLITS=num_splits,
        RES_PAGES=residual_slots.shape[1] if fmt in QUANT_FORMATS else 1,
    )
    _merge_splits_kernel[(B, Hq)](
        o_ptr=o_part,
        lse_ptr=lse,
        out_ptr=out,
        s_ob=out.stride(0),
        s_oh=out.stride(1),
        Hq=Hq,
        D=D,
        NUM_SPLITS=num_splits,
        SP=triton.next_power_of_2(num_splits),
        BLOCK_D=block_d,
    )
    return out


def paged_decode_attention(
    *,
    q: torch.Tensor,
    fmt: str,
    cache: dict[str, torch.Tensor],
    residual_k: torch.Tensor | None = None,
    residual_v: torch.Tensor | None = None,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    residual_slots: torch.Tensor | None = None,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA, the torch twin elsewhere."""
    impl = paged_decode_attention_triton if q.is_cuda else paged_decode_attention_torch
    return impl(
        q=q,
        fmt=fmt,
        cache=cache,
        residual_k=residual_k,
        residual_v=residual_v,
        block_tables=block_tables,
        context_lens=context_lens,
        residual_slots=residual_slots,
        scale=scale,
        sliding_window=sliding_window,
        num_splits=num_splits,
        out=out,
    )
