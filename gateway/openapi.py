"""The gateway's own OpenAPI 3 description, served at ``GET /openapi.json``.

It documents what the *gateway* checks and forwards: request schemas name the fields
routing reads plus the common sampling knobs, and allow everything else through (the
engine owns the rest), so a schema-driven fuzzer exercises the gateway's validation and
its error paths rather than a guess at every engine's full API.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from gateway import __version__
from gateway.openapi_api import SCHEMAS as API_SCHEMAS
from gateway.openapi_api import api_paths, other_paths

_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_STOP = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
_COMMON = {
    "model": {"type": "string", "minLength": 1},
    "stream": {"type": "boolean"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "n": {"type": "integer", "minimum": 1},
    "stop": _STOP,
    "user": {"type": "string"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
}

SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object", "required": ["error"],
        "properties": {"error": {
            "type": "object", "required": ["message", "type", "code"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": {"type": ["string", "null"]}, "code": {"type": ["string", "integer"]}},
        }},
    },
    "ChatMessage": {
        "type": "object", "required": ["role", "content"],
        "properties": {
            "role": {"type": "string", "enum": ["system", "user", "assistant", "tool"]},
            "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
                "type": "object", "required": ["type"],
                "properties": {"type": {"type": "string"}, "text": {"type": "string"}}}}]},
        },
    },
    "ChatCompletionRequest": {
        "type": "object", "required": ["model", "messages"],
        "properties": {**_COMMON, "messages": {"type": "array", "minItems": 1,
                                                "items": {"$ref": "#/components/schemas/ChatMessage"}},
                       "max_completion_tokens": {"type": "integer", "minimum": 1},
                       "tools": {"type": "array", "items": {"type": "object", "required": ["function"], "properties": {
                           "type": {"type": "string"},
                           "function": {"type": "object", "required": ["name"],
                                        "properties": {"name": {"type": "string"}, "description": {"type": "string"},
                                                       "parameters": {"type": "object"}}}}}},
                       "tool_choice": {"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]},
                                                 {"type": "object"}]},
                       "chat_template_kwargs": {"type": "object",
                                                "description": "variables for the model's chat template"},
                       "reasoning_effort": {"type": "string"},
                       "continue_final_message": {"type": "boolean"}},
    },
    "CompletionRequest": {
        "type": "object", "required": ["model", "prompt"],
        "properties": {**_COMMON, "prompt": {"oneOf": [
            {"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1}, _TOKEN_IDS,
            {"type": "array", "items": _TOKEN_IDS, "minItems": 1}]}},
    },
    "GenerateRequest": {
        "type": "object",
        "description": "SGLang's native request: exactly one of text or input_ids.",
        "properties": {
            "text": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1}]},
            "input_ids": {"oneOf": [_TOKEN_IDS, {"type": "array", "items": _TOKEN_IDS, "minItems": 1}]},
            "sampling_params": {"type": "object", "properties": {
                "max_new_tokens": {"type": "integer", "minimum": 0},
                "temperature": {"type": "number", "minimum": 0},
                "stop": _STOP}},
            "stream": {"type": "boolean"},
            "rid": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
            "return_logprob": {"type": "boolean"},
        },
    },
    "TokenizeRequest": {
        "type": "object", "description": "SGLang's: exactly one of prompt or messages (rendered as for a chat).",
        "properties": {"model": {"type": "string"},
                       "prompt": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
                       "messages": {"type": "array", "minItems": 1,
                                    "items": {"$ref": "#/components/schemas/ChatMessage"}},
                       "add_special_tokens": {"type": "boolean"}},
    },
    "DetokenizeRequest": {
        "type": "object", "required": ["tokens"],
        "properties": {"model": {"type": "string"},
                       "tokens": {"oneOf": [_TOKEN_IDS, {"type": "array", "items": _TOKEN_IDS}]}},
    },
    "AddWorker": {
        "type": "object", "required": ["url"],
        "properties": {"url": {"type": "string", "pattern": "^https?://"},
                       "role": {"type": "string", "enum": ["unified", "prefill", "decode"]},
                       "bootstrap_port": {"type": ["integer", "null"], "minimum": 1, "maximum": 65535},
                       "api_key": {"type": ["string", "null"]}},
    },
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _errors(*codes: int) -> dict[str, Any]:
    return {str(c): {"description": "OpenAI-style error", "content": {"application/json": {"schema": _ref("Error")}}}
            for c in codes}


def _generation(summary: str, schema: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(schema)}}},
        "responses": {
            "200": {"description": "the engine's answer (JSON, or SSE when stream is true)",
                    "content": {"application/json": {"schema": {}}, "text/event-stream": {"schema": {"type": "string"}}}},
            **_errors(400, 401, 404, 408, 413, 429, 502, 503, 504),
        },
    }}


def _get(summary: str, ctype: str = "application/json", *codes: int) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": {"description": "ok", "content": {ctype: {"schema": {}}}},
                                                       **_errors(*codes)}}}


def build_spec() -> dict[str, Any]:
    paths: dict[str, Any] = {
        "/v1/chat/completions": _generation("OpenAI chat completion", "ChatCompletionRequest"),
        "/v1/completions": _generation("OpenAI text completion", "CompletionRequest"),
        "/generate": _generation("SGLang native generation", "GenerateRequest"),
        "/v1/tokenize": _generation("a worker's token ids for a prompt or chat (SGLang's)", "TokenizeRequest"),
        "/v1/detokenize": _generation("a worker's text for token ids (SGLang's)", "DetokenizeRequest"),
        "/v1/models": _get("models served by healthy workers", "application/json", 401),
        "/health": _get("process liveness"),
        "/liveness": _get("process liveness"),
        "/readiness": _get("at least one healthy worker and not draining", "application/json", 503),
        "/metrics": _get("Prometheus metrics", "text/plain"),
        "/workers": {
            "get": _get("registered workers", "application/json", 401)["get"],
            "post": {"summary": "register a worker (admin)",
                     "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("AddWorker")}}},
                     "responses": {"201": {"description": "registered"}, **_errors(400, 401, 403, 409)}},
            "delete": {"summary": "remove a worker (admin)",
                       "parameters": [{"name": "url", "in": "query", "required": True, "schema": {"type": "string"}}],
                       "responses": {"200": {"description": "removed"}, **_errors(401, 403, 404)}},
        },
    }
    paths["/generate"]["put"] = paths["/generate"]["post"]  # SGLang takes both
    paths.update(other_paths())
    paths.update(api_paths())
    return {
        "openapi": "3.1.0",
        "info": {"title": "kvgate", "version": __version__,
                 "description": "Cache-aware gateway in front of SGLang workers; OpenAI-compatible."},
        "paths": paths,
        "components": {"schemas": {**SCHEMAS, **API_SCHEMAS},
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}, {}],
    }


_SPEC = msgspec.json.encode(build_spec())


async def openapi_json(request: web.Request) -> web.Response:
    return web.Response(body=_SPEC, content_type="application/json")
