"""The hand-made hostile requests of benchmarks/hostile_inputs.py: for each generation operation a valid body, and
hypothesis strategies that replace one to three of its fields with boundary values, wrong types, unicode digits as
logit_bias keys, huge arrays, deep nesting, bad UTF-8 bytes or empty strings.

A case is plain data, ``(mutations, stream)``; ``build`` turns it into the raw bytes sent. Values JSON cannot carry
as Python writes them go in as raw text: NaN / Infinity / -Infinity are the literals Python's json emits, nesting
5000 deep is spliced in as text (json.dumps would hit the recursion limit), bad UTF-8 bytes are spliced into a
string. Each mutation has a short description (``top_k=9223372036854775808``) that names it in the report.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable
from urllib.parse import quote

from hypothesis import strategies as st

NAN, INF = float("nan"), float("inf")
BOUNDARY = (0, -1, 1, 2**31, 2**31 - 1, -2**31, 2**63 - 1, 2**63, -2**63 - 1, 2**64, 10**30,
            1e308, -1e308, 1e-320, NAN, INF, -INF, 49151, 49152)  # the last two: SmolLM2's vocabulary edge
WRONG_TYPES = ("", "1", "abc", True, None, [], {}, [1], {"1": 1}, 1.5)
ODD_KEYS = ("²", "١", "①", "𝟙", "٣٤", "¹²", " 1", "1 ", "+1", "-1", "0x10", "1e3", "1_000", "1.5", "", "NaN",
            "Infinity", "9223372036854775808", "-9223372036854775809", "18446744073709551616", "4294967296",
            "1" * 30, "49152")
BAD_BYTES = (b"\xff", b"\xfe\xff", b"\xc3\x28", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82",
             b"\\ud800", b"\\udfff\\ud800", b"\\u0000")  # the last three: escapes of lone surrogates, NUL
DEPTHS = (50, 500, 5000)
X, DEEP = "@X@", "@DEEP@"  # where a template takes the value / the deep structure


@dataclass(frozen=True)
class Op:
    """One operation: ``base(model)`` a valid body (query parameters for a GET); targets are (path, template):
    the value goes where the template holds X (no template: the value itself)."""
    name: str
    api: str  # whose error shape and stream: openai | responses | anthropic
    base: Callable[[str], dict]
    numeric: tuple = ()
    strings: tuple = ()
    deep: tuple = ()  # (path, template with DEEP)
    huge: tuple = ()  # (path, kind, count)
    bias: bool = False
    stream: bool = False
    query: bool = False

    @property
    def method(self) -> str:
        return self.name.split()[0]

    @property
    def path(self) -> str:
        return self.name.split()[1]


def _t(*path, template=None):
    return (tuple(path), template)


SAMPLING = (_t("temperature"), _t("top_p"), _t("top_k"), _t("seed"))
PENALTIES = (_t("min_p"), _t("presence_penalty"), _t("frequency_penalty"), _t("repetition_penalty"))
IDS = [100, 200, X]
TOOL_CHAT = [{"type": "function", "function": {"name": "f", "parameters": DEEP}}]


def _chat(model: str) -> dict:
    return {"model": model, "messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Say hi."}],
            "max_tokens": 4, "n": 1, "seed": 7, "temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.01,
            "min_tokens": 0, "presence_penalty": 0.1, "frequency_penalty": 0.1, "repetition_penalty": 1.05,
            "logprobs": True, "top_logprobs": 2, "stop": ["\n\n"], "stop_token_ids": [2],
            "logit_bias": {"42": 0.5}, "metadata": {"tag": "hostile"}}


def _completion(model: str) -> dict:
    return {"model": model, "prompt": "Once upon a time", "max_tokens": 4, "n": 1, "seed": 7, "temperature": 0.8,
            "top_p": 0.95, "top_k": 40, "min_p": 0.01, "min_tokens": 0, "presence_penalty": 0.1,
            "frequency_penalty": 0.1, "repetition_penalty": 1.05, "logprobs": 2, "prompt_logprobs": 1,
            "stop": ["\n\n"], "stop_token_ids": [2], "logit_bias": {"42": 0.5}}


def _responses(model: str) -> dict:
    return {"model": model, "input": "Say hi.", "instructions": "Be brief.", "max_output_tokens": 4,
            "temperature": 0.8, "top_p": 0.95, "top_k": 40, "seed": 7, "store": False,
            "logit_bias": {"42": 0.5}, "metadata": {"tag": "hostile"}}


def _messages(model: str) -> dict:
    return {"model": model, "max_tokens": 4, "system": "Be brief.", "messages": [{"role": "user", "content": "Say hi."}],
            "temperature": 0.8, "top_p": 0.95, "top_k": 40, "stop_sequences": ["\n\n"],
            "metadata": {"user_id": "hostile"}}


def _count(model: str) -> dict:
    return {"model": model, "system": "Be brief.", "messages": [{"role": "user", "content": "Say hi."}]}


CHAT_NUMERIC = (*SAMPLING, *PENALTIES, _t("n"), _t("min_tokens"), _t("max_tokens"), _t("max_completion_tokens"),
                _t("top_logprobs"), _t("stop_token_ids", template=[2, X]), _t("logit_bias", template={"42": X}))
OPS = {op.name: op for op in (
    Op("POST /v1/chat/completions", "openai", _chat, stream=True, bias=True, numeric=CHAT_NUMERIC,
       strings=(_t("model"), _t("messages", 1, "content"), _t("messages", 0, "role"), _t("stop", template=[X]),
                _t("user"), _t("messages", 1, "content", template=[{"type": "text", "text": X}])),
       deep=(_t("metadata", template=DEEP), _t("tools", template=TOOL_CHAT),
             _t("messages", 1, "content", template=DEEP), _t("chat_template_kwargs", template=DEEP),
             _t("response_format", template={"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP}})),
       huge=((("stop",), "strings", 10**4), (("stop_token_ids",), "ids", 10**5), (("logit_bias",), "bias", 10**5),
             (("messages",), "messages", 10**4), (("messages", 1, "content"), "text", 10**6))),
    Op("POST /v1/completions", "openai", _completion, stream=True, bias=True,
       numeric=(*[t for t in CHAT_NUMERIC if t[0][0] not in ("max_completion_tokens", "top_logprobs")],
                _t("logprobs"), _t("prompt_logprobs"), _t("best_of"), _t("prompt", template=IDS),
                _t("prompt", template=[[100, X]])),
       strings=(_t("model"), _t("prompt"), _t("prompt", template=[X, "b"]), _t("stop", template=[X]), _t("suffix")),
       deep=(_t("metadata", template=DEEP), _t("prompt", template=DEEP),
             _t("structured_outputs", template={"json": DEEP})),
       huge=((("prompt",), "ids", 10**5), (("prompt",), "strings", 10**4), (("stop",), "strings", 10**4),
             (("stop_token_ids",), "ids", 10**5), (("logit_bias",), "bias", 10**5), (("prompt",), "text", 10**6))),
    Op("POST /v1/responses", "responses", _responses, stream=True, bias=True,
       numeric=(*SAMPLING, _t("max_output_tokens"), _t("top_logprobs"), _t("max_tool_calls"),
                _t("logit_bias", template={"42": X})),
       strings=(_t("model"), _t("input"), _t("instructions"), _t("input", template=[{"role": "user", "content": X}]),
                _t("previous_response_id")),
       deep=(_t("metadata", template=DEEP), _t("tools", template=[{"type": "function", "name": "f", "parameters": DEEP}]),
             _t("input", template=DEEP), _t("input", template=[{"role": "user", "content": DEEP}]),
             _t("text", template={"format": {"type": "json_schema", "name": "x", "schema": DEEP}})),
       huge=((("input",), "items", 10**4), (("logit_bias",), "bias", 10**5), (("input",), "text", 10**6))),
    Op("POST /v1/messages", "anthropic", _messages, stream=True,
       numeric=(_t("max_tokens"), _t("temperature"), _t("top_p"), _t("top_k"),
                _t("thinking", template={"type": "enabled", "budget_tokens": X})),
       strings=(_t("model"), _t("system"), _t("messages", 0, "content"), _t("stop_sequences", template=[X]),
                _t("messages", 0, "content", template=[{"type": "text", "text": X}])),
       deep=(_t("metadata", template=DEEP), _t("tools", template=[{"name": "f", "input_schema": DEEP}]),
             _t("messages", 0, "content", template=DEEP), _t("system", template=DEEP),
             _t("messages", 0, "content", template=[{"type": "text", "text": "hi", "x": DEEP}])),
       huge=((("stop_sequences",), "strings", 10**4), (("messages",), "amessages", 10**4),
             (("messages", 0, "content"), "text", 10**6))),
    Op("POST /v1/messages/count_tokens", "anthropic", _count,
       numeric=(_t("thinking", template={"type": "enabled", "budget_tokens": X}),
                _t("messages", 0, "content", template=[{"type": "text", "text": X}])),
       strings=(_t("model"), _t("system"), _t("messages", 0, "content")),
       deep=(_t("tools", template=[{"name": "f", "input_schema": DEEP}]),
             _t("messages", 0, "content", template=DEEP), _t("system", template=DEEP)),
       huge=((("messages",), "amessages", 10**4), (("messages", 0, "content"), "text", 10**6))),
    Op("POST /v1/embeddings", "openai", lambda m: {"model": m, "input": "Say hi."},
       numeric=(_t("dimensions"), _t("input", template=IDS), _t("input", template=[[100, X]])),
       strings=(_t("model"), _t("input"), _t("input", template=[X, "b"]), _t("encoding_format")),
       deep=(_t("input", template=DEEP),),
       huge=((("input",), "ids", 10**5), (("input",), "strings", 10**4), (("input",), "text", 10**6))),
    Op("POST /tokenize", "openai", lambda m: {"model": m, "prompt": "Say hi."},
       numeric=(_t("prompt"), _t("messages", template=[{"role": "user", "content": X}])),
       strings=(_t("model"), _t("prompt"), _t("messages", template=[{"role": "user", "content": X}])),
       deep=(_t("messages", template=[{"role": "user", "content": DEEP}]), _t("chat_template_kwargs", template=DEEP),
             _t("tools", template=TOOL_CHAT)),
       huge=((("prompt",), "text", 10**6), (("messages",), "messages", 10**4))),
    Op("POST /detokenize", "openai", lambda m: {"model": m, "tokens": [100, 200, 300]},
       numeric=(_t("tokens", template=IDS), _t("tokens", template=[X])),
       strings=(_t("model"),), deep=(_t("tokens", template=DEEP),), huge=((("tokens",), "ids", 10**5),)),
    Op("GET /v1/usage", "openai", lambda m: {"start": "0", "end": "4102444800"}, query=True,
       numeric=(_t("start"), _t("end")),
       strings=(_t("start"), _t("end"), _t("key"), _t("model"), _t("format")),
       huge=((("start",), "text", 10**4),)),
)}


@dataclass
class Built:
    method: str
    path: str  # with the query string
    body: bytes | None
    stream: bool
    atoms: list[str] = field(default_factory=list)


def describe(mutation: tuple) -> str:
    kind, path = mutation[0], ".".join(str(p) for p in mutation[1])
    if kind == "deep":
        return f"{path}=nested {mutation[3]} deep ({mutation[4]})"
    if kind == "huge":
        return f"{path}={mutation[2]} x {mutation[3]}"
    if kind == "utf8":
        return f"{path}=bad bytes {mutation[3]!r}"
    if kind == "bias_key":
        return f"logit_bias key {mutation[2]!r}"
    value = mutation[3]
    text = repr(value) if not isinstance(value, float) or math.isfinite(value) else json.dumps(value)
    return f"{path}={text}" + (f" in {json.dumps(mutation[2])}" if mutation[2] is not None else "")


def _fill(template: Any, placeholder: str, value: Any) -> Any:
    if template == placeholder:
        return value
    if isinstance(template, list):
        return [_fill(t, placeholder, value) for t in template]
    if isinstance(template, dict):
        return {k: _fill(v, placeholder, value) for k, v in template.items()}
    return template


def _set(body: dict, path: tuple, value: Any) -> None:
    node = body
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def _huge(kind: str, count: int) -> Any:
    if kind == "ids":
        return [(i * 7919) % 49000 + 100 for i in range(count)]
    if kind == "strings":
        return [f"stop{i}" for i in range(count)]
    if kind == "bias":
        return {str(100 + i): 0.1 for i in range(count)}
    if kind in ("messages", "amessages", "items"):
        return [{"role": ("user", "assistant")[i % 2], "content": "hi"} for i in range(count)]
    return "ab " * (count // 3)  # text


def _deep(depth: int, form: str) -> bytes:
    if form == "dict":
        return b'{"a":' * depth + b"1" + b"}" * depth
    return b"[" * depth + b"1" + b"]" * depth


def build(op: Op, model: str, mutations: tuple, stream: bool) -> Built:
    body = copy.deepcopy(op.base(model))
    raws: dict[str, bytes] = {}  # marker -> raw bytes: "@V0@" replaces a whole JSON value, "@S0@" a piece of a string
    last = {m[1]: m for m in mutations}  # one mutation a path: the last drawn
    applied = []
    for m in mutations:
        if last[m[1]] is not m:
            continue
        try:
            _apply(body, m, raws)
        except (KeyError, IndexError, TypeError):  # a path an earlier mutation took away
            continue
        applied.append(m)
    atoms = [describe(m) for m in applied]
    if op.query:
        return Built(op.method, op.path + "?" + _query(body, raws), None, False, atoms)
    if stream:
        body["stream"] = True
        atoms.append("stream=true")
    raw = json.dumps(body, allow_nan=True, ensure_ascii=False).encode()
    for marker, piece in raws.items():
        if marker.startswith("@V"):
            raw = raw.replace(f'"{marker}"'.encode(), piece)
        else:  # inside a string: a JSON escape goes in as it is, bytes as they are
            raw = raw.replace(marker.encode(), piece)
    return Built(op.method, op.path, raw, stream, atoms)


def _apply(body: dict, m: tuple, raws: dict[str, bytes]) -> None:
    kind, path = m[0], m[1]
    if kind == "huge":
        _set(body, path, _huge(m[2], m[3]))
    elif kind == "bias_key":
        _set(body, path, {m[2]: 1.0})
    elif kind == "deep":
        marker = f"@V{len(raws)}@"
        raws[marker] = _deep(m[3], m[4])
        _set(body, path, _fill(m[2], DEEP, marker) if m[2] is not None else marker)
    elif kind == "utf8":
        marker = f"@S{len(raws)}@"
        raws[marker] = m[3]
        _set(body, path, _fill(m[2], X, f"ab{marker}cd") if m[2] is not None else f"ab{marker}cd")
    else:  # num, type, empty
        _set(body, path, _fill(m[2], X, m[3]) if m[2] is not None else m[3])


def _query_value(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return json.dumps(value)  # NaN / Infinity / -Infinity
    if isinstance(value, (bool, type(None), list, dict)):
        return json.dumps(value)
    return str(value)


def _query(params: dict, raws: dict[str, bytes]) -> str:
    parts = []
    for key, value in params.items():
        text = quote(_query_value(value), safe="@")
        for marker, piece in raws.items():  # bad bytes in a query: percent-escaped as they are
            text = text.replace(marker, "".join(f"%{b:02X}" for b in piece))
        parts.append(f"{key}={text}")
    return "&".join(parts)


def mutation(op: Op, kind: str) -> st.SearchStrategy:
    """One mutation, plain data: (kind, path, template, value...)."""
    if kind == "huge":
        return st.sampled_from(op.huge).map(lambda h: ("huge", h[0], h[1], h[2]))
    if kind == "bias_key":
        return st.tuples(st.just("bias_key"), st.just(("logit_bias",)), st.sampled_from(ODD_KEYS))
    targets, values = {
        "num": (op.numeric, (st.sampled_from(BOUNDARY),)),
        "type": (op.numeric + op.strings, (st.sampled_from(WRONG_TYPES),)),
        "empty": (op.strings, (st.just(""),)),
        "utf8": (op.strings, (st.sampled_from(BAD_BYTES),)),
        "deep": (op.deep, (st.sampled_from(DEPTHS), st.sampled_from(["dict", "list"]))),
    }[kind]
    return st.tuples(st.sampled_from(targets), *values).map(lambda t: (kind, t[0][0], t[0][1], *t[1:]))


def sweep(op: Op) -> list[tuple]:
    """Every (numeric field, boundary value) pair of an operation and every odd logit_bias key, one mutation a case:
    the single-field cases a random draw of combinations may miss."""
    cases = [("num", path, template, value) for path, template in op.numeric for value in BOUNDARY]
    if op.bias:
        cases += [("bias_key", ("logit_bias",), key) for key in ODD_KEYS]
    return cases


def cases(op: Op) -> st.SearchStrategy:
    """(mutations, stream): one to three mutations of one operation's valid body, numbers first among them."""
    kinds = ["num"] * 4 + ["type", "empty", "utf8"] + ["deep"] * bool(op.deep) + ["huge"] * bool(op.huge)
    kinds += ["bias_key"] * 2 * op.bias

    @st.composite
    def draw_case(draw):
        count = draw(st.integers(1, 3))
        mutations = tuple(draw(mutation(op, draw(st.sampled_from(kinds)))) for _ in range(count))
        stream = op.stream and draw(st.integers(0, 2)) == 0  # a third of them streamed
        return mutations, stream
    return draw_case()
