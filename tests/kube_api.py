"""A loopback stand-in for the Kubernetes API server's pod list and watch, for discovery tests.

No real ``kube-apiserver`` can run here (no PyPI, npm or Debian package ships one, and
container images cannot be pulled), so this aiohttp server on 127.0.0.1 speaks the parts
of the API that ``gateway.discovery`` uses, in the API's own wire format:

- ``GET /api/v1/namespaces/{ns}/pods`` and ``/api/v1/pods``: a ``PodList`` (items without
  ``kind``/``apiVersion``, as the API sends them) with the list's ``resourceVersion``;
  ``labelSelector`` equality terms filter it.
- the same with ``watch=true``: chunked JSON lines ``{"type", "object"}`` from the given
  ``resourceVersion`` on (history first, then live); ``BOOKMARK`` events when
  ``allowWatchBookmarks=true``; a ``resourceVersion`` older than the compacted one gets an
  ``ERROR`` event carrying a 410 ``Status`` ("too old resource version") and the end of
  the stream, which is what the API server does.
- a bearer token is required (401 ``Status`` without it); ``down`` answers 503 ``Status``.

Pods are built from ``tests/data/k8s/pod.json``, a pod as the API returns it (a worker of a
Deployment: managed fields, projected token volume, conditions, container statuses). That
file and the ``Status`` and bookmark shapes below are hand-assembled in the API's format
(v1.30-era servers), not captured from a live cluster.

The server runs on its own thread and event loop; every method here is called from the test's
thread and waits (bounded) until the server has applied it.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import uuid
from pathlib import Path
from typing import Any

from aiohttp import web

POD_JSON = Path(__file__).parent / "data" / "k8s" / "pod.json"
NAMESPACE = "kvgate-test"
TOKEN = "kvgate-test-token"
_END = object()


def make_pod(name: str, port: int, *, ready: bool = True, labels: dict[str, str] | None = None,
             annotations: dict[str, str] | None = None, ip: str | None = "127.0.0.1") -> dict[str, Any]:
    """A running pod named ``name`` whose container port ``http`` is ``port`` at ``ip`` (always a
    loopback address in tests; None: not scheduled yet, so Pending without an IP)."""
    pod = json.loads(POD_JSON.read_text())
    meta = pod["metadata"]
    meta.update(name=name, namespace=NAMESPACE, uid=str(uuid.uuid4()), labels=labels or {"app": "sglang-sim"})
    if annotations:
        meta["annotations"] = annotations
    pod["spec"]["containers"][0]["ports"][0]["containerPort"] = port
    status = pod["status"]
    if ip is None:
        pod["status"] = {"phase": "Pending", "conditions": [status["conditions"][-1]], "qosClass": "BestEffort"}
        return pod
    status["podIP"], status["podIPs"] = ip, [{"ip": ip}]
    set_ready(pod, ready)
    return pod


def set_ready(pod: dict[str, Any], ready: bool) -> dict[str, Any]:
    """The pod as the kubelet reports it after its readiness probe passed (or failed)."""
    for cond in pod["status"]["conditions"]:
        if cond["type"] in ("Ready", "ContainersReady"):
            cond["status"] = "True" if ready else "False"
            if ready:
                cond.pop("reason", None), cond.pop("message", None)
            else:
                cond["reason"] = "ContainersNotReady"
                cond["message"] = "containers with unready status: [sglang]"
    for cs in pod["status"].get("containerStatuses", []):
        cs["ready"] = ready
    return pod


def status_body(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


def _flag(value: str | None) -> bool:
    """A boolean query parameter as the API server reads it (Go's strconv.ParseBool)."""
    return value in ("1", "t", "T", "TRUE", "true", "True")


def _matches(pod: dict[str, Any], selector: str) -> bool:
    labels = pod["metadata"].get("labels") or {}
    terms = [t.split("=", 1) for t in selector.split(",") if t]
    return all(labels.get(k) == v for k, v in terms)


class _Watch:
    def __init__(self, request: web.Request, selector: str, bookmarks: bool) -> None:
        self.request, self.selector, self.bookmarks = request, selector, bookmarks
        self.queue: asyncio.Queue = asyncio.Queue()


class KubeAPI:
    def __init__(self) -> None:
        self.rv = 1000
        self.compacted = 0  # watches from an older resourceVersion get 410
        self.pods: dict[str, dict[str, Any]] = {}  # by name, with kind/apiVersion
        self.history: list[tuple[int, str, dict[str, Any]]] = []
        self.watches: list[_Watch] = []
        self.requests: list[dict[str, str]] = []  # query of every pods call, in order
        self.paused = False  # changes are kept in history but not sent to open watches
        self.down = False
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kube-api", daemon=True)
        self._runner: web.AppRunner | None = None

    # --- lifecycle, from the test's thread ------------------------------------------------------
    def start(self) -> KubeAPI:
        self._thread.start()
        self._call(self._start())
        return self

    def stop(self) -> None:
        self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(json.dumps({  # JSON is YAML
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": TOKEN}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "tester", "namespace": NAMESPACE}}],
        }))
        return path

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._pods)
        app.router.add_get("/api/v1/pods", self._pods)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def _stop(self) -> None:
        self._drop()
        await self._runner.cleanup()

    # --- what a cluster does, from the test's thread ------------------------------------------
    def put(self, pod: dict[str, Any]) -> int:
        """Create or update ``pod``; returns its new resourceVersion."""
        return self._call(self._change("MODIFIED" if pod["metadata"]["name"] in self.pods else "ADDED", pod))

    def delete(self, name: str) -> int:
        return self._call(self._change("DELETED", self.pods[name]))

    def terminate(self, name: str) -> int:
        """A graceful delete begins: the pod stays, with ``deletionTimestamp`` set."""
        pod = copy.deepcopy(self.pods[name])
        pod["metadata"].update(deletionTimestamp="2025-03-11T10:02:13Z", deletionGracePeriodSeconds=30)
        return self.put(pod)

    def bookmark(self) -> int:
        """What the API server sends now and then to watches that allow bookmarks."""
        return self._call(self._bookmark())

    def expire(self) -> None:
        """Compact all history: open watches get a 410 ERROR event and end, as do later ones from before."""
        self._call(self._expire())

    def drop_watches(self) -> None:
        """Cut every open watch connection (an API server restart, a load balancer's idle cut)."""
        self._call(self._async(self._drop))

    def set_down(self, down: bool) -> None:
        """While down, every call gets 503 and open watches are cut."""
        self.down = down
        if down:
            self.drop_watches()

    def calls(self, kind: str) -> list[dict[str, str]]:
        """The queries of the list (``kind="list"``) or watch calls so far."""
        return [q for q in list(self.requests) if _flag(q.get("watch")) == (kind == "watch")]

    # --- on the server's loop ---------------------------------------------------------------
    async def _async(self, fn: Any) -> Any:
        return fn()

    async def _change(self, kind: str, pod: dict[str, Any]) -> int:
        self.rv += 1
        pod = copy.deepcopy(pod)
        pod["metadata"]["resourceVersion"] = str(self.rv)
        if kind == "DELETED":
            self.pods.pop(pod["metadata"]["name"], None)
        else:
            self.pods[pod["metadata"]["name"]] = pod
        self.history.append((self.rv, kind, pod))
        if not self.paused:
            for w in self.watches:
                if _matches(pod, w.selector):
                    w.queue.put_nowait({"type": kind, "object": pod})
        return self.rv

    async def _bookmark(self) -> int:
        mark = {"kind": "Pod", "apiVersion": "v1",  # an empty Pod, as the server encodes one
                "metadata": {"resourceVersion": str(self.rv), "creationTimestamp": None},
                "spec": {"containers": None}, "status": {}}
        for w in self.watches:
            if w.bookmarks:
                w.queue.put_nowait({"type": "BOOKMARK", "object": mark})
        return self.rv

    async def _expire(self) -> None:
        self.compacted = self.rv + 1
        self.history.clear()
        for w in self.watches:
            w.queue.put_nowait(self._gone(w.request.query.get("resourceVersion", "")))
            w.queue.put_nowait(_END)

    def _gone(self, rv: str) -> dict[str, Any]:
        message = f"too old resource version: {rv} ({self.compacted})"
        return {"type": "ERROR", "object": status_body(410, "Expired", message)}

    def _drop(self) -> None:
        for w in self.watches:
            if w.request.transport is not None:
                w.request.transport.abort()
            w.queue.put_nowait(_END)

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(dict(request.query))
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response(status_body(401, "Unauthorized", "Unauthorized"), status=401)
        if self.down:
            return web.json_response(status_body(503, "ServiceUnavailable", "the server is currently unable to "
                                                 "handle the request"), status=503)
        namespace = request.match_info.get("namespace")
        selector = request.query.get("labelSelector", "")
        pods = [p for p in self.pods.values() if namespace in (None, p["metadata"]["namespace"])
                and _matches(p, selector)]
        if _flag(request.query.get("watch")):
            return await self._watch(request, selector)
        items = [{k: v for k, v in p.items() if k not in ("kind", "apiVersion")} for p in pods]
        return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                  "metadata": {"resourceVersion": str(self.rv)}, "items": items})

    async def _watch(self, request: web.Request, selector: str) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        since = int(request.query.get("resourceVersion") or self.rv)
        if since < self.compacted:
            await resp.write(json.dumps(self._gone(str(since))).encode() + b"\n")
            return resp
        w = _Watch(request, selector, _flag(request.query.get("allowWatchBookmarks")))
        self.watches.append(w)
        # Registered before the history is read, with no await between: nothing falls in the gap.
        backlog = [{"type": k, "object": p} for rv, k, p in self.history if rv > since and _matches(p, selector)]
        try:
            async with asyncio.timeout(float(request.query.get("timeoutSeconds") or 1800)):  # then a clean end
                for event in backlog:
                    await resp.write(json.dumps(event).encode() + b"\n")
                while (event := await w.queue.get()) is not _END:
                    await resp.write(json.dumps(event).encode() + b"\n")
        except (ConnectionError, TimeoutError):  # cut by drop_watches or the client; or timeoutSeconds passed
            pass
        finally:
            self.watches.remove(w)
        return resp
