"""The attention backend of multi-head latent attention models (``models.deepseek``).

The step's new latent rows are written to the latent pages first; then single-token rows
(decode) attend in the absorbed form over the latent pages only (``kernels.mla_attention``:
Triton on CUDA, the torch twin on CPU), and each prefill chunk expands its context's
latents into per-head K and V. A chunk with nothing cached reads its own rows back through
the cache dtype, so a later prefix-cache hit sees the very same keys.
"""

from __future__ import annotations

import functools

import torch

from kvmesh.kernels.mla_attention import (
    absorb_output,
    absorb_query,
    check_triton_block_size,
    mla_decode,
    mla_decode_cpu,
    mla_decode_torch,
    mla_decode_triton,
    mla_prefill_torch,
    write_latent,
)
from kvmesh.worker.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    LayerCache,
    causal_prefill_mask,
)


class MLABackend(AttentionBackend):
    """``forward_mla`` replaces ``forward``: the model hands over latents, not K and V.
    ``kernel="auto"`` (the engine's choice) picks Triton for CUDA tensors and the torch twin
    elsewhere; ``"cpu"`` kvmesh's C decode kernel for CPU tensors where it builds (slower than
    the torch twin for MLA's shapes: docs/models.md); ``"torch"`` forces the reference,
    ``"triton"`` the Triton kernel (on CPU only under ``TRITON_INTERPRET=1``: the tests).
    Given ``block_size`` and ``device``, a page size the Triton decode cannot tile is refused
    here, not at the first decode: always for ``"triton"``, on CUDA for ``"auto"``/``"cpu"``."""

    name = "mla"

    def __init__(
        self,
        kernel: str = "auto",
        *,
        block_size: int | None = None,
        device: torch.device | str | None = None,
    ):
        kernels = {"auto": mla_decode, "torch": mla_decode_torch, "triton": mla_decode_triton}
        if kernel not in (*kernels, "cpu"):
            raise ValueError(
                f"MLA decode kernel must be one of {sorted((*kernels, 'cpu'))}, got {kernel!r}"
            )
        on_cuda = device is not None and torch.device(device).type == "cuda"
        if block_size is not None and (kernel == "triton" or (kernel != "torch" and on_cuda)):
            check_triton_block_size(block_size)
        self.kernel = kernel
        self._decode = kernels.get(kernel, mla_decode)
        if kernel == "cpu":  # the C decode kernel where it builds, else the torch twin
            from kvmesh.worker import cpu_kernels

            lib = cpu_kernels.load()
            if lib is not None:
                self._decode = functools.partial(_decode_cpu_or_auto, library=lib)
            else:
                self.kernel = "auto"
        self._meta: AttentionMetadata | None = None

    def prepare(self, meta: AttentionMetadata) -> None:
        if meta.residual_slots is not None:
            raise ValueError("MLA latent pages take float formats only (no residual slots)")
        self._meta = meta
        dev = meta.slot_mapping.device
        self._prefill = []
        for span in meta.prefills:
            mask = None
            if span.context_len != span.q_len:  # cached keys first: causal by position
                mask = causal_prefill_mask(span, dev)  # (q_len, ctx)
            self._prefill.append((span, mask))

    def forward(self, q, k, v, cache: LayerCache, scale):
        raise TypeError("an MLA model's cache holds latents: its attention calls forward_mla")

    def forward_mla(
        self,
        q_nope: torch.Tensor,  # (T, H, nope)
        q_pe: torch.Tensor,  # (T, H, rope), rotated
        latent: torch.Tensor,  # (T, rank + rope): [c_kv normed, k_pe rotated]
        cache: LayerCache,
        *,
        w_uk: torch.Tensor,  # (H, nope, rank)
        w_uv: torch.Tensor,  # (H, v, rank)
        scale: float,
    ) -> torch.Tensor:
        """Store the latents at the step's slots (mutates the cache), then attention:
        (T, H, v)."""
        meta = self._meta
        assert meta is not None, "prepare() must be called before forward_mla()"
        lc = cache.views["latent"]  # (P, bs, rank + rope)
        write_latent(lc, latent, meta.slot_mapping)
        T, H, _ = q_nope.shape
        out = q_nope.new_empty((T, H, w_uv.shape[1]))
        nd = meta.num_decode
        if nd:
            out[:nd] = self.decode(q_nope[:nd], q_pe[:nd], lc, w_uk=w_uk, w_uv=w_uv, scale=scale)
        for span, mask in self._prefill:
            s, n = span.start, span.q_len
            if mask is None:  # nothing cached: the chunk's own rows, as the cache holds them
                rows = latent[s : s + n].to(lc.dtype)
            else:
                rows = lc.index_select(0, span.block_table).flatten(0, 1)[: span.context_len]
            out[s : s + n] = mla_prefill_torch(
                q_nope=q_nope[s : s + n],
                q_pe=q_pe[s : s + n],
                latent=rows,
                w_uk=w_uk,
                w_uv=w_uv,
                scale=scale,
                mask=mask,
            )
        return out

    def decode(self, q_nope, q_pe, latent_cache, *, w_uk, w_uv, scale) -> torch.Tensor:
        """The step's single-token rows (nd, H, *) in the absorbed form: (nd, H, v)."""
        meta = self._meta
        q_abs = absorb_query(q_nope, q_pe, w_uk)  # (nd, H, rank + rope)
        o_lat = self._decode(
            q=q_abs,
            latent_cache=latent_cache,
            block_tables=meta.decode_block_tables,
            context_lens=meta.decode_context_lens,
            kv_rank=w_uk.shape[-1],
            scale=scale,
        )  # (nd, H, rank)
        return absorb_output(o_lat, w_uv)


def _decode_cpu_or_auto(*, library, **kw) -> torch.Tensor:
    if kw["q"].is_cpu:
        return mla_decode_cpu(**kw, library=library)
    return mla_decode(**kw)
