"""POST /v1/chat/completions, streaming (SSE) and not; tool calls in both, and the thinking of a reasoning model as
``reasoning_content`` apart from the answer (tools/reasoning.py; tool calls are read from the answer only)."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

from jinja2.exceptions import TemplateError

from tokenmill.engine.client import NoChatTemplate
from tokenmill.server.errors import APIError, bad_request, request_id
from tokenmill.server.logprobs import chat_logprobs
from tokenmill.server.protocol import UNSUPPORTED, ChatCompletionRequest, ChatMessage
from tokenmill.server.serving import ServerContext, make_requests, sampling_params
from tokenmill.server.tracker import Tracker
from tokenmill.server.structured import check, requested_grammar
from tokenmill.server.tool_calls import ToolPlan, plan_tools, tool_calls_message
from tokenmill.tools.thinking import after_thinking
from tokenmill.tools.parser import ToolCallParser
from tokenmill.tools.prompt import render_messages
from tokenmill.tools.split import reasoning_parser

log = logging.getLogger(__name__)


def _reject_unsupported(body: ChatCompletionRequest) -> None:
    for name, reason in UNSUPPORTED.items():
        if getattr(body, name) is not None:
            raise bad_request(reason, param=name)
    if body.modalities and body.modalities != ["text"]:
        raise bad_request("only text output is supported", param="modalities")


def openai_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Request messages -> plain dicts (developer -> system), with 400s for what cannot be served."""
    out = []
    for i, m in enumerate(messages):
        if m.audio is not None or m.function_call is not None:
            raise bad_request("audio and function_call in messages are not supported", param=f"messages.{i}")
        if isinstance(m.content, list):
            if any(part.type != "text" or part.text is None for part in m.content):
                raise bad_request("only text content parts are supported", param=f"messages.{i}.content")
            content = "".join(part.text for part in m.content)
        else:
            content = m.content or ""
        if m.role == "tool" and m.tool_call_id is None:
            raise bad_request("a tool message needs tool_call_id", param=f"messages.{i}.tool_call_id")
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


# What a request's chat_template_kwargs cannot set: the arguments of transformers' apply_chat_template and of its
# renderer (tests/server/test_hardening_requests.py holds this list to their signatures), the variables the renderer
# itself gives the template, and the special tokens' names (transformers lets template variables replace them).
RESERVED_TEMPLATE_ARGS = frozenset({
    "conversation", "conversations", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "raise_exception",
    "strftime_now", "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
    "additional_special_tokens"})


def template_kwargs(ctx: ServerContext, requested: dict[str, Any] | None, effort: str | None = None,
                    param: str = "chat_template_kwargs") -> dict[str, Any]:
    """The chat template's extra variables: the server's defaults, then a reasoning effort mapped onto the switches
    this template reads (``reasoning_effort`` as gpt-oss's takes it; ``enable_thinking`` as Qwen3's and GLM-4.5's:
    off only for effort "none"), then the request's own ``chat_template_kwargs``, which win. An effort the template
    has no switch for changes nothing (OpenAI's clients send one to every model)."""
    kwargs = dict(ctx.config.default_chat_template_kwargs)
    template = ctx.client.chat_template or ""
    if effort is not None:
        if "reasoning_effort" in template:
            kwargs["reasoning_effort"] = effort
        if "enable_thinking" in template:
            kwargs["enable_thinking"] = effort != "none"
    for name in requested or {}:
        if name in RESERVED_TEMPLATE_ARGS:
            raise bad_request(f"{name!r} is set by the server, not by chat_template_kwargs", param=f"{param}.{name}")
    return {**kwargs, **(requested or {})}


async def render_chat(ctx: ServerContext, messages: list[ChatMessage], tools: list | None, tool_choice,
                      parallel_tool_calls: bool = True, add_generation_prompt: bool = True,
                      check_grammars: bool = True, kwargs: dict[str, Any] | None = None
                      ) -> tuple[list[int], ToolPlan]:
    """A conversation -> its prompt tokens, and how its tools are served: the one rendering that chat completions and
    /tokenize share (the tools a plan leaves out are left out of both). ``kwargs``: the template's extra variables
    (``template_kwargs``)."""
    plan = await plan_tools(ctx, tools, tool_choice, parallel_tool_calls, check_grammars)
    try:
        rendered = render_messages(openai_messages(messages), plan.tools, ctx.tool_format, plan.native)
    except ValueError as exc:
        raise bad_request(str(exc), param="messages") from None
    try:
        prompt = await ctx.client.apply_chat_template(rendered, add_generation_prompt,
                                                      tools=plan.tools if plan.native else None,
                                                      template_kwargs=kwargs)
    except (TemplateError, NoChatTemplate) as exc:  # the template's own raise_exception, or no template
        raise bad_request(f"the chat template refused these messages: {exc}", param="messages") from None
    except Exception:  # anything else a template (or the code under it) may raise: the operator's log has it
        log.exception("request %s: the chat template failed", request_id())
        raise bad_request(f"the chat template could not render these messages (request id {request_id()})",
                          param="messages") from None
    return prompt, plan


