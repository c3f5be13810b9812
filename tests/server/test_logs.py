import json
import logging

from tokenmill.logs import JsonFormatter, TextFormatter


def _record(fields):
    record = logging.LogRecord("tokenmill.requests", logging.INFO, __file__, 1, "request", None, None)
    record.fields = fields
    return record


def test_json_lines_carry_the_request_fields():
    fields = {"id": "abc", "status": 200, "prompt_tokens": 5, "output_tokens": 7, "ttft_s": 0.1, "e2e_s": 0.4,
              "finish_reason": "stop", "key": "alice"}
    line = JsonFormatter().format(_record(fields))
    parsed = json.loads(line)
    assert parsed["message"] == "request" and parsed["level"] == "INFO"
    assert {k: parsed[k] for k in fields} == fields


def test_text_lines_append_fields():
    assert TextFormatter().format(_record({"id": "abc", "status": 200})).endswith("request id=abc status=200")
