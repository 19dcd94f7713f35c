"""The client routes SGLang serves beyond chat, completions and generate.

- ``GET /v1/models/{model}``: answered here from the models the healthy workers serve.
- Embeddings, rerank, score, classify, decisions, SGLang's native ``/encode`` and
  ``/classify``, and Anthropic's Messages API: one worker serving the body's ``model``,
  chosen by the policy and forwarded with chat's machinery (original bytes, retries, holds,
  metrics; ``gateway.proxy``). An engine's Anthropic-shaped errors pass through as they
  are (both shapes nest ``error.message`` and ``error.type``); the gateway's own are OpenAI's.
- The Responses API: a create goes where the policy says, and the worker that answers
  is remembered as the owner of the response's id (``gateway.responses``). A create that
  names a ``previous_response_id``, and every retrieve, cancel, input_items or delete, goes
  to that owner and nowhere else: another worker would answer for a response it never saw.
  An id the gateway never saw is a 404; an owner that left the fleet a 410, one that is
  unhealthy or does not answer a 503.

Auth, drain, rate limits and error shapes are the app middleware's, as for every route.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence

import aiohttp
import msgspec
from aiohttp import web
from yarl import URL

from gateway.api_body import (CLASSIFY, COUNT_TOKENS, DECISIONS, EMBEDDINGS, ENCODE, MESSAGES, RERANK, RESPONSES,
                              SCORE, V1_CLASSIFY, ApiBody, parse_api_body, prompt_of)
from gateway.attempts import Failure, failed
from gateway.error_shape import normalized
from gateway.errors import GatewayError
from gateway.proxy import Proxy, Unified, kind, upstream_headers
from gateway.request import request_id_from, session_key
from gateway.responses import ResponseOwners, tap_factory
from gateway.state import GatewayState
from gateway.workers import Worker
from index.views import RequestView
from policies.base import Choice

_json = msgspec.json.encode

# Upstream path -> the methods SGLang takes it with (PUT is sent upstream as POST: SGLang
# serves both with one handler).
ONE_WORKER: dict[str, tuple[str, ...]] = {
    EMBEDDINGS: ("POST",), RERANK: ("POST", "PUT"), SCORE: ("POST",), V1_CLASSIFY: ("POST",),
    DECISIONS: ("POST",), ENCODE: ("POST", "PUT"), CLASSIFY: ("POST", "PUT"),
    MESSAGES: ("POST",), COUNT_TOKENS: ("POST",),
}
RESPONSE = "/v1/responses/{response_id}"
FOLLOW_UPS: tuple[tuple[str, str], ...] = (
    ("GET", RESPONSE), ("DELETE", RESPONSE), ("POST", RESPONSE + "/cancel"), ("GET", RESPONSE + "/input_items"))
EMBEDDING_ONLY = frozenset({EMBEDDINGS, V1_CLASSIFY, ENCODE, CLASSIFY, RERANK})
GENERATION_ONLY = frozenset({RESPONSES, MESSAGES, COUNT_TOKENS})


class ByKind(Unified):
    """``Unified``, where a request that names no model and that only one kind of model
    serves prefers workers of that kind (SGLang's ``is_embedding`` in their server_info):
    in a fleet of embedding and chat models, an embeddings or rerank request without a
    model does not go to a chat model that would refuse it. A named model decides alone."""

    def candidates(self, view: RequestView, exclude: Sequence[str]) -> list[Worker]:
        workers = super().candidates(view, exclude)
        if view.model is not None or not (view.route in EMBEDDING_ONLY or view.route in GENERATION_ONLY):
            return workers
        want = view.route in EMBEDDING_ONLY
        return [w for w in workers if bool(w.view.server_info.get("is_embedding")) is want] or workers


async def _read(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise GatewayError(413, f"request body exceeds {limit} bytes", code="payload_too_large")
    return await request.read()


class ApiRoutes:
    """The handlers, sharing the gateway's state; their own ``Proxy`` (built at startup),
    whose workers are always single unified ones, even in PD mode."""

    def __init__(self, state: GatewayState, owners: ResponseOwners | None = None) -> None:
        self.state = state
        self.owners = owners if owners is not None else ResponseOwners()
        self.proxy: Proxy
        self.target: ByKind

    async def start(self, _app: web.Application) -> None:
        st = self.state
        made: list[ByKind] = []

        def target(freed: Callable[[], None]) -> ByKind:
            made.append(ByKind(st.registry, st.policy, st.session, st.metrics, freed, st.routing_peers))
            return made[-1]

        self.proxy = Proxy(st.registry, st.policy, st.session, st.metrics, st.cfg.max_retries, st.cfg.max_hold_secs,
                           st.cfg.hold_wake, target=target)
        # one hold room with chat: a request that frees a worker on either path wakes held ones on both
        self.proxy.attempts.holds = self.proxy.holds = st.proxy.holds
        self.target = made[0]
        self.target.taps[RESPONSES] = tap_factory(self.owners)
        if st.peers is not None:  # a group: each process's owners are every process's
            self.owners.on_remember, st.peers.learn_owner = st.peers.owned, self.owners.learn

    # --- the gateway's own answer ----------------------------------------------------------
    async def model(self, request: web.Request) -> web.Response:
        """SGLang's model card for a model some healthy worker serves."""
        name = request.match_info["model"]
        if name not in self.state.registry.models():
            raise GatewayError(404, f"The model '{name}' does not exist", code="model_not_found", param="model")
        card = {"id": name, "object": "model", "created": 0, "owned_by": "sglang", "root": name, "parent": None}
        return web.Response(body=_json(card), content_type="application/json")

    # --- one worker, chosen by the policy ---------------------------------------------------
    def one_worker(self, route: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self._proxied(request, route)

        return handle

    async def _proxied(self, request: web.Request, route: str) -> web.StreamResponse:
        st = self.state
        raw = await _read(request, st.cfg.max_payload_size)
        body = parse_api_body(raw)
        if body.model and st.cfg.strict_models and not st.registry.knows_model(body.model):
            raise GatewayError(404, f"model {body.model!r} is not served here; see /v1/models",
                               code="model_not_found", param="model")
        owner = self._owner(body.previous_response_id) if route == RESPONSES and body.previous_response_id else None
        qos, ticket = st.qos, None
        if qos is not None:  # tenant, class (by header only: these bodies have no engine priority) and budget
            max_out = body.max_output_tokens if type(body.max_output_tokens) is int else None
            ticket, raw = qos.admit(request, raw, body.model, None, max_out, splice=False)
        started = time.perf_counter()
        try:
            async with st.admission.slot(ticket):
                view = await self._view(request, route, body)
                if ticket is not None:
                    view.qos = ticket
                    qos.routed(ticket, view)
                if owner is None:
                    response = await self.proxy.forward(request, view, raw, body)
                else:
                    response = await self._pinned(request, view, raw, body, owner)
        finally:
            if ticket is not None:
                qos.finish(ticket)
        st.metrics.latency_of(route).observe(time.perf_counter() - started)
        return normalized(response)

    async def _view(self, request: web.Request, route: str, body: ApiBody) -> RequestView:
        st = self.state
        text, ids = prompt_of(route, body) if st.needs_prompt else (None, None)
        packed = None
        if ids is None and text is not None and st.encoder is not None:
            ids, packed = await st.encoder.text(text)
        session = session_key(request.headers, body.prompt_cache_key, body.user)
        max_tokens = body.max_output_tokens if type(body.max_output_tokens) is int else None
        rid = request_id_from(request.headers, st.cfg.request_id_headers)
        return RequestView(request_id=rid, route=route, model=body.model or None,
                           text=text, token_ids=ids, packed_ids=packed, session_key=session, stream=bool(body.stream),
                           max_tokens=max_tokens,
                           cache_salt=body.cache_salt if isinstance(body.cache_salt, str) else None,
                           headers=request.headers)

    async def _pinned(self, request: web.Request, view: RequestView, raw: bytes, body: ApiBody,
                      worker: Worker) -> web.StreamResponse:
        """One attempt on the owner of the previous response; no retry elsewhere."""
        pick = (worker, Choice(worker.view, reason="previous_response_id"))
        result = await self.target.attempt(request, view, raw, body, pick, 0)
        if not isinstance(result, Failure):
            return result
        if result.status >= 400:
            return web.Response(status=result.status, body=result.body, content_type=result.content_type,
                                headers={"X-Request-ID": view.request_id})
        raise _unavailable(body.previous_response_id or "", worker.url, result.cause)

    # --- the owner of a stored response ----------------------------------------------------
    def _owner(self, response_id: str) -> Worker:
        url = self.owners.where(response_id)
        if url is None:
            raise GatewayError(404, f"Response with id '{response_id}' not found.", code="response_not_found",
                               param="response_id")
        worker = self.state.registry.workers.get(url)
        if worker is None:
            raise GatewayError(410, f"response '{response_id}' is stored on worker {url}, which has left the fleet",
                               code="response_worker_gone", param="response_id")
        if not worker.available:
            raise _unavailable(response_id, url, "unhealthy")
        return worker

    async def follow_up(self, request: web.Request) -> web.Response:
        """Retrieve, cancel, input_items or delete: the owner's answer, as it sent it."""
        st = self.state
        response_id = request.match_info["response_id"]
        raw = await _read(request, st.cfg.max_payload_size) if request.can_read_body else b""
        worker = self._owner(response_id)
        rid = request_id_from(request.headers, st.cfg.request_id_headers)
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else RESPONSE
        started = time.perf_counter()
        async with st.admission.slot():
            try:
                # the client's path and query as it sent them (``encoded``: not spelled again)
                async with st.session.request(request.method, URL(worker.url + request.raw_path, encoded=True),
                                              data=raw or None,
                                              headers=upstream_headers(request, rid, worker)) as upstream:
                    data = await upstream.read()
                    ctype = upstream.headers.get("Content-Type", "application/json").split(";")[0]
                    status = upstream.status
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                failed(worker, kind(exc, "connect"), repr(exc), st.metrics)
                raise _unavailable(response_id, worker.url, kind(exc, "connect")) from None
        st.metrics.latency_of(route).observe(time.perf_counter() - started)
        return normalized(web.Response(status=status, body=data, content_type=ctype, headers={"X-Request-ID": rid}))


def _unavailable(response_id: str, url: str, why: str) -> GatewayError:
    return GatewayError(503, f"response '{response_id}' is stored on worker {url}, which is not available ({why}); "
                             "no other worker holds it", code="response_worker_unavailable", param="response_id")


def add_api_routes(app: web.Application, state: GatewayState, owners: ResponseOwners | None = None) -> ApiRoutes:
    """Register the routes on ``app``; their proxy is built at startup, after ``state.start``."""
    api = ApiRoutes(state, owners)
    app.on_startup.append(api.start)
    r = app.router
    r.add_get("/v1/models/{model:.+}", api.model)
    for path, methods in ONE_WORKER.items():
        handler = api.one_worker(path)
        for method in methods:
            r.add_route(method, path, handler)
    r.add_post(RESPONSES, api.one_worker(RESPONSES))
    for method, path in FOLLOW_UPS:
        r.add_route(method, path, api.follow_up)
    return api
