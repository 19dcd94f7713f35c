"""The group's message bus: one NATS subject that every gateway process publishes its
records to and hears every other process's records on (core NATS pub/sub, ``no_echo``).

Publishing never blocks a request and never raises into one. ``publish`` appends an
encoded record to the current batch; one sender task sends what accumulated in the
``linger_s`` after the first record as one message (a msgpack array built by prefixing the
records with an array header), split at the server's payload limit. Each message costs a
few tens of microseconds in nats-py whatever its size, so a gateway that sends a message
per turn of its event loop spends more on the bus than on routing; 2 ms of linger makes
batches of dozens of records under load and adds 2 ms to a lag that is a heartbeat-scale
matter for routing. While the connection is down, nats-py keeps
published messages in its pending buffer (``pending_bytes``) and sends them on reconnect;
past it, or before the first connection, records are dropped and counted. Connecting is
retried in the background for as long as the process runs, and nats-py reconnects an
established connection by itself (``max_reconnect_attempts=-1``), subscriptions included.
``on_state(True)`` follows every (re)connection and ``on_state(False)`` every loss, so
the owner can say so and resynchronise. Across hosts the bus is a ``tls://`` URL (``tls``:
the context of ``--state-tls-*``, else the system CAs); a token or user:password in the URL
is NATS's own authentication, and is kept out of the logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import struct
from collections.abc import Callable
from urllib.parse import urlsplit

import nats
from nats.aio.client import Client
from nats.errors import Error as NatsError

log = logging.getLogger("kvgate.bus")


def batch_header(n: int) -> bytes:
    """The msgpack array header for ``n`` elements."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + struct.pack(">H", n)
    return b"\xdd" + struct.pack(">I", n)


def redacted(url: str) -> str:
    """``url`` (servers separated by commas) without the user, password or token in it."""
    return ",".join(urlsplit(u)._replace(netloc=urlsplit(u).netloc.rpartition("@")[2]).geturl()
                    for u in url.split(","))


class Bus:
    def __init__(self, url: str, subject: str, on_batch: Callable[[bytes], None],
                 on_state: Callable[[bool], None], name: str, pending_bytes: int = 32 << 20,
                 linger_s: float = 0.002, tls: ssl.SSLContext | None = None) -> None:
        self.url, self.subject, self.name = url, subject, name
        self.shown = redacted(url)  # for logs: no password or token
        self.tls = tls
        self.on_batch, self.on_state = on_batch, on_state
        self.pending_bytes = pending_bytes
        self.linger_s = linger_s
        self.connected = False
        self.published = 0  # records handed to the connection
        self.dropped = 0  # records that could not be (no connection yet, or its buffer full)
        self._nc: Client | None = None
        self._batch: list[bytes] = []
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._said: set[str] = set()  # the errors warned of since the last connection

    @property
    def nc(self) -> Client | None:
        """The connection (claims publish through it)."""
        return self._nc

    def publish(self, record: bytes) -> None:
        self._batch.append(record)
        self._wake.set()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._connect()), loop.create_task(self._send())]

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._nc.flush(timeout=1), 2)
            with contextlib.suppress(Exception):
                await self._nc.close()

    # -- connection --------------------------------------------------------------------
    async def _connect(self) -> None:
        delay, warned = 0.2, False
        while not self._stopping:
            try:
                nc = await nats.connect(
                    self.url, name=self.name, no_echo=True, allow_reconnect=True, max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5, connect_timeout=2, ping_interval=5, max_outstanding_pings=2,
                    pending_size=self.pending_bytes, error_cb=self._error, disconnected_cb=self._lost,
                    reconnected_cb=self._regained, **({"tls": self.tls} if self.tls is not None else {}))
            except (NatsError, OSError, asyncio.TimeoutError) as exc:
                if not warned:
                    log.warning("state bus %s unreachable (%s): routing on this process's state, retrying",
                                self.shown, exc or type(exc).__name__)
                    warned = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            self._nc = nc
            await nc.subscribe(self.subject, cb=self._received)
            log.info("state bus connected: %s subject %s", self.shown, self.subject)
            self._set(True)
            return

    def _set(self, connected: bool) -> None:
        if connected != self.connected:
            self.connected = connected
            self._said.clear()
            try:
                self.on_state(connected)
            except Exception:
                log.exception("state bus listener failed")

    async def _error(self, exc: Exception) -> None:
        """nats-py's errors, including those of an initial connection it keeps retrying (a TLS
        handshake or authorization the server refuses): each kind said once while not connected."""
        kind = f"{type(exc).__name__}: {exc}"
        if self.connected or kind in self._said or len(self._said) >= 8:
            log.debug("state bus: %s", kind)
            return
        self._said.add(kind)
        log.warning("state bus %s unreachable (%s): routing on this process's state, retrying", self.shown, kind)

    async def _lost(self) -> None:
        if not self._stopping:
            log.warning("state bus %s lost: routing on this process's state until it is back", self.shown)
        self._set(False)

    async def _regained(self) -> None:
        log.info("state bus %s back: resynchronising", self.shown)
        self._set(True)

    async def _received(self, msg) -> None:
        try:
            self.on_batch(msg.data)
        except Exception:  # a bad record must not stop the subscription
            log.exception("state bus: could not apply a batch of %d bytes", len(msg.data))

    # -- sending -----------------------------------------------------------------------
    async def _send(self) -> None:
        while True:
            await self._wake.wait()
            if self.linger_s:
                await asyncio.sleep(self.linger_s)
            self._wake.clear()
            batch, self._batch = self._batch, []
            nc = self._nc
            if nc is None:
                self.dropped += len(batch)
                continue
            limit = max(nc.max_payload - 16, 1024)
            start, size = 0, 0
            for i, record in enumerate(batch):
                if size and size + len(record) > limit:
                    await self._put(nc, batch[start:i])
                    start, size = i, 0
                size += len(record)
            await self._put(nc, batch[start:])

    async def _put(self, nc: Client, records: list[bytes]) -> None:
        try:
            await nc.publish(self.subject, batch_header(len(records)) + b"".join(records))
            self.published += len(records)
        except (NatsError, OSError) as exc:
            self.dropped += len(records)
            log.debug("state bus: %d records dropped (%r)", len(records), exc)
