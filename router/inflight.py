"""Requests the router has routed and not yet seen finish, counted per worker.

Why the router counts them: workers report their load every report interval (0.25 s) and
when a request finishes, so a burst of requests that arrives between two reports would all
see the same stale "idle" and pile onto one worker. The router knows at once what it has
sent where. A worker's report still matters (it also sees work from other routers, direct
clients and preemptions), so it refines the count without replacing it: the load a policy
sees is, field by field, the larger of the two (``effective_load``).

A request charges its worker from ``begin`` (routed) to ``end`` (its stream closed, however):
- ``prefill_tokens``: what the worker must still do before the first token, in prefill-token
  equivalents (the chosen candidate's uncached tokens plus its priced tier fetches), until
  ``first_token``;
- one running sequence (the decode load), until ``end``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvmesh.router.load import WorkerLoad

__all__ = ["InflightLoad", "InflightTable", "effective_load"]


@dataclass
class InflightLoad:
    """One worker's share of the router's in-flight requests."""

    requests: int = 0  # routed, stream not closed
    prefill_tokens: int = 0  # of those that have not streamed their first token


@dataclass
class _Entry:
    worker_id: str
    prefill_tokens: int  # 0 once the first token arrived


class InflightTable:
    """request id -> (worker, prefill still charged), with per-worker totals. Not
    thread-safe: the router's event loop owns it, like the rest of ``RouterCore``."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._per_worker: dict[str, InflightLoad] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def begin(self, request_id: str, worker_id: str, prefill_tokens: int) -> None:
        """Charge ``worker_id`` for a request just routed there. A request routed again (a
        retry after its worker failed) moves: its old charge is released first."""
        if prefill_tokens < 0:
            raise ValueError(f"prefill_tokens must be >= 0, got {prefill_tokens}")
        self.end(request_id)
        self._entries[request_id] = _Entry(worker_id, prefill_tokens)
        w = self._per_worker.setdefault(worker_id, InflightLoad())
        w.requests += 1
        w.prefill_tokens += prefill_tokens

    def first_token(self, request_id: str) -> None:
        """The request's prefill is done: from now on it only decodes. Idempotent."""
        e = self._entries.get(request_id)
        if e is None or not e.prefill_tokens:
            return
        self._per_worker[e.worker_id].prefill_tokens -= e.prefill_tokens
        e.prefill_tokens = 0

    def end(self, request_id: str) -> None:
        """The request's stream closed (finished, failed, aborted). Unknown ids are ignored."""
        e = self._entries.pop(request_id, None)
        if e is None:
            return
        w = self._per_worker[e.worker_id]
        w.requests -= 1
        w.prefill_tokens -= e.prefill_tokens
        if not w.requests:
            del self._per_worker[e.worker_id]

    def drop_worker(self, worker_id: str) -> None:
        """Forget every charge on a worker that left (its requests are retried or failed)."""
        self._per_worker.pop(worker_id, None)
        for rid in [r for r, e in self._entries.items() if e.worker_id == worker_id]:
            del self._entries[rid]

    def of(self, worker_id: str) -> InflightLoad:
        w = self._per_worker.get(worker_id)
        return InflightLoad(w.requests, w.prefill_tokens) if w is not None else InflightLoad()


def effective_load(reported: WorkerLoad, mine: InflightLoad) -> WorkerLoad:
    """What a policy should assume: the worker's last report, raised to at least what the
    router itself has in flight there (running sequences and queued prefill tokens)."""
    if not mine.requests:
        return reported
    return replace(
        reported,
        running=max(reported.running, mine.requests),
        queued_prefill_tokens=max(reported.queued_prefill_tokens, mine.prefill_tokens),
    )
