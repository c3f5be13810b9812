"""OpenAI request bodies (and the vLLM extensions tokenmill honors), validated by pydantic.

The contract is strict: a field nobody documents is a 400 naming it ("Unrecognized request argument supplied"), as
OpenAI answers. Accepted fields are of three kinds:
- honored: they change the answer as OpenAI (or vLLM, for its extensions) documents;
- accepted and without effect on the answer by their definition: ``user``, ``metadata``, ``store``,
  ``service_tier`` (``"flex"`` schedules the request as batch work: scheduler/priority.py), ``prompt_cache_key``,
  ``safety_identifier``, ``prediction`` (a latency hint);
- known but not served here (audio, web search, verbosity, the deprecated ``functions``): a 400 that says so
  (``UNSUPPORTED``), never a silent drop.
``reasoning_effort`` and ``chat_template_kwargs`` reach the chat template (server/chat.py ``template_kwargs``).
Sizes (stop strings, logit_bias entries, prompts, the body) are bounded by server/limits.py.

Every number of every request body is bounded here, where it is parsed: integers through the bounded types below
(within what the engine's int64 arrays hold, tighter where the field says so; token ids are then held to the model's
vocabulary, token counts to its context), floats finite (``allow_inf_nan=False``: NaN and Infinity are a 400), so no
value that passes validation can overflow anything downstream.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tokenmill.sampling.params import INT64_MAX, INT64_MIN

# OpenAI's own fields that tokenmill refuses, with the reason given in the 400.
UNSUPPORTED = {
    "functions": "the deprecated functions/function_call are not supported; send tools and tool_choice",
    "function_call": "the deprecated functions/function_call are not supported; send tools and tool_choice",
    "audio": "audio output is not supported",
    "web_search_options": "web search is not supported",
    "verbosity": "this model does not take verbosity",
}


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


# The bounded integers of the API: what the engine's int64 arrays hold.
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]  # a number of things (tokens, candidates); ranges may be tighter
Positive = Annotated[int, Field(ge=1, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]  # then held to the model's vocabulary
TopK = Annotated[int, Field(ge=-1, le=INT64_MAX)]  # -1 and 0: off; above the vocabulary: every token
_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,19}")  # ASCII digits only: int() also reads "²" and "١" as digits


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI's; there is no obfuscation to switch off


class JsonSchemaFormat(Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Strict):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None


class SamplingFields(Strict):
    """Fields shared by both endpoints; ranges are checked again by SamplingParams."""

    model: str
    n: Positive = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Accepted, no effect on the answer (see the module docstring).
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's sampling extensions.
    top_k: TopK | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Count = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's prefix-cache isolation: requests share cached prompt blocks only with requests of the same salt.
    cache_salt: str | None = Field(None, min_length=1)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not _TOKEN_ID_KEY.fullmatch(key) or not 0 <= int(key) <= INT64_MAX:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        return value


class ContentPart(Strict):
    type: str
    text: str | None = None
    # Non-text parts are named so that they get "only text content parts are supported", not "unrecognized".
    image_url: Any = None
    input_audio: Any = None
    file: Any = None
    refusal: str | None = None


class FunctionCall(Strict):
    name: str = Field(min_length=1)
    arguments: str


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    refusal: str | None = None  # assistant, as OpenAI returns it
    audio: Any = None
    function_call: Any = None


class FunctionDefinition(Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Positive | None = None
    max_completion_tokens: Positive | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    modalities: list[Literal["text", "audio"]] | None = None
    prediction: dict[str, Any] | None = None
    # Refused with a reason (UNSUPPORTED); typed loosely so that the reason, not a type error, is what comes back.
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    # Reasoning controls: set through the chat template's own switches (server/chat.py template_kwargs).
    reasoning_effort: ReasoningEffort | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the chat template


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Positive | None = 16
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's: the prompt tokens' logprobs, per choice
    suffix: str | None = None
    best_of: Positive | None = None


class TokenizeRequest(Strict):
    """vLLM's POST /tokenize: a completion prompt or chat messages (with tools as chat completions takes them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template has them)
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[TokenId]
