"""Perplexity with K/V fake-quantized inside transformers' attention: the fast way to compare
int4 designs one factor at a time, and the plain KIVI-style reference point.

transformers (fp32, the GGUF SmolLM2-135M-Instruct) scores each window in one forward pass;
a registered attention function replaces every layer's K and V by quantize -> dequantize
before attending. By default every query reads every position quantized, its own page
included: what ``kvmesh eval-ppl`` at chunk 256 saw before prefill learnt decode's view.
Since then (issue 23's third pass) the engine reads a query's own page exact unless the
query completes it, which ``residual=16`` approximates (it keeps the page exact even for
its last query).

Windows are cut exactly as ``worker.eval.window_token_ids`` cuts them (consecutive,
non-overlapping, from the start of the text), so the numbers are comparable with
``kvmesh eval-ppl --context C --windows W`` on the same file.

A design is a comma-separated list of ``key=value`` (see ``Design``); ``plain`` is the
textbook KIVI quantizer the issue describes: keys int4 per channel over 16 tokens, values
int4 per token in groups of 32, min/max in fp32, round half to even, no rotation, no
clipping, and a trailing partial group quantized too. ``kvmesh`` applies
``kernels.quant.quantize_pages`` itself (with the value rotation when the format has one).

    python bench/kv_fake_quant.py --text ../shared/data/tinyshakespeare.txt \
        --design plain --design kvmesh --design plain,rotate_v=1

``residual=16`` shows decode's view instead: a query reads the K/V of its own 16-token page
exact (the engine's full-precision residual slot) and earlier pages quantized;
``residual=16,res_pages=N`` its own page and the N - 1 before it (the engine's residual
ring, ``kv_residual_pages``).

Windows are scored one at a time: the fp32 pass, then every design on the same window, so
a design's KL(fp32 || design) over each position's full next-token distribution comes for
free. KL is positive at every token and does not cancel, so it ranks designs with far less
noise than a perplexity change (docs/formats.md, issue 23). Progress and each window's
numbers go to stderr.

Prints one JSON object: the fp32 perplexity and, per design, its perplexity, its change
against fp32, the smallest and largest single-window change, KL per predicted token and its
bits per value (packed codes plus scales; alignment padding ignored).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Design:
    """One fake quantizer. Keys: per channel over ``k_tokens`` consecutive tokens; values: per
    token over ``v_group`` consecutive dims; asymmetric, ``x' = q * scale + zero``."""

    k_bits: int = 4
    v_bits: int = 4
    k_tokens: int = 16  # key group along tokens (the page's block_size in kvmesh)
    v_group: int = 32  # value group along the head dimension
    rotate_v: int = 0  # 1: values rotated by the normalized Hadamard matrix (block D & -D)
    v_clip: int = 1  # number of clip factors searched per value group: 1.0, 0.95, ... (1: none)
    k_clip: int = 1  # the same for key groups
    scale: str = "fp32"  # dtype scale and zero are stored in: fp32, fp16, bf16 or fp8 (e4m3)
    zero: str = "min"  # min: zero = group min, rounded to nearest in storage; cover: rounded
    # down and the scale up, so the stored grid covers [min, max]
    rounding: str = "even"  # even: round half to even; up: floor(y + 0.5) (kvmesh's kernels)
    partial: int = 1  # 1: a trailing partial group is quantized too (the KIVI reference)
    kvmesh: int = 0  # 1: kvmesh's own quant.quantize_pages("int4"), other fields ignored
    jitter: int = 0  # > 0: seed of a relative 1e-6 perturbation of K/V before quantizing
    sink: int = 0  # > 0: the window's first ``sink`` tokens keep exact K/V (attention sinks)
    residual: int = 0  # > 0: a query reads exact K/V of its own ``residual``-token page (what
    # decode sees: the partial last page lives in the full-precision residual slot)
    res_pages: int = 1  # with ``residual``: the query's own page and the ``res_pages - 1``
    # pages before it read exact (a KIVI-style full-precision window of recent tokens)

    @classmethod
    def parse(cls, spec: str) -> Design:
        if spec == "plain":
            return cls()
        if spec == "kvmesh":
            return cls(kvmesh=1, partial=0)
        d = cls()
        names = {f.name: f.type for f in fields(cls)}
        for item in spec.split(","):
            if item in ("plain", ""):
                continue
            if item == "kvmesh":
                d = replace(d, kvmesh=1, partial=0)
                continue
            key, _, val = item.partition("=")
            if key not in names:
                raise SystemExit(f"unknown design field {key!r}; fields: {', '.join(names)}")
            d = replace(d, **{key: val if names[key] == "str" else int(val)})
        if d.res_pages < 1 or (d.res_pages > 1 and not d.residual):
            raise SystemExit(f"{spec!r}: res_pages needs residual=<page size> and must be >= 1")
        return d

    def bits_per_value(self, head_size: int) -> float:
        """Code bits plus scale and zero bits per value, averaged over K and V."""
        sbits = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8": 8}[self.scale]
        if self.kvmesh:
            return 5.5
        k = self.k_bits + 2 * sbits / self.k_tokens
        v = self.v_bits + 2 * sbits / min(self.v_group, head_size)
        return (k + v) / 2


