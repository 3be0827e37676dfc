"""Offline throughput: kvmesh against transformers' ``generate`` (and optionally vLLM CPU).

One workload, run through every engine in the same process run:
``--num-prompts`` prompts of about ``--prompt-tokens`` tokens (lengths vary +-20 tokens,
deterministically) cut from tinyshakespeare, ``--max-tokens`` output tokens each, greedy,
EOS ignored, all submitted at once. Prompts are token ids, so every engine sees the very
same tokens.

Baselines:
  * transformers ``generate``, one request at a time (on the first ``--hf-seq-prompts``);
  * transformers ``generate``, one left-padded batch of every prompt;
  * vLLM's CPU build (``--vllm-python``), in its own virtualenv, as a subprocess, on a
    Hugging Face folder exported from the same GGUF weights.

Prints one JSON object on stdout; progress goes to stderr.

    python bench/throughput.py
    python bench/throughput.py --vllm-python /work/vllm-venv/bin/python
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from machine import machine_info

DEFAULT_TEXT = Path(__file__).resolve().parents[1].parent / "shared/data/tinyshakespeare.txt"
LENGTH_JITTER = 20  # prompt lengths are prompt_tokens +- this many tokens


def log(msg: str) -> None:
    print(f"[throughput] {msg}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between closest ranks."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> tuple[int, float]:
    """How many of ``theirs`` equal ours exactly (compared on the first ``len(theirs)``
    prompts), and the mean length of the common prefix."""
    pairs = list(zip(ours[: len(theirs)], theirs, strict=True))
    same = sum(a == b for a, b in pairs)
    return same, round(statistics.mean(common_prefix(a, b) for a, b in pairs), 1)


# ---------------------------------------------------------------- workload


def make_prompts(encode, text: str, num: int, tokens: int, seed: int) -> list[list[int]]:
    """``num`` token-id prompts of ``tokens +- LENGTH_JITTER`` tokens each, cut from evenly
    spaced, non-overlapping places in ``text`` (so no two share a prefix), each starting at
    a line start. The same arguments give the same prompts."""
    rng = random.Random(seed)
    jitter = min(LENGTH_JITTER, tokens - 1)
    lengths = [rng.randint(tokens - jitter, tokens + jitter) for _ in range(num)]
    stride = len(text) // num
    prompts = []
    for i, n in enumerate(lengths):
        start = i * stride
        if start:
            start = text.find("\n", start) + 1
        chars = 8 * n  # ~4 characters a token in this text; doubled for margin
        ids = encode(text[start : start + chars])
        while len(ids) < n and start + chars < len(text):
            chars *= 2
            ids = encode(text[start : start + chars])
        if len(ids) < n:
            raise ValueError(
                f"the text has too few tokens after character {start} for a {n}-token prompt; "
                f"use fewer or shorter prompts (--num-prompts/--prompt-tokens) or a longer --text"
            )
        prompts.append(ids[:n])
    return prompts


# ---------------------------------------------------------------- kvmesh


def set_gemm_mode(mode: str | None) -> None:
    """Run the next engine's linear layers with GEMM mode ``mode`` (``kernels.autotune``):
    a fresh process tuner, so each mode is timed in this one run."""
    if mode is None:
        return
    from kvmesh.kernels import autotune

    os.environ["KVMESH_GEMM"] = mode
    autotune.reset_default_tuners()


def autotune_mode() -> str:
    """The GEMM mode the engine runs over this bench's float KV cache (``kernels.autotune``)."""
    from kvmesh.kernels import autotune

    return autotune.engine_mode()


