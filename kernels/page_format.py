"""The byte layout of a KV page: one format for the device pool, the tiers and the wire.

The pool is one ``uint8`` tensor of shape ``(num_pages, page_nbytes)``: page-major, so a page
is one contiguous run of bytes. Spilling a page is a copy of ``buf[page_id]``, restoring it
is a copy back, and byte-exactness holds by construction.

Inside a page the bytes are grouped by layer, and each layer holds the components of its
format in a fixed order (K data, K scales, ..., V data, ...). Every component starts at a
16-byte aligned offset, so it can be viewed in place as a typed tensor of shape
``(num_pages, *shape)`` whose page stride is ``page_nbytes / itemsize`` elements.

Quantized formats keep a request's last, partially filled page in full precision in a
separate *residual* buffer and quantize the page once it is full (KIVI's full-precision
residual): see ``residual_shape``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

ALIGN = 16
FLOAT_FORMATS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
QUANT_FORMATS = ("fp8", "int8", "int4")
CACHE_FORMATS = ("auto", *FLOAT_FORMATS, *QUANT_FORMATS)
ATTENTION_LAYOUTS = ("mha", "mla")


@dataclass(frozen=True)
class Component:
    name: str  # e.g. "k", "k_scale", "v"
    dtype: torch.dtype
    shape: tuple[int, ...]  # per page and layer

    @property
    def nbytes(self) -> int:
        n = torch.tensor([], dtype=self.dtype).element_size()
        for s in self.shape:
            n *= s
        return n


def _components(fmt: str, bs: int, H: int, D: int, attention: str = "mha") -> list[Component]:
    if attention == "mla":  # one latent row per token: [c_kv (rank), k_pe (rope_dim)]
        return [Component("latent", FLOAT_FORMATS[fmt], (bs, D))]
    if fmt in FLOAT_FORMATS:
        dt = FLOAT_FORMATS[fmt]
        return [Component("k", dt, (bs, H, D)), Component("v", dt, (bs, H, D))]
    from kvmesh.kernels.quant import quant_components  # the quantized layouts live there

    return quant_components(fmt, bs, H, D)


def resolve_format(kv_cache_dtype: str, model_dtype: torch.dtype) -> str:
    """The concrete format name: ``auto`` becomes the model dtype's name."""
    if kv_cache_dtype not in CACHE_FORMATS:
        raise ValueError(
            f"unknown kv_cache_dtype {kv_cache_dtype!r}; accepted: {', '.join(CACHE_FORMATS)}"
        )
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    for name, dt in FLOAT_FORMATS.items():
        if dt == model_dtype:
            return name
    raise ValueError(f"no cache format for model dtype {model_dtype}")


