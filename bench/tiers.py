"""Tiered KV store: TTFT of a long prefix by where it lives, a multi-turn workload with tiers
on versus device-only recompute, and Redis throughput. Prints one JSON object.

    .venv/bin/python bench/tiers.py [--prefix-tokens 2048] [--conversations 64] [--turns 4]
        [--context-tokens 512] [--turn-tokens 64] [--device-memory 1GiB] [--skip ...]

1. TTFT of a request whose ``--prefix-tokens`` prefix is (a) cold, (b) on the device,
   (c) only in host RAM, (d) only in Redis (a throwaway redis-server on loopback unless
   ``--redis-url``), with ratios to cold and to the device hit. Medians over ``--repeats``
   prompts. Each restore is timed once the spill that put the prefix there is done (a
   fetch waits for spills handed over before it, so an undrained spill of the same pages
   would be timed too). The Redis restore is timed three times per prompt, in alternating
   order: with the tier's own reply reader (kvstore/redis_fast.py) in pipelined MGETs of
   ~``mget_chunk_bytes`` (the engine's read), with that reader asking each fetch batch in
   one MGET (the read before MGETs were chunked) and, as the baseline, with redis-py's
   MGET. Each engine first restores one prompt untimed: the first restore in a process
   takes the Redis tier's receive slabs (~94 MB) as fresh memory, once per engine.
2. ``--conversations`` x ``--turns``: each turn resends the whole history plus
   ``--turn-tokens`` new tokens and generates ``--output-tokens``; every conversation's turn
   is submitted together. Each conversation opens with its own ``--context-tokens``
   document (chat over a long prompt, kvmesh's case; 0 for plain chat) after a shared
   ``--turn-tokens`` system prompt. The device KV budget (``--device-memory``: 1,456
   SmolLM2 pages at 1GiB, against ~3,600 for the 64 conversations' last turn) is far below
   the working set, so earlier turns are evicted.
   Same engine settings with a host tier versus without any tier (recompute). Outputs of the
   two runs are compared token for token.
3. Batched put/get throughput of the Redis tier in GB/s of page payload.

Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from machine import machine_info

from kvmesh.cluster.calibrate import redis_url_for
from kvmesh.kvstore.redis_tier import redis_throughput
from kvmesh.worker import LLM, SamplingParams

TEXT = Path(__file__).resolve().parents[1].parent / "shared/data/tinyshakespeare.txt"
MODEL = "smollm2-135m-instruct"


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def prompts_from_text(llm: LLM, text: str, n: int, length: int, offset: int = 0) -> list[list[int]]:
    out, pos = [], offset
    while len(out) < n:
        ids = llm.tokenizer.encode(text[pos : pos + length * 6])
        if len(ids) < length:
            raise ValueError("the text is too short for these prompts")
        out.append(ids[:length])
        pos += length * 6
    return out


def ttft(llm: LLM, ids: list[int]) -> tuple[float, dict]:
    t0 = time.perf_counter()
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))[0]
    return time.perf_counter() - t0, out.cached_tokens_by_tier


def set_fetch_batch(llm: LLM, pages: int | None) -> int:
    """``--fetch-batch-pages``: pages per batch of a restore (0: the whole run in one batch,
    as restores were read before they were batched). Returns the engine's value."""
    off = llm.engine.connector.offloader
    if pages is not None:
        off.fetch_batch_pages = pages or 1 << 30
    return off.fetch_batch_pages


