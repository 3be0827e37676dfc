"""Eviction policies: which cached tokens a request keeps under its KV budget.

Every policy answers one question, ``select``: given the request's per-slot scores (the
attention its queries paid each cached token, per layer and KV head) and its cache length,
which slots to keep. The answer is an index tensor ``(L, Hkv, K)`` of slots in ascending
order, per layer and KV head: heads may keep different tokens, since a key carries its
position (rotary is applied before the cache) and attention never needs it again.

The selection functions are plain torch on small tensors, so each can be checked against a
loop-by-loop reference (tests/unit/test_eviction_policies.py). Ties in a score go to the
lower slot (older token), always.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

POLICIES = ("snapkv", "h2o", "streaming", "random")  # the ones defined in this module
# every name make_policy builds (worker/eviction/scissorhands.py adds its own); the requests'
# list is kvmesh.worker.sampling_params.KV_POLICIES, which a test holds equal to this one
MAKE_POLICY_NAMES = (*POLICIES, "scissorhands")
SNAPKV_POOLS = ("avg", "max")


def top_and_recent(scores: torch.Tensor, budget: int, recent: int) -> torch.Tensor:
    """Keep the last ``recent`` slots and the ``budget - recent`` highest-scoring others.

    scores: (..., N) -> kept slots (..., min(budget, N)) ascending. Ties go to the lower slot.
    """
    n = scores.shape[-1]
    if budget >= n:
        return torch.arange(n).expand(*scores.shape[:-1], n).clone()
    recent = min(recent, budget)
    older = n - recent
    n_top = budget - recent
    # stable descending sort: among equal scores the lower slot comes first
    order = torch.sort(scores[..., :older], dim=-1, descending=True, stable=True).indices
    top = order[..., :n_top]
    tail = torch.arange(older, n).expand(*scores.shape[:-1], recent)
    return torch.sort(torch.cat([top, tail], dim=-1), dim=-1).values


def snapkv_votes(window_attn: torch.Tensor, window: int, kernel: int, pool: str = "avg"):
    """SnapKV's votes: ``window_attn`` (L, Hkv, N) is the attention the prompt's last
    ``window`` queries paid each slot, summed over the queries and over each KV head's
    group of query heads. The votes of the slots before the window are smoothed over
    ``kernel`` neighbours (stride 1, same length; at the edges only the slots that exist):
    their average (``pool="avg"``) or their maximum (``"max"``: a voted slot lifts its
    neighbours as high as itself). The window's own slots are kept anyway. Returns
    (L, Hkv, N - window)."""
    if pool not in SNAPKV_POOLS:
        raise ValueError(f"snapkv pool must be one of {SNAPKV_POOLS}, got {pool!r}")
    n = window_attn.shape[-1]
    pre = window_attn[..., : max(n - window, 0)]
    if pre.shape[-1] == 0 or kernel <= 1:
        return pre.clone()
    shape = pre.shape
    flat = pre.reshape(-1, 1, shape[-1])
    if pool == "avg":
        pooled = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2, count_include_pad=False)
    else:
        pooled = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    return pooled[..., : shape[-1]].reshape(shape)


def streaming_keep(n: int, budget: int, num_sinks: int) -> torch.Tensor:
    """StreamingLLM: the first ``num_sinks`` slots and the most recent ``budget - sinks``."""
    if budget >= n:
        return torch.arange(n)
    sinks = min(num_sinks, budget)
    return torch.cat([torch.arange(sinks), torch.arange(n - (budget - sinks), n)])


class EvictionPolicy(ABC):
    """One policy for one request. ``observe_rows`` says which of the request's queries the
    engine must show it (their attention weights, summed into the request's scores)."""

    name = "abstract"

    def __init__(self, budget: int):
        self.budget = budget

    @abstractmethod
    def observe_rows(self, positions: range, num_prompt_tokens: int) -> range | None:
        """The positions (a sub-range of ``positions``, this step's new tokens) whose
        attention weights the policy reads, or None for none."""

    @abstractmethod
    def select(self, scores: torch.Tensor, after_prefill: bool) -> torch.Tensor:
        """scores: (L, Hkv, N) accumulated attention per slot. Returns kept slots
        (L, Hkv, K), ascending. ``after_prefill``: the first compaction of this run, right
        after the prompt (SnapKV votes then; later ones are during decode)."""

    def kept_scores(self, scores: torch.Tensor, keep: torch.Tensor, after_prefill: bool):
        """The scores the kept slots carry on (default: their own)."""
        return scores.gather(-1, keep)


class StreamingLLM(EvictionPolicy):
    """Attention sinks (the first ``num_sinks`` tokens) plus a window of the most recent."""

    name = "streaming"

    def __init__(self, budget: int, num_sinks: int = 4):
        super().__init__(budget)
        self.num_sinks = num_sinks

    def observe_rows(self, positions, num_prompt_tokens):
        return None

    def select(self, scores, after_prefill):
        L, H, N = scores.shape
        return streaming_keep(N, self.budget, self.num_sinks).expand(L, H, -1).clone()


class SnapKV(EvictionPolicy):
    """After prefill, the prompt's last ``window`` queries vote (pooled over ``kernel``
    neighbours, a GQA group voting together) for the prompt slots each KV head keeps; the
    window itself is kept. In decode, the slots past the budget go lowest vote first, the
    last ``window`` slots kept; generated tokens carry no vote.

    ``pool``: how votes are smoothed over ``kernel`` neighbours, ``avg`` (the paper, with
    kernel 5) or ``max``. The defaults (kernel 13, max) were chosen by measurement on
    SmolLM2 (docs/eviction.md): a voted token keeps its neighbours, so a fact that spans
    several tokens (a number, digit by digit) is kept whole. ``recent``: the share of the
    budget kept as the most recent prompt tokens (at least the window; 0: just the window,
    as in the paper); only the older slots are chosen by vote. ``sinks``: the first
    ``sinks`` prompt slots (StreamingLLM's attention sinks) are always kept, in decode too,
    whatever their vote (0: none protected, as in the paper)."""

    name = "snapkv"

    def __init__(
        self,
        budget: int,
        window: int = 32,
        kernel: int = 13,
        pool: str = "max",
        recent: float = 0.0,
        sinks: int = 0,
    ):
        super().__init__(budget)
        if pool not in SNAPKV_POOLS:
            raise ValueError(f"snapkv pool must be one of {SNAPKV_POOLS}, got {pool!r}")
        if not 0.0 <= recent <= 1.0:
            raise ValueError(f"snapkv recent must be a share of the budget in [0, 1], got {recent}")
        if sinks < 0:
            raise ValueError(f"snapkv sinks must be >= 0, got {sinks}")
        self.window = min(window, budget)
        self.kernel = kernel
        self.pool = pool
        self.tail = max(self.window, min(budget, int(budget * recent)))  # kept, not voted on
        self.sinks = min(sinks, budget - self.tail)  # kept first, not voted on

    def observe_rows(self, positions, num_prompt_tokens):
        lo = max(positions.start, num_prompt_tokens - self.window)
        hi = min(positions.stop, num_prompt_tokens)
        return range(lo, hi) if lo < hi else None

    def _votes(self, scores):
        votes = snapkv_votes(scores, self.tail, self.kernel, self.pool)
        if self.sinks:  # the sinks outrank every vote (and keep that rank in decode)
            votes[..., : self.sinks] = float("inf")
        return votes

    def select(self, scores, after_prefill):
        if after_prefill:
            votes = self._votes(scores)
            # the tail's slots (the window and any recent share): never chosen from, kept
            pad = scores.new_full((*votes.shape[:-1], scores.shape[-1] - votes.shape[-1]), 0.0)
            return top_and_recent(torch.cat([votes, pad], -1), self.budget, self.tail)
        return top_and_recent(scores, self.budget, self.tail)

    def kept_scores(self, scores, keep, after_prefill):
        if not after_prefill:
            return scores.gather(-1, keep)
        votes = self._votes(scores)
        n_pre = votes.shape[-1]
        # the tail's own slots rank with the best votes in decode (the sinks above them)
        best = votes[..., self.sinks :]
        if best.shape[-1]:
            top = best.amax(-1, keepdim=True)
        else:
            top = scores.new_zeros((*votes.shape[:-1], 1))
        full = torch.cat([votes, top.expand(*votes.shape[:-1], scores.shape[-1] - n_pre)], -1)
        return full.gather(-1, keep)


class H2O(EvictionPolicy):
    """Heavy hitters: every query's attention (a GQA group summed) accumulates per slot;
    past the budget, the lowest accumulated slots outside the last ``recent`` go."""

    name = "h2o"

    def __init__(self, budget: int, recent_ratio: float = 0.5):
        super().__init__(budget)
        self.recent = max(1, int(budget * recent_ratio))

    def observe_rows(self, positions, num_prompt_tokens):
        return positions

    def select(self, scores, after_prefill):
        return top_and_recent(scores, self.budget, self.recent)


class RandomKeep(EvictionPolicy):
    """The baseline: a uniformly random subset (seeded), the last slot kept so the newest
    token always sees itself."""

    name = "random"

    def __init__(self, budget: int, seed: int = 0):
        super().__init__(budget)
        self.gen = torch.Generator().manual_seed(seed)

    def observe_rows(self, positions, num_prompt_tokens):
        return None

    def select(self, scores, after_prefill):
        L, H, N = scores.shape
        return top_and_recent(torch.rand((L, H, N), generator=self.gen), self.budget, 1)


def first_observed(name: str, budget: int, num_prompt_tokens: int) -> int | None:
    """The first prompt position whose attention weights policy ``name`` reads (None: it
    reads none): those must be computed, not served from a prefix cache."""
    rows = make_policy(name, budget).observe_rows(range(num_prompt_tokens), num_prompt_tokens)
    return rows.start if rows else None


def make_policy(name: str, budget: int) -> EvictionPolicy:
    if name == "snapkv":
        return SnapKV(budget)
    if name == "h2o":
        return H2O(budget)
    if name == "streaming":
        return StreamingLLM(budget)
    if name == "random":
        return RandomKeep(budget)
    if name == "scissorhands":  # worker/eviction/scissorhands.py (it imports this module)
        from kvmesh.worker.eviction.scissorhands import Scissorhands

        return Scissorhands(budget)
    raise ValueError(f"unknown kv_policy {name!r}; accepted: {', '.join(MAKE_POLICY_NAMES)}")
