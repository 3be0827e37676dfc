"""Quantizing full KV pages on CPU in C (``cpu_quant.c``), straight into the page pool.

The torch quantizer (``kernels.quant.quantize_pages``, the twin) runs some twenty small ops
per format and, for int4 values, six more per clipping candidate, each over freshly allocated
tensors, then the results are scattered into the pool: at decode sizes (a few pages a step)
that is op overhead, not arithmetic. The C kernel does the same arithmetic in one pass per
(page, head) and writes the components in place. Bytes equal the twin's, except that int4
values may keep a different clipping candidate where two candidates' squared errors tie to
within float rounding (the sums run in another order); see ``cpu_quant.c``.

``write_kv_cache_cpu`` is ``kernels.cache_write.write_kv_cache_torch`` with this quantizer:
the same assembly of completing pages from the residual and the new tokens.
"""

from __future__ import annotations

import torch

from kvmesh.kernels.cache_write import _check_write_args
from kvmesh.kernels.cpu_native import CpuKernelError, CpuLibrary, default_library
from kvmesh.kernels.page_format import QUANT_FORMATS

_CODES = {"fp8": 1, "int8": 2, "int4": 3}
_VIEWS = ("k", "k_scale", "k_zero", "v", "v_scale", "v_zero")


def quantize_pages_into(
    fmt: str,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: dict[str, torch.Tensor],
    page_ids: torch.Tensor,
    *,
    library: CpuLibrary | None = None,
) -> None:
    """Quantize full pages k, v (n, bs, H, D) float32 into pool pages ``page_ids`` (n,) of one
    layer's views ``cache`` (``PageLayout.views``), as ``quant.quantize_pages`` would."""
    if fmt not in _CODES:
        raise ValueError(f"not a quantized cache format: {fmt!r}; accepted: {QUANT_FORMATS}")
    if k.shape != v.shape or k.dim() != 4 or k.dtype != torch.float32:
        raise ValueError(f"expected float32 k, v (n, bs, H, D), got {k.shape} {k.dtype} {v.shape}")
    n, bs, H, D = k.shape
    if page_ids.dtype != torch.int64 or tuple(page_ids.shape) != (n,):
        raise ValueError(f"page_ids must be int64 ({n},), got {page_ids.dtype} {page_ids.shape}")
    if n == 0:
        return
    if int(page_ids.min()) < 0 or int(page_ids.max()) >= cache["k"].shape[0]:
        raise ValueError(f"page_ids outside the pool's {cache['k'].shape[0]} pages")
    stride = cache["k"].stride(0) * cache["k"].element_size()
    for name, t in cache.items():
        if t.stride(0) * t.element_size() != stride or not t[0].is_contiguous():
            raise ValueError(f"view {name!r} is not a dense component of a page-major pool")
    kc, vc, ids = k.contiguous(), v.contiguous(), page_ids.contiguous()
    ptr = [cache[n].data_ptr() if n in cache else None for n in _VIEWS]
    fn = (library or default_library()).fn("kvmesh_quantize_pages")
    rc = fn(
        _CODES[fmt], kc.data_ptr(), vc.data_ptr(), n, bs, H, D, ids.data_ptr(), *ptr, stride,
        torch.get_num_threads(),
    )  # fmt: skip
    if rc:
        raise CpuKernelError(f"kvmesh_quantize_pages rejected {fmt} pages of head_size {D}")


def write_kv_cache_cpu(
    *,
    fmt: str,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: dict[str, torch.Tensor],
    residual_k: torch.Tensor,
    residual_v: torch.Tensor,
    residual_slots: torch.Tensor,
    complete_pages: torch.Tensor,
    complete_src: torch.Tensor,
    library: CpuLibrary | None = None,
) -> None:
    """``write_kv_cache_torch`` for quantized formats with an fp32 residual, full pages
    quantized in C."""
    bs, H, D = _check_write_args(
        fmt=fmt,
        k=k,
        v=v,
        cache=cache,
        slot_mapping=None,
        residual_k=residual_k,
        residual_v=residual_v,
        residual_slots=residual_slots,
        complete_pages=complete_pages,
        complete_src=complete_src,
    )
    R, n = residual_k.shape[0], complete_pages.shape[0]
    if not (residual_k.is_contiguous() and residual_v.is_contiguous()):
        raise ValueError("residual_k and residual_v must be contiguous")
    # row views (R * bs, H, D): one index per row, so the gathers and the store below copy
    # whole rows (index_select / index_copy_), 2-6x faster at decode sizes than indexing
    # with (page, offset) pairs; the same bytes
    rk, rv = residual_k.view(R * bs, H, D), residual_v.view(R * bs, H, D)
    if n:
        # the completing pages: earlier tokens from the residual, new ones from k/v (through
        # the residual dtype, like a tail token), assembled before the residual is written
        src = complete_src.reshape(-1)  # (n * bs,)
        from_res = src < R * bs
        pos_res, pos_new = from_res.nonzero().squeeze(1), (~from_res).nonzero().squeeze(1)
        rows, toks = src[pos_res], src[pos_new] - R * bs
        full = []
        for x, res in ((k, rk), (v, rv)):
            f = torch.empty((n * bs, H, D), dtype=torch.float32)
            f.index_copy_(0, pos_res, res.index_select(0, rows))
            f.index_copy_(0, pos_new, x.index_select(0, toks).to(res.dtype).float())
            full.append(f.view(n, bs, H, D))
        quantize_pages_into(fmt, *full, cache, complete_pages, library=library)
    keep = (residual_slots >= 0).nonzero().squeeze(1)  # the new tokens' residual rows
    if keep.numel():
        rows = residual_slots.index_select(0, keep)
        rk.index_copy_(0, rows, k.index_select(0, keep).to(rk.dtype))
        rv.index_copy_(0, rows, v.index_select(0, keep).to(rv.dtype))
