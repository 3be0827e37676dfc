"""The engine on one accelerator: schedule -> run -> postprocess, and the offline ``LLM`` API."""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvmesh.kernels.page_format import (
    PageLayout,
    read_pages,
    resolve_format,
    write_page_buffers,
)
from kvmesh.kvstore.codec import PageSpec
from kvmesh.kvstore.events import EventLog
from kvmesh.kvstore.host import HostTier
from kvmesh.kvstore.store import TieredStore
from kvmesh.kvstore.tier import Tier
from kvmesh.worker import envs
from kvmesh.worker.attention import LayerCache, default_backend_name, get_backend
from kvmesh.worker.config import CacheConfig, SchedulerConfig, parse_size, resolve_dtype
from kvmesh.worker.kv_cache import KVCacheManager
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.models.llama import LlamaForCausalLM, rope_inv_freq
from kvmesh.worker.models.loader import (
    DEFAULT_MODEL,
    load_config,
    load_weights,
    model_fingerprint,
    resolve_model,
)
from kvmesh.worker.offload import KVOffloader
from kvmesh.worker.outputs import RequestOutput
from kvmesh.worker.request import Request, RequestStatus
from kvmesh.worker.sampler import sample
from kvmesh.worker.sampling_params import SamplingParams
from kvmesh.worker.scheduler import Scheduler
from kvmesh.worker.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger("kvmesh.engine")

Prompt = str | Sequence[int]


@dataclass
class EngineStats:
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: float
    num_pages: int
    num_free_pages: int
    bytes_per_token: float  # device pool bytes per cached token, scales included
    kv_cache_dtype: str
    bits_per_value: float
    residual_bytes: int  # quantized formats' full-precision tail pages (outside the pool)
    prefix_cache_queries: int
    prefix_cache_hits: int
    tokens_computed: int
    num_preemptions: int
    queued_prefill_tokens: int