def _store(x: torch.Tensor, how: str) -> torch.Tensor:
    dt = {
        "fp32": torch.float32,
        "fp16": torch.float16,
        "bf16": torch.bfloat16,
        "fp8": torch.float8_e4m3fn,
    }[how]
    return x.to(dt).float()


def _below(x: torch.Tensor, stored: torch.Tensor, how: str) -> torch.Tensor:
    """``stored`` (x rounded to the storage dtype, as fp32), moved to the next representable
    value below where it rounded above ``x``."""
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(how)
    if dt is None:
        return stored
    s = stored.to(dt)
    down = torch.nextafter(s, torch.full_like(s, float("-inf"))).float()
    return torch.where(stored > x, down, stored)


def _round(y: torch.Tensor, how: str) -> torch.Tensor:
    return torch.round(y) if how == "even" else torch.floor(y + 0.5)


def fake_quant(x: torch.Tensor, axis: int, bits: int, clip_steps: int, d: Design) -> torch.Tensor:
    """Quantize-dequantize ``x`` fp32 in groups along ``axis`` (every other axis indexes a
    group): asymmetric min/max, optionally a clip search that shrinks [min, max] about its
    middle by 1.0, 0.95, ... and keeps the least squared error per group."""
    qmax = float(2**bits - 1)
    mn, mx = x.amin(axis, keepdim=True), x.amax(axis, keepdim=True)
    mid, half = (mn + mx) * 0.5, (mx - mn) * 0.5
    best_err, best = None, None
    for i in range(clip_steps):
        a = (20 - i) / 20.0
        lo, hi = mid - a * half, mid + a * half
        zero = _store(lo, d.scale)
        if d.zero == "cover":  # stored zero <= min: no value falls below the grid
            zero = _below(lo, zero, d.scale)
        scale = _store(((hi - zero) / qmax).clamp_min(2.0**-14), d.scale)
        if d.zero == "cover":  # stored scale big enough that zero + qmax * scale >= max
            scale = -_below(-((hi - zero) / qmax).clamp_min(2.0**-14), -scale, d.scale)
        q = _round((x - zero) / scale, d.rounding).clamp(0, qmax)
        xq = q * scale + zero
        if clip_steps == 1:
            return xq
        err = (xq - x).square().sum(axis, keepdim=True)
        if best is None:
            best_err, best = err, xq
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, xq, best)
    return best


def hadamard(x: torch.Tensor) -> torch.Tensor:
    from kvmesh.kernels.quant import hadamard_transform

    D = x.shape[-1]
    return hadamard_transform(x, D & -D)


