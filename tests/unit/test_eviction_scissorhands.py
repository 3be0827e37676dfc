"""Scissorhands (worker/eviction/scissorhands.py): its counts of above-average attention,
collected by the engine's observation path, and its kept set, against a loop-by-loop
reference on small random tensors."""

import math

import pytest
import torch
from helpers import ref_softmax_row, ref_top_and_recent

from kvmesh.worker.attention.base import LayerCache
from kvmesh.worker.eviction.manager import EvictionManager, EvictionState, _Observed
from kvmesh.worker.eviction.policies import make_policy
from kvmesh.worker.eviction.scissorhands import Scissorhands
from kvmesh.worker.sampling_params import SamplingParams

L, HKV, G, D, BS = 2, 2, 3, 8, 4


def ref_counts(q: torch.Tensor, k: torch.Tensor, q0: int) -> list[list[int]]:
    """q (m, HKV*G, D) at slots q0.., k (N, HKV, D): per KV head and slot, how many of its
    group's queries paid the slot more than 1 / (slots the query sees)."""
    m, N = q.shape[0], k.shape[0]
    out = [[0] * N for _ in range(HKV)]
    for i in range(m):
        qs = q0 + i
        for hq in range(HKV * G):
            h = hq // G
            for j, w in enumerate(ref_softmax_row(q[i, hq], k[:, h], qs, D)):
                if w > 1.0 / (qs + 1):
                    out[h][j] += 1
    return out


def _observe(policy, q_layers, k_layers, q0: int) -> torch.Tensor:
    """The engine's observation path (EvictionManager.observe, then the step's flush) over
    float caches holding k_layers; returns the request's scores."""
    N = k_layers[0].shape[0]
    P = -(-N // BS)
    caches = []
    for k in k_layers:
        pages = torch.zeros(P + 1, BS, HKV, D)
        pages.view(-1, HKV, D)[BS : BS + N] = k  # page 0: the null page
        caches.append(LayerCache("fp32", {"k": pages, "v": torch.zeros_like(pages)}))
    mgr = EvictionManager.__new__(EvictionManager)
    mgr.num_layers, mgr.failures = len(k_layers), {}
    st = EvictionState(policy, torch.zeros(L, HKV, N))
    m = q_layers[0].shape[0]
    mgr._observed = [_Observed(st, 0, m, q0, N, torch.arange(1, P + 1), -1)]
    for layer, q in enumerate(q_layers):
        mgr.observe(layer, q, caches[layer], 1 / math.sqrt(D))
    mgr._flush()
    return st.scores


@pytest.mark.parametrize("seed", range(4))
def test_scissorhands_keeps_the_references_set(seed):
    g = torch.Generator().manual_seed(seed)
    N, m, budget = 30, 12, 14
    ks = [torch.randn(N, HKV, D, generator=g) for _ in range(L)]
    qs = [torch.randn(m, HKV * G, D, generator=g) * 2 for _ in range(L)]
    pol = make_policy("scissorhands", budget)  # registered with the others
    assert isinstance(pol, Scissorhands) and pol.observe_rows(range(3, 9), 20) == range(3, 9)
    scores = _observe(pol, qs, ks, N - m)
    keep = pol.select(scores, after_prefill=True)
    assert keep.shape == (L, HKV, budget)
    for layer in range(L):
        counts = ref_counts(qs[layer], ks[layer], N - m)
        assert scores[layer].tolist() == [[float(c) for c in row] for row in counts]
        for h in range(HKV):
            ref = ref_top_and_recent(counts[h], budget, pol.recent)
            assert keep[layer, h].tolist() == ref, (layer, h)


def test_scissorhands_is_a_kv_policy_on_the_api():
    sp = SamplingParams(kv_budget=64, kv_policy="scissorhands")
    assert sp.kv_policy == "scissorhands"
