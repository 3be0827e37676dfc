"""``make run``: a local kvmesh cluster (two workers, the default model) and a short
multi-tenant demo through the client SDK.

Six tenants each have a long system prompt that all of their users share, and each worker's
KV cache is sized to hold about four of them: more tenants than one worker holds, fewer than
the two hold together. The same requests run once per routing policy (caches emptied in
between). round_robin sends every tenant to every worker, so each cache churns through all
six prompts and keeps recomputing them; prefix_affinity keeps each tenant on one worker, so
each cache holds its three and only the users' questions are computed. Each request prints
the worker that served it, its cached prompt tokens by tier and its time to first token;
each policy its totals; then the comparison and why. Then the cluster keeps serving until
Ctrl-C.

    python -m kvmesh.cluster.demo [--workers 2] [--port 50051] [--http-port 8000] [--no-wait]
"""

from __future__ import annotations

import argparse
import random
import signal
import socket
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

TENANTS = {
    "acme-bank": (
        "You are the support assistant of Acme Bank.",
        ["accounts", "cards", "transfers", "mortgages", "fraud reports", "branch hours"],
    ),
    "globex-air": (
        "You are the booking assistant of Globex Air.",
        ["bookings", "baggage", "seat upgrades", "delays", "refunds", "loyalty miles"],
    ),
    "initech-it": (
        "You are the internal IT helpdesk of Initech.",
        ["passwords", "laptops", "VPN access", "printers", "email", "software licences"],
    ),
    "umbrella-health": (
        "You are the patient-services assistant of Umbrella Health.",
        ["appointments", "prescriptions", "test results", "billing", "insurance", "visits"],
    ),
    "hooli-cloud": (
        "You are the customer-success assistant of Hooli Cloud.",
        ["billing", "outages", "storage quotas", "API keys", "data export", "support plans"],
    ),
    "wonka-foods": (
        "You are the consumer-care assistant of Wonka Foods.",
        ["allergens", "recalls", "deliveries", "gift boxes", "factory tours", "complaints"],
    ),
}
QUESTIONS = [
    "How do I get started?",
    "What does it cost, in one sentence?",
    "Who do I call if something goes wrong?",
    "Can you summarise your rules?",
    "What are your opening hours?",
    "Is my data safe with you?",
]
RULES = [
    "Answer questions about {topic} politely, in at most three sentences.",
    "Never ask the customer for a full password or PIN when the topic is {topic}.",
    "If a request about {topic} needs a human, say so and give the support number.",
    "Quote only the official policy on {topic}; do not guess numbers or dates.",
    "Log every conversation about {topic} with a short, neutral summary.",
]


def system_prompt(intro: str, topics: list[str]) -> str:
    """A tenant's system prompt: its intro and numbered rules per topic (~450 tokens)."""
    lines = [intro, "Follow these rules in every answer."]
    n = 0
    for topic in topics:
        for rule in RULES:
            n += 1
            lines.append(f"Rule {n}. " + rule.format(topic=topic))
    return "\n".join(lines)


@dataclass
class Result:
    tenant: str
    user: int
    worker: str
    prompt_tokens: int
    cached_tokens: int
    by_tier: dict
    ttft_s: float
    e2e_s: float
    tokens: int


def run_one(client, tenant: str, user: int, prompt: str, max_tokens: int) -> Result:
    t0 = time.perf_counter()
    ttft = None
    final = None
    n = 0
    for chunk in client.generate(prompt, max_tokens=max_tokens, temperature=0):
        if ttft is None and chunk.token_ids:
            ttft = time.perf_counter() - t0
        n += len(chunk.token_ids)
        if chunk.finished:
            final = chunk
    e2e = time.perf_counter() - t0
    return Result(
        tenant,
        user,
        final.worker_id,
        final.usage.prompt_tokens,
        final.usage.cached_tokens,
        {k: v for k, v in final.usage.cached_tokens_by_tier.items() if v},
        ttft if ttft is not None else e2e,
        e2e,
        n,
    )


