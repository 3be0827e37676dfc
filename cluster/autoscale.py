"""Autoscaling: the cluster grows and shrinks its workers with load, and keeps its cache.

``kvmesh serve --min-workers N --max-workers M`` runs an ``Autoscaler`` beside the router:
every ``interval_s`` it reads the router's view (``RouterCore.autoscale_view``), feeds it
to a ``ScalingPolicy`` and carries out what the policy decides. docs/autoscaling.md is the
user's page; the policy in short:

- **Signals**, averaged over the last ``look_back_s`` seconds: waiting requests and queued
  prefill tokens per live worker, the workers' mean KV-cache usage, and (with
  ``ttft_slo_s``) the router's TTFT p99.
- **Scale up** by one worker when any signal has stayed above its high mark for
  ``upscale_delay_s``; **scale down** by one when every signal, spread over one worker
  fewer, has stayed under its low mark for ``downscale_delay_s``. Between the marks
  nothing happens (the band), and either clock restarts whenever its condition breaks, so
  a signal oscillating inside the band, or crossing a mark for less than the delay, never
  scales. After an action the window starts over. Below ``min_workers`` or above
  ``max_workers`` the policy acts at once.
- **Which worker goes**: the one whose cached pages are least unique in the cluster
  (``PrefixIndex.unique_pages``: pages no other worker and not Redis holds), ties to the
  one with fewer requests in flight.
- **Cache-preserving retirement**: the router stops routing to it; its requests in flight
  finish (at most ``drain_timeout_s``); it writes its device and host pages down to Redis
  (at most ``flush_timeout_s``, worker/flush.py) and reports them; it leaves the router,
  which keeps those Redis pages credited to every worker; its actor exits, so Ray's
  autoscaler can remove its node.

Ray Serve's defaults are the defaults here (upscale 30 s, downscale 600 s); the tests and
the benchmark scale them down.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field

logger = logging.getLogger("kvmesh.autoscale")

UP, DOWN = "up", "down"


@dataclass(frozen=True)
class AutoscaleConfig:
    """The scaling policy's bounds, marks and delays (docs/autoscaling.md)."""

    min_workers: int = 1
    max_workers: int = 1
    upscale_delay_s: float = 30.0  # Ray Serve's default
    downscale_delay_s: float = 600.0  # Ray Serve's default
    look_back_s: float = 30.0  # signals are averaged over this window
    interval_s: float = 1.0  # how often the controller samples the router
    # high marks: any one exceeded (per live worker) asks for one more worker
    waiting_high: float = 2.0
    queued_tokens_high: float = 2048.0
    kv_usage_high: float = 0.90
    ttft_slo_s: float | None = None  # TTFT p99 above it asks for one more worker
    # low marks: all met, with the load spread over one worker fewer, allow one fewer
    waiting_low: float = 0.5
    queued_tokens_low: float = 256.0
    kv_usage_low: float = 0.60
    ttft_low_fraction: float = 0.5  # of the SLO
    # retirement
    drain_timeout_s: float = 30.0
    flush_timeout_s: float = 30.0
    preserve_cache: bool = True  # False: a retired worker's cache is dropped (the baseline)
    start_timeout_s: float = 900.0  # a new worker Ray cannot place is given up after this

    def __post_init__(self) -> None:
        if self.min_workers < 1:
            raise ValueError(f"min_workers must be >= 1, got {self.min_workers}")
        if self.max_workers < self.min_workers:
            raise ValueError(
                f"max_workers ({self.max_workers}) must be >= min_workers ({self.min_workers})"
            )
        for name in (
            "upscale_delay_s",
            "downscale_delay_s",
            "look_back_s",
            "drain_timeout_s",
            "flush_timeout_s",
        ):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)}")
        for name in ("interval_s", "start_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.ttft_slo_s is not None and not self.ttft_slo_s > 0:
            raise ValueError(f"ttft_slo_s must be > 0 seconds or None, got {self.ttft_slo_s}")
        for low, high in (
            ("waiting_low", "waiting_high"),
            ("queued_tokens_low", "queued_tokens_high"),
            ("kv_usage_low", "kv_usage_high"),
        ):
            lo, hi = getattr(self, low), getattr(self, high)
            if not 0 <= lo < hi:
                raise ValueError(f"need 0 <= {low} < {high}, got {lo} and {hi}")
        if not 0 < self.ttft_low_fraction < 1:
            raise ValueError(f"ttft_low_fraction must be in (0, 1), got {self.ttft_low_fraction}")

    @property
    def enabled(self) -> bool:
        """Whether there is anything to scale (min < max)."""
        return self.max_workers > self.min_workers

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Signals:
    """One sample of the fleet, as the router sees it. ``workers``: live (registered, not
    draining); ``pending``: started, not registered yet."""

    workers: int
    pending: int = 0
    waiting: float = 0.0
    running: float = 0.0
    queued_prefill_tokens: float = 0.0
    kv_usage: float = 0.0
    ttft_p99_s: float | None = None

    @classmethod
    def from_view(cls, view: Mapping, pending: int = 0) -> Signals:
        """From ``RouterCore.autoscale_view``."""
        return cls(
            workers=len(view["workers"]),
            pending=pending,
            waiting=float(view["waiting"]),
            running=float(view["running"]),
            queued_prefill_tokens=float(view["queued_prefill_tokens"]),
            kv_usage=float(view["kv_usage"]),
            ttft_p99_s=view.get("ttft_p99_s"),
        )


@dataclass
class ScaleDecision:
    """One action and why: ``cause`` is a label (high_load, low_load, min_workers,
    max_workers), ``reason`` a sentence, ``inputs`` the averaged signals it read."""

    action: str  # UP or DOWN
    from_workers: int
    to_workers: int
    cause: str
    reason: str
    inputs: dict = field(default_factory=dict)
    worker: str | None = None  # the one retired (DOWN)
    worker_reason: str | None = None  # why that one
    flush: dict | None = None  # what its flush did (DOWN)
    at: float = field(default_factory=time.time)
    seconds: float | None = None  # how long carrying it out took

    def as_dict(self) -> dict:
        return asdict(self)


class ScalingPolicy:
    """Decides from samples; pure but for ``clock`` (a fake one in the tests)."""

    def __init__(self, cfg: AutoscaleConfig, clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.clock = clock
        self._samples: deque[tuple[float, Signals]] = deque()
        self._high_since: float | None = None
        self._low_since: float | None = None

    def reset(self) -> None:
        """Start over (after an action: the fleet changed, so the old samples say little)."""
        self._samples.clear()
        self._high_since = self._low_since = None

    def averaged(self) -> dict:
        """The look-back window's mean per-worker signals (TTFT: the mean of the p99s)."""
        samples = [s for _, s in self._samples]
        if not samples:
            return {}
        k = len(samples)
        per = [max(1, s.workers) for s in samples]
        ttfts = [s.ttft_p99_s for s in samples if s.ttft_p99_s is not None]
        return {
            "workers": samples[-1].workers,
            "pending": samples[-1].pending,
            "samples": k,
            "waiting": sum(s.waiting for s in samples) / k,
            "queued_prefill_tokens": sum(s.queued_prefill_tokens for s in samples) / k,
            "waiting_per_worker": sum(s.waiting / n for s, n in zip(samples, per)) / k,
            "queued_tokens_per_worker": sum(
                s.queued_prefill_tokens / n for s, n in zip(samples, per)
            )
            / k,
            "kv_usage": sum(s.kv_usage for s in samples) / k,
            "ttft_p99_s": sum(ttfts) / len(ttfts) if ttfts else None,
        }

    def _high(self, avg: dict) -> list[str]:
        c = self.cfg
        out = []
        if avg["waiting_per_worker"] > c.waiting_high:
            out.append(f"waiting/worker {avg['waiting_per_worker']:.2f} > {c.waiting_high:g}")
        if avg["queued_tokens_per_worker"] > c.queued_tokens_high:
            out.append(
                f"queued prefill tokens/worker {avg['queued_tokens_per_worker']:.0f} > "
                f"{c.queued_tokens_high:g}"
            )
        if avg["kv_usage"] > c.kv_usage_high:
            out.append(f"kv usage {avg['kv_usage']:.2f} > {c.kv_usage_high:g}")
        ttft = avg["ttft_p99_s"]
        if c.ttft_slo_s is not None and ttft is not None and ttft > c.ttft_slo_s:
            out.append(f"ttft p99 {ttft:.3f}s > slo {c.ttft_slo_s:g}s")
        return out

    def _low(self, avg: dict) -> bool:
        """Every signal under its low mark once the load is spread over one worker fewer."""
        c = self.cfg
        n = avg["workers"]
        if n <= 1:
            return False
        fewer = n - 1
        ttft = avg["ttft_p99_s"]
        return (
            avg["waiting"] / fewer <= c.waiting_low
            and avg["queued_prefill_tokens"] / fewer <= c.queued_tokens_low
            and avg["kv_usage"] * n / fewer <= c.kv_usage_low
            and (c.ttft_slo_s is None or ttft is None or ttft <= c.ttft_low_fraction * c.ttft_slo_s)
        )

    def observe(self, s: Signals) -> ScaleDecision | None:
        """Add a sample; return the action it calls for, if any (one worker at a time)."""
        c = self.cfg
        now = self.clock()
        self._samples.append((now, s))
        while self._samples and self._samples[0][0] < now - c.look_back_s:
            self._samples.popleft()
        n = s.workers + s.pending
        avg = self.averaged()
        if n < c.min_workers:
            return self._act(UP, n, "min_workers", f"{n} workers < min_workers {c.min_workers}")
        if n > c.max_workers:
            return self._act(DOWN, n, "max_workers", f"{n} workers > max_workers {c.max_workers}")
        if s.pending:  # a worker on its way: wait for it before judging the load again
            self._high_since = self._low_since = None
            return None
        high = self._high(avg)
        if high:
            self._low_since = None
            if n >= c.max_workers:
                self._high_since = None
                return None
            if self._high_since is None:
                self._high_since = now
            if now - self._high_since >= c.upscale_delay_s:
                why = "; ".join(high) + f" for {now - self._high_since:.0f}s"
                return self._act(UP, n, "high_load", why, avg)
            return None
        self._high_since = None
        if n > c.min_workers and self._low(avg):
            if self._low_since is None:
                self._low_since = now
            if now - self._low_since >= c.downscale_delay_s:
                why = f"every signal under its low mark on {n - 1} workers for " + (
                    f"{now - self._low_since:.0f}s"
                )
                return self._act(DOWN, n, "low_load", why, avg)
            return None
        self._low_since = None
        return None

    def _act(
        self, action: str, n: int, cause: str, reason: str, avg: dict | None = None
    ) -> ScaleDecision:
        inputs = dict(avg if avg is not None else self.averaged())
        self.reset()
        to = n + 1 if action == UP else n - 1
        return ScaleDecision(action, n, to, cause, reason, inputs)


def choose_worker_to_retire(view: Mapping[str, Mapping]) -> tuple[str, str]:
    """The worker whose cached pages are least unique in the cluster (fewest pages no other
    worker and not Redis holds), then the one with the fewest requests in flight, then by
    id. ``view``: ``RouterCore.autoscale_view()["workers"]``. Returns (id, why)."""
    if not view:
        raise ValueError("no live worker to retire")
    wid = min(view, key=lambda w: (view[w]["unique_pages"], view[w]["in_flight"], w))
    others = {w: v["unique_pages"] for w, v in sorted(view.items()) if w != wid}
    why = (
        f"fewest unique pages ({view[wid]['unique_pages']}; others {others}), "
        f"{view[wid]['in_flight']} requests in flight"
    )
    return wid, why


class Autoscaler:
    """The controller: a thread that samples the router, asks the policy, and starts or
    retires workers through the ``Cluster`` (cluster/serve.py). Decisions go to the
    router (``record_scaling``: its stats, its metrics, ``kvmesh top``) and the log."""

    def __init__(self, cluster, cfg: AutoscaleConfig) -> None:
        self.cluster = cluster
        self.cfg = cfg
        self.policy = ScalingPolicy(cfg)
        self.decisions: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvmesh-autoscale", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 60.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.wait(self.cfg.interval_s):
            try:
                self.step()
            except Exception as e:  # the router restarting, a Ray hiccup: try again
                logger.warning("autoscaler step failed: %r", e)

    def step(self) -> ScaleDecision | None:
        """One sample and, if the policy says so, one action (carried out before return)."""
        import ray

        cl = self.cluster
        view = ray.get(cl.router.autoscale_view.remote(self.cfg.look_back_s), timeout=30)
        live_names = {w["name"] for w in view["workers"].values()}
        pending = cl.pending_workers(live_names)
        # a worker the cluster owns that is not live (Ray restarting it, or its registration
        # lost) counts as pending too: the bounds count actors, and no load-based action is
        # taken until it is back, so a restart never triggers a scale-up
        absent = sum(name not in live_names for name in list(cl.worker_names))
        d = self.policy.observe(Signals.from_view(view, pending=len(pending) + absent))
        if d is None:
            return None
        t0 = time.monotonic()
        if d.action == UP:
            d.worker = cl.add_worker()
            logger.info(
                "autoscale up: %d -> %d workers, starting %s (%s)",
                d.from_workers,
                d.to_workers,
                d.worker,
                d.reason,
            )
        else:
            if pending and d.cause == "max_workers":  # cancel a start before retiring
                d.worker = pending[0]
                d.worker_reason = "not registered yet"
                cl.cancel_worker(pending[0])
            else:
                wid, d.worker_reason = choose_worker_to_retire(view["workers"])
                d.worker = view["workers"][wid]["name"]
                logger.info(
                    "autoscale down: %d -> %d workers, retiring %s (%s; %s)",
                    d.from_workers,
                    d.to_workers,
                    d.worker,
                    d.reason,
                    d.worker_reason,
                )
                d.flush = cl.retire_worker(
                    wid,
                    d.worker,
                    drain_timeout_s=self.cfg.drain_timeout_s,
                    flush_timeout_s=self.cfg.flush_timeout_s,
                    preserve_cache=self.cfg.preserve_cache,
                )
        d.seconds = round(time.monotonic() - t0, 3)
        rec = d.as_dict()
        self.decisions.append(rec)
        try:
            ray.get(cl.router.record_scaling.remote(rec), timeout=30)
        except Exception as e:
            logger.warning("recording the decision at the router failed: %r", e)
        self.policy.reset()  # the fleet changed while acting: judge it afresh
        return d


__all__ = [
    "DOWN",
    "UP",
    "AutoscaleConfig",
    "Autoscaler",
    "ScaleDecision",
    "ScalingPolicy",
    "Signals",
    "choose_worker_to_retire",
]
