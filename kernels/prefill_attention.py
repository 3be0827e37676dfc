"""Paged prefill attention: chunks of new tokens attending to a cached prefix and themselves.

A batch of spans, cu_seqlens-style: span ``s`` has queries ``q[cu[s]:cu[s + 1]]``, the last
``q_len`` of its ``context_lens[s]`` positions (chunked prefill: the earlier positions are
the cached prefix). Attention is causal over positions, with an optional sliding window W
(query at position p sees keys in ``(p - W, p]``). All keys, the chunk's own included, are
read from the cache (the write op ran first), so a token's output does not depend on how
the prompt was chunked or whether the prefix came from the prefix cache.

The Triton kernel walks each span's block table itself: nothing is gathered into a dense
copy. One program owns a block of BLOCK_Q queries and one KV head, with the head's group of
query heads folded into the rows (M = BLOCK_Q * group), so each K/V tile is read once for
the whole group.
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
    check_index,
    check_query,
    check_seq_index,
    check_tile_block_size,
    fmt_code,
    kv_args,
    load_kv_tile,
    online_softmax_step,
    read_pages_torch,
    residual_kwargs,
)


def _check_prefill_args(
    *,
    q,
    fmt,
    cache,
    residual_k,
    residual_v,
    cu_seqlens_q,
    context_lens,
    block_tables,
    residual_slots,
    out,
) -> tuple[int, int, int]:
    bs, Hkv, D = check_cache(fmt, cache, residual_k, residual_v)
    check_query(q, out, num_kv_heads=Hkv, head_size=D, rows="T")
    S = context_lens.shape[0] if context_lens.dim() == 1 else -1
    check_index(cu_seqlens_q, "cu_seqlens_q", (S + 1,), (torch.int32, torch.int64))
    check_seq_index(
        fmt,
        num_seqs=S,
        block_tables=block_tables,
        context_lens=context_lens,
        residual_slots=residual_slots,
    )
    return bs, Hkv, D


# ---------------------------------------------------------------------------------------------
# torch twin


def paged_prefill_attention_torch(
    *,
    q: torch.Tensor,
    fmt: str,
    cache: dict[str, torch.Tensor],
    residual_k: torch.Tensor | None = None,
    residual_v: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    residual_slots: torch.Tensor | None = None,
    scale: float,
    sliding_window: int | None = None,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (T, Hq, D) -> (T, Hq, D) in q's dtype, computed in fp32; rows outside the spans are
    left as they are in ``out`` (zeros when out is None). ``max_query_len`` only matters to
    the Triton twin."""
    bs, Hkv, D = _check_prefill_args(
        q=q,
        fmt=fmt,
        cache=cache,
        residual_k=residual_k,
        residual_v=residual_v,
        cu_seqlens_q=cu_seqlens_q,
        context_lens=context_lens,
        block_tables=block_tables,
        residual_slots=residual_slots,
        out=out,
    )
    if out is None:
        out = torch.zeros_like(q)
    cu, ctxs = cu_seqlens_q.tolist(), context_lens.tolist()
    slots = residual_slots.tolist() if fmt in QUANT_FORMATS else [-1] * len(ctxs)
    for s, ctx in enumerate(ctxs):
        start, n = cu[s], cu[s + 1] - cu[s]
        if n == 0:
            continue
        pages = block_tables[s, : -(-ctx // bs)]
        k, v = read_pages_torch(fmt, cache, pages)  # (p, bs, Hkv, D) fp32
        if fmt in QUANT_FORMATS and ctx % bs and slots[s] >= 0:
            k[ctx // bs] = residual_k[slots[s]].float()
            v[ctx // bs] = residual_v[slots[s]].float()
        kpos = torch.arange(ctx, device=q.device)
        qpos = torch.arange(ctx - n, ctx, device=q.device)
        mask = kpos[None, :] <= qpos[:, None]  # (n, ctx)
        if sliding_window is not None:
            mask &= kpos[None, :] > qpos[:, None] - sliding_window
        o = F.scaled_dot_product_attention(
            q[start : start + n].float().transpose(0, 1),  # (Hq, n, D)
            k.view(-1, Hkv, D)[:ctx].transpose(0, 1),  # (Hkv, ctx, D)
            v.view(-1, Hkv, D)[:ctx].transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=q.shape[1] != Hkv,
        )  # (Hq, n, D)
        out[start : start + n] = o.transpose(0, 1).to(q.dtype)
    return out


# ---------------------------------------------------------------------------------------------
# Triton


@triton.jit
def _prefill_kernel(
    q_ptr, s_qt, s_qh,  # (T, Hq, D)
    out_ptr, s_ot, s_oh,  # (T, Hq, D)
    k_ptr, ks_ptr, kz_ptr, s_kp, s_kt, s_kh, s_ksp, s_kst, s_ksh, s_ksd,  # K views
    v_ptr, vs_ptr, vz_ptr, s_vp, s_vt, s_vh, s_vsp, s_vst, s_vsh, s_vsd,  # V views
    rk_ptr, rv_ptr, s_rkp, s_rkt, s_rkh, s_rvp, s_rvt, s_rvh,  # residual (R, BS, Hkv, D)
    bt_ptr, s_bts,  # (S, P) int64
    cu_ptr, ctx_ptr, rslot_ptr,  # (S + 1,), (S,), (S,) int64
    qk_scale, window, D,
    FMT: tl.constexpr, QUANT: tl.constexpr, K_DIV: tl.constexpr, V_DIV: tl.constexpr,
    BS: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0).to(tl.int64)
    qb = tl.program_id(1)
    hk = tl.program_id(2)
    q0 = tl.load(cu_ptr + s).to(tl.int64)
    qlen = (tl.load(cu_ptr + s + 1) - q0).to(tl.int32)
    M: tl.constexpr = BLOCK_Q * GP
    if qb * BLOCK_Q < qlen:
        ctx = tl.load(ctx_ptr + s).to(tl.int32)
        r = tl.arange(0, M)  # row = (query qi, head g of the group): qi-major
        qi = qb * BLOCK_Q + r // GP
        g = r % GP
        rmask = (qi < qlen) & (g < GROUP)
        heads = hk * GROUP + g
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        row_t = q0 + qi  # (M,) int64 token index
        q = tl.load(
            q_ptr + row_t[:, None] * s_qt + heads[:, None] * s_qh + d[None, :],
            mask=rmask[:, None] & dmask[None, :],
            other=0.0,
        )  # (M, BLOCK_D)
        qpos = ctx - qlen + qi  # (M,) absolute positions

        lo = ctx - qlen + qb * BLOCK_Q  # first query position of the block
        hi = tl.minimum(lo + BLOCK_Q, ctx)  # keys beyond the block's last query: causal-masked
        first = tl.maximum(lo - window + 1, 0) // BS
        last = tl.cdiv(hi, BS)
        if QUANT:
            pool_end = tl.minimum(last, ctx // BS)  # the partial page is in the residual
        else:
            pool_end = last
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, BLOCK_D], tl.float32)
        n = tl.arange(0, BS)
        for j in range(first, pool_end):
            page = tl.load(bt_ptr + s * s_bts + j)
            kT = load_kv_tile(
                k_ptr, ks_ptr, kz_ptr, page, hk, n[None, :], d[:, None], dmask[:, None],
                s_kp, s_kt, s_kh, s_ksp, s_kst, s_ksh, s_ksd, FMT, K_DIV,
            )  # fmt: skip  # (BLOCK_D, BS)
            vt = load_kv_tile(
                v_ptr, vs_ptr, vz_ptr, page, hk, n[:, None], d[None, :], dmask[None, :],
                s_vp, s_vt, s_vh, s_vsp, s_vst, s_vsh, s_vsd, FMT, V_DIV,
            )  # fmt: skip  # (BS, BLOCK_D)
            kpos = (j * BS + n)[None, :]
            valid = (kpos <= qpos[:, None]) & (kpos > qpos[:, None] - window)  # (M, BS)
            m_i, l_i, acc = online_softmax_step(q, kT, vt, valid, m_i, l_i, acc, qk_scale)
        if QUANT:
            tail = ctx // BS
            slot = tl.load(rslot_ptr + s)
            if (ctx % BS != 0) & (slot >= 0) & (tail >= first) & (tail < last):
                kT = load_kv_tile(
                    rk_ptr, rk_ptr, rk_ptr, slot, hk, n[None, :], d[:, None], dmask[:, None],
                    s_rkp, s_rkt, s_rkh, 0, 0, 0, 0, 0, 1,
                )  # fmt: skip
                vt = load_kv_tile(
                    rv_ptr, rv_ptr, rv_ptr, slot, hk, n[:, None], d[None, :], dmask[None, :],
                    s_rvp, s_rvt, s_rvh, 0, 0, 0, 0, 0, 1,
                )  # fmt: skip
                kpos = (tail * BS + n)[None, :]
                valid = (kpos <= qpos[:, None]) & (kpos > qpos[:, None] - window)
                m_i, l_i, acc = online_softmax_step(q, kT, vt, valid, m_i, l_i, acc, qk_scale)
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + row_t[:, None] * s_ot + heads[:, None] * s_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=rmask[:, None] & dmask[None, :],
        )


def paged_prefill_attention_triton(
    *,
    q: torch.Tensor,
    fmt: str,
    cache: dict[str, torch.Tensor],
    residual_k: torch.Tensor | None = None,
    residual_v: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    residual_slots: torch.Tensor | None = None,
    scale: float,
    sliding_window: int | None = None,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    block_m: int = 64,
) -> torch.Tensor:
    """``paged_prefill_attention_torch``'s Triton twin. Pass ``max_query_len`` (the longest
    span) to avoid a device sync; ``block_m`` is the target rows per program."""
    bs, Hkv, D = _check_prefill_args(
        q=q,
        fmt=fmt,
        cache=cache,
        residual_k=residual_k,
        residual_v=residual_v,
        cu_seqlens_q=cu_seqlens_q,
        context_lens=context_lens,
        block_tables=block_tables,
        residual_slots=residual_slots,
        out=out,
    )
    check_tile_block_size(bs)
    if block_m < 16:
        raise ValueError(f"block_m must be >= 16 (tl.dot's M), got {block_m}")
    if out is None:
        out = torch.zeros_like(q)
    S = context_lens.shape[0]
    if S == 0:
        return out
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_query_len == 0:
        return out
    group = q.shape[1] // Hkv
    gp = triton.next_power_of_2(group)
    block_q = max(1, block_m // gp)  # M = block_q * gp rows: >= 16 when block_m >= 16
    k_args, v_args = kv_args(fmt, cache, "k"), kv_args(fmt, cache, "v")
    _prefill_kernel[(S, triton.cdiv(max_query_len, block_q), Hkv)](
        q_ptr=q,
        s_qt=q.stride(0),
        s_qh=q.stride(1),
        out_ptr=out,
        s_ot=out.stride(0),
        s_oh=out.stride(1),
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
        s_bts=block_tables.stride(0),
        cu_ptr=cu_seqlens_q,
        ctx_ptr=context_lens,
        qk_scale=scale * math.log2(math.e),
        window=NO_WINDOW if sliding_window is None else int(sliding_window),
        D=D,
        FMT=fmt_code(fmt),
        QUANT=fmt in QUANT_FORMATS,
        K_DIV=k_args.scale_div,
        V_DIV=v_args.scale_div,
        BS=bs,
        BLOCK_D=max(16, triton.next_power_of_2(D)),
        GROUP=group,
        GP=gp,
        BLOCK_Q=block_q,
    )
    return out


def paged_prefill_attention(
    *,
    q: torch.Tensor,
    fmt: str,
    cache: dict[str, torch.Tensor],
    residual_k: torch.Tensor | None = None,
    residual_v: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    residual_slots: torch.Tensor | None = None,
    scale: float,
    sliding_window: int | None = None,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA, the torch twin elsewhere."""
    impl = paged_prefill_attention_triton if q.is_cuda else paged_prefill_attention_torch
    return impl(
        q=q,
        fmt=fmt,
        cache=cache,
        residual_k=residual_k,
        residual_v=residual_v,
        cu_seqlens_q=cu_seqlens_q,
        context_lens=context_lens,
        block_tables=block_tables,
        residual_slots=residual_slots,
        scale=scale,
        sliding_window=sliding_window,
        max_query_len=max_query_len,
        out=out,
    )
