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
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from gateway import __version__, group, tokenizer_check
from gateway.admission import Admission
from gateway.auth import bearer_token, key_matches
from gateway.config import GatewayConfig
from gateway.drain import Drain
from gateway.encoding import PromptEncoder
from gateway.error_shape import normalized
from gateway.errors import GatewayError, error_response, from_exception
from gateway.metrics import GatewayMetrics
from gateway.openapi import openapi_json
from gateway.process_metrics import ProcessCollector
from gateway.ratelimit import RateLimiter, check_rate
from gateway.pd import Pairs, pd_policies
from gateway.proxy import Proxy
from gateway.request import CHAT, COMPLETIONS, GENERATE, build_view, read_body, request_id_from
from gateway.upstream import make_session
from gateway.workers import WorkerRegistry
from policies.base import Policy
from policies.loader import load_policy, options_for
from wire.prefix_ids import RecentIds
from wire.tokenizer import load_tokenizer

log = logging.getLogger("kvgate")
_json = msgspec.json.encode

ADMIN_PATHS = ("/workers", "/add_worker", "/remove_worker", "/flush_cache", "/abort_request")
OPEN_PATHS = ("/health", "/readiness", "/liveness", "/metrics", "/openapi.json")

STATE: web.AppKey["GatewayState"] = web.AppKey("kvgate", object)  # type: ignore[arg-type]


class GatewayState:
    """Everything a handler needs, built once at startup."""

    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.process_index = group.process_index()  # slot in a process group (gateway.group); 0 alone
        self.metrics = GatewayMetrics()
        self.admission = Admission(cfg.max_concurrent_requests, cfg.queue_size, cfg.queue_timeout_secs)
        tokenizer = load_tokenizer(cfg.tokenizer, cfg.chat_template, int(cfg.tokenize_cache_mb * (1 << 20)))
        self.encoder = PromptEncoder(tokenizer, cfg.tokenize_inline_chars) if tokenizer is not None else None
        # One policy per worker role: unified workers use the main policy; in PD mode the
        # prefill side defaults to it (prefix hits live on prefill) and decode to least load.
        # ``policy_options`` serve the main and the prefill policy: where those differ, each
        # takes the options it declares, and an option neither declares is an error.
        shared = cfg.pd_disaggregation and cfg.prefill_policy not in (None, cfg.policy)
        load = options_for(cfg.policy_options, [cfg.policy, cfg.prefill_policy]) if shared else load_policy
        self.policy = load(cfg.policy, **cfg.policy_options)
        self.policies: dict[str, Policy] = {"unified": self.policy}
        if cfg.pd_disaggregation:
            self.policies["prefill"], self.policies["decode"] = pd_policies(cfg, self.policy, load)
        self.needs_prompt = any(p.needs_prompt for p in self.policies.values())
        # ids that clients send, kept to decode only what a next turn adds (wire.prefix_ids)
        self.recent_ids = RecentIds(int(cfg.ids_cache_mb * (1 << 20))) \
            if self.needs_prompt and cfg.ids_cache_mb > 0 else None
        sources = [s.stats for s in (self.encoder, self.recent_ids) if s is not None]
        if sources:
            self.metrics.tokenizer_stats = lambda: {k: v for f in sources for k, v in f().items()}
        self.drain = Drain(OPEN_PATHS)
        self.limiter = RateLimiter(cfg.rate_limit_rps, cfg.rate_limit_burst or cfg.rate_limit_rps) \
            if cfg.rate_limit_rps > 0 else None
        self.session = None  # created on startup, inside the running loop
        self._checks: dict[str, asyncio.Task] = {}  # tokenizer checks in flight, by worker url
        self.registry: WorkerRegistry
        self.proxy: Proxy

    @property
    def draining(self) -> bool:
        return self.drain.draining

    def _scrape_gauges(self) -> None:
        for worker in self.registry.workers.values():
            self.metrics.in_flight.labels(worker.url).set(worker.view.in_flight)
        self.metrics.queue_depth.set(self.admission.queued)
        self.metrics.held_now.set(self.proxy.holds.held)
        if self.encoder is not None:
            self.metrics.tokenized_off_loop.set(self.encoder.offloaded)

    async def start(self) -> None:
        cfg = self.cfg
        self.metrics.add_local(ProcessCollector(asyncio.get_running_loop()))
        self.session = make_session(connect_timeout=cfg.connect_timeout_secs, read_timeout=cfg.request_timeout_secs,
                                    limit_per_host=cfg.max_connections_per_worker)
        self.registry = WorkerRegistry(cfg, self.session)
        unique = list({id(p): p for p in self.policies.values()}.values())
        self.registry.poll_load = any(p.needs_engine_load for p in unique)
        self.registry.listeners.append(self._on_worker_event)
        pairs: Callable[[Callable[[], None]], Pairs] | None = None
        if cfg.pd_disaggregation:  # each attempt is a prefill/decode pair, not one worker
            def pairs(freed: Callable[[], None]) -> Pairs:
                return Pairs(self.registry, self.policy, self.session, self.metrics, freed,
                             prefill_policy=self.policies["prefill"], decode_policy=self.policies["decode"])
        self.proxy = Proxy(self.registry, self.policy, self.session, self.metrics, cfg.max_retries,
                           cfg.max_hold_secs, cfg.hold_wake, target=pairs)
        for role, policy in self.policies.items():
            self.metrics.policy_sources.append((f"{role}:{policy.name}", policy.stats))
        for policy in unique:
            await policy.start()
        await asyncio.gather(*(self.registry.add(spec) for spec in cfg.workers))
        self.registry.start()
        self.metrics.before_scrape = self._scrape_gauges
        if self.metrics.group is not None:
            self.metrics.group.start(self._scrape_gauges)

    async def stop(self) -> None:
        if self.metrics.group is not None:
            self.metrics.group.stop()
        for task in list(self._checks.values()):
            task.cancel()
        await self.registry.stop()
        for policy in {id(p): p for p in self.policies.values()}.values():
            await policy.stop()
        if self.session is not None:
            await self.session.close()
        if self.encoder is not None:
            self.encoder.close()

    def _on_worker_event(self, event: str, worker: Any) -> None:
        self.metrics.healthy.labels(worker.url, worker.view.role).set(1 if worker.view.healthy else 0)
        if (self.encoder is not None and event in ("added", "health") and worker.view.healthy
                and worker.tokenizer_match is None and worker.url not in self._checks):
            task = asyncio.get_running_loop().create_task(self._check_tokenizer(worker))
            self._checks[worker.url] = task
            task.add_done_callback(lambda _t, url=worker.url: self._checks.pop(url, None))
        if event == "removed":
            for kind in (worker.tokenizer_match or {}):
                self.metrics.tokenizer_match.remove(worker.url, kind)
        policy = self.policies.get(worker.view.role)
        if policy is None:
            return
        if event == "added":
            policy.on_worker_added(worker.view)
        elif event == "removed":
            policy.on_worker_removed(worker.view)
            self.metrics.healthy.remove(worker.url, worker.view.role)

    async def _check_tokenizer(self, worker: Any) -> None:
        """Ask a worker that just became healthy how it tokenizes the probes (``gateway.tokenizer_check``)."""
        found = await tokenizer_check.check(self.session, worker.url, worker.auth_headers(), self.encoder.tokenizer,
                                            aiohttp.ClientTimeout(total=self.cfg.health_check_timeout_secs))
        worker.tokenizer_match = found
        if worker.url in self.registry.workers:
            for kind, same in found.items():
                self.metrics.tokenizer_match.labels(worker.url, kind).set(1 if same else 0)


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
    if log.isEnabledFor(logging.DEBUG):  # never headers: they carry the keys
        log.debug("%s %s -> %d", request.method, route, response.status)
    return response