def run_kvmesh(args, text: str) -> tuple[dict, list[list[int]], list[list[int]]]:
    from kvmesh.worker import LLM, SamplingParams

    engine_args = {"max_num_seqs": args.max_num_seqs}
    if args.max_num_batched_tokens:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.kv_cache_memory:
        engine_args["kv_cache_memory"] = args.kv_cache_memory
    t = time.monotonic()
    llm = LLM(model=args.model, **engine_args)
    log(f"kvmesh: engine built in {time.monotonic() - t:.1f}s")
    eng = llm.engine
    prompts = make_prompts(
        llm.tokenizer.encode, text, args.num_prompts, args.prompt_tokens, args.seed
    )

    # warm up on a prompt outside the workload, then forget its pages
    llm.generate(
        [prompts[0][::-1][:32]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    )
    llm.reset_prefix_cache()

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    metrics = eng.metrics  # Prometheus metrics (worker/metrics.py), on by default
    # --metrics compare: runs take turns with the metrics off and on (scraped every second,
    # as Prometheus would), in this one engine; each side reports its fastest run
    modes = {"on": [True], "off": [False], "compare": [False, True]}[args.metrics]
    runs = []  # (elapsed, outputs, metrics on) per run; the fastest is reported
    # on a loaded machine run-to-run noise swamps a 2% difference, so the metrics' own time is
    # also accounted directly: the engine thread's time in the metrics hook, and the scrapes'
    hook = _TimedHook(metrics) if metrics is not None else None
    # per metrics-on run: (hook + scrape CPU seconds) / the process's CPU seconds in the run
    shares: list[float] = []
    for r in range(args.repeats):
        for on in modes:
            eng.metrics = metrics if on else None
            llm.reset_prefix_cache()  # every repeat computes every prompt
            log(
                f"kvmesh: {len(prompts)} prompts x {args.max_tokens} tokens, run {r + 1}"
                f", metrics {'on' if on else 'off'} ..."
            )
            scraper = _Scraper(metrics.registry if on and metrics is not None else None)
            if hook is not None:
                hook.seconds = 0.0
            t0, cpu0 = time.monotonic(), time.process_time()
            outs = llm.generate(prompts, params)
            runs.append((time.monotonic() - t0, outs, on))
            scraper.stop()
            if on and hook is not None:
                shares.append((hook.seconds + scraper.seconds) / (time.process_time() - cpu0))
    eng.metrics = metrics
    if hook is not None:
        hook.restore()
    elapsed, outs, _ = min(runs, key=lambda run: run[0])
    out_tokens = sum(len(o.token_ids) for o in outs)
    # ttft_s runs from the request's arrival; LLM.generate creates every request (arrival)
    # before running the first step, so it is the time from the batch's submission.
    ttfts = [o.ttft_s for o in outs]
    stats = eng.stats()
    result = {
        "kvmesh_elapsed_s": round(elapsed, 3),
        "kvmesh_elapsed_all_s": [round(e, 3) for e, _, _ in runs],
        "kvmesh_metrics": args.metrics,
        "kvmesh_out_tokens": out_tokens,
        "kvmesh_out_tok_s": round(out_tokens / elapsed, 2),
        "kvmesh_total_tok_s": round((out_tokens + sum(map(len, prompts))) / elapsed, 2),
        "kvmesh_ttft_p50_s": round(percentile(ttfts, 50), 4),
        "kvmesh_ttft_p99_s": round(percentile(ttfts, 99), 4),
        "kvmesh_ttft_max_s": round(max(ttfts), 4),
        "kvmesh_prefix_cached_tokens": sum(o.num_cached_tokens for o in outs),
        "kvmesh_preemptions": stats.num_preemptions,  # over all repeats
        "kvmesh_engine": {
            "model": eng.src.name,
            "model_file": str(eng.src.path),
            "device": str(eng.device),
            "dtype": str(eng.dtype).removeprefix("torch."),
            "kv_cache_dtype": eng.cache_config.kv_cache_dtype,
            "block_size": eng.cache_config.block_size,
            "num_pages": stats.num_pages,
            "enable_prefix_caching": eng.cache_config.enable_prefix_caching,
            "max_num_seqs": eng.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": eng.scheduler_config.max_num_batched_tokens,
            "max_model_len": eng.max_model_len,
            "attention_backend": type(eng.backend).__name__,
        },
    }
    if args.metrics == "compare":
        best = {on: min(e for e, _, m in runs if m == on) for on in (False, True)}
        off_tok_s, on_tok_s = out_tokens / best[False], out_tokens / best[True]
        result["kvmesh_metrics_off_out_tok_s"] = round(off_tok_s, 2)
        result["kvmesh_metrics_on_out_tok_s"] = round(on_tok_s, 2)
        result["metrics_overhead_pct"] = round(100 * (off_tok_s - on_tok_s) / off_tok_s, 2)
        result["kvmesh_elapsed_metrics_off_s"] = [round(e, 3) for e, _, m in runs if not m]
        result["kvmesh_elapsed_metrics_on_s"] = [round(e, 3) for e, _, m in runs if m]
    if shares:
        # the metrics' own CPU time (engine-thread hook + 1 s scrapes) as a share of the
        # process's CPU time in each metrics-on run
        result["metrics_cpu_share_pct"] = [round(100 * x, 3) for x in shares]
        if "metrics_overhead_pct" in result:
            log(f"kvmesh: metrics on costs {result['metrics_overhead_pct']}% of throughput")
    log(
        f"kvmesh: {result['kvmesh_out_tok_s']} out tok/s, "
        f"ttft p50 {result['kvmesh_ttft_p50_s']}s p99 {result['kvmesh_ttft_p99_s']}s"
    )
    if args.ttft_tokens:
        result.update(kvmesh_ttft(llm, text, args.ttft_tokens, args.ttft_repeats))
    token_ids = [list(o.token_ids) for o in outs]
    del llm, eng, outs
    gc.collect()
    return result, prompts, token_ids


def ttft_prompts(encode, text: str, tokens: int) -> list[list[int]]:
    """Two ``tokens``-token prompts from the middle and the end of ``text`` (no shared prefix
    with each other or the throughput prompts' starts)."""
    out = []
    for start in (len(text) // 2, len(text) - 16 * tokens):
        start = text.find("\n", max(start, 0)) + 1
        ids = encode(text[start : start + 16 * tokens])
        if len(ids) < tokens:
            raise ValueError(f"the text has too few tokens for a {tokens}-token TTFT prompt")
        out.append(ids[:tokens])
    return out


def kvmesh_ttft(llm, text: str, tokens: int, repeats: int = 1) -> dict:
    """Time to first token of each TTFT prompt cold (prefix cache empty), then on a prefix hit
    (the same prompt again: every full page cached, the last token's step computed), each
    ``repeats`` times; the reported figure per prompt is the median."""
    from kvmesh.worker import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    cold, hit = [], []
    prompts = ttft_prompts(llm.tokenizer.encode, text, tokens)
    for _ in range(repeats):  # rounds over the prompts: a drift in load hits each prompt alike
        for i, p in enumerate(prompts):
            if len(cold) <= i:
                cold.append([])
                hit.append([])
            llm.reset_prefix_cache()
            t0 = time.monotonic()
            llm.generate([p], one)
            cold[i].append(round(time.monotonic() - t0, 4))
            t0 = time.monotonic()
            llm.generate([p], one)
            hit[i].append(round(time.monotonic() - t0, 4))
    log(f"kvmesh: {tokens}-token TTFT cold {cold} s, on a hit {hit} s")
    return {
        "kvmesh_ttft_cold_s": [statistics.median(x) for x in cold],
        "kvmesh_ttft_hit_s": [statistics.median(x) for x in hit],
        "kvmesh_ttft_cold_all_s": cold,
        "kvmesh_ttft_hit_all_s": hit,
        "ttft_prompt_tokens": tokens,
        "_ttft_prompts": prompts,  # the same token ids go to vLLM; not printed
    }


class _TimedHook:
    """Counts the CPU seconds the engine spends in ``EngineMetrics.on_step`` (which calls
    ``on_finished``) while installed."""

    def __init__(self, metrics) -> None:
        self.metrics = metrics
        self.seconds = 0.0
        inner = metrics.on_step

        def on_step(*args, **kwargs):
            t = time.thread_time()  # CPU time: on a loaded machine wall time counts waits
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - t

        metrics.on_step = on_step

    def restore(self) -> None:
        del self.metrics.on_step  # the class's method again


class _Scraper:
    """Renders a Prometheus registry once a second on a thread, as a scrape would (None:
    nothing); ``seconds``: the CPU time spent rendering."""

    def __init__(self, registry) -> None:
        self._stop = threading.Event()
        self._thread = None
        self.seconds = 0.0
        if registry is not None:
            from prometheus_client import generate_latest

            def loop() -> None:
                while not self._stop.wait(1.0):
                    t = time.thread_time()
                    generate_latest(registry)
                    self.seconds += time.thread_time() - t

            self._thread = threading.Thread(target=loop, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


# ---------------------------------------------------------------- transformers


def load_hf(model: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvmesh.worker.models.loader import resolve_model

    src = resolve_model(model)
    if src.kind == "gguf":
        kw = {"gguf_file": src.path.name}
        folder = str(src.path.parent)
    else:
        kw, folder = {}, str(src.path)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw).eval()
    tok = AutoTokenizer.from_pretrained(folder, **kw)
    return src, hf_model, tok


@torch.inference_mode()
def hf_generate(model, input_ids, attention_mask, max_tokens: int, pad_id: int) -> torch.Tensor:
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        do_sample=False,
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,  # EOS is suppressed: the stand-in for ignore_eos
        pad_token_id=pad_id,
    )
    return out[:, input_ids.shape[1] :]  # (B, max_tokens)


def run_hf(args, prompts: list[list[int]], hf_model, tok) -> tuple[dict, dict]:
    pad_id = tok.eos_token_id
    # generation_config may carry sampling knobs from the model files; greedy ignores them
    hf_model.generation_config.temperature = None
    hf_model.generation_config.top_p = None
    hf_model.generation_config.top_k = None
    warm = torch.tensor([prompts[0][::-1][:32]])
    hf_generate(hf_model, warm, torch.ones_like(warm), 4, pad_id)

    result: dict = {}
    outputs: dict = {}
    log(f"hf batched: {len(prompts)} prompts x {args.max_tokens} tokens, left-padded ...")
    tok.padding_side = "left"
    tok.pad_token = tok.eos_token
    batch = tok.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
    ids, mask = batch["input_ids"], batch["attention_mask"]  # (B, longest prompt)
    runs = []
    for _ in range(args.repeats):
        t0 = time.monotonic()
        gen = hf_generate(hf_model, ids, mask, args.max_tokens, pad_id)
        runs.append(time.monotonic() - t0)
    elapsed = min(runs)
    n = gen.numel()
    result["hf_batched_elapsed_s"] = round(elapsed, 3)
    result["hf_batched_elapsed_all_s"] = [round(e, 3) for e in runs]
    result["hf_batched_out_tok_s"] = round(n / elapsed, 2)
    outputs["batched"] = gen.tolist()
    log(f"hf batched: {result['hf_batched_out_tok_s']} out tok/s")

    if args.skip_hf_sequential:
        result["hf_sequential_out_tok_s"] = None
        result["hf_sequential_note"] = "skipped (--skip-hf-sequential)"
        return result, outputs
    subset = prompts[: args.hf_seq_prompts]
    log(f"hf sequential: {len(subset)} prompts one at a time ...")
    seq_out = []
    t0 = time.monotonic()
    for p in subset:
        ids = torch.tensor([p])
        seq_out.append(hf_generate(hf_model, ids, torch.ones_like(ids), args.max_tokens, pad_id)[0])
    elapsed = time.monotonic() - t0
    n = sum(o.numel() for o in seq_out)
    result["hf_sequential_elapsed_s"] = round(elapsed, 3)
    result["hf_sequential_out_tok_s"] = round(n / elapsed, 2)
    result["hf_sequential_prompts"] = len(subset)
    result["hf_sequential_note"] = (
        f"tokens/s measured on the first {len(subset)} of {len(prompts)} prompts, run one at a time"
    )
    outputs["sequential"] = [o.tolist() for o in seq_out]
    log(f"hf sequential: {result['hf_sequential_out_tok_s']} out tok/s")
    return result, outputs


# ---------------------------------------------------------------- vLLM

# sitecustomize for the vLLM processes when KVMESH_CPU_ISA=avx2: vLLM picks its kernels by
# torch's CPU checks (its AVX-512 or AVX2 build of _C, AVX-512-only paths), which read the
# hardware; answering False there caps it at AVX2 as ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY
# and MKL_ENABLE_INSTRUCTIONS cap oneDNN, ATen (and inductor) and MKL. It replaces any
# sitecustomize of that virtualenv's Python (a plain venv has none).
VLLM_AVX2_SHIM = """
try:
    import torch.cpu
except ImportError:  # a process of the tree without torch: nothing to cap
    pass
else:
    for _name in (
        "_is_avx512_supported",
        "_is_avx512_bf16_supported",
        "_is_vnni_supported",
        "_is_amx_tile_supported",
        "_is_amx_fp16_supported",
    ):
        setattr(torch.cpu, _name, lambda: False)
"""

# Runs inside the vLLM virtualenv. vLLM CPU starts worker processes, hence the main guard.
VLLM_SCRIPT = """
import json
import statistics
import sys
import time


def main():
    spec = json.load(open(sys.argv[1]))
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=spec["model_dir"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        enable_prefix_caching=True,
        seed=0,
    )
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
    llm.generate([{"prompt_token_ids": spec["prompts"][0][::-1][:32]}],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    llm.reset_prefix_cache()
    t0 = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.monotonic() - t0
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    cold = [[] for _ in spec["ttft_prompts"]]
    hit = [[] for _ in spec["ttft_prompts"]]
    for _ in range(spec["ttft_repeats"]):
        for i, p in enumerate(spec["ttft_prompts"]):
            llm.reset_prefix_cache()
            t = time.monotonic()
            llm.generate([{"prompt_token_ids": p}], one, use_tqdm=False)
            cold[i].append(round(time.monotonic() - t, 4))
            t = time.monotonic()
            llm.generate([{"prompt_token_ids": p}], one, use_tqdm=False)
            hit[i].append(round(time.monotonic() - t, 4))
    import torch
    model_config = getattr(llm.llm_engine, "model_config", None)
    result = {
        "elapsed_s": elapsed,
        "out_tokens": sum(map(len, token_ids)),
        "token_ids": token_ids,
        "vllm_version": vllm.__version__,
        "ttft_cold_s": [statistics.median(x) for x in cold],
        "ttft_hit_s": [statistics.median(x) for x in hit],
        "ttft_cold_all_s": cold,
        "ttft_hit_all_s": hit,
        "torch_version": torch.__version__,
        "dtype": str(getattr(model_config, "dtype", spec["dtype"])).replace("torch.", ""),
        # what vLLM's kernel choice read (its AVX-512 or AVX2 build of _C): False under the
        # AVX2 cap's shim
        "torch_sees_avx512": torch.cpu._is_avx512_supported(),
    }
    with open(spec["result_path"], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
"""


def export_hf_folder(src, hf_model, tok, out_dir: Path) -> Path:
    """Save the GGUF-loaded model as a Hugging Face folder (safetensors, fp32), once."""
    if (out_dir / "config.json").is_file():
        return out_dir
    from transformers import AutoModelForCausalLM

    # A GGUF-loaded model keeps its quantizer attached and refuses save_pretrained, although
    # its weights are already plain fp32: copy them into a clean model of the same config.
    config = copy.deepcopy(hf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(hf_model).__name__]
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    clean.load_state_dict(hf_model.state_dict(), strict=True)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    clean.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out_dir)
    return out_dir


def isa_capped_at_avx2() -> bool:
    """Whether this run emulates an AVX2-only CPU (``KVMESH_CPU_ISA=avx2``; bench/README.md):
    then vLLM is capped too, and a warning names the caps missing beside it (set before torch
    loads, they cannot be set from here)."""
    from kvmesh.worker import envs

    if envs.cpu_isa() != "avx2":
        return False
    want = {
        ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"): "AVX2",
        ("ATEN_CPU_CAPABILITY",): "avx2",
        ("MKL_ENABLE_INSTRUCTIONS",): "AVX2",
    }
    missing = [
        f"{names[0]}={v}"
        for names, v in want.items()
        if not any(os.environ.get(k, "").lower() == v.lower() for k in names)
    ]
    if missing:
        log(f"warning: KVMESH_CPU_ISA=avx2 without {' '.join(missing)}: torch still runs AVX-512")
    return True


def run_vllm(
    args, prompts, model_dir: Path, kvmesh_cfg: dict, ttft: list[list[int]]
) -> tuple[dict, list[list[int]]]:
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-vllm-") as tmp:
        script = Path(tmp) / "run_vllm.py"
        script.write_text(VLLM_SCRIPT)
        spec_path = Path(tmp) / "spec.json"
        result_path = Path(tmp) / "result.json"
        longest = max(map(len, prompts)) + args.max_tokens
        longest = max(longest, (args.ttft_tokens or 0) + 1)
        spec = {
            "model_dir": str(model_dir),
            "dtype": args.vllm_dtype,
            "max_model_len": max(longest, 1024),
            "max_num_seqs": kvmesh_cfg["max_num_seqs"],
            "max_num_batched_tokens": kvmesh_cfg["max_num_batched_tokens"],
            "max_tokens": args.max_tokens,
            "prompts": prompts,
            "ttft_prompts": ttft,
            "ttft_repeats": args.ttft_repeats,
            "result_path": str(result_path),
        }
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB
        # every core, as kvmesh runs: vLLM's default reserves one for its frontend
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        isa_cap = args.isa_cap
        if isa_cap:  # the same cap as kvmesh's: vLLM's AVX-512 checks answer False
            shim = Path(tmp) / "avx2-shim"
            shim.mkdir()
            (shim / "sitecustomize.py").write_text(VLLM_AVX2_SHIM)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(shim), env.get("PYTHONPATH"))))
        log(f"vllm: running {args.vllm_python} on {model_dir} ({args.vllm_dtype}) ...")
        t0 = time.monotonic()
        # vLLM logs to stdout too: relay everything to stderr, keeping stdout for our JSON,
        # and keep the worker's OpenMP binding (vLLM CPU pins its worker to chosen cores)
        binding = []
        with subprocess.Popen(
            [args.vllm_python, str(script), str(spec_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp,
            text=True,
            errors="replace",
        ) as proc:
            watchdog = threading.Timer(args.vllm_timeout, proc.kill)
            watchdog.start()
            try:
                for line in proc.stdout:
                    sys.stderr.write(line)
                    if "core ids=" in line or "reserved_cpus=" in line:
                        binding.append(line.strip())
                rc = proc.wait()
            finally:
                watchdog.cancel()
        wall = time.monotonic() - t0
        if rc != 0 or not result_path.is_file():
            raise RuntimeError(f"the vLLM subprocess failed (exit {rc}); its log is above")
        r = json.loads(result_path.read_text())
    result = {
        "vllm_elapsed_s": round(r["elapsed_s"], 3),
        "vllm_out_tok_s": round(r["out_tokens"] / r["elapsed_s"], 2),
        "vllm_ttft_cold_s": r["ttft_cold_s"],
        "vllm_ttft_hit_s": r["ttft_hit_s"],
        "vllm_ttft_cold_all_s": r["ttft_cold_all_s"],
        "vllm_ttft_hit_all_s": r["ttft_hit_all_s"],
        "vllm": {
            "python": args.vllm_python,
            "version": r["vllm_version"],
            "torch_version": r["torch_version"],
            "dtype": r["dtype"],
            "model_dir": str(model_dir),
            "kv_cache_space_gib": env["VLLM_CPU_KVCACHE_SPACE"],
            "omp_binding": binding,
            "env": {k: v for k, v in env.items() if k.startswith("VLLM_CPU")},
            "isa_cap": "avx2" if isa_cap else None,
            "torch_sees_avx512": r.get("torch_sees_avx512"),
            "process_wall_s": round(wall, 1),
        },
    }
    log(f"vllm: {result['vllm_out_tok_s']} out tok/s")
    return result, r["token_ids"]


# ---------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="text the prompts are cut from")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=250, help=f"mean (+-{LENGTH_JITTER})")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per prompt")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompt lengths")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="engine default")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--kv-cache-memory", default=None, help="e.g. 1GiB (engine default)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (torch default)")
    p.add_argument("--hf-seq-prompts", type=int, default=8, help="prompts run one at a time")
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="runs of kvmesh and of HF batched; the fastest of each is reported",
    )
    p.add_argument("--skip-hf-sequential", action="store_true")
    p.add_argument("--skip-hf", action="store_true", help="no transformers baselines at all")
    p.add_argument(
        "--metrics",
        choices=("on", "off", "compare"),
        default="on",
        help="the engine's Prometheus metrics; compare: runs take turns off and on (scraped "
        "every second) and the JSON has both throughputs and metrics_overhead_pct",
    )
    p.add_argument(
        "--gemm-modes",
        default=None,
        help="comma-separated KVMESH_GEMM modes (e.g. legacy,auto): kvmesh runs once per mode "
        "in this run; the last is the reported kvmesh row, the others get kvmesh_gemm_* rows",
    )
    p.add_argument(
        "--ttft-tokens",
        type=int,
        default=2048,
        help="two prompts of this many tokens: TTFT cold and on a prefix hit, kvmesh and vLLM "
        "(0 skips)",
    )
    p.add_argument(
        "--ttft-repeats",
        type=int,
        default=3,
        help="rounds over the two TTFT prompts; each prompt's reported TTFT is its median",
    )
    p.add_argument("--vllm-python", default=None, help="python of a virtualenv with vllm-cpu")
    p.add_argument("--vllm-dtype", default="float32")
    p.add_argument("--vllm-export-dir", type=Path, default=None, help="HF folder for vLLM")
    p.add_argument("--vllm-timeout", type=float, default=1800, help="seconds, then kill")
    args = p.parse_args(argv)
    for name in (
        "num_prompts",
        "prompt_tokens",
        "max_tokens",
        "hf_seq_prompts",
        "repeats",
        "ttft_repeats",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.text.is_file():
        p.error(f"--text {args.text} is not a file")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    # a bad KVMESH_CPU_ISA, or caps missing beside avx2: said at once; vLLM gets the same cap
    args.isa_cap = isa_capped_at_avx2()
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.monotonic()
    load_at_start = os.getloadavg()[0]
    text = args.text.read_text(encoding="utf-8")

    result: dict = {}
    modes = args.gemm_modes.split(",") if args.gemm_modes else [None]
    gemm_rows = {}
    for mode in modes[:-1]:
        set_gemm_mode(mode)
        other, _, other_tokens = run_kvmesh(args, text)
        gemm_rows[mode] = (other, other_tokens)
        gc.collect()
    set_gemm_mode(modes[-1])
    kv, prompts, kv_tokens = run_kvmesh(args, text)
    result["kvmesh_gemm_mode"] = autotune_mode()
    for mode, (other, other_tokens) in gemm_rows.items():
        result[f"kvmesh_gemm_{mode}_out_tok_s"] = other["kvmesh_out_tok_s"]
        result[f"kvmesh_gemm_{mode}_elapsed_all_s"] = other["kvmesh_elapsed_all_s"]
        result[f"ratio_gemm_{modes[-1]}_vs_{mode}"] = round(
            kv["kvmesh_out_tok_s"] / other["kvmesh_out_tok_s"], 3
        )
        result[f"kvmesh_gemm_{mode}_same_tokens"] = agreement(kv_tokens, other_tokens)[0]
    lengths = list(map(len, prompts))
    result["workload"] = {
        "model": args.model,
        "text": str(args.text),
        "num_prompts": len(prompts),
        "prompt_tokens_mean": round(statistics.mean(lengths), 1),
        "prompt_tokens_min": min(lengths),
        "prompt_tokens_max": max(lengths),
        "max_tokens": args.max_tokens,
        "sampling": "greedy (temperature 0), EOS ignored (HF: min_new_tokens=max_new_tokens)",
        "submission": "all prompts at once, as token ids",
    }
    result["torch_threads"] = torch.get_num_threads()
    result["torch_version"] = torch.__version__
    result["cpu_count"] = os.cpu_count()
    result["loadavg_1m_at_start"] = round(load_at_start, 2)  # other work skews every number
    result.update(kv)

    if args.skip_hf:
        result["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
        result["bench_wall_s"] = round(time.monotonic() - t_start, 1)
        result["machine"] = machine_info()
        result.pop("_ttft_prompts", None)
        print(json.dumps(result, indent=2))
        return
    src, hf_model, tok = load_hf(args.model)
    hf, hf_out = run_hf(args, prompts, hf_model, tok)
    result.update(hf)
    result["hf_dtype"] = "float32"
    result["ratio_vs_hf_batched"] = round(kv["kvmesh_out_tok_s"] / hf["hf_batched_out_tok_s"], 3)
    seq = hf["hf_sequential_out_tok_s"]
    result["ratio_vs_hf_sequential"] = round(kv["kvmesh_out_tok_s"] / seq, 3) if seq else None

    # greedy agreement; left padding shifts numerics a little, so this is reported only
    same, prefix = agreement(kv_tokens, hf_out["batched"])
    result["kvmesh_matches_hf"] = same
    result["kvmesh_matches_hf_of"] = len(hf_out["batched"])
    result["kvmesh_hf_mean_common_prefix_tokens"] = prefix
    if "sequential" in hf_out:
        same, prefix = agreement(kv_tokens, hf_out["sequential"])
        result["kvmesh_matches_hf_sequential"] = same
        result["kvmesh_matches_hf_sequential_of"] = len(hf_out["sequential"])
        result["kvmesh_hf_sequential_mean_common_prefix_tokens"] = prefix

    if args.vllm_python:
        from kvmesh.worker import envs
        from kvmesh.worker.models.loader import model_fingerprint

        export = args.vllm_export_dir or (
            envs.cache_dir() / "bench" / f"hf-export-{model_fingerprint(src)}"
        )
        t = time.monotonic()
        model_dir = export_hf_folder(src, hf_model, tok, export)
        log(f"vllm: HF folder ready at {model_dir} in {time.monotonic() - t:.1f}s")
        del hf_model
        gc.collect()
        ttft = kv.get("_ttft_prompts", [])
        vl, vl_tokens = run_vllm(args, prompts, model_dir, kv["kvmesh_engine"], ttft)
        result.update(vl)
        if ttft:
            for kind in ("cold", "hit"):
                ours, theirs = kv[f"kvmesh_ttft_{kind}_s"], vl[f"vllm_ttft_{kind}_s"]
                result[f"ttft_{kind}_ratio_kvmesh_vs_vllm"] = [
                    round(a / b, 3) for a, b in zip(ours, theirs)
                ]
        result["ratio_vs_vllm"] = round(kv["kvmesh_out_tok_s"] / vl["vllm_out_tok_s"], 3)
        same, prefix = agreement(kv_tokens, vl_tokens)
        result["vllm_matches_kvmesh"] = same
        result["vllm_matches_kvmesh_of"] = len(vl_tokens)
        result["vllm_kvmesh_mean_common_prefix_tokens"] = prefix

    result["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    result["bench_wall_s"] = round(time.monotonic() - t_start, 1)
    result["machine"] = machine_info()  # CPU model and SIMD flags
    result.pop("_ttft_prompts", None)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
