"""An independent SnapKV / H2O / StreamingLLM reference in transformers, to check kvmesh's
compacted engine against and to try selection variants fast.

Nothing here uses kvmesh's eviction code. transformers runs the prompt once with an eager
attention function of our own that records, per layer, each query head's attention rows;
the kept set is computed from them here (loop-simple code), and the continuation then runs
with a per-KV-head mask: a query after the prompt sees only the kept prompt slots (and the
tokens after the prompt). The prompt itself is computed with full attention, as in the
engine (the first answer token comes from the full prompt).

* ``check``: on the needle prompts and one perplexity window, kvmesh (``kv_policy=snapkv``)
  against this reference with the same parameters: the greedy answer tokens, the perplexity.
* ``explore``: SnapKV variants (window, pooling kernel, avg or max pooling, how a GQA group
  votes) on the tuning text, needle accuracy and perplexity per variant.
* ``budgets``: perplexity with counts that differ per KV head (Ada-KV) or per layer
  (PyramidKV; ``eviction_budgets.py``), and the oracle bounds: the slots the continuation's
  own queries attend to most (one pass over context + continuation records them).

    python eviction_reference.py check --needles 10 --needle-context 1024
    python eviction_reference.py explore --text tinyshakespeare
    python eviction_reference.py budgets --text gpl --offset 0 --windows 4 --fractions 0.25
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from eviction import GPL, needle_cases
from eviction_budgets import allocate, top_per_row
from transformers import AttentionInterface, AutoModelForCausalLM

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"

# --- the attention function: records the prompt's rows, masks the continuation per head

_REC: dict[int, tuple] = {}  # layer -> what the recorded pass saw (see ``_attention``)
_KEEP: dict[int, torch.Tensor] = {}  # layer -> (Hkv, P) bool: prompt slots kept per KV head
_KEEPQ: dict[int, torch.Tensor] = {}  # layer -> (Hkv, Tq, P) bool: kept per query (oracle)
_STATE = {"record": False, "prompt_len": 0, "per_query": False}
REC_ROWS = 128  # the largest observation window tried


def _attention(module, query, key, value, attention_mask, scaling, **kw):
    # query (1, Hq, Tq, D), key/value (1, Hkv, Tk, D); the Tq queries are the last Tq keys
    G = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(G, 1)
    v = value.repeat_interleave(G, 1)
    Tq, Tk = query.shape[2], key.shape[2]
    w = torch.matmul(query, k.transpose(2, 3)) * scaling  # (B, Hq, Tq, Tk)
    B, Hq = query.shape[:2]
    qpos = torch.arange(Tk - Tq, Tk)
    allowed = torch.arange(Tk)[None, :] <= qpos[:, None]  # causal (Tq, Tk)
    allowed = allowed[None, None].expand(B, Hq, Tq, Tk).clone()
    P = _STATE["prompt_len"]
    layer = module.layer_idx
    if layer in _KEEP:  # queries after the prompt see only the kept prompt slots
        keep = _KEEP[layer]  # (Hkv, P), or (B, Hkv, P): one kept set per batch row
        keep = (keep if keep.dim() == 3 else keep[None]).repeat_interleave(G, 1)  # (B|1, Hq, P)
        after = qpos >= P
        allowed[:, :, after, :P] &= keep[:, :, None, :]
    if layer in _KEEPQ:  # each query after the prompt its own kept prompt slots
        allowed[:, :, qpos >= P, :P] &= _KEEPQ[layer].repeat_interleave(G, 0)[None]
    w = w.masked_fill(~allowed, float("-inf")).softmax(-1)
    if _STATE["record"]:
        # the prompt's last REC_ROWS queries' rows over the prompt (SnapKV's window), the
        # prompt queries' column sums (H2O), and, when the pass runs on past the prompt
        # (``prefill_window``), the later queries' column sums over the prompt (the oracle)
        P = P or Tk
        a = w[0].detach()  # (Hq, Tk, Tk): this pass starts at position 0
        rec = (a[:, P - REC_ROWS : P, :P].clone(), a[:, :P, :P].sum(1))
        if Tk > P:
            rec += (a[:, P:, :P].sum(1), a[:, P:, :P].clone() if _STATE["per_query"] else None)
        _REC[layer] = rec
    return torch.matmul(w, v).transpose(1, 2).contiguous(), None


AttentionInterface.register("evref", _attention)


def load_model():
    from kvmesh.worker.models.loader import resolve_model

    src = resolve_model("smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(
        str(src.path.parent), gguf_file=src.path.name, dtype=torch.float32
    ).eval()
    model.set_attn_implementation("evref")
    return model


def prefill(model, ids: list[int]):
    """Full-attention pass over the prompt, recording every layer's attention. Returns the
    cache, the last logits, and the records (layer -> (Hq, P, P))."""
    _KEEP.clear()
    _REC.clear()
    _STATE.update(record=True, prompt_len=len(ids))
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    _STATE["record"] = False
    rec = dict(_REC)
    _REC.clear()
    return out.past_key_values, out.logits[0], rec


def prefill_window(model, ctx: list[int], cont: list[int], per_query: bool = False):
    """One full-attention pass over context + continuation. Returns the cache (to crop to
    the context), the context's last logits, and per layer what ``prefill`` records plus the
    continuation queries' attention over the context: summed over them (Hq, P), and, with
    ``per_query``, each query's row (Hq, len(cont), P). The context's rows are what a pass
    over the context alone computes (causal attention)."""
    _KEEP.clear()
    _KEEPQ.clear()
    _REC.clear()
    _STATE.update(record=True, prompt_len=len(ctx), per_query=per_query)
    with torch.no_grad():
        out = model(torch.tensor([ctx + cont]), use_cache=True)
    _STATE.update(record=False, per_query=False)
    rec = dict(_REC)
    _REC.clear()
    return out.past_key_values, out.logits[0, len(ctx) - 1], rec


def _crop(cache, P: int) -> None:
    extra = cache.get_seq_length() - P
    if extra > 0:
        cache.crop(-extra)


def run_with_keep(model, cache, P: int, keep: dict[int, torch.Tensor], cont: list[int]):
    """The tokens ``cont`` after the prompt (cache cropped back to P), kept slots only.
    ``keep``: layer -> (Hkv, P), or (Hkv, len(cont), P) for a set per query.
    Returns their logits (len(cont), V)."""
    _crop(cache, P)
    _KEEP.clear()
    _KEEPQ.clear()
    for layer, m in keep.items():
        (_KEEPQ if m.dim() == 3 else _KEEP)[layer] = m
    _STATE["prompt_len"] = P
    with torch.no_grad():
        out = model(
            torch.tensor([cont]),
            past_key_values=cache,
            position_ids=torch.arange(P, P + len(cont))[None],
            use_cache=True,
        )
    _KEEP.clear()
    _KEEPQ.clear()
    return out.logits[0]


def greedy_batched(model, cache, P, keeps: list[dict], first_logits, n: int) -> list[list[int]]:
    """greedy_with_keep for several kept sets at once: one batch row per set, the prompt's
    cache copied to every row."""
    _crop(cache, P)
    B = len(keeps)
    for lay in cache.layers:
        lay.keys = lay.keys.expand(B, -1, -1, -1).contiguous()
        lay.values = lay.values.expand(B, -1, -1, -1).contiguous()
    _KEEP.clear()
    for layer in keeps[0]:
        _KEEP[layer] = torch.stack([kp[layer] for kp in keeps])
    _STATE["prompt_len"] = P
    first = int(first_logits.argmax())
    toks = [[first] for _ in range(B)]
    with torch.no_grad():
        for i in range(n - 1):
            out = model(
                torch.tensor([[t[-1]] for t in toks]),
                past_key_values=cache,
                position_ids=torch.full((B, 1), P + i),
                use_cache=True,
            )
            for b, t in enumerate(out.logits[:, -1].argmax(-1).tolist()):
                toks[b].append(t)
    _KEEP.clear()
    return toks


def greedy_with_keep(model, cache, P, keep, first_logits, n: int) -> list[int]:
    _crop(cache, P)
    _KEEP.clear()
    _KEEP.update(keep)
    _STATE["prompt_len"] = P
    toks = [int(first_logits.argmax())]
    with torch.no_grad():
        for i in range(n - 1):
            pos = P + i
            out = model(
                torch.tensor([[toks[-1]]]),
                past_key_values=cache,
                position_ids=torch.tensor([[pos]]),
                use_cache=True,
            )
            toks.append(int(out.logits[0, -1].argmax()))
    _KEEP.clear()
    return toks


# --- selection, written loop-simple and independently of kvmesh's policies.py


def pool1d(x: torch.Tensor, kernel: int, mode: str) -> torch.Tensor:
    """x (N,) -> (N,): each slot the avg / max of its +-kernel//2 neighbours inside x."""
    if kernel <= 1:
        return x.clone()
    n, r = x.shape[0], kernel // 2
    out = torch.empty_like(x)
    for j in range(n):
        seg = x[max(0, j - r) : min(n, j + r + 1)]
        out[j] = seg.mean() if mode == "avg" else seg.max()
    return out


