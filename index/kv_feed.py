"""Feed a ``BlockIndex`` from each worker's SGLang KV-event ZMQ publisher.

One asyncio task per publisher (per DP rank) SUBscribes to ``[topic, seq, payload]``
frames. The index is only as good as the event stream, so every way of losing events is
handled explicitly:

* a sequence gap asks the publisher's ROUTER replay socket for the missing batches
  (``[b"", start_seq]`` -> ``[b"", seq, payload]``... terminated by seq -1);
* a gap the replay buffer no longer covers, a sequence that goes backwards (the engine
  restarted) or a dropped TCP connection clears the worker: under-predicting hits costs a
  little, routing on blocks that are gone costs a full re-prefill;
* the first message after connecting replays from seq 0, so whatever the publisher still
  buffers from before we joined is not lost.

With ``dp_size`` > 1 the engine opens one publisher per DP rank (consecutive ports); all
ranks feed the one worker entry the gateway routes to, so a clear on any rank clears the
worker (conservative: it under-predicts until the ranks re-report).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from index.views import WorkerView
from index.block_index import BlockIndex
from wire.kv_events import decode_in_parts, pack_seq, unpack_seq

log = logging.getLogger("kvgate.policies.kv_events")
Pace = Callable[[], Awaitable[None]]  # yields a turn of the loop once the events' slice is spent


@dataclass(frozen=True, slots=True)
class Publisher:
    url: str  # the worker the events belong to
    endpoint: str
    replay: str | None = None
    topic: str = ""


def _localize(endpoint: str, host: str) -> str:
    return endpoint.replace("*", host).replace("0.0.0.0", host)


def _with_port_offset(endpoint: str, offset: int) -> str:
    if not offset:
        return endpoint
    return re.sub(r":(\d+)$", lambda m: f":{int(m.group(1)) + offset}", endpoint)


def publishers_for(worker: WorkerView, override: Mapping[str, object] | None = None) -> list[Publisher]:
    """Where ``worker`` publishes: a policy-option override, else ``server_info["kv_events"]``.
    SGLang opens one publisher per DP rank at consecutive ports."""
    cfg = (override or {}).get(worker.url) or worker.server_info.get("kv_events")
    if not cfg:
        return []
    if isinstance(cfg, str):
        cfg = {"endpoint": cfg}
    if not isinstance(cfg, Mapping) or not cfg.get("endpoint"):
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
        # Event work the subscribers together may do in one turn of the event loop: past it the
        # turn's other subscribers wait for the next, and a big message goes on there a part at
        # a time, so the requests on the same loop wait for no more than the slice plus one
        # part (~256 events) however far behind the feed is and however many publishers.
        self.slice_s = max(float(slice_ms), 0.0) / 1e3
        self._spent = 0.0  # of the slice, in this turn of the loop
        self._slice_open = False
        self.override = dict(override or {})
        self.replay_timeout_s = float(replay_timeout_s)
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: dict[Publisher, asyncio.Task] = {}
        self._workers: dict[str, WorkerView] = {}
        self._followed: list[str] = []  # the urls of the last worker list follow() checked
        self._waiting: set[str] = set()  # known workers whose server_info named no publisher yet
        self._warned: set[str] = set()
        self._recheck_at = 0.0
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
        if "page_size" in worker.server_info:
            self.index.set_page_size(worker.url, int(worker.server_info["page_size"]))
        if self.running:
            for pub in pubs:
                if pub not in self._tasks:
                    self._tasks[pub] = asyncio.get_running_loop().create_task(self._run(pub))

    def follow(self, workers: Sequence[WorkerView]) -> None:
        """Add workers the gateway routes to but never announced; re-check, at most once a
        second, those whose server_info named no publisher (discovery can lag registration)."""
        # Usually the urls seen last time (views are replaced as in-flight counts move; urls
        # compare by identity first, in C).
        urls = [w.url for w in workers]
        if urls != self._followed:
            known = self._workers
            for w in workers:
                if w.url not in known:
                    self.add(w)
            self._followed = urls
        if self._waiting and time.monotonic() >= self._recheck_at:
            # A waiting worker's server_info comes in a later view than the one it was added
            # with: re-check the one this decision was given.
            for w in workers:
                if w.url in self._waiting:
                    self._workers[w.url] = w
            self._recheck_at = time.monotonic() + 1.0
            for url in list(self._waiting):
                self._activate(self._workers[url])

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

    # -- one publisher ------------------------------------------------------------------
    async def _apply(self, url: str, payload: bytes, pace: Pace) -> None:
        """Apply one batch, a part at a time with ``pace()`` between parts (a scheduler step
        at page size 1 stores thousands of pages: milliseconds to decode and apply)."""
        parts = decode_in_parts(payload)  # with token ids: the index keys blocks by them
        first = True
        while True:
            try:
                events = next(parts, None)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
                self.counters["decode_errors"] += 1
                log.warning("undecodable KV event batch from %s: %s", url, e)
                return
            if events is None:
                return
            if not first:
                await pace()
            first = False
            self.index.apply_batch(url, events)

    async def _run(self, pub: Publisher) -> None:
        """Keep one subscription alive: an unexpected error drops what the worker's state was
        built from, so it is cleared and the subscription starts over (with a replay)."""
        while True:
            try:
                await self._subscribe(pub)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("KV event subscriber for %s failed; clearing %s and resubscribing",
                              pub.endpoint, pub.url)
                self.index.clear_worker(pub.url)
                await asyncio.sleep(1.0)

    async def _subscribe(self, pub: Publisher) -> None:
        """Receive from one publisher until cancelled or disconnected. The SUB socket is read
        through the blocking API from a reader on its file descriptor, draining what has
        arrived at each wakeup: pyzmq's asyncio poller cost ~100 us of the loop per message
        (a future per socket per poll, another per receive), so 64 workers' events took
        three quarters of a core (bench/kv_feed_rate.py). ZMQ's descriptor is edge-triggered: it signals when the
        socket's state changes, so a wakeup drains until the socket says it is empty (or the
        loop's slice for events is spent, and then it goes on after one turn of the loop)."""
        assert self._ctx is not None
        loop = asyncio.get_running_loop()
        # (a socket of the same context through the blocking API: the context does not track
        # it, so it is closed here on every path, or stop()'s destroy would wait for it forever)
        sub = zmq.Context.shadow(self._ctx.underlying).socket(zmq.SUB)
        raw_monitor = fd = watcher = None
        readable = asyncio.Event()
        disconnected = 0

        async def watch(monitor: zmq.asyncio.Socket) -> None:
            nonlocal disconnected
            try:
                while True:
                    await recv_monitor_message(monitor)
                    disconnected += 1
                    readable.set()
            finally:
                monitor.close(0)

        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, pub.topic.encode())
            raw_monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            watcher = loop.create_task(watch(zmq.asyncio.Socket.from_socket(raw_monitor)))
            sub.connect(pub.endpoint)
            fd = sub.getsockopt(zmq.FD)
            loop.add_reader(fd, readable.set)
            readable.set()  # (anything already queued would not signal the descriptor)
            clock = time.perf_counter
            t0 = 0.0

            def start() -> None:
                nonlocal t0
                if not self._slice_open:  # the first subscriber in this turn of the loop
                    self._slice_open = True
                    loop.call_soon(self._next_slice)
                t0 = clock()

            def spent() -> bool:
                return self._spent + clock() - t0 >= self.slice_s

            async def pace() -> None:
                """Between parts of one big message: the next turn of the loop once the slice
                is spent."""
                if spent():
                    self._spent += clock() - t0
                    await asyncio.sleep(0)
                    start()

            expected: int | None = None
            while True:
                await readable.wait()
                readable.clear()
                if disconnected:
                    disconnected = 0
                    self.counters["disconnects"] += 1
                    log.info("KV event publisher %s disconnected: clearing %s", pub.endpoint, pub.url)
                    self.index.clear_worker(pub.url)
                    expected = None
                start()
                if self._spent and spent():  # others spent this turn's slice: next turn
                    readable.set()
                    await asyncio.sleep(0)
                    continue
                while True:
                    try:
                        frames = sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if len(frames) >= 2:
                        expected = await self._receive(pub, unpack_seq(frames[-2]), frames[-1], expected, pace)
                    if spent():  # more may be waiting:
                        readable.set()
                        break
                self._spent += clock() - t0
                if readable.is_set():  # go on after one turn of the loop (wait() would not yield)
                    await asyncio.sleep(0)
        finally:
            if fd is not None:
                loop.remove_reader(fd)
            if raw_monitor is not None:
                # Before the monitor's reading end closes: libzmq's I/O thread sends each event
                # with a blocking send while holding a lock that disable_monitor (and close)
                # take, so a disconnect reported after the reader is gone hung stop() for good.
                sub.disable_monitor()
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await watcher
            if raw_monitor is not None:
                raw_monitor.close(0)
            sub.close(0)

    def _next_slice(self) -> None:
        self._spent, self._slice_open = 0.0, False

    async def _receive(self, pub: Publisher, seq: int, payload: bytes, expected: int | None, pace: Pace) -> int:
        """Apply one message after whatever a gap in the sequence calls for; the next expected."""
        self.counters["messages"] += 1
        if expected is None:
            if seq > 0:  # joined late: take what the publisher still buffers
                await self._replay(pub, 0, seq, pace, strict=False)
        elif seq > expected:
            self.counters["gaps"] += 1
            if not await self._replay(pub, expected, seq, pace, strict=True):
                self.counters["unrecoverable"] += 1
                log.warning("KV events %d..%d from %s lost for good: clearing %s",
                            expected, seq - 1, pub.endpoint, pub.url)
                self.index.clear_worker(pub.url)
        elif seq < expected:
            self.counters["restarts"] += 1
            log.info("KV event sequence of %s restarted (%d after %d): clearing %s",
                     pub.endpoint, seq, expected - 1, pub.url)
            self.index.clear_worker(pub.url)
            if seq > 0:
                await self._replay(pub, 0, seq, pace, strict=False)
        await self._apply(pub.url, payload, pace)
        return seq + 1

    async def _replay(self, pub: Publisher, start: int, stop: int, pace: Pace, *, strict: bool) -> bool:
        """Apply batches ``start..stop-1`` from the replay socket. With ``strict``, any hole
        (the buffer no longer reaches back to ``start``) applies nothing and fails."""
        if not pub.replay or self._ctx is None:
            return False
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(pub.replay)
        got: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + self.replay_timeout_s
        try:
            await sock.send_multipart([b"", pack_seq(start)])
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await sock.poll(int(left * 1000) + 1):
                    log.warning("KV event replay from %s timed out", pub.replay)
                    return False
                frames = await sock.recv_multipart()
                if len(frames) < 2:
                    continue
                seq = unpack_seq(frames[-2])
                if seq == -1:
                    break
                if start <= seq < stop:
                    got.append((seq, frames[-1]))
        finally:
            sock.close(0)
        got.sort()
        complete = [s for s, _ in got] == list(range(start, stop))
        if strict and not complete:
            return False
        for _, payload in got:
            await self._apply(pub.url, payload, pace)
        self.counters["replayed"] += len(got)
        return complete

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
