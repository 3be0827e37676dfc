"""Causal prefill attention on CPU: torch's SDPA or kvmesh's C flash kernel, chosen by
measurement on the machine at hand and cached per machine.

A fresh prefill chunk (nothing cached, no sliding window, float pages) runs causal attention
over its own keys. ``kernels.cpu_attention.prefill_attention_cpu`` (the C kernel) and SDPA
(``is_causal``, ``enable_gqa``) compute the same thing within float rounding (~1e-6); which
is faster depends on the CPU, its vector width and the thread count. So the cpu attention
backend asks a ``PrefillTuner`` per (Hq, Hkv, D, token bucket). At engine start
(``TorchAttentionBackend.warm_up_prefill``: every bucket up to the step budget; else at the
first fresh prefill of a bucket) a bucket (the next power of two of the length, at least
16; buckets above ``MAX_TOKENS`` share its measurement) times both on random inputs of the
bucket's size, interleaved in rounds (``autotune``'s timer: best round, 7 rounds, 3 once
they took 0.25 s unless the two are within 15%, more for short calls until 0.05 s or 64
rounds); the C kernel is taken
when it is at least ``MARGIN`` faster (a choice from timing noise would differ host to host
for no gain). The choice is logged on one line
and cached in memory and in
``$KVMESH_AUTOTUNE_DIR/prefill_attention.json``, keyed like the GEMM cache
(``autotune.machine_key``: CPU model and flags, torch version, threads, ISA environment)
plus the kernel library's build (its file name hashes the sources, flags and CPU): an entry
of another machine or another build is ignored and re-measured, a file that cannot be read
is ignored with a warning and rewritten. ``KVMESH_PREFILL_ATTN`` pins ``sdpa`` or ``c``
(default ``auto``).

A chunk over a quantized cache (``worker.attention.own_page``) has its own choice, kind
``own_page``: SDPA under the own-page mask over the dequantized complete pages followed by
the exact pages (``cat``, then blocks of 256 queries), or the C kernel that reads the two
runs of keys by per-query ranges (``prefill_attention_runs_cpu``), timed on a fresh chunk of
the bucket's length at the cache's page size and residual pages (``"page": [bs, W]`` in the
entry; a cache of another geometry is timed apart) and cached under the same file with
``"kind": "own_page"``; ``KVMESH_PREFILL_ATTN`` pins both kinds.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from kvmesh.kernels.autotune import (
    _time_rounds,
    cache_file_lock,
    machine_key,
    write_cache_file,
)

log = logging.getLogger(__name__)

CHOICES = ("sdpa", "c")
MODES = ("auto", *CHOICES)
CACHE_FORMAT = 2  # bumped when the timing changes: old entries are stale (2: short calls
# timed over more rounds; a 7-round best had kept SDPA at 128 tokens, 2x slower than C)
MIN_TOKENS = 16
MAX_TOKENS = 2048  # larger buckets use this one's measurement (timing 8k tokens takes seconds)
MARGIN = 0.95  # the C kernel must take at most this fraction of SDPA's time
ROUNDS = 7
KINDS = ("causal", "own_page")
OWN_PAGE_BS, OWN_PAGE_W = 16, 2  # the default own-page geometry: page size, residual pages


def token_bucket(n: int) -> int:
    b = MIN_TOKENS
    while b < n and b < MAX_TOKENS:
        b *= 2
    return b


class PrefillTuner:
    """``use_c(n, Hq, Hkv, D)``: whether a fresh prefill of n tokens runs the C kernel.
    ``cache_path``: the JSON file (None: memory only); ``timer``: replaces the measurement
    (tests), ``timer(fns, rounds) -> {name: seconds}``."""

    def __init__(
        self,
        library,
        cache_path: Path | None = None,
        *,
        mode: str = "auto",
        timer: Callable[[dict, int], dict[str, float]] | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"unknown prefill attention mode {mode!r}; accepted: {MODES}")
        self.library = library
        self.cache_path = Path(cache_path) if cache_path is not None else None
        self.mode = mode
        self.timer = timer or _time_rounds
        self.measured = 0
        self._lock = threading.Lock()
        self._choices: dict[tuple, bool] = {}

    def _key(self, shape: tuple, tokens: int, kind: str, page: tuple | None = None) -> dict:
        key = {
            "format": CACHE_FORMAT,
            "machine": machine_key(),
            "library": Path(self.library.path).name,
            "shape": list(shape),
            "tokens": tokens,
        }
        if kind != "causal":  # causal entries keep the key they had before kinds existed
            key["kind"] = kind
        if page is not None:  # own_page: the page size and residual pages it was timed at
            key["page"] = list(page)
        return key

    def use_c(
        self, n: int, Hq: int, Hkv: int, D: int, kind: str = "causal", page: tuple | None = None
    ) -> bool:
        """``kind``: ``causal`` (a fresh chunk over float pages) or ``own_page`` (a chunk
        over a quantized cache; ``page``: its cache's (block size, residual pages), timed and
        cached apart, default (OWN_PAGE_BS, OWN_PAGE_W))."""
        if kind not in KINDS:
            raise ValueError(f"unknown prefill attention kind {kind!r}; accepted: {KINDS}")
        if kind == "own_page":
            page = (OWN_PAGE_BS, OWN_PAGE_W) if page is None else tuple(int(x) for x in page)
            if len(page) != 2 or min(page) < 1:
                raise ValueError(f"page must be (block size, residual pages) >= 1, got {page}")
        else:
            page = None
        if self.mode != "auto":
            return self.mode == "c"
        tokens = token_bucket(n)
        mem = (Hq, Hkv, D, tokens, torch.get_num_threads(), kind, page)
        with self._lock:
            got = self._choices.get(mem)
            if got is None:
                key = self._key((Hq, Hkv, D), tokens, kind, page)
                with self._file_lock():
                    entries = self._load()
                    choice = next((e["choice"] for e in entries if _matches(e, key)), None)
                    if choice is None:
                        if kind == "own_page":
                            choice = self._measure_own_page(key, Hq, Hkv, D, tokens, *page)
                        else:
                            choice = self._measure(key, Hq, Hkv, D, tokens)
                        self._save([e for e in entries if not _matches(e, key, False)], key)
                got = self._choices[mem] = choice == "c"
            return got

    def _measure(self, key: dict, Hq: int, Hkv: int, D: int, tokens: int) -> str:
        from kvmesh.kernels.cpu_attention import prefill_attention_cpu

        g = torch.Generator().manual_seed(0)
        q = torch.randn(tokens, Hq, D, generator=g)
        k, v = torch.randn(tokens, Hkv, D, generator=g), torch.randn(tokens, Hkv, D, generator=g)
        out = torch.empty_like(q)
        qq, kk, vv = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        scale = D**-0.5

        def sdpa():  # the backend's call, with its copy back to token-major
            o = F.scaled_dot_product_attention(
                qq, kk, vv, is_causal=True, scale=scale, enable_gqa=Hq > Hkv
            )
            out.copy_(o[0].transpose(0, 1))

        def c():
            prefill_attention_cpu(q, k, v, scale, out=out, library=self.library)

        return self._choose(key, {"sdpa": sdpa, "c": c}, Hq, Hkv, D, tokens)

    def _measure_own_page(
        self, key: dict, Hq: int, Hkv: int, D: int, tokens: int, bs: int, W: int
    ) -> str:
        """The own-page view of a fresh chunk of ``tokens`` tokens (pages of ``bs`` tokens,
        ``W`` residual pages): query p reads keys [0, E(p)) of the dequantized run
        (length Lq) and [E(p), p] of the exact run, E(p) its window's first position.
        SDPA as ``own_page_attention`` runs it (the two runs copied into one buffer, the
        masked SDPA in blocks of 256 queries, the copy back to token-major) against the C
        kernel reading the runs in place. Both over a float run A: the engine dequantizes
        int4 pages for the SDPA in a separate pass and inside the C kernel, so leaving that
        work out of both times favours neither more than the one pass it saves C."""
        from kvmesh.kernels.cpu_attention import prefill_attention_runs_cpu

        n = tokens
        p = torch.arange(n)
        first = (p // bs - W + 1).clamp(min=0) * bs  # E(p)
        lq, lx = int(first[-1]), -(-n // bs) * bs
        ranges = torch.stack([torch.zeros_like(p), first, first, p + 1], dim=1)
        j = torch.arange(lq + lx)[None, :]
        mask = (j < first[:, None]) | ((j >= lq + first[:, None]) & (j <= lq + p[:, None]))
        g = torch.Generator().manual_seed(0)
        q = torch.randn(n, Hq, D, generator=g)
        ka, va = (torch.randn(lq, Hkv, D, generator=g) for _ in range(2))
        kb, vb = (torch.randn(lx, Hkv, D, generator=g) for _ in range(2))
        out = torch.empty_like(q)
        kk, vv = q.new_empty((lq + lx, Hkv, D)), q.new_empty((lq + lx, Hkv, D))
        qq = q.transpose(0, 1).unsqueeze(0)
        scale = D**-0.5

        def sdpa():
            kk[:lq], kk[lq:], vv[:lq], vv[lq:] = ka, kb, va, vb
            k4, v4 = kk.transpose(0, 1).unsqueeze(0), vv.transpose(0, 1).unsqueeze(0)
            o = torch.empty_like(qq)
            for i in range(0, n, 256):
                o[:, :, i : i + 256] = F.scaled_dot_product_attention(
                    qq[:, :, i : i + 256], k4, v4, attn_mask=mask[i : i + 256], scale=scale,
                    enable_gqa=Hq > Hkv,
                )  # fmt: skip
            out.copy_(o[0].transpose(0, 1))

        def c():
            prefill_attention_runs_cpu(
                q, (ka, va), (kb, vb), ranges, scale, out=out, library=self.library
            )

        return self._choose(key, {"sdpa": sdpa, "c": c}, Hq, Hkv, D, tokens)

    def _choose(self, key: dict, fns: dict, Hq: int, Hkv: int, D: int, tokens: int) -> str:
        t = self.timer(fns, ROUNDS)
        choice = "c" if t["c"] <= MARGIN * t["sdpa"] else "sdpa"
        self.measured += 1
        key["choice"] = choice
        key["us"] = {n: round(x * 1e6, 1) for n, x in t.items()}
        kind = " (own page)" if key.get("kind") == "own_page" else ""
        log.info(
            "prefill attention%s Hq=%d Hkv=%d D=%d tokens<=%d: %s (best us: sdpa %g, c %g)",
            kind, Hq, Hkv, D, tokens, choice, key["us"]["sdpa"], key["us"]["c"],
        )  # fmt: skip
        return choice

    # ---------------------------------------------------------------- the cache file

    def _load(self) -> list[dict]:
        if self.cache_path is None or not self.cache_path.exists():
            return []
        try:
            entries = json.loads(self.cache_path.read_text())["entries"]
            if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
                raise ValueError("'entries' is not a list of objects")
            return entries
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning(
                "prefill attention autotune cache %s is unreadable (%s): ignoring it, re-measuring",
                self.cache_path,
                e,
            )
            return []

    def _file_lock(self):
        """One process per host measures a bucket; the others read its entry."""
        return cache_file_lock(self.cache_path, "prefill attention")

    def _save(self, others: list[dict], entry: dict) -> None:
        if self.cache_path is None:
            return
        # own-page entries from before they were keyed by page geometry match nothing now
        others = [e for e in others if e.get("kind") != "own_page" or "page" in e]
        write_cache_file(self.cache_path, [*others, entry], CACHE_FORMAT, "prefill attention")


def _matches(e: dict, key: dict, need_choice: bool = True) -> bool:
    same = all(e.get(k) == v for k, v in key.items() if k not in ("choice", "us"))
    same = same and e.get("kind", "causal") == key.get("kind", "causal")
    return same and (not need_choice or e.get("choice") in CHOICES)


_tuner: PrefillTuner | None = None
_tuner_lock = threading.Lock()


def default_tuner(library) -> PrefillTuner:
    """The process's tuner: mode ``$KVMESH_PREFILL_ATTN``, cache in ``$KVMESH_AUTOTUNE_DIR``."""
    from kvmesh.worker import envs

    global _tuner
    with _tuner_lock:
        if _tuner is None or _tuner.library is not library:
            path = envs.autotune_dir() / "prefill_attention.json"
            _tuner = PrefillTuner(library, path, mode=envs.prefill_attn_mode())
        return _tuner
