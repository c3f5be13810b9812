"""How a checkpoint turns its hidden states into one embedding: sentence-transformers' own files, read as it reads
them (``modules.json``: a Pooling module's ``config.json`` for mean / CLS / last-token pooling, a Normalize module for
unit length), or, for a model without them (a decoder, a GGUF file), last-token pooling normalized, as vLLM embeds
with decoders. ``dimensions`` may shorten a vector only where config.json says the model was trained for it
(``matryoshka_dimensions``, or ``is_matryoshka``)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# sentence-transformers' pooling_mode names -> ours; the other modes (max, mean_sqrt_len, weightedmean) are refused.
_MODES = {"lasttoken": "last", "mean": "mean", "cls": "cls", "mean_tokens": "mean", "cls_token": "cls"}


@dataclass(frozen=True)
class Pooling:
    mode: str | None  # last | mean | cls; None: this checkpoint's pooling cannot be served (``refusal`` says why)
    normalize: bool
    source: str  # where it was read from, for the log
    matryoshka: tuple[int, ...] | bool = ()  # the dimensions it may be cut to (True: any)
    refusal: str | None = None


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _mode(config: dict) -> str | None:
    named = config.get("pooling_mode")
    if isinstance(named, str):
        return named
    return next((name for name in ("lasttoken", "mean_tokens", "cls_token", "max_tokens", "mean_sqrt_len_tokens",
                                   "weightedmean_tokens") if config.get(f"pooling_mode_{name}")), None)


def read_pooling(checkpoint: Path) -> Pooling:
    directory = checkpoint if checkpoint.is_dir() else checkpoint.parent
    hf_config = _read(directory / "config.json") if checkpoint.is_dir() else {}
    matryoshka = tuple(hf_config.get("matryoshka_dimensions") or ()) or bool(hf_config.get("is_matryoshka"))
    modules = _read(directory / "modules.json") if checkpoint.is_dir() else {}
    if not isinstance(modules, list) or not modules:
        return Pooling("last", True, "no sentence-transformers modules.json: last token, normalized", matryoshka)
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules if isinstance(m, dict)]
    pooling = next((m for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
    normalize = "Normalize" in kinds
    other = [k for k in kinds if k not in ("Transformer", "Pooling", "Normalize")]
    if pooling is None or other:
        why = f"its sentence-transformers modules ({', '.join(other) or 'no Pooling'}) are not served"
        return Pooling(None, normalize, "modules.json", matryoshka, why)
    config = _read(directory / pooling.get("path", "") / "config.json")
    name = _mode(config)
    mode = _MODES.get(name or "")
    if mode is None or config.get("include_prompt") is False:
        why = f"its pooling ({name}{', include_prompt false' if config.get('include_prompt') is False else ''}) " \
              "is not served"
        return Pooling(None, normalize, "modules.json", matryoshka, why)
    return Pooling(mode, normalize, f"{pooling.get('path')}/config.json", matryoshka)
