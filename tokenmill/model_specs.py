"""Several models behind one endpoint: the ``[[models]]`` and ``[[routes]]`` entries of the TOML config, pure data.
server/fleet.py serves them (one engine process each); server/routing.py applies the routes.

    [[models]]
    name = "small"                      # the id clients send as `model`
    aliases = ["gpt-4o-mini"]           # other ids for it
    # model = "/models/Qwen3-0.6B"      # checkpoint dir or .gguf; omitted: the embedded SmolLM2
    kv_cache_memory = "1GiB"            # any engine setting, for this model only
    load = "on_demand"                  # loaded at its first request, unloaded when idle (default: "startup")

    [[routes]]
    name = "auto"                       # a virtual model id
    rules = [{ prompt_tokens_above = 4000, model = "long" }, { tools = true, model = "large" }]
    default = "small"                   # when no rule matches
    fallbacks = ["large"]               # tried in order when the chosen model refuses (429 or 503)

The first ``[[models]]`` entry is the default model (a request without ``model``). Settings not named in an entry
come from the top level of the file (and the flags), as for a single model.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Server settings that make sense per model (its chat format and admission); the rest are the server's own.
PER_MODEL_SERVER_FIELDS = frozenset({"tool_call_parser", "reasoning_parser", "chat_template",
                                     "default_chat_template_kwargs", "admission_overcommit"})


class ModelSpec(BaseModel):
    """One served model; the fields not declared here (``model_extra``) are its engine settings."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str = Field(min_length=1)
    model: str | None = None
    aliases: tuple[str, ...] = ()
    load: Literal["startup", "on_demand"] = "startup"

    @property
    def settings(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    @property
    def ids(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


class RouteRule(BaseModel):
    """Matches when every condition it gives holds for the request; then ``model`` answers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    prompt_tokens_above: int | None = Field(None, ge=0)
    tools: bool | None = None  # the request offers tools (true) / offers none (false)
    json_schema: bool | None = None  # the request asks for a JSON schema (response_format / text.format)

    @model_validator(mode="after")
    def _some_condition(self) -> "RouteRule":
        if self.prompt_tokens_above is None and self.tools is None and self.json_schema is None:
            raise ValueError(f"a rule for {self.model!r} needs a condition (prompt_tokens_above, tools, json_schema)")
        return self


class RouteSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    rules: tuple[RouteRule, ...] = ()
    default: str
    fallbacks: tuple[str, ...] = ()

    @property
    def targets(self) -> tuple[str, ...]:
        return (*(r.model for r in self.rules), self.default, *self.fallbacks)


def check_fleet(models: list[ModelSpec], routes: list[RouteSpec], engine_fields: frozenset[str],
                server_fields: frozenset[str]) -> None:
    """ValueError where two models (or routes) share an id, a route names no model, or a model sets a field that is
    not an engine setting (server settings are the server's, except PER_MODEL_SERVER_FIELDS)."""
    seen: set[str] = set()
    for spec in models:
        for model_id in spec.ids:
            if model_id in seen:
                raise ValueError(f"models: the id {model_id!r} is given twice")
            seen.add(model_id)
        for field in spec.settings:
            if field in ("models", "routes", "served_model_name") or field not in engine_fields or (
                    field in server_fields and field not in PER_MODEL_SERVER_FIELDS):
                raise ValueError(f"models: {spec.name!r} sets {field!r}, which is not a per-model setting")
    for route in routes:
        if route.name in seen:
            raise ValueError(f"routes: the id {route.name!r} is already a model's or a route's")
        seen.add(route.name)
    served = {model_id for spec in models for model_id in spec.ids}
    for route in routes:
        missing = [target for target in route.targets if target not in served]
        if missing:
            raise ValueError(f"routes: {route.name!r} names models that are not served: {missing}")
