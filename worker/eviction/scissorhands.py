"""Scissorhands: keep the tokens whose importance persists (docs/eviction.md).

The persistence-of-importance hypothesis: a token that received more than its share of
attention from many past queries will keep receiving it. So every query votes: for each
slot it can see, 1 when its attention there is above average (more than 1 / the number of
slots it sees), 0 otherwise, summed over a KV head's group of query heads. A slot's score is
its count of such votes; past the budget, the lowest-counted slots outside the last
``recent`` go (the same ``top_and_recent`` rule as H2O, on counts instead of sums).

It reads every query's attention, like H2O: same cost, one more comparison. The counts
run over every query the request has seen (the paper's fixed history window is not kept:
the recent window protects the newest tokens, which have had few queries to vote yet).
"""

from __future__ import annotations

import torch

from kvmesh.worker.eviction.policies import EvictionPolicy, top_and_recent


class Scissorhands(EvictionPolicy):
    """Counts of above-average attention per slot; keeps the top counts plus the recent."""

    name = "scissorhands"

    def __init__(self, budget: int, recent_ratio: float = 0.5):
        super().__init__(budget)
        self.recent = max(1, int(budget * recent_ratio))

    def observe_rows(self, positions, num_prompt_tokens):
        return positions

    def weigh(self, probs: torch.Tensor, qslot: torch.Tensor) -> torch.Tensor:
        """probs: (Hkv, G, m, N) attention of m queries at cache slots ``qslot`` (m,), each
        seeing slots 0..qslot. Returns (Hkv, N): per slot, how many of the group's queries
        paid it more than the average share."""
        share = 1.0 / (qslot + 1).to(probs.dtype)  # (m,)
        return (probs > share[:, None]).sum(dim=(1, 2)).to(torch.float32)

    def select(self, scores, after_prefill):
        return top_and_recent(scores, self.budget, self.recent)
