"""The MLA (DeepSeek-V2/V3 latent) rows of ``bench/kv_formats.py``.

* ``layouts``: bytes per token and tokens per GiB of latent pages (``PageLayout(attention=
  "mla")``) for DeepSeek-V2-Lite and DeepSeek-V3, beside the same model's multi-head cache
  and a GQA model of similar size (Llama-3.1-8B, Llama-3.1-405B): layout arithmetic from
  the published geometries, in bf16, nothing timed.
* ``decode``: output tokens/s of the engine on a randomly initialised DeepSeek-V3-style
  checkpoint (dense MLP), latent path (absorbed decode over latent pages: the torch twin, the
  engine's choice on CPU, and kvmesh's C kernel) against a naive path that expands every context
  token's latent into per-head K and V (``kv_b_proj``) at every decode step, in the same run.
* ``formats``: whether lower-precision latent pages hold quality, on the same random
  model: mean KL(fp32 pages || format) of the next-token distributions (teacher forced over
  random token windows), top-1 agreement, and greedy continuations identical to fp32
  pages. fp16/bf16 are real page formats; int8 and fp8 (e4m3) are fake-quantized (quantize
  then dequantize each latent row with a per-token scale for its latent and its rotary part,
  as a page format would store them). A random model has no meaningful perplexity, so this
  measures agreement with fp32, not language-model quality.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

from kvmesh.kernels.mla_attention import mla_prefill_torch
from kvmesh.kernels.page_format import PageLayout
from kvmesh.worker.attention.mla import MLABackend

# name: (layers, heads, kv_lora_rank, rope, nope, v) of MLA models; (layers, kv_heads, head) GQA
MLA_MODELS = {
    "deepseek-v2-lite (15.7B, 2.4B active)": (27, 16, 512, 64, 128, 128),
    "deepseek-v3 (671B, 37B active)": (61, 128, 512, 64, 128, 128),
}
GQA_MODELS = {
    "llama-3.1-8b (GQA 8 kv heads)": (32, 8, 128),
    "llama-3.1-405b (GQA 8 kv heads)": (126, 8, 128),
}
BENCH_MODEL = dict(
    vocab_size=2048,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=192,
    kv_lora_rank=256,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    first_k_dense_replace=4,
    max_position_embeddings=4096,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=None,
)

LM_HEAD_SCALE = 2.0  # with initializer_range 0.1: attention clearly non-uniform, too


def layout_rows() -> dict:
    rows = {}
    for name, (L, H, rank, rope, nope, v) in MLA_MODELS.items():
        lay = PageLayout("bf16", L, 1, rank + rope, 16, attention="mla", rope_dim=rope)
        mha = L * H * (nope + rope + v) * 2
        rows[name] = {
            "layout": lay.name,
            "bytes_per_token": lay.bytes_per_token,
            "tokens_per_gib": int(2**30 / lay.bytes_per_token),
            "multi_head_bytes_per_token": mha,
            "latent_vs_multi_head": lay.bytes_per_token / mha,
        }
    for name, (L, Hkv, D) in GQA_MODELS.items():
        lay = PageLayout("bf16", L, Hkv, D, 16)
        rows[name] = {
            "layout": lay.name,
            "bytes_per_token": lay.bytes_per_token,
            "tokens_per_gib": int(2**30 / lay.bytes_per_token),
        }
    pairs = {
        "deepseek-v2-lite_vs_llama-3.1-8b": (
            "deepseek-v2-lite (15.7B, 2.4B active)",
            "llama-3.1-8b (GQA 8 kv heads)",
        ),
        "deepseek-v3_vs_llama-3.1-405b": (
            "deepseek-v3 (671B, 37B active)",
            "llama-3.1-405b (GQA 8 kv heads)",
        ),
    }
    ratios = {
        k: rows[a]["tokens_per_gib"] / rows[b]["tokens_per_gib"] for k, (a, b) in pairs.items()
    }
    return {"bf16_block16": rows, "tokens_per_gib_ratio": ratios}


class NaiveExpandBackend(MLABackend):
    """The baseline decode: each decode row expands its whole context's latents into
    per-head K and V (what a cache of latents costs without weight absorption)."""

    name = "mla-naive"

    def decode(self, q_nope, q_pe, latent_cache, *, w_uk, w_uv, scale):
        meta = self._meta
        out = []
        for i in range(q_nope.shape[0]):
            n = int(meta.decode_context_lens[i])
            pages = meta.decode_block_tables[i, : -(-n // meta.block_size)]
            rows = latent_cache.index_select(0, pages).flatten(0, 1)[:n]  # (n, rank + rope)
            out.append(
                mla_prefill_torch(
                    q_nope=q_nope[i : i + 1],
                    q_pe=q_pe[i : i + 1],
                    latent=rows,
                    w_uk=w_uk,
                    w_uv=w_uv,
                    scale=scale,
                    mask=torch.ones((1, n), dtype=torch.bool, device=rows.device),
                )[0]
            )
        return torch.stack(out)


def fake_quant_rows(x: torch.Tensor, rank: int, fmt: str) -> torch.Tensor:
    """Quantize then dequantize latent rows (T, rank + rope), one scale per token for the
    latent part and one for the rotary part."""
    out = torch.empty_like(x)
    for sl in (slice(0, rank), slice(rank, None)):
        part = x[:, sl].float()
        amax = part.abs().amax(-1, keepdim=True).clamp_min(1e-8)
        if fmt == "int8":
            s = amax / 127
            q = (part / s).round().clamp(-127, 127) * s
        elif fmt == "fp8":
            s = amax / 448  # e4m3's largest normal
            q = (part / s).to(torch.float8_e4m3fn).float() * s
        else:
            raise ValueError(fmt)
        out[:, sl] = q.to(x.dtype)
    return out


class FakeQuantBackend(MLABackend):
    name = "mla-fake-quant"

    def __init__(self, fmt: str):
        super().__init__("torch")
        self.fmt = fmt

    def forward_mla(self, q_nope, q_pe, latent, cache, *, w_uk, w_uv, scale):
        latent = fake_quant_rows(latent, w_uk.shape[-1], self.fmt)
        return super().forward_mla(q_nope, q_pe, latent, cache, w_uk=w_uk, w_uv=w_uv, scale=scale)


def _checkpoint(folder: Path) -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(**BENCH_MODEL)
    model = transformers.DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():  # next-token entropy ~3 nats, as a trained model's, not ~uniform
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
    model.save_pretrained(folder)


def _llm(path, **kw):
    from kvmesh.worker import LLM

    return LLM(str(path), dtype="float32", kv_cache_memory="256MiB", **kw)


def _swap_backend(llm, backend) -> None:
    llm.engine.backend = llm.engine.runner.backend = backend


def _timed_decode(eng, ids, params) -> tuple[list[list[int]], int, float]:
    """Run ``ids`` together; time only the steps after every request has its first token
    (the prefill is the same code on both paths and is left out). Returns the outputs, the
    tokens made in the timed steps, and their seconds."""
    rids = [eng.add_request(p, params) for p in ids]
    seen: dict[str, int] = {}
    final: dict = {}
    t0 = at_t0 = None
    while len(final) < len(rids):
        if t0 is None and len(seen) == len(rids):
            at_t0 = sum(seen.values())  # every request is decoding from here on
            t0 = time.perf_counter()
        for o in eng.step():
            seen[o.request_id] = len(o.token_ids)
            if o.finished:
                final[o.request_id] = o.token_ids
    seconds = time.perf_counter() - t0
    return [final[r] for r in rids], sum(seen.values()) - at_t0, seconds


def decode_rows(path: Path, prompts: int, prompt_len: int, tokens: int) -> dict:
    from kvmesh.worker import SamplingParams

    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(3, 2048, (prompt_len,), generator=g).tolist() for _ in range(prompts)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    rows, outs = {}, {}
    paths = (
        ("latent", MLABackend()),  # the engine's choice: the torch twin on CPU
        ("latent_c_kernel", MLABackend("cpu")),
        ("naive_expand", NaiveExpandBackend("torch")),
    )
    for name, backend in paths:
        llm = _llm(path, enable_prefix_caching=False, max_num_batched_tokens=prompt_len)
        _swap_backend(llm, backend)
        llm.generate(ids[:1], SamplingParams(max_tokens=2))  # warm-up
        outs[name], n, seconds = _timed_decode(llm.engine, ids, params)
        rows[name] = {"decode_tokens_per_s": n / seconds, "decode_tokens": n, "seconds": seconds}
        print(f"mla decode {name}: {rows[name]}", file=sys.stderr, flush=True)
        llm.close()
    rows["latent_vs_naive"] = (
        rows["latent"]["decode_tokens_per_s"] / rows["naive_expand"]["decode_tokens_per_s"]
    )
    rows["latent_c_kernel_vs_naive"] = (
        rows["latent_c_kernel"]["decode_tokens_per_s"] / rows["naive_expand"]["decode_tokens_per_s"]
    )
    rows["same_tokens"] = outs["latent"] == outs["naive_expand"] == outs["latent_c_kernel"]
    rows["setup"] = {"prompts": prompts, "prompt_len": prompt_len, "output_tokens": tokens}
    return rows


def _score(llm, ids: list[int], chunk: int) -> torch.Tensor:
    """Log-probs (len(ids), V) teacher forced, in chunks whose keys come from the pages."""
    from kvmesh.worker import SamplingParams

    eng = llm.engine
    req = eng.make_request(ids, SamplingParams(max_tokens=1))
    out = []
    try:
        while req.num_computed_tokens < len(ids):
            step = min(chunk, len(ids) - req.num_computed_tokens)
            assert eng.kv.allocate_slots(req, step) is not None
            _, logits = eng.runner.execute([(req, step)], all_logits=True)
            req.num_computed_tokens += step
            out.append(torch.log_softmax(logits.float(), -1))
    finally:
        eng.kv.free(req)
    return torch.cat(out)


def format_rows(path: Path, windows: int, window: int, prompts: int, tokens: int) -> dict:
    from kvmesh.worker import SamplingParams

    g = torch.Generator().manual_seed(9)
    wins = [torch.randint(3, 2048, (window,), generator=g).tolist() for _ in range(windows)]
    greedy_prompts = [torch.randint(3, 2048, (64,), generator=g).tolist() for _ in range(prompts)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    variants = [("fp32", "fp32", None), ("fp16", "fp16", None), ("bf16", "bf16", None)]
    variants += [("int8 (fake-quantized)", "fp32", "int8"), ("fp8 (fake-quantized)", "fp32", "fp8")]
    ref_lp, ref_tokens, rows = None, None, {}
    for name, page_fmt, fake in variants:
        llm = _llm(path, kv_cache_dtype=page_fmt, enable_prefix_caching=False)
        if fake:
            _swap_backend(llm, FakeQuantBackend(fake))
        lps = [_score(llm, w, chunk=16) for w in wins]  # (window, V) each
        toks = [o.token_ids for o in llm.generate(greedy_prompts, params)]
        lay = llm.engine.layout
        llm.close()
        rank = lay.kv_rank
        if fake:  # data bytes + one fp16 scale per token, layer and part (latent, rotary)
            bpt = lay.num_layers * (lay.head_size + 2 * 2)
        else:
            bpt = lay.bytes_per_token
        row: dict = {"bytes_per_token": bpt, "latent_rank": rank}
        if ref_lp is None:
            ref_lp, ref_tokens = lps, toks
            ent = torch.cat([-(lp.exp() * lp).sum(-1) for lp in lps])
            row["mean_entropy_nats"] = float(ent.mean())
        else:
            kl = torch.cat([(r.exp() * (r - lp)).sum(-1) for r, lp in zip(ref_lp, lps)])
            top1 = torch.cat([r.argmax(-1) == lp.argmax(-1) for r, lp in zip(ref_lp, lps)])
            same = sum(a == b for a, b in zip(ref_tokens, toks))
            agree = sum(x == y for a, b in zip(ref_tokens, toks) for x, y in zip(a, b))
            row.update(
                mean_kl_vs_fp32=float(kl.mean()),
                max_kl_vs_fp32=float(kl.max()),
                top1_agreement=float(top1.float().mean()),
                greedy_identical_sequences=f"{same}/{len(toks)}",
                greedy_token_agreement=agree / (len(toks) * tokens),
            )
        rows[name] = row
        print(f"mla format {name}: {row}", file=sys.stderr, flush=True)
    return {
        "rows": rows,
        "setup": {
            "windows": windows,
            "window_tokens": window,
            "greedy_prompts": prompts,
            "greedy_tokens": tokens,
            "note": "random model: agreement with fp32 pages, not language-model quality",
        },
    }


def mla_rows(args) -> dict:
    out: dict = {"layouts": layout_rows()}
    if not args.engine:
        return out
    # --threads (default 1): on a shared 2-core box, small GEMMs on 2 threads ran 20x slower
    # than on 1 (OpenMP threads waiting on each other while other processes hold the cores)
    torch.set_num_threads(args.threads)
    out["threads"] = args.threads
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        _checkpoint(path)
        out["bench_model"] = {k: v for k, v in BENCH_MODEL.items() if "token_id" not in k}
        out["bench_model"]["lm_head_scale"] = LM_HEAD_SCALE
        out["decode"] = decode_rows(path, args.mla_prompts, args.mla_prompt_len, args.mla_tokens)
        out["formats"] = format_rows(path, args.mla_windows, 256, 8, 32)
    return out
