"""The OpenAI-compatible HTTP wire: request and response bodies (Pydantic) and the error shape.

Both HTTP front doors (``worker/http_api.py``, ``router/http_api.py``) speak it through the
one app in ``protos/openai_app.py``. Every request field is one of three kinds, listed in
docs/http.md: supported; accepted and ignored with a warning (it cannot change the tokens, or
it is a client-side hint); or rejected with a 400 that names it (kvmesh cannot honour it, and
silently ignoring it would return something the caller did not ask for).

Fields kvmesh does not know at all are ignored with a warning too (``extra="allow"``), as vLLM
does: clients add vendor fields freely.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "APIError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "ErrorBody",
    "ErrorResponse",
    "StreamOptions",
    "TokenizeRequest",
    "grpc_status_to_http",
]

# ---------------------------------------------------------------- errors


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorBody


# HTTP status -> OpenAI's error type names
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class APIError(Exception):
    """A request that ends in an OpenAI-shaped error. 429 and 503 carry ``Retry-After``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        if retry_after_s is None and status in (429, 503):
            retry_after_s = 1
        self.retry_after_s = retry_after_s

    @property
    def type(self) -> str:
        default = "invalid_request_error" if self.status < 500 else "server_error"
        return _ERROR_TYPES.get(self.status, default)

    def body(self) -> dict:
        return ErrorResponse(
            error=ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code)
        ).model_dump()

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s else {}


# gRPC status code name -> HTTP status (what a worker's or the router's verdict means here)
_GRPC_TO_HTTP = {
    "INVALID_ARGUMENT": 400,
    "OUT_OF_RANGE": 400,
    "FAILED_PRECONDITION": 400,
    "NOT_FOUND": 404,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "RESOURCE_EXHAUSTED": 429,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}


def grpc_status_to_http(code_name: str) -> int:
    """The HTTP status for a gRPC status code name (``grpc.StatusCode.X.name``); 500 else."""
    return _GRPC_TO_HTTP.get(code_name, 500)


# ---------------------------------------------------------------- requests

NonNegInt = Annotated[int, Field(ge=0)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """The fields both endpoints share. Defaults follow OpenAI's API."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    user: str | None = None  # an end-user id: logged with the request, nothing else
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1)
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    stop_token_ids: list[NonNegInt] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    # KV eviction (docs/eviction.md); the engine validates both and names a bad one
    kv_budget: int | None = Field(None, ge=1, le=2**31 - 1)
    kv_policy: str | None = Field(None, max_length=32)
    repetition_penalty: float | None = None
    best_of: int | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: a text, a list of token ids, or a list of
    either (one choice set per prompt)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return []
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class OtherPart(BaseModel):
    """A content part kvmesh cannot read (an image, audio, a file): rejected by name."""

    model_config = ConfigDict(extra="allow")
    type: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | OtherPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: ``messages`` go through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extras
    add_generation_prompt: bool = True
    echo: bool = False


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's shape): a ``prompt``, or chat ``messages`` through the
    template."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[NonNegInt]


# ---------------------------------------------------------------- responses (plain dicts)
#
# The responses are built as dicts by protos/openai_app.py in OpenAI's field order: they are
# written once per token on a stream, and a Pydantic model per chunk would cost more than the
# rest of the HTTP layer. tests/integration/test_http_worker.py parses every one of them with
# the official ``openai`` client's own models.


def usage_dict(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    cached_by_tier: dict[str, int],
) -> dict[str, Any]:
    """OpenAI's usage object, ``prompt_tokens_details.cached_tokens`` always filled, with
    kvmesh's ``cached_tokens_by_tier`` beside it."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "cached_tokens_by_tier": dict(cached_by_tier),
    }
