"""Quantized KV caches end to end: the engine's greedy tokens equal transformers' with the same
page quantization applied to its K/V, and attention really reads the quantized pages.

The token-for-token oracle tests pin ``KVMESH_GEMM=exact``: the engine's default ``auto``
GEMMs (and the C elementwise kernels they bring) round differently in the last bit, which can
move an int8/int4 code (``kernels.autotune.engine_mode``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import text_prompts

from kvmesh.kernels.quant import (
    dequantize_pages,
    hadamard_transform,
    quantize_pages,
    value_rotation_block,
)
from kvmesh.worker import LLM, SamplingParams
from kvmesh.worker.config import DEFAULT_RESIDUAL_PAGES

BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _fake_quant_attention(fmt: str, W: int = DEFAULT_RESIDUAL_PAGES, state: dict | None = None):
    """An attention function for transformers that reads K/V the way kvmesh stores them:
    every full page of ``BS`` tokens quantized and dequantized as a whole, and a query at
    position ``p`` reading its own page and the ``W - 1`` pages before it in full precision
    (the engine's residual ring; in prefill too) and every earlier page quantized.
    transformers keeps its own cache in full precision, so each position's K/V is computed
    once, as in the engine. ``state["ring_from"]`` (default 0): pages before it were
    restored from the prefix cache, not computed by the request, and are read quantized."""
    state = {"ring_from": 0} if state is None else state

    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        B, H, S, D = key.shape  # (1, Hkv, S, D): everything cached so far plus the new tokens
        rot = value_rotation_block(fmt, D)
        if rot is not None:  # int4 stores V rotated and turns the output back
            value = hadamard_transform(value, rot)
        n = S // BS
        kq, vq = key, value
        if n:
            k = key[0, :, : n * BS].transpose(0, 1).reshape(n, BS, H, D)
            v = value[0, :, : n * BS].transpose(0, 1).reshape(n, BS, H, D)
            kd, vd = dequantize_pages(fmt, quantize_pages(fmt, k, v), key.dtype)
            kq, vq = key.clone(), value.clone()
            kq[0, :, : n * BS] = kd.reshape(n * BS, H, D).transpose(0, 1)
            vq[0, :, : n * BS] = vd.reshape(n * BS, H, D).transpose(0, 1)
        Q = query.shape[2]

        def window(page):  # the first page a query on ``page`` reads exact
            lo = max(state["ring_from"], 0)
            return (page - W + 1).clamp(min=lo) if torch.is_tensor(page) else max(page - W + 1, lo)

        if Q == 1:  # decode: the last W pages exact, in place, earlier pages quantized
            x0 = window((S - 1) // BS) * BS
            keys = torch.cat([kq[:, :, :x0], key[:, :, x0:]], dim=2)
            values = torch.cat([vq[:, :, :x0], value[:, :, x0:]], dim=2)
            mask = torch.ones(1, S, dtype=torch.bool)
        else:  # the engine's prefill layout: the pages some query reads quantized, then the
            # exact pages from the first query's window on (worker.attention.own_page)
            lq = min(window((S - 1) // BS), n) * BS
            e0 = window((S - Q) // BS) * BS
            lx = -(-S // BS) * BS - e0
            pad = key.new_zeros((B, H, e0 + lx - S, D))
            keys = torch.cat([kq[:, :, :lq], key[:, :, e0:], pad], dim=2)
            values = torch.cat([vq[:, :, :lq], value[:, :, e0:], pad], dim=2)
            qpos = torch.arange(S - Q, S)[:, None]
            kpos = torch.cat([torch.arange(lq), torch.arange(e0, e0 + lx)])[None, :]
            exact = torch.arange(lq + lx)[None, :] >= lq
            in_window = kpos // BS >= window(qpos // BS)
            mask = (kpos <= qpos) & (in_window == exact)
        o = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=True
        )  # (1, Hq, Q, D)
        if rot is not None:
            o = hadamard_transform(o, rot)
        return o.transpose(1, 2).contiguous(), None

    return attention


def _hf_fake_quant_greedy(
    model,
    fmt: str,
    prompt: list[int],
    n: int,
    chunk: int,
    W: int = DEFAULT_RESIDUAL_PAGES,
    restored: int = 0,
) -> list[int]:
    """transformers' greedy tokens with kvmesh's page quantization, the prompt prefilled in
    chunks of ``chunk`` tokens (as the engine schedules a lone request), then one token per
    step. ``restored`` (a multiple of BS): the request found that many tokens in the prefix
    cache, computed (in the first pass, as a cold request) with every page its own; it
    recomputes the rest reading the restored pages quantized."""
    from transformers import AttentionInterface, DynamicCache

    name = f"kvmesh_fakequant_{fmt}_{W}"
    state = {"ring_from": 0}
    AttentionInterface.register(name, _fake_quant_attention(fmt, W, state))
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    out: list[int] = []
    try:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            for s in range(0, len(prompt), chunk):
                logits = model(torch.tensor([prompt[s : s + chunk]]), cache=cache)
            if restored:  # the cached pages as the cold request left them; the rest anew
                cache.crop(restored - len(prompt))  # drop the tokens after it
                state["ring_from"] = restored // BS
                logits = model(torch.tensor([prompt[restored:]]), cache=cache)
            for _ in range(n):
                out.append(int(logits.logits[0, -1].argmax()))
                logits = model(torch.tensor([out[-1:]]), cache=cache)
    finally:
        model.set_attn_implementation(before)
    return out


@pytest.fixture(scope="module")
def prompts(smol_llm, shakespeare):
    # odd lengths: a partial tail page at every step, pages completing mid-chunk
    return text_prompts(smol_llm.tokenizer, shakespeare, [37, 100, 61])


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_greedy_matches_fake_quantized_transformers(fmt, hf_smol, prompts, monkeypatch):
    """One request at a time, prefilled in chunks of 40 (pages fill across chunk boundaries,
    from the residual and new tokens), then decoded: token for token. The chunk's queries
    go to attention in blocks of 16 (3 per chunk), as a long chunk's go in blocks of 256."""
    from kvmesh.worker.attention import own_page

    monkeypatch.setattr(own_page, "OWN_PAGE_QUERY_BLOCK", 16)
    monkeypatch.setenv("KVMESH_GEMM", "exact")  # the reference's bits (autotune.engine_mode)
    llm = LLM(
        "smollm2-135m-instruct",
        kv_cache_dtype=fmt,
        kv_cache_memory="64MiB",
        max_num_batched_tokens=40,
        max_num_seqs=1,
    )
    for p in prompts:
        out = llm.generate([p], GREEDY)[0]
        assert out.token_ids == _hf_fake_quant_greedy(hf_smol, fmt, p, GREEDY.max_tokens, 40)


def test_batched_int8_matches_fake_quantized_transformers(hf_smol, prompts, monkeypatch):
    """Several requests prefilled in one step and decoded as one batch. (int8 only: int4's
    rounding turns the last-bit differences of other GEMM shapes into different codes.)"""
    monkeypatch.setenv("KVMESH_GEMM", "exact")
    llm = LLM("smollm2-135m-instruct", kv_cache_dtype="int8", kv_cache_memory="64MiB")
    for p, out in zip(prompts, llm.generate(prompts, GREEDY)):
        assert out.token_ids == _hf_fake_quant_greedy(hf_smol, "int8", p, GREEDY.max_tokens, 4096)


def test_a_prefix_hit_reads_the_restored_pages_quantized(hf_smol, prompts, monkeypatch):
    """With a residual ring of W = 2 pages, a cold request's queries read the page before
    their own exact; after a prefix hit that page was restored from the cache and has no
    full-precision copy, so the hit's queries read it quantized (docs/formats.md): token for
    token the oracle with the restored pages quantized, for the cold and the hit run alike."""
    monkeypatch.setenv("KVMESH_GEMM", "exact")
    llm = LLM("smollm2-135m-instruct", kv_cache_dtype="int8", kv_cache_memory="64MiB")
    assert llm.engine.memory.residual_pages == 2
    p = prompts[1]  # 100 tokens: 6 pages restored on a hit, 4 tokens computed
    cold = llm.generate([p], GREEDY)[0]
    hit = llm.generate([p], GREEDY)[0]
    assert hit.num_cached_tokens == 96
    n = GREEDY.max_tokens
    assert cold.token_ids == _hf_fake_quant_greedy(hf_smol, "int8", p, n, 4096)
    assert hit.token_ids == _hf_fake_quant_greedy(hf_smol, "int8", p, n, 4096, restored=96)


@pytest.mark.parametrize("fmt, stored", [("int8", torch.int8), ("int4", torch.uint8)])
def test_attention_reads_the_quantized_pages(prompts, fmt, stored):
    """The control for the end-to-end tests above: the tokens they compare come from the
    quantized pages (spoil the cached pages' value scales and a hit's tokens change). With
    one residual page a hit gives the cold run's tokens: every page a query reads quantized
    is one it would have read quantized cold."""
    llm = LLM(
        "smollm2-135m-instruct", kv_cache_dtype=fmt, kv_cache_memory="64MiB", kv_residual_pages=1
    )
    eng = llm.engine
    prompt = prompts[1]
    cold = llm.generate([prompt], GREEDY)[0]
    hit = llm.generate([prompt], GREEDY)[0]  # 96 tokens served by the cached quantized pages
    assert hit.num_cached_tokens == 96 and hit.token_ids == cold.token_ids
    # zero the value scales of the cached pages: a hit must now give other tokens
    req = eng.make_request(prompt)
    pages = torch.tensor(eng.kv.cached_page_ids(req.page_hashes))
    for layer in eng.memory.layer_caches:
        assert layer.views["v"].dtype == stored  # int8 codes or packed nibbles, not floats
        layer.views["v_scale"][pages] = 0
    broken = llm.generate([prompt], GREEDY)[0]
    assert broken.num_cached_tokens == 96
    assert broken.token_ids != cold.token_ids


def test_capacity_per_format(smol_src):
    """At one kv_cache_memory budget, int8 holds >= 1.8x and int4 >= 2.8x the tokens of fp16."""
    budget = "32MiB"
    pages = {}
    for fmt in ("fp16", "int8", "int4"):
        llm = LLM("smollm2-135m-instruct", kv_cache_dtype=fmt, kv_cache_memory=budget)
        pages[fmt] = llm.engine.kv.num_pages
        assert llm.engine.stats().kv_cache_dtype == fmt
    assert pages["int8"] >= 1.8 * pages["fp16"]
    assert pages["int4"] >= 2.8 * pages["fp16"]


def test_unknown_cache_dtype_names_the_accepted_ones():
    with pytest.raises(ValueError, match="int4") as e:
        LLM("smollm2-135m-instruct", kv_cache_dtype="int3")
    assert "int3" in str(e.value)


# The unseen text of issue 23: the GNU GPL v3 as Debian ships it, in base-files, an Essential
# package (on every Debian or Ubuntu machine, this one's image included). English prose that
# nothing in kvmesh's quantizer was tuned on (tinyshakespeare was). eval-ppl cuts windows
# from its start: all 14 of 512 tokens it holds (7,154 predicted tokens, docs/formats.md),
# twice the windows of 1,024 tokens, so the mean is steadier.
GPL3 = "/usr/share/common-licenses/GPL-3"
UNSEEN_CONTEXT, UNSEEN_WINDOWS = 512, 14
# Issue 23's bound. int4 with the default two residual pages measured +0.60% here (14
# windows from -0.39% to +1.67%, sd 0.55 points; +0.77% over the 7 windows of 1,024 tokens,
# +0.36% on Newton's Opticks over 16), +0.89% with one residual page. Other roundings of
# K/V moved it little: +0.60% with KVMESH_GEMM=exact, +0.64% with the C kernels off (torch
# elementwise ops), so the margin of ~0.2 points covers another machine's rounding.
UNSEEN_BOUND = 0.008


def _eval_ppl(capsys, fmt: str) -> float:
    import json

    from kvmesh.cluster.cli import main

    argv = ["eval-ppl", "--text", GPL3, "--context", str(UNSEEN_CONTEXT)]
    argv += ["--windows", str(UNSEEN_WINDOWS)]
    assert main([*argv, "--kv-cache-dtype", fmt, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ppl"]


def test_int4_perplexity_on_a_text_it_was_not_tuned_on(capsys):
    """``kvmesh eval-ppl --kv-cache-dtype int4`` against fp32 (``auto``) on the unseen text:
    within issue 23's bound, +0.8% perplexity."""
    from pathlib import Path

    if not Path(GPL3).is_file():
        pytest.fail(f"{GPL3} is missing: it ships in Debian's base-files package")
    change = _eval_ppl(capsys, "int4") / _eval_ppl(capsys, "auto") - 1
    assert change <= UNSEEN_BOUND, f"int4 costs {change:+.2%} perplexity on {GPL3}"
