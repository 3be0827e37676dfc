"""The causal prefill mask shared by the torch and MLA backends (attention/base.py)."""

from __future__ import annotations

import torch

from kvmesh.worker.attention.base import PrefillSpan, causal_prefill_mask


def _span(q_len: int, ctx: int) -> PrefillSpan:
    return PrefillSpan(start=0, q_len=q_len, context_len=ctx, block_table=torch.zeros(1))


def test_causal_mask_after_cached_context():
    # 3 cached keys, then 2 new tokens at positions 3 and 4
    got = causal_prefill_mask(_span(2, 5), torch.device("cpu"))
    want = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(got, want)


def test_causal_mask_with_sliding_window():
    got = causal_prefill_mask(_span(3, 4), torch.device("cpu"), sliding_window=2)
    # positions 1, 2, 3 see themselves and the one key before
    want = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(got, want)
