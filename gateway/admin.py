"""Admin routes: runtime worker membership and what is fanned out to every healthy worker.

In a process group (``gateway.processes``) each acts on the member that answers.
"""

from __future__ import annotations

import asyncio

import msgspec
from aiohttp import web

from gateway import audit
from gateway.app import STATE, GatewayState
from gateway.config import WorkerSpec
from gateway.errors import GatewayError
from gateway.worker_policy import WorkerRefused

_json = msgspec.json.encode


class _AddWorker(msgspec.Struct):
    url: str
    role: str = "unified"
    bootstrap_port: int | None = None
    api_key: str | None = None


async def list_workers(request: web.Request) -> web.Response:
    state: GatewayState = request.app[STATE]
    return web.Response(body=_json({"workers": [w.describe() for w in state.registry.workers.values()]}),
                        content_type="application/json")


async def add_worker(request: web.Request) -> web.Response:
    state: GatewayState = request.app[STATE]
    raw = await request.read()
    try:
        spec = msgspec.json.decode(raw, type=_AddWorker) if raw.strip() else _AddWorker(url=request.query["url"])
    except (msgspec.DecodeError, msgspec.ValidationError, KeyError) as exc:
        raise GatewayError(400, f"expected {{'url', 'role', 'bootstrap_port'}}: {exc}") from None
    request[audit.TARGET] = spec.url
    if spec.role not in ("unified", "prefill", "decode"):
        raise GatewayError(400, f"role must be unified, prefill or decode, not {spec.role!r}", param="role")
    if not spec.url.startswith(("http://", "https://")):
        raise GatewayError(400, "url must start with http:// or https://", param="url")
    try:
        worker = await state.registry.add(WorkerSpec(spec.url, spec.role, spec.bootstrap_port, spec.api_key))
    except ValueError as exc:
        raise GatewayError(409, str(exc), code="worker_exists") from None
    except WorkerRefused as exc:  # by --worker-url-allow or the ranges always refused (gateway.worker_policy)
        raise GatewayError(403, str(exc), code="worker_url_refused", param="url") from None
    if state.membership is not None:
        state.membership.added(worker.spec)
    return web.Response(status=201, body=_json(worker.describe()), content_type="application/json")


async def remove_worker(request: web.Request) -> web.Response:
    state: GatewayState = request.app[STATE]
    url = request.query.get("url") or request.match_info.get("url", "")
    try:
        worker = state.registry.remove(url)
    except KeyError:
        raise GatewayError(404, f"no worker {url!r}", code="worker_not_found") from None
    if state.membership is not None:
        state.membership.removed(worker.url)
    return web.Response(body=_json(worker.describe()), content_type="application/json")


async def _fan_out(state: GatewayState, path: str, body: bytes) -> list[tuple[str, int, bytes]]:
    async def one(worker):
        try:
            async with state.session.post(worker.url + path, data=body, headers={
                    "Content-Type": "application/json", **worker.auth_headers()}) as resp:
                return worker.url, resp.status, await resp.read()
        except Exception as exc:
            return worker.url, 0, repr(exc).encode()

    return await asyncio.gather(*(one(w) for w in state.registry.workers.values() if w.view.healthy))


async def abort_request(request: web.Request) -> web.Response:
    state: GatewayState = request.app[STATE]
    results = await _fan_out(state, "/abort_request", await request.read())
    return web.Response(body=_json({"workers": {url: status for url, status, _ in results}}),
                        content_type="application/json")


async def flush_cache(request: web.Request) -> web.Response:
    state: GatewayState = request.app[STATE]
    results = await _fan_out(state, "/flush_cache", b"")
    failed = {url: body.decode(errors="replace") for url, status, body in results if status != 200}
    body = {"workers": {url: status for url, status, _ in results}, "errors": failed}
    return web.Response(status=400 if failed else 200, body=_json(body), content_type="application/json")
