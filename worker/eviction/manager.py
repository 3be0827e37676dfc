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

A fault in one request's eviction (its observation, its selection, its compaction: a bad
tensor, an out-of-memory) finishes that request alone with finish_reason "error"; the step
and every other request go on (``failures``, read by the engine). A failed compaction never
writes its old pages (a compaction copies into new pages, and those are given back); with a
quantized cache, though, the request's full-precision residual slot (its partial last page) is
rewritten in place layer by layer, so a failure part-way leaves that slot mixed. Nothing reads
it again: the request is finished and its cache, residual slot included, freed. It is not
silently served with its full cache instead: the budget is what bounds its memory (a
StreamingLLM stream runs past the pool only because of it), and the scores a failed
observation left behind are partial, so evicting on them later would be wrong without a
trace.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvmesh.worker.attention.base import AttentionBackend, AttentionMetadata, LayerCache
from kvmesh.worker.eviction.compaction import (
    gather_heads,
    read_layer,
    unchanged_pages,
    write_layer,
)
from kvmesh.worker.eviction.policies import EvictionPolicy, make_policy
from kvmesh.worker.kv_cache import KVCacheManager
from kvmesh.worker.request import Request
from kvmesh.worker.sampling_params import KV_POLICIES

logger = logging.getLogger("kvmesh.eviction")

_QUERY_CHUNK = 256  # queries scored at once: bounds the (Hq, chunk, N) weights in memory


def _to_host(x: torch.Tensor) -> torch.Tensor:
    """The one device-to-host copy of a step's observed attention (a sync on CUDA)."""
    return x.cpu()


@dataclass
class EvictionState:
    """One request's eviction bookkeeping for one run (reset when it is preempted)."""

    policy: EvictionPolicy
    scores: torch.Tensor  # (L, Hkv, N) float32 on CPU: accumulated attention per cache slot
    # its first compaction (the one after the prompt, where SnapKV votes) is done, or was
    # not needed; a first compaction put off for want of pages stays first until it runs
    prefilled: bool = False