def check_auth(request: web.Request, cfg: GatewayConfig) -> None:
    path = request.path
    if path in OPEN_PATHS:
        return
    admin = path.startswith(ADMIN_PATHS)
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


def generation_handler(route: str):
    async def handle(request: web.Request) -> web.StreamResponse:
        state: GatewayState = request.app[STATE]
        raw = await _read_body(request, state.cfg.max_payload_size)
        body, packed = read_body(raw, route, state.recent_ids)
        if body.model and state.cfg.strict_models and route != GENERATE and not state.registry.knows_model(body.model):
            raise GatewayError(404, f"model {body.model!r} is not served here; see /v1/models",
                               code="model_not_found", param="model")
        started = time.perf_counter()
        async with state.admission.slot():  # before tokenizing: a refused request costs no encode
            view = await build_view(body, route, request.headers, request_id_from(request.headers), state.encoder,
                                    state.needs_prompt, packed)
            response = await state.proxy.forward(request, view, raw, body)
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


# --- assembly -------------------------------------------------------------------------------

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
    from gateway import admin  # its handlers read STATE from this module

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
    r = app.router
    r.add_post(CHAT, generation_handler(CHAT))
    r.add_post(COMPLETIONS, generation_handler(COMPLETIONS))
    r.add_post(GENERATE, generation_handler(GENERATE))
    r.add_get("/v1/models", models)
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        r.add_get(path, info_passthrough)
    for path in ("/v1/tokenize", "/tokenize", "/v1/detokenize", "/detokenize"):
        r.add_post(path, info_passthrough)
    r.add_get("/health", health)
    r.add_get("/liveness", health)
    r.add_get("/readiness", readiness)
    r.add_get("/metrics", metrics)
    r.add_get("/openapi.json", openapi_json)
    r.add_get("/workers", admin.list_workers)
    r.add_post("/workers", admin.add_worker)
    r.add_delete("/workers", admin.remove_worker)
    r.add_delete("/workers/{url:.+}", admin.remove_worker)
    r.add_post("/add_worker", admin.add_worker)  # sglang-router's spelling
    r.add_post("/remove_worker", admin.remove_worker)
    r.add_post("/abort_request", admin.abort_request)
    r.add_post("/flush_cache", admin.flush_cache)
    return app
