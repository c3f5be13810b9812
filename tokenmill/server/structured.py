"""Structured-output fields of a request -> one GrammarSpec, checked before any engine work: compiled and tried for
the model's tokenizer within the server's time and size budget (EngineClient.check_grammar, off the event loop), so
that a bad or too costly grammar is a 400 naming its field and never reaches the engine."""

from __future__ import annotations

import json
from typing import Any

from tokenmill.server.errors import bad_request
from tokenmill.server.protocol import SamplingFields
from tokenmill.structured.checker import GrammarBudgetError
from tokenmill.structured.errors import GrammarError
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
    """The request's output constraint as (param, spec), not yet checked (``check``); None when it asks for none."""
    found = _candidates(body)
    if len(found) > 1:
        raise bad_request(f"only one output constraint may be given, got {', '.join(p for p, _ in found)}",
                          param=found[1][0])
    return found[0] if found else None


async def check(ctx, param: str, spec: GrammarSpec) -> None:
    """A 400 naming ``param`` when ``spec`` describes no grammar or costs more than the server allows."""
    try:
        await ctx.client.check_grammar(spec)
    except GrammarBudgetError as exc:
        raise bad_request(f"{param}: {exc}", param=param, code="grammar_too_costly") from None
    except GrammarError as exc:
        raise bad_request(f"invalid {spec.kind.replace('_', ' ')}: {exc}", param=param) from None
