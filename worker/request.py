"""A request's state as it moves through the scheduler and the cache."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from kvmesh.kvstore.hashing import hash_pages, root_hash
from kvmesh.worker.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # waiting while the KV connector promotes more of its prefix from the tiers (or peers)
    # into the device pool; the scheduler passes over it until the promotion is done
    PROMOTING = "promoting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # this request alone failed (non-finite logits, a sampling or detokenizer error, ...);
    # Request.error says why, and the engine and the other requests go on
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_size: int
    model_fp: str
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # set when first scheduled; -1 until then
    num_preemptions: int = 0
    first_token_time: float | None = None
    first_scheduled_time: float | None = None  # its first admission (queue time ends)
    last_token_time: float | None = None  # set by the metrics (inter-token latency)
    stop_reason: int | str | None = None
    error: str | None = None  # why it finished with FINISHED_ERROR
    # KV eviction (worker/eviction): its budget in cached tokens (None: keep everything) and
    # policy, resolved from its params and the engine default; num_evicted tokens have left
    # its cache, whose length is num_computed_tokens - num_evicted (positions go on from
    # num_computed_tokens). Both reset when it is preempted.
    kv_budget: int | None = None
    kv_policy: str | None = None
    num_evicted: int = 0

    def __post_init__(self):
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []  # per output token, if asked
        # the salt is mixed into the first page's hash, so it reaches every page's
        self.page_hashes: list[bytes] = hash_pages(
            self.all_token_ids, self.block_size, self.model_fp, cache_salt=self.params.cache_salt
        )
        self.generator: torch.Generator | None = None
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)
        self.detokenizer = None  # set by the engine when it has a tokenizer
        self.cached_by_tier: dict[str, int] = {}  # prompt tokens served per tier
        self.promoted_from: dict[bytes, str] = {}  # page hash -> tier it was promoted from
        self.num_promotions = 0  # promotions started from the tiered store / peers
        self.promoted_run = -1  # pages its prefix run reached after its last promotion
        self.peer_hints: list[str] = []  # KVTransfer addresses that may hold its pages
        self.text = ""
        self.kv_state = None  # worker.eviction's EvictionState, while it runs with a budget

    @property
    def cache_len(self) -> int:
        """Tokens in its KV cache: its computed ones less those evicted."""
        return self.num_computed_tokens - self.num_evicted

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def max_cached_pages(self) -> int:
        """How many of its first pages a prefix cache (or a tier) may serve: all but the
        last token's, and none of the tokens whose attention an eviction policy must see
        (SnapKV's observation window, every H2O query): a cached page is not recomputed."""
        limit = self.num_tokens - 1
        if self.kv_budget is not None:
            from kvmesh.worker.eviction.policies import first_observed

            first = first_observed(self.kv_policy, self.kv_budget, self.num_prompt_tokens)
            if first is not None:
                limit = min(limit, first)
        return limit // self.block_size

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.num_tokens // self.block_size > len(self.page_hashes):
            n = len(self.page_hashes)
            parent = self.page_hashes[-1] if n else root_hash(self.model_fp, self.params.cache_salt)
            self.page_hashes += hash_pages(
                self.all_token_ids, self.block_size, self.model_fp, parent=parent, start_page=n
            )
