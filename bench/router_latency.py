"""Routing decision latency: hash a long prompt, match it against a large index, pick a worker.

One JSON object on stdout. The index holds ``--index-pages`` pages spread over
``--workers`` workers (device and host tiers, some shared prefixes, some Redis pages); each
trial routes a fresh ``--prompt-tokens`` prompt whose first half one worker already holds.
Reported separately: page hashing (kvstore.hashing, the same function the workers use),
``PrefixIndex.match``, the decision (match + ``policy.pick``), and the whole
``pick_and_insert`` call, reported as ``route`` (the decision plus the optimistic insert of
the prompt's pages), as p50/p99 in milliseconds,
with peer credit on (the default) and off. Trials run back to back (hundreds of 16K-token
prompts a second), so the optimistic entries, which live 2 s, pile up far beyond what a real
arrival rate leaves, and their dict's growth shows in the ``route`` tail.

    .venv/bin/python bench/router_latency.py [--index-pages 1000000] [--workers 8]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from machine import machine_info

from kvmesh.kvstore.events import BlockStored
from kvmesh.kvstore.hashing import hash_pages
from kvmesh.router import PrefixIndex, RouteRequest, WorkerLoad, make_policy, pick_and_insert

FP = "bench-model"
BS = 16


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def build_index(pages: int, workers: int, peer_tiers, rng: random.Random) -> PrefixIndex:
    idx = PrefixIndex(peer_tiers=peer_tiers) if peer_tiers is not None else PrefixIndex()
    seqs = dict.fromkeys(range(workers), 0)
    per_worker = pages // workers
    for w in range(workers):
        h = rng.randbytes(16)
        for i in range(per_worker):
            # chains of 64 pages: realistic parent links, cheap to make
            h = rng.randbytes(16) if i % 64 == 0 else h[::-1][:8] + rng.randbytes(8)
            tier = "host" if i % 4 == 0 else "device"
            idx.apply(w, BlockStored(seqs[w], f"e{w}", h, None, (), BS, tier))
            seqs[w] += 1
    return idx, seqs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--index-pages", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=16384)
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    out = {
        "index_pages": a.index_pages,
        "workers": a.workers,
        "prompt_tokens": a.prompt_tokens,
        "block_size": BS,
        "trials": a.trials,
    }
    loads = {w: WorkerLoad(running=w % 3, queued_prefill_tokens=512 * w) for w in range(a.workers)}
    for label, peer_tiers in (("peer_on", None), ("peer_off", frozenset())):
        rng = random.Random(a.seed)
        t0 = time.perf_counter()
        idx, seqs = build_index(a.index_pages, a.workers, peer_tiers, rng)
        print(
            f"[router_latency] {label}: index built in {time.perf_counter() - t0:.1f}s",
            file=sys.stderr,
        )
        policy = make_policy("prefix_affinity", rng=random.Random(a.seed))
        t_hash, t_match, t_decide, t_route = [], [], [], []
        for trial in range(a.trials):
            tokens = [rng.randrange(50_000) for _ in range(a.prompt_tokens)]
            # worker (trial % workers) already holds the first half of this prompt
            w = trial % a.workers
            half = hash_pages(tokens[: a.prompt_tokens // 2], BS, FP)
            for h in half:
                idx.apply(w, BlockStored(seqs[w], f"e{w}", h, None, (), BS, "device"))
                seqs[w] += 1
            s = time.perf_counter()
            hashes = hash_pages(tokens, BS, FP)
            t_hash.append(time.perf_counter() - s)
            s = time.perf_counter()
            idx.match(hashes)
            t_match.append(time.perf_counter() - s)
            # Each timed call gets page hashes fresh from hash_pages, as the router's are: a
            # bytes object computes its hash on first use, which a repeated lookup would skip.
            fresh = hash_pages(tokens, BS, FP)
            req = RouteRequest(len(tokens), fresh, BS)
            s = time.perf_counter()
            policy.pick(req, idx.match(fresh), loads)  # the decision, without its bookkeeping
            t_decide.append(time.perf_counter() - s)
            req = RouteRequest(len(tokens), hash_pages(tokens, BS, FP), BS)
            s = time.perf_counter()
            pick_and_insert(idx, policy, req, loads)
            t_route.append(time.perf_counter() - s)
        timings = (("hash", t_hash), ("match", t_match), ("decide", t_decide), ("route", t_route))
        for name, xs in timings:
            out[f"{label}_{name}_p50_ms"] = round(statistics.median(xs) * 1e3, 4)
            out[f"{label}_{name}_p99_ms"] = round(_pct(xs, 0.99) * 1e3, 4)
    out["machine"] = machine_info()  # CPU model and SIMD flags
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
