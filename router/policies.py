"""Routing policies: turn the index's matches and the workers' load into a choice.

Every policy returns a ``Decision`` that carries each candidate's score terms, so a miss can
be traced to the workload, the routing or a stale index. Choose one by name with
``make_policy``; ``prefix_affinity`` is the default. See docs/router.md.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvmesh.router.load import WorkerLoad
from kvmesh.router.prefix_index import NO_MATCH, Match, PrefixIndex, WorkerId

DEFAULT_POLICY = "prefix_affinity"


@dataclass(frozen=True)
class CostModel:
    """Prices in prefill-token equivalents: recomputing one prompt token costs 1.

    Defaults are first estimates for Llama-3-8B on one H100 (prefill ~20k tokens/s, so one
    token ~50 us; bf16 KV is 128 KiB per token), the same arithmetic as ``from_bandwidth``:
    - ``host_cost`` 0.1: host RAM over PCIe at ~25 GB/s effective is ~5 us per token.
    - ``redis_cost`` 0.3: Redis, pipelined, at ~10 GB/s effective over a 100 Gb/s link.
    - ``peer_cost`` 0.5: a chunked, checksummed gRPC fetch from another worker (~5 GB/s),
      which also takes the peer's time; cheaper than recompute, dearer than Redis.
    - ``decode_cost`` 8.0: each running sequence adds a decode token to every step this
      request's prefill shares, and a decode token (memory-bound, reads its whole KV) costs
      several prefill tokens' worth of step time.
    - ``queue_weight`` 0.1: a token of queued work counts this much against a token to
      recompute. Waiting costs only this request; a recompute also costs the cluster later:
      the duplicated pages evict others, and the conversation's next turn follows the newest
      copy, so each move re-computes a whole history. On the Mooncake conversation trace
      (docs/router.md) 1.0 gave 79.5% of the shared-cache bound and 0.1 gives 98%, with mean
      and p50 TTFT no worse; the load guard (on unweighted load) still keeps a hot worker
      from being piled on.
    - ``idle_queue_weight`` 0.25: the weight of queued work instead, while some candidate is
      idle (nothing queued, nothing running). Then waiting buys nothing: a worker could start
      the request now, so a busy worker keeps the request only while its queue is shorter
      than 4x what its cache saves. Not 1.0: moving still costs the cluster the recompute
      and a duplicate of the prefix, and at 1.0 a burst of one tenant's requests split
      across workers at once, each recomputing the same prefix, where waiting for the first
      one's prefill cost the same TTFT. Not 0.5: on the Mooncake trace that moved enough
      conversations to drop prefix_affinity from 97.6% to 96.7% of the shared-cache bound;
      0.25 keeps 97.4% with a lower p99 TTFT (docs/router.md).
    The trace simulator's profiles replace the tier and decode prices with measured values.
    """

    host_cost: float = 0.1
    redis_cost: float = 0.3
    peer_cost: float = 0.5
    decode_cost: float = 8.0
    queue_weight: float = 0.1
    idle_queue_weight: float = 0.25

    def __post_init__(self) -> None:
        for name in ("host_cost", "redis_cost", "peer_cost"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"CostModel.{name} must be in [0, 1] (1 = recompute), got {v}")
        if self.decode_cost < 0:
            raise ValueError(f"CostModel.decode_cost must be >= 0, got {self.decode_cost}")
        for name in ("queue_weight", "idle_queue_weight"):
            if not getattr(self, name) >= 0:  # NaN too
                raise ValueError(f"CostModel.{name} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def from_bandwidth(
        cls,
        *,
        prefill_tokens_per_s: float,
        kv_bytes_per_token: float,
        host_bytes_per_s: float,
        redis_bytes_per_s: float,
        peer_bytes_per_s: float,
        decode_cost: float = 8.0,
    ) -> CostModel:
        """Credits from measured rates: moving a token's KV costs (bytes / bandwidth) seconds,
        recomputing it 1 / prefill rate; the ratio is capped at 1 (never worse than recompute).
        """
        if prefill_tokens_per_s <= 0 or kv_bytes_per_token <= 0:
            raise ValueError("prefill_tokens_per_s and kv_bytes_per_token must be > 0")

        def ratio(bw: float) -> float:
            if bw <= 0:
                raise ValueError(f"bandwidths must be > 0 bytes/s, got {bw}")
            return min(1.0, kv_bytes_per_token / bw * prefill_tokens_per_s)

        return cls(
            host_cost=ratio(host_bytes_per_s),
            redis_cost=ratio(redis_bytes_per_s),
            peer_cost=ratio(peer_bytes_per_s),
            decode_cost=decode_cost,
        )

    def load(self, load: WorkerLoad) -> float:
        """A worker's queued work in prefill-token equivalents."""
        return load.queued_prefill_tokens + self.decode_cost * load.running

    def weight(self, min_load: float) -> float:
        """What one token of queued work counts, given the least-loaded candidate's load (an
        idle candidate never makes a queue count less)."""
        if min_load <= 0:
            return max(self.queue_weight, self.idle_queue_weight)
        return self.queue_weight


