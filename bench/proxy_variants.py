"""Two minimal reverse proxies that differ only in the server framework.

Both forward the request bytes to the next upstream (round robin) with one shared aiohttp
``ClientSession`` (same connector settings as kvgate's) and pass the answer back, streamed
when the upstream streams. One serves on bare ``aiohttp.web``, the other on
Starlette+uvicorn (uvloop + httptools, access log off). Whatever separates their numbers
in ``bench/overhead.py`` is the cost of the server framework, which is the question behind
kvgate serving on aiohttp.web.

    python -m bench.proxy_variants aiohttp   --port P --upstream http://127.0.0.1:A ...
    python -m bench.proxy_variants starlette --port P --upstream http://127.0.0.1:A ...
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import AsyncIterator

import aiohttp

ROUTES = ("/v1/chat/completions", "/v1/completions", "/generate")


def make_session() -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, ttl_dns_cache=300)
    return aiohttp.ClientSession(connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",),
                                 timeout=aiohttp.ClientTimeout(total=None, sock_read=600), read_bufsize=2**16)


class Upstreams:
    def __init__(self, urls: list[str]) -> None:
        self._next = itertools.cycle([u.rstrip("/") for u in urls]).__next__

    def pick(self) -> str:
        return self._next()


def aiohttp_app(upstreams: Upstreams):
    from aiohttp import web

    async def forward(request: web.Request) -> web.StreamResponse:
        session: aiohttp.ClientSession = request.app["session"]
        raw = await request.read()
        async with session.post(upstreams.pick() + request.path, data=raw,
                                headers={"Content-Type": "application/json"}) as up:
            ctype = up.headers.get("Content-Type", "application/json")
            if not ctype.startswith("text/event-stream"):
                return web.Response(status=up.status, body=await up.read(), content_type=ctype.split(";")[0])
            resp = web.StreamResponse(status=up.status, headers={"Content-Type": ctype, "Cache-Control": "no-cache"})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def on_startup(app: web.Application) -> None:
        app["session"] = make_session()

    async def on_cleanup(app: web.Application) -> None:
        await app["session"].close()

    app = web.Application()
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    for path in ROUTES:
        app.router.add_post(path, forward)
    app.router.add_get("/health", health)
    return app


def starlette_app(upstreams: Upstreams):
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    holder: dict[str, aiohttp.ClientSession] = {}

    async def forward(request: Request) -> Response:
        raw = await request.body()
        up = await holder["session"].post(upstreams.pick() + request.url.path, data=raw,
                                          headers={"Content-Type": "application/json"})
        ctype = up.headers.get("Content-Type", "application/json")
        if not ctype.startswith("text/event-stream"):
            try:
                return Response(await up.read(), status_code=up.status, media_type=ctype.split(";")[0])
            finally:
                up.release()

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in up.content.iter_any():
                    yield chunk
            finally:
                up.release()

        return StreamingResponse(chunks(), status_code=up.status,
                                 headers={"Content-Type": ctype, "Cache-Control": "no-cache"})

    async def health(_: Request) -> Response:
        return PlainTextResponse("ok")

    @asynccontextmanager
    async def lifespan(_app):
        holder["session"] = make_session()
        yield
        await holder["session"].close()

    routes = [Route(p, forward, methods=["POST"]) for p in ROUTES] + [Route("/health", health)]
    return Starlette(routes=routes, lifespan=lifespan)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("server", choices=["aiohttp", "starlette"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", nargs="+", required=True)
    a = p.parse_args()
    upstreams = Upstreams(a.upstream)
    if a.server == "aiohttp":
        import uvloop
        from aiohttp import web

        uvloop.install()
        web.run_app(aiohttp_app(upstreams), host=a.host, port=a.port, access_log=None, print=None, backlog=4096)
    else:
        import uvicorn

        uvicorn.run(starlette_app(upstreams), host=a.host, port=a.port, loop="uvloop", http="httptools",
                    access_log=False, log_level="warning", backlog=4096)


if __name__ == "__main__":
    main()
