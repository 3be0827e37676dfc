"""The own-page prefill kernel's key block size on an int4 engine's real chunks (issue 21).
Prints one JSON object.

    .venv/bin/python bench/own_page_blocks.py [--prompt-tokens 1024] [--blocks 64,128,256]
        [--rounds 5] [--threads N]

An int4 engine (SmolLM2, prefill chunks of 256 tokens) prefills one prompt of
``--prompt-tokens``; every call of ``prefill_attention_runs_cpu`` is recorded (its q, both
runs and the ranges; int4 pages, which the engine hands the kernel as they lie in the
pool, are recorded dequantized, so the replay times the float run A). The first layer's
call of each chunk is then replayed with each ``block_k`` in turn, ``--rounds``
interleaved rounds, and the best round kept (wall ms for all chunks, at the process's torch
threads). ``max_abs_diff``: the largest difference of
any block size's output from the first one's (float rounding only: the kernel sums in
another order).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from machine import machine_info

import kvmesh.kernels.cpu_attention as cpu_attention
from kvmesh.worker import LLM, SamplingParams

TEXT = Path(__file__).resolve().parents[1].parent / "shared/data/tinyshakespeare.txt"
CHUNK = 256


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--blocks", default="64,128,256")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (its default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    blocks = [int(b) for b in args.blocks.split(",")]
    kernel = cpu_attention.prefill_attention_runs_cpu
    calls: list[tuple] = []

    def record(q, run_a, run_b, ranges, scale, **kw):
        if isinstance(run_a, cpu_attention.Int4Run):  # the pool's pages: kept dequantized
            views = run_a.views
            if isinstance(views, cpu_attention.Int4Pool):  # the engine's: checked once
                views = views.views
            n, (bs, H, D2) = run_a.pages.numel(), views["k"].shape[1:]
            a = [torch.empty(n * bs, H, 2 * D2) for _ in range(2)]
            cpu_attention.dequantize_int4_pages_cpu(views, run_a.pages, *a)
        else:
            a = [t.clone() for t in run_a]
        rot = kw.get("a_rotation")  # int4 with its rotations fused: run A's V turned back
        calls.append((q.clone(), a, [t.clone() for t in run_b], ranges.clone(), scale, rot))
        return kernel(q, run_a, run_b, ranges, scale, **kw)

    cpu_attention.prefill_attention_runs_cpu = record  # own_page_attention imports it per call
    llm = LLM(
        "smollm2-135m-instruct",
        kv_cache_dtype="int4",
        kv_cache_memory="512MiB",
        max_num_batched_tokens=CHUNK,
        enable_prefix_caching=False,
    )
    layers = llm.engine.model_config.num_layers
    calls.clear()  # the engine's start-up warm-up chunks
    ids = llm.tokenizer.encode(TEXT.read_text()[100_000 : 100_000 + 8 * args.prompt_tokens])
    if len(ids) < args.prompt_tokens:
        raise SystemExit(f"the text holds {len(ids)} tokens, {args.prompt_tokens} asked")
    llm.generate([ids[: args.prompt_tokens]], SamplingParams(max_tokens=1))
    cpu_attention.prefill_attention_runs_cpu = kernel
    if not calls:
        raise SystemExit("the engine made no own-page kernel call (SDPA chosen, or no C kernels)")
    chunks = calls[::layers]  # each chunk's first layer
    best = {b: float("inf") for b in blocks}
    for _ in range(args.rounds):
        for b in blocks:
            t0 = time.perf_counter()
            for q, a, bb, r, s, rot in chunks:
                kernel(q, a, bb, r, s, block_k=b, a_rotation=rot)
            best[b] = min(best[b], time.perf_counter() - t0)
    outs = {
        b: [kernel(q, a, bb, r, s, block_k=b, a_rotation=rot) for q, a, bb, r, s, rot in chunks]
        for b in blocks
    }
    diff = max(
        float((x - y).abs().max()) for b in blocks[1:] for x, y in zip(outs[blocks[0]], outs[b])
    ) if len(blocks) > 1 else 0.0  # fmt: skip
    print(
        json.dumps(
            {
                "prompt_tokens": args.prompt_tokens,
                "chunks": [
                    {"n": q.shape[0], "run_a_keys": a[0].shape[0], "run_b_keys": bb[0].shape[0]}
                    for q, a, bb, _, _, _ in chunks
                ],
                "threads": torch.get_num_threads(),
                "rounds": args.rounds,
                "best_ms": {str(b): round(t * 1e3, 3) for b, t in best.items()},
                "vs_first": {str(b): round(best[blocks[0]] / t, 3) for b, t in best.items()},
                "max_abs_diff": diff,
                "loadavg_1m": os.getloadavg()[0],
                "machine": machine_info(),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
