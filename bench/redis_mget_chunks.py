"""How a Redis read of one fetch batch should be asked: MGET size and MGETs in flight (issue 21).

Reads a 2,048-token SmolLM2 fp32 prefix (128 objects of 737,280 bytes, ``--objects`` /
``--object-bytes``) back from a throwaway loopback redis-server (or ``--redis-url``) through
``RedisTier.get`` in the engine's fetch batches (22 objects, ``--batch``), each batch asked as
MGETs of ``chunk`` bytes with ``depth`` of them in flight, for every variant in ``--variants``
(``CHUNK_KiBxDEPTH``; ``0x1`` is one MGET per batch, the read before chunking). Every round
SETs fresh objects and waits ``--delay`` seconds before reading them, as a restore reads pages
a spill wrote a moment before; the variants take turns, in reversed order every other round.
Per variant: the median and minimum read time over ``--rounds`` and the server's own MGET
time (INFO commandstats), medians. Prints one JSON object with the CPU model and flags.

    .venv/bin/python bench/redis_mget_chunks.py [--rounds 10] [--delay 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import redis
from machine import machine_info

from kvmesh.cluster.calibrate import redis_url_for
from kvmesh.kvstore.redis_tier import RedisTier


def mget_usec(client: redis.Redis) -> int:
    return client.info("commandstats").get("cmdstat_mget", {}).get("usec", 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--objects", type=int, default=128)
    ap.add_argument("--object-bytes", type=int, default=737280)
    ap.add_argument("--batch", type=int, default=22, help="objects per fetch batch")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--delay", type=float, default=2.0, help="seconds between SET and read")
    ap.add_argument("--variants", default="0x1,4096x1,4096x2,2048x2,1024x2,2048x3")
    ap.add_argument("--redis-url", default=None)
    args = ap.parse_args()
    size = args.object_bytes
    out: dict = {"bench": "redis_mget_chunks", "objects": args.objects, "object_bytes": size}
    out.update(batch=args.batch, delay_s=args.delay, rounds=args.rounds)
    out["loadavg_1m_start"] = os.getloadavg()[0]
    with redis_url_for(args.redis_url, lambda m: None) as url:
        stats = redis.Redis.from_url(url)
        tiers: dict[str, RedisTier] = {}
        for v in args.variants.split(","):
            kib, depth = (int(x) for x in v.split("x"))
            chunk = kib << 10 if kib else 1 << 50
            tier = RedisTier(url, model_fp="bench", cache_format="mget", timeout_s=10.0)
            tier.max_page_bytes = size  # as TieredStore bounds it
            tier.mget_chunk_bytes, tier.mget_depth = chunk, depth
            tiers[v] = tier
        times: dict[str, list[tuple[float, float]]] = {v: [] for v in tiers}
        for rnd in range(args.rounds):
            order = list(tiers.items())
            for name, tier in order if rnd % 2 == 0 else order[::-1]:
                n = args.objects
                items = [(os.urandom(16), os.urandom(64) * (size // 64)) for _ in range(n)]
                tier.put(items)
                hashes = [h for h, _ in items]
                time.sleep(args.delay)
                u0 = mget_usec(stats)
                t0 = time.perf_counter()
                for i in range(0, len(hashes), args.batch):
                    got = tier.get(hashes[i : i + args.batch])
                    if any(g is None for g in got):
                        raise SystemExit(f"{name}: a value read back as a miss")
                    del got
                wall = time.perf_counter() - t0
                times[name].append((wall * 1e3, (mget_usec(stats) - u0) / 1e3))
                tier.evict(hashes)
        out["variants"] = {
            name: {
                "read_ms_median": round(statistics.median(w for w, _ in t), 2),
                "read_ms_min": round(min(w for w, _ in t), 2),
                "server_mget_ms_median": round(statistics.median(s for _, s in t), 2),
            }
            for name, t in times.items()
        }
        for tier in tiers.values():
            tier.close()
        stats.close()
    out["loadavg_1m_end"] = os.getloadavg()[0]
    out["machine"] = machine_info()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
