"""Turns a scheduler step into tensors, runs the model, and returns the logits it needs."""

from __future__ import annotations

import torch

from kvmesh.worker.attention import AttentionBackend, AttentionMetadata, LayerCache, PrefillSpan
from kvmesh.worker.attention.base import residual_page
from kvmesh.worker.kv_cache import KVCacheManager
from kvmesh.worker.request import Request


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        caches: list[LayerCache],  # per layer views into the page pool
        kv: KVCacheManager,
        backend: AttentionBackend,
        device: torch.device,
        num_residual_slots: int = 0,  # quantized formats: R, the residual's slot count
        residual_pages: int = 1,  # quantized formats: W, each slot's ring of pages
    ):
        self.model = model
        self.caches = caches
        self.num_residual_slots = num_residual_slots
        self.residual_pages = residual_pages
        self.kv = kv
        self.backend = backend
        self.device = device
        self.block_size = kv.block_size
        self.tokens_computed = 0  # every token the model ran, for tests and stats
        self.eviction = None  # worker.eviction's EvictionManager, shown each step's spans

    def execute(
        self, scheduled: list[tuple[Request, int]], all_logits: bool = False
    ) -> tuple[list[Request], torch.Tensor]:
        """Run one step. Returns the requests to sample (those that reached the end of their
        known tokens: each gets a new token) and their logits, (len(those), vocab) float32. With
        ``all_logits`` (scoring), the logits of every token of the step instead, (T, vocab)."""
        bs = self.block_size
        # single-token requests first: they form one batched attention group
        order = sorted(scheduled, key=lambda rn: rn[1] != 1)
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSpan] = []
        logit_idx: list[int] = []
        to_sample: list[Request] = []
        spans: list[tuple[Request, int, int]] = []
        quantized = self.num_residual_slots > 0
        plan = _QuantPlan(bs, self.num_residual_slots, self.residual_pages) if quantized else None
        for req, n in order:
            # an evicting request's cache is shorter than its sequence: tokens go to cache
            # slots from ``cp`` on, at positions from ``c`` on (worker/eviction)
            c, cp = req.num_computed_tokens, req.cache_len
            table = self.kv.page_ids(req)
            start = len(ids)
            spans.append((req, start, n))
            ids += req.all_token_ids[c : c + n]
            pos += range(c, c + n)
            slots += [table[p // bs] * bs + p % bs for p in range(cp, cp + n)]
            r, ring_from, tail = -1, 0, -1
            if plan is not None:
                r, ring_from = self.kv.residual_slot(req), self.kv.ring_from(req)
                plan.add(table, start, num_computed=cp, num_new=n, residual_slot=r)
                if (cp + n) % bs:  # the residual page holding the partial last page
                    tail = residual_page(r, (cp + n) // bs, self.residual_pages)
            if n == 1:
                decode_tables.append(table[: (cp + bs) // bs])
                decode_lens.append(cp + 1)
                if plan is not None:
                    plan.add_decode(cp + 1, r, ring_from)
            else:
                n_pages = -(-(cp + n) // bs)
                pages = torch.tensor(table[:n_pages], dtype=torch.int64, device=self.device)
                prefills.append(
                    PrefillSpan(start, n, cp + n, pages, tail, r, self.residual_pages, ring_from)
                )
            if c + n == req.num_tokens:
                logit_idx.append(len(ids) - 1)
                to_sample.append(req)
        width = max((len(t) for t in decode_tables), default=0)
        tables = torch.zeros((len(decode_tables), width), dtype=torch.int64)  # 0 = null page
        for i, t in enumerate(decode_tables):
            tables[i, : len(t)] = torch.tensor(t, dtype=torch.int64)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            num_decode=len(decode_tables),
            decode_block_tables=tables.to(self.device),
            decode_context_lens=torch.tensor(decode_lens, dtype=torch.int64, device=self.device),
            prefills=prefills,
            block_size=bs,
        )
        if plan is not None:
            plan.fill(meta, self.device)
        if self.eviction is not None:
            self.eviction.begin_step(spans, self.device)
        self.backend.prepare(meta)
        with torch.inference_mode():
            logits = self.model(
                torch.tensor(ids, dtype=torch.int64, device=self.device),
                torch.tensor(pos, dtype=torch.int64, device=self.device),
                self.caches,
                self.backend,
                torch.arange(len(ids), device=self.device)
                if all_logits
                else torch.tensor(logit_idx, dtype=torch.int64, device=self.device),
            )
        self.tokens_computed += len(ids)
        return to_sample, logits


class _QuantPlan:
    """Per-step bookkeeping for quantized formats: which pages fill (and where their tokens
    are in full precision), which new tokens go to residual rows (every token of a request's
    last W pages: its ring), and which residual pages each decode sequence reads."""

    def __init__(self, block_size: int, num_slots: int, residual_pages: int = 1):
        self.block_size = block_size
        self.W = residual_pages
        self.res_rows = num_slots * residual_pages * block_size  # new-token sources start here
        self.residual_rows: list[int] = []  # per new token, in step order
        self.complete_pages: list[int] = []
        self.complete_src: list[int] = []
        self.decode_slots: list[list[int]] = []

    def _row(self, slot: int, pos: int) -> int:
        """The residual row of cache position ``pos`` of the request in ``slot``."""
        bs = self.block_size
        return residual_page(slot, pos // bs, self.W) * bs + pos % bs

    def add_decode(self, context_len: int, slot: int, ring_from: int) -> None:
        """A decode sequence with ``context_len`` keys (its new token's included): the
        residual page of each of its last W pages, -1 where the pool holds the only copy."""
        last = (context_len - 1) // self.block_size
        first = last - self.W + 1
        self.decode_slots.append(
            [
                residual_page(slot, j, self.W) if j >= max(ring_from, 0) else -1
                for j in range(first, last + 1)
            ]
        )

    def add(
        self,
        table: list[int],
        token_start: int,
        *,
        num_computed: int,
        num_new: int,
        residual_slot: int,
    ) -> None:
        """A request with ``num_computed`` tokens in its pages gets ``num_new`` more, found at
        ``tokens[token_start:]`` of the step; ``table`` is its page table."""
        if residual_slot < 0:
            raise AssertionError("a request of a quantized cache has no residual slot")
        bs, end = self.block_size, num_computed + num_new
        for page in range(num_computed // bs, end // bs):  # pages that fill in this step
            self.complete_pages.append(table[page])
            for pos in range(page * bs, (page + 1) * bs):
                # earlier tokens of the page wait in the ring; the rest are new
                self.complete_src.append(
                    self._row(residual_slot, pos)
                    if pos < num_computed
                    else self.res_rows + token_start + pos - num_computed
                )
        # the ring keeps the last W pages after the step (the write kernels gather the
        # completing pages' sources before they store these rows, so a page W back whose
        # ring page a new token takes over is still read whole)
        keep_from = max(num_computed, ((end - 1) // bs - self.W + 1) * bs)
        self.residual_rows += [-1] * (keep_from - num_computed)
        self.residual_rows += [self._row(residual_slot, pos) for pos in range(keep_from, end)]

    def fill(self, meta: AttentionMetadata, device: torch.device) -> None:
        def t(x):
            return torch.tensor(x, dtype=torch.int64, device=device)

        meta.residual_slots = t(self.residual_rows)
        meta.complete_pages = t(self.complete_pages)
        meta.complete_src = t(self.complete_src).view(-1, self.block_size)
        meta.decode_residual_slots = t(self.decode_slots).view(-1, self.W)
