"""KV eviction policies on SmolLM2: quality against budget, a needle test, throughput, and
what collecting attention weights costs.

Held-out text: the GNU GPL v3 as Debian ships it (``/usr/share/common-licenses/GPL-3``, in
``base-files``). SnapKV variants are chosen on tinyshakespeare (``eviction_reference.py
explore``); this text only reports them.

* ``ppl``: perplexity of a ``--continuation``-token continuation after a ``--context``-token
  context (default 256 after 1,536), for each policy and the ``random`` baseline at each
  ``--fractions`` of the context (default 12.5%, 25%, 50%), against the full cache in the
  same run. ``--ppl-mode context`` (default, the issue's setting and SnapKV's): the
  context's cache is compressed to the budget once, after the prompt, and the
  continuation's own K/V are kept (it is scored in teacher-forced chunks). ``whole``: the
  budget bounds the whole cache, the continuation's tokens evicted too once past
  ``budget + block_size``, exactly as in serving (stricter; one token a step through the
  engine's own step path: runner, then ``EvictionManager.after_step``).
* ``needle``: ``--needles`` facts ("The pass code of NAME is NUMBER.") at depths spread
  over a ``--needle-context``-token filler, the question at the end; greedy answer, right
  when the number appears in the first 8 tokens. Full cache and each policy at
  ``--needle-fractions`` (default 10%, 25%), every configuration on one needle before the
  next (so the prefix cache saves the full cache's prefill for the policies that observe
  only a window); accuracy per depth too. ``--needle-shard i/n`` splits a run over
  processes (the JSON carries each needle's hits to merge).
* ``throughput``: ``--tput-requests`` prompts of ``--tput-prompt`` tokens (default 32 x
  2,048) with ``--tput-new`` output tokens, in a ``--pool`` pool (default 1 GiB): full
  cache against SnapKV at 25%, output tokens/s and the ratio; and ``full_fit``, the full
  cache with ``max_num_seqs`` capped so that it never preempts (``ratio_vs_full_fit``).
* ``weights_cost``: decode with H2O at a budget it never reaches (it collects every query's
  attention weights, evicts nothing) against no budget: the price of the weights alone.

Prints one JSON object on stdout; progress on stderr. ``--parts`` picks what runs.

    python bench/eviction.py --parts ppl,needle,throughput,weights_cost
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
from machine import machine_info

from kvmesh.worker import LLM, SamplingParams

GPL = Path("/usr/share/common-licenses/GPL-3")
SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
TEXTS = {"gpl": GPL, "shakespeare": SHAKESPEARE}  # held-out / the tuning text
POLICIES = ("snapkv", "h2o", "streaming", "scissorhands", "random")


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def continuation_nll(llm: LLM, ctx: list[int], cont: list[int], budget, policy, mode) -> float:
    """Mean NLL (nats) of ``cont`` after ``ctx``, the cache under ``budget`` by ``policy``.

    ``mode="context"``: the context's cache is compressed to the budget once, after the
    prompt (the issue's and SnapKV's setting); the continuation's own K/V are then all kept
    and it is scored in one teacher-forced step. ``mode="whole"``: the budget bounds the
    whole cache, continuation included, as in serving (one token a step, re-evicted past
    ``budget + block_size``)."""
    eng = llm.engine
    params = SamplingParams(max_tokens=1, kv_budget=budget, kv_policy=policy if budget else None)
    req = eng.make_request(ctx, params)
    chunk = eng.scheduler_config.max_num_batched_tokens
    nll = 0.0
    try:
        while req.num_computed_tokens < req.num_tokens:
            n = min(chunk, req.num_tokens - req.num_computed_tokens)
            assert eng.kv.allocate_slots(req, n) is not None, "pool too small"
            _, logits = eng.runner.execute([(req, n)])
            req.num_computed_tokens += n
            eng.eviction.after_step([(req, n)])
        if mode == "context":
            if budget:  # compressed once: no eviction of the continuation's own tokens
                req.kv_budget = 10**9
            first = logits[-1]
            for tok in cont:
                req.append_token(tok)
            done = 0
            lps = [torch.log_softmax(first.float(), -1)[cont[0]].item()]
            while done < len(cont) - 1:  # the last token's logits predict nothing scored
                n = min(chunk, len(cont) - 1 - done)
                assert eng.kv.allocate_slots(req, n) is not None, "pool too small"
                _, lg = eng.runner.execute([(req, n)], all_logits=True)
                req.num_computed_tokens += n
                tgt = torch.tensor(cont[done + 1 : done + 1 + n])
                lps += torch.log_softmax(lg.float(), -1)[torch.arange(n), tgt].tolist()
                done += n
            return -sum(lps) / len(cont)
        for tok in cont:
            nll -= torch.log_softmax(logits[-1].float(), -1)[tok].item()
            req.append_token(tok)
            assert eng.kv.allocate_slots(req, 1) is not None, "pool too small"
            _, logits = eng.runner.execute([(req, 1)])
            req.num_computed_tokens += 1
            eng.eviction.after_step([(req, 1)])
    finally:
        eng.kv.free(req)
    return nll / len(cont)


def bench_ppl(llm: LLM, ids: list[int], args) -> dict:
    """Perplexity per window (``--ppl-windows`` disjoint spans of context + continuation,
    from ``--offset``): each row has every window's perplexity and ratio to the full cache
    on the same window, their mean and spread, and the pooled perplexity (exp of the mean
    NLL over all windows' tokens)."""
    C, N = args.context, args.continuation
    starts = range(args.offset, len(ids) - C - N + 1, C + N)
    windows = [ids[i : i + C + N] for i in starts][: args.windows]
    assert windows, f"text too short for one window of {C} + {N} tokens from {args.offset}"
    rows = {}

    def ppl(budget, policy, label) -> list[float]:
        t0 = time.monotonic()
        nlls = []
        for w in windows:
            nlls.append(continuation_nll(llm, w[:C], w[C:], budget, policy, args.ppl_mode))
            log(
                f"ppl {label} window {len(nlls)}/{len(windows)}: {math.exp(nlls[-1]):.3f} "
                f"({time.monotonic() - t0:.0f}s, load {os.getloadavg()[0]:.1f})"
            )
        return nlls

    full = ppl(None, None, "full")
    full_w = [math.exp(x) for x in full]
    full_pooled = math.exp(sum(full) / len(full))
    variants = args.snapkv or [None]
    for frac in args.fractions:
        budget = max(8, int(C * frac))
        for policy in args.policies:
            for spec in variants if policy == "snapkv" else [None]:
                label = f"{policy}@{frac:g}" if spec is None else f"snapkv[{spec}]@{frac:g}"
                if spec is not None:
                    use_snapkv_variant(spec)
                nlls = ppl(budget, policy, label)
                per = [math.exp(x) for x in nlls]
                ratios = [p / f - 1 for p, f in zip(per, full_w)]
                mean = sum(ratios) / len(ratios)
                sd = (sum((r - mean) ** 2 for r in ratios) / max(1, len(ratios) - 1)) ** 0.5
                pooled = math.exp(sum(nlls) / len(nlls))
                rows[label] = {
                    "budget": budget,
                    "ppl": round(pooled, 4),  # pooled over the windows' tokens
                    "vs_full": round(pooled / full_pooled - 1, 4),
                    "per_window_ppl": [round(x, 4) for x in per],
                    "per_window_vs_full": [round(x, 4) for x in ratios],
                    "vs_full_mean": round(mean, 4),
                    "vs_full_sd": round(sd, 4),
                    "vs_full_min": round(min(ratios), 4),
                    "vs_full_max": round(max(ratios), 4),
                }
                log(f"ppl {label}: {rows[label]}")
    return {
        "context": C,
        "continuation": N,
        "mode": args.ppl_mode,
        "windows": len(windows),
        "window_starts": list(starts)[: len(windows)],
        "offset": args.offset,
        "full_ppl": round(full_pooled, 4),
        "full_per_window_ppl": [round(x, 4) for x in full_w],
        "rows": rows,
    }


NAMES = ["Alice", "Boris", "Chen", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ines", "Jonas"]


def needle_cases(tok, ids: list[int], n: int, T: int, seed: int = 0) -> list:
    """``n`` prompts of about ``T`` tokens: a fact ("The pass code of NAME is NUMBER.") at a
    depth of 5-95% of a filler cut from ``ids``, the question at the end. Returns
    (prompt ids, code, depth) per needle."""
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        name = f"{NAMES[i % len(NAMES)]} {chr(65 + i // len(NAMES) % 26)}."
        code = str(rng.randrange(10_000, 100_000))
        depth = (i % 5) / 4 * 0.9 + 0.05  # 5%, 27.5%, 50%, 72.5%, 95%
        needle = tok.encode(f" The pass code of {name} is {code}. ")
        question = tok.encode(
            f"\n\nQuestion: what is the pass code of {name}? Answer: the pass code of {name} is"
        )
        n_fill = T - len(needle) - len(question)
        start = rng.randrange(0, len(ids) - n_fill)
        filler = ids[start : start + n_fill]
        at = int(depth * n_fill)
        cases.append((filler[:at] + needle + filler[at:] + question, code, depth))
    return cases


def bench_needle(llm: LLM, ids: list[int], args) -> dict:
    """Needle accuracy: every configuration (full cache, each policy at each budget) runs
    on one needle before the next needle, so the full cache's pages are still in the prefix
    cache: a policy recomputes only the queries it observes (SnapKV its window, H2O the
    whole prompt; see ``Request.max_cached_pages``)."""
    T = args.needle_context
    cases = needle_cases(llm.tokenizer, ids, args.needles, T)
    shard, shards = (int(x) for x in args.needle_shard.split("/"))
    cases = cases[shard::shards][args.needle_skip :]
    configs = [("full", None, None)]
    for frac in args.needle_fractions:
        budget = max(8, int(T * frac))
        configs += [(f"{policy}@{frac:g}", budget, policy) for policy in args.policies]
    hits = {label: [] for label, _, _ in configs}
    t0 = time.monotonic()
    for i, (prompt, code, _) in enumerate(cases):
        for label, budget, policy in configs:
            params = SamplingParams(
                temperature=0, max_tokens=8, kv_budget=budget, kv_policy=policy if budget else None
            )
            hits[label].append(code in llm.generate([prompt], params)[0].text)
        acc = {label: sum(h) for label, h in hits.items()}
        log(f"needle {i + 1}/{len(cases)} ({time.monotonic() - t0:.0f}s) hits so far: {acc}")
    depths = sorted({d for _, _, d in cases})

    def row(label: str, budget) -> dict:
        h = hits[label]
        by_depth = {
            f"{d:g}": round(
                sum(x for x, c in zip(h, cases) if c[2] == d) / sum(c[2] == d for c in cases), 4
            )
            for d in depths
        }
        return {"budget": budget, "accuracy": round(sum(h) / len(h), 4), "by_depth": by_depth}

    full = row("full", None)
    rows = {}
    for label, budget, _ in configs[1:]:
        r = row(label, budget)
        r["vs_full"] = round(r["accuracy"] / full["accuracy"], 4) if full["accuracy"] else None
        rows[label] = r
    return {
        "context": T,
        "needles": len(cases),
        "full_accuracy": full["accuracy"],
        "full_by_depth": full["by_depth"],
        "rows": rows,
        "shard": args.needle_shard,
        "skipped": args.needle_skip,
        "hits": {label: [int(x) for x in h] for label, h in hits.items()},
        "depth": [c[2] for c in cases],
    }


def run_batch(llm: LLM, prompts: list, params: SamplingParams, label: str) -> list:
    """``llm.generate``'s loop, with a progress line per finished request."""
    eng = llm.engine
    reqs = [eng.make_request(p, params) for p in prompts]
    for r in reqs:
        eng.add(r, check_queue=False)
    final, t0 = {}, time.monotonic()
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
                log(
                    f"throughput {label}: {len(final)}/{len(reqs)} done "
                    f"({time.monotonic() - t0:.0f}s, load {os.getloadavg()[0]:.1f})"
                )
    return [final[r.request_id] for r in reqs]


def bench_throughput(args, ids: list[int]) -> dict:
    out = {}
    prompts = [ids[i * 97 : i * 97 + args.tput_prompt] for i in range(args.tput_requests)]
    assert all(len(p) == args.tput_prompt for p in prompts), "text too short for the prompts"
    tokens = {}
    # full_fit: the full cache admitting only as many requests as the pool holds at their
    # final length (prompt + output), so it never preempts: the best a static
    # max_num_seqs can do for the full cache, where the default admission overcommits the
    # pool and preempts (recomputing whole prompts) once the admitted requests grow
    configs = {"full": None, "full_fit": None, "snapkv@0.25": args.tput_prompt // 4}
    for label, budget in configs.items():
        if label.split("@")[0] not in args.tput_configs.split(","):
            continue
        kw = dict(
            kv_cache_memory=args.pool,
            max_num_batched_tokens=args.chunk,
            enable_prefix_caching=False,
        )
        if label == "full_fit":
            probe = LLM("smollm2-135m-instruct", **kw)
            pages, bs = probe.engine.stats().num_pages, probe.engine.cache_config.block_size
            probe.close()
            del probe
            kw["max_num_seqs"] = max(1, pages // -(-(args.tput_prompt + args.tput_new) // bs))
        llm = LLM("smollm2-135m-instruct", **kw)
        params = SamplingParams(
            temperature=0,
            max_tokens=args.tput_new,
            ignore_eos=True,
            kv_budget=budget,
            kv_policy="snapkv" if budget else None,
        )
        load0 = os.getloadavg()
        t0 = time.monotonic()
        outs = run_batch(llm, prompts, params, label)
        dt = time.monotonic() - t0
        tokens[label] = [list(o.token_ids) for o in outs]
        n_out = sum(len(t) for t in tokens[label])
        s = llm.engine.stats()
        out[label] = {
            "seconds": round(dt, 2),
            "output_tokens_per_s": round(n_out / dt, 2),
            "num_pages": s.num_pages,
            "preemptions": s.num_preemptions,
            "max_num_seqs": llm.engine.scheduler_config.max_num_seqs,
            "errors": sum(o.finish_reason == "error" for o in outs),
            "load_start": [round(x, 2) for x in load0],
            "load_end": [round(x, 2) for x in os.getloadavg()],
        }
        log(f"throughput {label}: {out[label]}")
        llm.close()
        del llm
    out.update(
        requests=args.tput_requests, prompt=args.tput_prompt, new=args.tput_new, pool=args.pool
    )
    out["output_token_ids"] = tokens  # to merge runs split with --tput-configs
    if "full" in tokens and "full_fit" in tokens:  # the same model, batched differently
        out["full_fit_outputs_equal_full"] = sum(
            a == b for a, b in zip(tokens["full"], tokens["full_fit"])
        )
    if "snapkv@0.25" not in out:
        return out
    for base, key in (("full", "ratio"), ("full_fit", "ratio_vs_full_fit")):
        if base in out:
            out[key] = round(
                out["snapkv@0.25"]["output_tokens_per_s"] / out[base]["output_tokens_per_s"], 3
            )
    base = "full" if "full" in tokens else "full_fit" if "full_fit" in tokens else None
    if base is None:
        return out
    # a 25% budget changes what the model sees, so equal outputs are not expected: how many
    # of SnapKV's greedy outputs are still the full cache's, token for token, and how many
    # leading tokens agree on average
    full, snap = tokens[base], tokens["snapkv@0.25"]
    out["snapkv_outputs_base"] = base
    out["snapkv_outputs_equal_full"] = sum(a == b for a, b in zip(full, snap))
    common = [
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        for a, b in zip(full, snap)
    ]
    out["snapkv_mean_common_prefix"] = round(sum(common) / len(common), 2)
    return out


_MAKE_POLICY = None  # the engine's make_policy, before use_snapkv_variant replaces it


def use_snapkv_variant(spec: str) -> dict:
    """Every ``snapkv`` request of this process from now on gets ``SnapKV(budget,
    **variant)`` (``spec``: ``window=64,kernel=13,pool=max,recent=0.5,sinks=4``, or
    ``default``). The API sets only the budget and the policy, so this bench-only hook
    replaces ``make_policy`` where the engine builds policies (the manager) and where the
    prefix-cache limit asks (``first_observed``), to compare variants through the engine.
    Called again, the new variant replaces the last."""
    global _MAKE_POLICY
    from kvmesh.worker.eviction import manager, policies

    kw = {}
    for item in spec.split(","):
        if item == "default":
            continue
        k, _, v = item.partition("=")
        kw[k] = v if k == "pool" else float(v) if k == "recent" else int(v)
    policies.SnapKV(64, **kw)  # bad names or values fail here, before anything runs
    if _MAKE_POLICY is None:
        _MAKE_POLICY = policies.make_policy
    base = _MAKE_POLICY

    def make(name: str, budget: int):
        return policies.SnapKV(budget, **kw) if name == "snapkv" else base(name, budget)

    manager.make_policy = make
    policies.make_policy = make
    return kw


def bench_weights_cost(llm: LLM, ids: list[int], args) -> dict:
    prompts = [ids[i * 50 : i * 50 + 256] for i in range(args.wc_prompts)]
    out = {}
    for label, kw in (("none", {}), ("h2o_weights", {"kv_budget": 10**6, "kv_policy": "h2o"})):
        params = SamplingParams(temperature=0, max_tokens=args.wc_new, ignore_eos=True, **kw)
        llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm
        t0 = time.monotonic()
        outs = llm.generate(prompts, params)
        dt = time.monotonic() - t0
        out[label] = round(sum(len(o.token_ids) for o in outs) / dt, 2)
        log(f"weights_cost {label}: {out[label]} tok/s")
    out["ratio"] = round(out["h2o_weights"] / out["none"], 3)
    return {
        "output_tokens_per_s": out,
        "prompts": args.wc_prompts,
        "prompt_tokens": 256,
        "new": args.wc_new,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="ppl,needle,throughput,weights_cost")
    ap.add_argument("--context", type=int, default=1536)
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument(
        "--windows",
        "--ppl-windows",
        type=int,
        default=1,
        help="ppl: disjoint windows of context + continuation from --offset (at most)",
    )
    ap.add_argument(
        "--text", default="gpl", help="gpl (held out, default), shakespeare (tuning) or a path"
    )
    ap.add_argument("--offset", type=int, default=0, help="first token of the ppl windows")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument(
        "--snapkv",
        nargs="+",
        help="SnapKV variants (window=..,kernel=..,pool=..,recent=..,sinks=..): one is used "
        "for the whole run; with several, the ppl part has a snapkv row for each",
    )
    ap.add_argument("--ppl-mode", choices=("context", "whole"), default="context")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.125, 0.25, 0.5])
    ap.add_argument("--needles", type=int, default=50)
    ap.add_argument("--needle-context", type=int, default=1024)
    ap.add_argument(
        "--needle-shard",
        default="0/1",
        help="i/n: run needles i, i+n, ... only (to split a run over processes)",
    )
    ap.add_argument(
        "--needle-skip",
        type=int,
        default=0,
        help="skip the shard's first K needles (to go on with a run that was stopped)",
    )
    ap.add_argument("--needle-fractions", type=float, nargs="+", default=[0.10, 0.25])
    ap.add_argument("--tput-requests", type=int, default=32)
    ap.add_argument("--tput-prompt", type=int, default=2048)
    ap.add_argument("--tput-new", type=int, default=64)
    ap.add_argument("--pool", default="1GiB")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument(
        "--tput-configs",
        default="full,full_fit,snapkv",
        help="full,full_fit,snapkv (default) or some of them; full_fit is the full cache with "
        "max_num_seqs capped at what the pool holds at the requests' final length",
    )
    ap.add_argument("--wc-prompts", type=int, default=8)
    ap.add_argument("--wc-new", type=int, default=64)
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if args.snapkv and len(args.snapkv) > 1 and parts != {"ppl"}:
        ap.error("several --snapkv variants: only with --parts ppl (one row each)")
    t0 = time.monotonic()
    text = Path(TEXTS.get(args.text, args.text))
    result = {
        "bench": "eviction",
        "machine": machine_info(),
        "load_start": [round(x, 2) for x in os.getloadavg()],
        "text": str(text),
        "parts": sorted(parts),
        "policies": args.policies,
        "snapkv_variants": [use_snapkv_variant(v) for v in args.snapkv or ["default"]],
    }
    llm = LLM(
        "smollm2-135m-instruct",
        dtype="float32",
        kv_cache_memory="512MiB",
        max_num_batched_tokens=args.chunk,
    )
    ids = llm.tokenizer.encode(text.read_text())
    result["text_tokens"] = len(ids)
    if "ppl" in parts:
        result["ppl"] = bench_ppl(llm, ids, args)
    if "needle" in parts:
        result["needle"] = bench_needle(llm, ids, args)
    if "weights_cost" in parts:
        result["weights_cost"] = bench_weights_cost(llm, ids, args)
    llm.close()
    del llm
    if "throughput" in parts:
        result["throughput"] = bench_throughput(args, ids)
    result["seconds"] = round(time.monotonic() - t0, 1)
    result["load_after"] = machine_info().get("loadavg_1m")
    result["load_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
