"""What one layer of a decode-only step costs in the attention backend, per KV cache format:
the backend's ``forward`` (the KV write, the decode attention, int4's rotations, the Python
around them) with the data cache-hot, without the GEMMs or the rest of the model.

For each format of ``--formats`` an engine (SmolLM2) runs ``--prompts`` greedy requests
(prompt i has ``--prompt-tokens`` + 3 i tokens, ``--new-tokens`` new ones); the last
decode-only call of its backend's ``forward`` (the last layer, the last step with no prefill
chunk) is kept, then replayed: ``--rounds`` times ``prepare`` and ``--calls`` calls of
``forward`` on that layer (rewriting the same tokens into the same slots, so the cache does
not change). Reports the fastest round's time per call and each format's ratio to the first
format's. The "before" of a change: the same command with ``PYTHONPATH`` pointing at an
export of the older commit.

    python bench/backend_layer.py [--threads 1] [--formats auto,int4] [--rounds 9]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from machine import machine_info


def last_decode_call(fmt: str, args) -> tuple:
    """Run the workload on a fresh engine; return its backend and the arguments of the last
    ``forward`` call of a step without a prefill chunk: (backend, meta, q, k, v, cache, scale)."""
    from kvmesh.worker import LLM, SamplingParams

    llm = LLM(
        "smollm2-135m-instruct",
        kv_cache_dtype=fmt,
        kv_cache_memory="512MiB",
        max_num_batched_tokens=256,
        enable_prefix_caching=False,
    )
    backend = llm.engine.runner.backend
    forward = backend.forward
    kept = {}

    def keep_decode_calls(q, k, v, cache, scale):
        if not backend._meta.prefills:
            kept["call"] = (backend._meta, q.clone(), k.clone(), v.clone(), cache, scale)
        return forward(q, k, v, cache, scale)

    backend.forward = keep_decode_calls
    prompts = [[1 + i + j for j in range(args.prompt_tokens + 3 * i)] for i in range(args.prompts)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params)
    del backend.forward  # the class's method again
    assert "call" in kept, "the workload had no decode-only step"
    return (backend, *kept["call"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--formats", default="auto,int4", help="kv_cache_dtype values")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=120)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=30, help="forward calls a round (a step's layers)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()
    rounds_us = {}
    for fmt in args.formats.split(","):
        backend, meta, q, k, v, cache, scale = last_decode_call(fmt, args)
        torch.set_num_threads(args.threads)  # the engine may have set its own
        times = []
        with torch.inference_mode():
            backend.prepare(meta)
            backend.forward(q, k, v, cache, scale)  # warm-up
            for _ in range(args.rounds):
                backend.prepare(meta)
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    backend.forward(q, k, v, cache, scale)
                times.append((time.perf_counter() - t0) / args.calls)
        rounds_us[fmt] = [round(t * 1e6, 1) for t in times]
        del backend, meta, cache
    best = {f: min(t) for f, t in rounds_us.items()}
    first = next(iter(best.values()))
    print(
        json.dumps(
            {
                "machine": machine_info(),
                "torch_threads": args.threads,
                "loadavg_start": load0,
                "loadavg_end": os.getloadavg(),
                "decode_sequences": args.prompts,
                "forward_us_per_layer": best,
                "cost_vs_first_format": {f: round(t / first, 3) for f, t in best.items()},
                "rounds_us": rounds_us,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
