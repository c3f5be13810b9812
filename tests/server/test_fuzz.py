"""schemathesis over the server's own /openapi.json for the agent-facing operations (Responses, Messages,
count_tokens, embeddings, completions with prompt logprobs): whatever it generates, valid or not, never gets a 500,
and every refusal comes in the API's own error shape (OpenAI's, or Anthropic's under /v1/messages). The model is a
tiny Qwen3 with a short context, so that any valid request is answered in well under a second."""

import json

import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tests.family_checkpoints import make_family_checkpoint
from tests.live_server import inprocess_server


@pytest.fixture(scope="module")
def fuzz_root(tmp_path_factory, smollm_llm):
    path = tmp_path_factory.mktemp("fuzz")
    make_family_checkpoint(path, smollm_llm.tokenizer.hf, "qwen3")
    with inprocess_server(model=str(path), served_model_name="fuzz", dtype="float32", kv_cache_memory="16MiB",
                          max_model_len=96, enforce_eager=True) as (root, _):
        yield root


FUZZED = r"^/v1/(responses|messages|embeddings|completions)"


def test_generated_requests_never_fail_the_server(fuzz_root):
    schema = schemathesis.openapi.from_url(fuzz_root + "/openapi.json")
    operations = [result.ok() for result in schema.include(path_regex=FUZZED).get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
                                              "/v1/embeddings", "/v1/completions", "/v1/responses/{response_id}"}
    # The CPU kernels' library (built with -ffast-math) turns on flush-to-zero in the thread that loads it;
    # hypothesis refuses to generate floats under it, so the fuzzing runs with it off, as it was before.
    smallest = 5e-324  # the least subnormal double: read as zero under denormals-are-zero
    flushing = smallest * 1.0 == 0.0
    torch.set_flush_denormal(False)
    try:
        _fuzz(operations, fuzz_root)
    finally:
        torch.set_flush_denormal(flushing)


def _fuzz(operations, fuzz_root) -> None:
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        def fuzz(case):
            if isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = "fuzz"  # an unknown model is a 404 before anything else is read
            response = case.call(base_url=fuzz_root, timeout=60)
            case.validate_response(response, checks=[not_a_server_error])
            if response.status_code >= 400 and response.text:
                body = json.loads(response.text)
                if case.path.startswith("/v1/messages"):
                    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
                else:
                    assert set(body["error"]) == {"message", "type", "param", "code"}, body
        fuzz()
