"""CPU kernel microbenchmarks, every variant against its baseline in the same run, interleaved
(a load spike from another process hits all alike), medians reported with ratios:

* ``gemm``: each linear shape of the model at decode/prefill row counts, ``F.linear`` vs MKL
  packed vs oneDNN prepacked (``kernels.autotune``'s candidates), with GFLOP/s: the roofline
  numerator on this CPU;
* ``bandwidth``: a large copy's GB/s, the roofline's denominator for memory-bound decode;
* ``decode``: one layer's paged decode attention (SmolLM2: 9 query heads, 3 KV heads, D=64,
  pages of 16) for B sequences of L tokens, fp32 pages in C, int4/int8 pages in C (fused
  dequant), and int4 through the torch path the engine used before (gather + dequant + SDPA);
  ``--decode-shapes`` picks the B x L, ``--baseline-ref REV`` adds the C kernels of git
  revision REV (fp32 and int4, same flags) as the "before" in the same run (REV must have
  this tree's ``cpu_native.ABI``: a build of another ABI refuses to load, e.g. one from
  before ABI 4, when the quantized decode kernel took its ``res_pages`` argument, before
  ABI 5, when the prefill kernel took row strides, or before ABI 7, when the two-run
  prefill kernel took its run A rotation);
* ``quantize``: full pages quantized into the pool, C vs the torch twin (+ scatter), per format;
* ``engine``: SmolLM2 through the engine, ``--engine-prompts`` prompts of 128 tokens and
  ``--engine-tokens`` greedy tokens each, submitted together, for each KV cache format of
  ``--engine-formats`` and GEMM mode of ``--gemm-modes`` (``kernels.autotune``), the configs
  run in turn for ``--engine-rounds`` rounds (best of each kept): output tokens/s, ratios to
  the first config, and whether greedy tokens equal the first config's;
* ``prefill``: cold time to first token of a ``--prefill-tokens`` (2,048) prompt at each
  prefill chunk size of ``--prefill-chunks`` (engines taking turns, ``--engine-rounds``), the
  GEMM each chunk runs, ``F.linear`` vs oneDNN at 512 and 2,048 rows (the tuner measures
  prefill sizes once, at ``autotune.prefill_tune_rows``), and a profile's GEMM / attention
  / rest split of one prefill;
* ``prefill_attn``: causal prefill attention of one layer at the engine's exact call (SmolLM2:
  q (1, 9, T, 64), k/v (1, 3, T, 64) fp32 views of the token-major tensors, ``is_causal``,
  ``enable_gqa``) for T in ``--prefill-attn-tokens`` (512, 1,024, 2,048): torch's SDPA vs
  kvmesh's C flash kernel (``kernels.cpu_attention.prefill_attention_cpu``, the build of
  ``--flags``) interleaved, with GFLOP/s (the unmasked half only: 4 * Hq * D * T(T+1)/2),
  the ratio SDPA time / C time, and the max abs difference between the two;
* ``prefill_ttft``: cold time to first token of a ``--prefill-tokens`` (2,048) prompt through
  two engines (one chunk), one whose fresh prefill attention is pinned to SDPA and one pinned
  to the C kernel (``KVMESH_PREFILL_ATTN``), taking turns for ``--engine-rounds`` rounds
  (median), with the ratio and whether the first token agrees.

Prints one JSON object on stdout.

    python bench/cpu_kernels.py [--parts gemm,bandwidth,decode,quantize,engine,prefill,
        prefill_attn,prefill_ttft]
        [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from machine import machine_info

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def interleaved(fns: dict, rounds: int) -> dict[str, float]:
    for f in fns.values():
        f()
    t = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            t[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in t.items()}


def bench_gemm(rounds: int) -> dict:
    from kvmesh.kernels.autotune import GemmTuner
    from kvmesh.kernels.cpu_linear import PackedLinear

    out = {}
    for name, (N, K) in SHAPES.items():
        w = torch.randn(N, K)
        lins = {
            m: PackedLinear(w, tuner=GemmTuner(None, mode=m)) for m in ("linear", "mkl", "onednn")
        }
        for M in (1, 8, 16, 32, 64, 256):
            x = torch.randn(M, K)
            t = interleaved({m: (lambda lin=lin, x=x: lin(x)) for m, lin in lins.items()}, rounds)
            best = min(t, key=t.get)
            out[f"{name} {M}x{K}->{N}"] = {
                **{f"{m}_us": round(v * 1e6, 1) for m, v in t.items()},
                "best": best,
                "best_gflops": round(2 * M * K * N / t[best] / 1e9, 1),
                "mkl_vs_linear": round(t["linear"] / t["mkl"], 2),
                "onednn_vs_linear": round(t["linear"] / t["onednn"], 2),
            }
    return out


def bench_bandwidth(rounds: int) -> dict:
    a = torch.randn(64 * 2**20 // 4)  # 64 MiB, well past the caches
    b = torch.empty_like(a)
    t = interleaved({"copy": lambda: b.copy_(a), "sum": lambda: a.sum()}, rounds)
    return {
        "copy_gb_s": round(2 * a.numel() * 4 / t["copy"] / 1e9, 2),  # read + write
        "read_gb_s": round(a.numel() * 4 / t["sum"] / 1e9, 2),
    }


def _decode_setup(fmt, B, L, Hkv=3, D=64, bs=16):
    from kvmesh.kernels.page_format import PageLayout
    from kvmesh.kernels.quant import quantize_pages

    layout = PageLayout(fmt, 1, Hkv, D, bs)
    pages = B * (-(-L // bs)) + 1
    buf = layout.allocate(pages)
    views = layout.views(buf, 0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(pages - 1, generator=g) + 1
    k = torch.randn(pages - 1, bs, Hkv, D, generator=g)
    v = torch.randn(pages - 1, bs, Hkv, D, generator=g)
    if layout.quantized:
        for n, t in quantize_pages(fmt, k, v).items():
            views[n][ids] = t
    else:
        views["k"][ids], views["v"][ids] = k, v
    P = -(-L // bs)
    tables = ids[: B * P].view(B, P).contiguous()
    lens = torch.full((B,), L, dtype=torch.int64)
    res = torch.zeros(B, bs, Hkv, D)
    return views, tables, lens, res


def baseline_library(ref: str, flags: tuple[str, ...]):
    """The C kernels as they were at git revision ``ref``, built with the same flags: the
    "before" of a kernel change, timed in the same run."""
    import subprocess

    from kvmesh.kernels import cpu_native

    root = Path(__file__).resolve().parents[1]
    src = Path(tempfile.mkdtemp(prefix="kvmesh-bench-base-"))
    for f in cpu_native.SOURCES:
        rel = f.relative_to(root).as_posix()
        show = ["git", "-C", str(root), "show", f"{ref}:{rel}"]
        (src / f.name).write_bytes(subprocess.run(show, capture_output=True, check=True).stdout)
    sources = cpu_native.SOURCES
    cpu_native.SOURCES = tuple(src / f.name for f in sources)
    try:
        path = cpu_native.compile_library(build_dir=src / "build", flags=flags)
    finally:
        cpu_native.SOURCES = sources
    return cpu_native.CpuLibrary(path)


def bench_decode(rounds: int, lib, layers: int, base=None, shapes=None) -> dict:
    """A decode step's attention over ``layers`` layers, each its own pool (as the engine's
    layers are): their KV together is past the L3 cache, so pages come from DRAM as they do
    in a step of the engine, not from a cache warmed by the call before. Each format is
    called as the engine calls it: fp32 through ``paged_decode_attention_cpu``, quantized
    pages through a ``QuantLayerDecoder`` per layer (checked once) and the step's
    ``DecodeIndices``."""
    from kvmesh.kernels.cpu_attention import (
        DecodeIndices,
        QuantLayerDecoder,
        paged_decode_attention_cpu,
    )
    from kvmesh.kernels.decode_attention import paged_decode_attention_torch

    out = {}
    for B, L in shapes or ((16, 512), (32, 1024), (1, 2048)):
        q = torch.randn(B, 9, 64)
        fns = {}
        for fmt in ("fp32", "int8", "int4"):
            kws = []
            for _ in range(layers):
                views, tables, lens, res = _decode_setup(fmt, B, L)
                kw = dict(q=q, fmt=fmt, cache=views, block_tables=tables, context_lens=lens)
                kw["scale"] = 0.125
                if fmt != "fp32":
                    kw.update(residual_k=res, residual_v=res, residual_slots=torch.full((B,), -1))
                kws.append(kw)

            def engine_call(kws, library, q=q):
                if kws[0]["fmt"] == "fp32":
                    return lambda: [paged_decode_attention_cpu(**kw, library=library) for kw in kws]
                calls = []
                for kw in kws:
                    dec = QuantLayerDecoder(
                        fmt=kw["fmt"], cache=kw["cache"], residual_k=kw["residual_k"],
                        residual_v=kw["residual_v"], library=library,
                    )  # fmt: skip
                    idx = DecodeIndices(
                        kw["block_tables"], kw["context_lens"], kw["residual_slots"],
                        bs=dec.bs, num_slots=dec.num_slots,
                    )  # fmt: skip
                    calls.append((dec, idx))
                return lambda: [dec.decode(q, idx, 0.125) for dec, idx in calls]

            fns[f"c_{fmt}"] = engine_call(kws, lib)
            if base is not None and fmt != "int8":
                fns[f"base_c_{fmt}"] = engine_call(kws, base)
            if fmt == "int4":

                def t(kws=kws):
                    for kw in kws:
                        paged_decode_attention_torch(**kw)

                fns["torch_int4"] = t
        t = interleaved(fns, rounds)
        row = {f"{k}_us": round(v * 1e6, 1) for k, v in t.items()}
        row["c_int4_vs_c_fp32"] = round(t["c_fp32"] / t["c_int4"], 3)
        row["c_int8_vs_c_fp32"] = round(t["c_fp32"] / t["c_int8"], 3)
        row["c_int4_vs_torch_int4"] = round(t["torch_int4"] / t["c_int4"], 2)
        if base is not None:
            row["base_c_int4_vs_base_c_fp32"] = round(t["base_c_fp32"] / t["base_c_int4"], 3)
        kv_bytes = layers * 2 * B * L * 3 * 64 * 4
        row["c_fp32_kv_gb_s"] = round(kv_bytes / t["c_fp32"] / 1e9, 2)
        out[f"B={B} L={L} x{layers} layers"] = row
    return out


def bench_quantize(rounds: int, lib) -> dict:
    from kvmesh.kernels.cpu_quant import quantize_pages_into
    from kvmesh.kernels.page_format import PageLayout
    from kvmesh.kernels.quant import quantize_pages

    out = {}
    for fmt in ("int8", "fp8", "int4"):
        for n in (2, 32):
            layout = PageLayout(fmt, 1, 3, 64, 16)
            views = layout.views(layout.allocate(64), 0)
            ids = torch.randperm(63)[:n] + 1
            k, v = torch.randn(n, 16, 3, 64), torch.randn(n, 16, 3, 64)

            def twin(fmt=fmt, k=k, v=v, views=views, ids=ids):
                for name, t in quantize_pages(fmt, k, v).items():
                    views[name][ids] = t

            def c(fmt=fmt, k=k, v=v, views=views, ids=ids):
                quantize_pages_into(fmt, k, v, views, ids, library=lib)

            t = interleaved({"torch": twin, "c": c}, rounds)
            out[f"{fmt} {n} pages"] = {
                "torch_us": round(t["torch"] * 1e6, 1),
                "c_us": round(t["c"] * 1e6, 1),
                "c_vs_torch": round(t["torch"] / t["c"], 1),
            }
    return out


def bench_engine(args) -> dict:
    from kvmesh.kernels import autotune
    from kvmesh.worker import LLM, SamplingParams

    text = (
        Path(__file__).resolve().parents[1].parent / "shared/data/tinyshakespeare.txt"
    ).read_text()
    configs = [(f, m) for f in args.engine_formats.split(",") for m in args.gemm_modes.split(",")]
    llms, prompts = {}, None
    for fmt, mode in configs:
        os.environ["KVMESH_GEMM"] = mode
        autotune.reset_default_tuners()  # a fresh process tuner in this mode
        llm = LLM("smollm2-135m-instruct", kv_cache_dtype=fmt, kv_cache_memory="512MiB")
        if prompts is None:
            ids = llm.tokenizer.encode(text[:200_000])
            prompts = [ids[i * 128 : (i + 1) * 128] for i in range(args.engine_prompts)]
        warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        llm.generate([p[:64] for p in prompts], warm)  # tunes this mode's GEMM buckets
        llms[(fmt, mode)] = llm
    params = SamplingParams(max_tokens=args.engine_tokens, temperature=0.0, ignore_eos=True)
    best, tokens = {}, {}
    for _ in range(args.engine_rounds):
        for key, llm in llms.items():
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            dt = time.perf_counter() - t0
            best[key] = min(best.get(key, dt), dt)
            tokens[key] = [o.token_ids for o in outs]
    base = configs[0]
    n = len(prompts) * args.engine_tokens
    return {
        f"{fmt} gemm={mode}": {
            "out_tok_s": round(n / best[(fmt, mode)], 2),
            f"vs_{base[0]}_{base[1]}": round(best[base] / best[(fmt, mode)], 3),
            "same_tokens_as_base": sum(a == b for a, b in zip(tokens[(fmt, mode)], tokens[base])),
        }
        for fmt, mode in configs
    }


def _prefill_shares(llm, prompt) -> dict:
    """One cold prefill under torch.profiler: the share of its wall time in GEMMs, in
    attention (SDPA) and in the rest (the C elementwise kernels run through ctypes and show
    only as wall time outside both)."""
    from torch.profiler import ProfilerActivity, profile

    from kvmesh.worker import SamplingParams

    llm.reset_prefix_cache()
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        llm.generate([prompt], one)
        wall = time.perf_counter() - t0
    gemm = attn = 0.0
    for e in prof.key_averages():
        name = e.key.lower()
        us = e.self_cpu_time_total / 1e6
        if any(k in name for k in ("addmm", "aten::mm", "linear_pointwise", "mkl_linear")):
            gemm += us
        elif "attention" in name or "sdpa" in name:
            attn += us
    return {
        "wall_s": round(wall, 3),
        "gemm_share": round(gemm / wall, 3),
        "attention_share": round(attn / wall, 3),
        "rest_share": round(max(0.0, 1 - (gemm + attn) / wall), 3),
    }


def bench_prefill(args) -> dict:
    """Cold time to first token of a ``--prefill-tokens`` prompt at each prefill chunk size
    (``max_num_batched_tokens``) of ``--prefill-chunks``, the engines taking turns for
    ``--engine-rounds`` rounds (median kept); the GEMM each chunk's bucket runs (``auto``
    measures prefill sizes once, at ``autotune.prefill_tune_rows``) against ``F.linear`` /
    oneDNN timed at 512 and at 2,048 rows; the profile's split of one cold prefill at the
    largest chunk."""
    from kvmesh.kernels import autotune
    from kvmesh.worker import LLM, SamplingParams

    text = (
        Path(__file__).resolve().parents[1].parent / "shared/data/tinyshakespeare.txt"
    ).read_text()
    os.environ.pop("KVMESH_GEMM", None)  # the engine's default: auto over fp32 pages
    autotune.reset_default_tuners()
    chunks = [int(c) for c in args.prefill_chunks.split(",")]
    llms = {}
    for c in chunks:
        t0 = time.perf_counter()
        llms[c] = LLM("smollm2-135m-instruct", kv_cache_memory="160MiB", max_num_batched_tokens=c)
        print(f"prefill: engine chunk {c} built in {time.perf_counter() - t0:.1f}s", flush=True)
    ids = llms[chunks[0]].tokenizer.encode(text[len(text) // 2 :][: 16 * args.prefill_tokens])
    prompt = ids[: args.prefill_tokens]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times: dict[int, list[float]] = {c: [] for c in chunks}
    first: dict[int, list[int]] = {}
    for _ in range(args.engine_rounds):
        for c, llm in llms.items():
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            out = llm.generate([prompt], one)[0]
            times[c].append(time.perf_counter() - t0)
            first[c] = out.token_ids
    base = chunks[-1]
    med = {c: statistics.median(times[c]) for c in chunks}

    def choices(llm, c):
        layer = llm.engine.model.model.layers[0]
        lins = {"qkv": layer.self_attn.qkv, "o": layer.self_attn.o}
        lins.update(gate_up=layer.mlp.gate_up, down=layer.mlp.down)

        def b(lin):
            if c > autotune.MAX_TUNED_ROWS:
                return autotune.prefill_tune_rows(*lin.weight.shape)
            return autotune.bucket(c)

        return {name: lin.plan.get(b(lin)) for name, lin in lins.items()}

    res = {
        f"chunk {c}": {
            "ttft_cold_s": round(med[c], 3),
            "ttft_cold_all_s": [round(t, 3) for t in times[c]],
            f"vs_chunk_{base}": round(med[base] / med[c], 3),
            "gemm_choices": choices(llms[c], c),
            "same_first_token": first[c] == first[base],
        }
        for c in chunks
    }
    # is the winner at 512 rows also the winner at 2,048 (the tuner measures 2,048 for these)?
    from kvmesh.kernels.cpu_linear import PackedLinear

    rows = {}
    for name, (N, K) in SHAPES.items():
        w = torch.randn(N, K)
        lins = {
            m: PackedLinear(w, tuner=autotune.GemmTuner(None, mode=m)) for m in ("linear", "onednn")
        }
        for M in (512, 2048):
            x = torch.randn(M, K)
            t = interleaved({m: (lambda lin=lin, x=x: lin(x)) for m, lin in lins.items()}, 5)
            rows[f"{name} {M}x{K}->{N}"] = {
                **{f"{m}_ms": round(v * 1e3, 2) for m, v in t.items()},
                "onednn_vs_linear": round(t["linear"] / t["onednn"], 2),
                "best_gflops": round(2 * M * K * N / min(t.values()) / 1e9, 1),
            }
    res["gemm_512_vs_2048_rows"] = rows
    res["profile"] = _prefill_shares(llms[base], prompt)
    return res


def bench_prefill_attn(rounds: int, lib, tokens, Hq=9, Hkv=3, D=64) -> dict:
    import torch.nn.functional as F

    from kvmesh.kernels.cpu_attention import prefill_attention_cpu

    out = {}
    for T in tokens:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(T, Hq, D, generator=g)  # token-major, as the model hands them over
        k, v = torch.randn(T, Hkv, D, generator=g), torch.randn(T, Hkv, D, generator=g)
        o = torch.empty_like(q)
        qq, kk, vv = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        scale = D**-0.5

        def sdpa(qq=qq, kk=kk, vv=vv, o=o, scale=scale):
            r = F.scaled_dot_product_attention(
                qq, kk, vv, is_causal=True, scale=scale, enable_gqa=True
            )
            o.copy_(r[0].transpose(0, 1))  # the engine's copy back to token-major

        def c(q=q, k=k, v=v, o=o, scale=scale):
            prefill_attention_cpu(q, k, v, scale, out=o, library=lib)

        t = interleaved({"sdpa": sdpa, "c": c}, rounds)
        sdpa()
        ref = o.clone()
        c()
        flop = 4 * Hq * D * T * (T + 1) / 2
        out[str(T)] = {
            **{f"{n}_ms": round(x * 1e3, 2) for n, x in t.items()},
            **{f"{n}_gflops": round(flop / x / 1e9, 1) for n, x in t.items()},
            "c_vs_sdpa": round(t["sdpa"] / t["c"], 2),
            "max_abs_diff": float((o - ref).abs().max()),
        }
    return out


def bench_prefill_ttft(args) -> dict:
    from kvmesh.kernels import autotune, prefill_tune
    from kvmesh.worker import LLM, SamplingParams

    text = (
        Path(__file__).resolve().parents[1].parent / "shared/data/tinyshakespeare.txt"
    ).read_text()
    os.environ.pop("KVMESH_GEMM", None)  # the engine's default: auto over fp32 pages
    autotune.reset_default_tuners()
    n = args.prefill_tokens
    llms = {}
    for mode in ("sdpa", "c"):
        os.environ["KVMESH_PREFILL_ATTN"] = mode
        prefill_tune._tuner = None  # each engine's backends keep the tuner they were built with
        llms[mode] = LLM(
            "smollm2-135m-instruct", kv_cache_memory="160MiB", max_num_batched_tokens=n
        )
    os.environ.pop("KVMESH_PREFILL_ATTN")
    prefill_tune._tuner = None
    ids = llms["sdpa"].tokenizer.encode(text[len(text) // 2 :][: 16 * n])
    prompt = ids[:n]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times: dict[str, list[float]] = {m: [] for m in llms}
    first = {}
    for _ in range(args.engine_rounds + 1):  # the first round warms both up, not kept
        for m, llm in llms.items():
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            first[m] = llm.generate([prompt], one)[0].token_ids
            times[m].append(time.perf_counter() - t0)
    med = {m: statistics.median(t[1:]) for m, t in times.items()}
    return {
        "tokens": n,
        **{f"{m}_ttft_s": round(med[m], 3) for m in llms},
        **{f"{m}_all_s": [round(t, 3) for t in times[m][1:]] for m in llms},
        "c_vs_sdpa": round(med["sdpa"] / med["c"], 3),
        "same_first_token": first["sdpa"] == first["c"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="gemm,bandwidth,decode,quantize")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--layers", type=int, default=8, help="decode: layers (pools) a step reads")
    ap.add_argument(
        "--decode-shapes", default="16x512,32x1024,1x2048", help="decode: B x L, comma list"
    )
    ap.add_argument(
        "--baseline-ref",
        default=None,
        help="decode: also time the C kernels of this git revision (e.g. HEAD~3), same flags",
    )
    ap.add_argument("--flags", default="native", choices=("native", "avx2", "portable"))
    ap.add_argument("--engine-formats", default="fp32,int4")
    ap.add_argument("--gemm-modes", default="exact")
    ap.add_argument("--engine-prompts", type=int, default=16)
    ap.add_argument("--engine-tokens", type=int, default=32)
    ap.add_argument("--engine-rounds", type=int, default=2)
    ap.add_argument("--prefill-chunks", default="512,1024,2048", help="prefill: chunk sizes")
    ap.add_argument("--prefill-tokens", type=int, default=2048, help="prefill: prompt tokens")
    ap.add_argument("--prefill-attn-tokens", default="512,1024,2048", help="prefill_attn: T")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from kvmesh.kernels import cpu_native

    flags = {
        "native": cpu_native.NATIVE_FLAGS,
        "avx2": cpu_native.AVX2_FLAGS,
        "portable": cpu_native.PORTABLE_FLAGS,
    }[args.flags]
    lib = cpu_native.CpuLibrary(
        cpu_native.compile_library(
            build_dir=Path(tempfile.gettempdir()) / "kvmesh-bench-kernels", flags=flags
        )
    )
    parts = args.parts.split(",")
    res = {"machine": machine_info(), "torch_threads": torch.get_num_threads()}
    res["kernel_vector_bits"] = lib.vector_bits
    res["loadavg_at_start"] = round(os.getloadavg()[0], 2)
    if "gemm" in parts:
        res["gemm"] = bench_gemm(args.rounds)
    if "bandwidth" in parts:
        res["bandwidth"] = bench_bandwidth(args.rounds)
    if "decode" in parts:
        base = baseline_library(args.baseline_ref, flags) if args.baseline_ref else None
        shapes = [tuple(map(int, x.split("x"))) for x in args.decode_shapes.split(",")]
        res["decode"] = bench_decode(args.rounds, lib, args.layers, base, shapes)
        res["decode_baseline_ref"] = args.baseline_ref
    if "quantize" in parts:
        res["quantize"] = bench_quantize(args.rounds, lib)
    if "engine" in parts:
        res["engine"] = bench_engine(args)
    if "prefill" in parts:
        res["prefill"] = bench_prefill(args)
    if "prefill_attn" in parts:
        tokens = [int(x) for x in args.prefill_attn_tokens.split(",")]
        res["prefill_attn"] = bench_prefill_attn(args.rounds, lib, tokens)
    if "prefill_ttft" in parts:
        res["prefill_ttft"] = bench_prefill_ttft(args)
    res["loadavg_at_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
