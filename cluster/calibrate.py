"""Measure a trace-simulator profile (``router.profiles.SimProfile``) from kvmesh's own engine.

``kvmesh calibrate-profile`` runs the real engine (``kvmesh.worker.LLM``) and times what the
simulator's cost model needs:

- ``prefill_tokens_per_s``: a cold prefill of a ``prefill_tokens`` prompt (``max_tokens=1``),
  each repeat a prompt no cache holds; prompt tokens / median time.
- ``decode_s_per_token``: the median time of one engine step in which ``decode_batch``
  requests each decode one token (short prompts, ``ignore_eos``). The simulator charges it
  per output token of one request while requests decode in parallel, so it is the step time
  *at that batch size* (and at that short context).
- ``host_s_per_token`` / ``redis_s_per_token``: a ``prefix_tokens + 1`` prompt is computed;
  then ``tier_promotions`` times it is sent again with its pages on the device, spilled from the
  device to the tier (``reset_prefix_cache``) and sent again; (the tier TTFT - the device
  TTFT) / tokens the tier served. Both runs compute the same last token, so the difference
  is what serving the prefix from the tier costs (lookup, transfer, decode, copy-in), per
  token. One engine per tier (host RAM only; Redis only), the first prompt a warm-up.
- ``kv_bytes_per_token``: the engine's page format, bytes per page / block size.

Without a Redis URL a throwaway ``redis-server`` is started on a free loopback port (no
persistence) and killed afterwards. Each phase prints a progress line to stderr.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from kvmesh.router.profiles import SimProfile, profile_to_dict
from kvmesh.worker import LLM, SamplingParams
from kvmesh.worker.models.loader import DEFAULT_MODEL

DEFAULT_TEXT = (
    Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tinyshakespeare.txt"
)
REDIS_MISSING = "redis-server not found: install it with `apt-get install -y redis-server`"
_BLOCK = 16  # tokens per page of the calibration engines (the engine's default)
_CHARS_PER_TOKEN = 8  # text sliced per prompt token: more than enough for English text


class CalibrationError(RuntimeError):
    """A measurement could not be made (no Redis, a tier that served nothing, ...)."""


@dataclass(frozen=True)
class CalibrationSizes:
    """How much work each measurement does. The defaults take about 100 s on an
    idle 2-core CPU; ``QUICK`` is for tests (numbers from it are noisy)."""

    prefill_tokens: int = 2048  # prompt of each cold prefill
    prefix_tokens: int = 2048  # prefix served from host / Redis (the prompt is one longer)
    repeats: int = 5  # prompts per prefill and per tier measurement (median taken)
    # host / Redis promotions per prompt, each one sample. The first after the prompt's cold
    # prefill is the slow one (a promotion in serving follows other work); later ones are warm
    tier_promotions: int = 1
    decode_batch: int = 32  # requests decoding together
    decode_prompt_tokens: int = 32
    decode_tokens: int = 32  # output tokens of each decoding request
    max_num_batched_tokens: int = 2048

    def __post_init__(self) -> None:
        for k, v in asdict(self).items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{k} must be an integer >= 1, got {v!r}")
        if self.prefix_tokens < _BLOCK:
            raise ValueError(
                f"prefix_tokens must be >= {_BLOCK} (one page), got {self.prefix_tokens}"
            )
        if self.decode_tokens < 2:
            raise ValueError(
                f"decode_tokens must be >= 2 (the first token comes from prefill), "
                f"got {self.decode_tokens}"
            )


QUICK = CalibrationSizes(
    prefill_tokens=256,
    prefix_tokens=256,
    repeats=2,
    tier_promotions=2,
    decode_batch=4,
    decode_prompt_tokens=16,
    decode_tokens=8,
    max_num_batched_tokens=512,
)


def _stderr(msg: str) -> None:
    print(f"calibrate: {msg}", file=sys.stderr, flush=True)


class _Prompts:
    """Token-id prompts cut from consecutive, non-overlapping slices of a text, so no two
    share a cached page."""

    def __init__(self, llm: LLM, text: str) -> None:
        if llm.tokenizer is None:
            raise CalibrationError("the model has no tokenizer: prompts are cut from a text")
        self.tokenizer, self.text, self.pos = llm.tokenizer, text, 0

    def take(self, n_tokens: int) -> list[int]:
        chunk = self.text[self.pos : self.pos + n_tokens * _CHARS_PER_TOKEN]
        self.pos += len(chunk)
        ids = self.tokenizer.encode(chunk)[:n_tokens]
        if len(ids) < n_tokens:
            raise CalibrationError(
                f"the text ran out after {self.pos} characters; use a longer --text or "
                f"smaller sizes"
            )
        return ids


def _pages(tokens: int) -> int:
    return -(-tokens // _BLOCK)


def _timed(llm: LLM, ids: list[int]):
    """Wall time of a one-token request (its TTFT), and its output."""
    t0 = time.perf_counter()
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))[0]
    return time.perf_counter() - t0, out


def measure_prefill(llm: LLM, prompts: list[list[int]], log: Callable[[str], None]) -> list[float]:
    """Seconds per cold prefill of each prompt (the first is a warm-up and not returned)."""
    times = []
    for i, ids in enumerate(prompts):
        t, out = _timed(llm, ids)
        if out.num_cached_tokens:
            raise CalibrationError(f"prefill prompt {i} hit the cache ({out.num_cached_tokens})")
        if i == 0:
            log(f"prefill warm-up: {len(ids)} tokens in {t:.2f}s")
            continue
        times.append(t)
        log(f"prefill {i}/{len(prompts) - 1}: {len(ids)} tokens in {t:.2f}s")
    return times


def measure_decode(
    llm: LLM, prompts: list[list[int]], decode_tokens: int, log: Callable[[str], None]
) -> list[float]:
    """Wall time of every engine step in which all ``len(prompts)`` requests decode one token
    (steps after each request has its first token). A short round first warms up."""
    eng = llm.engine
    steps: list[float] = []
    for rnd, max_tokens in (("warm-up", min(4, decode_tokens)), ("measured", decode_tokens)):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        ids = {eng.add_request(p, params) for p in prompts}
        started: set[str] = set()
        times = []
        while eng.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = eng.step()
            dt = time.perf_counter() - t0
            if started == ids and len(outs) == len(ids):  # a pure decode step of the batch
                times.append(dt)
            started.update(o.request_id for o in outs)
        log(
            f"decode {rnd}: {len(times)} steps of {len(ids)} requests, median "
            f"{statistics.median(times) if times else float('nan'):.4f}s"
        )
        steps = times
    if not steps:
        raise CalibrationError("no decode step ran the whole batch; raise decode_tokens")
    return steps


def measure_tier(
    llm: LLM, tier: str, prompts: list[list[int]], promotions: int, log: Callable[[str], None]
) -> dict[str, list[float]]:
    """Per prompt (the first is a warm-up, not returned): compute it once, then ``promotions``
    times: time it served from the device, spill it (``reset_prefix_cache``), time
    it served from ``tier``. Returns the raw samples and ``s_per_token`` = (tier TTFT - device
    TTFT) / tokens the tier served, one per promotion."""
    out: dict[str, list[float]] = {
        "ttft_cold_s": [],
        "ttft_device_s": [],
        f"ttft_{tier}_s": [],
        "tier_tokens": [],
        "s_per_token": [],
    }
    for i, ids in enumerate(prompts):
        expect = (len(ids) - 1) // _BLOCK * _BLOCK  # the last prompt token is always computed
        llm.reset_prefix_cache()  # spill what earlier prompts left: nothing spills while timed
        cold, _ = _timed(llm, ids)
        if i:
            out["ttft_cold_s"].append(cold)
        for j in range(promotions):
            dev, res = _timed(llm, ids)  # the pages are on the device (computed or promoted)
            if res.cached_tokens_by_tier.get("device", 0) != expect:
                raise CalibrationError(
                    f"{tier} prompt {i}: expected {expect} device-cached tokens, got "
                    f"{res.cached_tokens_by_tier}"
                )
            llm.reset_prefix_cache()  # every page spills down to the tier; returns once stored
            t, res = _timed(llm, ids)
            served = res.cached_tokens_by_tier.get(tier, 0)
            if served != expect:  # a recomputed page would be charged to the tier
                raise CalibrationError(
                    f"{tier} prompt {i}: the {tier} tier served {served} of {expect} tokens "
                    f"({res.cached_tokens_by_tier}); is it reachable and large enough?"
                )
            per_token = (t - dev) / served
            what = f"{i}/{len(prompts) - 1}" if i else "warm-up"
            what += f" promotion {j + 1}/{promotions}"
            log(
                f"{tier} {what}: {served} tokens, TTFT {t:.3f}s vs device {dev:.3f}s "
                f"(cold {cold:.2f}s): {per_token * 1e6:.1f} us/token"
            )
            if i:
                out["ttft_device_s"].append(dev)
                out[f"ttft_{tier}_s"].append(t)
                out["tier_tokens"].append(served)
                out["s_per_token"].append(per_token)
    return out


def cpu_busy_fraction(interval_s: float = 1.0) -> float | None:
    """The fraction of all CPUs' time spent busy over the next ``interval_s`` (Linux
    /proc/stat; None elsewhere). A 1-minute load average would still count a run that just
    ended."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
        return sum(v[:8]) - idle, idle

    try:
        b0, i0 = sample()
        time.sleep(interval_s)
        b1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    total = (b1 - b0) + (i1 - i0)
    return (b1 - b0) / total if total > 0 else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ping(url: str) -> bool:
    import redis

    try:
        with redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=2) as c:
            return bool(c.ping())
    except redis.RedisError:
        return False


