"""Each tool-call format through a chat template that writes it (tiny Qwen3 checkpoints, the format read from the
template): a forced call comes back parsed into arguments that satisfy the tool's schema, streamed as whole; the
call and its result go back through the template exactly as transformers renders the same messages; the model then
answers. Kimi-K2's JSON in its own section tokens, Qwen3-Coder's and GLM-4.5's XML parameters, gpt-oss's harmony
channels (the call may come after an analysis message: its thinking), Mistral's [TOOL_CALLS]name[ARGS], and
Llama-4's pythonic calls."""

import json

import httpx
import jsonschema
import openai
import pytest

from tests.family_checkpoints import make_family_checkpoint
from tests.live_server import inprocess_server

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                            "parameters": PARAMETERS}}
TURNS = ("{%- for m in messages %}"
         "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content or '' }}CALLS<|im_end|>\n"
         "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
         "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
         "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
TOOLS = ("{%- if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t.function | tojson }}\n{% endfor %}"
         "Call them like this: EXAMPLE<|im_end|>\n{%- endif %}")
VALUE = "{{ v if v is string else v | tojson }}"
TEMPLATES = {
    "kimi_k2": (TOOLS.replace("EXAMPLE", "<|tool_calls_section_begin|>...") + TURNS.replace(
        "CALLS", "<|tool_calls_section_begin|>{% for tc in m.tool_calls %}<|tool_call_begin|>{{ tc.id }}"
                 "<|tool_call_argument_begin|>{{ tc.function.arguments | tojson }}<|tool_call_end|>{% endfor %}"
                 "<|tool_calls_section_end|>")),
    "qwen3_coder": (TOOLS.replace("EXAMPLE", "<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n"
                                             "</function>\n</tool_call>") + TURNS.replace(
        "CALLS", "{% for tc in m.tool_calls %}<tool_call>\n<function={{ tc.function.name }}>\n"
                 "{% for k, v in tc.function.arguments.items() %}<parameter={{ k }}>\n" + VALUE + "\n</parameter>\n"
                 "{% endfor %}</function>\n</tool_call>{% endfor %}")),
    "glm45": (TOOLS.replace("EXAMPLE", "<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n"
                                       "</tool_call>") + TURNS.replace(
        "CALLS", "{% for tc in m.tool_calls %}<tool_call>{{ tc.function.name }}\n"
                 "{% for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key>\n<arg_value>" + VALUE +
                 "</arg_value>\n{% endfor %}</tool_call>{% endfor %}")),
    "gpt_oss": (
        "{%- if tools %}<|start|>developer<|message|># Tools\n{% for t in tools %}{{ t.function | tojson }}\n"
        "{% endfor %}<|end|>{%- endif %}{%- for m in messages %}"
        "{%- if m.role == 'assistant' and m.tool_calls %}{% for tc in m.tool_calls %}<|start|>assistant<|channel|>"
        "commentary to=functions.{{ tc.function.name }} <|constrain|>json<|message|>"
        "{{ tc.function.arguments | tojson }}<|call|>{% endfor %}"
        "{%- elif m.role == 'tool' %}<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
        "{{ m.content }}<|end|>"
        "{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
        "{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"),
    "mistral": (
        "{%- for m in messages %}{%- if m.role == 'user' %}{% if tools %}[AVAILABLE_TOOLS]"
        "{% for t in tools %}{{ t.function | tojson }}{% endfor %}[/AVAILABLE_TOOLS]{% endif %}[INST]{{ m.content }}"
        "[/INST]{%- elif m.role == 'assistant' and m.tool_calls %}{% for tc in m.tool_calls %}[TOOL_CALLS]"
        "{{ tc.function.name }}[ARGS]{{ tc.function.arguments | tojson }}{% endfor %}</s>"
        "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
        "{%- else %}{{ m.content }}</s>{%- endif %}{%- endfor %}"),
    "pythonic": (TOOLS.replace("EXAMPLE", "[func_name1(params_name1=params_value1), func_name2(...)]") + TURNS.replace(
        "CALLS", "[{% for tc in m.tool_calls %}{{ tc.function.name }}({% for k, v in tc.function.arguments.items() %}"
                 "{{ k }}={{ v | tojson }}{% if not loop.last %}, {% endif %}{% endfor %}){% if not loop.last %}, "
                 "{% endif %}{% endfor %}]")),
}


@pytest.fixture(scope="module", params=list(TEMPLATES))
def served(request, tmp_path_factory, smollm_llm):
    path = tmp_path_factory.mktemp(request.param)
    make_family_checkpoint(path, smollm_llm.tokenizer.hf, "qwen3", max_position_embeddings=1024)
    config_file = path / "tokenizer_config.json"
    template = TEMPLATES[request.param]
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "chat_template": template}))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    with inprocess_server(model=str(path), dtype="float32", kv_cache_memory="16MiB",
                          enforce_eager=True) as (root, state):
        assert state.ctx.tool_format.name == request.param  # read from the template
        yield root, path


def test_a_forced_call_and_its_round_trip(served):
    root, path = served
    client = openai.OpenAI(base_url=root + "/v1", api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
    kwargs = dict(model=path.name, messages=ask, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                  temperature=0, max_tokens=120)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, PARAMETERS)
    assert call.function.name == "get_weather"
    streamed = {}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for fragment in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = streamed.setdefault(fragment.index, {"name": None, "arguments": ""})
            entry["name"] = fragment.function.name or entry["name"]
            entry["arguments"] += fragment.function.arguments or ""
    assert list(streamed.values()) == [{"name": "get_weather", "arguments": call.function.arguments}]
    # The call and its result go back; the prompt is transformers' rendering of the same conversation.
    history = ask + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
                     {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(path)
    native = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": arguments}} for c in
                                   m["tool_calls"]]} if m.get("tool_calls") else m for m in history]
    text = hf.apply_chat_template(native, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    tokens = httpx.post(root + "/tokenize", json={"messages": history, "tools": [WEATHER]}).json()["tokens"]
    assert tokens == hf.encode(text, add_special_tokens=False)
    answer = client.chat.completions.create(model=path.name, messages=history, tools=[WEATHER], tool_choice="none",
                                            temperature=0, max_tokens=8).choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.tool_calls is None
