"""A fast SGLang-shaped backend for measuring router overhead, not engine behaviour.

Answers instantly (or after ``--delay-ms``) so a benchmark through it measures the
router's own cost. It speaks just enough of SGLang for sglang-router's start-up probes
(/health, /server_info, /get_server_info, /model_info, /v1/models, /get_load).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import msgspec
from aiohttp import web

_enc = msgspec.json.encode
MODEL = "stub-model"


def _completion(model: str) -> bytes:
    return _enc({
        "id": "cmpl-stub", "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9,
                  "prompt_tokens_details": {"cached_tokens": 0}},
    })


def _chunk(i: int, model: str) -> bytes:
    return b"data: " + _enc({"id": "cmpl-stub", "object": "chat.completion.chunk", "model": model,
                             "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}]}) + b"\n\n"


class _Ask(msgspec.Struct):
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # sglang-router re-serializes max_tokens as this


_ask = msgspec.json.Decoder(_Ask)


def build_app(chunks: int, delay_ms: float) -> web.Application:
    """``max_tokens`` (or ``max_completion_tokens``) in a streamed request overrides
    ``--chunks``, so one stub process serves every stream length a benchmark asks for."""
    single = _completion(MODEL)
    frames: dict[int, list[bytes]] = {}

    def stream_frames(n: int) -> list[bytes]:
        if n not in frames:
            frames[n] = [_chunk(i, MODEL) for i in range(n)] + [b"data: [DONE]\n\n"]
        return frames[n]

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if delay_ms:
            await asyncio.sleep(delay_ms / 1000)
        if b'"stream":true' not in body.replace(b" ", b""):
            return web.Response(body=single, content_type="application/json")
        try:
            ask = _ask.decode(body)
            n = ask.max_tokens or ask.max_completion_tokens or chunks
        except msgspec.MsgspecError:
            n = chunks
        out = stream_frames(min(max(n, 1), 4096))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if len(out) <= 17:  # short answers leave in one write, longer ones one frame per write
            await resp.write(b"".join(out))
        else:
            for frame in out:
                await resp.write(frame)
        await resp.write_eof()
        return resp

    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def info(_: web.Request) -> web.Response:
        return web.Response(body=_enc({"model_path": MODEL, "served_model_name": MODEL, "version": "0.5.23"}),
                            content_type="application/json")

    async def models(_: web.Request) -> web.Response:
        return web.Response(body=_enc({"object": "list", "data": [{"id": MODEL, "object": "model"}]}),
                            content_type="application/json")

    async def load(_: web.Request) -> web.Response:
        return web.Response(body=_enc([{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]),
                            content_type="application/json")

    app = web.Application()
    for path in ("/v1/chat/completions", "/v1/completions", "/generate"):
        app.router.add_post(path, chat)
    for path in ("/health", "/health_generate"):
        app.router.add_get(path, ok)
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        app.router.add_get(path, info)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/get_load", load)
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=31000)
    p.add_argument("--chunks", type=int, default=16, help="SSE chunks per streamed answer without max_tokens")
    p.add_argument("--delay-ms", type=float, default=0.0)
    a = p.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(build_app(a.chunks, a.delay_ms), host=a.host, port=a.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
