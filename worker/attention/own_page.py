"""Prefill over a quantized cache reads each query's recent pages exact, as decode does.

A quantized page is quantized when it fills, and its tokens also stay in the request's
full-precision residual ring while the page is among the request's last W pages
(``LayerCache.residual_pages``). So in decode a query at position ``p`` reads the pages
``page(p) - W + 1 .. page(p)`` (its own page up to ``p``, and the W - 1 pages before it)
exact and every earlier page quantized. Pages the request did not compute itself (a
restored prefix: before ``span.ring_from``) have no full-precision copy and are read
quantized.

Prefill gives every query of a chunk that same view: its window of W pages exact (the
tokens of earlier steps from the request's ring as it was before this step's write, the
chunk's own tokens from the step's K/V), the pages before the window quantized (read from
the pool). A token's attention output then does not depend on how its prompt was chunked,
nor on whether it was prefilled or decoded (up to float rounding), and the chunk's
queries do not read their neighbourhood through the quantizer (issue 23: the own page
exact roughly halved KL(fp32 || int4) on SmolLM2-135M, and the page before it as well
took another third off).

Keys are two runs: ``Lq`` quantized positions ``[0, Lq)`` (the pages some query of the
chunk reads quantized), then the exact pages, positions ``[E0, E0 + Lx)`` where ``E0``
starts the first query's window. ``own_page_mask`` says which of the ``Lq + Lx`` keys each
query reads.
"""

from __future__ import annotations

import torch

from kvmesh.worker.attention.base import PrefillSpan, residual_page

OWN_PAGE_QUERY_BLOCK = 256  # query rows per SDPA call in own_page_attention


def _window_start(page: torch.Tensor | int, span: PrefillSpan):
    """The first page a query on ``page`` reads exact: W - 1 pages back, not before the
    first page the request computed itself."""
    w = page - span.residual_pages + 1
    if isinstance(w, int):
        return max(w, span.ring_from, 0)
    return w.clamp(min=max(span.ring_from, 0))


