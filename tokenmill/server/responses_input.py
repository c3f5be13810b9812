"""The request of OpenAI's Responses API (POST /v1/responses) and its input items as chat messages.

Input items -> chat messages: a string is one user message; ``message`` items (easy or typed, text parts
``input_text`` / ``output_text`` / ``refusal``) keep their role (developer -> system, as chat does); consecutive
``function_call`` items become one assistant message's tool calls (joined to the assistant text just before them);
``function_call_output`` -> a tool message; ``reasoning`` items are not replayed to the model (as Anthropic's earlier
thinking is not). ``instructions`` is a system message first and is not carried over by ``previous_response_id``
(OpenAI's rule), whose conversation (input and output items) comes before this request's input.
Fields that name services this server has not (stored prompts, conversations, background runs, hosted tools) are a
400 that says so, never a silent drop.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from tokenmill.server.errors import bad_request
from tokenmill.server.protocol import (ChatMessage, FunctionCall, Int64, Positive, ReasoningEffort, Strict,
                                       StructuredOutputs, ToolCall, TopK)


class FunctionTool(Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class NamedFunctionChoice(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = Field(None, min_length=1, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted: no model here takes it


class Reasoning(Strict):
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # accepted: the whole reasoning is returned
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesStreamOptions(Strict):
    include_obfuscation: bool | None = None  # there is no obfuscation to switch off


# Fields of OpenAI's that need services this server has not: a 400 naming them when they are set.
NOT_SERVED = {"background": "background responses are not supported", "conversation": "conversations are not "
              "supported; pass previous_response_id or the whole input", "prompt": "stored prompts are not supported",
              "context_management": "context compaction is not supported", "max_tool_calls": "max_tool_calls is not "
              "supported", "top_logprobs": "logprobs are not supported by /v1/responses yet"}
# ``include`` values that need nothing more here (reasoning is never encrypted: the item carries it as text).
INCLUDABLE = {"reasoning.encrypted_content"}


class ResponsesRequest(Strict):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Positive | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    reasoning: Reasoning | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool = True
    previous_response_id: str | None = None
    include: list[str] | None = None
    # vLLM's extensions, as chat completions takes them.
    chat_template_kwargs: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None
    top_k: TopK | None = None
    seed: Int64 | None = None
    logit_bias: dict[str, float] | None = None
    # Accepted, without effect on the answer by their definition (accounting, routing and caching hints).
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # Refused when set (NOT_SERVED); typed loosely so the reason, not a type error, comes back.
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    max_tool_calls: Any = None
    top_logprobs: Any = None


def check_served(body: ResponsesRequest) -> None:
    for name, reason in NOT_SERVED.items():
        if getattr(body, name) not in (None, False, 0):
            raise bad_request(reason, param=name)
    for i, name in enumerate(body.include or []):
        if name not in INCLUDABLE:
            raise bad_request(f"include {name!r} is not supported", param=f"include.{i}")


def _text(content: Any, param: str, kinds: tuple[str, ...]) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("content must be a string or a list of parts", param)
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text", part.get("refusal")), str):
            raise bad_request(f"a {kind!r} part is not supported here (text parts only: {', '.join(kinds)})",
                              f"{param}.{i}")
        parts.append(part.get("text", part.get("refusal")))
    return "".join(parts)


def _need(item: dict, names: tuple[str, ...], param: str) -> None:
    for name in names:
        if not isinstance(item.get(name), str):
            raise bad_request(f"a {item.get('type')} item needs {name} (a string)", f"{param}.{name}")


def chat_messages(items: list[dict[str, Any]], param: str = "input") -> list[ChatMessage]:
    """Input items (as sent, or as stored from earlier responses) -> chat messages; a 400 naming the item."""
    out: list[ChatMessage] = []
    for i, item in enumerate(items):
        where = f"{param}.{i}"
        if not isinstance(item, dict):
            raise bad_request("an input item must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"a message's role must be user, assistant, system or developer, got {role!r}",
                                  f"{where}.role")
            kinds = ("output_text", "refusal") if role == "assistant" else ("input_text",)
            out.append(ChatMessage(role=role, content=_text(item.get("content"), f"{where}.content", kinds)))
        elif kind == "function_call":
            _need(item, ("call_id", "name", "arguments"), where)
            call = ToolCall(id=item["call_id"], function=FunctionCall(name=item["name"], arguments=item["arguments"]))
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                last.tool_calls = (last.tool_calls or []) + [call]
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            _need(item, ("call_id",), where)
            output = _text(item.get("output"), f"{where}.output", ("input_text",))
            out.append(ChatMessage(role="tool", tool_call_id=item["call_id"], content=output))
        elif kind == "reasoning":
            continue  # earlier thinking is not replayed to the model
        else:
            raise bad_request(f"input items of type {kind!r} are not supported", f"{where}.type")
    return out


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """This request's input as the items OpenAI lists them (``input_items``): a string is one user message, and a
    message's string content one text part (``output_text`` for the assistant, ``input_text`` otherwise)."""
    items = [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    out = []
    for item in items:
        if isinstance(item, dict) and item.get("type", "message") == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item = {**item, "type": "message", "content": [{"type": part, "text": item["content"]}]}
        out.append(item)
    return out