@dataclass(frozen=True)
class LoadGuard:
    """When a candidate is too loaded for affinity to send it more work.

    A worker is overloaded when its load exceeds the least-loaded candidate's by more than
    ``slack_tokens`` AND is more than ``ratio`` times it. Both must hold, so a merely busier
    worker (a few thousand tokens ahead, or 1.5x an idle-ish peer) keeps its affinity; only
    one that is far ahead in both senses is skipped. The least-loaded worker is never
    overloaded, so there is always a candidate.
    """

    ratio: float = 2.0
    slack_tokens: float = 8192.0

    def __post_init__(self) -> None:
        if self.ratio < 1.0:
            raise ValueError(f"LoadGuard.ratio must be >= 1, got {self.ratio}")
        if self.slack_tokens < 0:
            raise ValueError(f"LoadGuard.slack_tokens must be >= 0, got {self.slack_tokens}")

    @classmethod
    def from_seconds(
        cls, slack_s: float, prefill_tokens_per_s: float, *, ratio: float = 2.0
    ) -> LoadGuard:
        """A guard whose slack is ``slack_s`` seconds of queued prefill at the given rate."""
        if not prefill_tokens_per_s > 0:  # NaN too
            raise ValueError(f"prefill_tokens_per_s must be > 0, got {prefill_tokens_per_s}")
        if not slack_s >= 0:
            raise ValueError(f"slack_s must be >= 0, got {slack_s}")
        return cls(ratio=ratio, slack_tokens=slack_s * prefill_tokens_per_s)

    def overloaded(self, load: float, min_load: float) -> bool:
        return load - min_load > self.slack_tokens and load > self.ratio * min_load


@dataclass(frozen=True)
class RouteRequest:
    """What a policy knows about the request: its length, page hashes and session."""

    prompt_tokens: int
    page_hashes: Sequence[bytes]
    block_size: int
    session_key: str | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if len(self.page_hashes) * self.block_size > self.prompt_tokens:
            raise ValueError(
                f"{len(self.page_hashes)} pages of {self.block_size} tokens do not fit in a "
                f"prompt of {self.prompt_tokens} tokens"
            )


@dataclass(frozen=True)
class CandidateScore:
    """One candidate's terms, all in prefill-token equivalents except the counts."""

    worker_id: WorkerId
    match: Match
    cached_tokens: int  # prompt tokens some tier can supply (device + host + redis + peer)
    recompute_tokens: int  # prompt tokens no tier has
    fetch_cost: float  # host/redis/peer tokens priced by the CostModel
    load: float  # queued prefill tokens + decode_cost * running
    overloaded: bool
    total: float  # recompute_tokens + fetch_cost + CostModel.weight(min load) * load


@dataclass(frozen=True)
class Decision:
    """The chosen worker and why.

    ``reason``: ``affinity`` (least expected work), ``session`` (sticky session kept),
    ``least_loaded`` or ``round_robin``. ``tied``: the workers that shared the winning
    score (the choice among them was random). ``candidates``: every candidate's terms, in
    worker order.
    """

    worker_id: WorkerId
    policy: str
    reason: str
    candidates: tuple[CandidateScore, ...]
    tied: tuple[WorkerId, ...] = ()

    def score(self, worker_id: WorkerId) -> CandidateScore:
        for c in self.candidates:
            if c.worker_id == worker_id:
                return c
        raise KeyError(f"{worker_id!r} was not a candidate")


class NoWorkerError(RuntimeError):
    """There is no worker to route to (none has reported its load)."""


