"""The engine side of eviction: collect attention weights, compact caches past the budget.

Three hooks, each one line in a shared file:

- ``ObservingBackend`` wraps the attention backend. After each layer's forward it shows the
  requests that asked (SnapKV's observation window, H2O's every query) their queries'
  attention over their cache, recomputed in torch from the cache as written. The backends
  and kernels (torch, the ``cpu`` C decode kernel, Triton) are untouched and return no
  weights: a request that needs them pays for one extra pass over its own keys per layer,
  and no other request pays anything.
- ``begin_step`` (model runner): which of the step's queries each request observes.
- ``after_step`` (engine, after the forward): a request that has just computed all its
  known tokens and is past its budget is compacted: the kept slots are copied into fresh
  private pages, its old pages are released (shared prefix pages stay cached, unmodified),
  and ``Request.num_evicted`` grows by what was dropped. From then on the request's cache
  length is ``num_computed_tokens - num_evicted`` while its positions go on from
  ``num_computed_tokens``: keys carry their rotary position, so the kept ones need nothing.

When it compacts: once when the prompt is done (if the prompt is over the budget), then in
decode whenever the cache reaches ``budget + block_size`` (back down to ``budget``). So a
request holds at most ``ceil(budget / block_size) + 1`` pages between steps, and each
compaction rewrites at most a page's worth of evictions for H2O and StreamingLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvmesh.worker.attention.base import AttentionBackend, AttentionMetadata, LayerCache
from kvmesh.worker.eviction.compaction import gather_heads, read_layer, write_layer
from kvmesh.worker.eviction.policies import EvictionPolicy, make_policy
from kvmesh.worker.kv_cache import KVCacheManager
from kvmesh.worker.request import Request

logger = logging.getLogger("kvmesh.eviction")

_QUERY_CHUNK = 256  # queries scored at once: bounds the (Hq, chunk, N) weights in memory


@dataclass
class EvictionState:
    """One request's eviction bookkeeping for one run (reset when it is preempted)."""

    policy: EvictionPolicy
    scores: torch.Tensor  # (L, Hkv, N) float32 on CPU: accumulated attention per cache slot
    prefilled: bool = False  # its first compaction point (the end of the prompt) has passed


@dataclass
class _Observed:
    state: EvictionState
    q_lo: int  # rows [q_lo, q_hi) of the step's flat batch
    q_hi: int
    first_slot: int  # cache slot of the first observed query (it sees slots <= its own)
    ctx: int  # cache length after this step's writes
    table: torch.Tensor  # (P,) int64 page ids
    residual_slot: int