def bench_ttft(args, text: str, redis_url: str) -> dict:
    common = dict(kv_cache_memory=args.prefix_device_memory, max_num_batched_tokens=2048)
    host = LLM(MODEL, host_cache_memory="4GiB", **common)
    batch = set_fetch_batch(host, args.fetch_batch_pages)
    prompts = prompts_from_text(host, text, args.repeats + 1, args.prefix_tokens + 1)
    ttft(host, prompts[-1])  # warm-up (allocator, thread pools)
    host.reset_prefix_cache()  # and one restore, untimed, as for Redis below
    host.engine.connector.drain()
    ttft(host, prompts[-1])
    cold, dev, on_host, on_redis = [], [], [], []
    for p in prompts[: args.repeats]:
        cold.append(ttft(host, p)[0])
        dev.append(ttft(host, p)[0])
        host.reset_prefix_cache()  # spills the prefix to host RAM
        host.engine.connector.drain()  # time the restore, not the spill before it
        t, tiers = ttft(host, p)
        assert tiers["host"] >= args.prefix_tokens - 16, tiers
        on_host.append(t)
        log(f"ttft cold {cold[-1]:.3f}s device {dev[-1]:.3f}s host {t:.3f}s")
    host.close()
    del host
    red = LLM(MODEL, redis_url=redis_url, **common)
    set_fetch_batch(red, args.fetch_batch_pages)
    tier = red.engine.connector.store.tiers[0]
    # a loaded machine can stall a reply past the tier's 0.5 s read timeout (then a miss and
    # a recompute): the bench times the restore, not that timeout
    tier._pool.connection_kwargs.update(socket_timeout=args.redis_timeout)
    tier._pool.disconnect()
    # warm-up: one restore, untimed. The first in a process takes the tier's receive slabs
    # (~94 MB here) as fresh memory; a serving engine pays that once, not per restore
    ttft(red, prompts[-1])
    red.reset_prefix_cache()
    red.engine.connector.drain()
    ttft(red, prompts[-1])
    fast_mget, chunk = tier._mget, tier.mget_chunk_bytes
    on_redis_py = []  # baseline in the same run: the reply read by redis-py's own MGET
    on_redis_one = []  # and kvmesh's reader asking each fetch batch in one MGET (before)
    paths = [
        (fast_mget, chunk, on_redis),
        (fast_mget, 1 << 50, on_redis_one),
        (tier._client.mget, chunk, on_redis_py),
    ]
    for i, p in enumerate(prompts[: args.repeats]):
        # alternate the order: no reader always gets the warmer caches
        for path, chunk_bytes, times in paths if i % 2 == 0 else paths[::-1]:
            tier._mget, tier.mget_chunk_bytes = path, chunk_bytes
            ttft(red, p)
            red.reset_prefix_cache()  # no host tier: straight to Redis
            red.engine.connector.drain()
            t, tiers = ttft(red, p)
            assert tiers["redis"] >= args.prefix_tokens - 16, tiers
            times.append(t)
        log(
            f"ttft redis {on_redis[-1]:.3f}s (one MGET a batch {on_redis_one[-1]:.3f}s, "
            f"redis-py MGET {on_redis_py[-1]:.3f}s)"
        )
    red.close()
    med = statistics.median
    out = {
        "prefix_tokens": args.prefix_tokens,
        "fetch_batch_pages": batch,
        "ttft_cold_s": med(cold),
        "ttft_device_s": med(dev),
        "ttft_host_s": med(on_host),
        "ttft_redis_s": med(on_redis),
        "ttft_redis_one_mget_per_batch_s": med(on_redis_one),
        "ttft_redis_redis_py_mget_s": med(on_redis_py),
        "redis_mget_chunk_bytes": chunk,
        "redis_mget_depth": tier.mget_depth,
    }
    for k in ("device", "host", "redis"):
        out[f"ttft_{k}_over_cold"] = out[f"ttft_{k}_s"] / out["ttft_cold_s"]
    out["ttft_host_over_device"] = out["ttft_host_s"] / out["ttft_device_s"]
    out["ttft_redis_over_device"] = out["ttft_redis_s"] / out["ttft_device_s"]
    out["ttft_redis_over_redis_py_mget"] = out["ttft_redis_s"] / out["ttft_redis_redis_py_mget_s"]
    out["ttft_redis_over_one_mget_per_batch"] = (
        out["ttft_redis_s"] / out["ttft_redis_one_mget_per_batch_s"]
    )
    out["target_host_le_1.3x_device"] = out["ttft_host_over_device"] <= 1.3
    out["target_redis_le_2x_device"] = out["ttft_redis_over_device"] <= 2.0
    out["target_host_le_0.2"] = out["ttft_host_over_cold"] <= 0.2
    out["target_redis_le_0.333"] = out["ttft_redis_over_cold"] <= 1 / 3
    return out


