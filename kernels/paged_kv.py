"""Reading pages of the KV cache in any format: the torch gather and the Triton tile loader.

The attention kernels (decode_attention, prefill_attention) and their torch twins both read
the cache through this module, so a format's read side lives in one place.

A layer's cache is the dict of typed views from ``PageLayout.views``: ``name -> (num_pages,
*shape)``, strided (page stride = page_nbytes / itemsize). Quantized formats add the residual
``(R, bs, Hkv, D)``: full-precision pages of running requests. Float formats read every
page from the pool. Decode of a quantized format names, per sequence, the residual slots of
its last W pages (``residual_page_slots``): a page with a slot is read wholly from it, every
other page from the pool; the old 1-D form (one slot per sequence, read for the partial page
``ctx // bs`` when ``ctx % bs != 0``) is the W = 1 case.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvmesh.kernels.page_format import CACHE_FORMATS, FLOAT_FORMATS, QUANT_FORMATS
from kvmesh.kernels.quant import (
    dequantize_pages,
    int4_v_group,
    quant_components,
    unpack_int4_tl,
)

# the format as a kernel constexpr
FMT_FLOAT = tl.constexpr(0)
FMT_FP8 = tl.constexpr(1)
FMT_INT8 = tl.constexpr(2)
FMT_INT4 = tl.constexpr(3)
NO_WINDOW = 1 << 30  # a window no sequence reaches: the kernels take an int, never None
_FMT_CODES = {"fp32": 0, "fp16": 0, "bf16": 0, "fp8": 1, "int8": 2, "int4": 3}


def fmt_code(fmt: str) -> int:
    if fmt not in _FMT_CODES:
        raise ValueError(f"unknown cache format {fmt!r}; accepted: {', '.join(_FMT_CODES)}")
    return _FMT_CODES[fmt]


def check_cache(
    fmt: str,
    cache: dict[str, torch.Tensor],
    residual_k: torch.Tensor | None,
    residual_v: torch.Tensor | None,
) -> tuple[int, int, int]:
    """Validate one layer's views (and residual) against the format; -> (bs, Hkv, D)."""
    if fmt not in CACHE_FORMATS or fmt == "auto":
        raise ValueError(f"need a concrete cache format, got {fmt!r}")
    if "k" not in cache:
        raise ValueError(f"cache views lack 'k': got {sorted(cache)}")
    if fmt in FLOAT_FORMATS:
        num_pages, bs, H, D = cache["k"].shape
        spec = [("k", FLOAT_FORMATS[fmt], (bs, H, D)), ("v", FLOAT_FORMATS[fmt], (bs, H, D))]
    else:
        num_pages, bs, H = cache["k"].shape[:3]
        D = cache["k"].shape[3] * (2 if fmt == "int4" else 1)  # int4: two values a byte
        spec = [(c.name, c.dtype, c.shape) for c in quant_components(fmt, bs, H, D)]
    if sorted(cache) != sorted(n for n, _, _ in spec):
        raise ValueError(f"{fmt} cache needs views {[n for n, _, _ in spec]}, got {sorted(cache)}")
    for name, dtype, shape in spec:
        t = cache[name]
        if t.dtype != dtype or tuple(t.shape) != (num_pages, *shape):
            raise ValueError(
                f"{fmt} view {name!r} must be {dtype} (num_pages={num_pages}, *{shape}), "
                f"got {t.dtype} {tuple(t.shape)}"
            )
        if t.stride(-1) != 1:
            raise ValueError(f"view {name!r} needs a unit innermost stride, got {t.stride()}")
    if bs & (bs - 1):
        raise ValueError(f"block_size must be a power of two for the kernels, got {bs}")
    if fmt in QUANT_FORMATS:
        for name, r in (("residual_k", residual_k), ("residual_v", residual_v)):
            if r is None or r.dim() != 4 or tuple(r.shape[1:]) != (bs, H, D):
                got = None if r is None else tuple(r.shape)
                raise ValueError(f"{fmt} needs {name} (R, {bs}, {H}, {D}), got {got}")
            if not r.is_floating_point() or r.stride(-1) != 1:
                raise ValueError(f"{name} must be float with unit innermost stride")
    return bs, H, D