class LLMEngine:
    """Runs one model over a paged KV cache. Not thread-safe: one thread drives ``step``."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        dtype: str | torch.dtype = "auto",
        kv_cache_dtype: str = "auto",
        block_size: int = 16,
        kv_cache_memory: str | int = "1GiB",
        num_pages: int | None = None,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        max_waiting: int = 4096,
        device: str | None = None,
        attention_backend: str | None = None,
        engine_id: str | None = None,
        host_cache_memory: str | int | None = None,
        redis_url: str | None = None,
        redis_ttl_s: float | None = None,
        extra_tiers: Sequence[Tier] = (),
    ):
        if envs.num_threads():
            torch.set_num_threads(envs.num_threads())
        self.src = resolve_model(model)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(dtype)
        # validate every knob before the (slow) model load; max_model_len is settled below
        SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len or 1, max_waiting)
        self.cache_config = CacheConfig(
            block_size=block_size,
            kv_cache_memory=parse_size(kv_cache_memory),
            kv_cache_dtype=kv_cache_dtype,
            enable_prefix_caching=enable_prefix_caching,
            num_blocks_override=num_pages,
        )
        t0 = time.monotonic()
        self.model_config = cfg = load_config(self.src)
        self.model_fp = model_fingerprint(self.src)
        self.tokenizer = Tokenizer.load(self.src, self.model_fp)
        with torch.device("meta"):
            model_mod = LlamaForCausalLM(cfg)
        model_mod = model_mod.to_empty(device=self.device).to(self.dtype)
        # buffers made on the meta device hold garbage after to_empty; rope stays float32
        model_mod.model.rotary_emb.inv_freq = rope_inv_freq(cfg).to(self.device)
        if cfg.tie_word_embeddings:
            model_mod.lm_head.weight = model_mod.model.embed_tokens.weight
        load_weights(model_mod, self.src, self.dtype)
        model_mod.fuse_projections()
        self.model = model_mod.eval()

        # page pool sized from the byte budget: one page-major uint8 buffer (page_format)
        bs = block_size
        self.cache_format = resolve_format(kv_cache_dtype, self.dtype)
        _check_format_supported(self.cache_format, self.device)
        self.layout = layout = PageLayout(
            self.cache_format, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, bs
        )
        self.bytes_per_token = layout.bytes_per_token
        n_pages = num_pages or self.cache_config.kv_cache_memory // layout.page_nbytes
        if n_pages < 2:
            raise ValueError(
                f"kv_cache_memory={kv_cache_memory!r} holds {n_pages} pages of "
                f"{layout.page_nbytes} bytes; at least 2 are needed"
            )
        self.kv_buffer = layout.allocate(n_pages, self.device)  # (n_pages, page_nbytes)
        # quantized formats: one full-precision tail page per running request, outside the
        # kv_cache_memory budget (like activations): (layers, 2, slots, bs, Hkv, D)
        n_slots = max_num_seqs if layout.quantized else 0
        self.residual = torch.zeros(
            layout.residual_shape(n_slots), dtype=self.dtype, device=self.device
        )
        self.layer_caches = [
            LayerCache(
                self.cache_format,
                layout.views(self.kv_buffer, i),
                self.residual[i, 0] if n_slots else None,
                self.residual[i, 1] if n_slots else None,
            )
            for i in range(cfg.num_layers)
        ]

        capacity = (n_pages - 1) * bs
        limit = max_model_len or cfg.max_position_embeddings
        if limit > capacity:
            if max_model_len:
                logger.warning(
                    "max_model_len %d exceeds the KV cache (%d tokens); lowering it",
                    limit,
                    capacity,
                )
            limit = capacity
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=min(limit, cfg.max_position_embeddings),
            max_waiting=max_waiting,
        )
        self.engine_id = engine_id or uuid.uuid4().hex[:12]
        self.events = EventLog(self.engine_id)
        self.kv = KVCacheManager(n_pages, bs, self.events, enable_prefix_caching, n_slots)
        self.scheduler = Scheduler(self.scheduler_config, self.kv)
        backend_name = attention_backend or default_backend_name(self.device.type)
        self.backend = get_backend(backend_name, sliding_window=cfg.sliding_window)
        if backend_name == "cpu" and not layout.quantized:
            # the C kernels serve the model's elementwise ops too. Not under quantized
            # caches: their RMSNorm and SiLU round differently from torch's in the last bit,
            # which int4 can turn into a different code, and quantized outputs are held to
            # equal the fake-quantized reference token for token
            from kvmesh.worker import cpu_kernels

            self.model.cpu_kernels = cpu_kernels.load()
        self.runner = ModelRunner(
            self.model, self.layer_caches, self.kv, self.backend, self.device, n_slots
        )
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        # finished loads waiting for room in the pool: (LoadResult, steps deferred so far)
        self._pending_loads: list = []
        self.store, self.offloader = self._make_store(
            host_cache_memory, redis_url, redis_ttl_s, extra_tiers
        )
        if self.store is not None:  # spill evicted pages down the tiers
            self.kv.pool.on_evict = self.offloader.on_evict
        self.scheduler.park = self._park
        self.driver = None  # the AsyncEngine whose thread steps this engine, if any
        logger.info(
            "engine %s: model %s (%s, %d layers) on %s, %d pages of %d tokens (%s, %.0f MiB), "
            "max_model_len %d, loaded in %.1fs",
            self.engine_id, self.src.name, cfg.architecture, cfg.num_layers, self.device,
            n_pages, bs, self.cache_format, self.kv_buffer.numel() / 2**20,
            self.scheduler_config.max_model_len, time.monotonic() - t0,
        )  # fmt: skip

    def _make_store(self, host_cache_memory, redis_url, redis_ttl_s, extra_tiers):
        tiers: list[Tier] = []
        if host_cache_memory is not None:
            tiers.append(HostTier(parse_size(host_cache_memory)))
        if redis_url:
            from kvmesh.kvstore.redis_tier import RedisTier  # redis-py only when used

            tiers.append(
                RedisTier(
                    redis_url, model_fp=self.model_fp, cache_format=self.cache_format,
                    ttl_s=redis_ttl_s,
                )
            )  # fmt: skip
        tiers += list(extra_tiers)
        store = None
        if tiers:
            store = TieredStore(self.page_spec, tiers)
            logger.info("tiered store: %s", " -> ".join(["device"] + [t.name for t in tiers]))
        # even without tiers: a request may name peers that hold its pages (router hints)
        return store, KVOffloader(store, self.page_spec)

    @property
    def page_spec(self) -> PageSpec:
        """What a stored page object of this engine must say about itself (kvstore.codec)."""
        lay = self.layout
        return PageSpec(
            self.model_fp, self.cache_format, lay.num_layers, lay.num_kv_heads, lay.head_size,
            lay.block_size, lay.page_nbytes,
        )  # fmt: skip

    def read_cached_pages(self, hashes: Sequence[bytes]) -> list[bytes | None]:
        """Payload bytes of the device's cached pages by hash (None where not cached). Call on
        the engine thread: the copy is taken before any later step can reuse a slot."""
        ids = [p.page_id if (p := self.kv.pool.lookup(h)) else -1 for h in hashes]
        hit = [i for i in ids if i >= 0]
        if not hit:
            return [None] * len(hashes)
        idx = torch.tensor(hit, dtype=torch.int64, device=self.kv_buffer.device)
        rows = read_pages(self.kv_buffer, idx).cpu().numpy()
        it = iter(rows)
        return [next(it).tobytes() if i >= 0 else None for i in ids]

    def _park(self, req: Request, device_pages: list) -> bool:
        """Scheduler hook: take ``req`` aside to load the rest of its prefix from the store.
        The last prompt token is always computed, so at most ``(num_tokens - 1) //
        block_size`` pages can be served. The request's device pages are held (``kv.hold``)
        while it waits, so other work cannot evict the prefix the loaded pages continue.

        It looks again whenever its device run is shorter than what it last reached (its
        pages were given up, evicted and spilled: after a preemption, or when the scheduler
        released every hold to make room), up to ``_MAX_LOADS`` times per admission."""
        if self.store is None and not req.peer_hints:
            return False
        max_pages = (req.num_tokens - 1) // self.cache_config.block_size
        num_device_pages = len(device_pages)
        if (
            num_device_pages >= max_pages
            or num_device_pages == req.store_run  # nothing changed since it last looked
            or req.store_loads >= _MAX_LOADS
        ):
            return False
        req.store_loads += 1
        rest = req.block_hashes[num_device_pages:max_pages]
        # device pages past the first gap (an older part of the prompt was evicted first)
        # continue the run once the gap is loaded: hold them too
        later = [self.kv.pool.lookup(h) for h in rest]
        self.kv.hold(req, list(device_pages) + [p for p in later if p is not None])
        self.offloader.start_load(req, num_device_pages, rest, [p is not None for p in later])
        return True

    def _admit_loaded(self) -> None:
        """Write finished loads into free device pages as cached pages and requeue their
        requests at the head of the queue. The loaded run stays held for its request until
        the scheduler admits it, so other work cannot evict it first. A load that does not
        fit beside room for the running requests waits (they free pages as they finish)
        rather than being written in part and recomputed, for at most ``_MAX_DEFER_STEPS``
        steps; then, or when nothing runs, what fits is written."""
        pool, bs = self.kv.pool, self.cache_config.block_size
        pending, self._pending_loads = self._pending_loads, []
        pending += [(res, 0) for res in self.offloader.finished_loads()]
        reserve = pool.num_pages // 8  # room for the running requests' next pages
        for res, deferred in pending:
            req = res.request
            if self.requests.get(req.request_id) is not req:
                continue  # aborted while loading
            first, end = res.first_page, res.first_page + len(res.tiers)
            hashes = req.block_hashes[first:end]
            # pages the device has (held since parking, or gained meanwhile) need no copy
            todo = [
                i for i, h in enumerate(hashes)
                if res.tiers[i] != "device" and pool.lookup(h) is None
            ]  # fmt: skip
            # hold the part of the run the device has before taking pages for the rest, so
            # taking them cannot evict it
            self.kv.hold(req, [p for h in req.block_hashes[:end] if (p := pool.lookup(h))])
            if (
                todo
                and len(todo) > pool.num_free - reserve
                and self.scheduler.running
                and deferred < _MAX_DEFER_STEPS
            ):
                self._pending_loads.append((res, deferred + 1))
                continue
            req.store_run = end  # the run it can now expect
            todo = todo[: pool.num_free]
            pages = pool.take(len(todo))
            if pages:
                self.offloader.flush_spills(self.kv_buffer)  # copy victims out first
                write_page_buffers(
                    self.kv_buffer, [p.page_id for p in pages], [res.payloads[i] for i in todo]
                )
            for page, i in zip(pages, todo):
                n = first + i
                parent = req.block_hashes[n - 1] if n else None
                pool.cache_page(page, hashes[i], parent, req.all_token_ids[n * bs : (n + 1) * bs])
                req.loaded_from[hashes[i]] = res.tiers[i]
            self.kv.hold(req, [p for h in req.block_hashes[:end] if (p := pool.lookup(h))])
            pool.release(reversed(pages))  # the hold keeps them now
            self.scheduler.waiting.appendleft(req)

    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len

    # ------------------------------------------------------------ requests

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def make_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        peers: Sequence[str] | None = None,
    ) -> Request:
        """Validate and build a request without touching engine state (safe from any thread).
        Raises ValueError naming the problem."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(prompt, str) and not isinstance(prompt, Sequence):
            raise ValueError(
                f"a prompt is a str or a list of token ids, got {type(prompt).__name__}"
            )
        ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [
            t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab
        ]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}, "
                f"which must leave room for at least one generated token"
            )
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = Request(
            request_id=rid,
            prompt_token_ids=ids,
            params=params,
            block_size=self.cache_config.block_size,
            model_fp=self.model_fp,
            prompt=prompt if isinstance(prompt, str) else None,
        )
        if peers:
            bad = [p for p in peers if not isinstance(p, str) or ":" not in p]
            if bad:
                raise ValueError(f"peer addresses must be 'host:port', got {bad[:3]}")
            req.peer_hints = list(peers)
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(
                self.tokenizer, ids, params.skip_special_tokens
            )
        return req

    def add(self, req: Request, check_queue: bool = True) -> None:
        """Queue a validated request. Raises QueueFullError at ``max_waiting`` unless
        ``check_queue`` is False (offline batches hold their own prompts anyway)."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if check_queue and len(self.scheduler.waiting) >= self.scheduler_config.max_waiting:
            raise QueueFullError(
                f"the waiting queue is full ({self.scheduler_config.max_waiting} requests)"
            )
        self.requests[req.request_id] = req
        self.scheduler.add(req)

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        req = self.make_request(prompt, params, request_id)
        self.add(req)
        return req.request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its pages now. Unknown ids are ignored (returns None)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if self.offloader is not None and self.offloader.is_loading(request_id):
            self.offloader.cancel(request_id)
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        return self._output(req, [], "")

    def has_unfinished_requests(self) -> bool:
        loading = self.offloader is not None and self.offloader.num_loading > 0
        return self.scheduler.has_unfinished() or loading or bool(self._pending_loads)

    # ------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample, and report every request that changed."""
        if self.offloader is not None:
            self._admit_loaded()
        sched = self.scheduler.schedule()
        if self.offloader is not None:
            self.offloader.flush_spills(self.kv_buffer)  # before the step overwrites slots
            if not sched.scheduled and self.offloader.num_loading:
                self.offloader.wait_for_load(0.05)  # nothing else to run: don't spin
        if not sched.scheduled:
            return []
        sampled, logits = self.runner.execute(sched.scheduled)
        for req, n in sched.scheduled:
            req.num_computed_tokens += n
        tokens, logprobs = sample(logits, sampled) if sampled else ([], [])
        outputs = []
        now = time.monotonic()
        for req, tok, lp in zip(sampled, tokens, logprobs):
            if req.first_token_time is None:
                req.first_token_time = now
            req.append_token(tok)
            if lp is not None:
                req.logprobs.append(lp)
            if req.detokenizer is not None:
                req.detokenizer.push(tok)
            status = self._check_stop(req, tok)
            if status is not None:
                self.requests.pop(req.request_id, None)
                self.scheduler.finish(req, status)
            outputs.append(self._output(req, [tok], self._emit_text(req)))
        return outputs

    def _emit_text(self, req: Request) -> str:
        """The text to stream now. While a request with stop strings runs, the last
        ``max(len(stop)) - 1`` characters are held back: they may turn out to start a stop
        string, and streamed text is never taken back."""
        det = req.detokenizer
        if det is None:
            return ""
        if req.status.finished:
            final = req.text if isinstance(req.stop_reason, str) else det.text
        else:
            hold = max(map(len, req.params.stop)) - 1 if req.params.stop else 0
            final = det.text[: max(len(req.text), len(det.text) - hold)]
        delta = final[len(req.text) :]
        req.text = final
        return delta

    def _check_stop(self, req: Request, tok: int) -> RequestStatus | None:
        p = req.params
        if p.stop and req.detokenizer is not None:
            text = req.detokenizer.text
            # a new match can only start in the held-back tail or in this token's text
            tail_from = max(0, len(req.text) - max(map(len, p.stop)) + 1)
            hits = [(at, s) for s in p.stop if (at := text.find(s, tail_from)) >= 0]
            if hits:
                at, s = min(hits)  # the earliest match wins
                req.text = text[: at + len(s) if p.include_stop_str_in_output else at]
                req.stop_reason = s
                return RequestStatus.FINISHED_STOPPED
        if tok in p.stop_token_ids:
            req.stop_reason = tok
            return RequestStatus.FINISHED_STOPPED
        if not p.ignore_eos and tok in self._eos_ids():
            req.stop_reason = tok
            return RequestStatus.FINISHED_STOPPED
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _by_tier(self, req: Request) -> dict[str, int]:
        out = {"device": 0}
        if self.store is not None:
            out.update((t.name, 0) for t in self.store.tiers)
        out.update(req.cached_by_tier)
        return out

    def _eos_ids(self) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def _output(self, req: Request, new_ids: list[int], delta: str) -> RequestOutput:
        finished = req.status.finished
        text = req.text  # everything streamed so far; the final text once finished
        cached = max(req.num_cached_tokens, 0)
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids),
            text=text,
            new_token_ids=new_ids,
            new_text=delta,
            finished=finished,
            finish_reason=req.status.value if finished else None,
            num_cached_tokens=cached,
            cached_tokens_by_tier=self._by_tier(req),
            logprobs=list(req.logprobs) if req.params.logprobs else None,
            stop_reason=req.stop_reason,
            ttft_s=(req.first_token_time - req.arrival_time) if req.first_token_time else None,
        )

    # ------------------------------------------------------------ stats

    def stats(self) -> EngineStats:
        s = self.scheduler
        queued = sum(r.num_tokens - r.num_computed_tokens for r in s.waiting)
        queued += sum(
            r.num_tokens - r.num_computed_tokens
            for r in s.running
            if r.num_computed_tokens < r.num_prompt_tokens
        )
        loading = self.offloader.num_loading if self.offloader is not None else 0
        loading += len(self._pending_loads)  # loaded, waiting for room
        return EngineStats(
            num_requests_running=len(s.running),
            num_requests_waiting=len(s.waiting) + loading,
            kv_cache_usage_perc=self.kv.usage(),
            num_pages=self.kv.pool.num_pages,
            num_free_pages=self.kv.num_free_pages,
            bytes_per_token=self.bytes_per_token,
            kv_cache_dtype=self.cache_format,
            bits_per_value=self.layout.bits_per_value,
            residual_bytes=self.residual.numel() * self.residual.element_size(),
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            tokens_computed=self.runner.tokens_computed,
            num_preemptions=s.num_preemptions,
            queued_prefill_tokens=queued,
        )

    def reset_prefix_cache(self) -> int:
        """Drop every cached device page no request holds, the way eviction does: with a
        tiered store they spill down to host (and on to Redis). Returns how many."""
        n = self.kv.pool.reset_prefix_cache()
        if self.offloader is not None:
            self.offloader.flush_spills(self.kv_buffer)
            self.offloader.drain()  # an admin call: return once the pages are in the store
        return n

    def store_metrics(self) -> dict:
        """Per-tier store counters plus the offloader's spill/load counters ({} without a
        store or a peer hint so far)."""
        if self.offloader is None:
            return {}
        out = {"offload": dict(self.offloader.metrics)}
        if self.store is not None:
            out["tiers"] = self.store.metrics()
        return out

    def close(self) -> None:
        """Finish pending spills and release the store's threads and connections."""
        if self.offloader is not None:
            self.kv.pool.on_evict = None
            self.scheduler.park = None
            self.offloader.close()
            self.offloader = None


