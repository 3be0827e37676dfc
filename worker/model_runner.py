"""Turns a scheduler step into tensors, runs the model, and returns the logits it needs."""

from __future__ import annotations

import torch

from kvmesh.worker.attention import AttentionBackend, AttentionMetadata, PrefillSpan
from kvmesh.worker.kv_cache import KVCacheManager
from kvmesh.worker.request import Request


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: torch.Tensor,  # (num_layers, 2, num_pages, block_size, Hkv, D)
        kv: KVCacheManager,
        backend: AttentionBackend,
        device: torch.device,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.kv = kv
        self.backend = backend
        self.device = device
        self.block_size = kv.block_size
        self.tokens_computed = 0  # every token the model ran, for tests and stats

    def execute(self, scheduled: list[tuple[Request, int]]) -> tuple[list[Request], torch.Tensor]:
        """Run one step. Returns the requests that reached the end of their known tokens (they
        get a new token sampled) and their logits, (len(those), vocab) float32."""
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
        sampled: list[Request] = []
        for req, n in order:
            c = req.num_computed_tokens
            table = self.kv.page_ids(req)
            start = len(ids)
            ids += req.all_token_ids[c : c + n]
            pos += range(c, c + n)
            slots += [table[p // bs] * bs + p % bs for p in range(c, c + n)]
            if n == 1:
                decode_tables.append(table[: (c + bs) // bs])
                decode_lens.append(c + 1)
            else:
                n_pages = -(-(c + n) // bs)
                pages = torch.tensor(table[:n_pages], dtype=torch.int64, device=self.device)
                prefills.append(PrefillSpan(start, n, c + n, pages))
            if c + n == req.num_tokens:
                logit_idx.append(len(ids) - 1)
                sampled.append(req)
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
        self.backend.prepare(meta)
        with torch.inference_mode():
            logits = self.model(
                torch.tensor(ids, dtype=torch.int64, device=self.device),
                torch.tensor(pos, dtype=torch.int64, device=self.device),
                self.kv_cache,
                self.backend,
                torch.tensor(logit_idx, dtype=torch.int64, device=self.device),
            )
        self.tokens_computed += len(ids)
        return sampled, logits
