"""Structured-output fields of a request -> one GrammarSpec, validated here so a bad schema is a 400 before any
engine work (the engine compiles the same spec for its tokenizer)."""

from __future__ import annotations

import json
from typing import Any

from tokenmill.server.errors import bad_request
from tokenmill.server.protocol import SamplingFields
from tokenmill.structured.grammar import GrammarError, build_grammar
from tokenmill.structured.spec import GrammarSpec


def _schema_text(schema: dict[str, Any] | str | bool, param: str) -> str:
    if isinstance(schema, str):
        try:
            json.loads(schema)
        except ValueError as exc:
            raise bad_request(f"the JSON schema is not valid JSON: {exc}", param=param) from None
        return schema
    return json.dumps(schema)


def _candidates(body: SamplingFields) -> list[tuple[str, GrammarSpec]]:
    """(param, spec) for each constraint the request asks for."""
    found = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", GrammarSpec("json_object")))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request("response_format of type json_schema needs json_schema.schema",
                              param="response_format.json_schema")
        param = "response_format.json_schema.schema"
        found.append((param, GrammarSpec("json_schema", _schema_text(fmt.json_schema.schema_, param))))
    so = body.structured_outputs
    if so is not None:
        given = {k: v for k, v in so.model_dump(by_alias=True).items() if v not in (None, False)}
        if len(given) != 1:
            raise bad_request("structured_outputs takes exactly one of json, regex, choice, grammar, json_object, "
                              "structural_tag", param="structured_outputs")
        (key, value), = given.items()
        param = f"structured_outputs.{key}"
        found.append((param, _spec_of(key, value, param)))
    for key in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{key}")
        if value is not None:
            found.append((f"guided_{key}", _spec_of(key, value, f"guided_{key}")))
    return found


def _spec_of(key: str, value: Any, param: str) -> GrammarSpec:
    if key == "json":
        return GrammarSpec("json_schema", _schema_text(value, param))
    if key == "json_object":
        return GrammarSpec("json_object")
    if key == "choice":
        return GrammarSpec("choice", json.dumps(value))
    return GrammarSpec(key, value)  # regex, grammar, structural_tag: text as given


def requested_grammar(body: SamplingFields) -> tuple[str, GrammarSpec] | None:
    """The request's output constraint as (param, spec), validated; None when it asks for none."""
    found = _candidates(body)
    if len(found) > 1:
        raise bad_request(f"only one output constraint may be given, got {', '.join(p for p, _ in found)}",
                          param=found[1][0])
    if not found:
        return None
    validate(*found[0])
    return found[0]


def validate(param: str, spec: GrammarSpec) -> None:
    try:
        build_grammar(spec)
    except GrammarError as exc:
        raise bad_request(f"invalid {spec.kind.replace('_', ' ')}: {exc}", param=param) from None