@dataclass
class _Observed:
    state: EvictionState
    q_lo: int  # rows [q_lo, q_hi) of the step's flat batch
    q_hi: int
    first_slot: int  # cache slot of the first observed query (it sees slots <= its own)
    ctx: int  # cache length after this step's writes
    table: torch.Tensor  # (P,) int64 page ids
    residual_slot: int
    req: Request | None = None
    ring_from: int | None = None  # quantized: the first page the residual ring may hold
    acc: torch.Tensor | None = None  # (L, Hkv, ctx) this step's attention, on the device


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
        # compaction attempts put off for want of free pages: one retried over n steps counts n
        self.num_deferred = 0
        # per policy, for the metrics (read at scrape time from another thread: every
        # built-in policy has its key from the start, so the dicts do not resize under it)
        self.compactions_by_policy: dict[str, int] = dict.fromkeys(KV_POLICIES, 0)
        self.evicted_by_policy: dict[str, int] = dict.fromkeys(KV_POLICIES, 0)
        self.deferred_by_policy: dict[str, int] = dict.fromkeys(KV_POLICIES, 0)
        # requests whose eviction failed this step -> why; the engine finishes each with
        # finish_reason "error" (``pop_failures``) and the step goes on without them
        self.failures: dict[Request, str] = {}

    def wrap(self, backend: AttentionBackend) -> AttentionBackend:
        return ObservingBackend(backend, self)

    # ------------------------------------------------------------ before the forward

    def begin_step(self, spans: list[tuple[Request, int, int]], device: torch.device) -> None:
        """spans: (request, first row in the step's batch, new tokens), for every request."""
        self._observed = []
        for req, start, n in spans:
            if req.kv_budget is None or req in self.failures:
                continue
            try:
                ob = self._begin(req, start, n, device)
            except Exception as e:  # this request's failure, not the step's
                self._fail(req, "preparing its observation", e)
                continue
            if ob is not None:
                self._observed.append(ob)

    def _begin(self, req: Request, start: int, n: int, device: torch.device) -> _Observed | None:
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
            return None
        table = torch.tensor(self.kv.page_ids(req), dtype=torch.int64, device=device)
        rslot = self.kv.residual_slot(req) if self.kv.num_residual_slots else -1
        ring_from = self.kv.ring_from(req) if self.kv.num_residual_slots else None
        lo = start + rows.start - c
        first_slot = rows.start - req.num_evicted
        return _Observed(
            st, lo, lo + len(rows), first_slot, cp + n, table, rslot, req, ring_from=ring_from
        )

    def observe(self, layer: int, q: torch.Tensor, cache: LayerCache, scale: float) -> None:
        """Add the attention weights of the observed queries of ``layer`` to their requests'
        step buffers (on the device: no sync per layer; ``_flush`` moves them to the
        requests' scores once per step). q: (T, Hq, D), the step's queries after rotary; the
        cache already holds the step's keys. A request whose observation fails is dropped
        from the step's observed set and fails alone."""
        failed = []
        for ob in self._observed:
            try:
                self._observe_one(ob, layer, q, cache, scale)
            except Exception as e:
                failed.append(ob)
                self._fail(ob.req, f"observing layer {layer}", e)
        if failed:
            gone = {id(ob) for ob in failed}
            self._observed = [ob for ob in self._observed if id(ob) not in gone]

    def _observe_one(self, ob: _Observed, layer: int, q, cache: LayerCache, scale: float):
        k, _ = read_layer(
            cache, ob.table, ob.ctx, ob.residual_slot, torch.float32, True, ob.ring_from
        )
        Hkv = k.shape[1]
        if ob.acc is None:
            shape = (self.num_layers, Hkv, ob.ctx)
            ob.acc = torch.zeros(shape, dtype=torch.float32, device=q.device)
        acc = ob.acc[layer]
        weigh = getattr(ob.state.policy, "weigh", None)
        kpos = torch.arange(ob.ctx, device=q.device)
        for lo in range(ob.q_lo, ob.q_hi, _QUERY_CHUNK):
            hi = min(lo + _QUERY_CHUNK, ob.q_hi)
            qq = q[lo:hi].float()  # (m, Hq, D)
            m, Hq, D = qq.shape
            qq = qq.view(m, Hkv, Hq // Hkv, D)
            w = torch.einsum("mhgd,nhd->hgmn", qq, k) * scale  # (Hkv, G, m, N)
            qpos = ob.first_slot + (lo - ob.q_lo) + torch.arange(m, device=q.device)
            w.masked_fill_(kpos[None, :] > qpos[:, None], float("-inf"))
            probs = w.softmax(-1)
            if weigh is None:
                acc += probs.sum(dim=(1, 2))  # a GQA group votes together
            else:  # a policy's own vote per query (Scissorhands counts)
                acc += weigh(probs, qpos)

    def _flush(self) -> None:
        """Move the step's observed attention into the requests' scores: one device-to-host
        copy for the whole step (a request whose part fails fails alone)."""
        obs = [ob for ob in self._observed if ob.acc is not None and ob.req not in self.failures]
        self._observed = []
        if not obs:
            return
        try:
            host = _to_host(torch.cat([ob.acc.reshape(-1) for ob in obs]))
            parts = host.split([ob.acc.numel() for ob in obs])
        except Exception:  # e.g. out of memory for the concatenation: one at a time
            parts = [None] * len(obs)
        for ob, part in zip(obs, parts):
            try:
                if part is None:
                    part = _to_host(ob.acc)
                ob.state.scores[..., : ob.ctx] += part.view(ob.acc.shape)
            except Exception as e:
                self._fail(ob.req, "collecting its attention", e)

    # ------------------------------------------------------------ after the forward

    def after_step(self, scheduled: list[tuple[Request, int]]) -> None:
        """Compact every request that has computed all its known tokens and is past its
        budget (see the module doc for when)."""
        self._flush()
        for req, _ in scheduled:
            st = req.kv_state
            if st is None or req in self.failures or req.num_computed_tokens < req.num_tokens:
                continue
            cache_len = req.num_computed_tokens - req.num_evicted
            budget = req.kv_budget
            first = not st.prefilled
            if cache_len <= budget:
                st.prefilled = True  # nothing to evict after the prompt: decode rules from here
                continue
            if not first and cache_len < budget + self.block_size:
                continue
            try:
                if self._compact(req, st, cache_len, first):
                    st.prefilled = True
            except Exception as e:
                self._fail(req, "compacting its cache", e)

    def pop_failures(self) -> dict[Request, str]:
        """The requests whose eviction failed since the last call, with why (then forgotten)."""
        out, self.failures = self.failures, {}
        return out

    def _fail(self, req: Request | None, what: str, e: Exception) -> None:
        if req is None or req in self.failures:
            return
        logger.exception("request %s: KV eviction failed while %s", req.request_id, what)
        self.failures[req] = (
            f"KV eviction (kv_policy={req.kv_policy!r}, kv_budget={req.kv_budget}) failed "
            f"while {what}: {type(e).__name__}: {e}"
        )

    def _select(self, req: Request, st: EvictionState, n: int, first: bool):
        """The kept slots (L, Hkv, K) of a cache of ``n`` slots, and the scores they carry on.

        The first compaction votes over the prompt's slots as at the end of the prompt, even
        when it runs later (it was put off for want of pages, or the request was recomputed
        after a preemption with its output): the slots since the prompt then join the kept
        ones and go through the decode rule, as if the compaction had run on time."""
        pol = st.policy
        scores = st.scores[..., :n]
        p = req.num_prompt_tokens  # the first compaction: nothing evicted yet, slot = position
        if not first or n <= p:
            keep = pol.select(scores, first)
            return keep, pol.kept_scores(scores, keep, first)
        keep1 = pol.select(scores[..., :p], True)
        kept1 = pol.kept_scores(scores[..., :p], keep1, True)
        L, H, _ = keep1.shape
        slots = torch.cat([keep1, torch.arange(p, n).expand(L, H, n - p)], -1)
        sc = torch.cat([kept1, scores[..., p:n]], -1)
        if slots.shape[-1] <= req.kv_budget:
            return slots, sc
        keep2 = pol.select(sc, False)
        return slots.gather(-1, keep2), pol.kept_scores(sc, keep2, False)

    def _compact(self, req: Request, st: EvictionState, n: int, first: bool) -> bool:
        """Compact ``req``'s ``n`` slots to its budget; False when put off (no free pages)."""
        keep, kept_scores = self._select(req, st, n, first)  # (L, Hkv, K)
        K = keep.shape[-1]
        new = self.kv.take_private_pages(-(-K // self.block_size))
        if new is None:
            self.num_deferred += 1
            name = st.policy.name
            self.deferred_by_policy[name] = self.deferred_by_policy.get(name, 0) + 1
            logger.debug("request %s: no free pages to compact into; later", req.request_id)
            return False
        try:
            self._write(req, keep, n, new)
        except BaseException:
            self.kv.unpin(new)  # its old pages are untouched: it still holds them
            raise
        self.kv.replace_pages(req, new)
        if self.kv.num_residual_slots:  # write_layer put the result's last pages in the ring
            self.kv.set_ring_from(req, 0)
        st.scores = kept_scores
        req.num_evicted += n - K
        name = st.policy.name
        self.num_compactions += 1
        self.num_evicted_tokens += n - K
        self.compactions_by_policy[name] = self.compactions_by_policy.get(name, 0) + 1
        self.evicted_by_policy[name] = self.evicted_by_policy.get(name, 0) + n - K
        return True

    def _write(self, req: Request, keep: torch.Tensor, n: int, new: list) -> None:
        if self.before_write is not None:
            self.before_write()
        dev = self.caches[0].views["k"].device
        table_h = torch.tensor(self.kv.page_ids(req), dtype=torch.int64)
        table = table_h.to(dev)
        new_t = torch.tensor([p.page_id for p in new], dtype=torch.int64, device=dev)
        rslot = self.kv.residual_slot(req) if self.kv.num_residual_slots else -1
        ring_from = self.kv.ring_from(req) if self.kv.num_residual_slots else None
        keep_d = keep.to(dev)
        keep_h = keep.cpu()  # which pages are copied whole: worked out on the CPU, no syncs
        for layer, cache in enumerate(self.caches):
            # float formats move bytes as stored; quantized ones through the residual dtype,
            # except the pages whose kept tokens are a whole old page's: copied as stored
            dt = cache.residual_k.dtype if cache.quantized else cache.views["k"].dtype
            copy_src = None
            if cache.quantized:
                src = unchanged_pages(keep_h[layer], n, self.block_size)
                copy_src = torch.where(src >= 0, table_h[src.clamp(min=0)], src)
            k, v = read_layer(cache, table, n, rslot, dt, ring_from=ring_from)
            write_layer(
                cache,
                gather_heads(k, keep_d[layer]),
                gather_heads(v, keep_d[layer]),
                new_t,
                rslot,
                copy_src,
            )


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