def pool_fast(x: torch.Tensor, kernel: int, mode: str) -> torch.Tensor:
    """pool1d on (..., N), vectorised (checked equal to pool1d in ``check``)."""
    if kernel <= 1:
        return x.clone()
    shape = x.shape
    flat = x.reshape(-1, 1, shape[-1])
    if mode == "avg":
        y = F.avg_pool1d(flat, kernel, 1, kernel // 2, count_include_pad=False)
    else:
        y = F.max_pool1d(flat, kernel, 1, kernel // 2)
    return y.reshape(shape)


def topk_lowtie(scores: torch.Tensor, k: int) -> torch.Tensor:
    order = sorted(range(scores.shape[0]), key=lambda j: (-float(scores[j]), j))
    return torch.tensor(sorted(order[:k]), dtype=torch.long)


def snapkv_keep(
    rec,
    P,
    budget,
    window=32,
    kernel=5,
    pool="avg",
    vote="group",
    Hkv=3,
    recent=0,
    alloc="uniform",
    floor=0.0,
    beta=20.0,
):
    """rec: layer -> (Hq, P, P). The kept prompt slots per layer: (Hkv, P) bool.

    vote: ``group`` sums the window's weights over each KV head's query heads; ``head``
    lets each query head pick its own top slots, merged round-robin within the group;
    ``layer`` sums over every head (one set per layer).
    alloc (``group`` votes only): how the voted slots are shared out, ``budget - window``
    per head on average (``eviction_budgets.allocate``: ``ada`` across a layer's heads,
    ``pyramid`` by depth, ``pyramid_ada``, ``model`` across everything; ``floor``, ``beta``);
    every head keeps the window whatever its share."""
    keep = {}
    Wq = min(window, budget, P)  # the voting queries
    W = min(max(window, int(recent * budget) if recent < 1 else recent), budget, P)  # kept tail
    n_pre = P - W
    n_top = budget - W
    if alloc != "uniform":
        if vote != "group":
            raise ValueError(f"alloc={alloc!r} needs vote='group', not {vote!r}")
        votes = []
        for a, *_ in rec.values():  # (Hq, n_pre) -> (Hkv, n_pre), pooled along positions
            per_q = a[:, a.shape[1] - Wq :, :n_pre].sum(1)
            votes.append(pool_fast(per_q.view(Hkv, -1, n_pre).sum(1), kernel, pool))
        chosen = allocate(votes, n_top, alloc, floor, beta)
        for layer, c in zip(rec, chosen):
            m = torch.zeros(Hkv, P, dtype=torch.bool)
            m[:, n_pre:] = True
            m[:, :n_pre] = c
            keep[layer] = m
        return keep
    for layer, (a, *_) in rec.items():
        Hq = a.shape[0]
        G = Hq // Hkv
        per_q = a[:, a.shape[1] - Wq :, :n_pre].sum(
            1
        )  # (Hq, n_pre): the window's votes per query head
        m = torch.zeros(Hkv, P, dtype=torch.bool)
        m[:, n_pre:] = True
        if n_top > 0 and n_pre > 0:
            if vote == "layer":
                v = pool_fast(per_q.sum(0), kernel, pool)
                top = torch.sort(torch.sort(v, descending=True, stable=True).indices[:n_top]).values
                m[:, top] = True
            elif vote == "group":
                v = pool_fast(per_q.view(Hkv, G, n_pre).sum(1), kernel, pool)
                for h in range(Hkv):
                    top = torch.sort(v[h], descending=True, stable=True).indices[:n_top]
                    m[h, top] = True
            else:  # head: each query head ranks, the group takes turns
                v = pool_fast(per_q, kernel, pool).view(Hkv, G, n_pre)
                for h in range(Hkv):
                    orders = [
                        torch.sort(v[h, g], descending=True, stable=True).indices.tolist()
                        for g in range(G)
                    ]
                    chosen: list[int] = []
                    seen = set()
                    i = 0
                    while len(chosen) < n_top:
                        s = orders[i % G][i // G]
                        if s not in seen:
                            seen.add(s)
                            chosen.append(s)
                        i += 1
                    m[h, chosen] = True
        keep[layer] = m
    return keep


def h2o_keep(rec, P, budget, Hkv=3, recent_ratio=0.5):
    keep = {}
    recent = max(1, int(budget * recent_ratio))
    for layer, (_, colsum, *_) in rec.items():
        Hq = colsum.shape[0]
        acc = colsum.view(Hkv, Hq // Hkv, P).sum(1)  # every query's attention, group summed
        m = torch.zeros(Hkv, P, dtype=torch.bool)
        m[:, P - recent :] = True
        for h in range(Hkv):
            top = torch.sort(acc[h, : P - recent], descending=True, stable=True).indices[
                : budget - recent
            ]
            m[h, top] = True
        keep[layer] = m
    return keep


def oracle_keep(rec, budget, Hkv=3, alloc="uniform", floor=0.0):
    """The oracle: per layer and KV head, the ``budget`` prompt slots the continuation's
    own queries attend to most (their attention summed over the continuation and the GQA
    group; ``rec`` from ``prefill_window``). ``alloc`` shares the same total out across a
    layer's heads (``ada``) or every layer and head (``model``). No window is forced in:
    the continuation's attention decides every slot."""
    scores = [orc.view(Hkv, -1, orc.shape[-1]).sum(1) for _, _, orc, _ in rec.values()]
    return dict(zip(rec, allocate(scores, budget, alloc, floor)))


def oracle_query_keep(rec, budget, Hkv=3):
    """The per-query oracle: each continuation query, per KV head, sees the ``budget``
    prompt slots its GQA group attended to most with the full cache (its own row, not a
    sum): the bound for query-aware selection (Quest-like), which picks per step.
    layer -> (Hkv, Tq, P)."""
    out = {}
    for layer, (*_, rows) in rec.items():
        Hq, T, P = rows.shape
        out[layer] = top_per_row(rows.view(Hkv, Hq // Hkv, T, P).sum(1), budget)
    return out


def mass_kept(rec, keep, Hkv=3) -> float:
    """The share of the continuation's attention to the context (full cache, GQA groups
    summed, every layer and head) that falls on the kept slots."""
    got = tot = 0.0
    for layer, (_, _, orc, rows) in rec.items():
        m = keep[layer]
        if m.dim() == 3:  # a set per query: weigh each query's own row
            r = rows.view(Hkv, -1, *rows.shape[1:]).sum(1)  # (Hkv, T, P)
            got += float((r * m).sum())
        else:
            got += float((orc.view(Hkv, -1, orc.shape[-1]).sum(1) * m).sum())
        tot += float(orc.sum())
    return got / tot


def oracle_recall(keep, oracle) -> float | None:
    """The share of the per-head oracle's slots that ``keep`` keeps too (every layer and
    KV head); None for a set per query, which has no single slot set to compare."""
    hit = tot = 0
    for layer, o in oracle.items():
        if keep[layer].dim() == 3:
            return None
        hit += int((keep[layer] & o).sum())
        tot += int(o.sum())
    return hit / tot


def streaming_keep_ref(rec, P, budget, Hkv=3, sinks=4):
    m = torch.zeros(Hkv, P, dtype=torch.bool)
    m[:, :sinks] = True
    m[:, P - (budget - sinks) :] = True
    return {layer: m for layer in rec}


def random_keep_ref(rec, P, budget, Hkv=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    keep = {}
    for layer in rec:
        m = torch.zeros(Hkv, P, dtype=torch.bool)
        for h in range(Hkv):
            m[h, torch.randperm(P - 1, generator=g)[: budget - 1]] = True
        m[:, P - 1] = True
        keep[layer] = m
    return keep


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def text_ids(tok, name: str) -> list[int]:
    path = GPL if name == "gpl" else SHAKESPEARE
    return tok.encode(path.read_text())


def cont_nll(logits_prompt_last, logits_cont, cont) -> float:
    lg = torch.cat([logits_prompt_last[None], logits_cont[:-1]], 0)
    return float(
        -torch.log_softmax(lg.float(), -1)[torch.arange(len(cont)), torch.tensor(cont)].mean()
    )


# --- explore


def variants():
    """The SnapKV variants tried (the paper's default first)."""
    return [
        dict(window=32, kernel=5, pool="avg", vote="group"),
        dict(window=32, kernel=7, pool="avg", vote="group"),
        dict(window=32, kernel=7, pool="max", vote="group"),
        dict(window=16, kernel=7, pool="max", vote="group"),
        dict(window=32, kernel=13, pool="max", vote="group"),
        dict(window=32, kernel=7, pool="max", vote="layer"),
    ]


def vname(v):
    r = f"_r{v['recent']:g}" if v.get("recent") else ""
    a = v.get("alloc", "uniform")
    if a != "uniform":
        a += "".join(f"_{k}{v[k]:g}" for k in ("floor", "beta") if k in v)
        r += f"_{a}"
    return f"w{v['window']}_k{v['kernel']}_{v['pool']}_{v['vote']}{r}"


ORACLES = ("head", "ada", "model", "query")  # oracle_keep's alloc, or oracle_query_keep


def budgets(model, tok, args) -> dict:
    """Perplexity at one budget per ``--fractions``: the full cache, the oracle bounds
    (``--oracles``) and SnapKV variants (``--variants``, with per-head / per-layer
    allocation), per window and over the windows, with the share of the continuation's
    attention mass each kept set holds."""
    ids = text_ids(tok, args.text)
    vs = json.loads(args.variants) if args.variants else [snapkv_defaults()]
    C, N = args.context, args.continuation
    H = model.config.num_key_value_heads
    nll: dict[str, list[float]] = {}
    mass: dict[str, list[float]] = {}
    recall: dict[str, list[float]] = {}
    starts = [args.offset + wi * (C + N) for wi in range(args.windows)]
    for wi, o in enumerate(starts):
        w = ids[o : o + C + N]
        assert len(w) == C + N, f"text too short for window {wi} at {o}"
        ctx, cont = w[:C], w[C:]
        t0 = time.monotonic()
        cache, last, rec = prefill_window(model, ctx, cont, per_query="query" in args.oracles)
        rows = {"full": {layer: torch.ones(H, C, dtype=torch.bool) for layer in rec}}
        bound = {"full": rows["full"]}  # row -> the per-head oracle at its budget
        for frac in args.fractions:
            b = int(C * frac)
            n_rows = len(rows)
            for o_name in args.oracles:
                rows[f"oracle_{o_name}@{frac:g}"] = (
                    oracle_query_keep(rec, b, Hkv=H)
                    if o_name == "query"
                    else oracle_keep(rec, b, Hkv=H, alloc="uniform" if o_name == "head" else o_name)
                )
            for v in vs:
                rows[f"snapkv_{vname(v)}@{frac:g}"] = snapkv_keep(rec, C, b, Hkv=H, **v)
            if args.baselines:
                rows[f"streaming@{frac:g}"] = streaming_keep_ref(rec, C, b, Hkv=H)
                rows[f"random@{frac:g}"] = random_keep_ref(rec, C, b, Hkv=H)
            head_oracle = oracle_keep(rec, b, Hkv=H)
            bound.update({name: head_oracle for name in list(rows)[n_rows:]})
        for name, keep in rows.items():
            lc = run_with_keep(model, cache, C, keep, cont)
            nll.setdefault(name, []).append(cont_nll(last, lc, cont))
            mass.setdefault(name, []).append(mass_kept(rec, keep, Hkv=H))
            recall.setdefault(name, []).append(oracle_recall(keep, bound[name]))
            log(
                f"window {wi} {name}: ppl {math.exp(nll[name][-1]):.3f} "
                f"mass {mass[name][-1]:.3f} recall {recall[name][-1]} "
                f"({time.monotonic() - t0:.0f}s, "
                f"load {os.getloadavg()[0]:.1f})"
            )
        del rec, rows
    full_w = [math.exp(x) for x in nll["full"]]
    full_pooled = math.exp(sum(nll["full"]) / len(nll["full"]))
    out = {}
    for name, v in nll.items():
        per = [math.exp(x) for x in v]
        ratios = [p / f - 1 for p, f in zip(per, full_w)]
        mean = sum(ratios) / len(ratios)
        sd = (sum((r - mean) ** 2 for r in ratios) / max(1, len(ratios) - 1)) ** 0.5
        pooled = math.exp(sum(v) / len(v))
        out[name] = {
            "ppl": round(pooled, 4),
            "vs_full": round(pooled / full_pooled - 1, 4),
            "per_window_ppl": [round(x, 4) for x in per],
            "per_window_vs_full": [round(x, 4) for x in ratios],
            "vs_full_mean": round(mean, 4),
            "vs_full_sd": round(sd, 4),
            "mass_kept": [round(x, 4) for x in mass[name]],
            "oracle_recall": [x if x is None else round(x, 4) for x in recall[name]],
        }
    return {
        "text": args.text,
        "context": C,
        "continuation": N,
        "window_starts": starts,
        "full_ppl": round(full_pooled, 4),
        "rows": out,
    }


def explore(model, tok, args) -> dict:
    ids = text_ids(tok, args.text)
    res = {"text": args.text, "needle": {}, "ppl": {}}
    vs = json.loads(args.variants) if args.variants else variants()
    # perplexity windows
    C, N = args.context, args.continuation
    nll = {}
    for wi in range(args.windows):
        o = args.offset + wi * (C + N)
        w = ids[o : o + C + N]
        ctx, cont = w[:C], w[C:]
        t0 = time.monotonic()
        cache, logits, rec = prefill(model, ctx)
        P = C
        H = model.config.num_key_value_heads
        full = torch.ones(H, P, dtype=torch.bool)
        rows = {"full": {layer: full for layer in rec}}
        for frac in args.fractions:
            b = int(C * frac)
            for v in vs:
                rows[f"snapkv_{vname(v)}@{frac:g}"] = snapkv_keep(rec, P, b, Hkv=H, **v)
            rows[f"h2o@{frac:g}"] = h2o_keep(rec, P, b, Hkv=H)
            rows[f"streaming@{frac:g}"] = streaming_keep_ref(rec, P, b, Hkv=H)
            rows[f"random@{frac:g}"] = random_keep_ref(rec, P, b, Hkv=H)
        for name, keep in rows.items():
            lc = run_with_keep(model, cache, P, keep, cont)
            nll.setdefault(name, []).append(cont_nll(logits[-1], lc, cont))
            log(f"ppl window {wi} {name}: {math.exp(nll[name][-1]):.3f}")
        log(f"ppl window {wi}: {time.monotonic() - t0:.0f}s")
    if nll:
        full = math.exp(sum(nll["full"]) / len(nll["full"]))
        res["ppl"]["full"] = round(full, 4)
        for name, v in nll.items():
            p = math.exp(sum(v) / len(v))
            res["ppl"][name] = {"ppl": round(p, 4), "vs_full": round(p / full - 1, 4)}
    # needles
    # the tuning text's needles differ from bench/eviction.py's (seed 1, not 0)
    cases = needle_cases(tok, ids, args.needles, args.needle_context, seed=args.needle_seed)
    shard, shards = (int(x) for x in args.needle_shard.split("/"))
    cases = cases[shard::shards]
    hits: dict[str, int] = {}
    for ci, (prompt, code, _) in enumerate(cases):
        t0 = time.monotonic()
        cache, logits, rec = prefill(model, prompt)
        P = len(prompt)
        H = model.config.num_key_value_heads
        rows = {"full": {layer: torch.ones(H, P, dtype=torch.bool) for layer in rec}}
        for frac in args.needle_fractions:
            b = int(args.needle_context * frac)
            for v in vs:
                rows[f"snapkv_{vname(v)}@{frac:g}"] = snapkv_keep(rec, P, b, Hkv=H, **v)
            rows[f"h2o@{frac:g}"] = h2o_keep(rec, P, b, Hkv=H)
            rows[f"streaming@{frac:g}"] = streaming_keep_ref(rec, P, b, Hkv=H)
            rows[f"random@{frac:g}"] = random_keep_ref(rec, P, b, Hkv=H)
        names = list(rows)
        outs = greedy_batched(model, cache, P, [rows[k] for k in names], logits[-1], 8)
        for name, toks in zip(names, outs):
            hits[name] = hits.get(name, 0) + (code in tok.decode(toks))
        log(f"needle {ci}: {time.monotonic() - t0:.0f}s " + json.dumps(hits))
    if cases:
        res["needle"] = {k: round(v / len(cases), 4) for k, v in hits.items()}
        res["needle_cases"] = len(cases)
    return res


# --- check


def snapkv_defaults() -> dict:
    """kvmesh's SnapKV defaults (what ``kv_policy="snapkv"`` runs), read off its signature."""
    import inspect

    from kvmesh.worker.eviction.policies import SnapKV

    sig = inspect.signature(SnapKV.__init__).parameters
    out = {k: sig[k].default for k in ("window", "kernel", "pool", "recent")}
    return {**out, "vote": "group"}


def check(model, tok, args) -> dict:
    from kvmesh.worker import LLM, SamplingParams

    # the vectorised pooling equals the loop one
    x = torch.rand(3, 40)
    for mode in ("avg", "max"):
        for k in (1, 5, 7):
            ref = torch.stack([pool1d(r, k, mode) for r in x])
            assert torch.allclose(pool_fast(x, k, mode), ref, atol=1e-6), (mode, k)
    llm = LLM(
        "smollm2-135m-instruct",
        dtype="float32",
        kv_cache_memory="256MiB",
        max_num_batched_tokens=512,
    )
    ids = text_ids(tok, args.text)
    cases = needle_cases(tok, ids, args.needles, args.needle_context, seed=0)
    out = {"needle": [], "text": args.text}
    H = model.config.num_key_value_heads
    for frac in args.needle_fractions:
        b = int(args.needle_context * frac)
        eng_out = llm.generate(
            [c for c, _, _ in cases],
            SamplingParams(temperature=0, max_tokens=8, kv_budget=b, kv_policy="snapkv"),
        )
        same = 0
        for (prompt, code, _), eo in zip(cases, eng_out):
            cache, logits, rec = prefill(model, prompt)
            keep = snapkv_keep(rec, len(prompt), b, Hkv=H, **snapkv_defaults())
            toks = greedy_with_keep(model, cache, len(prompt), keep, logits[-1], 8)
            same += toks == eo.token_ids
            out["needle"].append(
                {
                    "budget": b,
                    "code": code,
                    "engine": eo.text,
                    "reference": tok.decode(toks),
                    "same_tokens": toks == eo.token_ids,
                }
            )
            log(out["needle"][-1])
        log(f"budget {b}: {same}/{len(cases)} answers token-identical")
    llm.close()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("check", "explore", "budgets"))
    ap.add_argument("--text", default="shakespeare", choices=("shakespeare", "gpl"))
    ap.add_argument("--needles", type=int, default=10)
    ap.add_argument("--needle-context", type=int, default=1024)
    ap.add_argument("--needle-fractions", type=float, nargs="+", default=[0.10, 0.25])
    ap.add_argument("--context", type=int, default=1536)
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--windows", type=int, default=1)
    ap.add_argument("--offset", type=int, default=5000, help="first token of the ppl windows")
    ap.add_argument("--needle-seed", type=int, default=1)
    ap.add_argument("--needle-shard", default="0/1")
    ap.add_argument("--variants", help="JSON list of snapkv_keep keyword dicts")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.125, 0.25, 0.5])
    ap.add_argument(
        "--oracles", nargs="*", default=list(ORACLES), choices=ORACLES, help="budgets mode"
    )
    ap.add_argument("--baselines", action="store_true", help="budgets: streaming, random too")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = load_model()
    from kvmesh.worker.models.loader import model_fingerprint, resolve_model
    from kvmesh.worker.tokenizer import Tokenizer

    src = resolve_model("smollm2-135m-instruct")
    tok = Tokenizer.load(src, model_fingerprint(src))
    run = {"check": check, "explore": explore, "budgets": budgets}[args.mode]
    t0 = time.monotonic()
    load0 = os.getloadavg()[0]
    res = run(model, tok, args)
    res.update(seconds=round(time.monotonic() - t0, 1), load_before=load0)
    res["load_after"] = os.getloadavg()[0]
    print(json.dumps(res))


if __name__ == "__main__":
    main()
