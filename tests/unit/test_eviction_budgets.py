"""The eviction reference's budget allocation (bench/eviction_budgets.py: Ada-KV across heads,
PyramidKV by depth, one ranking over every layer) and its oracle / per-allocation SnapKV
(bench/eviction_reference.py) against plain loops on small random tensors. Integer scores
make ties common, so the tie rule (the lower index, then the lower row) is exercised."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import eviction_budgets as eb  # noqa: E402


def loop_top(row: list[float], k: int) -> set[int]:
    return set(sorted(range(len(row)), key=lambda j: (-row[j], j))[:k])


def loop_across(scores: list[list[float]], total: int, floor: int) -> list[set[int]]:
    kept = [loop_top(row, floor) for row in scores]
    rest = [
        (-row[j], h, j) for h, row in enumerate(scores) for j in range(len(row)) if j not in kept[h]
    ]
    for _, h, j in sorted(rest)[: total - floor * len(scores)]:
        kept[h].add(j)
    return kept


def as_sets(mask: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(r).flatten().tolist()) for r in mask]


def loop_pyramid(layers: int, per_head: int, beta: float) -> list[int]:
    lo = int(per_head // beta)
    hi = 2 * per_head - lo
    exact = [hi - i * (hi - lo) / (layers - 1) for i in range(layers)]
    counts = [int(x) for x in exact]
    while sum(counts) < layers * per_head:  # one more to the largest remaining fraction
        best = max(range(layers), key=lambda i: (exact[i] - counts[i], -i))
        counts[best] += 1
        exact[best] = counts[best]  # its fraction is used up
    return counts


def rand_scores(g, *shape) -> torch.Tensor:
    return torch.randint(0, 5, shape, generator=g).float()


@pytest.mark.parametrize("seed", range(4))
def test_top_per_row_and_across_match_loops(seed):
    g = torch.Generator().manual_seed(seed)
    s = rand_scores(g, 3, 11)
    rows = s.tolist()
    for k in (0, 1, 4, 11):
        assert as_sets(eb.top_per_row(s, k)) == [loop_top(r, k) for r in rows]
    for floor in (0, 2, 5):
        for total in (3 * floor, 3 * floor + 1, 13, 33):
            if total < 3 * floor:
                continue
            got = eb.top_across(s, total, floor)
            assert int(got.sum()) == total
            assert as_sets(got) == loop_across(rows, total, floor), (floor, total)


def test_top_across_refuses_an_impossible_total():
    with pytest.raises(ValueError, match="total=40"):
        eb.top_across(torch.zeros(3, 11), 40)


@pytest.mark.parametrize(
    "layers,per_head,beta", [(30, 352, 20), (30, 192, 2), (7, 13, 5), (2, 9, 3)]
)
def test_pyramid_counts(layers, per_head, beta):
    got = eb.pyramid_counts(layers, per_head, beta)
    assert got == loop_pyramid(layers, per_head, beta)
    assert sum(got) == layers * per_head
    assert all(a >= b for a, b in zip(got, got[1:]))  # falls with depth
    assert got[-1] == int(per_head // beta) and got[0] == 2 * per_head - got[-1]


@pytest.mark.parametrize("alloc", eb.ALLOCS)
def test_allocate_matches_loops(alloc):
    g = torch.Generator().manual_seed(7)
    L, H, N, per_head, floor, beta = 4, 3, 12, 5, 0.4, 3
    scores = [rand_scores(g, H, N) for _ in range(L)]
    got = [as_sets(m) for m in eb.allocate(scores, per_head, alloc, floor, beta)]
    lists = [s.tolist() for s in scores]
    counts = loop_pyramid(L, per_head, beta) if alloc.startswith("pyramid") else [per_head] * L
    if alloc in ("uniform", "pyramid"):
        want = [[loop_top(r, n) for r in rows] for rows, n in zip(lists, counts)]
    elif alloc in ("ada", "pyramid_ada"):
        want = [loop_across(rows, H * n, int(floor * n)) for rows, n in zip(lists, counts)]
    else:  # model: every layer's heads in one ranking, layer-major
        flat = loop_across([r for rows in lists for r in rows], L * H * per_head, 2)
        want = [flat[i * H : (i + 1) * H] for i in range(L)]
    assert got == want
    assert sum(len(s) for layer in got for s in layer) == L * H * per_head


def test_allocate_refuses_bad_input():
    with pytest.raises(ValueError, match="alloc='nope'"):
        eb.allocate([torch.zeros(3, 8)], 4, "nope")
    with pytest.raises(ValueError, match="per_head=9"):
        eb.allocate([torch.zeros(3, 8)], 9)


def test_reference_oracles_and_snapkv_allocation():
    """The reference's oracle (group-summed continuation attention), per-query oracle, and
    SnapKV with Ada-KV allocation, on a fake record of 2 layers, 6 query heads, 3 KV heads."""
    import eviction_reference as ref

    g = torch.Generator().manual_seed(3)
    Hq, Hkv, P, T, budget = 6, 3, 40, 5, 12
    rec = {}
    for layer in range(2):
        rows = torch.rand(Hq, T, P, generator=g)  # the continuation's rows over the prompt
        win = torch.rand(Hq, ref.REC_ROWS, P, generator=g)
        rec[layer] = (win, win.sum(1), rows.sum(1), rows)
    for layer, m in ref.oracle_keep(rec, budget, Hkv=Hkv).items():
        summed = rec[layer][2].view(Hkv, 2, P).sum(1).tolist()
        assert as_sets(m) == [loop_top(r, budget) for r in summed]
    for layer, m in ref.oracle_query_keep(rec, budget, Hkv=Hkv).items():
        rows = rec[layer][3]
        for h in range(Hkv):
            for t in range(T):
                grp = (rows[2 * h, t] + rows[2 * h + 1, t]).tolist()
                assert set(torch.nonzero(m[h, t]).flatten().tolist()) == loop_top(grp, budget)
    ada = ref.snapkv_keep(rec, P, budget, window=4, kernel=1, pool="max", Hkv=Hkv, alloc="ada")
    for layer, m in ada.items():
        votes = rec[layer][0][:, -4:, : P - 4].sum(1).view(Hkv, 2, P - 4).sum(1).tolist()
        want = loop_across(votes, Hkv * (budget - 4), 0)
        assert as_sets(m[:, : P - 4]) == want
        assert bool(m[:, P - 4 :].all())  # every head keeps the window
    assert ref.mass_kept(rec, ref.oracle_keep(rec, P, Hkv=Hkv), Hkv=Hkv) == pytest.approx(1.0)
    orc = ref.oracle_keep(rec, budget, Hkv=Hkv)
    both = sum(len(a & b) for L in rec for a, b in zip(as_sets(ada[L]), as_sets(orc[L])))
    assert ref.oracle_recall(ada, orc) == pytest.approx(both / (2 * Hkv * budget))
    assert ref.oracle_recall(orc, orc) == 1.0
    assert ref.oracle_recall(ref.oracle_query_keep(rec, budget, Hkv=Hkv), orc) is None