def quant_kv(key: torch.Tensor, value: torch.Tensor, d: Design):
    """key, value (Hkv, S, D) fp32 -> their fake-quantized copies, same shape. Tokens of a
    trailing partial group stay exact unless ``d.partial``."""
    H, S, D = key.shape
    if d.jitter:  # float noise as another GEMM shape would make it: how stable is a number?
        g = torch.Generator().manual_seed(d.jitter * 1000 + S)
        key = key * (1 + 1e-6 * torch.randn(key.shape, generator=g))
        value = value * (1 + 1e-6 * torch.randn(value.shape, generator=g))
    if d.kvmesh:
        from kvmesh.kernels.quant import dequantize_pages, quantize_pages

        n = S // 16
        kq, vq = key.clone(), value.clone()
        if n:
            k = key[:, : n * 16].transpose(0, 1).reshape(n, 16, H, D)
            v = value[:, : n * 16].transpose(0, 1).reshape(n, 16, H, D)
            k2, v2 = dequantize_pages("int4", quantize_pages("int4", k, v))
            kq[:, : n * 16] = k2.reshape(n * 16, H, D).transpose(0, 1)
            vq[:, : n * 16] = v2.reshape(n * 16, H, D).transpose(0, 1)
        return kq, vq
    T = d.k_tokens
    n = S // T
    kq = key.clone()
    if n:  # keys: per channel over T tokens -> groups (H, n, T, D), reduce over T
        kq[:, : n * T] = fake_quant(
            key[:, : n * T].reshape(H, n, T, D), 2, d.k_bits, d.k_clip, d
        ).reshape(H, n * T, D)
    if d.partial and S % T:
        kq[:, n * T :] = fake_quant(key[:, n * T :], 1, d.k_bits, d.k_clip, d)
    g = min(d.v_group, D)
    vq = fake_quant(value.reshape(H, S, D // g, g), 3, d.v_bits, d.v_clip, d).reshape(H, S, D)
    if not d.partial and S % T:
        vq[:, n * T :] = value[:, n * T :]
    return kq, vq


def quant_kv_sink(key: torch.Tensor, value: torch.Tensor, d: Design):
    """``quant_kv`` with the first ``d.sink`` tokens left exact (quantization still sees
    them, so groups keep their shape: only what the sink tokens read back changes)."""
    kq, vq = quant_kv(key, value, d)
    if d.sink:
        kq[:, : d.sink] = key[:, : d.sink]
        vq[:, : d.sink] = value[:, : d.sink]
    return kq, vq


def make_attention(d: Design):
    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        # query (1, Hq, S, D); key, value (1, Hkv, S, D): one whole window, one pass
        D = query.shape[-1]
        rot_v = bool(d.rotate_v or (d.kvmesh and _kvmesh_rotates_v(D)))
        v_in = hadamard(value) if rot_v else value
        kq, vq = quant_kv_sink(key[0].float(), v_in[0].float(), d)
        kq, vq = kq[None].to(key.dtype), vq[None].to(value.dtype)
        if d.residual:
            o = _residual_attention(query, key, v_in, kq, vq, scaling, d.residual, d.res_pages)
        else:
            o = F.scaled_dot_product_attention(
                query, kq, vq, is_causal=True, scale=scaling, enable_gqa=True
            )  # (1, Hq, S, D)
        if rot_v:
            o = hadamard(o)
        return o.transpose(1, 2).contiguous(), None

    return attention


def _residual_attention(
    query, key, value, kq, vq, scaling, page: int, pages: int = 1
) -> torch.Tensor:
    """Causal attention in which query t reads exact K/V for the keys of its own page
    (positions ``t // page * page .. t``) and quantized K/V for every earlier page: decode's
    view, where the partial page is the full-precision residual slot."""
    Hq, S, D = query.shape[1:]
    rep = Hq // key.shape[1]
    k, v, kq, vq = (x[0].repeat_interleave(rep, 0) for x in (key, value, kq, vq))
    q = query[0]
    scale = scaling if scaling is not None else D**-0.5
    pos = torch.arange(S)
    back = (pos[:, None] // page) - (pos[None, :] // page)
    same = (back >= 0) & (back < pages)  # (S, S): key in the query's page or ``pages - 1`` before
    causal = pos[None, :] <= pos[:, None]
    sc = torch.where(same, q @ k.transpose(1, 2), q @ kq.transpose(1, 2)) * scale
    p = torch.softmax(sc.masked_fill(~causal, float("-inf")), -1)
    o = (p * same) @ v + (p * ~same) @ vq  # (Hq, S, D)
    return o[None]


def _kvmesh_rotates_v(head_size: int) -> bool:
    from kvmesh.kernels import quant

    rot = getattr(quant, "value_rotation_block", None)  # the rotation hook, where it exists
    return rot is not None and rot("int4", head_size) is not None


def load_model():
    from transformers import AutoModelForCausalLM

    from kvmesh.worker.models.loader import model_fingerprint, resolve_model
    from kvmesh.worker.tokenizer import Tokenizer

    src = resolve_model("smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(
        str(src.path.parent), gguf_file=src.path.name, dtype=torch.float32
    ).eval()
    return model, Tokenizer.load(src, model_fingerprint(src))


def windows(tok, text: str, context: int, n: int, skip: int = 0) -> list[list[int]]:
    """``worker.eval.window_token_ids``'s cut: ``n`` consecutive windows of ``context`` tokens
    from the start of the text (after ``skip`` windows)."""
    need = context * (n + skip)
    ids = tok.encode(text[: need * 8])
    if len(ids) < need:
        ids = tok.encode(text)
    if len(ids) < need:
        raise SystemExit(f"the text has {len(ids)} tokens; {n + skip} windows need {need}")
    return [ids[i * context : (i + 1) * context] for i in range(skip, skip + n)]


def log_probs(model, ids: list[int], d: Design | None) -> torch.Tensor:
    """(S - 1, vocab) fp32 next-token log-probabilities of one window, K/V fake-quantized by
    ``d`` (None: fp32)."""
    from transformers import AttentionInterface

    before = model.config._attn_implementation
    if d is not None:
        AttentionInterface.register("kvmesh_fake_quant", make_attention(d))
        model.set_attn_implementation("kvmesh_fake_quant")
    try:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    finally:
        model.set_attn_implementation(before)


def score(model, wins: list[list[int]], designs: list[Design]) -> tuple[dict, list[dict]]:
    """Window by window: the fp32 pass, then every design on the same window. Per design the
    summed NLL, each window's NLL (for the spread) and the summed KL(fp32 || design) over
    predicted tokens: KL is positive per token, so unlike a perplexity change it does not
    cancel, and it ranks designs with far less run-to-run noise."""
    base = {"nll": 0.0, "win_nll": []}
    rows = [{"nll": 0.0, "win_nll": [], "kl": 0.0} for _ in designs]
    for w, ids in enumerate(wins):
        t0 = time.monotonic()
        ref = log_probs(model, ids, None)
        tgt = torch.tensor(ids[1:])[:, None]
        b = -ref.gather(1, tgt).sum().item()
        base["nll"] += b
        base["win_nll"].append(b)
        for d, row in zip(designs, rows):
            lp = log_probs(model, ids, d)
            x = -lp.gather(1, tgt).sum().item()
            row["nll"] += x
            row["win_nll"].append(x)
            kl = (ref.exp() * (ref - lp)).sum().item()
            row["kl"] += kl
            del lp
            print(
                f"  window {w} {d}: change {math.exp((x - b) / (len(ids) - 1)) - 1:+.4%} "
                f"KL {kl / (len(ids) - 1):.4e}",
                file=sys.stderr,
                flush=True,
            )
        print(f"window {w}: {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
    return base, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--text", required=True, help="a UTF-8 text file")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--skip", type=int, default=0, help="windows to skip at the start")
    ap.add_argument("--design", action="append", default=[], help="repeatable; see Design")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model()
    text = Path(args.text).read_text()
    wins = windows(tok, text, args.context, args.windows, args.skip)
    designs = [Design.parse(spec) for spec in args.design]
    n = sum(len(w) - 1 for w in wins)
    base, rows = score(model, wins, designs)
    out = {
        "text": str(Path(args.text).resolve()),
        "context": args.context,
        "windows": args.windows,
        "skip": args.skip,
        "tokens": n,
        "fp32_ppl": math.exp(base["nll"] / n),
        "designs": {},
    }
    head = model.config.head_dim if hasattr(model.config, "head_dim") else 64
    for spec, d, row in zip(args.design, designs, rows):
        ppl = math.exp(row["nll"] / n)
        per_win = [
            math.exp((x - b) / (len(w) - 1)) - 1
            for x, b, w in zip(row["win_nll"], base["win_nll"], wins)
        ]
        out["designs"][spec] = {
            "ppl": ppl,
            "change": ppl / out["fp32_ppl"] - 1,
            "window_change_min": min(per_win),
            "window_change_max": max(per_win),
            "kl_per_token": row["kl"] / n,
            "bits_per_value": d.bits_per_value(head),
        }
        print(
            f"{spec}: {ppl:.4f} {(ppl / out['fp32_ppl'] - 1) * 100:+.3f}% KL {row['kl'] / n:.3e}",
            file=sys.stderr,
        )
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
