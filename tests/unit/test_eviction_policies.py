"""Each eviction policy's token selection against a plain, loop-by-loop torch reference."""

import math

import pytest
import torch
from helpers import ref_softmax_row, ref_top_and_recent

from kvmesh.worker.attention.base import LayerCache
from kvmesh.worker.eviction import H2O, RandomKeep, SnapKV, StreamingLLM, make_policy
from kvmesh.worker.eviction.manager import EvictionManager, EvictionState, _Observed
from kvmesh.worker.sampling_params import SamplingParams

L, HKV, G, D = 2, 3, 3, 8  # layers, KV heads, query heads per KV head, head size


def ref_attention(q: torch.Tensor, k: torch.Tensor, qpos: list[int]) -> torch.Tensor:
    """q (m, HKV * G, D) at cache slots qpos, k (N, HKV, D): attention each KV head's
    slots got, summed over its query heads and the m queries -> (HKV, N). Loops."""
    N = k.shape[0]
    out = torch.zeros(HKV, N, dtype=torch.float64)
    for i, p in enumerate(qpos):
        for h in range(HKV * G):
            kh = h // G
            for j, w in enumerate(ref_softmax_row(q[i, h], k[:, kh], p, D)):
                out[kh, j] += w
    return out


def ref_avg_pool(x: list[float], kernel: int) -> list[float]:
    r = kernel // 2
    return [
        sum(x[max(0, i - r) : min(len(x), i + r + 1)]) / (min(len(x), i + r + 1) - max(0, i - r))
        for i in range(len(x))
    ]


def ref_max_pool(x: list[float], kernel: int) -> list[float]:
    r = kernel // 2
    return [max(x[max(0, i - r) : min(len(x), i + r + 1)]) for i in range(len(x))]


