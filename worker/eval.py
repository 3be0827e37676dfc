"""Perplexity through the real paged engine path, for comparing KV cache formats.

Each window is prefilled in chunks of ``max_num_batched_tokens`` through the page pool, so
every chunk after the first attends to pages that were written (and, for quantized formats,
quantized) by earlier chunks and read back from the cache.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from kvmesh.worker.engine import LLMEngine
from kvmesh.worker.sampling_params import SamplingParams

logger = logging.getLogger("kvmesh.eval")


@dataclass
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood per predicted token (nats)
    tokens: int  # predicted tokens
    windows: int
    context: int
    kv_cache_dtype: str
    bits_per_value: float
    bytes_per_token: float
    # each window's mean NLL per predicted token (nats), in window order: the spread
    window_nll: list[float] | None = None
    kv_residual_pages: int | None = None  # quantized formats: pages read exact (None: float)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def window_token_ids(engine: LLMEngine, text: str, context: int, windows: int) -> list[list[int]]:
    """``windows`` consecutive, non-overlapping windows of ``context`` tokens from ``text``."""
    if context < 2:
        raise ValueError(f"context must be >= 2 tokens, got {context}")
    if windows < 1:
        raise ValueError(f"windows must be >= 1, got {windows}")
    if context >= engine.max_model_len:
        raise ValueError(f"context {context} must be below max_model_len {engine.max_model_len}")
    if engine.tokenizer is None:
        raise ValueError("this model has no tokenizer to encode the text")
    need = context * windows
    ids = engine.tokenizer.encode(text[: need * 8])  # ~4 characters per token: plenty
    if len(ids) < need:
        ids = engine.tokenizer.encode(text)
    if len(ids) < need:
        raise ValueError(
            f"the text has {len(ids)} tokens; {windows} windows of {context} need {need}"
        )
    return [ids[i * context : (i + 1) * context] for i in range(windows)]


def score_window(engine: LLMEngine, ids: list[int]) -> tuple[float, int]:
    """Sum of next-token NLL over ``ids`` (``len(ids) - 1`` predictions), chunked through the
    cache. The engine must be idle (it is driven directly, outside the scheduler)."""
    if engine.has_unfinished_requests():
        raise RuntimeError("score_window needs an idle engine")
    req = engine.make_request(ids, SamplingParams(max_tokens=1))
    chunk = engine.scheduler_config.max_num_batched_tokens
    nll, n = 0.0, 0
    try:
        while req.num_computed_tokens < len(ids):
            step = min(chunk, len(ids) - req.num_computed_tokens)
            if engine.kv.allocate_slots(req, step) is None:
                raise RuntimeError("the KV cache is too small for one window; raise it")
            _, logits = engine.runner.execute([(req, step)], all_logits=True)  # (step, V)
            start = req.num_computed_tokens
            req.num_computed_tokens += step
            targets = torch.tensor(ids[start + 1 : start + step + 1], dtype=torch.int64)
            lp = torch.log_softmax(logits[: len(targets)].float().cpu(), dim=-1)
            nll -= lp.gather(1, targets[:, None]).sum().item()
            n += len(targets)
    finally:
        engine.kv.free(req)
    return nll, n


def evaluate_perplexity(
    engine: LLMEngine, text: str, context: int = 1024, windows: int = 8
) -> PerplexityResult:
    total, count = 0.0, 0
    per_window = []
    t0 = time.monotonic()
    for i, ids in enumerate(window_token_ids(engine, text, context, windows)):
        nll, n = score_window(engine, ids)
        total, count = total + nll, count + n
        per_window.append(nll / n)
        logger.info(
            "window %d/%d: running ppl %.4f (%.1fs)",
            i + 1,
            windows,
            math.exp(total / count),
            time.monotonic() - t0,
        )
    return PerplexityResult(
        ppl=math.exp(total / count),
        nll=total / count,
        tokens=count,
        windows=windows,
        context=context,
        kv_cache_dtype=engine.cache_format,
        bits_per_value=engine.layout.bits_per_value,
        bytes_per_token=engine.bytes_per_token,
        window_nll=per_window,
        kv_residual_pages=engine.memory.residual_pages if engine.layout.quantized else None,
    )
