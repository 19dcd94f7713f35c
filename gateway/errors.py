"""OpenAI-style error bodies, so every client SDK surfaces gateway errors the same way
it surfaces the engine's."""

from __future__ import annotations

import msgspec
from aiohttp import web

_encode = msgspec.json.encode

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class GatewayError(Exception):
    """Raised anywhere below a handler; the app turns it into an error response."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> bytes:
    return _encode({"error": {"message": message, "type": _TYPES.get(status, "server_error"),
                              "param": param, "code": code if code is not None else status}})


def error_response(status: int, message: str, code: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=error_body(status, message, code, param),
                        content_type="application/json", headers=headers)


def from_exception(exc: GatewayError) -> web.Response:
    return error_response(exc.status, exc.message, exc.code, exc.param, exc.headers)


def sse_error_frame(message: str, code: int = 502, kind: str = "upstream_error") -> bytes:
    """What a stream ends with when the upstream dies mid-way: one valid JSON event, then [DONE]."""
    return (b"data: " + _encode({"error": {"message": message, "type": kind, "code": code}})
            + b"\n\ndata: [DONE]\n\n")
