"""Whole-prompt prefill, chunked prefill over a cached prefix, and pure decode give the same logits (fp32)."""

import torch

from tests.conftest import PROMPTS
from tests.helpers import teacher_forced_logits
from tokenmill.kvcache.cache import KVCache


def test_chunking_does_not_change_logits(smollm_llm):
    model = smollm_llm.engine.runner.model
    ids = smollm_llm.tokenizer.encode(PROMPTS[3])[:50]
    logits = {}
    for chunk in (None, 7, 1):
        cache = KVCache(model.kv_cache_spec("fp32", 4), num_blocks=32, device="cpu")
        logits[chunk] = teacher_forced_logits(model, cache, ids, chunk=chunk)
    torch.testing.assert_close(logits[7], logits[None], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], logits[None], atol=2e-4, rtol=1e-4)
