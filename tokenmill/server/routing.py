"""From a request's ``model`` to the model that answers it: a served model by name or alias, or a ``[[routes]]``
entry (tokenmill/model_specs.py) whose rules read the request itself, with fallbacks tried in order while the chosen
model refuses for want of capacity (429 admission full, 503 loading or restarting: ``APIError.fallback``).

A key's ``models`` may name a model by its name or any alias (either grants every id of it) or a route; a route it
may use grants the models the route sends it to. Rules are read in order, the first that matches chooses;
``prompt_tokens_above`` counts the request's text (messages, prompt, input, system, instructions) with the route's
default model's tokenizer, plus any token-id prompt's length.

Usage: a generation request refused by the model that answers it (its validation, admission, a key's rates) counts
as a request and an error of that model in the ledger; one refused before it reaches a model (404, 503 while its
model loads) does not.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

from tokenmill.config import RouteSpec
from tokenmill.model_specs import RouteRule
from tokenmill.server.errors import APIError
from tokenmill.server.fleet import Fleet, ModelHost
from tokenmill.server.ledger import Usage
from tokenmill.server.serving import ServerContext
from tokenmill.server.tenants import Tenants

log = logging.getLogger(__name__)
T = TypeVar("T")
_TEXT_FIELDS = ("messages", "prompt", "input", "system", "instructions")


@dataclass(frozen=True)
class Shape:
    """What routing rules read of a request."""

    text: str
    num_token_ids: int  # tokens given as ids (a completions prompt of token ids)
    tools: bool
    json_schema: bool


def _collect(value: Any, texts: list[str]) -> int:
    """Append every string under ``value`` to ``texts``; return how many bare integers (token ids) it holds."""
    if isinstance(value, str):
        texts.append(value)
    elif isinstance(value, bool):
        return 0
    elif isinstance(value, int):
        return 1
    elif isinstance(value, dict):
        return sum(_collect(v, texts) for k, v in value.items() if k not in ("type", "role", "id", "call_id"))
    elif isinstance(value, (list, tuple)):
        return sum(_collect(v, texts) for v in value)
    return 0


def shape_of(body: Any) -> Shape:
    data = body.model_dump(include=set(_TEXT_FIELDS), exclude_none=True)
    texts: list[str] = []
    ids = _collect([data.get(f) for f in _TEXT_FIELDS], texts)
    formats = [getattr(body, "response_format", None), getattr(getattr(body, "text", None), "format", None),
               getattr(getattr(body, "output_config", None), "format", None)]
    json_schema = any(getattr(f, "type", None) == "json_schema" for f in formats if f is not None) or bool(
        getattr(getattr(body, "structured_outputs", None), "json_", None))
    return Shape("\n".join(texts), ids, bool(getattr(body, "tools", None)), json_schema)


def _matches(rule: RouteRule, shape: Shape, prompt_tokens: int | None) -> bool:
    return ((rule.tools is None or rule.tools == shape.tools)
            and (rule.json_schema is None or rule.json_schema == shape.json_schema)
            and (rule.prompt_tokens_above is None or (prompt_tokens or 0) > rule.prompt_tokens_above))


class Router:
    def __init__(self, fleet: Fleet, tenants: Tenants):
        self.fleet, self.tenants = fleet, tenants

    def _not_found(self, model_id: str) -> APIError:
        return APIError(404, f"The model `{model_id}` does not exist.", "invalid_request_error", param="model",
                        code="model_not_found")

    def _check_key(self, key_name: str | None, model_id: str | None, ids: tuple[str, ...]) -> None:
        """A 404 unless the key may use the model asked for by one of its ids (name, alias, route)."""
        if not any(self.tenants.may_use(key_name, i) for i in (model_id, *ids) if i is not None):
            self.tenants.check_model(key_name, model_id or ids[0])

    async def _prompt_tokens(self, route: RouteSpec, shape: Shape) -> int:
        """The request's prompt length in the route's default model's tokens (its other targets' when that one
        is not serving)."""
        for name in (route.default, *route.targets):
            host = self.fleet.find(name)
            ctx = host.ctx if host is not None else None  # read once: a failing engine's host drops it any time
            if ctx is not None and ctx.client.healthy:
                return len(await ctx.client.encode(shape.text)) + shape.num_token_ids
        return len(shape.text) // 4 + shape.num_token_ids  # nothing loaded to count with: ~4 characters a token

    async def choices(self, route: RouteSpec, shape: Shape) -> list[str]:
        """The route's models for this request, in the order they are tried."""
        needs_count = any(rule.prompt_tokens_above is not None for rule in route.rules)
        prompt_tokens = await self._prompt_tokens(route, shape) if needs_count else None
        first = next((r.model for r in route.rules if _matches(r, shape, prompt_tokens)), route.default)
        return list(dict.fromkeys([first, *route.fallbacks]))

    async def serve(self, body: Any, key_name: str | None, attempt: Callable[[ServerContext], Awaitable[T]],
                    generation: bool = False) -> T:
        """``attempt`` (validation, admission: up to the point a request is committed to a model) on the model
        ``body.model`` names, or on each of its route's choices in turn while they refuse with ``fallback``.
        ``generation``: the refusal that ends the request is usage too (a request, an error) of the model that
        refused it last."""
        model_id = getattr(body, "model", None)
        route = self.fleet.routes.get(model_id) if model_id is not None else None
        if route is None:
            host = self.fleet.find(model_id)
            if host is None:
                raise self._not_found(model_id)
            if host.name is not None:  # before a load: a key that may not use a model never loads it
                self._check_key(key_name, model_id, host.ids)
            async with self.fleet.hold(host) as ctx:
                if model_id is not None and model_id not in (ctx.model_name, *host.aliases):
                    raise self._not_found(model_id)  # a lone model, asked for by another name
                self._check_key(key_name, model_id, (ctx.model_name, *host.aliases))
                return await self._attempt(ctx, key_name, attempt, generation)
        self._check_key(key_name, route.name, (route.name,))
        names = await self.choices(route, shape_of(body))
        for i, name in enumerate(names):
            last = i == len(names) - 1
            try:
                async with self.fleet.hold(self.fleet.find(name)) as ctx:
                    return await self._attempt(ctx, key_name, attempt, generation, last)
            except APIError as exc:
                if not exc.fallback or last:
                    raise
                log.info("route %s: %s refused (%d %s); trying %s", route.name, name, exc.status, exc.message,
                         names[i + 1])
        raise AssertionError("unreachable: a route has at least one model")

    @staticmethod
    async def _attempt(ctx: ServerContext, key_name: str | None, attempt: Callable[[ServerContext], Awaitable[T]],
                       generation: bool, last: bool = True) -> T:
        """``attempt``; a generation request's refusal counts in its model's usage unless a fallback takes it."""
        try:
            return await attempt(ctx)
        except APIError as exc:
            if generation and (last or not exc.fallback):
                ctx.account(key_name, Usage(requests=1, errors=1))
            raise
