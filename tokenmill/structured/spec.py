"""GrammarSpec: what a request's output must match, as plain data (it crosses the process boundary)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GrammarKind = Literal["json_object", "json_schema", "regex", "choice", "grammar", "structural_tag"]


@dataclass(frozen=True)
class GrammarSpec:
    """``value`` by kind: json_object: ""; json_schema: the schema as JSON text; regex: the pattern; choice: a JSON
    list of the allowed strings; grammar: EBNF (xgrammar's dialect of GBNF); structural_tag: xgrammar's structural
    tag as JSON (tool calls in a model's own format). Equal specs compile to the same grammar (the cache key)."""

    kind: GrammarKind
    value: str = ""