@dataclass(frozen=True)
class PageLayout:
    cache_format: str  # concrete: fp32, fp16, bf16, fp8, int8, int4
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    # "mha": per-head K and V (Llama-family GQA/MQA). "mla": multi-head latent attention
    # (DeepSeek-V2/V3): per token and layer one row of head_size values, the compressed KV
    # latent (head_size - rope_dim, after kv_a_layernorm) then the rotary key (rope_dim,
    # after rotary); num_kv_heads is 1
    attention: str = "mha"
    rope_dim: int = 0
    components: tuple[Component, ...] = field(init=False)
    offsets: tuple[int, ...] = field(init=False)  # byte offset of each component in a layer
    layer_nbytes: int = field(init=False)

    def __post_init__(self):
        if self.cache_format not in CACHE_FORMATS or self.cache_format == "auto":
            raise ValueError(f"PageLayout needs a concrete format, got {self.cache_format!r}")
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.attention not in ATTENTION_LAYOUTS:
            raise ValueError(
                f"unknown page attention layout {self.attention!r}; accepted: {ATTENTION_LAYOUTS}"
            )
        if self.attention == "mla":
            if self.cache_format not in FLOAT_FORMATS:
                raise ValueError(
                    f"kv_cache_dtype {self.cache_format!r} is not offered for MLA latent pages; "
                    f"accepted: {', '.join(FLOAT_FORMATS)} (docs/formats.md measures int8/fp8)"
                )
            if self.num_kv_heads != 1 or not 0 < self.rope_dim < self.head_size:
                raise ValueError(
                    f"an MLA page has num_kv_heads 1 and 0 < rope_dim < head_size, got "
                    f"num_kv_heads={self.num_kv_heads} rope_dim={self.rope_dim} "
                    f"head_size={self.head_size}"
                )
        elif self.rope_dim:
            raise ValueError(f"rope_dim is for MLA pages only, got {self.rope_dim}")
        comps = tuple(
            _components(
                self.cache_format,
                self.block_size,
                self.num_kv_heads,
                self.head_size,
                self.attention,
            )
        )
        offsets, off = [], 0
        for c in comps:
            offsets.append(off)
            off += -(-c.nbytes // ALIGN) * ALIGN
        object.__setattr__(self, "components", comps)
        object.__setattr__(self, "offsets", tuple(offsets))
        object.__setattr__(self, "layer_nbytes", off)

    @property
    def name(self) -> str:
        """What a stored page's header says of its layout (kvstore.codec): ``mha``, or
        ``mla-r{latent rank}-rope{rope_dim}``, so an MLA page is never read as a GQA page."""
        if self.attention == "mha":
            return "mha"
        return f"mla-r{self.head_size - self.rope_dim}-rope{self.rope_dim}"

    @property
    def kv_rank(self) -> int:
        """MLA pages: the compressed latent's width (the rest of a row is the rotary key)."""
        return self.head_size - self.rope_dim

    @property
    def quantized(self) -> bool:
        return self.cache_format in QUANT_FORMATS

    @property
    def page_nbytes(self) -> int:
        return self.layer_nbytes * self.num_layers

    @property
    def bytes_per_token(self) -> float:
        """Device bytes per cached token, scales and alignment included."""
        return self.page_nbytes / self.block_size

    @property
    def bits_per_value(self) -> float:
        per_token = self.num_kv_heads * self.head_size * (1 if self.attention == "mla" else 2)
        values = self.num_layers * self.block_size * per_token
        return self.page_nbytes * 8 / values

    def allocate(self, num_pages: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """A zeroed pool ``(num_pages, page_nbytes)`` uint8. Zeros, not empty: attention reads
        whole pages and masks unused slots, and masked garbage (NaN) would poison softmax."""
        return torch.zeros((num_pages, self.page_nbytes), dtype=torch.uint8, device=device)

    def views(self, buf: torch.Tensor, layer: int) -> dict[str, torch.Tensor]:
        """Typed in-place views of ``layer``'s components: name -> (num_pages, *shape)."""
        if buf.dtype != torch.uint8 or buf.dim() != 2 or buf.shape[1] != self.page_nbytes:
            raise ValueError(
                f"expected a uint8 pool (num_pages, {self.page_nbytes}), got "
                f"{tuple(buf.shape)} {buf.dtype}"
            )
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
        base = layer * self.layer_nbytes
        out = {}
        for c, off in zip(self.components, self.offsets):
            raw = buf[:, base + off : base + off + c.nbytes]  # (num_pages, nbytes)
            out[c.name] = raw.view(c.dtype).unflatten(1, c.shape)
        return out

    def residual_shape(self, num_slots: int) -> tuple[int, ...]:
        """Full-precision pages of quantized formats (``num_slots`` residual pages: requests'
        slots times their pages each): (layers, 2, num_slots, bs, Hkv, D), so one layer's K
        (or V) residual, ``residual[layer, 0]``, is a contiguous (num_slots, bs, Hkv, D)
        block."""
        return (self.num_layers, 2, num_slots, self.block_size, self.num_kv_heads, self.head_size)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """A uint8 page tensor (n, page_nbytes) viewed as int64 where the size allows: torch's
    CPU index_select/index_copy_ move one element at a time, and 8-byte elements copied a
    whole page ~6x faster than bytes (40 fp32 SmolLM2 pages: 21 ms -> 3.7 ms)."""
    if t.shape[-1] % 8 == 0 and t.is_contiguous() and t.storage_offset() % 8 == 0:
        return t.view(torch.int64)
    return t


def read_pages(
    buf: torch.Tensor, ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """A copy of pool pages ``ids`` (n,) int64: (n, page_nbytes) uint8, on buf's device, or
    in ``out`` (n, page_nbytes) uint8 on any device when given. Copying into reused memory
    is the fast way out: a fresh buffer that is kept (as a spill's is, until stored) is
    filled at ~1 GB/s here, because every 4 KiB of it faults on first touch; a reused one
    at ~5.6 GB/s (measured with 100 SmolLM2 pages)."""
    ids = ids.to(buf.device)
    if out is None:
        return _wide(buf).index_select(0, ids).view(torch.uint8)
    if out.dtype != torch.uint8 or tuple(out.shape) != (len(ids), buf.shape[1]):
        raise ValueError(
            f"out must be uint8 of shape ({len(ids)}, {buf.shape[1]}), "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    if out.device != buf.device:
        out.copy_(_wide(buf).index_select(0, ids).view(torch.uint8))
        return out
    wide_buf, wide_out = _wide(buf), _wide(out)
    if wide_buf.dtype != wide_out.dtype:
        wide_buf, wide_out = buf, out
    torch.index_select(wide_buf, 0, ids, out=wide_out)
    return out


def write_pages(buf: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
    """Copy ``rows`` (n, page_nbytes) uint8 into pool pages ``ids`` (n,) int64."""
    wide_buf, wide_rows = _wide(buf), _wide(rows)
    if wide_buf.dtype != wide_rows.dtype:  # one of them cannot take the wide view
        wide_buf, wide_rows = buf, rows
    wide_buf.index_copy_(0, ids.to(buf.device), wide_rows)


def check_page_buffers(buf: torch.Tensor, ids: Sequence[int], payloads: Sequence) -> list:
    """Raise unless ``payloads`` (bytes-like) can be written into pages ``ids`` of ``buf``
    ((pages, page_nbytes) uint8): one id per payload, each id a page of ``buf``, each
    payload ``page_nbytes`` long. Returns the payloads as uint8 numpy arrays (views, no copy)."""
    if len(ids) != len(payloads):
        raise ValueError(f"{len(ids)} page ids for {len(payloads)} payloads")
    num_pages, nbytes = buf.shape
    views = [np.frombuffer(p, dtype=np.uint8) for p in payloads]
    bad = [v.nbytes for v in views if v.nbytes != nbytes]
    if bad:
        raise ValueError(f"a payload is {bad[0]} bytes, pages are {nbytes}")
    outside = [int(i) for i in ids if not 0 <= int(i) < num_pages]
    if outside:
        raise ValueError(f"page ids must lie in [0, {num_pages}), got {outside[0]}")
    return views


def write_page_buffers(
    buf: torch.Tensor, ids: Sequence[int], payloads: Sequence, *, library=None
) -> None:
    """Copy each of ``payloads`` (bytes-like, ``page_nbytes`` each; e.g. views of stored
    objects) into pool page ``ids[i]``: one copy per page on the CPU, straight from the
    object, with no staging array between (a fresh one is filled at page-fault speed); with
    ``library`` (kvmesh's C kernels, ``kernels.cpu_native``) and a contiguous ``buf`` by its
    streaming copy (``cpu_ops.copy_pages_cpu``: the same bytes, fewer through memory). On
    CUDA they are gathered into pinned memory first, then moved in one copy. Checked first
    (``check_page_buffers``): a bad call writes nothing."""
    views = check_page_buffers(buf, ids, payloads)
    if not views:
        return
    nbytes = buf.shape[1]
    if buf.device.type == "cpu" and library is not None and buf.is_contiguous():
        from kvmesh.kernels.cpu_ops import copy_page_views

        copy_page_views(buf, ids, views, library=library)
        return
    if buf.device.type == "cpu":
        pool = buf.numpy()
        for i, v in zip(ids, views):
            pool[i] = v
        return
    staged = torch.empty((len(views), nbytes), dtype=torch.uint8, pin_memory=True)
    rows = staged.numpy()
    for j, v in enumerate(views):
        rows[j] = v
    idx = torch.tensor(list(ids), dtype=torch.int64)
    write_pages(buf, idx, staged.to(buf.device, non_blocking=True))
