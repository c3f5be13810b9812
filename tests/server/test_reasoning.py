"""Models whose chat template thinks (a tiny Qwen3 with templates that write <think>): forced by a regex constraint to
emit ``<think>...</think>answer``, chat completions return ``reasoning_content`` apart from ``content``; with a
template that opens the thinking itself (DeepSeek-R1's way), the Messages API returns the thinking as a thinking
block and chat as reasoning_content; streamed and not, as the openai and anthropic SDKs parse them."""

import json
import re

import httpx
import openai
import pytest

from tests.family_checkpoints import make_family_checkpoint
from tests.live_server import inprocess_server

anthropic = pytest.importorskip("anthropic")

CONVERSATION = (
    "{% if reasoning_effort is defined %}<|im_start|>system\nReasoning: {{ reasoning_effort }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}")
# Qwen3's thinking switch (enable_thinking=false closes an empty thinking), and gpt-oss's reasoning_effort variable.
THINKING_TEMPLATE = CONVERSATION + (
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is "
    "false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}")
FORCED = r"<think>[a-z]{3,8}( [a-z]{3,8}){1,3}</think>\n\n[A-Z][a-z]{2,8}"


def _serve(tmp_path_factory, smollm_llm, name: str, template: str):
    """A tiny Qwen3 checkpoint with ``template`` as its chat template, served in this process."""
    path = tmp_path_factory.mktemp(name)
    make_family_checkpoint(path, smollm_llm.tokenizer.hf, "qwen3")
    config_file = path / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "chat_template": template}))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    with inprocess_server(model=str(path), dtype="float32", kv_cache_memory="16MiB",
                          enforce_eager=True) as (root, _):
        yield root, path.name, path


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm_llm):
    yield from _serve(tmp_path_factory, smollm_llm, "thinking", THINKING_TEMPLATE)


def test_chat_returns_the_thinking_apart_from_the_answer(server):
    root, model, _ = server
    client = openai.OpenAI(base_url=root + "/v1", api_key="unused", max_retries=0)
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=40, temperature=0,
                  extra_body={"structured_outputs": {"regex": FORCED}})
    message = client.chat.completions.create(**kwargs).choices[0].message
    thinking = message.model_extra["reasoning_content"]
    # The two parts are exactly the forced output's, less the tags and the newlines between them.
    assert thinking and re.fullmatch(FORCED, f"<think>{thinking}</think>\n\n{message.content}")
    assert "<" not in thinking + message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == \
        message.model_extra["reasoning_content"]
    assert "".join(d.content or "" for d in deltas) == message.content


R1_TEMPLATE = CONVERSATION + "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"


@pytest.fixture(scope="module")
def r1_server(tmp_path_factory, smollm_llm):
    """The template opens the thinking in the generation prompt (DeepSeek-R1's way): the output starts inside it."""
    yield from _serve(tmp_path_factory, smollm_llm, "r1", R1_TEMPLATE)


def test_messages_put_the_thinking_in_a_thinking_block(r1_server):
    root, model, _ = r1_server
    question = [{"role": "user", "content": "Hi"}]
    prompt = httpx.post(root + "/tokenize", json={"messages": question}).json()["tokens"]
    raw = httpx.post(root + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 12,
                                                     "temperature": 0}).json()["choices"][0]["text"]
    thinking, _, answer = raw.partition("</think>")  # R1: everything before the end tag is thinking
    client = anthropic.Anthropic(base_url=root, api_key="unused", max_retries=0)
    kwargs = dict(model=model, max_tokens=12, messages=question, extra_body={"temperature": 0})
    m = client.messages.create(**kwargs)
    assert m.content[0].type == "thinking" and m.content[0].thinking == thinking
    assert [b.text for b in m.content[1:]] == ([answer.lstrip("\n")] if answer.lstrip("\n") else [])
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in m.content]
    chat = openai.OpenAI(base_url=root + "/v1", api_key="unused", max_retries=0).chat.completions.create(
        model=model, messages=question, max_tokens=12, temperature=0).choices[0].message
    assert chat.model_extra["reasoning_content"] == thinking


