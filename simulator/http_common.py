"""Small helpers shared by the HTTP route modules: JSON/SSE encoding and SGLang error shapes."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from .engine import Engine
from .items import ApiError

ENGINE: web.AppKey[Engine] = web.AppKey("engine", Engine)
_enc = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


_any = msgspec.json.Decoder()


async def json_object(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object, else the 400 SGLang's OpenAI routes answer."""
    try:
        body = _any.decode(await request.read())
    except msgspec.DecodeError as e:
        raise ApiError(400, f"Invalid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "Request body must be a JSON object")
    return body


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=_enc.encode(obj), status=status, content_type="application/json")


def sse(obj: Any) -> bytes:
    return b"data: " + _enc.encode(obj) + b"\n\n"


def native_error(e: ApiError) -> web.Response:
    """/generate errors: ``{"error": {"message": ...}}`` (unknown sampling keys: a string)."""
    if e.message.startswith("unknown field"):
        return json_response({"error": e.message}, e.status)
    return json_response({"error": {"message": e.message}}, e.status)


def openai_error(e: ApiError) -> web.Response:
    return json_response({"object": "error", "message": e.message, "type": e.err_type, "param": None,
                          "code": e.status}, e.status)


async def open_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp
