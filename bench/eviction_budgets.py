"""Budget allocation for the eviction reference (``eviction_reference.py``): which slots each
layer and KV head keeps when the counts may differ between heads (Ada-KV) or layers
(PyramidKV), and the oracle bounds. Pure torch, no model: the kept sets are bool masks, so a
head keeping 500 slots and another 268 is just two masks.

Every selection ranks by score, ties going to the lower index (the older slot; across rows of
one ranking, the lower row): a stable descending sort.

* ``uniform``: every layer and head keeps ``per_head`` (SnapKV as published).
* ``ada``: Ada-KV. Per layer, the heads' scores are ranked together and the layer keeps its
  ``H * per_head`` best, so a head whose votes are concentrated gives slots to one whose
  votes are spread; each head first keeps its own ``floor * per_head`` best (the paper's
  safeguard against a head left with nothing).
* ``pyramid``: PyramidKV. Layer ``l`` of ``L`` keeps ``n_l`` per head, falling linearly from
  the first layer to the last with the same total: ``n_min = per_head // beta``,
  ``n_max = 2 * per_head - n_min``.
* ``pyramid_ada``: PyramidKV's per-layer counts, Ada-KV's ranking across heads inside a layer.
* ``model``: one ranking over every layer and head (``L * H * per_head`` slots in all),
  ``floor`` per head as in ``ada``.
"""

from __future__ import annotations

import torch

ALLOCS = ("uniform", "ada", "pyramid", "pyramid_ada", "model")


def top_per_row(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores (..., N) -> bool (..., N): each row's ``k`` highest, ties to the lower index."""
    k = max(0, min(k, scores.shape[-1]))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    keep = torch.zeros(scores.shape, dtype=torch.bool)
    return keep.scatter_(-1, order, True)


def top_across(scores: torch.Tensor, total: int, floor: int = 0) -> torch.Tensor:
    """scores (H, N) -> bool (H, N) with ``total`` True: each row its own ``floor`` best,
    then the remaining ``total - H * floor`` by one ranking over every row's other entries
    (flattened row-major, so ties go to the lower row, then the lower index)."""
    H, N = scores.shape
    floor = max(0, min(floor, N))
    if not 0 <= total - H * floor <= H * N - H * floor:
        raise ValueError(f"total={total} must be within [{H * floor}, {H * N}] (H={H}, N={N})")
    keep = top_per_row(scores, floor)
    rest = scores.masked_fill(keep, float("-inf")).flatten()  # (H * N,)
    order = torch.sort(rest, descending=True, stable=True).indices[: total - H * floor]
    keep.view(-1)[order] = True
    return keep


def pyramid_counts(layers: int, per_head: int, beta: float) -> list[int]:
    """Per-layer counts falling linearly from ``2 * per_head - n_min`` (first layer) to
    ``n_min = per_head // beta`` (last), summing to exactly ``layers * per_head``: each
    layer's real share floored, the remainder one each to the largest fractions (ties to
    the lower layer)."""
    if layers == 1:
        return [per_head]
    n_min = int(per_head // beta)
    n_max = 2 * per_head - n_min
    exact = [n_max - i * (n_max - n_min) / (layers - 1) for i in range(layers)]
    counts = [int(x) for x in exact]
    left = layers * per_head - sum(counts)
    by_frac = sorted(range(layers), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_frac[:left]:
        counts[i] += 1
    return counts


def allocate(
    scores: list[torch.Tensor],
    per_head: int,
    alloc: str = "uniform",
    floor: float = 0.0,
    beta: float = 20.0,
) -> list[torch.Tensor]:
    """scores: per layer (H, N) -> per layer bool (H, N), ``len(scores) * H * per_head``
    True in all (see the module docstring for ``alloc``)."""
    if alloc not in ALLOCS:
        raise ValueError(f"alloc={alloc!r}: expected one of {ALLOCS}")
    L = len(scores)
    H, N = scores[0].shape
    if per_head > N:
        raise ValueError(f"per_head={per_head} exceeds the {N} candidate slots")
    f = int(floor * per_head)
    if alloc == "uniform":
        return [top_per_row(s, per_head) for s in scores]
    if alloc == "model":
        flat = top_across(torch.cat(scores, 0), L * H * per_head, f)  # (L * H, N)
        return list(flat.view(L, H, N).unbind(0))
    counts = pyramid_counts(L, per_head, beta) if alloc.startswith("pyramid") else [per_head] * L
    if max(counts) > N:
        raise ValueError(f"pyramid beta={beta}: first layer's {max(counts)} exceeds {N} slots")
    if alloc == "pyramid":
        return [top_per_row(s, n) for s, n in zip(scores, counts)]
    return [top_across(s, H * n, int(floor * n)) for s, n in zip(scores, counts)]
