"""Workers from Kubernetes: pods matching a label selector become workers while they serve.

The flags are sglang-router's and SMG's (``--service-discovery``, ``--selector``,
``--service-discovery-port``, ``--service-discovery-namespace``, ``--prefill-selector``,
``--decode-selector``, the ``sglang.ai/bootstrap-port`` annotation), so a deployment can
switch routers by changing the binary name; ``docs/discovery.md`` has the whole picture.

How it follows the cluster: list the pods, then watch from the list's ``resourceVersion``
(with bookmarks, so a quiet watch still advances it). The pods seen are kept by uid, and
after every change the workers they ask for (one per pod that is Running and Ready, has an
IP and is not terminating) are compared with the ones discovery registered; the difference
goes through ``WorkerRegistry.add``/``remove``, as ``/add_worker`` and ``/remove_worker`` do,
so policies hear ``on_worker_added``/``on_worker_removed``. A ``410 Gone`` (the version was
compacted away) relists; a dropped or silent watch is watched again from the last version,
after a backoff. While the API cannot be reached the workers stay as they are, it is logged,
and ``kvgate_discovery_connected`` reads 0. A url that flags or ``/add_worker`` registered
is theirs: discovery neither adds it again nor removes it.

The client library is ``kubernetes_asyncio`` (the ``k8s`` extra). Of the maintained async
clients it is the one that:

- runs on aiohttp, the gateway's own HTTP stack (lightkube brings httpx2, httpcore2, anyio
  and h2; kr8s httpx, cryptography and python-box);
- has the whole watch protocol: ``resourceVersion`` tracking, ``allowWatchBookmarks`` and
  BOOKMARK events, ERROR events raised as ``ApiException`` (lightkube 1.0.1 cannot ask for
  bookmarks, and on a 410 it watches again from "now", which misses deletions);
- is generated from the Kubernetes OpenAPI spec at each release (36.x for 1.36) and is the
  most used of the three on PyPI; kubeconfig (with exec and OIDC token refresh) and
  in-cluster service-account config come with it.

Its cost is size: 43.6 MB installed (with ``six``, the only dependency the gateway lacks)
against lightkube's 4.9 MB and kr8s's 47.7 MB of new packages, and 0.31-0.37 s to import
against 0.11 s and 0.19 s (Python 3.11, this repository's VM). It is imported only when
``--service-discovery`` is on, once, and pod events are rare, so neither reaches a request.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import random
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client import ApiException, V1Pod

from gateway import audit
from gateway.config import GatewayConfig, WorkerSpec
from gateway.metrics import GatewayMetrics
from gateway.worker_policy import WorkerRefused
from gateway.workers import WorkerRegistry

log = logging.getLogger("kvgate.discovery")

WATCH_SECONDS = 300  # the API server ends each watch after this; it is then opened again
LIST_TIMEOUT = aiohttp.ClientTimeout(total=30, connect=10)
# No byte for this long past the server's own end of a watch: the connection is dead.
WATCH_TIMEOUT = aiohttp.ClientTimeout(total=WATCH_SECONDS + 30, connect=10)
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.5, 30.0
QUIET_WATCH_S = 10.0  # a watch that ends sooner with no event is a failure, not a quiet cluster


@dataclass(frozen=True, slots=True)
class PodRules:
    """Which pods are workers, and how a pod becomes a ``WorkerSpec``."""

    roles: tuple[tuple[str, Mapping[str, str]], ...]  # (role, labels) tried in order
    list_selector: str  # what the API filters on: labels every role's selector shares
    port: int
    port_name: str | None
    bootstrap_annotation: str
    namespace: str | None  # None: all namespaces

    @classmethod
    def from_config(cls, cfg: GatewayConfig) -> PodRules:
        if cfg.pd_disaggregation:
            roles = tuple((r, s) for r, s in (("prefill", cfg.prefill_selector), ("decode", cfg.decode_selector)) if s)
        else:
            roles = (("unified", cfg.selector),)
        shared = dict(roles[0][1]) if roles else {}
        for _, labels in roles[1:]:
            shared = {k: v for k, v in shared.items() if labels.get(k) == v}
        return cls(roles, label_selector(shared), cfg.service_discovery_port, cfg.service_discovery_port_name,
                   cfg.bootstrap_port_annotation, cfg.service_discovery_namespace)


def label_selector(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def role_of(pod: V1Pod, rules: PodRules) -> str | None:
    labels = pod.metadata.labels or {}
    for role, wanted in rules.roles:
        if all(labels.get(k) == v for k, v in wanted.items()):
            return role
    return None


def serving(pod: V1Pod) -> bool:
    """Running, Ready, with an IP and not terminating: a pod that may take requests."""
    status = pod.status
    if pod.metadata.deletion_timestamp is not None or status is None or not status.pod_ip:
        return False
    ready = any(c.type == "Ready" and c.status == "True" for c in status.conditions or ())
    return status.phase == "Running" and ready


def named_port(pod: V1Pod, name: str) -> int | None:
    for container in pod.spec.containers if pod.spec else ():
        for port in container.ports or ():
            if port.name == name:
                return int(port.container_port)
    return None


def annotated_port(pod: V1Pod, key: str) -> int | None:
    raw = (pod.metadata.annotations or {}).get(key)
    if raw is None:
        return None
    try:
        port = int(raw)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        log.warning("pod %s: annotation %s=%r is not a port; ignored", pod.metadata.name, key, raw)
        return None
    return port


def worker_url(ip: str, port: int) -> str:
    host = f"[{ip}]" if ipaddress.ip_address(ip).version == 6 else ip
    return f"http://{host}:{port}"


def spec_for(pod: V1Pod, rules: PodRules) -> WorkerSpec | None:
    """The worker ``pod`` stands for, or None while it is not one (or cannot serve)."""
    role = role_of(pod, rules)
    if role is None or not serving(pod):
        return None
    port = (named_port(pod, rules.port_name) if rules.port_name else None) or rules.port
    # Without the annotation the registry asks the engine (server_info) for the bootstrap port.
    bootstrap = annotated_port(pod, rules.bootstrap_annotation) if role == "prefill" else None
    return WorkerSpec(url=worker_url(pod.status.pod_ip, port), role=role, bootstrap_port=bootstrap)


def status_code(exc: BaseException) -> int | None:
    if isinstance(exc, ApiException):
        return exc.status
    if isinstance(exc, aiohttp.ClientResponseError):
        return exc.status
    return None


def backoff(failures: int) -> float:
    """Seconds to wait after ``failures`` failed calls in a row: doubling, capped, jittered."""
    return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** max(failures - 1, 0)) * random.uniform(0.5, 1.0)


async def api_client() -> tuple[client.ApiClient, Coroutine[Any, Any, None] | None]:
    """In a pod, its service account; elsewhere ``$KUBECONFIG`` or ``~/.kube/config``. With the
    client comes what keeps its token fresh, where the library leaves that to a task."""
    conf = client.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=conf)  # re-reads the token file as it rotates
        return client.ApiClient(conf), None
    path = os.path.expanduser(os.environ.get("KUBECONFIG") or "~/.kube/config")
    try:  # persist_config=False: a refreshed token is never written back into the user's file
        loader = await config.load_kube_config(client_configuration=conf, persist_config=False)
    except (config.ConfigException, OSError) as exc:
        raise RuntimeError(f"--service-discovery: not in a pod (no KUBERNETES_SERVICE_HOST), and no usable "
                           f"kubeconfig at {path}: {exc}") from None
    return client.ApiClient(conf), config.refresh_token(loader, conf)  # exec and GCP tokens; else returns


class PodDiscovery:
    """Keeps the registry's discovered workers equal to the serving pods (see the module)."""

    def __init__(self, cfg: GatewayConfig, registry: WorkerRegistry, metrics: GatewayMetrics) -> None:
        self.rules = PodRules.from_config(cfg)
        self.registry = registry
        self.metrics = metrics
        self.pods: dict[str, V1Pod] = {}  # by uid, as last listed or watched
        self.owned: dict[str, WorkerSpec] = {}  # url -> the spec discovery registered there
        self.resource_version: str | None = None  # None: list before watching
        self._adding: dict[str, asyncio.Task] = {}
        self._failures = 0  # API calls failed in a row (backoff)
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._api: client.ApiClient | None = None

    async def start(self) -> None:
        """Load the credentials (a missing kubeconfig fails the start) and begin watching."""
        self._api, refresh = await api_client()
        log.info("discovery: watching pods %s in %s", self.rules.list_selector or "(all)",
                 self.rules.namespace or "all namespaces")
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._follow()), loop.create_task(self._apply_changes())]
        if refresh is not None:
            self._tasks.append(loop.create_task(refresh))

    async def stop(self) -> None:
        tasks = self._tasks + list(self._adding.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._api is not None:
            await self._api.close()

    # --- the API side: list, then watch -------------------------------------------------------
    def _list_call(self) -> tuple[Any, dict[str, Any]]:
        core = client.CoreV1Api(self._api)
        kwargs: dict[str, Any] = {"label_selector": self.rules.list_selector} if self.rules.list_selector else {}
        if self.rules.namespace:
            return core.list_namespaced_pod, {"namespace": self.rules.namespace, **kwargs}
        return core.list_pod_for_all_namespaces, kwargs

    async def _follow(self) -> None:
        while True:
            try:
                if self.resource_version is None:
                    await self._relist()
                if await self._watch():  # the server ended a watch that worked: open the next one now
                    self._failures = 0
                    continue
                reason = "the watch ended at once, with no event"
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                reason = self._failed(exc)
            self._failures += 1
            delay = backoff(self._failures)
            log.warning("discovery: %s; keeping the %d discovered workers, next try in %.1fs",
                        reason, len(self.owned), delay)
            await asyncio.sleep(delay)

    def _failed(self, exc: Exception) -> str:
        if status_code(exc) == 410:  # compacted away: a watch cannot resume from there
            self.resource_version = None
            return "resourceVersion expired (410 Gone), listing again"
        self.metrics.discovery_connected.set(0)
        return f"Kubernetes API call failed ({_describe(exc)})"

    async def _relist(self) -> None:
        call, kwargs = self._list_call()
        pods = await call(**kwargs, _request_timeout=LIST_TIMEOUT)
        self.pods = {p.metadata.uid: p for p in pods.items if role_of(p, self.rules)}
        self.resource_version = pods.metadata.resource_version
        self.metrics.discovery_relists.inc()
        self.metrics.discovery_connected.set(1)
        self._changed.set()

    async def _watch(self) -> bool:
        """Follow one watch until the server ends it (a dropped one raises). False when it ended
        at once with no event, which is retried after a backoff rather than in a tight loop."""
        call, kwargs = self._list_call()
        received, started = 0, time.monotonic()
        async with watch.Watch() as stream:
            async for event in stream.stream(call, **kwargs, resource_version=self.resource_version,
                                             allow_watch_bookmarks=True, timeout_seconds=WATCH_SECONDS,
                                             _request_timeout=WATCH_TIMEOUT):
                received += 1
                self.on_event(event["type"], event["object"], event["raw_object"])
        return received > 0 or time.monotonic() - started >= QUIET_WATCH_S

    def on_event(self, kind: str, pod: Any, raw: Mapping[str, Any]) -> None:
        """One watch event (ERROR events never get here: the library raises them)."""
        self.metrics.discovery_events.labels(kind).inc()
        self.metrics.discovery_connected.set(1)
        self._failures = 0
        self.resource_version = raw["metadata"]["resourceVersion"]
        if kind == "BOOKMARK":  # only a newer version to resume from
            return
        uid = pod.metadata.uid
        # A pod whose labels stop matching arrives as MODIFIED where the API filters on fewer
        # labels than a role needs (PD), and as DELETED where it filters on all of them.
        if kind == "DELETED" or not role_of(pod, self.rules):
            self.pods.pop(uid, None)
        else:
            self.pods[uid] = pod
        self._changed.set()

    # --- the registry side ----------------------------------------------------------------
    async def _apply_changes(self) -> None:
        while True:
            await self._changed.wait()
            self._changed.clear()
            self.reconcile()

    def wanted(self) -> dict[str, WorkerSpec]:
        specs = (spec_for(pod, self.rules) for pod in self.pods.values())
        return {spec.url: spec for spec in specs if spec is not None}

    def reconcile(self) -> None:
        """Remove the workers no pod asks for any more; start adding those newly asked for."""
        wanted = self.wanted()
        for url, spec in list(self.owned.items()):
            if wanted.get(url) != spec:
                self._remove(url)
        for url, spec in wanted.items():
            if url in self.owned or url in self._adding:
                continue
            if url in self.registry.workers:  # registered by a flag or /add_worker
                continue
            task = asyncio.get_running_loop().create_task(self._add(spec))
            self._adding[url] = task
        self.metrics.discovery_workers.set(len(self.owned))

    def _remove(self, url: str) -> None:
        del self.owned[url]
        log.info("discovery: removing %s (its pod stopped serving, went away or changed)", url)
        try:
            self.registry.remove(url)
            audit.membership("discovery", "remove_worker", url, "removed")
        except KeyError:  # removed through /remove_worker already
            pass

    async def _add(self, spec: WorkerSpec) -> None:
        """Adding probes the worker (up to the health-check timeout), so it runs beside the
        watch; once done, the pods are looked at again in case they changed meanwhile."""
        try:
            await self.registry.add(spec)
        except ValueError:  # registered by someone else while this one was starting
            return
        except WorkerRefused as exc:  # logged and counted by the gate; tried again when the pods change
            audit.membership("discovery", "add_worker", spec.url, f"refused:{exc.reason}")
            return
        except Exception:
            log.exception("discovery: adding %s failed", spec.url)
            return
        finally:
            self._adding.pop(spec.url, None)
        self.owned[spec.url] = spec
        audit.membership("discovery", "add_worker", spec.url, "added")
        self._changed.set()


def _describe(exc: BaseException) -> str:
    code = status_code(exc)
    if isinstance(exc, ApiException):
        return f"HTTP {code} {exc.reason or ''}".strip()
    text = str(exc)
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__
