"""Reading the bodies of the routes beyond chat, completions and generate (``gateway.api_routes``).

As for chat (``gateway.request``), only what routing reads is decoded: the model, whether
the answer streams, the response a Responses request follows, and the prompt a policy may
route on. Every other field is the engine's to check; the original bytes go upstream.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.errors import GatewayError
from wire.chat_template import apply_chat_template

EMBEDDINGS, RERANK, SCORE, V1_CLASSIFY = "/v1/embeddings", "/v1/rerank", "/v1/score", "/v1/classify"
DECISIONS, ENCODE, CLASSIFY, RESPONSES = "/v1/decisions", "/encode", "/classify", "/v1/responses"
MESSAGES, COUNT_TOKENS = "/v1/messages", "/v1/messages/count_tokens"  # Anthropic's Messages API


class ApiBody(msgspec.Struct):
    model: str | None = None
    stream: bool | None = None
    previous_response_id: str | None = None
    input: Any = None  # embeddings, classify, responses
    text: Any = None  # native /encode, /classify
    input_ids: Any = None
    query: Any = None  # rerank, score, decisions
    instructions: Any = None  # responses
    messages: Any = None  # Anthropic messages
    system: Any = None
    max_output_tokens: Any = None
    user: Any = None
    prompt_cache_key: Any = None
    cache_salt: Any = None


_decoder = msgspec.json.Decoder(ApiBody)


def parse_api_body(raw: bytes) -> ApiBody:
    """The body, or a 400 in OpenAI's shape: empty, not JSON, not an object, or a routing
    field of the wrong type."""
    if not raw.strip():
        raise GatewayError(400, "request body is empty; expected a JSON object")
    try:
        body = _decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise GatewayError(400, f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise GatewayError(400, f"malformed JSON: {exc}") from None
    if body.previous_response_id is not None and not body.previous_response_id:
        raise GatewayError(400, "'previous_response_id' must not be empty", param="previous_response_id")
    return body


def _ids(value: Any) -> list[int] | None:
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        return value
    return None


def _first_text_or_ids(value: Any) -> tuple[str | None, list[int] | None]:
    """A prompt given as text, texts, ids or lists of ids: its first text or ids."""
    if isinstance(value, str):
        return value, None
    if isinstance(value, list) and value:
        head = value[0]
        if isinstance(head, str):
            return head, None
        if isinstance(head, list):
            return None, _ids(head)
        return None, _ids(value)
    return None, None


def prompt_of(route: str, body: ApiBody) -> tuple[str | None, list[int] | None]:
    """What a policy may route on: the first prompt's text or token ids (both None: nothing).

    Rerank and scoring send one query with many documents or items: the query is the part
    every pair shares. A Responses input of typed items is rendered as a chat."""
    if route in (EMBEDDINGS, V1_CLASSIFY):
        return _first_text_or_ids(body.input)
    if route in (ENCODE, CLASSIFY):
        return _first_text_or_ids(body.text if body.text is not None else body.input_ids)
    if route in (RERANK, SCORE, DECISIONS):
        query = body.query
        return (query, None) if isinstance(query, str) and query else (None, _ids(query))
    if route in (RESPONSES, MESSAGES, COUNT_TOKENS):
        system, turns = (body.instructions, body.input) if route == RESPONSES else (body.system, body.messages)
        messages: list[dict[str, Any]] = []
        if isinstance(system, (str, list)):
            messages.append({"role": "system", "content": system})
        if isinstance(turns, str):
            messages.append({"role": "user", "content": turns})
        elif isinstance(turns, list):
            messages += [m for m in turns if isinstance(m, dict) and isinstance(m.get("role"), str)]
        try:
            return (apply_chat_template(messages), None) if messages else (None, None)
        except TypeError:  # a part whose text is no string: the engine words the error
            return None, None
    return None, None
