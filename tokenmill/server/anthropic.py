"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) over the chat path.

A Messages request becomes a chat completion request (the one place prompts are rendered, tools planned and
constrained, sampling parameters validated): ``system`` -> a system message; text blocks -> message text; an
assistant's ``tool_use`` blocks -> its tool calls; a user's ``tool_result`` blocks -> tool messages (before the
user's text: they answer the calls just made); ``tools`` (``input_schema``) -> function tools; ``tool_choice``
auto / any / tool / none -> auto / required / the named function / none, ``disable_parallel_tool_use`` -> one call;
``stop_sequences`` -> stop strings. The answer comes back in Anthropic's shape: content blocks (text, then tool_use),
``stop_reason`` end_turn / max_tokens / stop_sequence (with the sequence) / tool_use, and usage in Anthropic's terms
(``input_tokens`` excludes the prompt tokens read from the prefix cache, counted as ``cache_read_input_tokens``).
Streams send Anthropic's events: message_start, ping, content_block_start / _delta (text_delta, input_json_delta) /
_stop per block, message_delta (stop_reason, usage), message_stop; an error after the start is an ``error`` event.

``output_config.format`` (a JSON schema) constrains the answer through the structured-output path. A reasoning
model's thinking (--reasoning-parser) comes first as a ``thinking`` block (``thinking_delta`` events; its signature is
empty: nothing here signs it). ``thinking`` switches the template's thinking (``_effort``). Not served: image and
document blocks, server tools.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tokenmill.server.chat import prepare_chat, render_chat, split_reasoning, template_kwargs
from tokenmill.server.errors import APIError, bad_request
from tokenmill.server.limits import check_limits
from tokenmill.sampling.params import INT64_MAX
from tokenmill.server.protocol import ChatCompletionRequest, ChatMessage, FunctionCall, Positive, ToolCall, TopK
from tokenmill.server.serving import ServerContext
from tokenmill.server.tracker import Tracker
from tokenmill.tools.parser import ToolCallParser
from tokenmill.tools.split import reasoning_parser


class _Strict(BaseModel):  # Anthropic's API refuses fields it does not know too; numbers bounded as OpenAI's are
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class AnthropicMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicTool(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class AnthropicToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1024, le=INT64_MAX)  # Anthropic's minimum
    display: str | None = None


class CountTokensRequest(_Strict):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: Thinking | None = None


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: OutputFormat | None = None  # honored: the answer follows the schema (structured outputs)
    effort: str | None = None  # accepted; no model served here reasons, so it changes nothing


class MessagesRequest(CountTokensRequest):
    max_tokens: Positive
    stop_sequences: list[str] | None = None
    stream: bool = False
    output_config: OutputConfig | None = None
    # Older clients' sampling fields (today's SDK sends them through extra_body).
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: TopK | None = None
    # Accepted, without effect on the answer by their definition (routing, caching hints, accounting).
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    container: Any = None
    diagnostics: Any = None
    inference_geo: str | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


