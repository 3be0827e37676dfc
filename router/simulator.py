"""Trace-driven cluster simulator: replay a Mooncake-format trace through the real router.

Every request is hashed into pages, matched against the real ``PrefixIndex`` and routed by
the real policy with ``policies.pick_and_insert`` (match, pick, optimistic insert). N simulated
workers serve it; each one has an LRU page cache (plus an optional host tier and a shared
Redis tier), emits ``BlockStored``/``BlockRemoved`` events with its own sequence numbers into
the index, and reports ``WorkerLoad`` to the policy. The model (see docs/router.md):

- One trace hash id is one page of ``BLOCK_TOKENS`` (512) tokens. Only full pages of the
  prompt are cached and routed on; page hashes are chained from the ids
  (``page_hashes``), so equal hashes mean an equal prefix.
- Prefill: each worker runs one prefill at a time, first come first served. Its cache is
  looked up when the prefill starts; the request's duration is
  ``computed / prefill_tokens_per_s + host_hit_tokens * host_s_per_token +
  redis_hit_tokens * redis_s_per_token``. At least one prompt token is always computed.
  The prompt's full pages enter the device cache when the prefill ends (that is when the
  events are emitted); a page evicted from the device spills to the host tier if enabled;
  with Redis every computed page is also written to Redis (unbounded, shared).
- Decode: a fixed ``decode_s_per_token`` per output token, in parallel with other requests
  and with prefill (decode does not slow prefill down in this model). TTFT is the time from
  arrival to the end of the request's prefill.
- Peer fetches are not modelled: a page only another worker holds is recomputed, and the
  index is built with no peer tiers so that the policy does not credit one.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import random
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvmesh.kvstore.events import BlockRemoved, BlockStored
from kvmesh.router.policies import (
    POLICIES,
    LoadGuard,
    RouteRequest,
    WorkerLoad,
    make_policy,
    pick_and_insert,
)
from kvmesh.router.prefix_index import DEVICE, HOST, REDIS, PrefixIndex
from kvmesh.router.profiles import DEFAULT_PROFILE, SimProfile, get_profile

BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A malformed trace line; the message names the file and the line number."""


@dataclass(frozen=True)
class TraceRequest:
    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _parse_line(text: str, source: str, line: int) -> TraceRequest | None:
    where = f"{source} line {line}"
    text = text.strip()
    if not text:
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in ("timestamp", "input_length", "output_length", "hash_ids"):
        if key not in obj:
            raise TraceError(f"{where}: missing field {key!r}")
    ts, inp, out, ids = obj["timestamp"], obj["input_length"], obj["output_length"], obj["hash_ids"]

    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) or ts < 0:
        raise TraceError(f"{where}: 'timestamp' must be a number >= 0 (ms), got {ts!r}")
    if not is_int(inp) or inp < 1:
        raise TraceError(f"{where}: 'input_length' must be an integer >= 1, got {inp!r}")
    if not is_int(out) or out < 0:
        raise TraceError(f"{where}: 'output_length' must be an integer >= 0, got {out!r}")
    if not isinstance(ids, list) or not all(is_int(i) for i in ids):
        raise TraceError(f"{where}: 'hash_ids' must be a list of integers")
    return TraceRequest(line, float(ts), inp, out, tuple(ids))


def parse_trace(lines: Iterable[str], source: str = "trace", limit: int | None = None):
    """Parse JSONL lines into ``TraceRequest``s (blank lines skipped), stable-sorted by time."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    out: list[TraceRequest] = []
    for n, text in enumerate(lines, start=1):
        req = _parse_line(text, source, n)
        if req is not None:
            out.append(req)
            if limit is not None and len(out) >= limit:
                break
    out.sort(key=lambda r: r.timestamp_ms)
    return out


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake-format JSONL trace; a malformed line raises TraceError with its number."""
    path = Path(path)
    with path.open(encoding="utf-8") as f:
        return parse_trace(f, str(path), limit)


