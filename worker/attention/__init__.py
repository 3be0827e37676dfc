"""Attention backends behind one interface, chosen by name from a registry.

Each factory imports its backend lazily, so importing kvmesh never touches CUDA or Triton.
"""

from __future__ import annotations

from collections.abc import Callable

from kvmesh.worker.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    LayerCache,
    PrefillSpan,
)


def _torch_backend(**kw) -> AttentionBackend:
    from kvmesh.worker.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(**kw)


def _cpu_backend(**kw) -> AttentionBackend:
    from kvmesh.worker.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(native=True, **kw)


def _triton_backend(**kw) -> AttentionBackend:
    from kvmesh.worker.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(**kw)


_REGISTRY: dict[str, Callable[..., AttentionBackend]] = {
    "torch": _torch_backend,  # pure torch: the reference
    "cpu": _cpu_backend,  # torch, with decode in kvmesh's C kernel where it builds
    "triton": _triton_backend,  # Triton kernels on CUDA, their torch twins elsewhere
}


def register_backend(name: str, factory: Callable[..., AttentionBackend]) -> None:
    _REGISTRY[name] = factory


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def get_backend(name: str, **kwargs) -> AttentionBackend:
    """The backend ``name``: ``"torch"`` (reference), ``"cpu"`` (torch plus the C decode
    kernel) or ``"triton"`` (CUDA)."""
    check_backend_name(name)
    return _REGISTRY[name](**kwargs)


def check_backend_name(name: str) -> None:
    """Raise ValueError naming ``name`` unless it is a registered backend."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; available: {available_backends()}")


def default_backend_name(device: str) -> str:
    if device.startswith("cuda") and "triton" in _REGISTRY:
        return "triton"
    return "cpu" if device == "cpu" and "cpu" in _REGISTRY else "torch"


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "LayerCache",
    "PrefillSpan",
    "available_backends",
    "check_backend_name",
    "default_backend_name",
    "get_backend",
    "register_backend",
]
