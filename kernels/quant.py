"""Quantized KV page formats: their components, the torch quantizer, the one INT4 nibble helper.

Every quantized page is quantized once, when it is full (the tail page waits in a
full-precision residual buffer), so the quantizer always sees whole pages of ``bs`` tokens.

==========  ===========================================================================
format      components per page and layer (bs tokens, H kv heads, D head size)
==========  ===========================================================================
fp8         k (bs, H, D) float8_e4m3fn, k_scale (bs, H) fp16, v ..., v_scale ...
            symmetric, one scale per (token, head): scale = absmax / 448
int8        k (bs, H, D) int8, k_scale (bs, H) fp16, v ..., v_scale ...
            symmetric, one scale per (token, head): scale = absmax / 127
int4        k (bs, H, D/2) uint8, k_scale (H, D) fp16, k_zero (H, D) fp16,
            v (bs, H, D/2) uint8, v_scale (bs, H, D/32) fp16, v_zero (bs, H, D/32) fp16
            asymmetric x ~ q * scale + zero, q in [0, 15]; keys per channel (KIVI: the group
            is the page's bs tokens of one (head, dim)), values per token in groups of 32
            along the head dimension
==========  ===========================================================================

Rounding is ``floor(y + 0.5)`` (ties up) in every twin, so the torch and Triton quantizers
agree bit for bit. Scales are rounded to fp16 *before* dividing by them, and dequantization
uses the same stored fp16 values, so the error bound is stated in terms of the stored scale:
int8 ``|x - x'| <= scale / 2``; int4 ``<= 0.51 * scale + 2^-11 * |zero|`` (the fp16
rounding of zero and scale). Scales are at least ``2^-14`` (fp16's smallest normal), which
keeps an all-zero page (the null page) finite.

INT4 nibble order: along the last axis, byte ``j`` holds element ``2j`` in its low nibble and
element ``2j + 1`` in its high nibble. ``pack_int4``/``unpack_int4`` (torch) and
``pack_int4_tl``/``unpack_int4_tl`` (Triton) are the only code that knows this.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvmesh.kernels.page_format import QUANT_FORMATS, Component

SCALE_DTYPE = torch.float16
MIN_SCALE = 2.0**-14  # fp16's smallest normal: a scale never underflows, 0/0 never happens
FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127.0
INT4_MAX = 15.0
INT4_V_GROUP = 32  # values: one (scale, zero) per 32 consecutive head dims of one token


def int4_v_group(head_size: int) -> int:
    """The value group size along the head dimension (32, or D itself when D < 32)."""
    return min(INT4_V_GROUP, head_size)


def quant_components(fmt: str, bs: int, H: int, D: int) -> list[Component]:
    """The components of one page and layer, in storage order (K first, then V)."""
    if fmt == "fp8" or fmt == "int8":
        data = torch.float8_e4m3fn if fmt == "fp8" else torch.int8
        return [
            Component("k", data, (bs, H, D)),
            Component("k_scale", SCALE_DTYPE, (bs, H)),
            Component("v", data, (bs, H, D)),
            Component("v_scale", SCALE_DTYPE, (bs, H)),
        ]
    if fmt == "int4":
        g = int4_v_group(D)
        if D % 2 or D % g:
            raise ValueError(f"int4 needs an even head_size divisible by {g}, got {D}")
        return [
            Component("k", torch.uint8, (bs, H, D // 2)),
            Component("k_scale", SCALE_DTYPE, (H, D)),
            Component("k_zero", SCALE_DTYPE, (H, D)),
            Component("v", torch.uint8, (bs, H, D // 2)),
            Component("v_scale", SCALE_DTYPE, (bs, H, D // g)),
            Component("v_zero", SCALE_DTYPE, (bs, H, D // g)),
        ]
    raise ValueError(f"not a quantized cache format: {fmt!r}; accepted: {', '.join(QUANT_FORMATS)}")


# ---------------------------------------------------------------------------------------------
# INT4 nibbles: the one helper, torch and Triton twins


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(..., 2m) uint8 values in [0, 15] -> (..., m) uint8; element 2j low, 2j+1 high nibble."""
    if q.dtype != torch.uint8 or q.shape[-1] % 2:
        raise ValueError(f"pack_int4 needs uint8 with an even last dim, got {q.dtype} {q.shape}")
    return (q[..., 0::2] & 0xF) | ((q[..., 1::2] & 0xF) << 4)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """(..., m) uint8 -> (..., 2m) uint8 in [0, 15]: the inverse of ``pack_int4``."""
    if p.dtype != torch.uint8:
        raise ValueError(f"unpack_int4 needs uint8, got {p.dtype}")
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


