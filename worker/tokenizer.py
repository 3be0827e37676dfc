"""Tokenizer and chat template, taken from the model's own files.

For a GGUF model, transformers converts the embedded vocabulary once (seconds); the result is
cached under ``KVMESH_CACHE_DIR/tokenizers/<model fingerprint>``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvmesh.worker import envs
from kvmesh.worker.models.loader import ModelSource

logger = logging.getLogger(__name__)


class Tokenizer:
    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer
        self.eos_token_id = hf_tokenizer.eos_token_id
        self.vocab_size = len(hf_tokenizer)

    @classmethod
    def load(cls, src: ModelSource, model_fp: str) -> Tokenizer | None:
        """The model's tokenizer, or None when the files ship none (token-id prompts only)."""
        from transformers import AutoTokenizer

        if src.kind == "hf":
            if not any((src.path / f).exists() for f in ("tokenizer.json", "tokenizer.model")):
                return None
            return cls(AutoTokenizer.from_pretrained(str(src.path)))
        cached = envs.cache_dir() / "tokenizers" / model_fp
        if (cached / "tokenizer.json").is_file():
            try:
                return cls(AutoTokenizer.from_pretrained(str(cached)))
            except Exception as e:  # a half-written cache: rebuild it
                logger.warning("ignoring damaged tokenizer cache %s: %s", cached, e)
        tok = AutoTokenizer.from_pretrained(str(src.path.parent), gguf_file=src.path.name)
        try:
            cached.mkdir(parents=True, exist_ok=True)
            tok.save_pretrained(str(cached))
        except OSError as e:
            logger.warning("cannot cache tokenizer at %s: %s", cached, e)
        return cls(tok)

    def encode(self, text: str) -> list[int]:
        return self.hf(text, add_special_tokens=False).input_ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.hf.chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        return self.hf.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything.

    It re-decodes only a short window ending at the newest token, and holds back text that
    ends in an incomplete UTF-8 sequence (U+FFFD) until the next token completes it.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset :], self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""
