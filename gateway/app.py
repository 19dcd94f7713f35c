"""The aiohttp application: routes, middleware and lifecycle.

aiohttp.web serves both the proxy and the control plane: one server, one event loop, no
ASGI translation on the hot path (bench/RESULTS.md has the comparison with
Starlette+uvicorn that chose it).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

import msgspec
from aiohttp import web

from gateway import __version__, audit
from gateway.api_routes import add_api_routes
from gateway.auth import bearer_token, key_matches
from gateway.config import GatewayConfig
from gateway.error_shape import normalized
from gateway.errors import GatewayError, error_response, from_exception
from gateway.openapi import openapi_json
from gateway.posture import refuse_open_admin
from gateway.ratelimit import check_rate
from gateway.state import OPEN_PATHS, GatewayState
from gateway.request import CHAT, COMPLETIONS, GENERATE, Body, build_view, read_body, request_id_from

log = logging.getLogger("kvgate")
_json = msgspec.json.encode

ADMIN_PATHS = ("/workers", "/add_worker", "/remove_worker", "/flush_cache", "/abort_request")

STATE: web.AppKey[GatewayState] = web.AppKey("kvgate", GatewayState)



# --- middleware ---------------------------------------------------------------------------

@web.middleware
async def error_middleware(request: web.Request, handler):
    """Auth, drain accounting, rate limit, then the handler; any error becomes an OpenAI-style body and every
    answer is counted.

    One middleware, not two: each layer is another coroutine frame resumed at every await
    of the handler (bench/RESULTS.md)."""
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
    state: GatewayState = request.app[STATE]
    counted = False
    try:
        check_auth(request, state.cfg)
        if state.admin_refused and request.path.startswith(ADMIN_PATHS):  # exposed, no admin key
            raise refuse_open_admin(state.cfg.host)
        counted = state.drain.enter(request.path)
        if counted and state.limiter is not None:  # after auth: a bad key never gets a bucket
            check_rate(state.limiter, request, bool(state.cfg.api_keys))
        response = await handler(request)
    except GatewayError as exc:
        response = from_exception(exc)
    except web.HTTPRequestEntityTooLarge:
        response = error_response(413, f"request body exceeds {state.cfg.max_payload_size} bytes",
                                  code="payload_too_large")
    except web.HTTPException as exc:
        response = error_response(exc.status, exc.reason or "error")
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        response = error_response(500, "internal gateway error", code="internal_error")
    finally:
        if counted:
            state.drain.leave()
    if state.drain.retiring:  # the client reconnects, to a process that stays (gateway.group)
        response.force_close()
    state.metrics.requests_by(route, response.status).inc()
    if request.method != "GET" and request.path.startswith(ADMIN_PATHS):
        audit.record(request, response.status, state.cfg)
    if log.isEnabledFor(logging.DEBUG):  # never headers: they carry the keys
        log.debug("%s %s -> %d", request.method, route, response.status)
    return response


def check_auth(request: web.Request, cfg: GatewayConfig) -> None:
    path = request.path
    if path in OPEN_PATHS and not (cfg.protect_metrics and path == "/metrics"):
        return
    admin = path.startswith(ADMIN_PATHS) or path == "/metrics"
    keys = (cfg.admin_api_keys or cfg.api_keys) if admin else cfg.api_keys
    if not keys:
        return
    presented = bearer_token(request.headers.get("Authorization"))
    if key_matches(presented, keys):
        return
    if admin and cfg.admin_api_keys and key_matches(presented, cfg.api_keys):
        raise GatewayError(403, "this API key may not call admin routes", code="admin_key_required")
    raise GatewayError(401, "invalid or missing API key", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})


# --- data routes ----------------------------------------------------------------------------

async def _read_body(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise GatewayError(413, f"request body exceeds {limit} bytes", code="payload_too_large")
    return await request.read()


def _max_tokens(body: Body) -> int | None:
    sp = body.sampling_params
    sp = sp[0] if isinstance(sp, list) and sp else sp
    return body.max_tokens or body.max_completion_tokens or (sp.max_new_tokens if sp is not None else None)


def generation_handler(route: str):
    async def handle(request: web.Request) -> web.StreamResponse:
        state: GatewayState = request.app[STATE]
        raw = await _read_body(request, state.cfg.max_payload_size)
        body, packed = read_body(raw, route, state.recent_ids)
        if body.model and not state.registry.knows_model(body.model):
            if route == GENERATE:  # SGLang's native route ignores the name: so does the choice of worker
                body.model = None
            elif state.cfg.strict_models:
                raise GatewayError(404, f"model {body.model!r} is not served here; see /v1/models",
                                   code="model_not_found", param="model")
        qos, ticket = state.qos, None
        if qos is not None:  # tenant, class and budget; the class's priority spliced in where configured
            ticket, raw = qos.admit(request, raw, body.model, body.priority, _max_tokens(body))
        started = time.perf_counter()
        try:
            async with state.admission.slot(ticket):  # before tokenizing: a refused request costs no encode
                rid = request_id_from(request.headers, state.cfg.request_id_headers)
                view = await build_view(body, route, request.headers, rid,
                                        state.encoder, state.needs_prompt, packed)
                if ticket is not None:
                    view.qos = ticket
                    qos.routed(ticket, view)
                response = await state.proxy.forward(request, view, raw, body)
        finally:
            if ticket is not None:
                qos.finish(ticket)
        state.metrics.latency_of(route).observe(time.perf_counter() - started)
        return normalized(response)  # an engine's error, in the gateway's shape

    return handle


async def models(request: web.Request) -> web.Response:
    state: GatewayState = request.app[STATE]
    data = [{"id": m, "object": "model", "created": 0, "owned_by": "sglang"} for m in sorted(state.registry.models())]
    return web.Response(body=_json({"object": "list", "data": data}), content_type="application/json")


async def info_passthrough(request: web.Request) -> web.Response:
    """``/server_info``, ``/model_info`` and SGLang's ``/v1/tokenize`` / ``/v1/detokenize`` from
    a healthy worker (decode before prefill in PD): the engine's own answer, body as sent."""
    state: GatewayState = request.app[STATE]
    workers = sorted((w for w in state.registry.workers.values() if w.view.healthy),
                     key=lambda w: {"unified": 0, "decode": 1, "prefill": 2}.get(w.view.role, 3))
    path = request.path
    body = await _read_body(request, state.cfg.max_payload_size) if request.method == "POST" else None
    headers = {"Content-Type": request.headers.get("Content-Type", "application/json")} if body is not None else {}
    for worker in workers:
        try:
            async with state.session.request(request.method, worker.url + path, data=body,
                                             headers={**headers, **worker.auth_headers()}) as resp:
                if resp.status == 404 and path.startswith("/get_"):
                    continue
                return normalized(web.Response(status=resp.status, body=await resp.read(),
                                               content_type=resp.content_type or "application/json"))
        except Exception as exc:
            worker.last_error = repr(exc)
    raise GatewayError(503, "no healthy worker available", code="no_worker_available")