class RoutingPolicy(ABC):
    """Chooses a worker for one request.

    ``pick`` may change only the policy's own state (a round-robin cursor, a session table,
    its random generator). It never modifies the index, the matches or the loads; recording
    the routed pages in the index (``PrefixIndex.insert_optimistic``) is the caller's job,
    done by ``pick_and_insert``.
    """

    name: ClassVar[str]

    def __init__(
        self,
        *,
        cost: CostModel | None = None,
        guard: LoadGuard | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.cost = cost or CostModel()
        self.guard = guard or LoadGuard()
        self.rng = rng or random.Random()

    @abstractmethod
    def pick(
        self,
        request: RouteRequest,
        matches: Mapping[WorkerId, Match],
        loads: Mapping[WorkerId, WorkerLoad],
    ) -> Decision:
        """Choose among the workers in ``loads`` (those alive and reporting).

        ``matches`` comes from ``PrefixIndex.match``; a worker missing there matched nothing.
        Raises NoWorkerError when ``loads`` is empty.
        """

    def _score_all(
        self,
        request: RouteRequest,
        matches: Mapping[WorkerId, Match],
        loads: Mapping[WorkerId, WorkerLoad],
    ) -> list[CandidateScore]:
        if not loads:
            raise NoWorkerError("no worker has reported its load; nothing to route to")
        c, bs = self.cost, request.block_size
        worker_loads = {wid: c.load(ld) for wid, ld in loads.items()}
        min_load = min(worker_loads.values())
        weight = c.weight(min_load)
        out = []
        for wid in sorted(loads, key=str):  # a stable order makes seeded tie-breaks repeatable
            m = matches.get(wid, NO_MATCH)
            cached = m.pages * bs
            recompute = request.prompt_tokens - cached
            fetch = bs * (c.host_cost * m.host + c.redis_cost * m.redis + c.peer_cost * m.peer)
            load = worker_loads[wid]
            out.append(
                CandidateScore(
                    worker_id=wid,
                    match=m,
                    cached_tokens=cached,
                    recompute_tokens=recompute,
                    fetch_cost=fetch,
                    load=load,
                    overloaded=self.guard.overloaded(load, min_load),
                    total=recompute + fetch + weight * load,
                )
            )
        return out

    def _pick_min(self, cands: list[CandidateScore], key) -> tuple[CandidateScore, tuple]:
        """The candidate with the least ``key``; ties are broken at random."""
        best = min(key(c) for c in cands)
        tied = [c for c in cands if key(c) <= best + 1e-9]
        return self.rng.choice(tied), tuple(c.worker_id for c in tied)


class RoundRobin(RoutingPolicy):
    """Each request to the next worker in id order; ignores cache and load."""

    name = "round_robin"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._next = 0

    def pick(self, request, matches, loads) -> Decision:
        cands = self._score_all(request, matches, loads)
        chosen = cands[self._next % len(cands)]
        self._next += 1
        return Decision(chosen.worker_id, self.name, "round_robin", tuple(cands))


class LeastLoaded(RoutingPolicy):
    """The worker with the least queued work (CostModel.load); ignores cache."""

    name = "least_loaded"

    def pick(self, request, matches, loads) -> Decision:
        cands = self._score_all(request, matches, loads)
        chosen, tied = self._pick_min(cands, lambda c: c.load)
        return Decision(chosen.worker_id, self.name, "least_loaded", tuple(cands), tied)


class PrefixAffinity(RoutingPolicy):
    """The worker with the least expected work for this request, among those not overloaded.

    Expected work = prompt tokens no tier has + tier-priced fetched tokens + weighted queued
    load (``CostModel.weight``: heavier while another candidate is idle; the guard judges the
    unweighted load). A session key sticks to the worker it last went to while that worker is
    not overloaded; the table keeps the ``max_sessions`` most recent keys.
    """

    name = "prefix_affinity"

    def __init__(self, *, max_sessions: int = 100_000, **kwargs) -> None:
        super().__init__(**kwargs)
        if max_sessions < 0:
            raise ValueError(f"max_sessions must be >= 0, got {max_sessions}")
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, WorkerId] = OrderedDict()

    def pick(self, request, matches, loads) -> Decision:
        cands = self._score_all(request, matches, loads)
        key = request.session_key
        if key is not None and key in self._sessions:
            sticky = self._sessions[key]
            for c in cands:
                if c.worker_id == sticky and not c.overloaded:
                    self._remember(key, sticky)
                    return Decision(sticky, self.name, "session", tuple(cands))
        eligible = [c for c in cands if not c.overloaded]
        chosen, tied = self._pick_min(eligible, lambda c: c.total)
        if key is not None:
            self._remember(key, chosen.worker_id)
        return Decision(chosen.worker_id, self.name, "affinity", tuple(cands), tied)

    def _remember(self, key: str, worker_id: WorkerId) -> None:
        if self.max_sessions == 0:
            return
        self._sessions[key] = worker_id
        self._sessions.move_to_end(key)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)


POLICIES: dict[str, type[RoutingPolicy]] = {
    p.name: p for p in (RoundRobin, LeastLoaded, PrefixAffinity)
}


def make_policy(name: str = DEFAULT_POLICY, **kwargs) -> RoutingPolicy:
    """Build a policy by name; ``kwargs`` go to its constructor (cost, guard, rng, ...)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown routing policy {name!r}; accepted: {', '.join(sorted(POLICIES))}"
        ) from None
    return cls(**kwargs)


def pick_and_insert(
    index: PrefixIndex,
    policy: RoutingPolicy,
    request: RouteRequest,
    loads: Mapping[WorkerId, WorkerLoad],
) -> Decision:
    """Match, pick, then insert the routed pages optimistically on the chosen worker.

    The optimistic insert is what keeps a burst of same-prefix requests together before the
    chosen worker's block events arrive.
    """
    decision = policy.pick(request, index.match(request.page_hashes), loads)
    index.insert_optimistic(decision.worker_id, request.page_hashes)
    return decision