def _text_of(blocks: str | list[dict[str, Any]] | None, param: str) -> str:
    """The text of a string or a list of text blocks (a system prompt, a tool result's content)."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    parts = []
    for i, block in enumerate(blocks):
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise bad_request(f"only text blocks are supported here, got {block.get('type')!r}", f"{param}.{i}")
        parts.append(block["text"])
    return "".join(parts)


def _messages(body: CountTokensRequest) -> list[ChatMessage]:
    out = [ChatMessage(role="system", content=_text_of(body.system, "system"))] if body.system else []
    for i, message in enumerate(body.messages):
        blocks = [{"type": "text", "text": message.content}] if isinstance(message.content, str) else message.content
        text, calls, results = [], [], []
        for j, block in enumerate(blocks):
            kind, param = block.get("type"), f"messages.{i}.content.{j}"
            if kind == "text" and isinstance(block.get("text"), str):
                text.append(block["text"])
            elif kind == "tool_use" and message.role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise bad_request("a tool_use block needs an id and a name", param)
                calls.append(ToolCall(id=block["id"], function=FunctionCall(
                    name=block["name"], arguments=json.dumps(block.get("input") or {}))))
            elif kind == "tool_result" and message.role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise bad_request("a tool_result block needs tool_use_id", param)
                results.append(ChatMessage(role="tool", tool_call_id=block["tool_use_id"],
                                           content=_text_of(block.get("content"), f"{param}.content")))
            elif kind in ("thinking", "redacted_thinking") and message.role == "assistant":
                continue  # earlier thinking is not replayed to the model
            else:
                raise bad_request(f"a {kind!r} block is not supported in a {message.role} message", param)
        if message.role == "user":
            out += results + ([ChatMessage(role="user", content="".join(text))] if text or not results else [])
        else:
            out.append(ChatMessage(role="assistant", content="".join(text) or None, tool_calls=calls or None))
    return out


def _tools(body: CountTokensRequest) -> tuple[list[dict] | None, Any, bool]:
    """OpenAI's tools, tool_choice and parallel_tool_calls for the request's."""
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                               "parameters": t.input_schema}} for t in body.tools or []] or None
    choice, parallel = body.tool_choice, True
    if choice is None:
        return tools, None, parallel
    if choice.type == "tool" and not choice.name:
        raise bad_request("tool_choice of type 'tool' needs the tool's name", "tool_choice.name")
    parallel = not choice.disable_parallel_tool_use
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
        {"type": "function", "function": {"name": choice.name}}
    return tools, mapped, parallel


def _effort(thinking: Thinking | None) -> str | None:
    """``thinking`` as a reasoning effort (the template's switches, server/chat.py template_kwargs): disabled is
    "none"; enabled maps its budget to low (< 4,096 tokens), medium (< 16,384) or high. The budget is not a hard
    limit on the thinking here; max_tokens bounds thinking and answer together."""
    if thinking is None:
        return None
    if thinking.type == "disabled":
        return "none"
    budget = thinking.budget_tokens or 16384
    return "low" if budget < 4096 else "medium" if budget < 16384 else "high"


def chat_request(body: CountTokensRequest, **fields: Any) -> ChatCompletionRequest:
    tools, choice, parallel = _tools(body)
    try:
        return ChatCompletionRequest(model=body.model, messages=_messages(body), tools=tools, tool_choice=choice,
                                     parallel_tool_calls=parallel, reasoning_effort=_effort(body.thinking), **fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise bad_request(f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from None


async def prepare_messages(ctx: ServerContext, body: MessagesRequest, key_name: str | None, arrival: float) -> Tracker:
    fmt = body.output_config.format if body.output_config else None
    response_format = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}} if fmt else None
    chat = chat_request(body, max_tokens=body.max_tokens, stop=body.stop_sequences, temperature=body.temperature,
                        top_p=body.top_p, top_k=body.top_k, response_format=response_format)
    check_limits(chat, ctx.config)
    return await prepare_chat(ctx, chat, key_name, arrival, endpoint="messages")


async def count_tokens(ctx: ServerContext, body: CountTokensRequest) -> dict[str, int]:
    chat = chat_request(body)
    prompt, _ = await render_chat(ctx, chat.messages, chat.tools, chat.tool_choice, chat.parallel_tool_calls,
                                  check_grammars=False, kwargs=template_kwargs(ctx, None, chat.reasoning_effort))
    return {"input_tokens": len(prompt)}


def _stop(reason: str | None, stop: int | str | None, parser: ToolCallParser | None) -> tuple[str, str | None]:
    if parser is not None and parser.calls:
        return "tool_use", None
    if reason == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def _usage(tracker: Tracker) -> dict[str, int]:
    usage = tracker.usage(1)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": usage["prompt_tokens"] - cached, "output_tokens": usage["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}  # cannot happen under the tools' grammar; never a 500
    return value if isinstance(value, dict) else {}


def _message(ctx: ServerContext, content: list[dict], stop: tuple[str, str | None] | None, usage: dict) -> dict:
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": ctx.model_name,
            "content": content, "stop_reason": stop[0] if stop else None,
            "stop_sequence": stop[1] if stop else None, "usage": usage}


async def messages_response(ctx: ServerContext, body: MessagesRequest, tracker: Tracker) -> dict[str, Any]:
    text, reason, stop = "", None, None
    async for _, out in tracker.outputs():
        text += out.delta_text
        reason, stop = out.finish_reason, out.stop_reason
    thinking, text = split_reasoning(ctx, text)
    parser = None
    if tracker.tools.active:
        parser = tracker.tools.parser(ctx.tool_format)
        parser.feed(text)
        parser.finish()
        text = parser.content
    content = [{"type": "thinking", "thinking": thinking, "signature": ""}] if thinking else []
    calls = parser.calls if parser else []
    content += [{"type": "text", "text": text}] if text or not (content or calls) else []
    content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c.arguments)}
                for c in calls]
    return _message(ctx, content, _stop(reason, stop, parser), _usage(tracker))


def _event(kind: str, **data: Any) -> dict[str, str]:
    return {"event": kind, "data": json.dumps({"type": kind, **data})}


async def messages_stream(ctx: ServerContext, body: MessagesRequest, tracker: Tracker) -> AsyncIterator[dict]:
    """Anthropic's event sequence; blocks open and close in order: the thinking, the text, then each tool call."""
    prompt = len(tracker.requests[0].prompt_token_ids)
    start = _message(ctx, [], None, {"input_tokens": prompt, "output_tokens": 0})
    yield _event("message_start", message=start)
    yield _event("ping")
    parser = tracker.tools.parser(ctx.tool_format) if tracker.tools.active else None
    reasoner = reasoning_parser(ctx.reasoning) if ctx.reasoning else None
    block: int | None = None  # the open block's index
    kind = None  # its type
    count, reason, stop = 0, None, None

    def open_block(new_kind: str, content_block: dict) -> list[dict]:
        nonlocal block, kind, count
        events = [] if block is None else close_block()
        block, kind, count = count, new_kind, count + 1
        return events + [_event("content_block_start", index=block, content_block=content_block)]

    def close_block() -> list[dict]:
        signature = [_event("content_block_delta", index=block, delta={"type": "signature_delta", "signature": ""})]
        return (signature if kind == "thinking" else []) + [_event("content_block_stop", index=block)]

    try:
        async for _, out in tracker.outputs():
            thinking, answer = "", out.delta_text
            if reasoner is not None:
                thinking, answer = reasoner.step(answer, out.finished)
            if thinking:
                if kind != "thinking":
                    for event in open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                        yield event
                yield _event("content_block_delta", index=block, delta={"type": "thinking_delta", "thinking": thinking})
            text, calls = answer, []
            if parser is not None:
                text, calls = parser.step(answer, out.finished)
            if text and kind != "text":
                for event in open_block("text", {"type": "text", "text": ""}):
                    yield event
            if text:
                yield _event("content_block_delta", index=block, delta={"type": "text_delta", "text": text})
            for call in calls:
                if call.id is not None:  # a new call: its block opens after the one before closes
                    for event in open_block("tool_use", {"type": "tool_use", "id": call.id, "name": call.name,
                                                         "input": {}}):
                        yield event
                if call.arguments:
                    yield _event("content_block_delta", index=block,
                                 delta={"type": "input_json_delta", "partial_json": call.arguments})
            if out.finished:
                reason, stop = out.finish_reason, out.stop_reason
    except APIError as exc:
        yield {"event": "error", "data": json.dumps(exc.anthropic_body())}
        return
    if block is not None:
        for event in close_block():
            yield event
    stop_reason, sequence = _stop(reason, stop, parser)
    yield _event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": sequence}, usage=_usage(tracker))
    yield _event("message_stop")