def run_policy(client, requests: list, *, concurrency: int, max_tokens: int) -> tuple:
    results: list[Result] = []
    lock = threading.Lock()

    def one(req) -> None:
        r = run_one(client, *req, max_tokens)
        with lock:
            results.append(r)
            tiers = ", ".join(f"{k} {v}" for k, v in r.by_tier.items()) or "none"
            print(
                f"  {r.tenant:16s} user {r.user}  -> {r.worker:24s} "
                f"cached {r.cached_tokens:4d}/{r.prompt_tokens:<4d} ({tiers:12s}) "
                f"TTFT {r.ttft_s * 1000:6.0f} ms",
                flush=True,
            )

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, requests))
    return results, time.perf_counter() - t0


def summarize(results: list[Result], wall: float) -> dict:
    ttfts = sorted(r.ttft_s for r in results)
    prompt = sum(r.prompt_tokens for r in results)
    tenants_at: dict[str, set] = {}
    for r in results:
        tenants_at.setdefault(r.worker, set()).add(r.tenant)
    return {
        "requests": len(results),
        "cached_fraction": sum(r.cached_tokens for r in results) / prompt,
        # served from the worker's own cache / pulled from the other worker's
        "own_cache_fraction": sum(r.by_tier.get("device", 0) for r in results) / prompt,
        "peer_fraction": sum(r.by_tier.get("peer", 0) for r in results) / prompt,
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_max_s": ttfts[-1],
        "wall_s": wall,
        "requests_per_s": len(results) / wall,
        "tenants_per_worker": sorted(len(t) for t in tenants_at.values()),
    }


