"""Helpers shared by test modules (import as ``from helpers import ...``)."""

from __future__ import annotations


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, ignore_eos=True) -> list[int]:
    """transformers' greedy continuation; with ignore_eos it never stops early."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens if ignore_eos else 0,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


def text_prompts(tokenizer, text: str, lengths: list[int], stride: int = 4000) -> list[list[int]]:
    """Token-id prompts of exactly the given lengths, cut from different parts of ``text``."""
    out = []
    for i, n in enumerate(lengths):
        ids = tokenizer.encode(text[i * stride : i * stride + n * 8])[:n]
        assert len(ids) == n, f"text slice too short for {n} tokens"
        out.append(ids)
    return out