def page_hashes(hash_ids: Sequence[int]) -> list[bytes]:
    """Chained page hashes: page i's hash covers ids 0..i, so equal hashes = equal prefix."""
    out = []
    prev = b""
    for i in hash_ids:
        prev = hashlib.blake2b(prev + int(i).to_bytes(8, "little", signed=True), digest_size=16)
        prev = prev.digest()
        out.append(prev)
    return out


def _full_pages(req: TraceRequest) -> int:
    return min(len(req.hash_ids), req.input_length // BLOCK_TOKENS)


def _reusable_pages(req: TraceRequest) -> int:
    # The engine computes at least the prompt's last token, so a fully cached prompt
    # still recomputes its last page.
    return min(len(req.hash_ids), (req.input_length - 1) // BLOCK_TOKENS)


class _LRU:
    """An LRU set of pages with a fixed capacity (``None`` = unbounded)."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self._d: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, h: bytes) -> bool:
        return h in self._d

    def __len__(self) -> int:
        return len(self._d)

    def touch(self, h: bytes) -> None:
        self._d.move_to_end(h)

    def add(self, h: bytes) -> tuple[bool, list[bytes]]:
        """Insert or refresh ``h``; returns (newly added, evicted pages)."""
        if h in self._d:
            self._d.move_to_end(h)
            return False, []
        if self.capacity is not None and self.capacity <= 0:
            return False, []
        self._d[h] = None
        evicted = []
        while self.capacity is not None and len(self._d) > self.capacity:
            evicted.append(self._d.popitem(last=False)[0])
        return True, evicted


@dataclass(frozen=True)
class SimConfig:
    workers: int
    capacity_tokens: int
    host_capacity_tokens: int = 0
    redis: bool = False
    profile: SimProfile = field(default_factory=lambda: get_profile(DEFAULT_PROFILE))
    speed: float = 1.0
    seed: int = 0
    optimistic_ttl_s: float = 2.0
    # The load guard's slack as time: a worker is overloaded when its queued prefill is more
    # than this many seconds (at the profile's prefill rate) beyond the least-loaded
    # worker's, and more than twice it. Time, not tokens, so it means the same on any profile.
    guard_slack_s: float = 5.0

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.capacity_tokens < BLOCK_TOKENS:
            raise ValueError(
                f"capacity_tokens must be >= {BLOCK_TOKENS} (one page), got {self.capacity_tokens}"
            )
        if self.host_capacity_tokens < 0:
            raise ValueError(f"host_capacity_tokens must be >= 0, got {self.host_capacity_tokens}")
        if not self.speed > 0:
            raise ValueError(f"speed must be > 0, got {self.speed}")
        if not self.guard_slack_s >= 0:  # NaN too
            raise ValueError(f"guard_slack_s must be >= 0, got {self.guard_slack_s}")


@dataclass
class _Job:
    req: TraceRequest
    pages: list[bytes]
    arrival: float
    queued_tokens: int  # what the worker counts in queued_prefill_tokens for it
    hit_device: int = 0
    hit_host: int = 0
    hit_redis: int = 0


class _SimWorker:
    def __init__(self, wid: str, cfg: SimConfig, index: PrefixIndex, redis: set | None) -> None:
        self.wid = wid
        self.engine_id = f"sim-{wid}"
        self.seq = 0
        self.index = index
        self.device = _LRU(cfg.capacity_tokens // BLOCK_TOKENS)
        host_pages = cfg.host_capacity_tokens // BLOCK_TOKENS
        self.host = _LRU(host_pages) if host_pages > 0 else None
        self.redis = redis
        self.waiting: deque[_Job] = deque()
        self.prefilling: _Job | None = None
        self.decoding = 0
        self.queued_prefill_tokens = 0

    def _emit(self, event_cls, h: bytes, tier: str, parent: bytes | None = None) -> None:
        if event_cls is BlockStored:
            ev = BlockStored(self.seq, self.engine_id, h, parent, (), BLOCK_TOKENS, tier)
        else:
            ev = BlockRemoved(self.seq, self.engine_id, h, tier)
        self.seq += 1
        self.index.apply(self.wid, ev)

    def load(self, now: float) -> WorkerLoad:
        running = self.decoding + (1 if self.prefilling is not None else 0)
        return WorkerLoad(
            running=running,
            waiting=len(self.waiting),
            queued_prefill_tokens=self.queued_prefill_tokens,
            timestamp=now,
        )

    def device_hit_pages(self, job: _Job) -> int:
        n = 0
        for h in job.pages[: _reusable_pages(job.req)]:
            if h not in self.device:
                break
            n += 1
        return n

    def lookup(self, job: _Job) -> None:
        """Consecutive hits from the start of the prompt: device, then host, then Redis."""
        dev = host = red = 0
        for h in job.pages[: _reusable_pages(job.req)]:
            if h in self.device:
                dev += 1
                self.device.touch(h)
            elif self.host is not None and h in self.host:
                host += 1
                self.host.touch(h)
            elif self.redis is not None and h in self.redis:
                red += 1
            else:
                break
        job.hit_device, job.hit_host, job.hit_redis = dev, host, red

    def store(self, job: _Job) -> None:
        """The prompt's full pages enter the device cache; evictions spill to host."""
        parent = None
        for h in job.pages:
            added, evicted = self.device.add(h)
            if added:
                self._emit(BlockStored, h, DEVICE, parent)
            for e in evicted:
                self._emit(BlockRemoved, e, DEVICE)
                if self.host is not None:
                    h_added, h_evicted = self.host.add(e)
                    if h_added:
                        self._emit(BlockStored, e, HOST)
                    for he in h_evicted:
                        self._emit(BlockRemoved, he, HOST)
            if self.redis is not None and h not in self.redis:
                self.redis.add(h)
                self._emit(BlockStored, h, REDIS, parent)
            parent = h


@dataclass
class PolicyResult:
    """One policy's numbers on one trace (times in seconds, rates in [0, 1])."""

    policy: str
    requests: int
    prompt_tokens: int
    output_tokens: int
    hit_tokens: int
    hit_tokens_device: int
    hit_tokens_host: int
    hit_tokens_redis: int
    computed_tokens: int
    token_hit_rate: float
    shared_cache_bound: float
    hit_rate_vs_bound: float
    tokens_conserved: bool
    load_imbalance: float
    prefill_utilization: float  # prefill busy time / (workers * makespan)
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    makespan_s: float
    requests_per_s: float
    tokens_per_s: float
    output_tokens_per_s: float
    decisions: dict[str, int]
    index: dict[str, int]

    def to_dict(self) -> dict:
        return asdict(self)


def _percentile(sorted_vals: Sequence[float], q: float) -> float:
    if not sorted_vals:
        return 0.0
    k = max(0, math.ceil(q / 100.0 * len(sorted_vals)) - 1)
    return sorted_vals[min(k, len(sorted_vals) - 1)]


def shared_cache_hit_rate(trace: Sequence[TraceRequest], capacity_pages: int | None) -> float:
    """Token hit rate of one LRU cache of ``capacity_pages`` (None: unbounded) serving the
    whole trace in arrival order, each request's pages inserted as soon as it arrives."""
    cache = _LRU(capacity_pages)
    hits = total = 0
    for req in trace:
        pages = page_hashes(req.hash_ids[: _full_pages(req)])
        n = 0
        for h in pages[: _reusable_pages(req)]:
            if h not in cache:
                break
            n += 1
        hits += n * BLOCK_TOKENS
        total += req.input_length
        for h in pages:
            cache.add(h)
    return hits / total if total else 0.0


def shared_cache_bound(trace: Sequence[TraceRequest], cfg: SimConfig) -> float:
    """The bound for any routing: one cache with the cluster's total device + host capacity
    (unbounded when Redis is on, since the simulated Redis keeps every page)."""
    if cfg.redis:
        return shared_cache_hit_rate(trace, None)
    per_worker = cfg.capacity_tokens // BLOCK_TOKENS + cfg.host_capacity_tokens // BLOCK_TOKENS
    return shared_cache_hit_rate(trace, cfg.workers * per_worker)


def simulate(
    trace: Sequence[TraceRequest],
    policy_name: str,
    cfg: SimConfig,
    *,
    bound: float | None = None,
) -> PolicyResult:
    """Replay ``trace`` through ``policy_name`` on ``cfg.workers`` simulated workers."""
    if policy_name not in POLICIES:
        make_policy(policy_name)  # raises ValueError with the accepted names
    prof = cfg.profile
    now = 0.0
    index = PrefixIndex(optimistic_ttl_s=cfg.optimistic_ttl_s, peer_tiers=(), clock=lambda: now)
    guard = LoadGuard.from_seconds(cfg.guard_slack_s, prof.prefill_tokens_per_s)
    policy = make_policy(
        policy_name, cost=prof.cost_model(), guard=guard, rng=random.Random(cfg.seed)
    )
    redis: set[bytes] | None = set() if cfg.redis else None
    workers = {}
    for i in range(cfg.workers):
        wid = f"w{i}"
        index.add_worker(wid)
        workers[wid] = _SimWorker(wid, cfg, index, redis)
    wlist = list(workers.values())

    # Timed events: (time, tiebreak, kind, worker id, job). Completions at the same time as
    # an arrival are processed first (a lower kind).
    PREFILL_END, DECODE_END = 0, 1
    heap: list = []
    tie = 0
    ttfts: list[float] = []
    reasons: Counter[str] = Counter()
    hit_dev = hit_host = hit_redis = computed = 0
    busy = 0.0
    last_finish = 0.0
    imb_max = imb_mean = 0.0
    last_t = 0.0

    def advance(t: float) -> None:
        nonlocal now, imb_max, imb_mean, last_t
        dt = t - last_t
        if dt > 0:
            q = [w.queued_prefill_tokens for w in wlist]
            imb_max += max(q) * dt
            imb_mean += sum(q) / len(q) * dt
            last_t = t
        now = t

    def start_prefill(w: _SimWorker) -> None:
        nonlocal tie, hit_dev, hit_host, hit_redis, computed, busy
        if w.prefilling is not None or not w.waiting:
            return
        job = w.waiting.popleft()
        w.lookup(job)
        hit_pages = job.hit_device + job.hit_host + job.hit_redis
        todo = job.req.input_length - hit_pages * BLOCK_TOKENS
        # Replace the estimate made at arrival with the real remaining work.
        w.queued_prefill_tokens += todo - job.queued_tokens
        job.queued_tokens = todo
        duration = (
            todo / prof.prefill_tokens_per_s
            + job.hit_host * BLOCK_TOKENS * prof.host_s_per_token
            + job.hit_redis * BLOCK_TOKENS * prof.redis_s_per_token
        )
        hit_dev += job.hit_device * BLOCK_TOKENS
        hit_host += job.hit_host * BLOCK_TOKENS
        hit_redis += job.hit_redis * BLOCK_TOKENS
        computed += todo
        busy += duration
        w.prefilling = job
        tie += 1
        heapq.heappush(heap, (now + duration, PREFILL_END, tie, w.wid, job))

    def handle(kind: int, wid: str, job: _Job) -> None:
        nonlocal tie, last_finish
        w = workers[wid]
        if kind == PREFILL_END:
            w.prefilling = None
            w.queued_prefill_tokens -= job.queued_tokens
            ttfts.append(now - job.arrival)
            w.store(job)
            w.decoding += 1
            tie += 1
            end = now + job.req.output_length * prof.decode_s_per_token
            heapq.heappush(heap, (end, DECODE_END, tie, wid, job))
            start_prefill(w)
        else:
            w.decoding -= 1
            last_finish = max(last_finish, now)

    first_arrival = trace[0].timestamp_ms / 1000.0 / cfg.speed if trace else 0.0
    for req in trace:
        t_arr = req.timestamp_ms / 1000.0 / cfg.speed
        while heap and heap[0][0] <= t_arr:
            t, kind, _, wid, job = heapq.heappop(heap)
            advance(t)
            handle(kind, wid, job)
        advance(t_arr)
        pages = page_hashes(req.hash_ids[: _full_pages(req)])
        rr = RouteRequest(req.input_length, pages, BLOCK_TOKENS)
        loads = {wid: w.load(now) for wid, w in workers.items()}
        decision = pick_and_insert(index, policy, rr, loads)
        reasons[decision.reason] += 1
        w = workers[decision.worker_id]
        job = _Job(req, pages, t_arr, 0)
        est = req.input_length - w.device_hit_pages(job) * BLOCK_TOKENS
        job.queued_tokens = est
        w.queued_prefill_tokens += est
        w.waiting.append(job)
        start_prefill(w)
    while heap:
        t, kind, _, wid, job = heapq.heappop(heap)
        advance(t)
        handle(kind, wid, job)

    prompt = sum(r.input_length for r in trace)
    output = sum(r.output_length for r in trace)
    hits = hit_dev + hit_host + hit_redis
    hit_rate = hits / prompt if prompt else 0.0
    if bound is None:
        bound = shared_cache_bound(trace, cfg)
    ttfts.sort()
    makespan = max(last_finish - first_arrival, 1e-9)
    st = index.stats
    return PolicyResult(
        policy=policy_name,
        requests=len(trace),
        prompt_tokens=prompt,
        output_tokens=output,
        hit_tokens=hits,
        hit_tokens_device=hit_dev,
        hit_tokens_host=hit_host,
        hit_tokens_redis=hit_redis,
        computed_tokens=computed,
        token_hit_rate=hit_rate,
        shared_cache_bound=bound,
        hit_rate_vs_bound=hit_rate / bound if bound else 0.0,
        tokens_conserved=hits + computed == prompt,
        load_imbalance=imb_max / imb_mean if imb_mean else 1.0,
        prefill_utilization=busy / (cfg.workers * makespan),
        ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else 0.0,
        ttft_p50_s=_percentile(ttfts, 50),
        ttft_p99_s=_percentile(ttfts, 99),
        makespan_s=makespan,
        requests_per_s=len(trace) / makespan,
        tokens_per_s=(prompt + output) / makespan,
        output_tokens_per_s=output / makespan,
        decisions=dict(reasons),
        index={
            "events_applied": st.events_applied,
            "events_ignored": st.events_ignored,
            "gaps": st.gaps,
            "restarts": st.restarts,
            "optimistic_inserted": st.optimistic_inserted,
            "optimistic_confirmed": st.optimistic_confirmed,
            "optimistic_expired": st.optimistic_expired,
        },
    )


def resolve_policies(name: str) -> list[str]:
    """``all`` -> every policy (sorted); else the one name, checked."""
    if name == "all":
        return sorted(POLICIES)
    if name not in POLICIES:
        raise ValueError(
            f"unknown routing policy {name!r}; accepted: all, {', '.join(sorted(POLICIES))}"
        )
    return [name]


def simulate_policies(
    trace: Sequence[TraceRequest], policies: Iterable[str], cfg: SimConfig
) -> dict[str, PolicyResult]:
    """Run each policy on the same trace; the shared-cache bound is computed once."""
    if not trace:
        raise ValueError("the trace has no requests")
    bound = shared_cache_bound(trace, cfg)
    return {p: simulate(trace, p, cfg, bound=bound) for p in policies}


def format_table(results: dict[str, PolicyResult]) -> str:
    """A plain-text table of the main numbers, one row per policy."""
    head = (
        f"{'policy':<16} {'hit':>7} {'bound':>7} {'hit/bnd':>7} {'imbal':>6} {'util':>5} "
        f"{'ttft_mean':>10} {'ttft_p50':>9} {'ttft_p99':>9} {'req/s':>8} {'tok/s':>10} cons"
    )
    rows = [head]
    for r in results.values():
        rows.append(
            f"{r.policy:<16} {r.token_hit_rate:>7.2%} {r.shared_cache_bound:>7.2%} "
            f"{r.hit_rate_vs_bound:>7.2%} {r.load_imbalance:>6.2f} {r.prefill_utilization:>5.0%} "
            f"{r.ttft_mean_s:>10.3f} "
            f"{r.ttft_p50_s:>9.3f} {r.ttft_p99_s:>9.3f} {r.requests_per_s:>8.3f} "
            f"{r.tokens_per_s:>10.1f} {'ok' if r.tokens_conserved else 'FAIL'}"
        )
    return "\n".join(rows)
