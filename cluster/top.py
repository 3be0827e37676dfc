"""``kvmesh top``: a live terminal view of a cluster, from its Prometheus metrics.

    kvmesh top --address ROUTER_HOST:METRICS_PORT

reads the router's ``/metrics`` (the address ``kvmesh serve --metrics-port`` prints), finds
every live worker's ``/metrics`` in ``kvmesh:router_worker_info`` and reads those too, once a
second. One row per worker: requests running and waiting, KV usage, the share of prompt
tokens each tier served, generated tokens per second and TTFT p50 (both over the last
refresh; TTFT falls back to every request so far while none finished its prefill since);
then the router's decision mix. Ctrl-C exits.
"""

from __future__ import annotations

import argparse
import math
import signal
import threading
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

P = "kvmesh:"
SOURCES = ("device", "host", "redis", "peer")

# a scrape: metric sample name -> list of (labels, value)
Samples = dict[str, list[tuple[dict[str, str], float]]]


def scrape(address: str, timeout: float = 2.0) -> Samples:
    """The samples of one ``/metrics`` page (``host:port`` or a URL)."""
    url = address if "://" in address else f"http://{address}"
    if not url.rstrip("/").endswith("/metrics"):
        url = url.rstrip("/") + "/metrics"
    with urllib.request.urlopen(url, timeout=timeout) as r:
        text = r.read().decode()
    out: Samples = defaultdict(list)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name].append((s.labels, s.value))
    return out


