"""The tokenizer and chat template of a checkpoint, through transformers' AutoTokenizer (which also converts
a GGUF file's embedded tokenizer).

Converting a GGUF tokenizer takes seconds (SmolLM2's: 4.7 s on 2 cores, at every start of both the engine and the API
process), so the converted tokenizer is saved once under ``cache_dir`` and read back from there (0.3 s). The cache key
is the GGUF file's resolved path, size and modification time and the transformers and tokenizers versions: a changed
file or library converts afresh. An entry appears whole or not at all (written to a temporary directory, then
renamed), so processes starting at once never read half of one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from tokenmill.models.paths import ModelLoadError, tokenizer_files

if TYPE_CHECKING:  # the loader imports torch, which the API process (tokenizer only) never needs
    from tokenmill.models.loader import Checkpoint

log = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = "~/.cache/tokenmill/tokenizers"  # EngineConfig.tokenizer_cache_dir's default too


class Tokenizer:
    def __init__(self, directory: Path, gguf_file: str | None = None, cache_dir: str | None = DEFAULT_CACHE_DIR):
        """The tokenizer in ``directory`` (HF files), or embedded in ``directory / gguf_file``; ``cache_dir`` None or
        '' converts a GGUF tokenizer at every start."""
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        if not gguf_file:
            _refuse_remote_code(Path(directory))
        try:
            if gguf_file and cache_dir:
                self.hf = _cached_gguf_tokenizer(Path(directory) / gguf_file, Path(cache_dir).expanduser())
            else:
                self.hf = _load(directory, gguf_file)
        except Exception as exc:  # transformers raises many kinds for a missing/broken tokenizer
            raise ModelLoadError(f"cannot load a tokenizer from {Path(directory) / (gguf_file or '')}: {exc}") \
                from None
        # The tokenizer's own EOS; the model's full list is ModelConfig.eos_token_ids (this one included).
        self.eos_token_id: int | None = self.hf.eos_token_id
        self.vocab_size = len(self.hf)
        self._rust_decode = _rust_decode(self.hf)

    @classmethod
    def of_checkpoint(cls, checkpoint: Checkpoint, cache_dir: str | None = DEFAULT_CACHE_DIR) -> "Tokenizer":
        return cls(checkpoint.tokenizer_dir, checkpoint.tokenizer_gguf_file, cache_dir)

    @classmethod
    def of_model(cls, model: str | None, cache_dir: str | None = DEFAULT_CACHE_DIR) -> "Tokenizer":
        """``model``'s tokenizer (a path as ``--model`` takes it; None: the default model) without reading its
        weights or GGUF metadata."""
        return cls(*tokenizer_files(model), cache_dir)

    def ids_of_tokens(self, tokens: Sequence[str]) -> list[int]:
        """The ids of those of ``tokens`` that are whole tokens of this vocabulary (special or added ones)."""
        vocab = self.hf.get_vocab()
        return [vocab[token] for token in tokens if token in vocab]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        # the engine detokenizes every running request twice a step (engine/detokenizer.py): transformers' wrapper
        # around the Rust call cost ~1.5 us of a call's 2.4 (SmolLM2, 6 tokens; ad hoc), 0.1 ms of a 32-decode step
        # (benchmarks/step_split.py)
        if self._rust_decode is not None:
            return self._rust_decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template_kwargs: dict[str, Any] | None = None
                            ) -> list[int]:
        """``template_kwargs``: more variables for the template (``enable_thinking``, ``reasoning_effort``...)."""
        if not self.hf.chat_template:
            raise NoChatTemplate("this model has no chat template; use a completion prompt instead")
        rendered = self.hf.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                               tokenize=False, **(template_kwargs or {}))
        # The template already holds the special tokens it needs (e.g. <|im_start|>).
        return self.encode(rendered, add_special_tokens=False)


class NoChatTemplate(ValueError):
    """The model has no chat template to render messages with."""


def _rust_decode(hf):
    """The ``tokenizers`` library's decode where transformers' ``decode`` returns exactly what it returns (a fast
    tokenizer whose class overrides neither decode step, with no clean-up of tokenization spaces), else None."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: its own decode, always
        return None
    cls, backend = type(hf), getattr(hf, "_tokenizer", None)
    if not isinstance(hf, TokenizersBackend) or cls.decode is not PreTrainedTokenizerBase.decode \
            or cls._decode is not TokenizersBackend._decode or hf.clean_up_tokenization_spaces \
            or not callable(getattr(backend, "decode", None)):
        return None
    return backend.decode


def _refuse_remote_code(directory: Path) -> None:
    """A tokenizer that only the checkpoint's own Python code builds (``auto_map`` in tokenizer_config.json and no
    tokenizer.json: Kimi-K2's tiktoken tokenizer, tokenization_kimi.py) is one clear error: tokenmill never runs a
    checkpoint's code, and says how to write the tokenizer.json it reads instead."""
    config_file = directory / "tokenizer_config.json"
    if (directory / "tokenizer.json").exists() or not config_file.exists():
        return
    try:
        auto = json.loads(config_file.read_text()).get("auto_map", {}).get("AutoTokenizer")
    except (ValueError, AttributeError):
        return  # transformers reports a broken file itself
    if not auto:
        return
    code = (auto[0] if isinstance(auto, list) else auto).split(".")[0] + ".py"
    raise ModelLoadError(
        f"the tokenizer of {directory} is the checkpoint's own code ({code}, tokenizer_config.json's auto_map) and "
        f"there is no tokenizer.json: tokenmill does not run a checkpoint's code. Once you have read {code}, write "
        f"the tokenizer.json once with transformers: python -c \"from transformers import AutoTokenizer; "
        f"AutoTokenizer.from_pretrained('{directory}', trust_remote_code=True, use_fast=True)"
        f".save_pretrained('{directory}')\" (a tiktoken tokenizer such as Kimi-K2's needs `pip install tiktoken` "
        f"for that), then start tokenmill again")


def _load(directory: Path, gguf_file: str | None = None):
    from transformers import AutoTokenizer

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    return AutoTokenizer.from_pretrained(str(directory), **kwargs)


def _cached_gguf_tokenizer(gguf: Path, cache_dir: Path):
    import tokenizers
    import transformers

    source = gguf.resolve()
    stat = source.stat()
    identity = f"{source}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}|{tokenizers.__version__}"
    entry = cache_dir / hashlib.sha256(identity.encode()).hexdigest()[:32]
    if entry.is_dir():
        return _load(entry)
    converted = _load(source.parent, source.name)
    partial = None
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        partial = tempfile.mkdtemp(dir=cache_dir, prefix=".partial-")
        converted.save_pretrained(partial)
        os.rename(partial, entry)
    except OSError as exc:  # another process renamed its copy first, or the directory is not writable
        if partial:
            shutil.rmtree(partial, ignore_errors=True)
        if not entry.is_dir():
            log.warning("tokenizer not cached in %s (%s): it is converted again at the next start", cache_dir, exc)
    return converted
