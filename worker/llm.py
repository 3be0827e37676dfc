"""The offline batch API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.worker.engine import LLMEngine, Prompt
from kvmesh.worker.flush import DEFAULT_FLUSH_TIMEOUT_S, flush_to_shared
from kvmesh.worker.models.loader import DEFAULT_MODEL
from kvmesh.worker.outputs import RequestOutput
from kvmesh.worker.sampling_params import SamplingParams
from kvmesh.worker.tokenizer import Tokenizer


class LLM:
    """Offline batch API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

    def __init__(self, model: str = DEFAULT_MODEL, **engine_args):
        self.engine = LLMEngine(model, **engine_args)
        self._closed = False

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion as one continuous batch; outputs in input order.
        Every prompt is validated before anything runs."""
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        elif len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        if self.engine.driver is not None:
            raise RuntimeError(
                "this engine is driven by an AsyncEngine; use AsyncEngine.generate instead"
            )
        reqs = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            try:
                reqs.append(self.engine.make_request(p, sp))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        for r in reqs:
            self.engine.add(r, check_queue=False)
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r.request_id] for r in reqs]

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        return self.generate(self.tokenizer.apply_chat_template(messages), params)[0]

    def reset_prefix_cache(self) -> int:
        return self.engine.reset_prefix_cache()

    def close(self, flush_timeout_s: float | None = DEFAULT_FLUSH_TIMEOUT_S) -> None:
        """Release the engine. With a Redis tier, its cached pages (device and host) are
        first written down to Redis, for at most ``flush_timeout_s`` seconds (None: no
        flush), so the next process finds them (worker/flush.py). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if flush_timeout_s is not None:
            flush_to_shared(self.engine, flush_timeout_s)
        self.engine.close()


__all__ = ["LLM"]
