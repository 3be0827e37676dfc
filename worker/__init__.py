"""The engine on one accelerator: model, paged cache, scheduler, runner, sampler.

The names below load on first use (PEP 562), so that light modules of this package (``envs``)
and the commands that need only them (``kvmesh top``) do not import torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvmesh.worker.async_engine import AsyncEngine
    from kvmesh.worker.engine import LLMEngine, QueueFullError
    from kvmesh.worker.llm import LLM
    from kvmesh.worker.outputs import RequestOutput
    from kvmesh.worker.sampling_params import SamplingParams

_WHERE = {
    "AsyncEngine": "kvmesh.worker.async_engine",
    "LLMEngine": "kvmesh.worker.engine",
    "QueueFullError": "kvmesh.worker.engine",
    "LLM": "kvmesh.worker.llm",
    "RequestOutput": "kvmesh.worker.outputs",
    "SamplingParams": "kvmesh.worker.sampling_params",
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'kvmesh.worker' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


__all__ = ["LLM", "AsyncEngine", "LLMEngine", "QueueFullError", "RequestOutput", "SamplingParams"]
