"""One error shape for every client: ``{"error": {"message", "type", "param", "code"}}``.

Engines answer errors in their own shapes (SGLang's OpenAI routes send ``{"object": "error",
"message": ...}``, its native ``/generate`` sends ``{"error": "..."}`` or
``{"error": {"message": ...}}``). The gateway passes the engine's words through but rewraps
them in OpenAI's shape, so a client parses one format whichever side refused it.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from gateway.errors import error_body

_decode = msgspec.json.Decoder()


def _is_openai_shape(data: Any) -> bool:
    err = data.get("error") if isinstance(data, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)


def _message_of(data: Any, raw: bytes) -> str:
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        for value in (err, data.get("message"), data.get("detail")):
            if isinstance(value, str) and value:
                return value
    text = raw[:2000].decode(errors="replace").strip()
    return text or "upstream error"


def normalized(response: web.StreamResponse) -> web.StreamResponse:
    """``response`` itself when it is already well-shaped (or streamed), else a rewrapped copy."""
    if response.status < 400 or not isinstance(response, web.Response) or response.prepared:
        return response
    raw = response.body if isinstance(response.body, bytes) else b""
    try:
        data = _decode.decode(raw) if raw else None
    except msgspec.DecodeError:
        data = None
    if _is_openai_shape(data):
        return response
    code = data.get("code") if isinstance(data, dict) and isinstance(data.get("code"), (int, str)) else None
    headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-type", "content-length")}
    return web.Response(status=response.status, body=error_body(response.status, _message_of(data, raw), code),
                        content_type="application/json", headers=headers)
