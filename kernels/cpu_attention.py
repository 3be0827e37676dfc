"""Paged decode attention on CPU, in C (``cpu_attention.c``), without the gather copy.

The torch path gathers every page of every sequence (``index_select``) into a padded
(B, L, Hkv, D) copy, then runs SDPA over it: the KV is read, written and read again, and at
decode time that traffic is the step's largest cost after the weights. The C kernel reads
each K/V row once, in place, through the block table. ``kernels.cpu_native`` builds it.

Float formats (fp32, fp16, bf16 pages) are read as stored; quantized ones (fp8, int8,
int4, the byte layout of ``kernels.quant``) are read in place, with the pages that
``residual_slots`` names (the partial last page, or the last W pages, see
``kernels.paged_kv.residual_page_slots``) read from the fp32 residual instead: fp8 and
int8 pages (and int4 on scalar builds or head sizes off the vector width) are dequantized
a page at a time into a per-thread float scratch (small enough for L1 only for small
pages) with the twin's arithmetic; int4 on the AVX2/AVX-512 builds folds its scales into
q and the softmax weights instead of making a dequantized copy. Either way the result
equals the twin's within float rounding (checked at 2e-5), not bit for bit. q and the
result are fp32 inside. The torch twin is
``kernels.decode_attention.paged_decode_attention_torch``.
"""

from __future__ import annotations

import torch

from kvmesh.kernels.cpu_native import CpuLibrary, default_library
from kvmesh.kernels.page_format import FLOAT_FORMATS, QUANT_FORMATS
from kvmesh.kernels.paged_kv import (
    check_cache,
    check_index,
    residual_page_slots,
    rotation_block,
)

_SYMBOLS = {
    "fp32": "kvmesh_decode_attention_f32",
    "bf16": "kvmesh_decode_attention_bf16",
    "fp16": "kvmesh_decode_attention_f16",
}
_QUANT_CODES = {"fp8": 1, "int8": 2, "int4": 3}  # cpu_attention.c's QFMT_*
_QUANT_VIEWS = ("k", "k_scale", "k_zero", "v", "v_scale", "v_zero")


def supports(fmt: str, residual_dtype: torch.dtype | None = None) -> bool:
    """Whether the C kernel reads ``fmt`` pages (quantized ones with an fp32 residual)."""
    if fmt in _SYMBOLS:
        return True
    return fmt in _QUANT_CODES and residual_dtype in (None, torch.float32)


