"""Writing a step's new K/V into the paged cache (reshape-and-cache), every format.

Float formats store each new token at its slot (``page * bs + offset``). Quantized formats
quantize a page only when it is full:

1. every page that fills this step (``complete_pages``) is gathered in full precision from
   the residual (tokens of earlier steps) and from this step's tokens, as ``complete_src``
   says, quantized (``kernels.quant``) and written into the pool;
2. then this step's tokens whose page is still partial are stored into the residual.

Step 1 reads residual rows that step 2 may overwrite (a request's slot is reused for its
next page), so the order is part of the contract: two launches on one stream in the Triton
path, two statements in the torch one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvmesh.kernels import quant
from kvmesh.kernels.page_format import FLOAT_FORMATS
from kvmesh.kernels.paged_kv import (
    FMT_FP8,
    FMT_INT4,
    check_cache,
    check_index,
    check_new_kv,
    fmt_code,
    kv_args,
)
from kvmesh.kernels.quant import int4_v_group, pack_int4_tl, quantize_pages

# quant's constants as kernel constexprs (a jit function may only read constexpr globals)
FP8_MAX = tl.constexpr(quant.FP8_MAX)
INT8_MAX = tl.constexpr(quant.INT8_MAX)
INT4_MAX = tl.constexpr(quant.INT4_MAX)
CLIP_STEPS = tl.constexpr(quant.INT4_V_CLIP_STEPS)
MIN_SCALE = tl.constexpr(quant.MIN_SCALE)


def _check_write_args(
    *,
    fmt,
    k,
    v,
    cache,
    slot_mapping,
    residual_k,
    residual_v,
    residual_slots,
    complete_pages,
    complete_src,
) -> tuple[int, int, int]:
    bs, H, D = check_cache(fmt, cache, residual_k, residual_v)
    check_new_kv(k, v, H, D)
    T = k.shape[0]
    if fmt in FLOAT_FORMATS:
        check_index(slot_mapping, "slot_mapping", (T,))
        return bs, H, D
    check_index(residual_slots, "residual_slots", (T,))
    check_index(complete_pages, "complete_pages", (None,))
    check_index(complete_src, "complete_src", (complete_pages.shape[0], bs))
    return bs, H, D


# ---------------------------------------------------------------------------------------------
# torch twin


def write_kv_cache_torch(
    *,
    fmt: str,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: dict[str, torch.Tensor],
    slot_mapping: torch.Tensor | None = None,
    residual_k: torch.Tensor | None = None,
    residual_v: torch.Tensor | None = None,
    residual_slots: torch.Tensor | None = None,
    complete_pages: torch.Tensor | None = None,
    complete_src: torch.Tensor | None = None,
) -> None:
    """Store k, v (T, Hkv, D) into one layer's cache views (and residual); see the module doc.
    Negative slots (float formats) are skipped."""
    bs, H, D = _check_write_args(
        fmt=fmt,
        k=k,
        v=v,
        cache=cache,
        slot_mapping=slot_mapping,
        residual_k=residual_k,
        residual_v=residual_v,
        residual_slots=residual_slots,
        complete_pages=complete_pages,
        complete_src=complete_src,
    )
    if fmt in FLOAT_FORMATS:
        _store_rows_torch(k, v, cache["k"], cache["v"], slot_mapping, bs)
        return
    R = residual_k.shape[0]
    n = complete_pages.shape[0]
    if n:
        src = complete_src.reshape(-1)  # (n * bs,)
        from_res = src < R * bs
        pos_res, pos_new = from_res.nonzero().squeeze(1), (~from_res).nonzero().squeeze(1)
        rows, toks = src[pos_res], src[pos_new] - R * bs
        full = []
        for x, res in ((k, residual_k), (v, residual_v)):
            f = torch.empty((n * bs, H, D), dtype=res.dtype, device=k.device)
            f[pos_res] = res[rows // bs, rows % bs]
            f[pos_new] = x[toks].to(res.dtype)  # through the residual dtype, like a tail token
            full.append(f.view(n, bs, H, D))
        for name, t in quantize_pages(fmt, *full).items():
            cache[name][complete_pages] = t
    _store_rows_torch(k, v, residual_k, residual_v, residual_slots, bs)


def _store_rows_torch(k, v, dst_k, dst_v, slots: torch.Tensor, bs: int) -> None:
    keep = (slots >= 0).nonzero().squeeze(1)
    if keep.numel():
        s = slots[keep]
        dst_k[s // bs, s % bs] = k[keep].to(dst_k.dtype)
        dst_v[s // bs, s % bs] = v[keep].to(dst_v.dtype)


# ---------------------------------------------------------------------------------------------
# Triton


@triton.jit
def _store_rows_kernel(
    k_ptr, v_ptr, s_kt, s_kh, s_vt, s_vh,  # new tokens (T, H, D)
    slots_ptr,  # (T,) int64 page * BS + offset, < 0: skip
    dk_ptr, dv_ptr,  # destination (pages, BS, H, D): pool views or the residual
    s_dkp, s_dkt, s_dkh, s_dvp, s_dvt, s_dvh,
    D, BS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        page, off = slot // BS, slot % BS
        d = tl.arange(0, BLOCK_D)
        m = d < D
        xk = tl.load(k_ptr + t * s_kt + h * s_kh + d, mask=m)
        xv = tl.load(v_ptr + t * s_vt + h * s_vh + d, mask=m)
        dk = dk_ptr + page * s_dkp + off * s_dkt + h * s_dkh + d
        dv = dv_ptr + page * s_dvp + off * s_dvt + h * s_dvh + d
        tl.store(dk, xk.to(dk_ptr.dtype.element_ty), mask=m)
        tl.store(dv, xv.to(dv_ptr.dtype.element_ty), mask=m)


@triton.jit
def _load_src(x_ptr, s_xt, s_xh, r_ptr, s_rp, s_rt, s_rh, src, h, d, dmask, RROWS, BS):
    """Full-precision rows of a completing page: src (BS,) int64 sources, d a (1, W) dim
    tile -> (BS, W) fp32. A source < RROWS is residual row src (slot src // BS, offset
    src % BS), otherwise new token src - RROWS, rounded through the residual dtype."""
    from_res = (src < RROWS)[:, None]
    r_off = (src // BS) * s_rp + (src % BS) * s_rt + h * s_rh  # (BS,) int64
    t_off = (src - RROWS) * s_xt + h * s_xh
    xr = tl.load(r_ptr + r_off[:, None] + d, mask=dmask & from_res, other=0.0)
    xn = tl.load(x_ptr + t_off[:, None] + d, mask=dmask & ~from_res, other=0.0)
    xn = xn.to(r_ptr.dtype.element_ty)
    return tl.where(from_res, xr.to(tl.float32), xn.to(tl.float32))


@triton.jit
def _asym_params(mn, mx):
    """Group min/max (fp32) -> stored fp16 (scale, zero), as fp32. Twin of quant._asym_params."""
    zero = mn.to(tl.float16).to(tl.float32)
    scale = tl.maximum((mx - zero) / INT4_MAX, MIN_SCALE).to(tl.float16).to(tl.float32)
    return scale, zero


@triton.jit
def _int4_codes(x, scale, zero):
    return tl.minimum(tl.maximum(tl.floor((x - zero) / scale + 0.5), 0.0), INT4_MAX)


@triton.jit
def _round_to_e4m3(y):
    """y in [-448, 448] fp32 -> the nearest float8_e4m3fn value (ties to even), still fp32.

    The cast that follows is then exact, so the stored byte does not depend on how a
    backend rounds fp32 -> fp8 (Triton's interpreter does not carry a rounding overflow into
    the exponent: it turns 124 into 64). e4m3 has 3 mantissa bits and normal exponents down
    to -6; below that the step is a constant 2^-9."""
    a = tl.abs(y)
    e = (a.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased fp32 exponent
    e = tl.maximum(e, 127 - 6)
    ulp = ((e - 3) << 23).to(tl.float32, bitcast=True)  # 2^(e - 127 - 3)
    inv_ulp = ((257 - e) << 23).to(tl.float32, bitcast=True)  # its exact inverse
    t = a * inv_ulp  # exact: a power-of-two scaling, t < 16
    r = (t + 8388608.0) - 8388608.0  # round to an integer, ties to even (2^23 trick)
    return tl.where(y < 0, -r * ulp, r * ulp)


@triton.jit
def _quantize_side(
    x_ptr, s_xt, s_xh, r_ptr, s_rp, s_rt, s_rh, src, RROWS,  # where the rows come from
    page, h,  # where they go
    o_ptr, s_op, s_ot, s_oh,  # data (pages, BS, H, D or D/2)
    sc_ptr, zp_ptr, s_sp, s_st, s_sh, s_sd,  # scale/zero, strides as paged_kv.kv_args
    D, FMT: tl.constexpr, IS_KEY: tl.constexpr, BS: tl.constexpr, BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr, NUM_GROUPS: tl.constexpr, BLOCK_G2: tl.constexpr,
):  # fmt: skip
    """Quantize one completing page's K or V of head h and store it: quant.quantize_pages'
    twin, same formulas in the same order, so the bytes agree."""
    n = tl.arange(0, BS)[:, None]  # (BS, 1)
    o_base = page * s_op + h * s_oh
    s_base = page * s_sp + h * s_sh
    if FMT == FMT_INT4:
        if IS_KEY:  # per channel over the page's tokens; even and odd dims become one byte
            j = tl.arange(0, BLOCK_D // 2)[None, :]  # (1, D/2) byte index
            jm = j < D // 2
            xe = _load_src(x_ptr, s_xt, s_xh, r_ptr, s_rp, s_rt, s_rh, src, h, 2 * j, jm, RROWS, BS)
            xo = _load_src(
                x_ptr, s_xt, s_xh, r_ptr, s_rp, s_rt, s_rh, src, h, 2 * j + 1, jm, RROWS, BS
            )  # (BS, D/2) each
            se, ze = _asym_params(tl.min(xe, 0), tl.max(xe, 0))  # (D/2,)
            so, zo = _asym_params(tl.min(xo, 0), tl.max(xo, 0))
            qe = _int4_codes(xe, se[None, :], ze[None, :])
            qo = _int4_codes(xo, so[None, :], zo[None, :])
            tl.store(o_ptr + o_base + n * s_ot + j, pack_int4_tl(qe, qo), mask=jm)
            je = 2 * tl.arange(0, BLOCK_D // 2)
            jmask = je < D
            tl.store(sc_ptr + s_base + je * s_sd, se.to(tl.float16), mask=jmask)
            tl.store(sc_ptr + s_base + (je + 1) * s_sd, so.to(tl.float16), mask=jmask)
            tl.store(zp_ptr + s_base + je * s_sd, ze.to(tl.float16), mask=jmask)
            tl.store(zp_ptr + s_base + (je + 1) * s_sd, zo.to(tl.float16), mask=jmask)
        else:  # per token, one (scale, zero) per GROUP consecutive dims
            for g in tl.static_range(NUM_GROUPS):
                j = g * (GROUP // 2) + tl.arange(0, BLOCK_G2)[None, :]  # (1, G/2) byte index
                jm = tl.arange(0, BLOCK_G2)[None, :] < GROUP // 2
                xe = _load_src(
                    x_ptr, s_xt, s_xh, r_ptr, s_rp, s_rt, s_rh, src, h, 2 * j, jm, RROWS, BS
                )
                xo = _load_src(
                    x_ptr, s_xt, s_xh, r_ptr, s_rp, s_rt, s_rh, src, h, 2 * j + 1, jm, RROWS, BS
                )  # (BS, G/2) each
                mn = tl.minimum(
                    tl.min(tl.where(jm, xe, float("inf")), 1),
                    tl.min(tl.where(jm, xo, float("inf")), 1),
                )
                mx = tl.maximum(
                    tl.max(tl.where(jm, xe, float("-inf")), 1),
                    tl.max(tl.where(jm, xo, float("-inf")), 1),
                )
                # quant._quant_int4_v's clipping search, factor by factor in the same order
                mid = (mn + mx) * 0.5
                half = (mx - mn) * 0.5
                sc, zp = _asym_params(mn, mx)  # placeholders, replaced by the first factor
                qe = _int4_codes(xe, sc[:, None], zp[:, None])
                qo = _int4_codes(xo, sc[:, None], zp[:, None])
                best = tl.full((BS,), float("inf"), tl.float32)
                for c in tl.static_range(CLIP_STEPS):
                    alpha = (20 - c) / 20.0  # constexpr, used as fp32 like the twin's
                    cs, cz = _asym_params(mid - alpha * half, mid + alpha * half)
                    ce = _int4_codes(xe, cs[:, None], cz[:, None])
                    co = _int4_codes(xo, cs[:, None], cz[:, None])
                    de = (ce * cs[:, None] + cz[:, None]) - xe
                    do = (co * cs[:, None] + cz[:, None]) - xo
                    err = tl.sum(tl.where(jm, de * de + do * do, 0.0), 1)  # (BS,)
                    better = err < best
                    best = tl.where(better, err, best)
                    sc = tl.where(better, cs, sc)
                    zp = tl.where(better, cz, zp)
                    qe = tl.where(better[:, None], ce, qe)
                    qo = tl.where(better[:, None], co, qo)
                tl.store(o_ptr + o_base + n * s_ot + j, pack_int4_tl(qe, qo), mask=jm)
                soff = s_base + tl.arange(0, BS) * s_st + g * s_sd
                tl.store(sc_ptr + soff, sc.to(tl.float16))
                tl.store(zp_ptr + soff, zp.to(tl.float16))
    else:  # fp8 / int8: symmetric, one scale per (token, head)
        d = tl.arange(0, BLOCK_D)[None, :]
        dm = d < D
        x = _load_src(x_ptr, s_xt, s_xh, r_ptr, s_rp, s_rt, s_rh, src, h, d, dm, RROWS, BS)
        if FMT == FMT_FP8:
            qmax = FP8_MAX
        else:
            qmax = INT8_MAX
        sc = tl.maximum(tl.max(tl.abs(x), 1) / qmax, MIN_SCALE).to(tl.float16)  # (BS,)
        y = x / sc.to(tl.float32)[:, None]
        if FMT == FMT_FP8:
            q = _round_to_e4m3(tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)).to(tl.float8e4nv)
        else:
            q = tl.minimum(tl.maximum(tl.floor(y + 0.5), -INT8_MAX), INT8_MAX).to(tl.int8)
        tl.store(o_ptr + o_base + n * s_ot + d, q, mask=dm)
        tl.store(sc_ptr + s_base + tl.arange(0, BS) * s_st, sc)


@triton.jit
def _quantize_pages_kernel(
    k_ptr, v_ptr, s_kt, s_kh, s_vt, s_vh,  # new tokens (T, H, D)
    rk_ptr, rv_ptr, s_rkp, s_rkt, s_rkh, s_rvp, s_rvt, s_rvh,  # residual (R, BS, H, D)
    pages_ptr,  # (n,) int64 completing pages
    src_ptr, s_src,  # (n, BS) int64 sources
    ok_ptr, oks_ptr, okz_ptr, s_okp, s_okt, s_okh, s_oksp, s_okst, s_oksh, s_oksd,  # K out
    ov_ptr, ovs_ptr, ovz_ptr, s_ovp, s_ovt, s_ovh, s_ovsp, s_ovst, s_ovsh, s_ovsd,  # V out
    RROWS, D,
    FMT: tl.constexpr, BS: tl.constexpr, BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr, NUM_GROUPS: tl.constexpr, BLOCK_G2: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    page = tl.load(pages_ptr + i)
    src = tl.load(src_ptr + i * s_src + tl.arange(0, BS))  # (BS,) int64
    _quantize_side(
        x_ptr=k_ptr,
        s_xt=s_kt,
        s_xh=s_kh,
        r_ptr=rk_ptr,
        s_rp=s_rkp,
        s_rt=s_rkt,
        s_rh=s_rkh,
        src=src,
        RROWS=RROWS,
        page=page,
        h=h,
        o_ptr=ok_ptr,
        s_op=s_okp,
        s_ot=s_okt,
        s_oh=s_okh,
        sc_ptr=oks_ptr,
        zp_ptr=okz_ptr,
        s_sp=s_oksp,
        s_st=s_okst,
        s_sh=s_oksh,
        s_sd=s_oksd,
        D=D,
        FMT=FMT,
        IS_KEY=True,
        BS=BS,
        BLOCK_D=BLOCK_D,
        GROUP=GROUP,
        NUM_GROUPS=NUM_GROUPS,
        BLOCK_G2=BLOCK_G2,
    )
    _quantize_side(
        x_ptr=v_ptr,
        s_xt=s_vt,
        s_xh=s_vh,
        r_ptr=rv_ptr,
        s_rp=s_rvp,
        s_rt=s_rvt,
        s_rh=s_rvh,
        src=src,
        RROWS=RROWS,
        page=page,
        h=h,
        o_ptr=ov_ptr,
        s_op=s_ovp,
        s_ot=s_ovt,
        s_oh=s_ovh,
        sc_ptr=ovs_ptr,
        zp_ptr=ovz_ptr,
        s_sp=s_ovsp,
        s_st=s_ovst,
        s_sh=s_ovsh,
        s_sd=s_ovsd,
        D=D,
        FMT=FMT,
        IS_KEY=False,
        BS=BS,
        BLOCK_D=BLOCK_D,
        GROUP=GROUP,
        NUM_GROUPS=NUM_GROUPS,
        BLOCK_G2=BLOCK_G2,
    )


def _launch_store_rows(
    *,
    k: torch.Tensor,
    v: torch.Tensor,
    dst_k: torch.Tensor,
    dst_v: torch.Tensor,
    slots: torch.Tensor,
    bs: int,
    D: int,
) -> None:
    """k, v (T, H, D) into dst_k, dst_v (pages, bs, H, D) at ``slots`` (T,) int64."""
    T, H, _ = k.shape
    if T == 0:
        return
    _store_rows_kernel[(T, H)](
        k_ptr=k,
        v_ptr=v,
        s_kt=k.stride(0),
        s_kh=k.stride(1),
        s_vt=v.stride(0),
        s_vh=v.stride(1),
        slots_ptr=slots,
        dk_ptr=dst_k,
        dv_ptr=dst_v,
        s_dkp=dst_k.stride(0),
        s_dkt=dst_k.stride(1),
        s_dkh=dst_k.stride(2),
        s_dvp=dst_v.stride(0),
        s_dvt=dst_v.stride(1),
        s_dvh=dst_v.stride(2),
        D=D,
        BS=bs,
        BLOCK_D=triton.next_power_of_2(D),
    )


def write_kv_cache_triton(
    *,
    fmt: str,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: dict[str, torch.Tensor],
    slot_mapping: torch.Tensor | None = None,
    residual_k: torch.Tensor | None = None,
    residual_v: torch.Tensor | None = None,
    residual_slots: torch.Tensor | None = None,
    complete_pages: torch.Tensor | None = None,
    complete_src: torch.Tensor | None = None,
) -> None:
    """``write_kv_cache_torch``'s Triton twin: same arguments, same bytes."""
    bs, H, D = _check_write_args(
        fmt=fmt,
        k=k,
        v=v,
        cache=cache,
        slot_mapping=slot_mapping,
        residual_k=residual_k,
        residual_v=residual_v,
        residual_slots=residual_slots,
        complete_pages=complete_pages,
        complete_src=complete_src,
    )
    if fmt in FLOAT_FORMATS:
        _launch_store_rows(
            k=k, v=v, dst_k=cache["k"], dst_v=cache["v"], slots=slot_mapping, bs=bs, D=D
        )
        return
    n = complete_pages.shape[0]
    if n:
        group = int4_v_group(D)
        rk, rv = residual_k.stride(), residual_v.stride()
        _quantize_pages_kernel[(n, H)](
            k_ptr=k,
            v_ptr=v,
            s_kt=k.stride(0),
            s_kh=k.stride(1),
            s_vt=v.stride(0),
            s_vh=v.stride(1),
            rk_ptr=residual_k,
            rv_ptr=residual_v,
            s_rkp=rk[0],
            s_rkt=rk[1],
            s_rkh=rk[2],
            s_rvp=rv[0],
            s_rvt=rv[1],
            s_rvh=rv[2],
            pages_ptr=complete_pages,
            src_ptr=complete_src,
            s_src=complete_src.stride(0),
            **kv_args(fmt, cache, "k").kwargs("ok"),
            **kv_args(fmt, cache, "v").kwargs("ov"),
            RROWS=residual_k.shape[0] * bs,
            D=D,
            FMT=fmt_code(fmt),
            BS=bs,
            BLOCK_D=triton.next_power_of_2(D),
            GROUP=group,
            NUM_GROUPS=D // group,
            BLOCK_G2=triton.next_power_of_2(group // 2),
        )
    # after the pages: their sources may be the very residual rows this overwrites
    _launch_store_rows(
        k=k, v=v, dst_k=residual_k, dst_v=residual_v, slots=residual_slots, bs=bs, D=D
    )


def write_kv_cache(
    *,
    fmt: str,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: dict[str, torch.Tensor],
    slot_mapping: torch.Tensor | None = None,
    residual_k: torch.Tensor | None = None,
    residual_v: torch.Tensor | None = None,
    residual_slots: torch.Tensor | None = None,
    complete_pages: torch.Tensor | None = None,
    complete_src: torch.Tensor | None = None,
) -> None:
    """Dispatch: the Triton kernel on CUDA, the torch twin elsewhere."""
    impl = write_kv_cache_triton if k.is_cuda else write_kv_cache_torch
    impl(
        fmt=fmt,
        k=k,
        v=v,
        cache=cache,
        slot_mapping=slot_mapping,
        residual_k=residual_k,
        residual_v=residual_v,
        residual_slots=residual_slots,
        complete_pages=complete_pages,
        complete_src=complete_src,
    )
