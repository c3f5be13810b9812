"""OpenAI's Responses API (POST /v1/responses) over the chat path, as the Messages API is (server/anthropic.py).

A request becomes a chat completion request (responses_input.py: items -> messages; ``tools`` -> function tools;
``text.format`` -> response_format; ``reasoning.effort`` -> the template's thinking switches; ``max_output_tokens``
-> max_tokens), so prompts, tool grammars, structured outputs and sampling are the chat path's own. The answer comes
back as output items in order: a ``reasoning`` item (the thinking, when --reasoning-parser splits one), a ``message``
with one ``output_text`` part, then one ``function_call`` per call. A response cut by max_output_tokens is
``incomplete`` (``incomplete_details.reason``). Streams send the typed events the openai SDK accumulates by output and
content index, each with its ``sequence_number``: response.created, .in_progress, then per item
output_item.added, content_part.added / {output_text, reasoning_text}.delta / .done / content_part.done (or
function_call_arguments.delta / .done), output_item.done, and response.completed (or .incomplete; .failed for an
error after the start). ``store`` (default true) keeps the response for ``previous_response_id`` and GET
(response_store.py), under the caller's key.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from pydantic import ValidationError

from tokenmill.server.chat import prepare_chat, split_reasoning
from tokenmill.server.errors import APIError, bad_request
from tokenmill.server.limits import check_limits
from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.server.response_store import stored_size
from tokenmill.server.responses_input import ResponsesRequest, chat_messages, check_served, input_items
from tokenmill.server.serving import ServerContext
from tokenmill.server.tracker import Tracker
from tokenmill.tools.split import reasoning_parser


@dataclass
class Exchange:
    """One request's conversation and its tracker: what the answer is built from and what the store keeps."""

    body: ResponsesRequest
    key_name: str | None
    tracker: Tracker
    conversation: list[dict[str, Any]]  # the input items, previous responses' first
    response_id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=lambda: int(time.time()))


def _response_format(body: ResponsesRequest) -> dict | None:
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None or fmt.name is None:
        raise bad_request("a json_schema format needs a name and a schema", param="text.format")
    return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict,
                                                   "description": fmt.description}}


def _conversation(ctx: ServerContext, body: ResponsesRequest, key_name: str | None) -> list[dict[str, Any]]:
    if body.previous_response_id is None:
        return list(input_items(body))
    previous = ctx.responses.get(key_name, body.previous_response_id)
    if previous is None:
        raise APIError(404, f"Previous response with id '{body.previous_response_id}' not found.",
                       "invalid_request_error", param="previous_response_id", code="previous_response_not_found")
    return previous.input_items + previous.response["output"] + list(input_items(body))


async def prepare_response(ctx: ServerContext, body: ResponsesRequest, key_name: str | None,
                           arrival: float) -> Exchange:
    check_served(body)
    conversation = _conversation(ctx, body, key_name)
    messages = chat_messages(conversation)
    if not messages:
        raise bad_request("the input has no messages", param="input")
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    tools = [{"type": "function", "function": t.model_dump(include={"name", "description", "parameters", "strict"})}
             for t in body.tools or []] or None
    choice = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = {"type": "function", "function": {"name": choice.name}}
    try:
        chat = ChatCompletionRequest(
            model=body.model, messages=system + messages, tools=tools, tool_choice=choice,
            parallel_tool_calls=True if body.parallel_tool_calls is None else body.parallel_tool_calls,
            max_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p,
            response_format=_response_format(body), chat_template_kwargs=body.chat_template_kwargs,
            reasoning_effort=body.reasoning.effort if body.reasoning else None,
            structured_outputs=body.structured_outputs, top_k=body.top_k, seed=body.seed, logit_bias=body.logit_bias,
            service_tier=body.service_tier)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise bad_request(f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    check_limits(chat, ctx.config)
    if body.store and stored_size({}, conversation) > ctx.responses.max_item_bytes:
        raise bad_request(f"this conversation is larger than the {ctx.responses.max_item_bytes} bytes a stored "
                          "response may take (responses_store_max_item_bytes); send store: false, or less input",
                          param="store", code="limit_exceeded")
    tracker = await prepare_chat(ctx, chat, key_name, arrival, endpoint="responses")
    return Exchange(body, key_name, tracker, conversation)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _reasoning_item(item_id: str, text: str | None, status: str) -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [] if text is None else [{"type": "reasoning_text", "text": text}]}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str | None, status: str) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [] if text is None else [_text_part(text)]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