class EvictionManager:
    def __init__(
        self,
        caches: list[LayerCache],
        kv: KVCacheManager,
        num_kv_heads: int,
        before_write: Callable[[], None] | None = None,
    ):
        self.caches = caches
        # the engine's ``connector.save_evicted``: pages the pool evicts to give compaction
        # its private pages may still hold cached KV queued for the tiers under their
        # hashes; it is copied out before compaction overwrites them
        self.before_write = before_write
        self.kv = kv
        self.num_layers = len(caches)
        self.num_kv_heads = num_kv_heads
        self.block_size = kv.block_size
        self._observed: list[_Observed] = []
        self.num_compactions = 0
        self.num_evicted_tokens = 0
        self.num_deferred = 0  # compactions put off for want of free pages

    def wrap(self, backend: AttentionBackend) -> AttentionBackend:
        return ObservingBackend(backend, self)

    # ------------------------------------------------------------ before the forward

    def begin_step(self, spans: list[tuple[Request, int, int]], device: torch.device) -> None:
        """spans: (request, first row in the step's batch, new tokens), for every request."""
        self._observed = []
        for req, start, n in spans:
            if req.kv_budget is None:
                continue
            st = req.kv_state
            if st is None:
                st = req.kv_state = EvictionState(
                    make_policy(req.kv_policy, req.kv_budget),
                    torch.zeros((self.num_layers, self.num_kv_heads, 0)),
                )
            c = req.num_computed_tokens
            cp = c - req.num_evicted  # cache slot of the first new token
            grow = cp + n - st.scores.shape[-1]
            if grow > 0:  # new slots start with no attention paid to them
                pad = st.scores.new_zeros((*st.scores.shape[:2], grow))
                st.scores = torch.cat([st.scores, pad], -1)
            rows = st.policy.observe_rows(range(c, c + n), req.num_prompt_tokens)
            if not rows:
                continue
            table = torch.tensor(self.kv.page_ids(req), dtype=torch.int64, device=device)
            rslot = self.kv.residual_slot(req) if self.kv.num_residual_slots else -1
            lo = start + rows.start - c
            first_slot = rows.start - req.num_evicted
            ob = _Observed(st, lo, lo + len(rows), first_slot, cp + n, table, rslot)
            self._observed.append(ob)

    def observe(self, layer: int, q: torch.Tensor, cache: LayerCache, scale: float) -> None:
        """Add the attention weights of the observed queries of ``layer`` to their requests'
        scores. q: (T, Hq, D), the step's queries after rotary; the cache already holds the
        step's keys."""
        for ob in self._observed:
            k, _ = read_layer(cache, ob.table, ob.ctx, ob.residual_slot, torch.float32, True)
            Hkv = k.shape[1]
            acc = torch.zeros((Hkv, ob.ctx), dtype=torch.float32, device=q.device)
            kpos = torch.arange(ob.ctx, device=q.device)
            for lo in range(ob.q_lo, ob.q_hi, _QUERY_CHUNK):
                hi = min(lo + _QUERY_CHUNK, ob.q_hi)
                qq = q[lo:hi].float()  # (m, Hq, D)
                m, Hq, D = qq.shape
                qq = qq.view(m, Hkv, Hq // Hkv, D)
                w = torch.einsum("mhgd,nhd->hgmn", qq, k) * scale  # (Hkv, G, m, N)
                qpos = ob.first_slot + (lo - ob.q_lo) + torch.arange(m, device=q.device)
                w.masked_fill_(kpos[None, :] > qpos[:, None], float("-inf"))
                acc += w.softmax(-1).sum(dim=(1, 2))  # a GQA group votes together
            ob.state.scores[layer, :, : ob.ctx] += acc.cpu()

    # ------------------------------------------------------------ after the forward

    def after_step(self, scheduled: list[tuple[Request, int]]) -> None:
        """Compact every request that has computed all its known tokens and is past its
        budget (see the module doc for when)."""
        self._observed = []
        for req, _ in scheduled:
            st = req.kv_state
            if st is None or req.num_computed_tokens < req.num_tokens:
                continue
            cache_len = req.num_computed_tokens - req.num_evicted
            first = not st.prefilled
            st.prefilled = True
            budget = req.kv_budget
            if cache_len > budget and (first or cache_len >= budget + self.block_size):
                self._compact(req, st, cache_len, first)

    def _compact(self, req: Request, st: EvictionState, n: int, first: bool) -> None:
        keep = st.policy.select(st.scores[..., :n], first)  # (L, Hkv, K)
        K = keep.shape[-1]
        new = self.kv.take_private_pages(-(-K // self.block_size))
        if new is None:
            self.num_deferred += 1
            logger.debug("request %s: no free pages to compact into; later", req.request_id)
            return
        if self.before_write is not None:
            self.before_write()
        dev = self.caches[0].views["k"].device
        table = torch.tensor(self.kv.page_ids(req), dtype=torch.int64, device=dev)
        new_t = torch.tensor([p.page_id for p in new], dtype=torch.int64, device=dev)
        rslot = self.kv.residual_slot(req) if self.kv.num_residual_slots else -1
        keep_d = keep.to(dev)
        for layer, cache in enumerate(self.caches):
            # float formats move bytes as stored; quantized ones through the residual dtype
            dt = cache.residual_k.dtype if cache.quantized else cache.views["k"].dtype
            k, v = read_layer(cache, table, n, rslot, dt)
            write_layer(
                cache, gather_heads(k, keep_d[layer]), gather_heads(v, keep_d[layer]), new_t, rslot
            )
        self.kv.replace_pages(req, new)
        st.scores = st.policy.kept_scores(st.scores[..., :n], keep, first)
        req.num_evicted += n - K
        self.num_compactions += 1
        self.num_evicted_tokens += n - K


class ObservingBackend(AttentionBackend):
    """The engine's attention backend, plus ``EvictionManager.observe`` after each layer
    when some request of the step asked for attention weights."""

    def __init__(self, inner: AttentionBackend, manager: EvictionManager):
        self.inner = inner
        self.manager = manager
        self.name = inner.name
        self._layer = 0

    def prepare(self, meta: AttentionMetadata) -> None:
        self.inner.prepare(meta)
        self._layer = 0

    def forward(self, q, k, v, cache: LayerCache, scale: float) -> torch.Tensor:
        out = self.inner.forward(q, k, v, cache, scale)
        if self.manager._observed:
            self.manager.observe(self._layer, q, cache, scale)
        self._layer += 1
        return out

    def __getattr__(self, name):  # anything else the engine or tests read of the backend
        return getattr(self.inner, name)
