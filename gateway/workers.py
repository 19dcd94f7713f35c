"""The worker registry: who is out there, whether they are healthy, and how loaded.

Each ``Worker`` holds its current ``WorkerView``, which policies read, and replaces it
whenever health, models, the in-flight count, load or server_info change (a view is never
changed once handed out: ``index.views``). A new report (load, server_info) goes through
``WorkerView.reported``, so policies learn from ``WorkerView.reports`` that one came.
Background loops probe ``/health`` with failure/success thresholds and, when the policy
asks for it, poll ``/v1/loads`` (falling back to ``/get_load`` on older SGLang).
Listeners hear ``added``, ``removed``, ``health``, and ``updated`` when a known worker's
server_info is read again or the KV capacity it reports changes (``Policy.on_worker_updated``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from typing import Any

import aiohttp
import msgspec

from gateway.circuit import CircuitBreaker
from gateway.config import GatewayConfig, WorkerSpec
from gateway.tls import explain
from index.views import EngineLoad, WorkerView, Workers, new_membership

log = logging.getLogger("kvgate.workers")
_json = msgspec.json.Decoder()


class _Loads(msgspec.Struct):
    loads: list[dict[str, Any]] = []


class Worker:
    def __init__(self, spec: WorkerSpec, cfg: GatewayConfig) -> None:
        self.spec = spec
        self.url = spec.url.rstrip("/")
        self.view = WorkerView(url=self.url, role=spec.role, bootstrap_port=spec.bootstrap_port, healthy=False)
        self.breaker = CircuitBreaker(cfg.cb_failure_threshold, cfg.cb_timeout_secs)
        self.api_key = spec.api_key or cfg.worker_api_key
        self.fail_streak = 0
        self.ok_streak = 0
        self.last_error: str | None = None
        self.load_endpoint: str | None = "/v1/loads"
        self.draining = False
        self.tokenizer_match: dict[str, bool] | None = None  # gateway.tokenizer_check's answer, once asked

    def started(self) -> None:
        """One more request routed here and not yet finished."""
        self.view = self.view.with_in_flight(self.view.in_flight + 1)

    def finished(self) -> None:
        self.view = self.view.with_in_flight(self.view.in_flight - 1)

    def set_healthy(self, healthy: bool) -> None:
        self.view = replace(self.view, healthy=healthy)

    @property
    def available(self) -> bool:
        return self.view.healthy and not self.draining and self.breaker.allows()

    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def describe(self) -> dict[str, Any]:
        v = self.view
        return {
            "url": self.url, "role": v.role, "bootstrap_port": v.bootstrap_port, "healthy": v.healthy,
            "models": sorted(v.models), "in_flight": v.in_flight, "circuit": self.breaker.state,
            "load": msgspec.to_builtins(v.load) if v.load else None, "last_error": self.last_error,
            "tokenizer_match": self.tokenizer_match,
        }


def parse_loads(payload: Any) -> EngineLoad:
    """Sum per-DP-rank load from either ``/v1/loads`` (>= 0.5.10) or ``/get_load`` (<= 0.5.20)."""
    load = EngineLoad(timestamp=time.monotonic())
    ranks = payload.get("loads", []) if isinstance(payload, dict) else payload
    for r in ranks or []:
        load.running += int(r.get("num_running_reqs", r.get("num_reqs", 0)) or 0)
        load.waiting += int(r.get("num_waiting_reqs", 0) or 0)
        load.used_tokens += int(r.get("num_used_tokens", r.get("num_tokens", 0)) or 0)
        load.max_tokens += int(r.get("max_total_num_tokens", 0) or 0)
    if isinstance(payload, list):  # /get_load counts waiting inside num_reqs
        load.running = max(0, load.running - load.waiting)
    return load


class WorkerRegistry:
    def __init__(self, cfg: GatewayConfig, session: aiohttp.ClientSession) -> None:
        self.cfg = cfg
        self.session = session
        self.workers: dict[str, Worker] = {}
        self.listeners: list[Callable[[str, Worker], None]] = []  # ("added"|"updated"|"removed"|"health", worker)
        self.poll_load = False
        self.vet: Callable[[str], Awaitable[None]] | None = None  # raises to refuse a runtime add (worker_policy)
        self._tasks: list[asyncio.Task] = []
        self._probe_timeout = aiohttp.ClientTimeout(total=cfg.health_check_timeout_secs)
        self._memberships: list[tuple[list[Worker], int]] = []  # recent candidate lists and their tokens (``views``)

    # --- membership -------------------------------------------------------------------
    async def add(self, spec: WorkerSpec, configured: bool = False) -> Worker:
        """Register and probe a worker. Unless it is ``configured`` (the operator's own list),
        ``vet`` sees its URL first and may refuse it before any connection is made."""
        url = spec.url.rstrip("/")
        if url in self.workers:
            raise ValueError(f"worker {url} is already registered")
        if self.vet is not None and not configured:
            await self.vet(url)
            if url in self.workers:  # added by another caller while this one was being checked
                raise ValueError(f"worker {url} is already registered")
        worker = Worker(spec, self.cfg)
        self.workers[url] = worker
        await self._discover(worker)
        await self.check_health(worker, initial=True)
        self._emit("added", worker)
        log.info("worker added: %s role=%s healthy=%s models=%s", url, spec.role, worker.view.healthy,
                 sorted(worker.view.models))
        return worker

    def remove(self, url: str) -> Worker:
        worker = self.workers.pop(url.rstrip("/"))
        worker.draining = True
        self._emit("removed", worker)
        log.info("worker removed: %s", url)
        return worker

    def _emit(self, event: str, worker: Worker) -> None:
        for listener in self.listeners:
            try:
                listener(event, worker)
            except Exception:  # a listener bug must not take the registry down
                log.exception("worker listener failed on %s", event)

    # --- selection inputs -----------------------------------------------------------------
    def candidates(self, model: str | None, role: str = "unified", exclude: Iterable[str] = ()) -> list[Worker]:
        excluded = set(exclude)
        return [
            w for w in self.workers.values()
            if w.view.role == role and w.available and w.url not in excluded
            and (model is None or not w.view.models or model in w.view.models)
        ]

    def views(self, workers: list[Worker]) -> Workers:
        """The current views of ``workers`` (an answer of ``candidates``), as a policy is
        given them: with the membership token of the last list of the same workers in the
        same order (``index.views.Workers``), so that a policy's caches know them without
        comparing urls. A worker's url never changes, so the same ``Worker`` objects are the
        same urls (a worker removed and added again is another object: another token)."""
        for members, token in self._memberships:  # compared by identity, in C
            if members == workers:
                break
        else:  # a few lists recur (roles, models, retries' exclusions): the last 8 are kept
            token = new_membership()
            self._memberships = [(list(workers), token), *self._memberships[:7]]
        return Workers([w.view for w in workers], token)

    def models(self) -> set[str]:
        return {m for w in self.workers.values() if w.view.healthy for m in w.view.models}

    def knows_model(self, model: str) -> bool:
        """True when some worker serves ``model``, or when no worker has reported any model."""
        workers = self.workers.values()
        return any(model in w.view.models for w in workers) or not any(w.view.models for w in workers)

    def ready(self) -> bool:
        if self.cfg.pd_disaggregation:
            roles = {w.view.role for w in self.workers.values() if w.view.healthy}
            return {"prefill", "decode"} <= roles
        return any(w.view.healthy for w in self.workers.values())

    # --- probes ---------------------------------------------------------------------------
    async def _get_json(self, worker: Worker, path: str) -> Any:
        async with self.session.get(worker.url + path, headers=worker.auth_headers(),
                                    timeout=self._probe_timeout) as resp:
            if resp.status != 200:
                raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
            return _json.decode(await resp.read())

    async def _discover(self, worker: Worker) -> None:
        """Read server info and served models once; a worker still starting is retried by health checks."""
        for path in ("/server_info", "/get_server_info"):
            try:
                info = await self._get_json(worker, path)
                worker.view = worker.view.reported(server_info=info if isinstance(info, dict) else {})
                break
            except Exception:
                continue
        try:
            models = await self._get_json(worker, "/v1/models")
            worker.view = replace(worker.view, models=frozenset(m["id"] for m in models.get("data", []) if "id" in m))
        except Exception as exc:
            worker.last_error = f"model discovery failed: {exc!r}"
        if worker.view.role == "prefill" and worker.view.bootstrap_port is None:
            port = worker.view.server_info.get("disaggregation_bootstrap_port")
            worker.view = replace(worker.view, bootstrap_port=int(port) if port else None)

    async def check_health(self, worker: Worker, initial: bool = False) -> bool:
        try:
            async with self.session.get(worker.url + self.cfg.health_check_endpoint, headers=worker.auth_headers(),
                                        timeout=self._probe_timeout) as resp:
                ok = resp.status == 200
                await resp.read()
        except Exception as exc:
            ok = False
            worker.last_error = f"health check: {explain(exc, worker.url, self.cfg.worker_client_cert_file)}"
        was = worker.view.healthy
        if ok:
            worker.fail_streak = 0
            worker.ok_streak += 1
            if not was and (initial or worker.ok_streak >= self.cfg.health_success_threshold):
                worker.set_healthy(True)
                worker.breaker.record_success()
                if not worker.view.models:
                    await self._discover(worker)
                    if worker.url in self.workers:
                        self._emit("updated", worker)
        else:
            worker.ok_streak = 0
            worker.fail_streak += 1
            if was and worker.fail_streak >= self.cfg.health_failure_threshold:
                worker.set_healthy(False)
        if was != worker.view.healthy:
            log.log(logging.INFO if worker.view.healthy else logging.WARNING, "worker %s is now %s", worker.url,
                    "healthy" if worker.view.healthy else "unhealthy")
            self._emit("health", worker)
        return worker.view.healthy

    async def poll_load_once(self, worker: Worker) -> None:
        if worker.load_endpoint is None:
            return
        try:
            load = parse_loads(await self._get_json(worker, worker.load_endpoint))
            before = worker.view.load
            worker.view = worker.view.reported(load=load)
            if before is None or before.max_tokens != load.max_tokens:  # the KV capacity it states
                self._emit("updated", worker)
        except aiohttp.ClientResponseError as exc:
            if exc.status == 404:  # older SGLang: only /get_load; newer: only /v1/loads
                worker.load_endpoint = "/get_load" if worker.load_endpoint == "/v1/loads" else None
        except Exception:
            pass

    async def _loop(self, interval: float, fn: Callable[[Worker], Any]) -> None:
        while True:
            await asyncio.sleep(interval)
            workers = list(self.workers.values())
            if workers:
                await asyncio.gather(*(fn(w) for w in workers), return_exceptions=True)

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._loop(self.cfg.health_check_interval_secs, self.check_health)))
        if self.poll_load:
            self._tasks.append(asyncio.create_task(self._loop(self.cfg.load_poll_interval_secs, self.poll_load_once)))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
