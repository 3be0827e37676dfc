"""Page codec cost and RedisTier batched throughput; prints one JSON object.

    .venv/bin/python bench/redis_tier.py [--url redis://host:port/0] [--pages 64]
        [--page-nbytes 737280] [--repeats 3]

Without --url it starts a throwaway redis-server on a free loopback port (no persistence).
Baselines in the same run: a plain ``bytes`` copy of the payload (the floor for encode),
blake2b-128 of the payload (the checksum not chosen), and redis-py's own pipelined SET / MGET
of the same objects (the floor for the tier).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

from machine import machine_info

from kvmesh.cluster.calibrate import redis_url_for
from kvmesh.kvstore.codec import PageSpec, checksum, decode, encode
from kvmesh.kvstore.redis_tier import redis_throughput


def per_call_us(fn, n: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def codec_costs(page_nbytes: int, n: int = 200) -> dict:
    spec = PageSpec("ab" * 16, "fp32", 30, 3, 64, 16, page_nbytes)
    payload = os.urandom(page_nbytes)
    obj = encode(spec, payload)
    return {
        "encode_us": per_call_us(lambda: encode(spec, payload), n),
        "decode_us": per_call_us(lambda: decode(spec, obj), n),
        "xxh3_128_us": per_call_us(lambda: checksum(payload), n),
        "baseline_copy_us": per_call_us(lambda: bytearray(payload), n),
        "baseline_blake2b_us": per_call_us(
            lambda: hashlib.blake2b(payload, digest_size=16).digest(), n
        ),
        "header_bytes": len(obj) - page_nbytes,
    }


def raw_redis_baseline(url: str, n_pages: int, page_nbytes: int, repeats: int) -> dict:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=10)
    items = {f"kvmesh-bench:{i}": os.urandom(page_nbytes) for i in range(n_pages)}
    total = n_pages * page_nbytes
    put_s, get_s = [], []
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            pipe = client.pipeline(transaction=False)
            for k, v in items.items():
                pipe.set(k, v)
            pipe.execute()
            t1 = time.perf_counter()
            client.mget(list(items))
            t2 = time.perf_counter()
            client.delete(*items)
            put_s.append(t1 - t0)
            get_s.append(t2 - t1)
    finally:
        client.delete(*items)
        client.close()
    return {"raw_put_gbps": total / min(put_s) / 1e9, "raw_get_gbps": total / min(get_s) / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default=None, help="an existing Redis (default: start one)")
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--page-nbytes", type=int, default=737_280, help="SmolLM2 fp32 page")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    # the given Redis (it must answer PING), or a throwaway loopback redis-server
    with redis_url_for(args.url) as url:
        out = {"page_nbytes": args.page_nbytes, "n_pages": args.pages}
        out["codec"] = codec_costs(args.page_nbytes)
        out["redis_tier"] = redis_throughput(
            url, args.pages, args.page_nbytes, repeats=args.repeats
        )
        out["redis_raw"] = raw_redis_baseline(url, args.pages, args.page_nbytes, args.repeats)
        out["loadavg_1m"] = os.getloadavg()[0]
    out["machine"] = machine_info()  # CPU model and SIMD flags
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
