"""``python -m simulator serve``: one simulated SGLang worker process."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import ssl
import sys

from aiohttp import web

from .config import parse_args
from .engine import Engine
from .http_common import ENGINE, json_response

log = logging.getLogger("simulator")


@web.middleware
async def fastapi_shapes(request: web.Request, handler):
    """SGLang runs on FastAPI/uvicorn: unknown routes and wrong methods answer in its shapes."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return json_response({"detail": "Not Found"}, 404)
    except web.HTTPMethodNotAllowed:
        return json_response({"detail": "Method Not Allowed"}, 405)


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = "uvicorn"


def build_app(engine: Engine) -> web.Application:
    from . import http_embed, http_native, http_openai, http_responses, http_tokenize

    app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=[fastapi_shapes])
    app.on_response_prepare.append(_server_header)
    app[ENGINE] = engine
    http_native.add_routes(app)
    http_openai.add_routes(app)
    http_tokenize.add_routes(app)
    http_embed.add_routes(app)
    http_responses.add_routes(app)
    return app


def ssl_context(args) -> ssl.SSLContext | None:
    """The HTTPS server context, as uvicorn builds it from SGLang's --ssl-* flags (None: plain HTTP)."""
    if not args.ssl_certfile:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(args.ssl_certfile, args.ssl_keyfile, password=args.ssl_keyfile_password)
    if args.ssl_ca_certs:
        ctx.load_verify_locations(args.ssl_ca_certs)
    ctx.verify_mode = ssl.VerifyMode(args.ssl_cert_reqs)
    return ctx


async def _freeze_gc_periodically(interval: float = 0.25) -> None:
    """Keep cyclic-GC pauses short: the radix tree holds hundreds of thousands of long-lived
    objects, and a full collection scanning them stalls the event loop for 0.1-0.3 s (at a
    high --time-scale that is tens of simulated seconds). Freezing moves survivors out of
    the collector's view, so each collection only scans what the last quarter second allocated.
    Refcounting still frees evicted pages (they hold no cycles once unlinked)."""
    while True:
        await asyncio.sleep(interval)
        gc.freeze()


async def serve(argv: list[str] | None) -> int:
    args = parse_args(argv)
    tls = ssl_context(args)  # before anything starts: a certificate that does not load ends the start here
    gc.collect()
    gc.freeze()
    gc_task = asyncio.get_running_loop().create_task(_freeze_gc_periodically())
    engine = Engine(args)
    await engine.start()
    if args.disaggregation_mode != "null":
        from .disagg import start_pd

        try:
            engine.pd = await start_pd(engine)
        except ImportError as e:
            log.error("PD mode needs the Mooncake transfer engine: %s", e)
            print(f"error: --disaggregation-mode {args.disaggregation_mode} needs mooncake "
                  f"(pip install mooncake-transfer-engine-non-cuda): {e}", file=sys.stderr)
            return 2
    # handler_cancellation: a client that goes away aborts its request, as in SGLang
    runner = web.AppRunner(build_app(engine), access_log=None, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, backlog=1024, ssl_context=tls)
    await site.start()
    scheme = "https" if tls else "http"
    log.info("simulated SGLang %s (%s) serving %s on %s://%s:%d", args.sglang_version, args.profile,
             args.model_name, scheme, args.host, args.port)
    print(f"The server is fired up and ready to roll! {scheme}://{args.host}:{args.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    gc_task.cancel()
    await runner.cleanup()
    if engine.pd is not None:
        await engine.pd.close()
    await engine.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    return asyncio.run(serve(argv))