def paged_decode_attention_cpu(
    *,
    q: torch.Tensor,
    fmt: str,
    cache: dict[str, torch.Tensor],
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    library: CpuLibrary | None = None,
    residual_k: torch.Tensor | None = None,
    residual_v: torch.Tensor | None = None,
    residual_slots: torch.Tensor | None = None,
    out_rotation: int | None = None,
) -> torch.Tensor:
    """q (B, Hq, D) -> (B, Hq, D) in q's dtype, computed in fp32.

    Same contract as ``paged_decode_attention_torch``: the keys are the first
    ``context_lens[b]`` positions of sequence b's pages (the new token's own K/V already
    written), the last ``sliding_window`` of them if given; quantized formats read the
    pages ``residual_slots`` names from ``residual_k/v`` (fp32, (R, bs, Hkv, D)): (B,) the
    partial last page ``ctx // bs`` from slot ``residual_slots[b]``, or (B, W) page
    ``(ctx - 1) // bs - W + 1 + i`` from slot ``residual_slots[b, i]``, -1: from the pool.
    ``library``: a specific build, else the one ``cpu_native.build()`` loaded.
    ``out_rotation`` (quantized formats): a block size; the result is rotated as
    ``quant.hadamard_transform(result, out_rotation)`` would rotate it, in the same C call
    and bit for bit (int4 keeps V rotated: its attention output is turned back so).
    """
    if fmt in QUANT_FORMATS:
        return _quantized(
            q, fmt, cache, block_tables, context_lens, scale, sliding_window, out, library,
            residual_k, residual_v, residual_slots, out_rotation,
        )  # fmt: skip
    if out_rotation:
        raise ValueError(f"out_rotation is for quantized pages, not {fmt!r}")
    if fmt not in _SYMBOLS:
        formats = sorted(_SYMBOLS) + list(QUANT_FORMATS)
        raise ValueError(f"the CPU kernel reads formats {formats}, got {fmt!r}")
    bs, Hkv, D = check_cache(fmt, cache, None, None)
    if q.dim() != 3 or q.shape[2] != D or q.shape[1] % Hkv:
        raise ValueError(f"q must be (B, Hq, {D}) with Hq a multiple of {Hkv}, got {q.shape}")
    B, Hq, _ = q.shape
    check_index(block_tables, "block_tables", (B, None))
    check_index(context_lens, "context_lens", (B,))
    k, v = cache["k"], cache["v"]
    if k.stride()[1:] != (Hkv * D, D, 1) or v.stride() != k.stride():
        raise ValueError(f"K/V views must be dense within a page, got {k.stride()} {v.stride()}")
    if k.dtype != FLOAT_FORMATS[fmt]:
        raise ValueError(f"{fmt} cache must be {FLOAT_FORMATS[fmt]}, got {k.dtype}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if B and int(block_tables.shape[1]) * bs < int(context_lens.max()):
        raise ValueError("block_tables have fewer pages than context_lens need")
    qf = q.detach().to(torch.float32).contiguous()
    tables = block_tables.contiguous()
    lens = context_lens.contiguous()
    o = torch.empty((B, Hq, D), dtype=torch.float32)
    if B:
        fn = (library or default_library()).fn(_SYMBOLS[fmt])
        rc = fn(
            qf.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            tables.data_ptr(),
            lens.data_ptr(),
            o.data_ptr(),
            B,
            tables.shape[1],
            Hq,
            Hkv,
            D,
            bs,
            k.stride(0),
            float(scale),
            sliding_window or 0,
            torch.get_num_threads(),
        )
        if rc:
            raise MemoryError("the CPU attention kernel could not allocate its score buffer")
    o = o.to(q.dtype)
    if out is None:
        return o
    out.copy_(o)
    return out


class DecodeIndices:
    """One step's decode tables for the quantized kernel, checked and made contiguous once
    for every layer's ``QuantLayerDecoder.decode``: ``block_tables`` (B, P), ``context_lens``
    (B,), ``residual_slots`` as ``paged_decode_attention_cpu`` takes them; ``bs`` the block
    size, ``num_slots`` the residual's R (every layer's: one geometry)."""

    def __init__(self, block_tables, context_lens, residual_slots, *, bs: int, num_slots: int):
        B = context_lens.shape[0] if context_lens.dim() == 1 else -1
        check_index(block_tables, "block_tables", (B, None))
        check_index(context_lens, "context_lens", (B,))
        self.slots = residual_page_slots(
            residual_slots, context_lens, bs=bs, num_slots=num_slots
        )  # (B, W) contiguous
        if B and int(block_tables.shape[1]) * bs < int(context_lens.max()):
            raise ValueError("block_tables have fewer pages than context_lens need")
        self.tables, self.lens = block_tables.contiguous(), context_lens.contiguous()
        self.B, self.bs, self.num_slots = B, bs, num_slots


class QuantLayerDecoder:
    """The quantized half of ``paged_decode_attention_cpu`` for one layer's pool views and
    fp32 residual, checked once (the engine calls it every layer of every step); ``decode``
    checks only the query and the step's indices against the layer. The same C call."""

    def __init__(self, *, fmt, cache, residual_k, residual_v, library=None):
        if fmt not in _QUANT_CODES:
            raise ValueError(f"not a quantized format the CPU kernel reads: {fmt!r}")
        self.bs, self.Hkv, self.D = check_cache(fmt, cache, residual_k, residual_v)
        for name, r in (("residual_k", residual_k), ("residual_v", residual_v)):
            if r.dtype != torch.float32 or not r.is_contiguous():
                raise ValueError(
                    f"{name} must be contiguous float32 for the CPU kernel, got {r.dtype}"
                )
        # every component of the pool lies at the same byte stride from page to page
        stride = cache["k"].stride(0) * cache["k"].element_size()
        for name, t in cache.items():
            if t.stride(0) * t.element_size() != stride or not t[0].is_contiguous():
                raise ValueError(f"view {name!r} is not a dense component of a page-major pool")
        self.fmt, self.num_slots = fmt, residual_k.shape[0]
        self._ptr = [cache[n].data_ptr() if n in cache else None for n in _QUANT_VIEWS]
        self._res = (residual_k.data_ptr(), residual_v.data_ptr())
        self._stride = stride
        self._lib = library

    def decode(self, q, idx: DecodeIndices, scale, sliding_window=None, out=None, rotation=None):
        """``paged_decode_attention_cpu`` for this layer over the step's ``idx``."""
        Hkv, D, bs = self.Hkv, self.D, self.bs
        rot = rotation_block("out_rotation", rotation, D)
        if q.dim() != 3 or q.shape[2] != D or q.shape[1] % Hkv:
            raise ValueError(f"q must be (B, Hq, {D}) with Hq a multiple of {Hkv}, got {q.shape}")
        B, Hq, _ = q.shape
        if idx.B != B or idx.bs != bs or idx.num_slots != self.num_slots:
            raise ValueError(
                f"the step's tables are for {idx.B} sequences (block size {idx.bs}, "
                f"{idx.num_slots} residual slots), q for {B} (block size {bs}, "
                f"{self.num_slots} slots)"
            )
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        qf = q.detach().to(torch.float32).contiguous()
        o = out if _writable_in_place(out, (B, Hq, D), qf) else torch.empty((B, Hq, D))
        if B:
            tables, slots = idx.tables, idx.slots
            args = (
                _QUANT_CODES[self.fmt], qf.data_ptr(), *self._ptr, *self._res,
                tables.data_ptr(), idx.lens.data_ptr(), slots.data_ptr(), o.data_ptr(),
                B, tables.shape[1], slots.shape[1], Hq, Hkv, D, bs, self._stride, float(scale),
                sliding_window or 0, torch.get_num_threads(),
            )  # fmt: skip
            lib = self._lib or default_library()
            if rot:  # the output rotated in the same call
                rc = lib.fn("kvmesh_decode_attention_quant_rot")(*args, rot, 1.0 / rot**0.5)
            else:
                rc = lib.fn("kvmesh_decode_attention_quant")(*args)
            if rc == 1:
                raise MemoryError("the CPU attention kernel could not allocate its scratch")
            if rc == 3:
                raise ValueError(f"residual_slots must have W >= 1 columns, got {slots.shape[1]}")
            if rc:
                raise ValueError(
                    f"the CPU attention kernel rejected {self.fmt} pages with head_size {D}"
                )
        if o is out:
            return out
        o = o.to(q.dtype)
        if out is None:
            return o
        out.copy_(o)
        return out


def _writable_in_place(out, shape, src: torch.Tensor) -> bool:
    """Whether a kernel may write its float32 result straight into ``out``: contiguous, of
    ``shape``, on the CPU, and not overlapping the input ``src`` it reads meanwhile."""
    if out is None or out.dtype != torch.float32 or out.device.type != "cpu":
        return False
    if tuple(out.shape) != shape or not out.is_contiguous():
        return False
    a, b = out.data_ptr(), src.data_ptr()
    return a + out.numel() * 4 <= b or b + src.numel() * src.element_size() <= a


def _quantized(
    q, fmt, cache, block_tables, context_lens, scale, sliding_window, out, library,
    residual_k, residual_v, residual_slots, out_rotation=None,
) -> torch.Tensor:  # fmt: skip
    dec = QuantLayerDecoder(
        fmt=fmt, cache=cache, residual_k=residual_k, residual_v=residual_v, library=library
    )
    if q.dim() != 3 or q.shape[2] != dec.D or q.shape[1] % dec.Hkv:
        raise ValueError(
            f"q must be (B, Hq, {dec.D}) with Hq a multiple of {dec.Hkv}, got {q.shape}"
        )
    idx = DecodeIndices(
        block_tables, context_lens, residual_slots, bs=dec.bs, num_slots=dec.num_slots
    )
    return dec.decode(q, idx, scale, sliding_window, out, out_rotation)


def hadamard_cpu(x: torch.Tensor, block: int, library: CpuLibrary | None = None) -> torch.Tensor:
    """``kernels.quant.hadamard_transform`` in C, bit-equal: the int4 backend's rotation of V
    rows and of the attention output (two per layer and step). Inputs it does not take
    (not CPU float32, or a library without the C kernels loaded) go to the torch version."""
    from kvmesh.kernels.quant import hadamard_transform

    D = x.shape[-1] if x.dim() else 0
    if x.device.type != "cpu" or x.dtype != torch.float32 or not D or D % block:
        return hadamard_transform(x, block)
    if library is None:
        try:
            library = default_library()
        except RuntimeError:
            return hadamard_transform(x, block)
    src = x.detach().contiguous()
    out = torch.empty_like(src)
    rc = library.fn("kvmesh_hadamard_f32")(
        src.data_ptr(), out.data_ptr(), src.numel() // D, D, block, 1.0 / block**0.5,
        torch.get_num_threads(),
    )  # fmt: skip
    if rc:
        raise ValueError(f"Hadamard block {block} must be a power of two dividing {D}")
    return out


def dequantize_int4_pages_cpu(
    views: dict[str, torch.Tensor],
    pages: torch.Tensor,
    out_k: torch.Tensor,
    out_v: torch.Tensor,
    library: CpuLibrary | None = None,
) -> None:
    """``kernels.quant.dequantize_pages("int4", {n: t[pages]}, torch.float32)`` in C, bit for
    bit, written into ``out_k``/``out_v`` (each a contiguous float32 tensor of ``len(pages)
    * bs * H * D`` elements, e.g. the first rows of a larger buffer) with no gathered copy of
    the components. ``views``: one layer's int4 pool views (``LayerCache.views``)."""
    bs, H, D2 = views["k"].shape[1:]
    D = 2 * D2
    n = int(pages.numel())
    stride = views["k"].stride(0) * views["k"].element_size()
    for name, t in views.items():
        if t.stride(0) * t.element_size() != stride or not t[0].is_contiguous():
            raise ValueError(f"view {name!r} is not a dense component of a page-major pool")
    for name, o in (("out_k", out_k), ("out_v", out_v)):
        if o.dtype != torch.float32 or not o.is_contiguous() or o.numel() != n * bs * H * D:
            raise ValueError(f"{name} must be contiguous float32 of {n * bs * H * D} elements")
    if n and (int(pages.min()) < 0 or int(pages.max()) >= views["k"].shape[0]):
        raise ValueError(f"page ids must lie in [0, {views['k'].shape[0]})")
    ids = pages.to(torch.int64).contiguous()
    rc = (library or default_library()).fn("kvmesh_dequantize_int4_pages")(
        *(views[c].data_ptr() for c in _QUANT_VIEWS), stride, ids.data_ptr(), n, bs, H, D,
        out_k.data_ptr(), out_v.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc:
        raise ValueError(f"int4 pages need an even head_size divisible by its group, got {D}")


def _token_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """t (T, H, D) as the prefill kernel reads it, with its token row stride: each token's
    H x D values dense, tokens at least H x D apart. A slice of a wider row (q, k or v of the
    fused qkv output) passes as it is; anything else is copied. (A size-1 dimension's
    stride is never read.)"""
    T, H, D = t.shape
    dense = (D <= 1 or t.stride(2) == 1) and (H <= 1 or t.stride(1) == D)
    if not dense or (T > 1 and t.stride(0) < H * D):
        t = t.contiguous()
    return t, (t.stride(0) if T > 1 else H * D)


def _prefill_out(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Where a prefill kernel writes: ``out`` itself when it is contiguous, else a buffer
    copied into it after (``_prefill_done``)."""
    if out is not None and out.is_contiguous():
        o = out
    else:
        o = torch.empty(q.shape, dtype=torch.float32)
    if o.shape != q.shape or o.dtype != torch.float32:
        raise ValueError(f"out must be float32 {tuple(q.shape)}, got {o.dtype} {tuple(o.shape)}")
    return o


def _prefill_done(rc: int, o: torch.Tensor, out: torch.Tensor | None, rejected: str):
    if rc == 1:
        raise MemoryError("the CPU prefill attention kernel could not allocate its scratch")
    if rc:
        raise ValueError(rejected)
    if out is not None and o is not out:
        out.copy_(o)
        return out
    return o


def prefill_attention_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    library: CpuLibrary | None = None,
    block_q: int = 0,
    block_k: int = 0,
    force_scalar: bool = False,
) -> torch.Tensor:
    """Causal prefill attention in C (``kvmesh_prefill_attention_f32``), token-major:
    q (n, Hq, D), k/v (ctx, Hkv, D) float32 -> (n, Hq, D) float32; query t sits at position
    ``ctx - n + t`` and sees keys [0, that position]; query head g reads KV head g // (Hq //
    Hkv). The torch twin is ``F.scaled_dot_product_attention(q, k, v, is_causal=True,
    enable_gqa=True)`` on the (1, H, T, D) transposes when ctx == n (a bottom-right causal
    mask when ctx > n). Equal to it within float rounding (tests: 2e-5 absolute for unit
    normal inputs), not bit for bit: the blocks sum in another order and exp is a polynomial.
    ``block_q``/``block_k``: query tokens and keys per block (0: the kernel's defaults);
    ``force_scalar``: the plain loop even on a vector build. q, k and v are read in place
    when each token's heads are dense (strides (any, D, 1)), e.g. column slices of the fused
    qkv projection's output; other layouts are copied first."""
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(
            f"q must be (n, Hq, D) and k, v (ctx, Hkv, D), got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    n, Hq, D = q.shape
    ctx, Hkv, Dk = k.shape
    if Dk != D or Hq % Hkv:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)}: D differs or Hq % Hkv != 0")
    if ctx < n:
        raise ValueError(f"{n} queries need at least as many keys, got {ctx}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU float32 tensor, got {t.dtype} on {t.device}")
    (q, ldq), (k, ldk), (v, ldv) = _token_rows(q), _token_rows(k), _token_rows(v)
    o = _prefill_out(q, out)
    fn = (library or default_library()).fn("kvmesh_prefill_attention_f32")
    rc = fn(
        q.data_ptr(), ldq, k.data_ptr(), ldk, v.data_ptr(), ldv, o.data_ptr(), n, ctx, Hq,
        Hkv, D, float(scale), block_q, block_k, int(force_scalar), torch.get_num_threads(),
    )  # fmt: skip
    return _prefill_done(
        rc, o, out, f"the CPU prefill kernel rejected the shapes (block_k {block_k})"
    )


def prefill_attention_runs_cpu(
    q: torch.Tensor,
    run_a: tuple[torch.Tensor, torch.Tensor] | Int4Run,
    run_b: tuple[torch.Tensor, torch.Tensor],
    ranges: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    library: CpuLibrary | None = None,
    block_q: int = 0,
    block_k: int = 0,
    force_scalar: bool = False,
    a_rotation: int | None = None,
) -> torch.Tensor:
    """Prefill attention over two runs of keys in C (``kvmesh_prefill_attention_runs_f32``),
    token-major: q (n, Hq, D), ``run_a`` = (k, v) each (La, Hkv, D), ``run_b`` = (k, v) each
    (Lb, Hkv, D), all float32 -> (n, Hq, D) float32. ``ranges`` (n, 4) int64: query t reads
    run A's keys ``[ranges[t, 0], ranges[t, 1])`` and run B's ``[ranges[t, 2], ranges[t,
    3])`` (every query at least one key). One online softmax over both runs, each key read
    once; query head g reads KV head g // (Hq // Hkv). The twin is SDPA over ``cat(A, B)``
    with the bool mask the ranges make (``worker.attention.own_page``: the complete pages
    dequantized, then the exact pages), equal within float rounding. ``block_q``,
    ``block_k``, ``force_scalar`` as ``prefill_attention_cpu``.

    ``run_a`` may be an ``Int4Run`` instead: int4 pool pages, dequantized inside the kernel
    (``kvmesh_prefill_attention_runs_int4_f32``) to the bits ``dequantize_int4_pages_cpu``
    gives them, so the result equals this function's over those dequantized pages, bit for
    bit. q and run B's k and v are read in place where each token's heads are dense (views of
    the fused qkv output among them).

    ``a_rotation`` (a block size; int4 keeps V rotated): run A's V holds rows rotated as
    ``kernels.quant.hadamard_transform(v, a_rotation)`` leaves them and run B's V plain ones,
    and the output is plain: the result equals ``hadamard_transform`` of this function's
    output with run B's V rotated too, within float rounding. Each row's sum over run A is
    rotated back inside the kernel, so the caller rotates neither the chunk's V nor the
    output."""
    if q.dim() != 3:
        raise ValueError(f"q must be (n, Hq, D), got {tuple(q.shape)}")
    n, Hq, D = q.shape
    quant = isinstance(run_a, Int4Run)
    runs = [("run_b", *run_b)] if quant else [("run_a", *run_a), ("run_b", *run_b)]
    for name, k, v in runs:
        if k.dim() != 3 or v.shape != k.shape or k.shape[2] != D or Hq % max(k.shape[1], 1):
            raise ValueError(
                f"{name} must be (k, v), each (L, Hkv, {D}) with Hq {Hq} a multiple of Hkv, "
                f"got {tuple(k.shape)}, {tuple(v.shape)}"
            )
    kb, vb = run_b
    Hkv = kb.shape[1]
    tensors = [("q", q)]
    tensors += [(f"{name} {c}", t) for name, k, v in runs for c, t in (("k", k), ("v", v))]
    for name, t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU float32 tensor, got {t.dtype} on {t.device}")
    if ranges.shape != (n, 4) or ranges.dtype != torch.int64:
        raise ValueError(f"ranges must be ({n}, 4) int64, got {ranges.dtype} {tuple(ranges.shape)}")
    (q, ldq), (kb, ldkb), (vb, ldvb) = _token_rows(q), _token_rows(kb), _token_rows(vb)
    rot = rotation_block("a_rotation", a_rotation, D)
    rg = ranges.contiguous()
    o = _prefill_out(q, out)
    tail = (rg.data_ptr(), o.data_ptr(), n, Hq, Hkv, D, float(scale), block_q, block_k)
    tail += (rot, 1.0 / rot**0.5 if rot else 0.0, int(force_scalar), torch.get_num_threads())
    if quant:
        pool, ids, la = run_a.checked(Hkv, D)
        lib = library or default_library()
        rc = lib.fn("kvmesh_prefill_attention_runs_int4_f32")(
            q.data_ptr(), ldq, *pool.ptrs, pool.stride, ids.data_ptr(), ids.numel(),
            pool.num_pages, pool.bs, kb.data_ptr(), ldkb, vb.data_ptr(), ldvb, kb.shape[0],
            *tail,
        )  # fmt: skip
    else:
        (ka, ldka), (va, ldva) = _token_rows(run_a[0]), _token_rows(run_a[1])
        if ka.shape[1] != Hkv:
            raise ValueError(f"run_a has {ka.shape[1]} KV heads, run_b {Hkv}")
        la = ka.shape[0]
        lib = library or default_library()
        rc = lib.fn("kvmesh_prefill_attention_runs_f32")(
            q.data_ptr(), ldq, ka.data_ptr(), ldka, va.data_ptr(), ldva, la, kb.data_ptr(), ldkb,
            vb.data_ptr(), ldvb, kb.shape[0], *tail,
        )  # fmt: skip
    ids_named = f"page ids in [0, {pool.num_pages}) and " if quant else ""
    return _prefill_done(
        rc,
        o,
        out,
        f"{ids_named}ranges within the runs ({la} and {kb.shape[0]} keys) with every query "
        "reading at least one key are required",
    )


class Int4Pool:
    """One layer's int4 pool views (``LayerCache.views``), checked once: an ``Int4Run`` over
    it checks only its page ids (the views' checks cost ~45 us a call; the engine's backend
    keeps one pool per layer cache). ValueError names what is wrong with the views. The
    pool keeps the views' addresses: storage swapped in place under the same dict is not
    noticed (the backend makes a new pool when the cache holds a new views dict)."""

    def __init__(self, views: dict[str, torch.Tensor]):
        from kvmesh.kernels.quant import quant_components

        missing = [c for c in _QUANT_VIEWS if c not in views]
        if missing:
            raise ValueError(f"int4 run A needs the views {_QUANT_VIEWS}, missing {missing}")
        if views["k"].dim() != 4:
            raise ValueError(
                f"view 'k' must be (pages, bs, H, D / 2), got {tuple(views['k'].shape)}"
            )
        num_pages, bs, H, D2 = views["k"].shape
        stride = views["k"].stride(0) * views["k"].element_size()
        for c in quant_components("int4", bs, H, 2 * D2):  # a head size int4 cannot take: raises
            t = views[c.name]
            if t.dtype != c.dtype or tuple(t.shape) != (num_pages, *c.shape):
                raise ValueError(
                    f"view {c.name!r} must be {c.dtype} {(num_pages, *c.shape)}, "
                    f"got {t.dtype} {tuple(t.shape)}"
                )
            dense = t.stride(0) * t.element_size() == stride and t[0].is_contiguous()
            if t.device.type != "cpu" or not dense:
                raise ValueError(f"view {c.name!r} is not a dense component of a page-major pool")
        self.views = views
        self.num_pages, self.bs, self.H, self.D = num_pages, bs, H, 2 * D2
        self.stride = stride
        self.ptrs = tuple(views[c].data_ptr() for c in _QUANT_VIEWS)


class Int4Run:
    """Run A of ``prefill_attention_runs_cpu`` as int4 pool pages: ``views`` one layer's int4
    views (``LayerCache.views``) or an ``Int4Pool`` of them (checked once), ``pages`` the
    page ids in key order (each page's bs tokens are that many keys)."""

    def __init__(self, views: dict[str, torch.Tensor] | Int4Pool, pages: torch.Tensor):
        self.views, self.pages = views, pages

    def checked(self, Hkv: int, D: int) -> tuple[Int4Pool, torch.Tensor, int]:
        """(the pool, page ids as contiguous int64, keys), or ValueError naming what is wrong.
        Page ids out of range are rejected by the kernel (named by the caller)."""
        pool = self.views if isinstance(self.views, Int4Pool) else Int4Pool(self.views)
        if (pool.H, pool.D) != (Hkv, D):
            raise ValueError(f"int4 pages hold {pool.H} heads of {pool.D}, the chunk {Hkv} of {D}")
        if self.pages.is_floating_point() or self.pages.device.type != "cpu":
            raise ValueError(
                f"pages must be integer page ids on the CPU, got {self.pages.dtype} "
                f"on {self.pages.device}"
            )
        ids = self.pages if self.pages.dtype == torch.int64 else self.pages.to(torch.int64)
        if ids.dim() != 1:
            raise ValueError(f"pages must be one-dimensional, got {tuple(ids.shape)}")
        return pool, ids.contiguous(), ids.numel() * pool.bs
