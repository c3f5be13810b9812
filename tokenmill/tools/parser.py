"""Tool calls read out of generated text, incrementally: feed text deltas, get OpenAI-shaped events.

States: CONTENT (text before the first trigger is the message's content; a tail that may be the start of a trigger
is held back) -> HEADER (waiting for the format's header: it gives the function name, and ends where the arguments
begin) -> ARGUMENTS (the JSON value is scanned character by character -- strings, escapes, nesting -- and sent as
it comes; it ends where its outermost brace closes) -> BETWEEN (closers and separators are skipped until the next
header) -> HEADER ... Text after the first call that starts no call is dropped, as OpenAI returns none there.
Formats with XML parameters (qwen3_coder, glm45) go HEADER -> XML instead: each parameter is sent, once its value
is complete, as the next member of the call's JSON object, typed by the tool's schema (``schemas``: a string
parameter stays the text, any other is read as JSON where it parses), and the call's end closes the object.
Pythonic calls go HEADER -> PYTHON: the keyword arguments up to the call's closing parenthesis, sent as one JSON
object.
A header that does not come within ``MAX_HEADER_CHARS`` of a trigger was no call: its text is content after all.
"""

from __future__ import annotations

import ast
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from tokenmill.tools.formats import ToolFormat

MAX_HEADER_CHARS = 256


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None  # with the name, on a call's first delta only
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str