def test_responses_return_the_thinking_as_a_reasoning_item(server):
    root, model, _ = server
    client = openai.OpenAI(base_url=root + "/v1", api_key="unused", max_retries=0)
    kwargs = dict(model=model, input="Hi", max_output_tokens=40, temperature=0,
                  extra_body={"structured_outputs": {"regex": FORCED}})
    r = client.responses.create(**kwargs)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    thinking = r.output[0].content[0].text
    assert re.fullmatch(FORCED, f"<think>{thinking}</think>\n\n{r.output_text}")
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=40,
                                          temperature=0, extra_body=kwargs["extra_body"]).choices[0].message
    assert (chat.model_extra["reasoning_content"], chat.content) == (thinking, r.output_text)
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thinking
    done = [e.text for e in events if e.type == "response.reasoning_text.done"]
    assert done == [thinking] and [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output_text == r.output_text


def test_reasoning_switches_reach_the_template(server):
    """reasoning_effort (chat), reasoning.effort (Responses), thinking (Messages) and chat_template_kwargs render the
    prompt that transformers renders from the same template with the same variables."""
    root, model, path = server
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(path)
    question = [{"role": "user", "content": "Hi"}]

    def want(**variables) -> list[int]:
        text = hf.apply_chat_template(question, add_generation_prompt=True, tokenize=False, **variables)
        return hf.encode(text, add_special_tokens=False)
    client = openai.OpenAI(base_url=root + "/v1", api_key="unused", max_retries=0)

    def chat_prompt(**kwargs) -> int:
        answer = client.chat.completions.create(model=model, messages=question, max_tokens=1, **kwargs)
        return answer.usage.prompt_tokens
    off = want(enable_thinking=False, reasoning_effort="none")
    assert len(off) > len(want())
    assert chat_prompt(reasoning_effort="none") == len(off)
    assert chat_prompt(reasoning_effort="high") == len(want(enable_thinking=True, reasoning_effort="high"))
    assert chat_prompt(extra_body={"chat_template_kwargs": {"enable_thinking": False}}) == \
        len(want(enable_thinking=False))
    tokens = httpx.post(root + "/tokenize", json={"messages": question, "chat_template_kwargs": {
        "enable_thinking": False}}).json()["tokens"]
    assert tokens == want(enable_thinking=False)
    r = client.responses.create(model=model, input="Hi", reasoning={"effort": "low"}, max_output_tokens=1)
    assert r.usage.input_tokens == len(want(enable_thinking=True, reasoning_effort="low"))
    messages = anthropic.Anthropic(base_url=root, api_key="unused", max_retries=0).messages
    assert messages.count_tokens(model=model, messages=question, thinking={"type": "disabled"}).input_tokens == len(off)
    low = want(enable_thinking=True, reasoning_effort="low")
    assert messages.count_tokens(model=model, messages=question, thinking={
        "type": "enabled", "budget_tokens": 2048}).input_tokens == len(low)
    reserved = httpx.post(root + "/v1/chat/completions", json={"model": model, "messages": question,
                                                               "chat_template_kwargs": {"tools": []}})
    assert reserved.status_code == 400 and reserved.json()["error"]["param"] == "chat_template_kwargs.tools"



def test_chat_template_file_replaces_the_checkpoints(tmp_path_factory, smollm_llm):
    """--chat-template FILE: the server renders with the operator's template (here one that thinks, over a
    checkpoint whose own template does not), and reads its reasoning format from it."""
    path = tmp_path_factory.mktemp("override")
    make_family_checkpoint(path, smollm_llm.tokenizer.hf, "qwen3")
    template = path / "override.jinja"
    template.write_text(R1_TEMPLATE)
    question = [{"role": "user", "content": "Hi"}]
    with inprocess_server(model=str(path), dtype="float32", kv_cache_memory="16MiB", enforce_eager=True,
                          chat_template=str(template)) as (root, state):
        tokens = httpx.post(root + "/tokenize", json={"messages": question}).json()["tokens"]
        assert state.ctx.reasoning.name == "deepseek_r1"
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(path)
    text = hf.apply_chat_template(question, chat_template=R1_TEMPLATE, add_generation_prompt=True, tokenize=False)
    assert tokens == hf.encode(text, add_special_tokens=False) and text.endswith("<think>\n")
