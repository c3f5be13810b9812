"""A chat request's tools -> how it is served (ToolPlan), and parsed calls -> OpenAI's assistant message."""

from __future__ import annotations

import json
from dataclasses import dataclass

from tokenmill.server.errors import bad_request
from tokenmill.server.structured import check
from tokenmill.structured.spec import GrammarSpec
from tokenmill.tools.formats import ToolFormat, structural_tag
from tokenmill.tools.parser import ToolCallParser
from tokenmill.tools.prompt import template_knows_tools


@dataclass(frozen=True)
class ToolPlan:
    """``active``: the model is offered tools and its output is read for calls; ``tools``: the definitions the
    prompt shows (OpenAI's shape); ``native``: the chat template renders them itself; ``grammar``: the structural
    tag that keeps every call well formed (auto), or forces one (required, a named function)."""

    active: bool = False
    tools: list[dict] | None = None
    native: bool = False
    grammar: GrammarSpec | None = None

    def parser(self, fmt: ToolFormat) -> ToolCallParser:
        """A parser of this request's output, knowing its tools' parameter schemas (XML formats type by them)."""
        return ToolCallParser(fmt, {t["function"]["name"]: t["function"].get("parameters") or {}
                                    for t in self.tools or []})


async def plan_tools(ctx, tools_given: list | None, choice, parallel_tool_calls: bool = True,
                     check_grammars: bool = True) -> ToolPlan:
    """Validates tools and tool_choice (400s naming them; each parameter schema and the tag that constrains the calls
    are checked like any grammar unless ``check_grammars`` is false: a prompt that is only rendered needs none).
    tool_choice defaults to auto with tools, none without; with none the tools are left out of the prompt, so the
    model has nothing to call."""
    if choice is not None and choice != "none" and not tools_given:
        raise bad_request("tool_choice needs tools", param="tool_choice")
    native = template_knows_tools(ctx.client.chat_template)
    if not tools_given or choice == "none":
        return ToolPlan(native=native)
    tools = [t.model_dump(exclude_none=True) for t in tools_given]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tool function names must be unique", param="tools")
    xgr_choice: str | dict = choice or "auto"
    if not isinstance(xgr_choice, str):
        if xgr_choice.function.name not in names:
            raise bad_request(f"tool_choice names a function that is not in tools: {xgr_choice.function.name}",
                              param="tool_choice")
        xgr_choice = xgr_choice.model_dump()
    for i, tool in enumerate(tools):
        tool["function"].setdefault("parameters", {"type": "object", "properties": {}})
        if check_grammars:
            await check(ctx, f"tools.{i}.function.parameters",
                        GrammarSpec("json_schema", json.dumps(tool["function"]["parameters"])))
    spec = GrammarSpec("structural_tag", structural_tag(ctx.tool_format, tools, xgr_choice, parallel_tool_calls))
    if check_grammars:
        await check(ctx, "tools", spec)
    return ToolPlan(True, tools, native, spec)


def tool_calls_message(parser: ToolCallParser) -> dict:
    """The assistant message of a parsed output: its calls, and the text before them as content (None when there
    are calls and no text, as OpenAI sends it)."""
    content = parser.content
    message = {"role": "assistant", "content": content, "refusal": None}
    if parser.calls:
        message["content"] = content if content.strip() else None
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in parser.calls]
    return message