def own_page_geometry(span: PrefillSpan, block_size: int) -> tuple[int, int, int]:
    """``(Lq, E0, Lx)``: quantized keys ``[0, Lq)``, exact keys ``[E0, E0 + Lx)`` (whole
    pages: positions from ``context_len`` on are masked)."""
    bs, ctx = block_size, span.context_len
    e0 = _window_start((ctx - span.q_len) // bs, span) * bs
    lq = min(_window_start((ctx - 1) // bs, span), ctx // bs) * bs  # read quantized by some
    return lq, e0, -(-ctx // bs) * bs - e0


def own_page_mask(
    span: PrefillSpan, block_size: int, device: torch.device, sliding_window: int | None = None
) -> torch.Tensor:
    """(q_len, Lq + Lx) bool: query ``p`` reads quantized key ``j`` when j's page is before
    p's window, and exact key ``j`` when ``j <= p`` and j's page is in the window."""
    bs = block_size
    lq, e0, lx = own_page_geometry(span, bs)
    qpos = torch.arange(span.context_len - span.q_len, span.context_len, device=device)[:, None]
    first = _window_start(qpos // bs, span)  # (q_len, 1): the window's first page
    kq = torch.arange(lq, device=device)[None, :]
    kx = torch.arange(e0, e0 + lx, device=device)[None, :]
    mq = kq // bs < first
    mx = (kx <= qpos) & (kx // bs >= first)
    if sliding_window is not None:
        mq &= kq > qpos - sliding_window
        mx &= kx > qpos - sliding_window
    return torch.cat([mq, mx], dim=1)


def own_page_ranges(
    span: PrefillSpan, block_size: int, sliding_window: int | None = None
) -> torch.Tensor:
    """``own_page_mask`` as ranges, for the C kernel that reads the two runs of keys
    (``kernels.cpu_attention.prefill_attention_runs_cpu``): (q_len, 4) int64 CPU, query
    ``p`` reads quantized keys ``[r0, r1)`` (positions ``[0, E(p))``, ``E(p)`` its window's
    first position) and exact keys ``[r2, r3)`` (positions ``[E(p), p]``, indices from E0);
    both cut to the last ``sliding_window`` positions where set."""
    bs = block_size
    lq, e0, _ = own_page_geometry(span, bs)
    p = torch.arange(span.context_len - span.q_len, span.context_len)  # (q_len,)
    first = (_window_start(p // bs, span) * bs).clamp(max=lq)  # E(p): <= Lq
    lo = torch.zeros_like(p) if sliding_window is None else (p - sliding_window + 1).clamp(min=0)
    a0 = lo.clamp(max=first)
    b0 = torch.maximum(first, lo) - e0
    return torch.stack([a0, first, b0, p + 1 - e0], dim=1)


def exact_own_pages(
    span: PrefillSpan,
    k: torch.Tensor,
    v: torch.Tensor,
    residual_k: torch.Tensor,
    residual_v: torch.Tensor,
    block_size: int,
    plain_v: int | None = None,
    native: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact keys' K/V, ``(Lx, Hkv, D)`` each in the residual's dtype: the tokens from
    ``E0`` up to the chunk from the request's ring (``span.request_slot``; call this before
    the step's write, which may reuse the ring's pages), then the chunk's tokens
    ``k/v[start:start + q_len]`` (V as stored: rotated where the format rotates it), zeros
    after ``context_len``. On CPU, a chunk that is all of them (nothing from the ring, whole
    pages) gets views of k and v themselves, not a copy into a new pair (the runs kernel
    reads them in place, token rows apart).

    ``plain_v`` (int4's rotation block): v is the chunk's plain V, not rotated, and the
    ring's rows (stored rotated) are turned back, so every exact row is plain (the C kernel
    that turns run A's sums back, ``own_page_attention(a_rotation=...)``). ``native``: fp32
    on the CPU, the rows are gathered by one C call (``kvmesh_exact_rows_f32``, the same
    bits) where the C kernels are built."""
    bs = block_size
    _, e0, lx = own_page_geometry(span, bs)
    head = span.context_len - span.q_len - e0  # earlier tokens, in the ring
    s, n = span.start, span.q_len
    if head and span.request_slot < 0:
        raise AssertionError("a chunk reading earlier exact pages has no residual slot")
    if not head and lx == n and k.dtype == residual_k.dtype and k.device.type == "cpu":
        return k[s : s + n], v[s : s + n]  # a fresh chunk of whole pages: views
    ring = [
        residual_page(span.request_slot, j, span.residual_pages)
        for j in range(e0 // bs, -(-(e0 + head) // bs))
    ]
    ring_idx = torch.tensor(ring, dtype=torch.int64, device=residual_k.device)
    if native:
        got = _exact_rows_in_c(k[s : s + n], v[s : s + n], residual_k, residual_v, ring_idx,
                               head, lx, plain_v)  # fmt: skip
        if got is not None:
            return got
    out = []
    for i, (new, res) in enumerate(((k, residual_k), (v, residual_v))):
        # each row written once: the ring's pages (whole: their rows from ``head`` on are
        # overwritten, a partial page's are not its tokens yet), the chunk, zeros after it
        x = res.new_empty((lx, *res.shape[2:]))
        if head:
            torch.index_select(res, 0, ring_idx, out=x[: len(ring) * bs].view(-1, *res.shape[1:]))
        x[head : head + n] = new[s : s + n]
        x[head + n :] = 0
        if head and plain_v and i == 1:  # the ring's rotated V rows turned back (self-inverse)
            x[:head] = _hadamard(x[:head], plain_v)
        out.append(x)
    return out[0], out[1]


def own_page_attention(
    q: torch.Tensor,
    exact: tuple[torch.Tensor, torch.Tensor],
    cache,
    span: PrefillSpan,
    mask: torch.Tensor | None,
    scale: float,
    block_size: int,
    native: bool = False,
    ranges: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    a_rotation: int | None = None,
    int4_pool=None,
) -> torch.Tensor:
    """A chunk's attention over a quantized cache (``cache`` a ``LayerCache``, after the
    step's write): ``q`` (q_len, Hq, D), ``exact`` from ``exact_own_pages``, ``mask`` from
    ``own_page_mask``; returns (q_len, Hq, D) in q's dtype (V as stored: still rotated,
    unless ``a_rotation`` is given), in ``out`` if given. ``native``: int4 pages may be
    read by the C kernels (the ``cpu`` backend); the torch reference backend and the
    Triton one leave it off and read them in torch. ``ranges`` (from ``own_page_ranges``;
    CPU float32 only): the C kernel reads the dequantized pages and the exact ones where
    they lie, each query its two ranges, in one pass
    (``kernels.cpu_attention.prefill_attention_runs_cpu``) instead of SDPA under ``mask``
    over their concatenation (then ``mask`` may be None); with ``native``, int4 pages are
    read from the pool and dequantized inside that kernel, to the same bits.
    ``a_rotation`` (int4's rotation block; only where ``one_pass_int4`` holds): ``exact``
    holds plain V (``exact_own_pages(plain_v=...)``) and the output is plain: the kernel
    turns the sums over the quantized pages back itself. ``int4_pool``: ``cache.views`` as a
    ``kernels.cpu_attention.Int4Pool``, checked once (the backend keeps one per layer)."""
    import torch.nn.functional as F

    from kvmesh.kernels.quant import dequantize_pages

    lq, _, _ = own_page_geometry(span, block_size)
    pages = span.block_table[: lq // block_size]  # those some query reads quantized
    xk, xv = exact
    H, D = xk.shape[1:]
    one_pass = ranges is not None
    if one_pass_int4(cache, q, native, ranges):
        from kvmesh.kernels.cpu_attention import Int4Run, prefill_attention_runs_cpu

        # int4 pages dequantized inside the kernel: no float copy of them
        run_a = Int4Run(cache.views if int4_pool is None else int4_pool, pages)
        return prefill_attention_runs_cpu(
            q, run_a, (xk, xv), ranges, scale, out=out, a_rotation=a_rotation
        )
    if a_rotation:
        raise ValueError("a_rotation needs the one-pass C kernel over int4 pages")
    # the complete pages, then (for SDPA) the exact ones
    kk = q.new_empty((lq + (0 if one_pass else xk.shape[0]), H, D))
    vv = torch.empty_like(kk)
    if not (native and _dequantize_in_c(cache, pages, q, kk[:lq], vv[:lq])):
        comps = {name: t.index_select(0, pages) for name, t in cache.views.items()}
        kq, vq = dequantize_pages(cache.cache_format, comps, q.dtype)  # (nq, bs, Hkv, D)
        kk[:lq] = kq.reshape(-1, H, D)
        vv[:lq] = vq.reshape(-1, H, D)
    if one_pass:
        from kvmesh.kernels.cpu_attention import prefill_attention_runs_cpu

        return prefill_attention_runs_cpu(q, (kk, vv), (xk, xv), ranges, scale, out=out)
    kk[lq:] = xk
    vv[lq:] = xv
    kk, vv = kk.transpose(0, 1), vv.transpose(0, 1)  # (Hkv, L, D)
    qq = q.transpose(0, 1).unsqueeze(0)  # (1, Hq, n, D)
    o = torch.empty_like(qq)
    # in blocks of queries: a masked SDPA may run the math kernel, whose scores are
    # (Hq, rows, L): a whole long chunk against a long context at once is gigabytes
    for i in range(0, qq.shape[2], OWN_PAGE_QUERY_BLOCK):
        j = i + OWN_PAGE_QUERY_BLOCK
        o[:, :, i:j] = F.scaled_dot_product_attention(
            qq[:, :, i:j],
            kk.unsqueeze(0),
            vv.unsqueeze(0),
            attn_mask=mask[i:j],
            scale=scale,
            enable_gqa=q.shape[1] != H,
        )
    if out is None:
        return o[0].transpose(0, 1)
    out.copy_(o[0].transpose(0, 1))
    return out


def _exact_rows_in_c(k, v, residual_k, residual_v, ring_idx, head: int, lx: int, rot):
    """``exact_own_pages``' rows by ``kvmesh_exact_rows_f32``, or None where it does not apply
    (not CPU float32 with dense token rows and a dense ring, a residual of other heads or
    head size than k's, or no C kernels): the torch gather then runs."""
    from kvmesh.kernels.cpu_native import CpuKernelError, default_library

    ts = (k, v, residual_k, residual_v)
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in ts):
        return None
    if not (residual_k.is_contiguous() and residual_v.is_contiguous()):
        return None
    n, H, D = k.shape
    if v.shape != k.shape or residual_k.dim() != 4 or residual_v.shape != residual_k.shape:
        return None  # the torch gather names the mismatch
    if tuple(residual_k.shape[2:]) != (H, D):
        return None
    for t in (k, v):
        if n and (not t[0].is_contiguous() or (n > 1 and t.stride(0) < H * D)):
            return None
    try:
        lib = default_library()
    except CpuKernelError:
        return None
    out = residual_k.new_empty((2, lx, H, D))
    bs = residual_k.shape[1]
    rot = int(rot or 0)
    rc = lib.fn("kvmesh_exact_rows_f32")(
        residual_k.data_ptr(), residual_v.data_ptr(), residual_k.shape[0], ring_idx.data_ptr(),
        ring_idx.numel(), bs, k.data_ptr(), k.stride(0) if n > 1 else H * D, v.data_ptr(),
        v.stride(0) if n > 1 else H * D, n, head, lx, H * D, D, out[0].data_ptr(),
        out[1].data_ptr(), rot, 1.0 / rot**0.5 if rot else 0.0,
    )  # fmt: skip
    if rc:
        raise ValueError(
            f"exact rows rejected: ring {ring_idx.tolist()} of {residual_k.shape[0]} residual "
            f"pages, {head} ring rows and {n} new of {lx}, rotation {rot}"
        )
    return out[0], out[1]


def _hadamard(x: torch.Tensor, block: int) -> torch.Tensor:
    from kvmesh.kernels.cpu_attention import hadamard_cpu

    return hadamard_cpu(x, block)  # the torch version where the C kernels are not built


def one_pass_int4(cache, q: torch.Tensor, native: bool, ranges) -> bool:
    """Whether ``own_page_attention`` runs the one-pass C kernel over int4 pool pages."""
    return ranges is not None and native and _int4_in_kernel(cache, q)


def _int4_in_kernel(cache, q: torch.Tensor) -> bool:
    """int4 pages of a CPU fp32 engine: the C kernels read them (the one-pass kernel itself,
    the SDPA path through ``_dequantize_in_c``)."""
    return cache.cache_format == "int4" and q.dtype == torch.float32 and q.device.type == "cpu"


def _dequantize_in_c(cache, pages: torch.Tensor, q: torch.Tensor, kk, vv) -> bool:
    """int4 pages of a CPU fp32 engine dequantized by the C kernels, bit-equal to
    ``dequantize_pages``, straight into ``kk``/``vv``; False where they do not apply (other
    formats or dtypes, the C kernels off or not built): the torch path then runs."""
    if not _int4_in_kernel(cache, q):
        return False
    from kvmesh.kernels import cpu_attention
    from kvmesh.kernels.cpu_native import CpuKernelError, default_library

    try:
        lib = default_library()
    except CpuKernelError:
        return False
    cpu_attention.dequantize_int4_pages_cpu(cache.views, pages, kk, vv, library=lib)
    return True
