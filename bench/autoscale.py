"""Autoscaling on a bursty trace: a fixed cluster at the maximum size against kvmesh's
autoscaler, with and without cache-preserving scale-down.

The trace: ``--tenants`` system prompts of ``--system-tokens`` tokens; each request is one
tenant's system prompt plus ``--user-tokens`` of its own, ``--max-tokens`` greedy output
tokens, sent open-loop at seeded Poisson arrival times: ``--quiet-s`` seconds at
``--quiet-rate`` requests/s, ``--burst-s`` at ``--burst-rate``, then ``--tail-s`` quiet
again. ``--burst-tenants`` of the tenants first appear with the burst. The same requests
at the same times are replayed against:

- ``fixed``: ``--max-workers`` workers all along;
- ``autoscale``: ``--min-workers`` .. ``--max-workers``, retired workers flush their cache to
  Redis first (kvmesh's scale-down);
- ``autoscale_no_preserve``: the same, but retired workers just leave (what other servers do).

Every run has its own local Ray and an emptied Redis (``redis-server`` on a free port),
workers with a device pool and a host tier that hold every tenant, and a Redis tier.

Reported per run: TTFT p50/p99 (client side), SLO attainment (TTFT <= ``--slo-s``),
worker-seconds (live, draining and starting worker actors, sampled every 0.25 s), the
cluster-wide prefix hit rate (cached / prompt tokens) of the first request of each tenant
after each scale-down (``hit_after_scale_down_first``: what a retirement costs), of every
request after it (``hit_after_scale_down``), and of the first request after it of each
tenant the retired worker served last (``hit_after_scale_down_retired_tenants_first``: its
tenants), and the autoscaler's decisions. Then the ratios
the issue targets: autoscale / fixed worker-seconds (<= 0.70), autoscale / fixed TTFT p99
(<= 1.5), and autoscale / autoscale_no_preserve first-request hit rate after scale-down
(>= 1.5).

    .venv/bin/python bench/autoscale.py [--runs fixed,autoscale,autoscale_no_preserve]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from machine import machine_info

RUNS = ("fixed", "autoscale", "autoscale_no_preserve")


def _pct(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q * len(xs) + 0.5)) - 1))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_trace(a: argparse.Namespace) -> list[tuple[float, int, list[int]]]:
    """(send time from the start, tenant, prompt ids); random token ids (prefill cost does
    not depend on what the tokens say)."""
    rng = random.Random(a.seed)
    systems = [
        [rng.randrange(100, 40000) for _ in range(a.system_tokens)] for _ in range(a.tenants)
    ]
    out = []
    t = 0.0
    # the burst brings new tenants (``--burst-tenants`` of them): the quiet phase sees only
    # the others, so the workers added for the burst hold prefixes the first one never saw
    old = max(1, a.tenants - a.burst_tenants)
    phases = (
        (a.quiet_s, a.quiet_rate, old),
        (a.burst_s, a.burst_rate, a.tenants),
        (a.tail_s, a.quiet_rate, a.tenants),
    )
    start = 0.0
    for length, rate, n_tenants in phases:
        t = start
        while True:
            t += rng.expovariate(rate)
            if t >= start + length:
                break
            tenant = rng.randrange(n_tenants)
            user = [rng.randrange(100, 40000) for _ in range(a.user_tokens)]
            out.append((t, tenant, systems[tenant] + user))
        start += length
    return out


def run_one(name: str, trace, a: argparse.Namespace, redis_url: str) -> dict:
    import ray
    import redis

    from kvmesh.cluster import Client
    from kvmesh.cluster.autoscale import AutoscaleConfig
    from kvmesh.cluster.serve import Cluster, ClusterConfig

    redis.Redis.from_url(redis_url).flushall()
    autoscale = None
    if name != "fixed":
        autoscale = AutoscaleConfig(
            min_workers=a.min_workers,
            max_workers=a.max_workers,
            upscale_delay_s=a.upscale_delay_s,
            downscale_delay_s=a.downscale_delay_s,
            look_back_s=a.look_back_s,
            interval_s=0.25,
            waiting_high=a.waiting_high,
            ttft_slo_s=a.slo_s,
            drain_timeout_s=10.0,
            flush_timeout_s=20.0,
            preserve_cache=name == "autoscale",
        )
    cfg = ClusterConfig(
        autoscale=autoscale,
        engine_args=dict(
            kv_cache_memory=a.kv_cache_memory,
            host_cache_memory=a.host_cache_memory,
            redis_url=redis_url,
            max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=512,
        ),
        host="127.0.0.1",
        port=_free_port(),
        grace_s=2.0,
        log_level="WARNING",
        seed=a.seed,
        flush_timeout_s=0.0,  # the runs end with a kill; nothing to keep
    )
    ray.init(
        address="local",
        num_cpus=max(a.max_workers, 2),
        include_dashboard=False,
        object_store_memory=150 * 2**20,
        namespace=f"kvmesh-bench-{uuid.uuid4().hex[:6]}",
        log_to_driver=False,
    )
    t_start = time.monotonic()
    cluster = Cluster.start(cfg, timeout_s=600)
    startup_s = time.monotonic() - t_start
    samples: list[tuple[float, int]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.25):
            try:
                n = len(cluster.stats()["workers"])  # live + draining (still registered)
                with cluster._lock:
                    n += len(cluster._pending)
                samples.append((time.monotonic(), n))
            except Exception:
                pass

    results: list[dict] = []
    try:
        with Client(cluster.endpoint, timeout=600) as client:
            # the cluster is up: count worker-seconds from the trace's start only
            t0 = time.monotonic()
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()

            def one(item) -> dict:
                at, tenant, ids = item
                delay = t0 + at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                sent = time.monotonic()
                ttft = final = None
                try:
                    for chunk in client.generate(
                        ids, max_tokens=a.max_tokens, temperature=0, ignore_eos=True
                    ):
                        if ttft is None and chunk.token_ids:
                            ttft = time.monotonic() - sent
                        if chunk.finished:
                            final = chunk
                except Exception as e:  # counted (an SLO miss), the run goes on
                    return {"sent": sent - t0, "tenant": tenant, "error": repr(e)[:200]}
                return {
                    "sent": sent - t0,
                    "tenant": tenant,
                    "ttft": ttft,
                    "prompt": final.usage.prompt_tokens,
                    "cached": final.usage.cached_tokens,
                    "by_tier": dict(final.usage.cached_tokens_by_tier),
                    "worker": final.worker_id,
                }

            with ThreadPoolExecutor(64) as pool:
                results = list(pool.map(one, trace))
            end = max(time.monotonic(), t0 + a.quiet_s + a.burst_s + a.tail_s)
            stop.set()
            sampler.join(5)
            decisions = cluster.stats()["autoscale"]["decisions"]
    finally:
        stop.set()
        cluster.shutdown(grace=0)
        ray.shutdown()
    # worker-seconds: the sampled count, held until the next sample
    ws = 0.0
    pts = [(t0, samples[0][1] if samples else a.max_workers), *samples, (end, 0)]
    for (ta, n), (tb, _) in zip(pts, pts[1:]):
        ws += n * max(0.0, tb - ta)
    errors = [r for r in results if "error" in r]
    results = [r for r in results if "error" not in r]
    ttfts = [r["ttft"] for r in results]
    downs = [d for d in decisions if d["action"] == "down"]
    wall0 = time.time() - (time.monotonic() - t0)  # decisions carry wall-clock times
    after: list[dict] = []
    first: list[dict] = []
    orphans: list[dict] = []  # first requests of the tenants the retired worker served last
    for d in downs:
        started_at = d["at"] - wall0
        done_at = started_at + (d.get("seconds") or 0.0)
        later = sorted((r for r in results if r["sent"] >= done_at), key=lambda r: r["sent"])
        after += later
        last_home: dict[int, str] = {}
        for r in sorted(results, key=lambda r: r["sent"]):
            if r["sent"] < started_at:
                last_home[r["tenant"]] = r["worker"].rsplit("-", 1)[0]
        seen: set[int] = set()
        for r in later:
            if r["tenant"] not in seen:
                seen.add(r["tenant"])
                first.append(r)
                if last_home.get(r["tenant"]) == d["worker"]:
                    orphans.append(r)

    def hit(rs: list[dict]) -> float | None:
        p = sum(r["prompt"] for r in rs)
        return round(sum(r["cached"] for r in rs) / p, 4) if p else None

    tiers: dict[str, int] = {}
    for r in first:
        for t, n in r["by_tier"].items():
            tiers[t] = tiers.get(t, 0) + n
    return {
        "requests": len(results),
        "startup_s": round(startup_s, 1),
        "ttft_p50_s": round(_pct(ttfts, 0.5), 3),
        "ttft_p99_s": round(_pct(ttfts, 0.99), 3),
        "slo_attainment": round(sum(t <= a.slo_s for t in ttfts) / (len(ttfts) + len(errors)), 4),
        "errors": len(errors),
        "first_error": errors[0]["error"] if errors else None,
        "worker_seconds": round(ws, 1),
        "hit_rate": hit(results),
        "hit_after_scale_down_first": hit(first),
        "hit_after_scale_down_first_by_tier": tiers,
        "hit_after_scale_down": hit(after),
        "hit_after_scale_down_retired_tenants_first": hit(orphans),
        "retired_tenants_after_scale_down": len(orphans),
        "requests_after_scale_down": len(after),
        "decisions": [
            {
                k: d.get(k)
                for k in (
                    "action",
                    "from_workers",
                    "to_workers",
                    "cause",
                    "reason",
                    "worker",
                    "worker_reason",
                    "seconds",
                    "flush",
                )
            }
            for d in decisions
        ],  # fmt: skip
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--min-workers", type=int, default=1)
    p.add_argument("--max-workers", type=int, default=2)
    p.add_argument("--tenants", type=int, default=6)
    p.add_argument("--burst-tenants", type=int, default=3, help="tenants new with the burst")
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--user-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--quiet-s", type=float, default=30.0)
    p.add_argument("--burst-s", type=float, default=40.0)
    p.add_argument("--tail-s", type=float, default=60.0)
    p.add_argument("--quiet-rate", type=float, default=0.15, help="requests/s")
    p.add_argument("--burst-rate", type=float, default=1.0, help="requests/s")
    p.add_argument("--slo-s", type=float, default=2.0, help="TTFT SLO (also the autoscaler's)")
    p.add_argument("--upscale-delay-s", type=float, default=2.0)
    p.add_argument("--downscale-delay-s", type=float, default=5.0)
    p.add_argument("--look-back-s", type=float, default=3.0)
    p.add_argument("--waiting-high", type=float, default=1.0)
    p.add_argument("--max-num-seqs", type=int, default=2)
    p.add_argument("--kv-cache-memory", default="160MiB")
    p.add_argument("--host-cache-memory", default="160MiB")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    runs = [r for r in a.runs.split(",") if r]
    bad = set(runs) - set(RUNS)
    if bad:
        p.error(f"unknown runs {sorted(bad)}; accepted: {', '.join(RUNS)}")
    os.environ.setdefault("KVMESH_NUM_THREADS", "1")
    trace = make_trace(a)
    out: dict = {
        "bench": "autoscale",
        "machine": machine_info(),
        "config": {k: v for k, v in vars(a).items()},
        "trace_requests": len(trace),
        "runs": {},
    }
    from kvmesh.cluster.calibrate import redis_url_for

    with redis_url_for(None) as redis_url:  # a throwaway loopback redis-server
        for name in runs:
            print(f"run {name} ...", file=sys.stderr, flush=True)
            out["runs"][name] = run_one(name, trace, a, redis_url)
            out["runs"][name]["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
    r = out["runs"]

    def ratio(x, y, key):
        if x in r and y in r and r[x][key] and r[y][key]:
            return round(r[x][key] / r[y][key], 3)
        return None

    out["ratios"] = {
        "worker_seconds_autoscale_over_fixed": ratio("autoscale", "fixed", "worker_seconds"),
        "ttft_p99_autoscale_over_fixed": ratio("autoscale", "fixed", "ttft_p99_s"),
        "hit_after_scale_down_first_preserve_over_no_preserve": ratio(
            "autoscale", "autoscale_no_preserve", "hit_after_scale_down_first"
        ),
        "hit_after_scale_down_preserve_over_no_preserve": ratio(
            "autoscale", "autoscale_no_preserve", "hit_after_scale_down"
        ),
        "hit_retired_tenants_preserve_over_no_preserve": ratio(
            "autoscale", "autoscale_no_preserve", "hit_after_scale_down_retired_tenants_first"
        ),
    }
    out["targets"] = {
        "worker_seconds_autoscale_over_fixed": "<= 0.70",
        "ttft_p99_autoscale_over_fixed": "<= 1.5",
        "hit_after_scale_down_first_preserve_over_no_preserve": ">= 1.5",
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
