"""Where one prefix restore's time goes, stage by stage, from host RAM and from Redis (issue
21). Prints one JSON object.

    .venv/bin/python bench/restore_stages.py [--prefix-tokens 2048] [--repeats 3]
        [--redis-url URL] [--skip host,redis] [--fetch-batch-pages N] [--compare-one-batch]

``--compare-one-batch`` restores every prompt twice, read in batches (the engine's way) and
in one batch (the way before restores were batched), alternating which goes first, so the
before/after pair of each prompt shares the machine's load of that moment;
``over_device_hit`` is each restore's TTFT over the same prompt's device hit.

Same setup as bench/tiers.py's TTFT part (SmolLM2, 512 MiB of device KV, a 4 GiB host tier
or a Redis tier, the spill drained before the restore is timed). Timers wrap the stages of
the restore, each as milliseconds from the request's submission (medians of ``--repeats``):

* ``fetch_submitted``: the scheduler started the promotion (``KVOffloader.start_fetch``);
* ``fetch_begin`` / ``fetch_end``: the fetch thread's run (lookup, tier reads, codec checks);
* ``tier_get``: the tier's own reads, summed (host: dict lookups; Redis: the MGETs, replies
  included);
* ``codec_checks``: summed time in ``codec.decode`` (header and xxh3-128 of each page);
* ``write_begin`` / ``write_end``: the copy of the fetched pages into the pool (engine
  thread), the first batch's start and the last batch's end; ``write``: their summed time;
* ``step_begin`` / ``step_end``: the model step that computes the last token;
* ``ttft``: ``generate`` returned (one token).

The device hit of the same prompt is timed the same way (it has only the step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from machine import machine_info

import kvmesh.kvstore.store as store_mod
from kvmesh.cluster.calibrate import redis_url_for
from kvmesh.worker import LLM, SamplingParams

TEXT = Path(__file__).resolve().parents[1].parent / "shared/data/tinyshakespeare.txt"
MODEL = "smollm2-135m-instruct"


class Timeline:
    """Marks (name -> seconds since ``start``) and summed durations of one request."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.marks: dict[str, float] = {}
        self.sums: dict[str, float] = {}

    def mark(self, name: str) -> None:
        """The first time of a ``*_begin``, the last of anything else."""
        t = time.perf_counter() - self.t0
        if name.endswith("_begin"):
            self.marks.setdefault(name, t)
        else:
            self.marks[name] = t

    def add(self, name: str, seconds: float) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + seconds


CURRENT: list[Timeline] = []


def _mark(name: str) -> None:
    if CURRENT:
        CURRENT[-1].mark(name)


def wrap(obj, attr: str, before: str | None = None, after: str | None = None, total=None):
    fn = getattr(obj, attr)

    def wrapped(*a, **k):
        if before:
            _mark(before)
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            if total and CURRENT:
                CURRENT[-1].add(total, time.perf_counter() - t)
            if after:
                _mark(after)

    setattr(obj, attr, wrapped)


def instrument(llm: LLM) -> None:
    eng = llm.engine
    off = eng.connector.offloader
    wrap(off, "start_fetch", before="fetch_submitted")
    wrap(off, "_fetch_run_all", before="fetch_begin", after="fetch_end")
    for tier in eng.connector.store.tiers:
        wrap(tier, "get", total="tier_get")
    wrap(eng.connector.memory, "write", before="write_begin", after="write_end", total="write")
    wrap(eng.runner, "execute", before="step_begin", after="step_end")


def timed_request(llm: LLM, ids: list[int]) -> dict:
    tl = Timeline()
    CURRENT.append(tl)
    try:
        out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))[0]
    finally:
        CURRENT.pop()
    tl.mark("ttft")
    row = {k: v * 1e3 for k, v in tl.marks.items()}
    row.update({k: v * 1e3 for k, v in tl.sums.items()})
    row["tiers"] = dict(out.cached_tokens_by_tier)
    return row


def medians(rows: list[dict]) -> dict:
    keys = [k for k in rows[0] if k != "tiers"]
    return {k: round(statistics.median(r.get(k, float("nan")) for r in rows), 2) for k in keys}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--skip", default="", help="comma list of: host, redis")
    ap.add_argument(
        "--fetch-batch-pages",
        type=int,
        default=None,
        help="pages per batch of a restore (default: the engine's; 0: the whole run in one "
        "batch, as before restores were batched)",
    )
    ap.add_argument(
        "--compare-one-batch",
        action="store_true",
        help="also restore each prompt read in one batch (the read before batching), "
        "alternating which goes first: a before/after pair per prompt, in one process",
    )
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    # codec checks: summed inside TieredStore.get
    decode = store_mod.decode

    def timed_decode(*a, **k):
        t = time.perf_counter()
        try:
            return decode(*a, **k)
        finally:
            if CURRENT:
                CURRENT[-1].add("codec_checks", time.perf_counter() - t)

    store_mod.decode = timed_decode
    text = TEXT.read_text()
    common = dict(kv_cache_memory="512MiB", max_num_batched_tokens=2048)
    out: dict = {"model": MODEL, "prefix_tokens": args.prefix_tokens, "repeats": args.repeats}
    out["loadavg_1m_start"] = os.getloadavg()[0]
    with redis_url_for(args.redis_url, lambda m: None) as url:
        for kind in ("host", "redis"):
            if kind in skip:
                continue
            extra = {"host_cache_memory": "4GiB"} if kind == "host" else {"redis_url": url}
            llm = LLM(MODEL, **common, **extra)
            if kind == "redis":
                tier = llm.engine.connector.store.tiers[0]
                tier._pool.connection_kwargs.update(socket_timeout=10.0)
                tier._pool.disconnect()
            off = llm.engine.connector.offloader
            if args.fetch_batch_pages is not None:
                off.fetch_batch_pages = args.fetch_batch_pages or 1 << 30
            out["fetch_batch_pages"] = batched = off.fetch_batch_pages
            modes = [("restore", batched)]
            if args.compare_one_batch:
                modes.append(("restore_one_batch", 1 << 30))
            instrument(llm)
            n = args.prefix_tokens + 1
            prompts, pos = [], 0
            while len(prompts) < args.repeats + 1:
                prompts.append(llm.tokenizer.encode(text[pos : pos + n * 6])[:n])
                pos += n * 6
            timed_request(llm, prompts[-1])  # warm-up
            # and one restore, untimed: the first in a process takes the Redis tier's
            # receive slabs as fresh memory, which a serving engine pays once
            llm.reset_prefix_cache()
            llm.engine.connector.drain()
            timed_request(llm, prompts[-1])
            dev: list[dict] = []
            rows: dict[str, list[dict]] = {name: [] for name, _ in modes}
            for i, p in enumerate(prompts[: args.repeats]):
                timed_request(llm, p)  # cold
                dev.append(timed_request(llm, p))
                for name, pages in modes if i % 2 == 0 else modes[::-1]:
                    off.fetch_batch_pages = pages
                    llm.reset_prefix_cache()
                    llm.engine.connector.drain()
                    r = timed_request(llm, p)
                    assert r["tiers"].get(kind, 0) >= args.prefix_tokens - 16, r["tiers"]
                    r["over_device_hit"] = r["ttft"] / dev[-1]["ttft"]
                    rows[name].append(r)
            llm.close()
            del llm
            out[kind] = {"device_hit": medians(dev)}
            out[kind].update({name: medians(r) for name, r in rows.items()})
    out["loadavg_1m_end"] = os.getloadavg()[0]
    out["machine"] = machine_info()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