async def prepare_chat(ctx: ServerContext, body: ChatCompletionRequest, key_name: str | None,
                       arrival: float, endpoint: str = "chat") -> Tracker:
    _reject_unsupported(body)
    constraint = requested_grammar(body)
    if constraint is not None and body.tools and body.tool_choice != "none":
        raise bad_request("an output constraint cannot be combined with tools unless tool_choice is 'none'",
                          param=constraint[0])
    kwargs = template_kwargs(ctx, body.chat_template_kwargs, body.reasoning_effort)
    prompt, plan = await render_chat(ctx, body.messages, body.tools, body.tool_choice, body.parallel_tool_calls,
                                     kwargs=kwargs)
    if constraint is not None:
        await check(ctx, *constraint)
    grammar_param = "tools" if plan.grammar else constraint[0] if constraint else None
    grammar = plan.grammar or (constraint[1] if constraint else None)
    if grammar is not None and ctx.reasoning is not None:  # the model thinks first; the constraint holds after
        grammar = after_thinking(grammar, ctx.reasoning)
        await check(ctx, grammar_param, grammar)
    top = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens or body.max_tokens
    params = sampling_params(body, max_tokens, top)
    if "gpt_oss" in (ctx.tool_format.name, ctx.reasoning.name if ctx.reasoning else None):
        params = dataclasses.replace(params, skip_special_tokens=False)  # harmony's markup is special tokens
    if grammar is not None:
        params = dataclasses.replace(params, grammar=grammar)
    requests, reservation, charge = make_requests(ctx, [prompt], params, "messages", arrival, key_name,
                                                  body.cache_salt, body.service_tier)
    return Tracker(ctx, endpoint, arrival, key_name, requests, reservation, charge, tools=plan,
                   grammar_param=grammar_param)


def split_reasoning(ctx: ServerContext, text: str) -> tuple[str | None, str]:
    """A whole output's thinking (None when there is none, or no reasoning format) and its answer."""
    if ctx.reasoning is None:
        return None, text
    split = reasoning_parser(ctx.reasoning)
    split.feed(text)
    split.finish()
    return split.reasoning or None, split.content


def _finish_reason(reason: str | None, parser: ToolCallParser | None) -> str | None:
    return "tool_calls" if reason == "stop" and parser is not None and parser.calls else reason


async def chat_response(ctx: ServerContext, body: ChatCompletionRequest, tracker: Tracker) -> dict[str, Any]:
    texts = [""] * len(tracker.requests)
    logprobs: list[list] = [[] for _ in tracker.requests]
    reasons: list[str | None] = [None] * len(tracker.requests)
    async for index, out in tracker.outputs():
        texts[index] += out.delta_text
        logprobs[index] += await chat_logprobs(ctx.client, out)
        reasons[index] = out.finish_reason
    choices = []
    for i, text in enumerate(texts):
        reasoning, text = split_reasoning(ctx, text)
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        parser = None
        if tracker.tools.active:  # tool calls are read from the answer only, never from the thinking
            parser = tracker.tools.parser(ctx.tool_format)
            parser.feed(text)
            parser.finish()
            message = tool_calls_message(parser)
        if ctx.reasoning is not None:
            message["reasoning_content"] = reasoning
        choices.append({"index": i, "message": message, "logprobs": {"content": logprobs[i]} if body.logprobs
                        else None, "finish_reason": _finish_reason(reasons[i], parser)})
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": ctx.model_name, "choices": choices, "usage": tracker.usage(body.n), "system_fingerprint": None}


async def chat_stream(ctx: ServerContext, body: ChatCompletionRequest, tracker: Tracker) -> AsyncIterator[str]:
    """SSE data payloads: a role chunk per choice, content (and tool-call) chunks, finish_reason on each choice's last
    chunk, an optional usage chunk with empty choices, then [DONE]. One id and created for all chunks.

    Tool calls stream as OpenAI's: a call's first delta carries its index, id, type and name with empty arguments;
    the next ones carry argument fragments, which concatenate to the call's arguments."""
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": ctx.model_name, "system_fingerprint": None}
    parsers = [tracker.tools.parser(ctx.tool_format) if tracker.tools.active else None for _ in tracker.requests]
    reasoners = [reasoning_parser(ctx.reasoning) if ctx.reasoning else None for _ in tracker.requests]

    def chunk(index: int, delta: dict, finish_reason: str | None = None, logprobs: list | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": {"content": logprobs} if logprobs else None,
                  "finish_reason": finish_reason}
        payload = {**head, "choices": [choice]}
        if include_usage:
            payload["usage"] = None
        return json.dumps(payload)

    for index in range(len(tracker.requests)):
        yield chunk(index, {"role": "assistant", "content": ""})
    try:
        async for index, out in tracker.outputs():
            lps = await chat_logprobs(ctx.client, out) if body.logprobs else None
            answer, reasoner = out.delta_text, reasoners[index]
            if reasoner is not None:
                thinking, answer = reasoner.step(answer, out.finished)
                if thinking:
                    yield chunk(index, {"reasoning_content": thinking})
            content, calls, parser = answer, [], parsers[index]
            if parser is not None:
                content, calls = parser.step(answer, out.finished)
            if calls and (content or lps):  # text before a call comes before it
                yield chunk(index, {"content": content}, None, lps)
                content, lps = "", None
            for call in calls:
                fragment: dict[str, Any] = {"index": call.index, "function": {"arguments": call.arguments}}
                if call.id is not None:
                    fragment.update(id=call.id, type="function")
                    fragment["function"]["name"] = call.name
                yield chunk(index, {"tool_calls": [fragment]})
            if content or out.finished or lps:
                delta = {"content": content} if content or lps else {}
                reason = _finish_reason(out.finish_reason, parser) if out.finished else None
                yield chunk(index, delta, reason, lps)
    except APIError as exc:
        yield json.dumps(exc.body())
    if include_usage:
        yield json.dumps({**head, "choices": [], "usage": tracker.usage(body.n)})
    yield "[DONE]"
