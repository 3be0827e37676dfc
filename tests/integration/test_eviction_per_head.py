"""Per-head compaction against a per-head masked reference.

Every KV head may keep a different set of slots (SnapKV and H2O select per head). The
random-keep policy draws an independent random set per layer and head, so one compaction
with it moves every head's own kept rows; the engine's greedy tokens must equal
transformers' when each layer's each query head sees exactly the slots its KV head kept
(the reference runs the full sequence with a per-layer, per-head mask, no compaction).
"""

from __future__ import annotations

import torch
from helpers import text_prompts
from transformers import AttentionInterface

from kvmesh.worker import LLM, SamplingParams
from kvmesh.worker.eviction import policies

BS = 16
_MASKS: dict[int, torch.Tensor] = {}  # layer -> (Hkv, T, T) bool, allowed keys per query


def _per_head_masked_attention(module, query, key, value, attention_mask, scaling, **kw):
    # query (B, Hq, T, D), key/value (B, Hkv, T, D): eager attention, the mask per KV head
    G = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(G, 1)
    v = value.repeat_interleave(G, 1)
    w = torch.matmul(query, k.transpose(2, 3)) * scaling
    allowed = _MASKS[module.layer_idx].repeat_interleave(G, 0)[None]  # (1, Hq, T, T)
    w = w.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.matmul(w, v).transpose(1, 2).contiguous(), w


AttentionInterface.register("kvmesh_per_head_mask", _per_head_masked_attention)


def test_per_head_random_compaction_matches_per_head_masked_transformers(hf_smol, shakespeare):
    llm = LLM(
        "smollm2-135m-instruct",
        dtype="float32",
        kv_cache_memory="16MiB",
        max_num_batched_tokens=64,
        block_size=BS,
    )
    P, budget, n_new = 48, 20, 12  # one compaction (after the prompt): n_new < BS
    (ids,) = text_prompts(llm.tokenizer, shakespeare, [P])
    params = SamplingParams(
        temperature=0, max_tokens=n_new, ignore_eos=True, kv_budget=budget, kv_policy="random"
    )
    out = llm.generate([ids], params)[0]
    eng = llm.engine
    assert eng.eviction.num_compactions == 1
    L, H = len(eng.eviction.caches), eng.eviction.num_kv_heads
    # the engine's policy is seeded: the same draw for the same (L, H, P) slots
    keep = policies.RandomKeep(budget).select(torch.zeros(L, H, P), True)  # (L, H, budget)
    assert not all(torch.equal(keep[0, 0], keep[layer, h]) for layer in range(L) for h in range(H))
    seq = ids + out.token_ids[:-1]
    T = len(seq)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    _MASKS.clear()
    for layer in range(L):
        m = causal.expand(H, T, T).clone()
        for h in range(H):
            dropped = torch.ones(P, dtype=torch.bool)
            dropped[keep[layer, h]] = False
            m[h, P:, :P] &= ~dropped  # queries after the prompt see only the kept prompt slots
        _MASKS[layer] = m
    prev = hf_smol.config._attn_implementation
    hf_smol.set_attn_implementation("kvmesh_per_head_mask")
    try:
        with torch.no_grad():
            logits = hf_smol(torch.tensor([seq]), position_ids=torch.arange(T)[None]).logits[0]
    finally:
        hf_smol.set_attn_implementation(prev)
    ref = logits[P - 1 :].argmax(-1).tolist()
    assert out.token_ids == ref
