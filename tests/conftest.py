"""Shared fixtures. The SmolLM2 ones load the embedded model once per test session."""

from __future__ import annotations

import os
import tempfile

# Triton kernels run through Triton's CPU interpreter in the tests (read by triton when a kernel module is first
# imported, so it must be set before any test imports one). A GPU run sets TRITON_INTERPRET=0 explicitly.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Engines in the tests (and the servers they start, which inherit the environment) run eagerly with torch's own thread
# count: compiling and timing thread layouts at every start-up would cost minutes of CI. tests/models/test_compile.py
# and tests/engine/test_settle.py cover both, and set them explicitly.
os.environ.setdefault("TOKENMILL_ENFORCE_EAGER", "1")
os.environ.setdefault("TOKENMILL_NUM_THREADS", str(len(os.sched_getaffinity(0))))
# The CPU attention's prefetch target likewise (tests/engine/test_attention_prefetch.py times both).
os.environ.setdefault("TOKENMILL_ATTENTION_PREFETCH", "l1")
# And the prefill attention kernel (tests/kernels/test_prefill_attention.py times and runs both).
os.environ.setdefault("TOKENMILL_PREFILL_ATTENTION", "sdpa")
# KV cache pages at first use: populating each test engine's cache (2 GiB unless set) would cost start-up seconds and
# hold that memory per engine alive (tests/kvcache/test_populate.py covers both modes).
os.environ.setdefault("TOKENMILL_KV_CACHE_POPULATE", "lazy")
# Full-precision weights unless a test asks for quantized ones: the parity tests compare against transformers' fp32
# model of the dequantized GGUF (tests/models/test_quantized*.py set --quantization themselves).
os.environ.setdefault("TOKENMILL_QUANTIZATION", "none")
# Servers started by the tests keep their usage ledger in a directory of this session's, not the user's.
os.environ.setdefault("TOKENMILL_USAGE_DB", os.path.join(tempfile.mkdtemp(prefix="tokenmill-usage-"), "usage.sqlite3"))

import pytest  # noqa: E402
import torch  # noqa: E402

from tokenmill.models.loader import DEFAULT_MODEL_FILE, default_model_path  # noqa: E402

PROMPTS = [
    "Hi",
    "The capital of France is",
    "Write a short poem about the sea and the wind, with four lines that rhyme.",
    "Here is a list of fruits: apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon, "
    "mango, nectarine, orange, papaya, quince, raspberry, strawberry, tangerine. Which of them are citrus fruits? "
    "Explain your answer briefly.",
    " ".join(["In the beginning the universe was created. This has made a lot of people very angry and been "
              "widely regarded as a bad move."] * 6) + " What happened next?",
]


@pytest.fixture(scope="session")
def smollm_hf():
    """transformers' own LlamaForCausalLM on the dequantized GGUF weights, fp32: the reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=DEFAULT_MODEL_FILE,
                                                 dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=DEFAULT_MODEL_FILE)
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def smollm_llm():
    """tokenmill on the same weights, fp32 compute and fp32 KV cache."""
    from tokenmill import LLM

    return LLM(dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="1GiB", max_model_len=2048)


@pytest.fixture(scope="session")
def prompt_ids(smollm_llm):
    return [smollm_llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]


def hf_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding with transformers' forward and its KV cache; EOS does not stop it."""
    out, past, inputs = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(max_new_tokens):
            result = model(input_ids=inputs, past_key_values=past, use_cache=True)
            past = result.past_key_values
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            inputs = torch.tensor([[token]])
    return out


# Live servers (subprocesses) shared by tests/server and tests/bench.
from tests.live_server import fp32_server  # noqa: E402,F401
