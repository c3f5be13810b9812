"""lm-evaluation-harness's ``local-completions`` model scoring a small multiple-choice task (written to a local file: no
download) against a live fp32 server: every loglikelihood it gets from ``echo`` + ``logprobs`` equals transformers'
own on the same weights within 1e-3, and its greedy flags agree."""

import json

import torch

from tests.live_server import API_KEY, MODEL

QUESTIONS = [
    {"question": "What is the capital of France?", "choices": [" Paris", " Berlin", " Madrid"], "answer": 0},
    {"question": "How many legs does a spider have?", "choices": [" six", " eight", " ten"], "answer": 1},
    {"question": "Which planet is closest to the sun?", "choices": [" Mercury", " Venus", " Mars"], "answer": 0},
]
TASK = """task: tokenmill_capitals
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def _encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """As lm-eval splits a request: trailing spaces of the context move to the continuation; the continuation's
    tokens are the whole string's beyond the context's."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    start = tokenizer.encode(context, add_special_tokens=False)
    return start, whole[len(start):]


def test_local_completions_scores_as_transformers_does(tmp_path, fp32_server, smollm_hf, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    model, tokenizer = smollm_hf
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "capitals.yaml").write_text(TASK.format(data=data))
    results = lm_eval.simple_evaluate(
        model="local-completions", tasks=["tokenmill_capitals"], log_samples=True,
        task_manager=TaskManager(include_path=str(tmp_path / "tasks")),
        model_args=f"model={MODEL},base_url={fp32_server.base_url}/completions,tokenizer={tmp_path / 'tokenizer'},"
                   f"tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1")
    samples = results["samples"]["tokenmill_capitals"]
    assert len(samples) == len(QUESTIONS)
    checked, right = 0, 0
    for sample in samples:
        wants = []
        for (context, continuation), ((served, greedy),) in zip(sample["arguments"], sample["resps"]):
            start, rest = _encode_pair(tokenizer, context, continuation)
            with torch.no_grad():
                logprobs = model(torch.tensor([start + rest])).logits[0].float().log_softmax(-1)
            positions = range(len(start) - 1, len(start) + len(rest) - 1)
            want = sum(logprobs[p, t].item() for p, t in zip(positions, rest))
            assert abs(served - want) < 1e-3, (context, continuation, served, want)
            assert greedy == all(logprobs[p].argmax().item() == t for p, t in zip(positions, rest))
            wants.append(want)
            checked += 1
        right += max(range(len(wants)), key=wants.__getitem__) == sample["doc"]["answer"]
    assert checked == sum(len(q["choices"]) for q in QUESTIONS)
    assert results["results"]["tokenmill_capitals"]["acc,none"] == right / len(QUESTIONS)
