"""The scheduler: one rule for continuous batching, chunked prefill and prefix caching.

There is no prefill phase and no decode phase. Every request has ``num_computed_tokens``;
each step gives each request ``min(remaining, budget left)`` new tokens under
``max_num_batched_tokens`` and ``max_num_seqs``. Running requests go first (oldest first),
then waiting ones in arrival order (FCFS). When the pool runs out of pages, the newest running
request is preempted: its pages are freed (they stay in the prefix cache) and it goes back to
the front of the queue, to be recomputed later.

Admission is optimistic: a waiting request is admitted when its prompt fits. Once a
preemption shows the pool overcommitted, that would thrash (admit a request, compute its
prompt, preempt it when the others grow, admit it again): from then on, until the queue
drains, a waiting request is admitted only if the running requests' and its own growth
still fits beside it: the rest of each one's prompt, and ``preemption_reserve`` of the
output each is expected to produce still (its remaining ``max_tokens``, capped by the
finished requests' mean output), doubled at a step with further preemptions, up to all of
it. A KV budget bounds what a compacted request holds; before its compaction it holds its
whole prompt and then a copy of what it keeps. A request that runs alone is always
admitted.

The scheduler never talks to a tier. It asks the KV connector (worker/kv_connector.py)
whether the tiers can supply more of a waiting request's prefix; a request being promoted
waits in its own state (``PROMOTING``) in the queue, passed over until the connector is done.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmesh.worker.config import SchedulerConfig
from kvmesh.worker.kv_cache import KVCacheManager
from kvmesh.worker.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvmesh.worker.kv_connector import KVConnector


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, connector: KVConnector | None = None
    ):
        self.config = config
        self.kv = kv
        self.connector = connector  # None: no tiers below the device, no peers
        self.waiting: deque[Request] = deque()  # PROMOTING requests wait here too
        self.running: list[Request] = []
        self.num_preemptions = 0
        # the share of each request's remaining output admission keeps pages for: 0 until a
        # preemption, back to 0 when the queue drains (see the module docstring)
        self.reserve_ratio = 0.0
        self.mean_output: float | None = None  # moving mean of finished requests' outputs
        self._steps = 0
        self._raised_at = -1  # the step the share was last raised in

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt_newest(self, out: SchedulerOutput) -> Request:
        victim = self.running.pop()
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_evicted, victim.kv_state = 0, None  # recomputed in full, evicted anew
        if self.connector is not None:
            self.connector.on_preempted(victim)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        if self._raised_at != self._steps:  # once a step, however many it preempts
            self._raised_at = self._steps
            r = self.config.preemption_reserve
            self.reserve_ratio = min(1.0, 2 * self.reserve_ratio) if self.reserve_ratio else r
        self.waiting.appendleft(victim)
        out.preempted.append(victim)
        return victim

    def _pages_to_grow(self, req: Request, held: int) -> int:
        """Pages ``req`` still needs, beyond ``held``, for the rest of its prompt and
        ``reserve_ratio`` of the output it is expected to produce still: its remaining
        ``max_tokens``, but no more than the finished requests' mean output beyond what it
        has produced (a request without ``max_tokens`` would otherwise count the whole
        ``max_model_len``); before any request finished, no more than a step's token budget.
        The last output token is never written to the cache."""
        bs = self.kv.block_size
        done = len(req.output_token_ids)
        left = min(req.params.max_tokens - done, self.config.max_model_len - req.num_tokens)
        if self.mean_output is None:
            expected = self.config.max_num_batched_tokens
        else:
            expected = max(self.mean_output - done, bs)
        grow = math.ceil(max(min(left, expected) - 1, 0) * self.reserve_ratio)
        pages = -(-(req.num_tokens - req.num_evicted + grow) // bs)
        if req.kv_budget is not None:  # docs/eviction.md: at most ceil(B / bs) + 1 pages
            cap = -(-req.kv_budget // bs) + 1
            if req.num_evicted == 0 and req.num_prompt_tokens > req.kv_budget:
                # not compacted yet: the whole prompt, then the copy of what it keeps
                pages = -(-req.num_prompt_tokens // bs) + cap
            else:
                pages = min(pages, cap)
        return max(0, pages - held)

    def schedule(self) -> SchedulerOutput:
        self._steps += 1
        if not self.waiting:
            self.reserve_ratio = 0.0
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while self.kv.allocate_slots(req, num_new) is None:
                # pages pinned for waiting requests are only cache: they go before a
                # running request's computed KV does
                if self.kv.release_newest_hold():
                    continue
                if self._preempt_newest(out) is req:
                    break
            else:
                out.scheduled.append((req, num_new))
                budget -= num_new
                i += 1
                continue
            break  # req itself was preempted: nothing older is left to try
        if out.preempted:
            return out  # the pool is full: admitting new work now would only thrash
        conn = self.connector
        blocked = False  # a request that could run did not fit in the pool
        reserve = 0
        if self.reserve_ratio:
            reserve = sum(self._pages_to_grow(r, self.kv.num_held_pages(r)) for r in self.running)
        i = 0  # PROMOTING requests are passed over; the others are taken in order
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[i]
            if req.status is RequestStatus.PROMOTING and not conn.finish_promotion(
                req, room_needed=bool(self.running)
            ):
                i += 1
                continue
            computed, num_hit = self.kv.get_computed_pages(req)
            if conn is not None and conn.start_promotion(req, computed):
                i += 1
                continue
            num_new = min(req.num_tokens - num_hit, budget)
            extra = 0
            if self.reserve_ratio and (self.running or out.scheduled):
                held = -(-(num_hit + num_new) // self.kv.block_size)
                extra = reserve + self._pages_to_grow(req, held)
            if self.kv.allocate_slots(req, num_new, computed, reserve=extra) is None:
                blocked = True
                break
            if self.reserve_ratio:
                reserve += self._pages_to_grow(req, self.kv.num_held_pages(req))
            del self.waiting[i]
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                req.first_scheduled_time = time.monotonic()
                for p in computed:  # pages promoted from a lower tier count for that tier
                    tier = req.promoted_from.get(p.page_hash, "device")
                    req.cached_by_tier[tier] = req.cached_by_tier.get(tier, 0) + req.block_size
                self.kv.prefix_queries += req.num_tokens
                self.kv.prefix_hits += num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append((req, num_new))
            budget -= num_new
        if blocked and not self.running and not out.scheduled and self.kv.num_holds:
            # Nothing runs and the head of the queue does not fit: the pages pinned for
            # waiting requests (held prefixes, promoted pages) are what it lacks. They stay
            # cached, now evictable, rather than the engine waiting forever.
            self.kv.release_holds()
        return out

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Remove a running or waiting request and free its pages at once."""
        req.status = status
        if req.output_token_ids and status in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
        ):
            n = len(req.output_token_ids)
            m = self.mean_output
            self.mean_output = float(n) if m is None else 0.9 * m + 0.1 * n
        if self.connector is not None:
            self.connector.on_finished(req)
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.kv.free(req)