@triton.jit
def pack_int4_tl(lo, hi):
    """Two tiles of int4 codes (elements 2j and 2j+1) -> one uint8 tile, ``pack_int4``'s twin."""
    return ((lo.to(tl.int32) & 0xF) | ((hi.to(tl.int32) & 0xF) << 4)).to(tl.uint8)


@triton.jit
def unpack_int4_tl(packed, d):
    """The int4 code of element ``d`` from its byte ``packed`` (loaded at offset ``d // 2``),
    as int32 in [0, 15]; ``d`` broadcasts against ``packed``. ``unpack_int4``'s twin."""
    return (packed.to(tl.int32) >> ((d % 2) * 4)) & 0xF


# ---------------------------------------------------------------------------------------------
# torch quantizer and dequantizer (the CPU engine path uses these directly)


def _round(y: torch.Tensor) -> torch.Tensor:
    return torch.floor(y + 0.5)  # ties up: the Triton twins use the same formula


def _sym_scale(x: torch.Tensor, qmax: float) -> torch.Tensor:
    """(..., D) fp32 -> (...) fp16 stored scale."""
    return (x.abs().amax(-1) / qmax).clamp_min(MIN_SCALE).to(SCALE_DTYPE)


def _asym_params(mn: torch.Tensor, mx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Group min/max (fp32) -> stored (scale, zero) fp16."""
    zero = mn.to(SCALE_DTYPE)
    scale = ((mx - zero.float()) / INT4_MAX).clamp_min(MIN_SCALE).to(SCALE_DTYPE)
    return scale, zero


def _quant_sym(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, bs, H, D) fp32 -> data (n, bs, H, D), scale (n, bs, H)."""
    qmax = FP8_MAX if fmt == "fp8" else INT8_MAX
    scale = _sym_scale(x, qmax)
    y = x / scale.float().unsqueeze(-1)
    if fmt == "fp8":
        return y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
    return _round(y).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


# int4 stores values rotated by a normalized Hadamard matrix along head_dim (QuaRot's idea,
# applied to V only): the rotation spreads a token's outlier channels over its group, so the
# per-token groups of 32 quantize with a finer step. Attention never needs V itself:
# softmax(QK^T) (V H) = (softmax(QK^T) V) H, so the backend rotates new V before writing it
# (pages and the residual alike) and rotates the attention output back (H H = I). Kernels
# and the page layout are unchanged. Keys are left alone: their per-channel scales already
# absorb outlier channels. What each choice measured: docs/formats.md.
INT4_V_ROTATION_FORMATS = ("int4",)


def value_rotation_block(fmt: str, head_size: int) -> int | None:
    """The Hadamard block size applied to V for ``fmt`` (None: no rotation): the largest power
    of two dividing head_size, so 64 for SmolLM2 and 128 for Llama 3."""
    if fmt not in INT4_V_ROTATION_FORMATS:
        return None
    return head_size & -head_size


def hadamard_transform(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` (..., D) times the normalized Hadamard matrix of size ``block`` applied to each of
    the D / block consecutive blocks of the last dim (block-diagonal). Self-inverse.

    A fast Walsh-Hadamard transform: log2(block) stages of elementwise butterflies, so the
    result is bitwise the same for any batch shape (a GEMM's accumulation order is not)."""
    D = x.shape[-1]
    if block < 1 or block & (block - 1) or D % block:
        raise ValueError(f"Hadamard block {block} must be a power of two dividing {D}")
    lead = x.shape[:-1]
    y = x.reshape(-1, D // block, block)
    h = 1
    while h < block:
        y = y.view(y.shape[0], D // block, block // (2 * h), 2, h)
        a, b = y[:, :, :, 0], y[:, :, :, 1]
        y = torch.stack((a + b, a - b), dim=3).view(-1, D // block, block)
        h *= 2
    return (y * (1.0 / block**0.5)).view(*lead, D)


def _quant_int4_k(k: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(n, bs, H, D) fp32 -> packed (n, bs, H, D/2), scale (n, H, D), zero (n, H, D)."""
    scale, zero = _asym_params(k.amin(1), k.amax(1))
    y = (k - zero.float().unsqueeze(1)) / scale.float().unsqueeze(1)
    q = _round(y).clamp(0, INT4_MAX).to(torch.uint8)
    return pack_int4(q), scale, zero


# Value groups shrink their [min, max] range about its middle by each of these factors and
# keep the one with the least squared error (the first, on a tie): clipping a group's rare
# extreme value buys a finer step for the other 31. Keys keep their full range: their
# outlier channels carry attention (measured: docs/formats.md).
INT4_V_CLIP_STEPS = 6  # factors (20 - i) / 20: 1.0, 0.95, ..., 0.75


def _int4_v_clip_factors() -> list[float]:
    return [(20 - i) / 20.0 for i in range(INT4_V_CLIP_STEPS)]


def _quant_int4_v(v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(n, bs, H, D) fp32 -> packed (n, bs, H, D/2), scale (n, bs, H, G), zero (n, bs, H, G)."""
    n, bs, H, D = v.shape
    g = int4_v_group(D)
    vg = v.view(n, bs, H, D // g, g)  # (n, bs, H, G, g)
    mn, mx = vg.amin(-1), vg.amax(-1)
    mid, half = (mn + mx) * 0.5, (mx - mn) * 0.5
    best = None
    for a in _int4_v_clip_factors():
        alpha = torch.tensor(a, dtype=torch.float32)
        sc, zp = _asym_params(mid - alpha * half, mid + alpha * half)
        s32, z32 = sc.float().unsqueeze(-1), zp.float().unsqueeze(-1)
        q = _round((vg - z32) / s32).clamp(0, INT4_MAX)
        err = ((q * s32 + z32) - vg).square().sum(-1)  # (n, bs, H, G)
        if best is None:
            best = [err, sc, zp, q]
            continue
        better = err < best[0]
        best[0] = torch.where(better, err, best[0])
        best[1] = torch.where(better, sc, best[1])
        best[2] = torch.where(better, zp, best[2])
        best[3] = torch.where(better.unsqueeze(-1), q, best[3])
    _, scale, zero, q = best
    return pack_int4(q.to(torch.uint8).view(n, bs, H, D)), scale, zero


def quantize_pages(fmt: str, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
    """Full pages k, v (n, bs, H, D) float -> components name -> (n, *shape), as stored."""
    if k.shape != v.shape or k.dim() != 4 or not k.is_floating_point():
        raise ValueError(f"expected float k, v (n, bs, H, D), got {k.shape} {k.dtype}, {v.shape}")
    k, v = k.float(), v.float()
    if fmt in ("fp8", "int8"):
        kq, ks = _quant_sym(k, fmt)
        vq, vs = _quant_sym(v, fmt)
        return {"k": kq, "k_scale": ks, "v": vq, "v_scale": vs}
    if fmt == "int4":
        _, _, _, D = k.shape
        quant_components(fmt, 1, 1, D)  # validates D
        kq, ks, kz = _quant_int4_k(k)
        vq, vs, vz = _quant_int4_v(v)
        return {"k": kq, "k_scale": ks, "k_zero": kz, "v": vq, "v_scale": vs, "v_zero": vz}
    raise ValueError(f"not a quantized cache format: {fmt!r}; accepted: {', '.join(QUANT_FORMATS)}")


def dequantize_k(fmt: str, comps: dict[str, torch.Tensor]) -> torch.Tensor:
    """K components (n, *shape) -> (n, bs, H, D) fp32."""
    if fmt in ("fp8", "int8"):
        return comps["k"].float() * comps["k_scale"].float().unsqueeze(-1)
    if fmt == "int4":
        q = unpack_int4(comps["k"]).float()  # (n, bs, H, D)
        return q * comps["k_scale"].float().unsqueeze(1) + comps["k_zero"].float().unsqueeze(1)
    raise ValueError(f"not a quantized cache format: {fmt!r}; accepted: {', '.join(QUANT_FORMATS)}")


def dequantize_v(fmt: str, comps: dict[str, torch.Tensor]) -> torch.Tensor:
    """V components (n, *shape) -> (n, bs, H, D) fp32."""
    if fmt in ("fp8", "int8"):
        return comps["v"].float() * comps["v_scale"].float().unsqueeze(-1)
    if fmt == "int4":
        q = unpack_int4(comps["v"]).float()  # (n, bs, H, D)
        n, bs, H, D = q.shape
        G = comps["v_scale"].shape[-1]
        qg = q.view(n, bs, H, G, D // G)
        s = comps["v_scale"].float().unsqueeze(-1)
        z = comps["v_zero"].float().unsqueeze(-1)
        return (qg * s + z).view(n, bs, H, D)
    raise ValueError(f"not a quantized cache format: {fmt!r}; accepted: {', '.join(QUANT_FORMATS)}")


def dequantize_pages(
    fmt: str, comps: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Components name -> (n, *shape) -> k, v (n, bs, H, D) in ``dtype``.

    Works on any page selection, e.g. ``{name: view[page_ids]}`` from ``PageLayout.views``."""
    return dequantize_k(fmt, comps).to(dtype), dequantize_v(fmt, comps).to(dtype)
