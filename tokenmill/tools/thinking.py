"""Constraints that start once the thinking closes: a reasoning model (tools/reasoning.py) thinks freely, then its
answer follows the request's grammar (a JSON schema, a tool call...), as vLLM applies structured outputs only after
the reasoning ends. The grammar becomes one xgrammar structural tag: thinking, then the constraint. Where the
generation prompt opened the thinking (deepseek_r1), the output is thinking up to the end tag; where the model opens
it itself (qwen3, glm45), a thinking part is optional (a template with thinking switched off writes none).
A regex or grammar that writes the end tag itself constrains the thinking too: it is kept as given."""

from __future__ import annotations

import json
import re

from tokenmill.structured.spec import GrammarSpec
from tokenmill.tools.reasoning import ReasoningFormat


def _element(spec: GrammarSpec) -> dict:
    """The constraint as a structural-tag element."""
    if spec.kind == "json_schema":
        return {"type": "json_schema", "json_schema": json.loads(spec.value)}
    if spec.kind == "json_object":
        return {"type": "json_schema", "json_schema": {"type": "object"}}
    if spec.kind == "regex":
        return {"type": "regex", "pattern": spec.value}
    if spec.kind == "choice":
        return {"type": "regex", "pattern": "|".join(f"(?:{re.escape(c)})" for c in json.loads(spec.value))}
    if spec.kind == "grammar":
        return {"type": "grammar", "grammar": spec.value}
    return json.loads(spec.value)["format"]  # a structural tag: its format


def after_thinking(spec: GrammarSpec, fmt: ReasoningFormat) -> GrammarSpec:
    if spec.kind in ("regex", "grammar") and fmt.end in spec.value:
        return spec
    inner = _element(spec)
    if fmt.starts_inside:
        thinking = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": fmt.end}
        body = {"type": "sequence", "elements": [thinking, {"type": "regex", "pattern": fmt.separator}, inner]}
    else:
        thinking = {"type": "tag", "begin": fmt.start, "content": {"type": "any_text"}, "end": fmt.end}
        body = {"type": "or", "elements": [
            {"type": "sequence", "elements": [thinking, {"type": "regex", "pattern": fmt.separator}, inner]}, inner]}
    return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": body}))
