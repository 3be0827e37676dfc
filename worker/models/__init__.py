"""Model registry: the architecture named by a ``ModelConfig`` picks the module that builds it.

Each builder imports its module lazily."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmesh.worker.models.config import MLA_ARCHITECTURES, ModelConfig

if TYPE_CHECKING:  # torch loads with a model, not with the command line's parser
    import torch


def build_model(cfg: ModelConfig, src, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The model of ``cfg`` with the weights of ``src`` (a ``loader.ModelSource``), in eval
    mode: Llama-family decoders (``models.llama``) or DeepSeek-V2/V3 with multi-head latent
    attention (``models.deepseek``)."""
    if cfg.architecture in MLA_ARCHITECTURES:
        from kvmesh.worker.models.deepseek import build_deepseek

        return build_deepseek(cfg, src, dtype, device)
    from kvmesh.worker.models.llama import build_model as build_llama

    return build_llama(cfg, src, dtype, device)


__all__ = ["build_model"]
