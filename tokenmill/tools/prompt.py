"""Chat messages with tools -> what a chat template renders. A template that knows tools (it reads ``tools``) gets
them natively: tool definitions as ``tools``, past calls as ``tool_calls`` with arguments as objects, results as
``role: tool`` messages (transformers' convention). A template that does not (SmolLM2's) gets the same information
as text in the model's tool format: definitions in the system message, past calls in the assistant's content,
results as user turns in ``<tool_response>`` tags (Qwen2.5's rendering, which Hermes-format models are trained on)."""

from __future__ import annotations

import json
from typing import Any

from tokenmill.tools.formats import ToolFormat, arguments_json


def template_knows_tools(chat_template: str | None) -> bool:
    return "tools" in (chat_template or "")


def tools_system_prompt(fmt: ToolFormat, tools: list[dict]) -> str:
    signatures = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{signatures}\n"
            "</tools>\n\nFor each function call, reply with the function name and its JSON arguments like this:\n"
            + fmt.render_call("<function-name>", "<args-json-object>"))


def render_messages(messages: list[dict[str, Any]], tools: list[dict] | None, fmt: ToolFormat,
                    native: bool) -> list[dict[str, Any]]:
    """``messages`` in OpenAI's shape (past calls' arguments as JSON strings) -> the template's input; ValueError
    (naming the message) when a past call's arguments are not a JSON object."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls") or []
        try:
            parsed = [(c["function"]["name"], arguments_json(c["function"]["arguments"])) for c in calls]
        except ValueError as exc:
            raise ValueError(f"messages.{i}.tool_calls: {exc}") from None
        if native:
            rendered = {k: v for k, v in message.items() if k != "tool_calls"}
            if calls:
                rendered["tool_calls"] = [{"id": c["id"], "type": "function",
                                           "function": {"name": name, "arguments": args}}
                                          for c, (name, args) in zip(calls, parsed)]
            out.append(rendered)
        elif message["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"})
        else:
            text = [message["content"]] if message.get("content") else []
            text += [fmt.render_call(name, json.dumps(args, ensure_ascii=False)) for name, args in parsed]
            out.append({"role": message["role"], "content": "\n".join(text)})
    if tools and not native:
        prompt = tools_system_prompt(fmt, tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
