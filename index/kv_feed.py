"""Feed a ``BlockIndex`` from each worker's SGLang KV-event ZMQ publishers.

``KvEventFeed`` follows the fleet: it finds each worker's publishers (``server_info``'s
``kv_events``, or the ``kv_endpoints`` option) and runs one ``index.kv_subscriber.Subscriber``
task per publisher (per DP rank). Every way of losing events is handled there, and a lost
stream clears its worker: under-predicting hits costs a little, routing on blocks that are
gone costs a full re-prefill.

With ``dp_size`` > 1 the engine opens one publisher per DP rank (consecutive ports); all
ranks feed the one worker entry the gateway routes to, so a clear on any rank clears the
worker (conservative: it under-predicts until the ranks re-report).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Mapping, Sequence

import msgspec
import zmq.asyncio

from index.block_index import BlockIndex
from index.kv_subscriber import Publisher, Slice, Subscriber
from index.views import WorkerView

log = logging.getLogger("kvgate.policies.kv_events")


def _localize(endpoint: str, host: str) -> str:
    return endpoint.replace("*", host).replace("0.0.0.0", host)


def _with_port_offset(endpoint: str, offset: int) -> str:
    if not offset:
        return endpoint
    return re.sub(r":(\d+)$", lambda m: f":{int(m.group(1)) + offset}", endpoint)


def _from_descriptor(cfg: Mapping[str, object]) -> Mapping[str, object]:
    """SGLang's ``server_info["kv_events"]`` descriptor (``endpoint_host``, ``endpoint_port_base``,
    ``replay_endpoint_port_base``: rank r at base + r) as the endpoint form ``kv_endpoints`` takes."""
    if cfg.get("endpoint") or not cfg.get("endpoint_port_base"):
        return cfg
    host = str(cfg.get("endpoint_host") or "*")
    host = f"[{host}]" if ":" in host else host
    out = dict(cfg, endpoint=f"tcp://{host}:{int(cfg['endpoint_port_base'])}")  # type: ignore[call-overload]
    if cfg.get("replay_endpoint_port_base"):
        out["replay_endpoint"] = f"tcp://{host}:{int(cfg['replay_endpoint_port_base'])}"  # type: ignore[call-overload]
    return out


def publishers_for(worker: WorkerView, override: Mapping[str, object] | None = None) -> list[Publisher]:
    """Where ``worker`` publishes: a policy-option override, else ``server_info["kv_events"]``
    (SGLang's descriptor, or an endpoint mapping). SGLang opens one publisher per DP rank at
    consecutive ports."""
    cfg = (override or {}).get(worker.url) or worker.server_info.get("kv_events")
    if not cfg:
        return []
    if isinstance(cfg, str):
        cfg = {"endpoint": cfg}
    if not isinstance(cfg, Mapping):
        return []
    cfg = _from_descriptor(cfg)
    if not cfg.get("endpoint"):
        return []
    host = worker.host
    endpoint = _localize(str(cfg["endpoint"]), host)
    replay = cfg.get("replay_endpoint")
    replay = _localize(str(replay), host) if replay else None
    topic = str(cfg.get("topic") or "")
    ranks = int(worker.server_info.get("dp_size") or 1) if "dp_size" not in cfg else int(cfg["dp_size"])
    return [
        Publisher(worker.url, _with_port_offset(endpoint, r),
                  _with_port_offset(replay, r) if replay else None, topic)
        for r in range(max(ranks, 1))
    ]


class KvEventFeed:
    """Runs the subscribers; ``add``/``remove`` follow the fleet, ``start``/``stop`` the loop."""

    def __init__(self, index: BlockIndex, override: Mapping[str, object] | None = None,
                 replay_timeout_s: float = 2.0, quiet: bool = False, slice_ms: float = 0.5) -> None:
        self.index = index
        self.slice = Slice(slice_ms)
        self.override = dict(override or {})
        self.replay_timeout_s = float(replay_timeout_s)
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: dict[Publisher, asyncio.Task] = {}
        self._workers: dict[str, WorkerView] = {}
        self._waiting: set[str] = set()  # known workers whose server_info named no publisher yet
        self._warned: set[str] = set()
        self._missing_level = logging.INFO if quiet else logging.WARNING  # quiet: events are optional
        self.counters = dict.fromkeys(
            ("messages", "gaps", "replayed", "unrecoverable", "restarts", "disconnects", "decode_errors"), 0)

    @property
    def running(self) -> bool:
        return self._ctx is not None

    def add(self, worker: WorkerView) -> None:
        if worker.url in self._workers:
            return
        self._workers[worker.url] = worker
        self._waiting.add(worker.url)
        self._activate(worker)

    def _activate(self, worker: WorkerView) -> None:
        """Subscribe once the worker's server_info (or the override) names its publishers."""
        pubs = publishers_for(worker, self.override)
        if not pubs:
            if worker.url not in self._warned:
                self._warned.add(worker.url)
                log.log(self._missing_level, "worker %s names no KV event publisher (no "
                        "server_info.kv_events, no kv_endpoints option): the precise index cannot "
                        "match it until it does", worker.url)
            return
        self._waiting.discard(worker.url)
        described = worker.server_info.get("kv_events")
        if isinstance(described, Mapping) and described.get("block_size"):  # what the events hash at
            self.index.set_page_size(worker.url, int(described["block_size"]))  # type: ignore[call-overload]
        elif "page_size" in worker.server_info:
            self.index.set_page_size(worker.url, int(worker.server_info["page_size"]))
        if self.running:
            for pub in pubs:
                if pub not in self._tasks:
                    subscriber = Subscriber(self.index, self._ctx, self.slice, self.counters, self.replay_timeout_s)
                    self._tasks[pub] = asyncio.get_running_loop().create_task(subscriber.run(pub))

    def update(self, worker: WorkerView) -> None:
        """A newer view of a worker: subscribe now if its server_info has come to name a
        publisher (a worker registered before it was up is read again once healthy)."""
        if worker.url not in self._workers:
            self.add(worker)
            return
        self._workers[worker.url] = worker
        if worker.url in self._waiting:
            self._activate(worker)

    def feeds_any(self, workers: Sequence[WorkerView]) -> bool:
        """Whether events can describe at least one of ``workers`` (O(1) when all are fed)."""
        if not self._waiting:
            return bool(self._workers)
        return any(w.url in self._workers and w.url not in self._waiting for w in workers)

    def remove(self, url: str) -> None:
        self._workers.pop(url, None)
        self._waiting.discard(url)
        for pub in [p for p in self._tasks if p.url == url]:
            self._tasks.pop(pub).cancel()
        self.index.remove_worker(url)

    async def start(self) -> None:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
            for worker in self._workers.values():
                self._activate(worker)

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    def stats(self) -> Mapping[str, float]:
        out = {f"kv_{k}": float(v) for k, v in self.counters.items()}
        out["kv_subscribers"] = float(len(self._tasks))
        return out


def parse_endpoints(option: object) -> dict[str, object]:
    """The ``kv_endpoints`` policy option: a mapping (YAML) or a JSON object (CLI), worker
    URL -> endpoint string or ``{"endpoint", "replay_endpoint", "topic"}``."""
    if not option:
        return {}
    if isinstance(option, (str, bytes)):
        option = msgspec.json.decode(option)
    if not isinstance(option, Mapping):
        raise ValueError("kv_endpoints must map worker URLs to endpoints")
    return dict(option)