def check_new_kv(k: torch.Tensor, v: torch.Tensor, H: int, D: int) -> None:
    """Raise unless k, v are a step's new keys and values for a cache of H heads of size D:
    (T, H, D) each, one float dtype, unit innermost stride (the writers read rows in place)."""
    if k.shape != v.shape or k.dim() != 3 or tuple(k.shape[1:]) != (H, D):
        raise ValueError(f"k, v must be (T, {H}, {D}), got {tuple(k.shape)}, {tuple(v.shape)}")
    if not k.is_floating_point() or k.dtype != v.dtype:
        raise ValueError(f"k, v must share a float dtype, got {k.dtype}, {v.dtype}")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(f"k, v need a unit innermost stride, got {k.stride()}, {v.stride()}")


def check_index(
    t: torch.Tensor | None,
    name: str,
    shape: tuple[int | None, ...],
    dtypes: tuple[torch.dtype, ...] = (torch.int64,),
) -> None:
    """Raise naming ``name`` unless t is an index tensor of ``shape`` (None: any size)."""
    if t is None or t.dtype not in dtypes or t.dim() != len(shape):
        got = None if t is None else f"{t.dtype} {tuple(t.shape)}"
        names = "/".join(str(dt).removeprefix("torch.") for dt in dtypes)
        raise ValueError(f"{name} must be {names} of shape {shape}, got {got}")
    if any(want is not None and want != got for want, got in zip(shape, t.shape)):
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.numel() > 1 and t.stride(-1) != 1:  # the kernels step through the last axis by 1
        raise ValueError(f"{name} needs a unit innermost stride, got {t.stride()}")


def rotation_block(name: str, value: int | None, D: int) -> int:
    """A fused Hadamard rotation's block (``None``/0: no rotation) checked as the C kernels
    need it, a power of two dividing the head size; the error names the argument."""
    rot = int(value or 0)
    if rot < 0 or rot & (rot - 1) or (rot and D % rot):
        raise ValueError(f"{name} must be a power of two dividing {D}, got {value}")
    return rot


def check_tile_block_size(bs: int) -> None:
    """The attention kernels' K/V tile is one page: tl.dot on a GPU needs N = bs >= 16."""
    if bs < 16:
        raise ValueError(f"the Triton attention kernels need block_size >= 16, got {bs}")


def check_query(
    q: torch.Tensor, out: torch.Tensor | None, *, num_kv_heads: int, head_size: int, rows: str
) -> None:
    """An attention kernel's query and output: q (rows, Hq, D) with Hq a multiple of the KV
    heads, fp32/fp16/bf16, unit dim stride; ``out`` None or q's shape and dtype. ``rows``
    names q's first axis in the message (B: one token per sequence, T: tokens of spans)."""
    Hkv, D = num_kv_heads, head_size
    if q.dim() != 3 or q.shape[2] != D or q.shape[1] % Hkv:
        raise ValueError(
            f"q must be ({rows}, Hq, {D}) with Hq a multiple of {Hkv}, got {tuple(q.shape)}"
        )
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or q.stride(-1) != 1:
        raise ValueError(
            f"q must be fp32/fp16/bf16 with unit dim stride, got {q.dtype} strides {q.stride()}"
        )
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1):
        raise ValueError(
            f"out must be {q.dtype} {tuple(q.shape)} with unit dim stride, "
            f"got {out.dtype} {tuple(out.shape)} strides {out.stride()}"
        )