@dataclass
class ToolCallParser:
    fmt: ToolFormat
    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)  # function name -> its parameters' schema
    text: str = ""
    pos: int = 0  # text[:pos] is consumed
    state: str = "CONTENT"
    calls: list[ParsedCall] = field(default_factory=list)
    content: str = ""
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _xml_key: str | None = None  # the XML parameter whose value is being read

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        """The content and tool-call deltas that ``delta`` completes."""
        self.text += delta
        content, deltas = "", []
        while True:
            step = getattr(self, f"_{self.state.lower()}")(deltas)
            if step is None:
                break
            content += step
        self.content += content
        return content, deltas

    def step(self, delta: str, finished: bool) -> tuple[str, list[ToolCallDelta]]:
        """``feed``, and ``finish`` too at the output's last delta: what a stream sends for this delta."""
        content, deltas = self.feed(delta)
        if finished:
            more, late = self.finish()
            content, deltas = content + more, deltas + late
        return content, deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """At the end of the output: held-back text is content, and so is a trigger no header followed."""
        rest, late = "", []
        if self.state in ("CONTENT", "HEADER") and not self.calls:
            rest = self.text[self.pos:]
            self.pos = len(self.text)
        elif self.state == "XML":  # cut off inside a call: close the object it has so far
            late = [self._emit("}" if self.calls[-1].arguments else "{}")]
            self.state = "BETWEEN"
        self.content += rest
        return rest, late

    # --- states: each consumes what it can and returns content ("" for none), or None to wait for more text
    def _content(self, deltas: list[ToolCallDelta]) -> str | None:
        rest = self.text[self.pos:]
        start = self._next_trigger(rest)
        if start is not None:
            self.pos += start
            self.state = "HEADER"
            return rest[:start]
        keep = max((k for t in self.fmt.triggers for k in range(1, len(t)) if rest.endswith(t[:k])), default=0)
        if len(rest) - keep <= 0:
            return None
        self.pos += len(rest) - keep
        return rest[:len(rest) - keep]

    def _header(self, deltas: list[ToolCallDelta]) -> str | None:
        match = self.fmt.header.match(self.text, self.pos)
        if match is None:
            if not self.calls and len(self.text) - self.pos > MAX_HEADER_CHARS:  # no call after all
                self.state = "CONTENT"
                self.pos += 1
                return self.text[self.pos - 1]
            return None
        given_id = match.groupdict().get("id")
        call = ParsedCall(given_id.strip() if given_id else f"call_{uuid.uuid4().hex[:24]}",
                          match.group("name").strip(), "")
        self.calls.append(call)
        deltas.append(ToolCallDelta(len(self.calls) - 1, call.id, call.name))
        self.pos = match.end()
        self.state = "PYTHON" if self.fmt.python else "XML" if self.fmt.xml is not None else "ARGUMENTS"
        self._depth, self._in_string, self._escaped, self._xml_key = 0, False, False, None
        return ""

    def _xml(self, deltas: list[ToolCallDelta]) -> str | None:
        xml, call = self.fmt.xml, self.calls[-1]
        if self._xml_key is None:  # between parameters: the next one opens, or the call ends
            opened = xml.key.match(self.text, self.pos)
            if opened is not None:
                self._xml_key, self.pos = opened.group("key").strip(), opened.end()
                return ""
            rest = self.text[self.pos:]
            if not rest.lstrip().startswith(xml.call_end):
                return None
            self.pos += len(rest) - len(rest.lstrip()) + len(xml.call_end)
            deltas.append(self._emit("}" if call.arguments else "{}"))
            self.state = "BETWEEN"
            return ""
        end = self.text.find(xml.value_end, self.pos)
        if end < 0:
            return None
        # The whitespace around a value is the format's (the templates write "\nV\n"; xgrammar's XML grammar allows
        # a run of it on both sides), not the value's.
        value = self.text[self.pos:end].strip()
        self.pos = end + len(xml.value_end)
        member = f"{json.dumps(self._xml_key, ensure_ascii=False)}: {self._typed(call.name, self._xml_key, value)}"
        deltas.append(self._emit(("{" if not call.arguments else ", ") + member))
        self._xml_key = None
        return ""

    def _python(self, deltas: list[ToolCallDelta]) -> str | None:
        """A pythonic call's keyword arguments, up to the parenthesis that closes the call: sent whole, as JSON."""
        depth, quote, escaped = 0, None, False
        for end in range(self.pos, len(self.text)):
            ch = self.text[end]
            if quote is not None:
                escaped, quote = (False, quote) if escaped else (ch == "\\", None if ch == quote else quote)
            elif ch in "'\"":
                quote = ch
            elif ch in "([{":
                depth += 1
            elif ch in ")]}":
                if depth == 0:
                    deltas.append(self._emit(python_arguments(self.text[self.pos:end])))
                    self.pos, self.state = end + 1, "BETWEEN"
                    return ""
                depth -= 1
        return None

    def _typed(self, function: str, key: str, value: str) -> str:
        """An XML parameter's value as JSON: text for a string parameter (or one the schema does not type), else
        the value read as JSON where it parses (a number, a boolean, an object...)."""
        schema = self.schemas.get(function, {}).get("properties", {}).get(key, {})
        kinds = schema.get("type") or []
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if kinds and "string" not in kinds:
            try:
                return json.dumps(json.loads(value), ensure_ascii=False)
            except ValueError:
                pass
        return json.dumps(value, ensure_ascii=False)

    def _emit(self, fragment: str) -> ToolCallDelta:
        self.calls[-1].arguments += fragment
        return ToolCallDelta(len(self.calls) - 1, arguments=fragment)

    def _arguments(self, deltas: list[ToolCallDelta]) -> str | None:
        if not self.calls[-1].arguments:  # whitespace before the value may arrive after the header matched
            while self.pos < len(self.text) and self.text[self.pos].isspace():
                self.pos += 1
        start, end = self.pos, self.pos
        while end < len(self.text):
            ch = self.text[end]
            end += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                continue
            if ch == '"':
                self._in_string, self._escaped = True, False
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.state = "BETWEEN"
                    break
        if end == start:
            return None
        fragment = self.text[start:end]
        self.pos = end
        self.calls[-1].arguments += fragment
        if fragment:
            deltas.append(ToolCallDelta(len(self.calls) - 1, arguments=fragment))
        return ""

    def _between(self, deltas: list[ToolCallDelta]) -> str | None:
        start = self._next_trigger(self.text[self.pos:], self.fmt.next_calls or self.fmt.triggers)
        if start is None:
            return None
        self.pos += start
        self.state = "HEADER"
        return ""

    def _next_trigger(self, text: str, triggers: tuple[str, ...] = ()) -> int | None:
        """Where the first call trigger (of ``triggers``, or the format's) in ``text`` starts."""
        return min((i for t in triggers or self.fmt.triggers if (i := text.find(t)) != -1), default=None)


def python_arguments(text: str) -> str:
    """Python keyword arguments (``city="Paris", days=3``) as a JSON object; each value read as a Python literal, or
    as JSON where Python does not read it (``true`` inside a list); what is neither is its source text."""
    try:
        call = ast.parse(f"f({text})", mode="eval").body
    except SyntaxError:
        return "{}"
    values = {}
    for keyword in getattr(call, "keywords", []):
        if keyword.arg is None:
            continue
        source = ast.get_source_segment(f"f({text})", keyword.value) or ""
        try:
            values[keyword.arg] = ast.literal_eval(keyword.value)
        except ValueError:
            try:
                values[keyword.arg] = json.loads(source)
            except ValueError:
                values[keyword.arg] = source
    return json.dumps(values, ensure_ascii=False)


def parse_tool_calls(fmt: ToolFormat, text: str, schemas: dict[str, dict] | None = None
                     ) -> tuple[str, list[ParsedCall]]:
    """A whole output -> (content before the calls, the calls)."""
    parser = ToolCallParser(fmt, schemas or {})
    parser.feed(text)
    parser.finish()
    return parser.content, parser.calls