def observe_all(scores: torch.Tensor, q_layers, k_layers, qpos0: int, bs: int = 4) -> None:
    """Run EvictionManager.observe over float-format caches holding k_layers."""
    N = k_layers[0].shape[0]
    P = -(-N // bs)
    caches = []
    for k in k_layers:
        pages = torch.zeros(P + 1, bs, HKV, D)
        pages.view(-1, HKV, D)[bs : bs + N] = k  # page 0: the null page
        caches.append(LayerCache("fp32", {"k": pages, "v": torch.zeros_like(pages)}))
    mgr = EvictionManager.__new__(EvictionManager)
    mgr.num_layers, mgr.failures = len(k_layers), {}
    st = EvictionState(SnapKV(8), scores)
    m = q_layers[0].shape[0]
    table = torch.arange(1, P + 1)
    mgr._observed = [_Observed(st, 0, m, qpos0, N, table, -1)]
    for layer, q in enumerate(q_layers):
        mgr.observe(layer, q, caches[layer], 1 / math.sqrt(D))
    mgr._flush()  # the step's one move of the observed attention into the scores


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_observe_accumulates_the_reference_attention(seed):
    g = torch.Generator().manual_seed(seed)
    N, m = 13, 5
    ks = [torch.randn(N, HKV, D, generator=g) for _ in range(L)]
    qs = [torch.randn(m, HKV * G, D, generator=g) for _ in range(L)]
    scores = torch.zeros(L, HKV, N)
    observe_all(scores, qs, ks, N - m)
    for layer in range(L):
        ref = ref_attention(qs[layer], ks[layer], list(range(N - m, N)))
        torch.testing.assert_close(scores[layer].double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "seed,kernel,pool,recent,sinks",
    [
        (0, 5, "avg", 0, 0),
        (1, 5, "avg", 0, 0),
        (2, 7, "avg", 0, 0),
        (3, 7, "max", 0, 0),
        (4, 13, "max", 0.5, 0),
        (5, 13, "max", 0, 4),
        (6, 5, "avg", 0.5, 3),
    ],
)
def test_snapkv_keeps_the_references_set(seed, kernel, pool, recent, sinks):
    g = torch.Generator().manual_seed(seed)
    N, window, budget = 40, 6, 17
    ks = [torch.randn(N, HKV, D, generator=g) for _ in range(L)]
    qs = [torch.randn(window, HKV * G, D, generator=g) for _ in range(L)]
    scores = torch.zeros(L, HKV, N)
    observe_all(scores, qs, ks, N - window)
    policy = SnapKV(budget, window=window, kernel=kernel, pool=pool, recent=recent, sinks=sinks)
    tail = max(window, int(budget * recent))  # kept as the most recent, not voted on
    keep = policy.select(scores, after_prefill=True)
    assert keep.shape == (L, HKV, budget)
    for layer in range(L):
        votes = ref_attention(qs[layer], ks[layer], list(range(N - window, N)))
        for h in range(HKV):
            pool_ref = ref_avg_pool if pool == "avg" else ref_max_pool
            pooled = pool_ref(votes[h, : N - tail].tolist(), kernel)
            # the sinks kept first, the rest by pooled vote (pooled over the sinks too)
            voted = range(sinks, N - tail)
            top = sorted(voted, key=lambda i: (-pooled[i], i))[: budget - tail - sinks]
            ref = sorted(list(range(sinks)) + top + list(range(N - tail, N)))
            assert keep[layer, h].tolist() == ref, (layer, h)
    if sinks:  # in decode the sinks outrank every other kept slot: they stay
        carried = policy.kept_scores(scores, keep, after_prefill=True)
        again = SnapKV(budget - 5, window=window, kernel=kernel, pool=pool, recent=recent)
        kept2 = keep.gather(-1, again.select(carried, after_prefill=False))
        assert (kept2[..., :sinks] == torch.arange(sinks)).all()


@pytest.mark.parametrize("seed", range(4))
def test_h2o_keeps_heavy_hitters_and_the_recent_window(seed):
    g = torch.Generator().manual_seed(seed)
    N0, steps, budget = 20, 6, 12
    ks = [torch.randn(N0 + steps, HKV, D, generator=g) for _ in range(L)]
    scores = torch.zeros(L, HKV, N0 + steps)
    acc = torch.zeros(L, HKV, N0 + steps, dtype=torch.float64)
    # prefill: every prompt query; then one query per decode step
    qs = [torch.randn(N0, HKV * G, D, generator=g) for _ in range(L)]
    observe_all(scores[..., :N0], qs, [k[:N0] for k in ks], 0)
    for layer in range(L):
        acc[layer, :, :N0] += ref_attention(qs[layer], ks[layer][:N0], list(range(N0)))
    for s in range(steps):
        n = N0 + s + 1
        qs = [torch.randn(1, HKV * G, D, generator=g) for _ in range(L)]
        observe_all(scores[..., :n], qs, [k[:n] for k in ks], n - 1)
        for layer in range(L):
            acc[layer, :, :n] += ref_attention(qs[layer], ks[layer][:n], [n - 1])
    torch.testing.assert_close(scores.double(), acc, rtol=1e-5, atol=1e-5)
    pol = H2O(budget)
    assert pol.recent == budget // 2  # the paper's split: half heavy hitters, half recent
    keep = pol.select(scores, after_prefill=False)
    for layer in range(L):
        for h in range(HKV):
            ref = ref_top_and_recent(scores[layer, h].tolist(), budget, budget // 2)
            assert keep[layer, h].tolist() == ref


@pytest.mark.parametrize("n,budget", [(30, 10), (10, 10), (9, 10), (100, 5), (6, 4)])
def test_streaming_keeps_sinks_and_recent(n, budget):
    keep = StreamingLLM(budget, num_sinks=4).select(torch.zeros(L, HKV, n), False)
    sinks = list(range(min(4, n, budget)))
    ref = list(range(n)) if budget >= n else sinks + list(range(n - (budget - len(sinks)), n))
    for layer in range(L):
        for h in range(HKV):
            assert keep[layer, h].tolist() == ref


def test_random_keep_is_seeded_and_keeps_the_newest():
    a = RandomKeep(10, seed=3).select(torch.zeros(L, HKV, 50), False)
    b = RandomKeep(10, seed=3).select(torch.zeros(L, HKV, 50), False)
    assert torch.equal(a, b) and a.shape == (L, HKV, 10)
    assert bool((a[..., -1] == 49).all())
    assert all(len(set(row.tolist())) == 10 for row in a.reshape(-1, 10))


def test_ties_go_to_the_older_slot():
    keep = H2O(4, recent_ratio=0.25).select(torch.zeros(1, 1, 10), False)
    assert keep[0, 0].tolist() == [0, 1, 2, 9]


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"kv_budget": 4}, "kv_budget must be an integer in"),
        ({"kv_budget": -3}, "kv_budget must be an integer in"),
        ({"kv_budget": 1.5}, "kv_budget must be an integer in"),
        ({"kv_budget": True}, "kv_budget must be an integer in"),
        ({"kv_budget": 64, "kv_policy": "lru"}, "kv_policy must be one of snapkv, h2o"),
    ],
)
def test_bad_budgets_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_unset_on_the_wire_is_unset():
    p = SamplingParams(kv_budget=0, kv_policy="")
    assert p.kv_budget is None and p.kv_policy is None
    with pytest.raises(ValueError, match="unknown kv_policy"):
        make_policy("lru", 16)


def test_every_policy_a_request_names_is_built_listed_and_labelled():
    # make_policy builds each name a request may send, its error lists them all, and the
    # metrics doc names each as a `policy` label value (the manager exports every one)
    import pathlib
    import re

    from kvmesh.worker.eviction.policies import MAKE_POLICY_NAMES
    from kvmesh.worker.sampling_params import KV_POLICIES

    assert set(MAKE_POLICY_NAMES) == set(KV_POLICIES)
    for name in KV_POLICIES:
        assert make_policy(name, 16) is not None
    with pytest.raises(ValueError, match="unknown kv_policy") as e:
        make_policy("lru", 16)
    assert all(name in str(e.value) for name in KV_POLICIES), str(e.value)
    doc = (pathlib.Path(__file__).parents[2] / "docs" / "metrics.md").read_text()
    labels = re.search(r"`policy` \(([^:]*):", doc)
    assert labels, "docs/metrics.md: the eviction `policy` label values are not listed"
    listed = set(re.findall(r"`(\w+)`", labels.group(1)))
    assert listed == set(KV_POLICIES), listed
