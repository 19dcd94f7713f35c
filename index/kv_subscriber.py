"""One KV-event subscription: a ZMQ SUB on one publisher, applied to the index in slices.

``Subscriber.run`` keeps the subscription alive; ``_receive`` turns the sequence numbers into
what the index needs: a gap asks the publisher's ROUTER replay socket for the missing
batches (``[b"", start_seq]`` -> ``[b"", seq, payload]``... terminated by seq -1), a gap the
buffer no longer covers, a sequence that goes backwards (the engine restarted) or a dropped
connection clears the worker, and the first message after joining replays from seq 0.
``Slice`` is the event work all subscribers together may do in one turn of the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

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


class Slice:
    """Event work the subscribers together may do in one turn of the event loop: past it the
    turn's other subscribers wait for the next, and a big message goes on there a part at a
    time, so the requests on the same loop wait for no more than the slice plus one part
    (~256 events) however far behind the feed is and however many publishers."""

    def __init__(self, slice_ms: float) -> None:
        self.slice_s = max(float(slice_ms), 0.0) / 1e3
        self.spent = 0.0  # of the slice, in this turn of the loop
        self._open = False

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        """A subscriber starts work in this turn; the first one schedules the slice's reset."""
        if not self._open:
            self._open = True
            loop.call_soon(self._next)

    def _next(self) -> None:
        self.spent, self._open = 0.0, False


class Subscriber:
    """Receives one publisher's events into ``index`` until cancelled (``run``)."""

    def __init__(self, index: BlockIndex, ctx: zmq.asyncio.Context, budget: Slice, counters: dict[str, int],
                 replay_timeout_s: float) -> None:
        self.index = index
        self._ctx = ctx
        self.budget = budget
        self.counters = counters
        self.replay_timeout_s = replay_timeout_s

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

    async def run(self, pub: Publisher) -> None:
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
        three quarters of a core (bench/micro/kv_feed_rate.py). ZMQ's descriptor is edge-triggered: it signals when the
        socket's state changes, so a wakeup drains until the socket says it is empty (or the
        loop's slice for events is spent, and then it goes on after one turn of the loop)."""
        loop = asyncio.get_running_loop()
        budget = self.budget
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
                budget.open(loop)
                t0 = clock()

            def spent() -> bool:
                return budget.spent + clock() - t0 >= budget.slice_s

            async def pace() -> None:
                """Between parts of one big message: the next turn of the loop once the slice
                is spent."""
                if spent():
                    budget.spent += clock() - t0
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
                if budget.spent and spent():  # others spent this turn's slice: next turn
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
                budget.spent += clock() - t0
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
        if not pub.replay:
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