def check_seq_index(
    fmt: str,
    *,
    num_seqs: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    residual_slots: torch.Tensor | None,
    residual_pages: bool = False,
) -> None:
    """The per-sequence index tensors of an attention kernel: block_tables (S, P) int64,
    context_lens (S,) int32/int64 and, for quantized formats, residual_slots (S,) int64 (or,
    with ``residual_pages``, decode's (S,) or (S, W) form: ``residual_page_slots``)."""
    check_index(context_lens, "context_lens", (num_seqs,), (torch.int32, torch.int64))
    check_index(block_tables, "block_tables", (num_seqs, None))
    if fmt in QUANT_FORMATS:
        two_d = residual_pages and residual_slots is not None and residual_slots.dim() == 2
        check_index(residual_slots, "residual_slots", (num_seqs, None) if two_d else (num_seqs,))


def residual_page_slots(
    residual_slots: torch.Tensor | None,
    context_lens: torch.Tensor,
    *,
    bs: int,
    num_slots: int,
) -> torch.Tensor:
    """Decode's residual slots in their (B, W) int64 form, contiguous.

    Entry ``[b, i]`` is the residual slot (first axis of ``residual_k/v``) that holds page
    ``last_b - W + 1 + i`` of sequence b, ``last_b = (context_lens[b] - 1) // bs``: that page
    is read wholly from the slot (positions ``>= context_lens[b]`` masked as usual). A
    negative entry, or one naming a page index < 0, means the page is read from the pool.
    A (B,) tensor (the W = 1 form before the ring) names the slot of the partial page
    ``ctx // bs``, read only when ``ctx % bs != 0``: it becomes (B, 1), -1 where
    ``ctx % bs == 0``. None: no sequence has a residual page. ``num_slots``: R; an entry
    ``>= R`` is a ValueError (checked where the tensor is on the CPU, to keep a GPU step free
    of a host sync)."""
    B = context_lens.shape[0]
    if residual_slots is None:
        return torch.full((B, 1), -1, dtype=torch.int64, device=context_lens.device)
    two_d = residual_slots.dim() == 2
    check_index(residual_slots, "residual_slots", (B, None) if two_d else (B,))
    if two_d and residual_slots.shape[1] < 1:
        raise ValueError(f"residual_slots (B, W) needs W >= 1, got {tuple(residual_slots.shape)}")
    if residual_slots.device.type == "cpu" and residual_slots.numel():
        if int(residual_slots.max()) >= num_slots:
            raise ValueError(f"residual_slots name a slot >= {num_slots} (residual_k/v's R)")
    if two_d:
        return residual_slots.contiguous()
    tail = context_lens % bs != 0
    return torch.where(tail, residual_slots, -1)[:, None].contiguous()


class KVArgs(NamedTuple):
    """The kernel arguments of one layer's K or V: see ``kv_args``."""

    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    data_strides: tuple[int, int, int]  # page, token, head (the dim stride is 1)
    scale_strides: tuple[int, int, int, int]  # page, token, head, dim group; 0: absent dim
    scale_div: int  # dim index -> scale index divisor (int4 V: the group size)

    def kwargs(self, p: str) -> dict[str, torch.Tensor | int]:
        """The tensors and strides as a kernel's keyword arguments, named after prefix
        ``p``: ``{p}_ptr, {p}s_ptr, {p}z_ptr`` (data, scale, zero), ``s_{p}p, s_{p}t,
        s_{p}h`` (data strides) and ``s_{p}sp, s_{p}st, s_{p}sh, s_{p}sd`` (scale strides).
        Names, not positions: a kernel whose parameters are spelled otherwise fails to
        launch instead of reading a stride as a pointer."""
        sp, st, sh, sd = self.scale_strides
        return {
            f"{p}_ptr": self.data,
            f"{p}s_ptr": self.scale,
            f"{p}z_ptr": self.zero,
            f"s_{p}p": self.data_strides[0],
            f"s_{p}t": self.data_strides[1],
            f"s_{p}h": self.data_strides[2],
            f"s_{p}sp": sp,
            f"s_{p}st": st,
            f"s_{p}sh": sh,
            f"s_{p}sd": sd,
        }


