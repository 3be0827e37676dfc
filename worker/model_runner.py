"""Turns a scheduler step into tensors, runs the model, and returns the logits it needs."""

from __future__ import annotations

import torch

from kvmesh.worker.attention import AttentionBackend, AttentionMetadata, LayerCache, PrefillSpan
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
    ):
        self.model = model
        self.caches = caches
        self.num_residual_slots = num_residual_slots
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
        plan = _QuantPlan(bs, self.num_residual_slots) if quantized else None
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
            r = -1
            if plan is not None:
                r = self.kv.residual_slot(req)
                plan.add(table, start, num_computed=cp, num_new=n, residual_slot=r)
            tail = r if (cp + n) % bs else -1  # the slot holding the partial last page
            if n == 1:
                decode_tables.append(table[: (cp + bs) // bs])
                decode_lens.append(cp + 1)
                if plan is not None:
                    plan.decode_slots.append(tail)
            else:
                n_pages = -(-(cp + n) // bs)
                pages = torch.tensor(table[:n_pages], dtype=torch.int64, device=self.device)
                prefills.append(PrefillSpan(start, n, cp + n, pages, tail, r))
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
    are in full precision), and which new tokens go to residual slots."""

    def __init__(self, block_size: int, num_slots: int):
        self.block_size = block_size
        self.res_rows = num_slots * block_size  # new-token sources are offset by this
        self.residual_rows: list[int] = []  # per new token, in step order
        self.complete_pages: list[int] = []
        self.complete_src: list[int] = []
        self.decode_slots: list[int] = []

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
        slot_row = residual_slot * bs  # the slot's first row in the residual
        for page in range(num_computed // bs, end // bs):  # pages that fill in this step
            self.complete_pages.append(table[page])
            for pos in range(page * bs, (page + 1) * bs):
                # earlier tokens of the page wait in the residual; the rest are new
                self.complete_src.append(
                    slot_row + pos % bs
                    if pos < num_computed
                    else self.res_rows + token_start + pos - num_computed
                )
        tail_from = max(num_computed, end // bs * bs)
        self.residual_rows += [-1] * (tail_from - num_computed)
        self.residual_rows += [slot_row + pos % bs for pos in range(tail_from, end)]

    def fill(self, meta: AttentionMetadata, device: torch.device) -> None:
        def t(x):
            return torch.tensor(x, dtype=torch.int64, device=device)

        meta.residual_slots = t(self.residual_rows)
        meta.complete_pages = t(self.complete_pages)
        meta.complete_src = t(self.complete_src).view(-1, self.block_size)
        meta.decode_residual_slots = t(self.decode_slots)
