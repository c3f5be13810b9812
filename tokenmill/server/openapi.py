"""The OpenAPI document, made truthful: each operation lists the statuses the server really sends, with OpenAI's
error body, and the shape of its 200 body; FastAPI's automatic 422 (never sent: validation errors are OpenAI 400s) is
removed. The response models here are documentation only; a test checks real responses against them."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from tokenmill.sampling.params import INT64_MAX, INT64_MIN


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None  # a reasoning model's thinking (--reasoning-parser)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length", "tool_calls", "abort"] | None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class ChatCompletion(BaseModel):
    """Without ``stream``; with it, the body is ``text/event-stream`` of ``chat.completion.chunk`` objects."""
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length", "abort"] | None


class Completion(BaseModel):
    """Without ``stream``; with it, the body is ``text/event-stream`` of ``text_completion`` objects."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32 (encoding_format)


class EmbeddingList(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: dict[str, int]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorDetail


class AnthropicMessage(BaseModel):
    """Without ``stream``; with it, ``text/event-stream`` of Anthropic's named events (message_start ... message_stop)."""
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]  # text and tool_use blocks
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: dict[str, int]


class TokenCount(BaseModel):
    input_tokens: int


class ResponseObject(BaseModel):
    """Without ``stream``; with it, ``text/event-stream`` of typed events (response.created ... response.completed)."""
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    model: str
    output: list[dict[str, Any]]  # reasoning, message and function_call items
    usage: dict[str, Any] | None


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"]
    deleted: bool


class ItemList(BaseModel):
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


_ERRORS = {400: "invalid request (OpenAI's invalid_request_error; `param` names the field)",
           401: "missing or unknown API key", 403: "the key may not read this (another key's usage)",
           404: "unknown model (or stored response; or the usage ledger is off)",
           429: "at capacity; see the Retry-After header",
           500: "the engine failed while generating", 503: "loading, draining, or the engine has failed"}


def error_responses(*statuses: int) -> dict[int, dict[str, Any]]:
    return {s: {"model": ErrorResponse, "description": _ERRORS[s]} for s in statuses}


def anthropic_error_responses(*statuses: int) -> dict[int, dict[str, Any]]:
    """The same statuses with Anthropic's error body (its API: /v1/messages...)."""
    return {s: {"model": AnthropicErrorResponse, "description": _ERRORS[s]} for s in statuses}


def _exact_integer_bounds(node: Any) -> None:
    """FastAPI writes an integer's bounds as floats: int64's ends become 2**63 and -2**63 (one past the largest int64).
    Put back the integers the models hold (server/protocol.py: INT64_MIN..INT64_MAX)."""
    if isinstance(node, list):
        for item in node:
            _exact_integer_bounds(item)
    elif isinstance(node, dict):
        if node.get("type") == "integer":
            for bound in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                if isinstance(node.get(bound), float):
                    node[bound] = max(INT64_MIN, min(INT64_MAX, int(node[bound])))
        for value in node.values():
            _exact_integer_bounds(value)


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in schema["paths"].values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            _exact_integer_bounds(schema)
            app.openapi_schema = schema
        return app.openapi_schema
    app.openapi = openapi