def kv_args(fmt: str, cache: dict[str, torch.Tensor], which: str) -> KVArgs:
    """Kernel arguments for K or V (``which`` = "k" or "v"): data, scale and zero tensors,
    data strides (page, token, head), scale strides (page, token, head, dim) and the scale's
    divisor of the dim index. Absent dims get stride 0, absent tensors the data tensor."""
    data = cache[which]
    ds = (data.stride(0), data.stride(1), data.stride(2))
    if fmt in FLOAT_FORMATS:
        return KVArgs(data, data, data, ds, (0, 0, 0, 0), 1)
    scale = cache[f"{which}_scale"]
    if fmt in ("fp8", "int8"):  # (P, bs, H): one scale per (token, head)
        ss = (scale.stride(0), scale.stride(1), scale.stride(2), 0)
        return KVArgs(data, scale, scale, ds, ss, 1)
    zero = cache[f"{which}_zero"]
    if zero.stride() != scale.stride():
        raise ValueError(
            f"{which}_scale and {which}_zero views must share strides, "
            f"got {scale.stride()} and {zero.stride()}"
        )
    if which == "k":  # (P, H, D): per channel, shared by the page's tokens
        ss = (scale.stride(0), 0, scale.stride(1), scale.stride(2))
        return KVArgs(data, scale, zero, ds, ss, 1)
    D = data.shape[3] * 2  # (P, bs, H, G): per token, groups along D
    ss = (scale.stride(0), scale.stride(1), scale.stride(2), scale.stride(3))
    return KVArgs(data, scale, zero, ds, ss, int4_v_group(D))


def residual_kwargs(
    fmt: str,
    cache: dict[str, torch.Tensor],
    *,
    residual_k: torch.Tensor | None,
    residual_v: torch.Tensor | None,
    residual_slots: torch.Tensor | None,
    block_tables: torch.Tensor,
) -> dict[str, torch.Tensor | int]:
    """An attention kernel's residual arguments by name: ``rk_ptr, rv_ptr`` (R, bs, Hkv, D),
    their slot, token and head strides ``s_rkp .. s_rvh``, and ``rslot_ptr`` (S,) int64.

    Float formats have no residual and the kernels never read these (QUANT is off), but
    every pointer needs a tensor: the cache's K view and ``block_tables`` stand in."""
    if fmt not in QUANT_FORMATS:
        residual_k = residual_v = cache["k"]
        residual_slots = block_tables
    rk, rv = residual_k.stride(), residual_v.stride()
    return dict(
        rk_ptr=residual_k,
        rv_ptr=residual_v,
        s_rkp=rk[0],
        s_rkt=rk[1],
        s_rkh=rk[2],
        s_rvp=rv[0],
        s_rvt=rv[1],
        s_rvh=rv[2],
        rslot_ptr=residual_slots,
    )


# ---------------------------------------------------------------------------------------------
# torch


