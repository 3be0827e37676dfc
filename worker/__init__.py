"""The engine on one accelerator: model, paged cache, scheduler, runner, sampler."""

from kvmesh.worker.async_engine import AsyncEngine
from kvmesh.worker.engine import LLMEngine, QueueFullError
from kvmesh.worker.llm import LLM
from kvmesh.worker.outputs import RequestOutput
from kvmesh.worker.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncEngine", "LLMEngine", "QueueFullError", "RequestOutput", "SamplingParams"]
