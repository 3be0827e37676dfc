"""The engine on one accelerator: schedule -> run -> postprocess.

``LLMEngine`` wires the parts together: the model (worker/models), the device memory of the
page pool (kv_memory.py), the page bookkeeping (kv_cache.py), the scheduler, the model
runner, the sampler, the KV connector to the tiers below the device (kv_connector.py), and
the output processor. The offline ``LLM`` API is in llm.py.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvmesh.kernels.page_format import PageLayout
from kvmesh.kvstore.codec import PageSpec
from kvmesh.kvstore.events import EventLog
from kvmesh.kvstore.store import TieredStore
from kvmesh.kvstore.tier import Tier
from kvmesh.worker import envs
from kvmesh.worker.attention import check_backend_name, default_backend_name, get_backend
from kvmesh.worker.config import (
    DEFAULT_RESIDUAL_PAGES,
    CacheConfig,
    EvictionConfig,
    SchedulerConfig,
    parse_size,
    resolve_dtype,
)
from kvmesh.worker.eviction.manager import EvictionManager
from kvmesh.worker.kv_cache import KVCacheManager
from kvmesh.worker.kv_connector import KVConnector, make_store
from kvmesh.worker.kv_memory import KVMemory
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.models import build_model
from kvmesh.worker.models.loader import (
    DEFAULT_MODEL,
    load_config,
    model_fingerprint,
    resolve_model,
)
from kvmesh.worker.output_processor import OutputProcessor
from kvmesh.worker.outputs import RequestOutput
from kvmesh.worker.request import Request, RequestStatus
from kvmesh.worker.sampler import sample
from kvmesh.worker.sampling_params import KV_POLICY_NONE, SamplingParams
from kvmesh.worker.scheduler import Scheduler, SchedulerOutput
from kvmesh.worker.tokenizer import IncrementalDetokenizer, Tokenizer

if TYPE_CHECKING:  # grpc is imported only when a peer is named
    from kvmesh.protos.security import ClusterIdentity, TLSConfig

MAX_PEER_HINTS = 4  # peer addresses one request may name (the router names at most 2)

logger = logging.getLogger("kvmesh.engine")

Prompt = str | Sequence[int]


@dataclass
class EngineStats:
    num_requests_running: int
    num_requests_waiting: int  # PROMOTING requests included
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


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_waiting``; retry later (gRPC: RESOURCE_EXHAUSTED)."""