async def health(request: web.Request) -> web.Response:
    return web.Response(body=_json({"status": "ok", "version": __version__}), content_type="application/json")


async def readiness(request: web.Request) -> web.Response:
    state: GatewayState = request.app[STATE]
    ready = state.registry.ready() and not state.draining
    healthy = sum(w.view.healthy for w in state.registry.workers.values())
    body = {"status": "ready" if ready else "not_ready", "healthy_workers": healthy,
            "total_workers": len(state.registry.workers), "draining": state.draining}
    return web.Response(status=200 if ready else 503, body=_json(body), content_type="application/json")


async def metrics(request: web.Request) -> web.Response:
    state: GatewayState = request.app[STATE]
    return web.Response(body=state.metrics.render(), content_type="text/plain", charset="utf-8")


def tune_gc() -> None:
    """Keep the cyclic collector off the hot path once everything long-lived exists.

    Each proxied request allocates many short-lived containers (futures, tasks, headers):
    with CPython's default thresholds a generation-0 collection ran every ~15 requests and
    a full one, walking all ~43k objects made at start-up (modules, metrics, policy
    tables), every ~1,800. Freezing the start-up heap and collecting every 100k
    allocations measured ~15% less CPU per request (bench/RESULTS.md); reference counting
    still frees everything acyclic at once, and RSS under load did not change (~48 MB).
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)



def build_app(cfg: GatewayConfig) -> web.Application:
    state = GatewayState(cfg)
    app = web.Application(middlewares=[error_middleware], client_max_size=cfg.max_payload_size)
    app[STATE] = state

    async def on_startup(_app: web.Application) -> None:
        await state.start()
        tune_gc()

    async def on_shutdown(_app: web.Application) -> None:
        state.drain.draining = True

    async def on_cleanup(_app: web.Application) -> None:
        await state.stop()

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    if state.qos is not None and state.qos.budgets is not None:  # x-ratelimit-* headers, streams included
        app.on_response_prepare.append(state.qos.on_prepare)
    r = app.router
    r.add_post(CHAT, generation_handler(CHAT))
    r.add_post(COMPLETIONS, generation_handler(COMPLETIONS))
    r.add_post(GENERATE, generation_handler(GENERATE))
    r.add_get("/v1/models", models)
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        r.add_get(path, info_passthrough)
    for path in ("/v1/tokenize", "/tokenize", "/v1/detokenize", "/detokenize"):
        r.add_post(path, info_passthrough)
    for path in ("/parse_function_call", "/separate_reasoning"):  # SGLang's stateless parsers: any worker's
        r.add_post(path, info_passthrough)
    r.add_get("/health", health)
    r.add_get("/liveness", health)
    r.add_get("/readiness", readiness)
    r.add_get("/metrics", metrics)
    r.add_get("/openapi.json", openapi_json)
    r.add_put(GENERATE, generation_handler(GENERATE))  # SGLang takes both; sent upstream as POST
    add_api_routes(app, state)  # embeddings, rerank, score, classify, Responses, /v1/models/{model}
    from gateway import admin  # its handlers read STATE from this module

    r.add_get("/workers", admin.list_workers)
    r.add_post("/workers", admin.add_worker)
    r.add_delete("/workers", admin.remove_worker)
    r.add_delete("/workers/{url:.+}", admin.remove_worker)
    r.add_post("/add_worker", admin.add_worker)  # sglang-router's spelling
    r.add_post("/remove_worker", admin.remove_worker)
    r.add_post("/abort_request", admin.abort_request)
    r.add_post("/flush_cache", admin.flush_cache)
    return app