def total(samples: Samples, name: str, **match: str) -> float:
    """The sum of ``name``'s samples whose labels include ``match``."""
    return sum(
        v
        for labels, v in samples.get(name, ())
        if all(labels.get(k) == want for k, want in match.items())
    )


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus's estimate of quantile ``q`` from cumulative bucket counts ``{le: count}``
    (linear inside the bucket); None when there is no observation."""
    les = sorted(buckets)
    if not les or buckets[les[-1]] <= 0:
        return None
    rank = q * buckets[les[-1]]
    prev_le, prev_c = 0.0, 0.0
    for le in les:
        c = buckets[le]
        if c >= rank:
            if math.isinf(le):
                return prev_le
            if c == prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return None


def _buckets(samples: Samples, name: str) -> dict[float, float]:
    out: dict[float, float] = defaultdict(float)
    for labels, v in samples.get(name + "_bucket", ()):
        out[float(labels["le"])] += v
    return out


@dataclass
class WorkerRow:
    worker: str
    name: str
    running: float = 0
    waiting: float = 0
    kv_usage: float = 0.0
    hit_by_tier: dict[str, float] = field(default_factory=dict)  # share of prompt tokens
    tokens_per_s: float | None = None
    ttft_p50: float | None = None
    error: str | None = None


class TopModel:
    """Two successive scrapes of every target make one frame (rates are their differences)."""

    def __init__(self, address: str, timeout: float = 2.0) -> None:
        self.address = address
        self.timeout = timeout
        self._prev: dict[str, tuple[float, Samples]] = {}

    def frame(self) -> tuple[Samples, list[WorkerRow]]:
        router = scrape(self.address, self.timeout)
        info = sorted(
            (labels for labels, _ in router.get(P + "router_worker_info", ())),
            key=lambda labels: labels.get("name", ""),
        )

        def one(labels: dict[str, str]) -> tuple[dict[str, str], Samples | None, str | None]:
            addr = labels.get("metrics_address")
            if not addr:
                return labels, None, "no /metrics (serve with --metrics-port)"
            try:
                return labels, scrape(addr, self.timeout), None
            except OSError as e:
                return labels, None, f"scrape failed: {e}"

        rows = []
        now = time.monotonic()
        for labels, samples, err in _in_daemon_threads(one, info):
            row = WorkerRow(labels["worker"], labels.get("name", ""))
            if samples is None:
                row.error = err
            else:
                self._fill(row, samples, now)
                self._prev[row.worker] = (now, samples)
            rows.append(row)
        return router, rows

    def _fill(self, row: WorkerRow, s: Samples, now: float) -> None:
        row.running = total(s, P + "num_requests_running")
        row.waiting = total(s, P + "num_requests_waiting")
        row.kv_usage = total(s, P + "kv_cache_usage_perc")
        prev = self._prev.get(row.worker)
        cached = {src: total(s, P + "prompt_tokens_cached_by_source_total", source=src)
                  for src in SOURCES}  # fmt: skip
        prompt = total(s, P + "prompt_tokens_total")
        ttft = _buckets(s, P + "time_to_first_token_seconds")
        if prev is not None:
            t0, p = prev
            d_prompt = prompt - total(p, P + "prompt_tokens_total")
            if d_prompt > 0:  # over the last refresh; else everything so far (below)
                cached = {
                    src: n - total(p, P + "prompt_tokens_cached_by_source_total", source=src)
                    for src, n in cached.items()
                }
                prompt = d_prompt
            gen = total(s, P + "generation_tokens_total") - total(p, P + "generation_tokens_total")
            row.tokens_per_s = gen / max(now - t0, 1e-6)
            before = _buckets(p, P + "time_to_first_token_seconds")
            recent = {le: c - before.get(le, 0.0) for le, c in ttft.items()}
            if recent and max(recent.values()) > 0:
                ttft = recent
        row.hit_by_tier = {src: (n / prompt if prompt else 0.0) for src, n in cached.items()}
        row.ttft_p50 = histogram_quantile(0.5, ttft)

    def close(self) -> None:
        """Nothing to release: scrapes run in daemon threads, which an exit never waits for."""


SCRAPES_AT_ONCE = 8


def _in_daemon_threads(fn, items: list) -> list:
    """``[fn(x) for x in items]``, in daemon threads, ``SCRAPES_AT_ONCE`` at a time. Unlike
    a ThreadPoolExecutor's workers, which the interpreter joins at exit, a scrape still in
    flight when Ctrl-C lands does not hold up the exit."""
    out: list = [None] * len(items)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = fn(items[i])
        except BaseException as e:  # raised in the caller's thread, below
            errors.append(e)

    for at in range(0, len(items), SCRAPES_AT_ONCE):
        threads = [
            threading.Thread(target=run, args=(i,), name=f"kvmesh-top-{i}", daemon=True)
            for i in range(at, min(at + SCRAPES_AT_ONCE, len(items)))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return out


def render(address: str, router: Samples, rows: list[WorkerRow]):
    """The frame as a rich renderable."""
    from rich.console import Group
    from rich.table import Table

    policy = next((lb.get("policy") for lb, _ in router.get(P + "router_policy_info", ())), "?")
    live = int(total(router, P + "router_workers"))
    t = Table(title=f"kvmesh top - router {address}, policy {policy}, {live} live workers")
    for col, just in (
        ("worker", "left"), ("name", "left"), ("running", "right"), ("waiting", "right"),
        ("KV usage", "right"), *((f"hit {s}", "right") for s in SOURCES),
        ("tokens/s", "right"), ("TTFT p50", "right"),
    ):  # fmt: skip
        t.add_column(col, justify=just)
    for r in rows:
        if r.error:
            t.add_row(r.worker, r.name, r.error, *[""] * (5 + len(SOURCES)))
            continue
        t.add_row(
            r.worker,
            r.name,
            f"{r.running:.0f}",
            f"{r.waiting:.0f}",
            f"{r.kv_usage:.1%}",
            *(f"{r.hit_by_tier.get(s, 0.0):.0%}" for s in SOURCES),
            "-" if r.tokens_per_s is None else f"{r.tokens_per_s:.1f}",
            "-" if r.ttft_p50 is None else f"{r.ttft_p50 * 1000:.0f} ms",
        )
    decisions: dict[tuple[str, str], float] = defaultdict(float)
    for lb, v in router.get(P + "router_decisions_total", ()):
        decisions[(lb.get("policy", ""), lb.get("reason", ""))] += v
    n = sum(decisions.values())
    d = Table(title="router decisions (since start)")
    for col in ("policy", "reason", "decisions", "share"):
        d.add_column(col, justify="left" if col in ("policy", "reason") else "right")
    for (pol, reason), v in sorted(decisions.items(), key=lambda kv: -kv[1]):
        d.add_row(pol, reason, f"{v:.0f}", f"{v / n:.0%}" if n else "-")
    return Group(t, d, *autoscale_table(router))


def autoscale_table(router: Samples, now: float | None = None) -> list:
    """The autoscaler's bounds, workers draining and latest decisions with their reasons
    (an empty list when the router exports none)."""
    from rich.table import Table

    bounds = {lb.get("bound"): v for lb, v in router.get(P + "autoscale_bounds", ())}
    last = sorted(router.get(P + "autoscale_decision_info", ()), key=lambda x: -x[1])
    if not bounds and not last:
        return []
    now = time.time() if now is None else now
    draining = int(total(router, P + "autoscale_draining_workers"))
    a = Table(
        title=f"autoscaling {bounds.get('min', 0):.0f}..{bounds.get('max', 0):.0f} workers, "
        f"{draining} draining"
    )
    for col in ("when", "action", "workers", "cause", "worker", "reason"):
        a.add_column(col, justify="right" if col == "when" else "left")
    for lb, at in last:
        a.add_row(
            f"{max(0.0, now - at):.0f}s ago",
            lb.get("action", ""),
            f"{lb.get('from_workers', '')} -> {lb.get('to_workers', '')}",
            lb.get("cause", ""),
            lb.get("worker", ""),
            lb.get("reason", ""),
        )
    return [a]


def run_top(address: str, interval: float = 1.0, iterations: int = 0) -> int:
    """Refresh every ``interval`` seconds until Ctrl-C (or ``iterations`` frames, if > 0)."""
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    restore = _ctrl_c_exits()
    console = Console()
    model = TopModel(address)
    frames = 0
    try:
        with Live(console=console, auto_refresh=False, screen=False) as live:
            while True:
                try:
                    router, rows = model.frame()
                    live.update(render(address, router, rows), refresh=True)
                except OSError as e:  # the router is not there (yet, or any more)
                    live.update(Text(f"cannot read {address}: {e}"), refresh=True)
                frames += 1
                if iterations and frames >= iterations:
                    return 0
                time.sleep(interval)
    except KeyboardInterrupt:
        return 0
    finally:
        model.close()
        restore()


def _ctrl_c_exits():
    """Ctrl-C ends this interactive view even when its launcher ignored SIGINT (a script's
    ``cmd &`` without job control starts it ignored, and a child inherits that) or blocked
    it; Python keeps an inherited SIG_IGN, and the view would sleep through every Ctrl-C.
    Returns what puts the handler and mask back (``run_top`` called from a program)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)

    def restore() -> None:
        signal.signal(signal.SIGINT, handler if handler is not None else signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    return restore


def add_top_parser(subparsers) -> argparse.ArgumentParser:
    t = subparsers.add_parser("top", help="live view of a cluster from its Prometheus metrics")
    t.add_argument(
        "--address",
        required=True,
        help="the router's /metrics, host:port (kvmesh serve --metrics-port prints it)",
    )
    t.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    t.add_argument(
        "--iterations", type=int, default=0, help="exit after this many refreshes (0: never)"
    )
    t.set_defaults(func=lambda a: run_top(a.address, a.interval, a.iterations))
    return t


__all__ = ["TopModel", "add_top_parser", "histogram_quantile", "run_top", "scrape"]