def _kv_budget_error(model, cfg) -> str | None:
    """Why a kv_budget cannot run on this model, or None when it can."""
    if cfg.is_mla:
        # eviction compacts per-KV-head rows; MLA pages hold one shared latent row per token,
        # which the policies' per-head scores and the compaction do not cover (docs/eviction.md)
        return (
            f"kv_budget is not supported on MLA models ({model} caches one latent row per "
            f"token, not per-head K/V); unset kv_budget for this model"
        )
    if cfg.sliding_window is not None:
        # the kernels apply the window in cache slots; after a compaction slot distance is
        # no longer position distance, so the window would be wrong (docs/eviction.md)
        return (
            f"kv_budget is not supported on sliding-window models ({model} attends over a "
            f"window of {cfg.sliding_window} positions); unset kv_budget for this model"
        )
    return None


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
        preemption_reserve: float = 0.5,
        device: str | None = None,
        attention_backend: str | None = None,
        engine_id: str | None = None,
        host_cache_memory: str | int | None = None,
        redis_url: str | None = None,
        redis_ttl_s: float | None = 24 * 3600.0,  # RedisTier's DEFAULT_TTL_S; None: never
        redis_namespace: str = "kvmesh",
        extra_tiers: Sequence[Tier] = (),
        enable_metrics: bool = True,
        peer_identity: ClusterIdentity | None = None,
        peer_tls: TLSConfig | None = None,
        kv_budget: int | None = None,
        kv_policy: str = "snapkv",
        kv_residual_pages: int = DEFAULT_RESIDUAL_PAGES,
    ):
        if envs.num_threads():
            torch.set_num_threads(envs.num_threads())
        self.src = resolve_model(model)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(dtype)
        # validate every knob before the (slow) model load; max_model_len is settled below
        SchedulerConfig(
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len or 1,
            max_waiting,
            preemption_reserve,
        )
        self.cache_config = CacheConfig(
            block_size=block_size,
            kv_cache_memory=parse_size(kv_cache_memory),
            kv_cache_dtype=kv_cache_dtype,
            enable_prefix_caching=enable_prefix_caching,
            num_pages=num_pages,
            kv_residual_pages=kv_residual_pages,
        )
        self.eviction_config = EvictionConfig(kv_budget, kv_policy)
        host_bytes = parse_size(host_cache_memory) if host_cache_memory is not None else None
        t0 = time.monotonic()
        self.model_config = cfg = load_config(self.src)
        if kv_budget is not None and (why := _kv_budget_error(self.src, cfg)):
            raise ValueError(why)
        self.model_fp = model_fingerprint(self.src)
        self.tokenizer = Tokenizer.load(self.src, self.model_fp)
        self.model = build_model(cfg, self.src, self.dtype, self.device)

        self.memory = KVMemory.for_model(
            cfg,
            self.model_fp,
            kv_cache_dtype=kv_cache_dtype,
            dtype=self.dtype,
            device=self.device,
            block_size=block_size,
            kv_cache_memory=self.cache_config.kv_cache_memory,
            num_pages=num_pages,
            max_num_seqs=max_num_seqs,
            residual_pages=kv_residual_pages,
        )
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=self._settle_max_model_len(max_model_len),
            max_waiting=max_waiting,
            preemption_reserve=preemption_reserve,
        )
        self.engine_id = engine_id or uuid.uuid4().hex[:12]
        self.events = EventLog(self.engine_id)
        n_slots = self.memory.num_residual_slots
        self.kv = KVCacheManager(
            self.memory.num_pages,
            block_size,
            self.events,
            enable_prefix_caching,
            n_slots,
            residual_pages=kv_residual_pages,
        )
        store = make_store(
            self.page_spec,
            self.events,
            host_cache_memory=host_bytes,
            redis_url=redis_url,
            redis_ttl_s=redis_ttl_s,
            redis_namespace=redis_namespace,
            extra_tiers=extra_tiers,
        )
        self.connector = KVConnector(self.kv, self.memory, store)
        # peers a router names are fetched from as a cluster member (docs/security.md); with
        # no cluster identity, a request's peers are refused
        self.peer_identity = peer_identity
        self.connector.offloader.set_peer_auth(peer_identity, peer_tls)
        self.scheduler = Scheduler(self.scheduler_config, self.kv, self.connector)
        backend_name = attention_backend or default_backend_name(self.device.type)
        check_backend_name(backend_name)  # the MLA branch below does not go through the registry
        if cfg.is_mla:  # latent pages: the MLA backend (Triton decode on CUDA)
            from kvmesh.worker.attention.mla import MLABackend

            kernel = "torch" if backend_name == "torch" else "auto"
            bs = self.cache_config.block_size
            self.backend = MLABackend(kernel, block_size=bs, device=self.device)
        else:
            self.backend = get_backend(backend_name, sliding_window=cfg.sliding_window)
        from kvmesh.kernels import autotune  # GEMMs by measurement: auto unless KVMESH_GEMM

        mode = autotune.engine_mode()
        if (
            backend_name == "cpu"
            and autotune.elementwise_in_c(self.layout.quantized, mode)
            and not cfg.is_mla
        ):
            # the C kernels serve the model's elementwise ops too (not under `exact` over a
            # quantized cache: they round differently from torch's in the last bit)
            from kvmesh.worker import cpu_kernels

            self.model.cpu_kernels = cpu_kernels.load()
        if self.device.type == "cpu" and hasattr(self.model, "set_gemm_tuner"):
            self.model.set_gemm_tuner(autotune.default_tuner(mode))
            from kvmesh.kernels.cpu_linear import warm_up  # measure now, not in a request

            warm_up(self.model.gemm_rows(max_num_batched_tokens, max_num_seqs))
            if hasattr(self.backend, "warm_up_prefill"):  # fresh prefill: SDPA or C, measured
                self.backend.warm_up_prefill(
                    max_num_batched_tokens, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                    self.dtype, self.layout.cache_format,
                    (self.cache_config.block_size, kv_residual_pages),
                )  # fmt: skip
        # per-request KV budgets (worker/eviction): the runner's backend also shows the
        # requests that ask their attention weights
        self.eviction = EvictionManager(
            self.memory.layer_caches,
            self.kv,
            cfg.num_kv_heads,
            before_write=self.connector.save_evicted,
        )
        self.runner = ModelRunner(
            self.model,
            self.memory.layer_caches,
            self.kv,
            self.eviction.wrap(self.backend),
            self.device,
            n_slots,
            kv_residual_pages,
        )
        self.runner.eviction = self.eviction
        self.output_processor = OutputProcessor(
            self.eos_token_ids, self.max_model_len, self.connector.tier_names()
        )
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.driver = None  # the AsyncEngine whose thread steps this engine, if any
        # Prometheus metrics in a registry of this engine's own (worker/metrics.py)
        self.metrics = None
        if enable_metrics:
            from kvmesh.worker.metrics import EngineMetrics

            self.metrics = EngineMetrics(self, model_name=self.src.name, worker=self.engine_id)
        logger.info(
            "engine %s: model %s (%s, %d layers) on %s, %d pages of %d tokens (%s, %.0f MiB), "
            "max_model_len %d, loaded in %.1fs",
            self.engine_id,
            self.src.name,
            cfg.architecture,
            cfg.num_layers,
            self.device,
            self.memory.num_pages,
            block_size,
            self.cache_format,
            self.memory.nbytes / 2**20,
            self.max_model_len,
            time.monotonic() - t0,
        )

    def _settle_max_model_len(self, asked: int | None) -> int:
        """The model's context, or ``asked``, within what the pool can hold."""
        capacity = (self.memory.num_pages - 1) * self.cache_config.block_size
        limit = asked or self.model_config.max_position_embeddings
        if limit > capacity:
            if asked:
                logger.warning(
                    "max_model_len %d exceeds the KV cache (%d tokens); lowering it",
                    limit,
                    capacity,
                )
            limit = capacity
        return min(limit, self.model_config.max_position_embeddings)

    # ------------------------------------------------------------ what it is

    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len

    @property
    def layout(self) -> PageLayout:
        return self.memory.layout

    @property
    def cache_format(self) -> str:
        return self.memory.cache_format

    @property
    def bytes_per_token(self) -> float:
        return self.memory.layout.bytes_per_token

    @property
    def page_spec(self) -> PageSpec:
        """What a stored page object of this engine must say about itself (kvstore.codec)."""
        return self.memory.page_spec

    @property
    def store(self) -> TieredStore | None:
        """The tiers below the device (None: only the device, and peers a request names)."""
        return self.connector.store

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every token id that ends a generation: the model config's and the tokenizer's."""
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    # ------------------------------------------------------------ pages, for peers and the router

    def read_cached_pages(self, hashes: Sequence[bytes]) -> list[bytes | None]:
        """Payload bytes of the device's cached pages by hash (None where not cached). Call on
        the engine thread: the copy is taken before any later step can reuse a slot."""
        ids = self.kv.cached_page_ids(hashes)
        it = iter(self.memory.read([i for i in ids if i >= 0]))
        return [next(it) if i >= 0 else None for i in ids]

    def cached_on_device(self, hashes: Sequence[bytes]) -> list[bool]:
        """Which of these pages the device pool holds now (engine thread)."""
        return [i >= 0 for i in self.kv.cached_page_ids(hashes)]

    def cached_pages_by_tier(self) -> dict[str, list[bytes]]:
        """The page hashes this worker holds in its own tiers, at this instant: ``device``
        and, with a host tier, ``host`` (engine thread). Redis is shared, not listed."""
        out = {"device": self.kv.cached_hashes()}
        host = self.connector.host_tier()
        if host is not None:
            out["host"] = host.keys()
        return out

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
        try:
            ids = self.tokenize(prompt)
        except ValueError:
            raise
        except Exception as e:  # the tokenizer's own failure is this prompt's problem
            raise ValueError(f"cannot tokenize the prompt: {type(e).__name__}: {e}") from None
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_model_len:  # before the per-token scan: a huge list is cheap
            raise ValueError(
                f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}, "
                f"which must leave room for at least one generated token"
            )
        vocab = self.model_config.vocab_size
        bad = [
            t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab
        ]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {vocab}); got {bad[:5]}")
        ev = self.eviction_config
        kv_budget = params.kv_budget if params.kv_budget is not None else ev.kv_budget
        if params.kv_policy == KV_POLICY_NONE:  # its opt-out: the full cache, whatever the default
            kv_budget = None
        elif params.kv_policy is not None and kv_budget is None:
            raise ValueError(
                f"kv_policy={params.kv_policy!r} needs a kv_budget: set one (this engine has "
                f"no default budget)"
            )
        if kv_budget is not None and (why := _kv_budget_error(self.src, self.model_config)):
            raise ValueError(why)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = Request(
            request_id=rid,
            prompt_token_ids=ids,
            params=params,
            block_size=self.cache_config.block_size,
            model_fp=self.model_fp,
            prompt=prompt if isinstance(prompt, str) else None,
            kv_budget=kv_budget,
            kv_policy=(params.kv_policy or ev.kv_policy) if kv_budget is not None else None,
        )
        if peers:
            if self.peer_identity is None:
                raise ValueError(
                    "peer addresses need a cluster identity (peer_identity): this engine has none"
                )
            if len(peers) > MAX_PEER_HINTS:
                raise ValueError(f"at most {MAX_PEER_HINTS} peer addresses, got {len(peers)}")
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
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        if self.metrics is not None:
            self.metrics.on_finished(req)
        return self.output_processor.output(req, [], "")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample, and report every request that changed."""
        sched = self.scheduler.schedule()
        self.connector.save_evicted()  # evicted pages leave before this step's writes
        if not sched.scheduled:
            self.connector.wait_for_promotion(0.05)  # nothing to run: don't spin
            return []
        to_sample, tokens, logprobs, errors = self._run(sched)
        outputs = self._postprocess(to_sample, tokens, logprobs, errors)
        # a request whose KV eviction failed mid-prefill (not sampled this step) fails alone
        for req, why in self.eviction.pop_failures().items():
            outputs.append(self._fail(req, why, []))
            if self.metrics is not None:
                self.metrics.on_finished(req)
        return outputs

    def _run(self, sched: SchedulerOutput) -> tuple[list[Request], list[int], list, list]:
        to_sample, logits = self.runner.execute(sched.scheduled)
        for req, n in sched.scheduled:
            req.num_computed_tokens += n
        self.eviction.after_step(sched.scheduled)  # compacts caches past their budget
        if to_sample:
            self._mask_early_stops(logits, to_sample)
        tokens, logprobs, errors = sample(logits, to_sample) if to_sample else ([], [], [])
        for i, req in enumerate(to_sample):  # its eviction failed: it fails, takes no token
            why = self.eviction.failures.pop(req, None)
            if why is not None and errors[i] is None:
                errors[i] = why
        if any(r.params.top_logprobs for r in to_sample):
            self._record_top_logprobs(logits, to_sample, errors)
        return to_sample, tokens, logprobs, errors

    def _mask_early_stops(self, logits: torch.Tensor, reqs: list[Request]) -> None:
        """min_tokens: a request short of it cannot sample EOS (unless ignore_eos) or its
        stop_token_ids. logits: (S, V), one row per request, masked in place."""
        vocab = logits.shape[-1]
        for i, req in enumerate(reqs):
            p = req.params
            if len(req.output_token_ids) >= p.min_tokens:
                continue
            ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
            ids = [t for t in ids if t < vocab]
            if ids:
                # the lowest finite logit, not -inf: the sampler fails a row that is not finite
                with torch.inference_mode():  # the model's logits are an inference tensor
                    logits[i, ids] = torch.finfo(logits.dtype).min

    @staticmethod
    def _record_top_logprobs(logits: torch.Tensor, reqs: list[Request], errors: list) -> None:
        """The k most likely tokens of each asking row that sampled, appended to its request
        (as its logprobs are: under the distribution the sampler saw, before temperature)."""
        rows = [i for i, r in enumerate(reqs) if r.params.top_logprobs and errors[i] is None]
        if not rows:
            return
        k = max(reqs[i].params.top_logprobs for i in rows)
        vals, ids = torch.log_softmax(logits[rows], dim=-1).topk(k, dim=-1)  # (R, k)
        for row, v, t in zip(rows, vals.tolist(), ids.tolist()):
            n = reqs[row].params.top_logprobs
            reqs[row].top_logprobs.append(list(zip(t[:n], v[:n])))

    def _postprocess(self, reqs: list[Request], tokens: list[int], logprobs: list, errors: list):
        outputs = []
        took: list[bool] = []  # per request: it took a token (a late failure may have)
        now = time.monotonic()
        for req, tok, lp, err in zip(reqs, tokens, logprobs, errors):
            if req.first_token_time is None:
                req.first_token_time = now
            n_before = len(req.output_token_ids)
            if err is None:
                try:
                    outputs.append(self._take_token(req, tok, lp))
                except Exception as e:  # a detokenizer or stop-check failure is this request's
                    logger.exception("request %s failed after sampling", req.request_id)
                    err = f"{type(e).__name__} while processing its output: {e}"
            if err is not None:
                # the token it failed on, if it was taken, is reported: token_ids match the usage
                outputs.append(self._fail(req, err, req.output_token_ids[n_before:]))
            took.append(len(req.output_token_ids) > n_before)
        if self.metrics is not None:
            self.metrics.on_step(reqs, now, took)
        return outputs

    def _take_token(self, req: Request, tok: int, lp: float | None) -> RequestOutput:
        proc = self.output_processor
        req.append_token(tok)
        if lp is not None:
            req.logprobs.append(lp)
        if req.detokenizer is not None:
            req.detokenizer.push(tok)
        status = proc.check_stop(req, tok)
        if status is not None:
            self.requests.pop(req.request_id, None)
            self.scheduler.finish(req, status)
        return proc.output(req, [tok], proc.emit_text(req))

    def _fail(self, req: Request, message: str, new_ids: list[int]) -> RequestOutput:
        """Finish ``req`` alone with finish_reason "error": its pages are freed, the engine
        and every other request go on."""
        logger.warning("request %s failed: %s", req.request_id, message)
        req.error = message
        if req.status.finished:  # it failed after finishing (its final text): already freed
            req.status = RequestStatus.FINISHED_ERROR
        else:
            self.requests.pop(req.request_id, None)
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        return self.output_processor.output(req, new_ids, "")

    # ------------------------------------------------------------ stats

    def stats(self) -> EngineStats:
        s = self.scheduler
        # a PROMOTING request's prefix is on its way from a tier, not queued for compute
        queued = sum(
            r.num_tokens - r.num_computed_tokens
            for r in s.waiting
            if r.status is not RequestStatus.PROMOTING
        )
        queued += sum(
            r.num_tokens - r.num_computed_tokens
            for r in s.running
            if r.num_computed_tokens < r.num_prompt_tokens
        )
        return EngineStats(
            num_requests_running=len(s.running),
            num_requests_waiting=len(s.waiting),
            kv_cache_usage_perc=self.kv.usage(),
            num_pages=self.kv.num_pages,
            num_free_pages=self.kv.num_free_pages,
            bytes_per_token=self.bytes_per_token,
            kv_cache_dtype=self.cache_format,
            bits_per_value=self.layout.bits_per_value,
            residual_bytes=self.memory.residual_nbytes,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            tokens_computed=self.runner.tokens_computed,
            num_preemptions=s.num_preemptions,
            queued_prefill_tokens=queued,
        )

    def reset_prefix_cache(self, drain_timeout_s: float = 30.0) -> int:
        """Drop every cached device page no request holds, the way eviction does: with a
        tiered store they spill down to host (and on to Redis). Returns how many; waits at
        most ``drain_timeout_s`` for them to be in the store (TimeoutError past it)."""
        n = self.kv.reset_prefix_cache()
        # an admin call: return once the pages are in the store
        self.connector.drain(drain_timeout_s)
        return n

    def store_metrics(self) -> dict:
        """The connector's spill and promotion counters (``offload``) and per-tier store
        counters (``tiers``, with a store)."""
        return self.connector.metrics()

    def close(self) -> None:
        """Finish pending spills and release the store's threads and connections."""
        self.connector.close()


__all__ = ["LLMEngine", "QueueFullError", "EngineStats", "Prompt"]
