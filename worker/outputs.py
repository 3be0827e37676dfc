"""What the engine returns to callers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """A request's state after a step. ``new_token_ids``/``new_text`` are what this step
    added (for streaming); ``token_ids``/``text`` are everything so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    num_cached_tokens: int
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    logprobs: list[float] | None = None
    # per output token, when asked: the most likely (token id, logprob), most likely first
    top_logprobs: list[list[tuple[int, float]]] | None = None
    stop_reason: int | str | None = None
    ttft_s: float | None = None  # arrival to first token
    error: str | None = None  # why, when finish_reason is "error"
