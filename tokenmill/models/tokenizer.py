"""The tokenizer and chat template of a checkpoint, through transformers' AutoTokenizer (which also converts
a GGUF file's embedded tokenizer)."""

from __future__ import annotations

from typing import Any

from tokenmill.models.loader import Checkpoint, ModelLoadError


class Tokenizer:
    def __init__(self, checkpoint: Checkpoint):
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        kwargs = {"gguf_file": checkpoint.tokenizer_gguf_file} if checkpoint.tokenizer_gguf_file else {}
        try:
            self.hf = AutoTokenizer.from_pretrained(str(checkpoint.tokenizer_dir), **kwargs)
        except Exception as exc:  # transformers raises many kinds for a missing/broken tokenizer
            raise ModelLoadError(f"cannot load a tokenizer from {checkpoint.path}: {exc}") from None
        # The tokenizer's own EOS; the model's full list is ModelConfig.eos_token_ids (this one included).
        self.eos_token_id: int | None = self.hf.eos_token_id
        self.vocab_size = len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> list[int]:
        if not self.hf.chat_template:
            raise ValueError("this model has no chat template; use a completion prompt instead")
        rendered = self.hf.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                               tokenize=False)
        # The template already holds the special tokens it needs (e.g. <|im_start|>).
        return self.encode(rendered, add_special_tokens=False)


