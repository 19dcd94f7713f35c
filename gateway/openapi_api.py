"""The OpenAPI description of the routes ``gateway.api_routes`` serves, and of the
passthrough, info and admin routes, merged into ``gateway.openapi``'s document.

As there, request schemas name what the gateway reads plus the fields a client most often
sends, and let everything else through: the engine owns the rest of each body.
"""

from __future__ import annotations

from typing import Any

_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_TEXTS = {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1}
_PROMPT = {"oneOf": [{"type": "string", "minLength": 1}, _TEXTS, _TOKEN_IDS,
                     {"type": "array", "items": _TOKEN_IDS, "minItems": 1}]}
_MODEL = {"type": "string", "minLength": 1}

SCHEMAS: dict[str, Any] = {
    "EmbeddingRequest": {
        "type": "object", "required": ["input"],
        "properties": {"model": _MODEL, "input": _PROMPT, "encoding_format": {"type": "string", "enum": ["float", "base64"]},
                       "dimensions": {"type": "integer", "minimum": 1}, "user": {"type": "string"}},
    },
    "ClassifyRequest": {
        "type": "object", "required": ["input"],
        "properties": {"model": _MODEL, "input": {"oneOf": [{"type": "string", "minLength": 1}, _TEXTS, _TOKEN_IDS]}},
    },
    "RerankRequest": {
        "type": "object", "required": ["query", "documents"],
        "description": "SGLang's rerank; a `model` (not in SGLang's schema, ignored there) routes it in a mixed fleet.",
        "properties": {"model": _MODEL, "query": {"type": "string", "minLength": 1}, "documents": _TEXTS,
                       "top_n": {"type": "integer", "minimum": 1}, "return_documents": {"type": "boolean"},
                       "instruct": {"type": "string"}},
    },
    "ScoreRequest": {
        "type": "object", "required": ["items"],
        "properties": {"model": _MODEL, "query": {"oneOf": [{"type": "string"}, _TOKEN_IDS]},
                       "items": {"oneOf": [{"type": "string", "minLength": 1}, _TEXTS,
                                           {"type": "array", "items": _TOKEN_IDS, "minItems": 1}]},
                       "label_token_ids": {"oneOf": [_TOKEN_IDS, {"type": "array", "items": _TOKEN_IDS}]},
                       "apply_softmax": {"type": "boolean"}, "item_first": {"type": "boolean"}},
    },
    "DecisionsRequest": {"type": "object", "description": "SGLang's decisions request (the engine checks it)",
                         "properties": {"model": _MODEL}},
    "EncodeRequest": {
        "type": "object", "description": "SGLang's native embedding request: exactly one of text or input_ids.",
        "properties": {"text": {"oneOf": [{"type": "string", "minLength": 1}, _TEXTS]},
                       "input_ids": {"oneOf": [_TOKEN_IDS, {"type": "array", "items": _TOKEN_IDS, "minItems": 1}]},
                       "rid": {"type": "string"}},
    },
    "ParseRequest": {"type": "object", "required": ["text"], "description": "the engine checks the parser fields",
                     "properties": {"text": {"type": "string"}}},
    "MessagesRequest": {
        "type": "object", "required": ["model", "messages", "max_tokens"], "description": "Anthropic's Messages API",
        "properties": {"model": _MODEL, "max_tokens": {"type": "integer", "minimum": 1}, "stream": {"type": "boolean"},
                       "system": {"type": "string"},
                       "messages": {"type": "array", "minItems": 1, "items": {
                           "type": "object", "required": ["role", "content"],
                           "properties": {"role": {"type": "string", "enum": ["user", "assistant"]},
                                          "content": {"type": "string"}}}}},
    },
    "CountTokensRequest": {"type": "object", "required": ["model", "messages"], "description": "Anthropic's",
                           "properties": {"model": _MODEL, "system": {"type": "string"},
                                          "messages": {"type": "array", "minItems": 1, "items": {"type": "object"}}}},
    "ResponsesRequest": {
        "type": "object", "required": ["input"],
        "properties": {"model": _MODEL, "input": {"oneOf": [{"type": "string", "minLength": 1}, {
                           "type": "array", "minItems": 1, "items": {"type": "object", "required": ["role", "content"],
                                                                     "properties": {"role": {"type": "string"},
                                                                                    "content": {"type": "string"}}}}]},
                       "instructions": {"type": "string"},
                       "previous_response_id": {"type": "string", "pattern": "^resp_"},
                       "max_output_tokens": {"type": "integer", "minimum": 1},
                       "stream": {"type": "boolean"}, "store": {"type": "boolean"}, "background": {"type": "boolean"},
                       "temperature": {"type": "number", "minimum": 0}},
    },
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _errors(*codes: int) -> dict[str, Any]:
    return {str(c): {"description": "OpenAI-style error", "content": {"application/json": {"schema": _ref("Error")}}}
            for c in codes}


_PROXIED = (400, 401, 404, 408, 413, 429, 502, 503, 504)
_OWNER = (400, 401, 404, 410, 429, 503)  # a stored response's owner: unknown, gone or unavailable


def _post(summary: str, schema: str | None, *codes: int, stream: bool = False) -> dict[str, Any]:
    ok: dict[str, Any] = {"application/json": {"schema": {}}}
    if stream:
        ok["text/event-stream"] = {"schema": {"type": "string"}}
    op: dict[str, Any] = {"summary": summary, "responses": {"200": {"description": "the engine's answer", "content": ok},
                                                            **_errors(*(codes or _PROXIED))}}
    if schema is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(schema)}}}
    return op


