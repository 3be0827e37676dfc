"""Per-request sampling parameters, validated on construction.

Validation rejects what cannot work, naming the field: a ValueError here is INVALID_ARGUMENT
on the wire. Every list a client controls has a bound, because the engine thread walks them on
every step (stop strings) or per request (stop token ids), and one request must not be able
to slow the others down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# vLLM's epsilon: a temperature below it is greedy. Dividing logits by a smaller one overflows
# float32 to inf, and softmax of inf is NaN (the crash this bound closes).
SAMPLING_EPS = 1e-5
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_CACHE_SALT_CHARS = 1024
MAX_TOP_LOGPROBS = 20  # OpenAI's bound
# KV eviction (docs/eviction.md): the policies, and the smallest budget (sinks and windows
# need room)
KV_POLICIES = ("snapkv", "h2o", "streaming", "random", "scissorhands")
# a request's explicit opt-out: its full cache, whatever the engine's default budget
KV_POLICY_NONE = "none"
MIN_KV_BUDGET = 8
_INT64 = (-(2**63), 2**64)  # torch.Generator.manual_seed takes [-2**63, 2**64)
_INT32_MAX = 2**31 - 1


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """vLLM-shaped sampling parameters.

    ``temperature`` below ``SAMPLING_EPS`` (1e-5; 0 included) is greedy. ``top_k=0`` (or -1)
    and ``top_p=1`` disable those filters. ``seed`` makes a sampled request reproducible on
    its own, whatever it is batched with. ``logprobs=True`` returns the log-probability of
    each sampled token under the model's unmodified distribution (before temperature, top-k
    and top-p); ``top_logprobs=k`` (with ``logprobs``, at most ``MAX_TOP_LOGPROBS``) also
    the k most likely tokens at each position. ``min_tokens`` (vLLM's): EOS and
    ``stop_token_ids`` cannot be sampled before that many output tokens (their logits are
    masked, and the logprobs of those steps are under the masked distribution); stop strings
    still end the output.

    ``kv_budget`` bounds the request's KV cache to that many tokens and ``kv_policy``
    (``snapkv``, ``h2o``, ``streaming``, ``scissorhands``, or the ``random`` baseline) says
    which it keeps
    (docs/eviction.md); either unset takes the engine's default (``kv_budget=None`` with
    no engine default: no eviction). ``kv_policy="none"`` opts out: the full cache, even
    on an engine with a default budget (it takes no ``kv_budget``). Like ``cache_salt``,
    it rides with these parameters.

    ``cache_salt`` (vLLM's name and meaning) is mixed into the hash of the prompt's first
    page, so cached pages are shared only between requests with the same salt: a tenant's
    salt keeps other tenants from learning, through cache hits, what it sent
    (docs/security.md). It is not sampling, but it travels with these parameters so every
    path into the engine (gRPC, the router, HTTP, the offline API) carries it unchanged.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = field(default=None, repr=False)  # a tenant secret: not in logs
    kv_budget: int | None = None
    kv_policy: str | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "temperature", _finite_float("temperature", self.temperature))
        object.__setattr__(self, "top_p", _finite_float("top_p", self.top_p))
        if self.cache_salt == "":
            object.__setattr__(self, "cache_salt", None)  # the wire's "unset"
        if self.kv_policy == "":
            object.__setattr__(self, "kv_policy", None)  # the wire's "unset"
        if self.kv_budget == 0 and not isinstance(self.kv_budget, bool):
            object.__setattr__(self, "kv_budget", None)  # the wire's "unset"
        self._validate()

    def _validate(self) -> None:
        if not _is_int(self.max_tokens):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if not 1 <= self.max_tokens <= _INT32_MAX:
            raise ValueError(f"max_tokens must be in [1, {_INT32_MAX}], got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= _INT32_MAX:
            raise ValueError(
                f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}"
            )
        if self.seed is not None and (
            not _is_int(self.seed) or not _INT64[0] <= self.seed < _INT64[1]
        ):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(
                f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are accepted"
            )
        for s in self.stop:
            if not isinstance(s, str):
                raise ValueError(f"stop strings must be str, got {type(s).__name__} {s!r}")
            if not s:
                raise ValueError("stop strings must be non-empty")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"stop strings may have at most {MAX_STOP_STRING_CHARS} characters, "
                    f"got one of {len(s)}"
                )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids has {len(self.stop_token_ids)} ids; at most "
                f"{MAX_STOP_TOKEN_IDS} are accepted"
            )
        bad = [t for t in self.stop_token_ids if not _is_int(t) or not 0 <= t <= _INT32_MAX]
        if bad:
            raise ValueError(f"stop_token_ids must be integers >= 0, got {bad[:5]}")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                f"got {self.top_logprobs!r}"
            )
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=True")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}"
            )
        for name in ("ignore_eos", "logprobs", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(
                f"skip_special_tokens must be a bool, got {self.skip_special_tokens!r}"
            )
        validate_kv_budget(self.kv_budget, self.kv_policy)
        salt = self.cache_salt
        if salt is not None:
            if not isinstance(salt, str):
                raise ValueError(f"cache_salt must be a string, got {type(salt).__name__}")
            if len(salt) > MAX_CACHE_SALT_CHARS:
                raise ValueError(
                    f"cache_salt may have at most {MAX_CACHE_SALT_CHARS} characters, "
                    f"got {len(salt)}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def validate_kv_budget(budget, policy, *, opt_out: bool = True) -> None:
    """Raise ValueError naming a bad ``kv_budget`` / ``kv_policy`` (None: unset).
    ``opt_out``: ``kv_policy="none"`` (a request's opt-out) is accepted, without a budget."""
    if budget is not None and (not _is_int(budget) or not MIN_KV_BUDGET <= budget <= _INT32_MAX):
        raise ValueError(
            f"kv_budget must be an integer in [{MIN_KV_BUDGET}, {_INT32_MAX}] (tokens of KV "
            f"cache kept), or unset; got {budget!r}"
        )
    if opt_out and policy == KV_POLICY_NONE:
        if budget is not None:
            raise ValueError(
                f"kv_policy='none' keeps the full cache and takes no kv_budget; got "
                f"kv_budget={budget} (unset one of the two)"
            )
        return
    if not opt_out and policy is None and budget is not None:
        # an engine default: a budget with no policy would fail every request that uses it
        raise ValueError(
            f"kv_policy must be one of {', '.join(KV_POLICIES)} when kv_budget is set; "
            f"got kv_policy=None with kv_budget={budget}"
        )
    if policy is not None and policy not in KV_POLICIES:
        accepted = (*KV_POLICIES, KV_POLICY_NONE) if opt_out else KV_POLICIES
        raise ValueError(f"kv_policy must be one of {', '.join(accepted)}; got {policy!r}")
