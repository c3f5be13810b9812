"""Tool calls read out of generated text, incrementally: feed text deltas, get OpenAI-shaped events.

States: CONTENT (text before the first trigger is the message's content; a tail that may be the start of a trigger
is held back) -> HEADER (waiting for the format's header: it gives the function name, and ends where the arguments
begin) -> ARGUMENTS (the JSON value is scanned character by character -- strings, escapes, nesting -- and sent as
it comes; it ends where its outermost brace closes) -> BETWEEN (closers and separators are skipped until the next
header) -> HEADER ... Text after the first call that starts no call is dropped, as OpenAI returns none there.
A header that does not come within ``MAX_HEADER_CHARS`` of a trigger was no call: its text is content after all.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

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
    text: str = ""
    pos: int = 0  # text[:pos] is consumed
    state: str = "CONTENT"
    calls: list[ParsedCall] = field(default_factory=list)
    content: str = ""
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False

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
        rest = ""
        if self.state in ("CONTENT", "HEADER") and not self.calls:
            rest = self.text[self.pos:]
            self.pos = len(self.text)
        self.content += rest
        return rest, []

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
        call = ParsedCall(f"call_{uuid.uuid4().hex[:24]}", match.group("name").strip(), "")
        self.calls.append(call)
        deltas.append(ToolCallDelta(len(self.calls) - 1, call.id, call.name))
        self.pos = match.end()
        self.state, self._depth, self._in_string, self._escaped = "ARGUMENTS", 0, False, False
        return ""

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
        start = self._next_trigger(self.text[self.pos:])
        if start is None:
            return None
        self.pos += start
        self.state = "HEADER"
        return ""

    def _next_trigger(self, text: str) -> int | None:
        """Where the first call trigger in ``text`` starts."""
        return min((i for t in self.fmt.triggers if (i := text.find(t)) != -1), default=None)


def parse_tool_calls(fmt: ToolFormat, text: str) -> tuple[str, list[ParsedCall]]:
    """A whole output -> (content before the calls, the calls)."""
    parser = ToolCallParser(fmt)
    parser.feed(text)
    parser.finish()
    return parser.content, parser.calls