def explain(totals: dict, *, tenants: int, tenant_tokens: int, cache_tokens: int) -> list[str]:
    """Why the policies differ, in the run's own numbers."""
    fits = cache_tokens // tenant_tokens
    lines = [
        f"Why: each worker's KV cache holds {cache_tokens:,} tokens, about {fits} of the "
        f"{tenants} tenants' system prompts ({tenant_tokens:,} tokens each).",
    ]
    for policy, t in totals.items():
        per = t["tenants_per_worker"]
        need = max(per) * tenant_tokens
        verdict = "fits" if need <= cache_tokens else "does not fit: the cache keeps evicting"
        lines.append(
            f"  {policy}: tenants per worker {per} -> up to {need:,} tokens of prompts per "
            f"cache ({verdict}); of all prompt tokens {t['own_cache_fraction']:.0%} came from "
            f"the worker's own cache, {t['peer_fraction']:.0%} were copied from the other "
            f"worker, {1 - t['cached_fraction']:.0%} were computed"
        )
    if {"round_robin", "prefix_affinity"} <= totals.keys():
        rr, pa = totals["round_robin"], totals["prefix_affinity"]
        lines.append(
            f"prefix_affinity vs round_robin: {pa['requests_per_s'] / rr['requests_per_s']:.2f}x "
            f"throughput, {pa['ttft_mean_s'] / rr['ttft_mean_s']:.2f}x mean TTFT, "
            f"{pa['ttft_p50_s'] / rr['ttft_p50_s']:.2f}x p50 TTFT"
        )
    return lines


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--port", type=int, default=50051, help="router port (a free one if busy)")
    p.add_argument(
        "--http-port", type=int, default=8000, help="OpenAI-compatible API (a free one if busy)"
    )
    p.add_argument("--policies", default="round_robin,prefix_affinity")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument(
        "--kv-cache-memory", default="128MiB", help="per worker (about four tenants' prompts)"
    )
    p.add_argument("--no-wait", action="store_true", help="stop after the demo")
    a = p.parse_args(argv)

    import ray

    from kvmesh.cluster import Client
    from kvmesh.cluster.serve import Cluster, ClusterConfig, init_ray
    from kvmesh.worker.models.loader import DEFAULT_MODEL, model_fingerprint, resolve_model
    from kvmesh.worker.tokenizer import Tokenizer

    policies = [s.strip() for s in a.policies.split(",") if s.strip()]
    port = a.port if _port_free(a.port) else 0
    cfg = ClusterConfig(
        workers=a.workers,
        policy=policies[0],
        port=port,
        http_port=a.http_port if _port_free(a.http_port) else 0,
        engine_args={"kv_cache_memory": a.kv_cache_memory, "max_num_batched_tokens": 512},
        grace_s=2.0,
        log_level="WARNING",
        seed=0,
    )
    src = resolve_model(DEFAULT_MODEL)
    tok = Tokenizer.load(src, model_fingerprint(src))
    # every user of a tenant shares the tenant's system prompt; users arrive interleaved
    requests = []
    shared = []  # per tenant: the prompt tokens its users share (system prompt and template)
    for name, (intro, topics) in TENANTS.items():
        sys_prompt = system_prompt(intro, topics)
        texts = []
        for u, q in enumerate(QUESTIONS):
            messages = [{"role": "system", "content": sys_prompt}, {"role": "user", "content": q}]
            texts.append(tok.apply_chat_template(messages))
            requests.append((name, u, texts[-1]))
        a_ids, b_ids = tok.encode(texts[0]), tok.encode(texts[1])
        shared.append(next(i for i, (x, y) in enumerate(zip(a_ids, b_ids)) if x != y))
    random.Random(7).shuffle(requests)

    print(
        f"starting a local Ray cluster: {a.workers} workers ({DEFAULT_MODEL}) + router ...",
        flush=True,
    )
    init_ray(None, num_cpus=max(4, a.workers), log_to_driver=True)
    cluster = None
    try:
        t0 = time.perf_counter()
        cluster = Cluster.start(cfg)
        print(f"cluster up in {time.perf_counter() - t0:.0f}s; router at {cluster.endpoint}\n")
        st = cluster.stats()
        cache_tokens = min(w["load"]["num_pages"] for w in st["workers"].values())
        cache_tokens *= st["block_size"]
        totals = {}
        with Client(cluster.endpoint, timeout=300) as client:
            for w in range(a.workers):  # first-call costs (kernel builds) off the clock
                client.generate_text(f"Warm-up {w}.", max_tokens=2)
            for policy in policies:
                cluster.reset_prefix_caches()
                cluster.set_policy(policy)
                print(f"policy {policy}: {len(requests)} requests, {a.concurrency} at a time")
                results, wall = run_policy(
                    client, requests, concurrency=a.concurrency, max_tokens=a.max_tokens
                )
                totals[policy] = summarize(results, wall)
                print()
        print(
            f"{'policy':16s} {'cached':>8s} {'TTFT mean':>10s} {'TTFT p50':>9s} "
            f"{'TTFT max':>9s} {'wall':>7s} {'req/s':>6s}"
        )
        for policy, t in totals.items():
            print(
                f"{policy:16s} {t['cached_fraction']:8.1%} {t['ttft_mean_s'] * 1000:8.0f}ms "
                f"{t['ttft_p50_s'] * 1000:7.0f}ms {t['ttft_max_s'] * 1000:7.0f}ms "
                f"{t['wall_s']:6.1f}s {t['requests_per_s']:6.2f}"
            )
        print()
        lines = explain(
            totals,
            tenants=len(TENANTS),
            tenant_tokens=round(statistics.fmean(shared)),
            cache_tokens=cache_tokens,
        )
        print("\n".join(lines), flush=True)
        if a.no_wait:
            return 0
        stop = threading.Event()
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        print(
            f"\nThe cluster keeps serving on {cluster.endpoint} (Ctrl-C to stop). Try:\n"
            f'  .venv/bin/python -c "from kvmesh.cluster import Client; '
            f"print(Client('{cluster.endpoint}').generate_text('Hello!', max_tokens=32).text)\"\n"
            f"and the OpenAI-compatible API at http://{cluster.http_endpoint}/v1 (README.md):\n"
            f"  curl -s http://{cluster.http_endpoint}/v1/chat/completions "
            f'-H \'content-type: application/json\' -d \'{{"model": "{DEFAULT_MODEL}", '
            f'"messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}\'',
            flush=True,
        )
        stop.wait()
        print("stopping ...", flush=True)
        return 0
    finally:
        if cluster is not None:
            cluster.shutdown(grace=2.0)
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