def run_conversations(llm: LLM, args, text: str) -> dict:
    n, turns = args.conversations, args.turns
    system = llm.tokenizer.encode(text[:2000])[: args.turn_tokens]
    if args.context_tokens:  # each conversation opens with its own document after the system
        docs = prompts_from_text(llm, text, n, args.context_tokens, offset=900_000)
        histories = [list(system) + d for d in docs]
    else:
        histories = [list(system) for _ in range(n)]
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    ttfts, outputs, prompt_tokens = [], [], 0
    t0, c0 = time.perf_counter(), time.process_time()
    for turn in range(turns):
        news = prompts_from_text(llm, text, n, args.turn_tokens, offset=5000 + turn * 200_000)
        prompts = [h + m for h, m in zip(histories, news)]
        prompt_tokens += sum(map(len, prompts))
        outs = llm.generate(prompts, params)
        for i, o in enumerate(outs):
            histories[i] = prompts[i] + o.token_ids
            ttfts.append(o.ttft_s)
            outputs.append(o.token_ids)
        log(
            f"turn {turn + 1}/{turns}: {time.perf_counter() - t0:.1f}s"
            f" ({time.process_time() - c0:.1f} CPU s)"
        )
    wall = time.perf_counter() - t0
    s = llm.engine.stats()
    return {
        "wall_s": wall,
        # the process's CPU seconds (all threads) over the same span: on a loaded machine
        # less inflated than wall time by waiting for a core (not by OpenMP spin-waits)
        "cpu_s": time.process_time() - c0,
        "requests_per_s": n * turns / wall,
        "output_tokens_per_s": n * turns * args.output_tokens / wall,
        "mean_ttft_s": statistics.fmean(ttfts),
        "prompt_tokens": prompt_tokens,
        "tokens_computed": s.tokens_computed,
        "prefix_cache_hit_tokens": s.prefix_cache_hits,
        "_outputs": outputs,
    }


def bench_conversations(args, text: str) -> dict:
    common = dict(
        kv_cache_memory=args.device_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    results = {}
    modes = [("tiers", {"host_cache_memory": args.host_memory}), ("device_only", {})]
    if args.tiers_only:  # e.g. int4 against fp32 pages: the tiers runs alone
        modes = modes[:1]
    for name, extra in modes:
        log(f"multi-turn, {name}")
        llm = LLM(MODEL, **common, **extra)
        results[name] = run_conversations(llm, args, text)
        if name == "tiers":
            results[name]["store"] = llm.engine.store_metrics()
        llm.close()
        del llm
    if args.tiers_only:
        results["tiers"].pop("_outputs")
        return {"kv_cache_dtype": args.kv_cache_dtype, "tiers": results["tiers"]}
    same = results["tiers"].pop("_outputs") == results["device_only"].pop("_outputs")
    on, off = results["tiers"], results["device_only"]
    return {
        "conversations": args.conversations,
        "turns": args.turns,
        "kv_cache_dtype": args.kv_cache_dtype,
        "turn_tokens": args.turn_tokens,
        "output_tokens": args.output_tokens,
        "context_tokens": args.context_tokens,
        "device_memory": args.device_memory,
        "host_memory": args.host_memory,
        "tiers": on,
        "device_only": off,
        "throughput_ratio": on["requests_per_s"] / off["requests_per_s"],
        "mean_ttft_ratio": on["mean_ttft_s"] / off["mean_ttft_s"],
        "outputs_identical": same,
        "target_throughput_ge_2": on["requests_per_s"] / off["requests_per_s"] >= 2,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--prefix-device-memory", default="512MiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument(
        "--context-tokens",
        type=int,
        default=512,
        help="a per-conversation document of this many tokens before the first turn (0: none)",
    )
    ap.add_argument("--device-memory", default="1GiB", help="below the working set")
    ap.add_argument("--host-memory", default="4GiB")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="the multi-turn workload's KV cache format (e.g. int4; compare with a run of auto)",
    )
    ap.add_argument(
        "--tiers-only",
        action="store_true",
        help="the multi-turn workload with tiers only (no device-only run to compare with)",
    )
    ap.add_argument("--redis-url", default=None)
    ap.add_argument(
        "--redis-timeout", type=float, default=10.0, help="the TTFT engine's Redis read timeout"
    )
    ap.add_argument(
        "--fetch-batch-pages",
        type=int,
        default=None,
        help="pages per batch of a TTFT restore (default: the engine's, ~16 MiB; 0: the "
        "whole run in one batch, as restores were read before they were batched)",
    )
    ap.add_argument("--skip", default="", help="comma list of: ttft, conversations, redis")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    text = TEXT.read_text()
    out: dict = {"model": MODEL}
    with redis_url_for(args.redis_url) as url:  # a throwaway loopback redis-server if None
        if "ttft" not in skip:
            out["ttft"] = bench_ttft(args, text, url)
        if "conversations" not in skip:
            out["multi_turn"] = bench_conversations(args, text)
        if "redis" not in skip:
            out["redis_tier"] = redis_throughput(url, 64, 737_280)
        out["loadavg_1m"] = os.getloadavg()[0]
    out["machine"] = machine_info()  # CPU model and SIMD flags
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