def _get(summary: str, *codes: int) -> dict[str, Any]:
    return {"summary": summary, "responses": {"200": {"description": "ok", "content": {"application/json": {"schema": {}}}},
                                              **_errors(*codes)}}


def _path_param(name: str, op: dict[str, Any]) -> dict[str, Any]:
    return {**op, "parameters": [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}]}


def api_paths() -> dict[str, Any]:
    response = "/v1/responses/{response_id}"
    return {
        "/v1/models/{model}": {"get": _path_param("model", _get("a model some healthy worker serves", 401, 404))},
        "/v1/embeddings": {"post": _post("embeddings (one worker serving the model)", "EmbeddingRequest")},
        "/v1/rerank": {m: _post("documents ranked against a query (one worker)", "RerankRequest") for m in ("post", "put")},
        "/v1/score": {"post": _post("scores of items against a query (one worker)", "ScoreRequest")},
        "/v1/classify": {"post": _post("classification (one worker serving the model)", "ClassifyRequest")},
        "/v1/decisions": {"post": _post("SGLang's decisions (one worker)", "DecisionsRequest")},
        "/encode": {m: _post("SGLang's native embedding (one worker)", "EncodeRequest") for m in ("post", "put")},
        "/classify": {m: _post("SGLang's native classification (one worker)", "EncodeRequest") for m in ("post", "put")},
        "/v1/messages": {"post": _post("Anthropic's Messages API (one worker serving the model)", "MessagesRequest",
                                       stream=True)},
        "/v1/messages/count_tokens": {"post": _post("Anthropic's token count (one worker)", "CountTokensRequest")},
        "/v1/responses": {"post": _post("create a response; with previous_response_id, on the worker that holds it",
                                        "ResponsesRequest", *_PROXIED, 410, stream=True)},
        response: {"get": _path_param("response_id", _get("a stored response, from the worker that holds it", *_OWNER)),
                   "delete": _path_param("response_id", _get("delete a stored response on its worker", *_OWNER))},
        response + "/cancel": {"post": _path_param("response_id",
                                                   _post("cancel a background response on its worker", None, *_OWNER))},
        response + "/input_items": {"get": _path_param("response_id", _get("a response's input items", *_OWNER))},
    }


def other_paths() -> dict[str, Any]:
    """Routes ``gateway.openapi`` does not describe itself: info passthrough, aliases, admin."""
    tokenize = {"post": _post("a worker's token ids (SGLang's)", "TokenizeRequest", 400, 401, 503)}
    detokenize = {"post": _post("a worker's text for token ids (SGLang's)", "DetokenizeRequest", 400, 401, 503)}
    info = {"get": _get("from a healthy worker", 401, 503)}
    admin = _errors(400, 401, 403, 404, 409)
    return {
        "/server_info": info, "/get_server_info": info, "/model_info": info, "/get_model_info": info,
        "/tokenize": tokenize, "/detokenize": detokenize,
        "/parse_function_call": {"post": _post("a worker's tool-call parser on a text (SGLang's)", "ParseRequest",
                                               400, 401, 503)},
        "/separate_reasoning": {"post": _post("a worker's reasoning parser on a text (SGLang's)", "ParseRequest",
                                              400, 401, 503)},
        "/openapi.json": {"get": _get("this document")},
        "/flush_cache": {"post": {"summary": "flush every healthy worker's cache (admin)",
                                  "responses": {"200": {"description": "flushed"}, **admin}}},
        "/abort_request": {"post": {"summary": "abort on every healthy worker (admin)",
                                    "requestBody": {"content": {"application/json": {"schema": {"type": "object"}}}},
                                    "responses": {"200": {"description": "sent"}, **admin}}},
        "/add_worker": {"post": {"summary": "register a worker (admin; sglang-router's spelling)",
                                 "requestBody": {"content": {"application/json": {"schema": _ref("AddWorker")}}},
                                 "responses": {"201": {"description": "registered"}, **admin}}},
        "/remove_worker": {"post": {"summary": "remove a worker (admin; sglang-router's spelling)",
                                    "parameters": [{"name": "url", "in": "query", "required": True,
                                                    "schema": {"type": "string"}}],
                                    "responses": {"200": {"description": "removed"}, **admin}}},
        "/workers/{url}": {"delete": _path_param("url", {"summary": "remove a worker (admin)",
                                                         "responses": {"200": {"description": "removed"}, **admin}})},
    }