@contextlib.contextmanager
def redis_url_for(url: str | None, log: Callable[[str], None] = _stderr) -> Iterator[str]:
    """``url`` if given (it must answer PING); else a throwaway ``redis-server`` on a free
    loopback port, no persistence, killed on exit."""
    if url is not None:
        if not _ping(url):
            from kvmesh.kvstore.redis_tier import redact_url

            raise CalibrationError(f"Redis at {redact_url(url)} does not answer PING")
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        raise CalibrationError(REDIS_MISSING)
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="kvmesh-calibrate-redis-") as tmp:
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", tmp, "--loglevel", "warning"]
        with open(Path(tmp) / "redis.log", "ab") as logf:  # a file: a full pipe would stall it
            proc = subprocess.Popen(
                args, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        try:
            url = f"redis://127.0.0.1:{port}/0"
            deadline = time.monotonic() + 10
            while not _ping(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = (Path(tmp) / "redis.log").read_text(errors="replace")[-2000:]
                    raise CalibrationError(f"redis-server on port {port} did not start:\n{tail}")
                time.sleep(0.05)
            log(f"started a throwaway redis-server at {url}")
            yield url
        finally:
            proc.kill()
            proc.wait(timeout=10)


def calibrate(
    model: str = DEFAULT_MODEL,
    *,
    name: str | None = None,
    dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    redis_url: str | None = None,
    sizes: CalibrationSizes = CalibrationSizes(),
    text_path: str | Path | None = None,
    threads: int | None = None,
    log: Callable[[str], None] = _stderr,
) -> dict:
    """Measure a ``SimProfile`` with the real engine. Returns its JSON form (every
    ``SimProfile`` field, as ``router.profiles.load_profile`` reads it) plus a ``measured``
    block: date, model, formats, device, torch threads, sizes and the raw samples.
    ``threads`` sets torch's intra-op threads for the run (restored afterwards).
    Raises CalibrationError when a measurement cannot be made."""
    text_path = Path(text_path) if text_path is not None else DEFAULT_TEXT
    if not text_path.is_file():
        raise FileNotFoundError(f"--text {text_path}: no such file (prompts are cut from it)")
    if threads is not None and (isinstance(threads, bool) or threads < 1):
        raise ValueError(f"threads must be >= 1, got {threads!r}")
    text = text_path.read_text()
    busy = cpu_busy_fraction()
    if busy is not None and busy > 0.25:
        log(
            f"warning: the machine is busy ({busy:.0%} of {os.cpu_count()} CPUs in use by "
            f"other processes); timings will be slow and noisy"
        )
    saved_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        result = _calibrate(
            model, name, dtype, kv_cache_dtype, redis_url, sizes, text, threads, log
        )
    finally:
        torch.set_num_threads(saved_threads)
    result["measured"]["cpu_busy_before"] = busy  # other processes' share, see the warning
    return result


def _calibrate(model, name, dtype, kv_cache_dtype, redis_url, sizes, text, threads, log) -> dict:
    started = datetime.now(timezone.utc)
    t_start, cpu_start = time.monotonic(), time.process_time()
    load_before = os.getloadavg()[0]
    sz = sizes
    engine_args = dict(dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=_BLOCK)
    engine_args["max_num_batched_tokens"] = sz.max_num_batched_tokens

    def make_llm(**kw) -> LLM:
        llm = LLM(model, **engine_args, **kw)
        if threads is not None:  # the engine applies KVMESH_NUM_THREADS; --threads wins
            torch.set_num_threads(threads)
        return llm

    tier_pages = _pages(sz.prefix_tokens + 1) + 8  # one prompt on the device, nothing more

    # phase 1: prefill and decode on an engine without tiers (a cold request never parks)
    log(f"loading {model} (no tiers)")
    decode_pages = sz.decode_batch * (_pages(sz.decode_prompt_tokens + sz.decode_tokens) + 1)
    llm = make_llm(
        num_pages=max(_pages(sz.prefill_tokens + 1) + 8, decode_pages + 8),
        max_num_seqs=sz.decode_batch,
    )
    eng = llm.engine
    spec = eng.page_spec
    kv_bytes_per_token = spec.page_nbytes // spec.block_size
    log(f"KV format {eng.cache_format}: {spec.page_nbytes} bytes per page of {spec.block_size}")
    prompts = _Prompts(llm, text)
    try:
        prefill_s = measure_prefill(
            llm, [prompts.take(sz.prefill_tokens) for _ in range(sz.repeats + 1)], log
        )
        decode_prompts = [prompts.take(sz.decode_prompt_tokens) for _ in range(sz.decode_batch)]
        decode_step_s = measure_decode(llm, decode_prompts, sz.decode_tokens, log)
    finally:
        llm.close()
    torch_threads = torch.get_num_threads()
    device = str(eng.device)
    device_name = torch.cuda.get_device_name(eng.device) if eng.device.type == "cuda" else None
    model_name, cache_format, model_dtype = eng.src.name, eng.cache_format, str(eng.dtype)
    del llm, eng

    # the same prompts for both tiers (their engines' caches are separate); the first warms
    # up the load path (allocator, Redis, connections): the first loads are slower
    tier_prompts = [prompts.take(sz.prefix_tokens + 1) for _ in range(sz.repeats + 1)]
    host_bytes = 2 * len(tier_prompts) * tier_pages * (spec.page_nbytes + 4096)

    # phase 2: the host tier
    log("loading the engine with a host tier")
    llm = make_llm(num_pages=tier_pages, host_cache_memory=host_bytes)
    try:
        host = measure_tier(llm, "host", tier_prompts, sz.tier_promotions, log)
    finally:
        llm.close()
    del llm

    # phase 3: Redis (no host tier: evicted pages go straight to Redis)
    with redis_url_for(redis_url, log) as url:
        from kvmesh.kvstore.redis_tier import redact_url

        log(f"loading the engine with a Redis tier ({redact_url(url)})")
        llm = make_llm(num_pages=tier_pages, redis_url=url)
        try:
            red = measure_tier(llm, "redis", tier_prompts, sz.tier_promotions, log)
        finally:
            try:  # leave a shared Redis as it was, even after a failure: delete our pages
                redis_tier = llm.engine.store.tiers[-1]
                for ids in tier_prompts:
                    redis_tier.evict(llm.engine.make_request(ids).page_hashes)
            except Exception as e:  # never mask the measurement's own error
                log(f"could not delete the calibration's pages from Redis: {e}")
            llm.close()
        del llm

    values = {
        "prefill_tokens_per_s": sz.prefill_tokens / statistics.median(prefill_s),
        "decode_s_per_token": statistics.median(decode_step_s),
        "host_s_per_token": statistics.median(host["s_per_token"]),
        "redis_s_per_token": statistics.median(red["s_per_token"]),
    }
    check_measured(values, log)
    date = started.strftime("%Y-%m-%d")
    profile = SimProfile(
        name=name or f"{model_name}-{device.split(':')[0]}-{cache_format}",
        kv_bytes_per_token=kv_bytes_per_token,
        note=(
            f"measured by kvmesh calibrate-profile on {date}: {model_name}, KV {cache_format}, "
            f"{device}, {torch_threads} torch threads; decode at batch {sz.decode_batch}"
        ),
        **values,
    )
    result = profile_to_dict(profile)
    result["measured"] = {
        "date": started.isoformat(timespec="seconds"),
        "model": model_name,
        "model_fp": spec.model_fp,
        "dtype": model_dtype,
        "kv_cache_dtype": kv_cache_dtype,
        "kv_cache_format": cache_format,
        "block_size": spec.block_size,
        "page_nbytes": spec.page_nbytes,
        "device": device,
        "device_name": device_name,
        "torch_threads": torch_threads,
        "torch_version": torch.__version__,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "loadavg_1m": [load_before, os.getloadavg()[0]],  # before and after
        "redis": "given" if redis_url else "throwaway loopback redis-server",
        "sizes": asdict(sz),
        "wall_s": time.monotonic() - t_start,
        # this process's CPU time: well below wall_s x torch_threads means others shared the CPUs
        "process_cpu_s": time.process_time() - cpu_start,
        "samples": {
            "prefill_s": prefill_s,
            "decode_step_s": decode_step_s,
            "host": host,
            "redis": red,
        },
    }
    return result


TIER_COSTS = ("host_s_per_token", "redis_s_per_token")


def check_measured(values: dict[str, float], log=lambda msg: None) -> None:
    """Check measured profile values in place; raise CalibrationError naming a bad one.

    A tier load no slower than a device hit measures as a small number of either sign (host
    RAM often does): within 5% of the time to recompute a token it is set to 0, "free" to
    the routing policy. Every other value must be finite and positive."""
    recompute_s = 1.0 / values["prefill_tokens_per_s"] if values["prefill_tokens_per_s"] > 0 else 0
    for k in TIER_COSTS:
        v = values[k]
        if math.isfinite(v) and v <= 0 and -v < 0.05 * recompute_s:
            log(f"{k} = {v * 1e6:.1f} us/token: no slower than a device hit, within noise; 0")
            values[k] = 0.0
    for k, v in values.items():
        if not (math.isfinite(v) and (v > 0 or (v == 0 and k in TIER_COSTS))):
            raise CalibrationError(
                f"measured {k} = {v}: not a positive number (a busy machine or sizes too "
                f"small to time); rerun, or raise the sizes"
            )
