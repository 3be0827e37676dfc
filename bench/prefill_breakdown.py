"""Where a cold prefill's time goes, per op: each GEMM shape, causal attention, the KV cache
write, the fused elementwise C ops, embedding and rotary tables, the LM head, and what is
left outside the model (scheduling, sampling, Python).

One engine (SmolLM2, fp32 pages, one chunk of ``--tokens``), ``--rounds`` cold prefills of
the same prompt after one warm-up; every op is timed by a wrapper around its call, by wall
clock and by the process's CPU time (all threads: a 2-thread op that keeps both cores busy
shows ~2x its wall time; an OpenMP thread spinning at a barrier counts too). Reports the
per-op median over rounds, its share of the TTFT and GFLOP/s where the FLOPs are known.

    python bench/prefill_breakdown.py [--tokens 2048] [--rounds 5] [--threads 2]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from machine import machine_info

_acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])


def _timed(name_of, fn):
    def wrapper(*a, **kw):
        w0, c0 = time.perf_counter(), time.process_time()
        r = fn(*a, **kw)
        e = _acc[name_of(*a, **kw)]
        e[0] += time.perf_counter() - w0
        e[1] += time.process_time() - c0
        e[2] += 1
        return r

    return wrapper


def instrument(llm) -> None:
    """Wrap the ops of one engine (module attributes the model looks up at call time)."""
    from kvmesh.kernels import cpu_attention, cpu_linear, cpu_ops

    model = llm.engine.model
    layer = model.model.layers[0]
    shapes = {}
    a, m = layer.self_attn, layer.mlp
    for name, lin in (("qkv", a.qkv), ("o", a.o), ("gate_up", m.gate_up), ("down", m.down)):
        shapes[tuple(lin.weight.shape)] = f"gemm {name}"
    shapes[tuple(model.head.weight.shape)] = "lm_head"

    orig_call = cpu_linear.PackedLinear.__call__
    cpu_linear.PackedLinear.__call__ = _timed(
        lambda self, x: shapes.get(tuple(self.weight.shape), "gemm other"), orig_call
    )
    for fname in ("rmsnorm_cpu", "add_rmsnorm_cpu", "rotary_cpu_", "silu_mul_cpu"):
        setattr(cpu_ops, fname, _timed(lambda *a, n=fname, **k: n[:-4], getattr(cpu_ops, fname)))
    cpu_attention.prefill_attention_cpu = _timed(
        lambda *a, **k: "attention (C)", cpu_attention.prefill_attention_cpu
    )
    import torch.nn.functional as F

    F.scaled_dot_product_attention = _timed(
        lambda *a, **k: "attention (SDPA)", F.scaled_dot_product_attention
    )
    backend = llm.engine.runner.backend
    backend.forward = _timed(lambda *a, **k: "attention backend (all)", backend.forward)
    emb = model.model.embed_tokens
    emb.forward = _timed(lambda *a, **k: "embedding", emb.forward)
    rot = model.model.rotary_emb
    rot.forward = _timed(lambda *a, **k: "rotary tables", rot.forward)
    model.forward = _timed(lambda *a, **k: "model forward (all)", model.forward)
    runner = llm.engine.runner
    runner.execute = _timed(lambda *a, **k: "runner.execute (all)", runner.execute)


def flops(cfg, n: int) -> dict[str, float]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    nh, nkv, hd, L = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    return {
        "gemm qkv": 2 * n * h * (nh + 2 * nkv) * hd * L,
        "gemm o": 2 * n * nh * hd * h * L,
        "gemm gate_up": 2 * n * h * 2 * i * L,
        "gemm down": 2 * n * i * h * L,
        "lm_head": 2 * h * cfg.vocab_size,
        # the unmasked half: QK^T and PV, 2 FLOPs a multiply-add each
        "attention (C)": 4 * nh * hd * n * (n + 1) / 2 * L,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from kvmesh.worker import LLM, SamplingParams

    load0 = os.getloadavg()
    text = Path(__file__).resolve().parents[1].parent / "shared/data/tinyshakespeare.txt"
    text = (
        text.read_text()
        if text.exists()
        else Path("/work/shared/data/tinyshakespeare.txt").read_text()
    )
    llm = LLM("smollm2-135m-instruct", kv_cache_memory="160MiB", max_num_batched_tokens=args.tokens)
    ids = llm.tokenizer.encode(text[len(text) // 2 :][: 16 * args.tokens])[: args.tokens]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([ids], one)  # warm-up
    instrument(llm)
    per_round: list[dict] = []
    ttft = []
    for _ in range(args.rounds):
        llm.reset_prefix_cache()
        _acc.clear()
        w0, c0 = time.perf_counter(), time.process_time()
        tok = llm.generate([ids], one)[0].token_ids
        ttft.append((time.perf_counter() - w0, time.process_time() - c0))
        per_round.append({k: tuple(v) for k, v in _acc.items()})
    fl = flops(llm.engine.model.config, args.tokens)
    med_wall = statistics.median(t[0] for t in ttft)
    med_cpu = statistics.median(t[1] for t in ttft)
    ops = {}
    for name in per_round[0]:
        w = statistics.median(r[name][0] for r in per_round)
        c = statistics.median(r[name][1] for r in per_round)
        row = {
            "wall_ms": round(w * 1e3, 1),
            "cpu_ms": round(c * 1e3, 1),
            "calls": per_round[0][name][2],
            "share_of_ttft_wall": round(w / med_wall, 4),
        }
        if name in fl and w > 0:
            row["gflops_wall"] = round(fl[name] / w / 1e9, 1)
        ops[name] = row
    print(
        json.dumps(
            {
                "machine": machine_info(),
                "torch_threads": torch.get_num_threads(),
                "tokens": args.tokens,
                "loadavg_start": load0,
                "loadavg_end": os.getloadavg(),
                "ttft_wall_s": round(med_wall, 3),
                "ttft_cpu_s": round(med_cpu, 3),
                "ttft_all": [(round(a, 3), round(b, 3)) for a, b in ttft],
                "first_token": tok,
                "ops": ops,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
