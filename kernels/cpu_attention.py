"""Paged decode attention on CPU, in C (``cpu_attention.c``), without the gather copy.

The torch path gathers every page of every sequence (``index_select``) into a padded
(B, L, Hkv, D) copy, then runs SDPA over it: the KV is read, written and read again, and at
decode time that traffic is the step's largest cost after the weights. The C kernel reads
each K/V row once, in place, through the block table. ``kernels.cpu_native`` builds it.

Float cache formats only (fp32, fp16, bf16 pages; q and the result in fp32 inside). The
torch twin is ``kernels.decode_attention.paged_decode_attention_torch``.
"""

from __future__ import annotations

import torch

from kvmesh.kernels.cpu_native import CpuLibrary, default_library
from kvmesh.kernels.page_format import FLOAT_FORMATS
from kvmesh.kernels.paged_kv import check_cache, check_index

_SYMBOLS = {
    "fp32": "kvmesh_decode_attention_f32",
    "bf16": "kvmesh_decode_attention_bf16",
    "fp16": "kvmesh_decode_attention_f16",
}


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
) -> torch.Tensor:
    """q (B, Hq, D) -> (B, Hq, D) in q's dtype, computed in fp32, over float-format pages.

    Same contract as ``paged_decode_attention_torch`` for float formats: the keys are the
    first ``context_lens[b]`` positions of sequence b's pages (the new token's own K/V already
    written), the last ``sliding_window`` of them if given. ``library``: a specific build,
    else the one ``cpu_native.build()`` loaded.
    """
    if fmt not in _SYMBOLS:
        raise ValueError(f"the CPU kernel reads float formats {sorted(_SYMBOLS)}, got {fmt!r}")
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