async def _usage(ctx: ServerContext, tracker: Tracker, reasoning: str) -> dict:
    usage = tracker.usage(1)
    thinking = len(await ctx.client.encode(reasoning, False)) if reasoning else 0
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"], "input_tokens_details": {
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens_details": {"reasoning_tokens": min(thinking, usage["completion_tokens"])}}


def response_object(ex: Exchange, ctx: ServerContext, status: str, output: list[dict], usage: dict | None,
                    incomplete: str | None = None, error: dict | None = None) -> dict[str, Any]:
    body = ex.body
    fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else \
        {"type": "text"}
    choice = body.tool_choice if isinstance(body.tool_choice, str) or body.tool_choice is None else \
        body.tool_choice.model_dump()
    return {
        "id": ex.response_id, "object": "response", "created_at": ex.created_at, "status": status,
        "completed_at": int(time.time()) if status == "completed" else None, "error": error,
        "incomplete_details": {"reason": incomplete} if incomplete else None, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "model": ctx.model_name, "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
        "store": body.store, "temperature": body.temperature, "text": {"format": fmt},
        "tool_choice": choice or "auto", "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "top_p": body.top_p, "truncation": body.truncation or "disabled", "usage": usage, "user": body.user,
        "metadata": body.metadata or {}}


def _finish(ex: Exchange, ctx: ServerContext, response: dict) -> dict:
    if ex.body.store and response["status"] != "failed":
        ctx.responses.put(ex.key_name, response, ex.conversation)
    return response


def _status(reason: str | None) -> tuple[str, str | None]:
    return ("incomplete", "max_output_tokens") if reason == "length" else ("completed", None)


async def whole_response(ctx: ServerContext, ex: Exchange) -> dict[str, Any]:
    text, reason = "", None
    async for _, out in ex.tracker.outputs():
        text += out.delta_text
        reason = out.finish_reason
    thinking, text = split_reasoning(ctx, text)
    reasoning, calls = thinking or "", []
    if ex.tracker.tools.active:  # tool calls are read from the answer only, never from the thinking
        parser = ex.tracker.tools.parser(ctx.tool_format)
        parser.feed(text)
        parser.finish()
        text, calls = parser.content, parser.calls
    status, incomplete = _status(reason)
    output = [_reasoning_item(_id("rs"), reasoning, "completed")] if reasoning else []
    if text or not calls:
        output.append(_message_item(_id("msg"), text, status))
    output += [_call_item(_id("fc"), c.id, c.name, c.arguments, "completed") for c in calls]
    usage = await _usage(ctx, ex.tracker, reasoning)
    return _finish(ex, ctx, response_object(ex, ctx, status, output, usage, incomplete))