def read_pages_torch(
    fmt: str, cache: dict[str, torch.Tensor], pages: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``pages`` (n,) int64 as (n, bs, Hkv, D) fp32."""
    if fmt in FLOAT_FORMATS:
        return cache["k"].index_select(0, pages).float(), cache["v"].index_select(0, pages).float()
    comps = {name: t.index_select(0, pages) for name, t in cache.items()}
    return dequantize_pages(fmt, comps, torch.float32)


def gather_kv_torch(
    *,
    fmt: str,
    cache: dict[str, torch.Tensor],
    residual_k: torch.Tensor | None,
    residual_v: torch.Tensor | None,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    residual_slots: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense K and V of each sequence: block_tables (B, P) -> (B, P * bs, Hkv, D) fp32.

    Quantized formats take each page that ``residual_slots`` ((B,) or (B, W), see
    ``residual_page_slots``) names from its residual slot instead of the pool. Positions
    ``>= context_lens`` hold whatever their page holds (the null page's zeros for padding):
    callers mask them."""
    B, P = block_tables.shape
    k, v = read_pages_torch(fmt, cache, block_tables.reshape(-1))  # (B * P, bs, Hkv, D)
    _, bs, H, D = k.shape
    k, v = k.view(B, P, bs, H, D), v.view(B, P, bs, H, D)
    if fmt in QUANT_FORMATS and residual_slots is not None:
        slots = residual_page_slots(
            residual_slots, context_lens, bs=bs, num_slots=residual_k.shape[0]
        )  # (B, W)
        W = slots.shape[1]
        last = (context_lens.to(torch.int64) - 1).div(bs, rounding_mode="floor")  # (B,)
        page = last[:, None] - (W - 1) + torch.arange(W, device=slots.device)  # (B, W)
        rows, cols = ((slots >= 0) & (page >= 0)).nonzero(as_tuple=True)
        if rows.numel():
            pages, named = page[rows, cols], slots[rows, cols]
            k[rows, pages] = residual_k[named].float()
            v[rows, pages] = residual_v[named].float()
    return k.view(B, P * bs, H, D), v.view(B, P * bs, H, D)


# ---------------------------------------------------------------------------------------------
# Triton


@triton.jit
def load_kv_tile(
    data_ptr,
    scale_ptr,
    zero_ptr,
    page,  # int64 scalar: a pool page id, or a residual slot when FMT is FMT_FLOAT
    head,
    n,  # int tile of token offsets in the page, broadcastable against d
    d,  # int tile of head-dim indices
    mask,
    s_dp,
    s_dt,
    s_dh,  # data strides: page, token, head (the dim stride is 1)
    s_sp,
    s_st,
    s_sh,
    s_sd,  # scale/zero strides: page, token, head, dim group (0 where the dim is absent)
    FMT: tl.constexpr,
    SCALE_DIV: tl.constexpr,  # dim index -> scale index divisor (int4 V: the group size)
):
    """One page's K or V values at (n, d), dequantized to fp32; the shape of ``n + d``.

    Passing n as a column and d as a row gives a (tokens, D) tile; the other way round gives
    the transposed (D, tokens) tile K^T that ``q @ K^T`` wants, without a transpose."""
    base = page.to(tl.int64) * s_dp + head.to(tl.int64) * s_dh
    if FMT == FMT_INT4:
        raw = tl.load(data_ptr + base + n * s_dt + d // 2, mask=mask, other=0)
        q = unpack_int4_tl(raw, d).to(tl.float32)
        soff = page.to(tl.int64) * s_sp + head.to(tl.int64) * s_sh + n * s_st
        soff += (d // SCALE_DIV) * s_sd
        s = tl.load(scale_ptr + soff, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(zero_ptr + soff, mask=mask, other=0.0).to(tl.float32)
        x = q * s + z
    else:
        # no `other=`: it cannot be cast to fp8 everywhere; masked lanes are zeroed instead
        x = tl.where(mask, tl.load(data_ptr + base + n * s_dt + d, mask=mask).to(tl.float32), 0.0)
        if FMT != FMT_FLOAT:
            soff = page.to(tl.int64) * s_sp + head.to(tl.int64) * s_sh + n * s_st + d * s_sd
            x = x * tl.load(scale_ptr + soff, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def online_softmax_step(q, kT, v, valid, m_i, l_i, acc, qk_scale):
    """One K/V tile of flash attention, in base 2.

    q (M, Dp) in the compute dtype; kT (Dp, N) and v (N, Dp) fp32 tiles; valid (M, N);
    m_i, l_i (M,) running max (log2 units) and normaliser; acc (M, Dp) fp32.
    ``qk_scale`` = softmax scale * log2(e). Rows with no valid key so far keep m_i = -inf."""
    qk = tl.dot(q, kT.to(q.dtype)) * qk_scale  # (M, N)
    qk = tl.where(valid, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no NaN from (-inf) - (-inf)
    p = tl.exp2(qk - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
    return m_new, l_i, acc
