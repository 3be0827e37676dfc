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

from kvmesh.kernels.cpu_native import CpuKernelError, CpuLibrary, default_library
from kvmesh.kernels.page_format import QUANT_FORMATS
from kvmesh.kernels.paged_kv import check_cache, check_index, check_new_kv, rotation_block

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


class WriteIndices:
    """One step's quantized-write indices (``AttentionMetadata``'s ``residual_slots`` (T,),
    ``complete_pages`` (n,), ``complete_src`` (n, bs)), checked and made contiguous once for
    every layer's ``LayerWriter.write`` of the step."""

    def __init__(self, residual_slots, complete_pages, complete_src, block_size: int):
        check_index(residual_slots, "residual_slots", (None,))
        check_index(complete_pages, "complete_pages", (None,))
        check_index(complete_src, "complete_src", (complete_pages.shape[0], block_size))
        self.rows = residual_slots.contiguous()  # (T,)
        self.pages = complete_pages.contiguous()  # (n,)
        self.src = complete_src.contiguous()  # (n, bs)
        self.block_size = block_size


class LayerWriter:
    """``write_kv_cache_cpu`` for one layer's quantized views and fp32 residual, checked once
    (the engine writes every layer every step: the per-call checks cost more than the C call
    at decode sizes); ``write`` checks only what changes from call to call (k, v, the step's
    indices against the layer). The same C call, so the same bytes."""

    def __init__(
        self,
        *,
        fmt: str,
        cache: dict[str, torch.Tensor],
        residual_k: torch.Tensor,
        residual_v: torch.Tensor,
        library: CpuLibrary | None = None,
    ):
        if fmt not in _CODES:
            raise ValueError(f"not a quantized cache format: {fmt!r}; accepted: {QUANT_FORMATS}")
        self.bs, self.H, self.D = check_cache(fmt, cache, residual_k, residual_v)
        if not (residual_k.is_contiguous() and residual_v.is_contiguous()):
            raise ValueError("residual_k and residual_v must be contiguous")
        if residual_k.dtype != torch.float32 or residual_v.dtype != torch.float32:
            raise ValueError(f"residual_k/v must be float32, got {residual_k.dtype}")
        stride = cache["k"].stride(0) * cache["k"].element_size()
        for name, t in cache.items():
            if t.stride(0) * t.element_size() != stride or not t[0].is_contiguous():
                raise ValueError(f"view {name!r} is not a dense component of a page-major pool")
        self.fmt, self.cache = fmt, cache
        self.residual_k, self.residual_v = residual_k, residual_v  # (R, bs, H, D) each
        self._R, self._num_pages = residual_k.shape[0], cache["k"].shape[0]
        self._ptr = [cache[c].data_ptr() if c in cache else None for c in _VIEWS]
        self._head = (_CODES[fmt],)
        self._tail = (residual_k.data_ptr(), residual_v.data_ptr(), self._R)
        self._pool = (self._num_pages, self.bs, self.H, self.D, *self._ptr, stride)
        self._fn = (library or default_library()).fn("kvmesh_write_kv_quant")

    def write(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        idx: WriteIndices,
        v_rotation: int | None = None,
    ) -> None:
        """Store the step's k, v (T, H, D) as ``write_kv_cache_cpu`` does."""
        D = self.D
        check_new_kv(k, v, self.H, D)
        T, n = k.shape[0], idx.pages.shape[0]
        if idx.rows.shape[0] != T or idx.block_size != self.bs:
            raise ValueError(
                f"residual_slots must have shape ({T},) and complete_src ({n}, {self.bs}), got "
                f"{tuple(idx.rows.shape)}, {tuple(idx.src.shape)}"
            )
        # one C call (kvmesh_write_kv_quant): the completing pages assembled from the ring and
        # the new tokens and quantized, then the new tokens' rows stored into the ring; k and
        # v are read in place where each token's H * D values are contiguous (the fused qkv
        # output's columns), so no copy
        if k.dtype != torch.float32 or (T and not k[0].is_contiguous()):
            k = k.float().contiguous()
        if v.dtype != torch.float32 or (T and not v[0].is_contiguous()):
            v = v.float().contiguous()
        rot = rotation_block("v_rotation", v_rotation, D)
        rc = self._fn(
            *self._head, k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), T,
            idx.rows.data_ptr(), *self._tail, n, idx.pages.data_ptr(), idx.src.data_ptr(),
            *self._pool, torch.get_num_threads(), rot, 1.0 / rot**0.5 if rot else 0.0,
        )  # fmt: skip
        if rc == 4:
            raise ValueError(
                f"residual_slots, complete_pages or complete_src out of range (residual rows "
                f"{self._R * self.bs}, new tokens {T}, pool pages {self._num_pages})"
            )
        if rc == 1:
            raise MemoryError("kvmesh_write_kv_quant could not allocate its page scratch")
        if rc:
            raise CpuKernelError(
                f"kvmesh_write_kv_quant rejected {self.fmt} pages of head_size {D}"
            )


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
    v_rotation: int | None = None,
) -> None:
    """``write_kv_cache_torch`` for quantized formats with an fp32 residual, in one C call
    (``kvmesh_write_kv_quant``): the same bytes in the pool and the residual (the quantizer
    as ``quantize_pages_into``). ``v_rotation``: a block size; v is first rotated as
    ``quant.hadamard_transform(v, v_rotation)`` rotates it (int4 keeps V rotated), in C, bit
    for bit, so the caller need not (v as given is not changed). The engine's backend keeps a
    ``LayerWriter`` per layer and one ``WriteIndices`` per step instead (the same call)."""
    if fmt not in _CODES:
        raise ValueError(f"not a quantized cache format: {fmt!r}; accepted: {QUANT_FORMATS}")
    writer = LayerWriter(
        fmt=fmt, cache=cache, residual_k=residual_k, residual_v=residual_v, library=library
    )
    idx = WriteIndices(residual_slots, complete_pages, complete_src, writer.bs)
    writer.write(k, v, idx, v_rotation)