class _Events:
    """The stream's items in order; each event gets the next sequence number. One item is open at a time."""

    def __init__(self, ex: Exchange, ctx: ServerContext):
        self.ex, self.ctx = ex, ctx
        self.sequence = 0
        self.output: list[dict] = []  # finished items
        self.open: dict | None = None  # the item being streamed, as it will be when done

    def event(self, kind: str, **data: Any) -> dict[str, str]:
        payload = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return {"event": kind, "data": json.dumps(payload)}

    def lifecycle(self, kind: str, status: str, usage: dict | None = None, incomplete: str | None = None,
                  error: dict | None = None) -> dict[str, str]:
        response = response_object(self.ex, self.ctx, status, list(self.output), usage, incomplete, error)
        if kind in ("response.completed", "response.incomplete"):
            _finish(self.ex, self.ctx, response)
        return self.event(kind, response=response)

    def start(self, item: dict, in_progress: dict) -> list[dict]:
        """Close the open item, then open ``item`` (``in_progress``: how output_item.added shows it)."""
        events = self.close()
        self.open = item
        events.append(self.event("response.output_item.added", output_index=len(self.output), item=in_progress))
        if item["type"] in ("message", "reasoning"):
            part = _text_part("") if item["type"] == "message" else {"type": "reasoning_text", "text": ""}
            events.append(self._part_event("response.content_part.added", part))
        return events

    def text_item(self, kind: str, text: str) -> list[dict]:
        """``text`` added to the open item of ``kind`` (reasoning or message), opened first if another is open."""
        events = []
        if self.open is None or self.open["type"] != kind:
            item_id = _id("rs" if kind == "reasoning" else "msg")
            make = _reasoning_item if kind == "reasoning" else _message_item
            events = self.start(make(item_id, "", "in_progress"), make(item_id, None, "in_progress"))
        return events + ([self.delta(text)] if text else [])

    def _part_event(self, kind: str, part: dict) -> dict:
        return self.event(kind, item_id=self.open["id"], output_index=len(self.output), content_index=0, part=part)

    def delta(self, text: str) -> dict:
        item, index = self.open, len(self.output)
        if item["type"] == "function_call":
            item["arguments"] += text
            return self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                              delta=text)
        item["content"][0]["text"] += text
        kind = "response.output_text.delta" if item["type"] == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if item["type"] == "message" else {}
        return self.event(kind, item_id=item["id"], output_index=index, content_index=0, delta=text, **extra)

    def close(self, status: str = "completed") -> list[dict]:
        item, index = self.open, len(self.output)
        if item is None:
            return []
        item["status"] = status if item["type"] == "message" else "completed"
        if item["type"] == "function_call":
            events = [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                 name=item["name"], arguments=item["arguments"])]
        else:
            part, kind = item["content"][0], "output_text" if item["type"] == "message" else "reasoning_text"
            extra = {"logprobs": []} if item["type"] == "message" else {}
            events = [self.event(f"response.{kind}.done", item_id=item["id"], output_index=index, content_index=0,
                                 text=part["text"], **extra),
                      self._part_event("response.content_part.done", part)]
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        self.open = None
        return events


async def response_stream(ctx: ServerContext, ex: Exchange) -> AsyncIterator[dict]:
    events = _Events(ex, ctx)
    yield events.lifecycle("response.created", "in_progress")
    yield events.lifecycle("response.in_progress", "in_progress")
    parser = ex.tracker.tools.parser(ctx.tool_format) if ex.tracker.tools.active else None
    reasoner = reasoning_parser(ctx.reasoning) if ctx.reasoning else None
    reason, reasoning = None, ""
    try:
        async for _, out in ex.tracker.outputs():
            thinking, answer = "", out.delta_text
            if reasoner is not None:
                thinking, answer = reasoner.step(answer, out.finished)
            if thinking:
                reasoning += thinking
                for event in events.text_item("reasoning", thinking):
                    yield event
            text, calls = (answer, []) if parser is None else parser.step(answer, out.finished)
            if text:
                for event in events.text_item("message", text):
                    yield event
            for call in calls:
                if call.id is not None:  # a new call: its item opens after the one before closes
                    item = _call_item(_id("fc"), call.id, call.name, "", "in_progress")
                    for event in events.start(item, dict(item)):
                        yield event
                if call.arguments:
                    yield events.delta(call.arguments)
            if out.finished:
                reason = out.finish_reason
    except APIError as exc:
        for event in events.close("incomplete"):
            yield event
        error = {"code": exc.code or exc.type, "message": exc.message}
        yield events.lifecycle("response.failed", "failed", error=error)
        return
    status, incomplete = _status(reason)
    if not events.output and events.open is None:  # nothing was said: still one (empty) message
        for event in events.text_item("message", ""):
            yield event
    for event in events.close(status):
        yield event
    usage = await _usage(ctx, ex.tracker, reasoning)
    yield events.lifecycle(f"response.{status}", status, usage, incomplete)
