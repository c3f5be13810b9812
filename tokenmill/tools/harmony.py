"""gpt-oss's harmony format read out of generated text, incrementally (as ReasoningParser reads think tags): the
output is messages, each ``[<|start|>assistant]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>TEXT``
ended by ``<|end|>``, ``<|return|>`` or ``<|call|>``. The ``analysis`` channel is the reasoning; ``final`` (and a
``commentary`` message to the user) the answer; a message to ``functions.NAME`` is a tool call, passed on in one
canonical spelling (``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>``, wherever
the model put the recipient) for the gpt_oss tool format to read. Text that never opens a message is answer."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tokenmill.tools.reasoning import ReasoningFormat, ReasoningParser, held_back

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
MAX_HEADER_CHARS = 256  # a header longer than this without <|message|> was no header: answer text
_RECIPIENT = re.compile(r"to=(?:functions\.)?(?P<name>[^\s<]+)")


def tool_message(name: str, arguments: str) -> str:
    return f"{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json{MESSAGE}{arguments}<|call|>"


@dataclass
class HarmonyParser:
    fmt: ReasoningFormat
    state: str = "HEADER"  # HEADER: up to <|message|>; BODY: the message's text; PLAIN: no harmony, all answer
    header: str = ""
    kind: str = ""  # the open message's: reasoning, answer or tool
    pending: str = ""
    reasoning: str = ""
    content: str = ""

    def feed(self, delta: str) -> tuple[str, str]:
        text, reasoning, content = self.pending + delta, "", ""
        self.pending = ""
        while text:
            if self.state == "PLAIN":
                content, text = content + text, ""
            elif self.state == "HEADER":
                header, text = self.header + text, ""
                at = header.find(MESSAGE)
                if at < 0:
                    self.header = header
                    if len(header) > MAX_HEADER_CHARS:
                        content, self.header, self.state = content + header, "", "PLAIN"
                    continue
                self.header, text = header[:at], header[at + len(MESSAGE):]
                content += self._open()
                self.state = "BODY"
            else:
                ends = [(i, end) for end in ENDS if (i := text.find(end)) >= 0]
                if ends:
                    at, end = min(ends)
                    part, text = text[:at], text[at + len(end):]
                    self.state, self.header = "HEADER", ""
                else:
                    keep = max(held_back(text, end) for end in ENDS)
                    part, self.pending, text = text[:len(text) - keep], text[len(text) - keep:], ""
                if self.kind == "reasoning":
                    reasoning += part
                else:
                    content += part + ("<|call|>" if self.kind == "tool" and self.state == "HEADER" else "")
        self.reasoning += reasoning
        self.content += content
        return reasoning, content

    def _open(self) -> str:
        """The message whose header just ended: what kind it is; a tool call's canonical header."""
        header = self.header.replace(START, "")
        recipient = _RECIPIENT.search(header)
        channel = header.split(CHANNEL, 1)[-1].split()[0] if CHANNEL in header else ""
        if recipient is not None:
            self.kind = "tool"
            return tool_message(recipient.group("name"), "")[:-len("<|call|>")]
        self.kind = "reasoning" if channel.startswith("analysis") else "answer"
        return ""

    step = ReasoningParser.step  # feed, and finish too at the last delta: the same for both readers

    def finish(self) -> tuple[str, str]:
        """The end of the output: an open message ends; a header that never got its <|message|> is answer text."""
        rest, self.pending = self.pending, ""
        if self.state == "HEADER":
            rest, self.header = self.header + rest, ""
            self.content += rest
            return "", rest
        if self.state == "BODY" and self.kind == "reasoning":
            self.reasoning += rest
            return rest, ""
        rest += "<|call|>" if self.state == "BODY" and self.kind == "tool" else ""
        self.content += rest
        return "", rest
