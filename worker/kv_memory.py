"""The device memory behind the page pool: one page-major byte buffer, the quantized formats'
full-precision tail pages, and the per-layer views the attention backends read.

``KVCacheManager`` (worker/kv_cache.py) decides which page id holds what; this module owns
the bytes those ids point at and the byte format every tier and the wire share
(``kernels.page_format.PageLayout``, ``kvstore.codec.PageSpec``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvmesh.kernels.page_format import PageLayout, read_pages, resolve_format, write_page_buffers
from kvmesh.kvstore.codec import PageSpec
from kvmesh.worker.attention import LayerCache
from kvmesh.worker.models.config import ModelConfig

logger = logging.getLogger(__name__)


class KVMemory:
    """Pages sized from a byte budget (or a page count) for one model and cache format.

    ``buffer``: (num_pages, page_nbytes) uint8, page 0 the null page. ``residual``: for
    quantized formats, ``residual_pages`` full-precision pages per running request (its last
    pages, a ring), outside the byte budget (like activations): (layers, 2, slots *
    residual_pages, block_size, Hkv, D).
    """

    def __init__(
        self,
        layout: PageLayout,
        model_fp: str,
        num_pages: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        num_residual_slots: int = 0,
        residual_pages: int = 1,
    ):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        self.layout = layout
        self.cache_format = layout.cache_format
        self.model_fp = model_fp
        self.num_pages = num_pages
        self.buffer = layout.allocate(num_pages, device)  # (num_pages, page_nbytes)
        # write's C library (kernels built at engine start, not on the first restore's
        # thread; None: numpy's copy)
        self._copy_library = None
        if self.buffer.device.type == "cpu":
            from kvmesh.worker import cpu_kernels

            self._copy_library = cpu_kernels.load()
        self.num_residual_slots = n_slots = num_residual_slots if layout.quantized else 0
        self.residual_pages = residual_pages
        shape = layout.residual_shape(n_slots * residual_pages)
        self.residual = torch.zeros(shape, dtype=dtype, device=device)
        self.layer_caches = [
            LayerCache(
                self.cache_format,
                layout.views(self.buffer, i),
                self.residual[i, 0] if n_slots else None,
                self.residual[i, 1] if n_slots else None,
                residual_pages,
            )
            for i in range(layout.num_layers)
        ]

    @classmethod
    def for_model(
        cls,
        cfg: ModelConfig,
        model_fp: str,
        *,
        kv_cache_dtype: str,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        kv_cache_memory: int,
        num_pages: int | None,
        max_num_seqs: int,
        residual_pages: int = 1,
    ) -> KVMemory:
        """As many pages as ``kv_cache_memory`` bytes hold (or ``num_pages``), with one
        residual slot of ``residual_pages`` pages per possible running request for quantized
        formats."""
        cache_format = resolve_format(kv_cache_dtype, dtype)
        _check_format_supported(cache_format, device)
        layout = cfg.page_layout(cache_format, block_size)  # MLA models: latent pages
        n_pages = num_pages or kv_cache_memory // layout.page_nbytes
        if n_pages < 2:
            raise ValueError(
                f"kv_cache_memory={kv_cache_memory!r} holds {n_pages} pages of "
                f"{layout.page_nbytes} bytes; at least 2 are needed"
            )
        return cls(
            layout,
            model_fp,
            n_pages,
            dtype=dtype,
            device=device,
            num_residual_slots=max_num_seqs,
            residual_pages=residual_pages,
        )

    @property
    def page_spec(self) -> PageSpec:
        """What a stored page object of this memory must say about itself (kvstore.codec)."""
        lay = self.layout
        return PageSpec(
            model_fp=self.model_fp,
            cache_format=self.cache_format,
            num_layers=lay.num_layers,
            num_kv_heads=lay.num_kv_heads,
            head_size=lay.head_size,
            block_size=lay.block_size,
            page_nbytes=lay.page_nbytes,
            layout=lay.name,
        )

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @property
    def residual_nbytes(self) -> int:
        return self.residual.numel() * self.residual.element_size()

    def read(self, page_ids: Sequence[int]) -> list[bytes]:
        """Payload bytes of these pages (a copy, taken now)."""
        if not page_ids:
            return []
        idx = torch.tensor(list(page_ids), dtype=torch.int64, device=self.buffer.device)
        return [row.tobytes() for row in read_pages(self.buffer, idx).cpu().numpy()]

    def write(self, page_ids: Sequence[int], payloads: Sequence) -> None:
        """Copy page payloads (bytes-like, page_nbytes each) into these pages (on the CPU by
        the C kernels' streaming copy where they are built, ``worker.cpu_kernels``)."""
        write_page_buffers(self.buffer, list(page_ids), payloads, library=self._copy_library)


def _check_format_supported(fmt: str, device: torch.device) -> None:
    """Fail at start-up, not mid-request, for a cache format this device cannot run."""
    if device.type == "cuda" and fmt == "fp8":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise ValueError(
                f"kv_cache_dtype 'fp8' needs a GPU with compute capability 8.9 or newer "
                f"(Ada, Hopper); this one is {cap[0]}.{cap[1]}. Use 'int8' instead."
            )
