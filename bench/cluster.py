"""The cluster end to end under each routing policy: throughput, TTFT, cached-token fraction.

A local Ray cluster with ``--workers`` worker actors (the default model) behind the router.
The workload is multi-tenant: ``--tenants`` system prompts of ``--system-tokens`` tokens,
each shared by ``--users`` users who add ``--user-tokens`` of their own; requests arrive in
one seeded random order, ``--concurrency`` in flight (closed loop), ``--max-tokens`` greedy
output tokens each. Every policy runs the same requests on emptied caches. Each worker's KV
pool (``--kv-cache-memory``) holds about half of the tenants' prompts: the cluster's cache
is big enough for all of them only if each tenant stays on one worker, which is what prefix
affinity is for.

Prints one JSON object: per policy, and the ratios prefix_affinity / round_robin (targets:
>= 1.3x throughput, p99 TTFT no worse, i.e. <= 1.0x). With 64 requests the nearest-rank p99
is the slowest request (usually a cold prompt queued behind another in the first seconds),
so it moves more between runs than the other figures.

    .venv/bin/python bench/cluster.py [--tenants 8] [--users 8] [--concurrency 4]
    .venv/bin/python bench/cluster.py --netns --policies round_robin,prefix_affinity   # root

``--netns`` runs the same across network namespaces (bench/netns.py): a head node with the
router, one Ray worker node per worker, each with its own address on a bridge.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from machine import machine_info


def _pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q * len(xs) + 0.5)) - 1))]


def make_workload(a: argparse.Namespace) -> list[tuple[int, list[int]]]:
    """(tenant, prompt token ids) in arrival order. Random token ids: prefill cost does not
    depend on what the tokens say, and no tokenizer or text file is needed."""
    rng = random.Random(a.seed)
    systems = [
        [rng.randrange(100, 40000) for _ in range(a.system_tokens)] for _ in range(a.tenants)
    ]
    reqs = [
        (t, systems[t] + [rng.randrange(100, 40000) for _ in range(a.user_tokens)])
        for t in range(a.tenants)
        for _ in range(a.users)
    ]
    rng.shuffle(reqs)
    return reqs


def run_policy(client, reqs, a: argparse.Namespace) -> dict:
    def one(req) -> dict:
        tenant, ids = req
        t0 = time.perf_counter()
        ttft = final = None
        for chunk in client.generate(ids, max_tokens=a.max_tokens, temperature=0, ignore_eos=True):
            if ttft is None and chunk.token_ids:
                ttft = time.perf_counter() - t0
            if chunk.finished:
                final = chunk
        return {
            "tenant": tenant,
            "ttft": ttft,
            "e2e": time.perf_counter() - t0,
            "worker": final.worker_id,
            "prompt": final.usage.prompt_tokens,
            "cached": final.usage.cached_tokens,
            "out": final.usage.completion_tokens,
        }

    t0 = time.perf_counter()
    with ThreadPoolExecutor(a.concurrency) as pool:
        rs = list(pool.map(one, reqs))
    wall = time.perf_counter() - t0
    ttfts = [r["ttft"] for r in rs]
    prompt = sum(r["prompt"] for r in rs)
    per_worker: dict[str, int] = {}
    tenants_per_worker: dict[str, set] = {}
    for r in rs:
        per_worker[r["worker"]] = per_worker.get(r["worker"], 0) + 1
        tenants_per_worker.setdefault(r["worker"], set()).add(r["tenant"])
    return {
        "requests": len(rs),
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(rs) / wall, 4),
        "tokens_per_s": round((prompt + sum(r["out"] for r in rs)) / wall, 1),
        "ttft_p50_s": round(_pct(ttfts, 0.50), 4),
        "ttft_p99_s": round(_pct(ttfts, 0.99), 4),
        "ttft_mean_s": round(statistics.fmean(ttfts), 4),
        "cached_fraction": round(sum(r["cached"] for r in rs) / prompt, 4),
        "requests_per_worker": per_worker,
        "tenants_per_worker": {w: len(t) for w, t in tenants_per_worker.items()},
    }


def _ratios(out: dict) -> None:
    res = out["policies"]
    if "prefix_affinity" in res and "round_robin" in res:
        pa, rr = res["prefix_affinity"], res["round_robin"]
        ratios = {
            "throughput": round(pa["requests_per_s"] / rr["requests_per_s"], 3),
            "ttft_p50": round(pa["ttft_p50_s"] / rr["ttft_p50_s"], 3),
            "ttft_p99": round(pa["ttft_p99_s"] / rr["ttft_p99_s"], 3),
            "cached_fraction": round(pa["cached_fraction"] / max(rr["cached_fraction"], 1e-9), 3),
        }
        out["prefix_affinity_over_round_robin"] = ratios
        out["targets_met"] = {
            "throughput_ge_1.3x": ratios["throughput"] >= 1.3,
            "ttft_p99_le_1.0x": ratios["ttft_p99"] <= 1.0,
        }
    out["machine"] = machine_info()  # CPU model and SIMD flags


def main_netns(a: argparse.Namespace) -> int:
    """The same workload and policies across namespaced nodes: every request and every page
    a worker fetches from another crosses a bridge between network namespaces."""
    from netns import NetnsCluster

    from kvmesh.cluster import Client

    policies = [s.strip() for s in a.policies.split(",") if s.strip()]
    reqs = make_workload(a)
    engine_args = {
        "kv_cache_memory": a.kv_cache_memory,
        "max_num_batched_tokens": a.max_num_batched_tokens,
    }
    out: dict = {
        "config": {k: v for k, v in vars(a).items() if k != "policies"},
        "policies": {},
    }
    t0 = time.perf_counter()
    with NetnsCluster(
        a.workers, engine_args=engine_args, policy=policies[0], redis=False, seed=a.seed
    ) as nc:
        out["config"]["startup_s"] = round(time.perf_counter() - t0, 1)
        out["config"]["nodes"] = {n: nc.ips[n] for n in nc.nodes}
        with Client(nc.info["endpoint"], timeout=600) as client:
            client.generate_text([1, 2, 3], max_tokens=2)  # warm both paths once
            client.generate_text([4, 5, 6], max_tokens=2)
            for policy in policies:
                nc.call("reset", timeout=120)
                nc.call("policy", policy)
                out["policies"][policy] = run_policy(client, reqs, a)
                print(f"{policy}: {out['policies'][policy]}", file=sys.stderr, flush=True)
    _ratios(out)
    print(json.dumps(out, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--users", type=int, default=8, help="requests per tenant")
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--user-tokens", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--kv-cache-memory", default="128MiB", help="per worker (~2,900 tokens)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--policies", default="round_robin,least_loaded,prefix_affinity")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--netns",
        action="store_true",
        help="one Ray node per worker, each in its own network namespace on a bridge, the "
        "router on a head node of its own (bench/netns.py; needs root)",
    )
    a = p.parse_args(argv)
    if a.netns:
        return main_netns(a)

    import ray

    from kvmesh.cluster import Client
    from kvmesh.cluster.serve import Cluster, ClusterConfig, init_ray

    policies = [s.strip() for s in a.policies.split(",") if s.strip()]
    reqs = make_workload(a)
    engine_args = {
        "kv_cache_memory": a.kv_cache_memory,
        "max_num_batched_tokens": a.max_num_batched_tokens,
    }
    init_ray(None, num_cpus=max(4, a.workers), log_to_driver=False)
    cluster = None
    out: dict = {
        "config": {k: v for k, v in vars(a).items() if k != "policies"},
        "policies": {},
    }
    try:
        t0 = time.perf_counter()
        cluster = Cluster.start(
            ClusterConfig(
                workers=a.workers,
                policy=policies[0],
                port=0,
                host="127.0.0.1",
                engine_args=engine_args,
                log_level="WARNING",
                seed=a.seed,
            )
        )
        out["config"]["startup_s"] = round(time.perf_counter() - t0, 1)
        with Client(cluster.endpoint, timeout=600) as client:
            client.generate_text([1, 2, 3], max_tokens=2)  # warm both paths once
            client.generate_text([4, 5, 6], max_tokens=2)
            for policy in policies:
                cluster.reset_prefix_caches()
                cluster.set_policy(policy)
                out["policies"][policy] = run_policy(client, reqs, a)
                print(f"{policy}: {out['policies'][policy]}", file=sys.stderr, flush=True)
    finally:
        if cluster is not None:
            cluster.shutdown(grace=0)
        ray.shutdown()
    _ratios(out)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