_MAX_LOADS = 3  # store lookups per request: a prefix evicted again and again is computed
_MAX_DEFER_STEPS = 32  # steps a finished load may wait for room before it is written in part


def _check_format_supported(fmt: str, device: torch.device) -> None:
    """Fail at start-up, not mid-request, for a cache format this device cannot run."""
    if device.type == "cuda" and fmt == "fp8":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise ValueError(
                f"kv_cache_dtype 'fp8' needs a GPU with compute capability 8.9 or newer "
                f"(Ada, Hopper); this one is {cap[0]}.{cap[1]}. Use 'int8' instead."
            )


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_waiting``; retry later (gRPC: RESOURCE_EXHAUSTED)."""


class LLM:
    """Offline batch API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

    def __init__(self, model: str = DEFAULT_MODEL, **engine_args):
        self.engine = LLMEngine(model, **engine_args)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion as one continuous batch; outputs in input order.
        Every prompt is validated before anything runs."""
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        elif len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        if self.engine.driver is not None:
            raise RuntimeError(
                "this engine is driven by an AsyncEngine; use AsyncEngine.generate instead"
            )
        reqs = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            try:
                reqs.append(self.engine.make_request(p, sp))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        for r in reqs:
            self.engine.add(r, check_queue=False)
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r.request_id] for r in reqs]

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        return self.generate(self.tokenizer.apply_chat_template(messages), params)[0]

    def reset_prefix_cache(self) -> int:
        return self.engine.reset_prefix_cache()

    def close(self) -> None:
        self.engine.close()


__all__ = ["LLM", "LLMEngine", "QueueFullError", "EngineStats"]
