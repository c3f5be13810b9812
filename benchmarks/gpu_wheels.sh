#!/usr/bin/env bash
# Run HERE (a machine with network and the dev venv) before a GPU check: gathers what the H200 image lacks into two
# ignored folders that the device tool carries (`carry: [".whl", ".gpu"]`, 64 MiB in all):
#   .whl/  tokenmill's dependencies missing there, as Python 3.12 manylinux wheels (its image has torch, triton,
#          transformers, safetensors, tokenizers, numpy, jinja2, prometheus-client, httpx, pytest);
#   .gpu/tokenizer/  SmolLM2's tokenizer files (its GGUF weights, 100 MB, do not travel; gpu_engine_check.py writes
#          random checkpoints of its shapes there instead).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
grep -qx '/.gpu/' .git/info/exclude || echo '/.gpu/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl .gpu
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
    -d .whl pydantic pydantic-core annotated-types typing-inspection pydantic-settings python-dotenv msgspec pyzmq \
    xgrammar gguf fastapi starlette uvicorn sse-starlette jsonschema jsonschema-specifications referencing \
    rpds-py attrs apache-tvm-ffi opentelemetry-api importlib-metadata
python3 - <<'PY'
from tokenmill.models.tokenizer import Tokenizer

Tokenizer.of_model(None).hf.save_pretrained(".gpu/tokenizer")
PY
du -sh .whl .gpu
