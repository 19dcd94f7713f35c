"""Admission control: at most N requests upstream, a bounded FIFO queue in front.

A full queue answers 429 at once (the client should back off); a request that waited
longer than the queue timeout answers 408. Slots are handed directly to the next waiter
on release, so a burst cannot overtake requests already queued.
"""

from __future__ import annotations

import asyncio
import collections

from typing import Any

from gateway.errors import GatewayError


class Admission:
    def __init__(self, max_concurrent: int, queue_size: int, queue_timeout: float) -> None:
        self.max_concurrent = max_concurrent
        self.queue_size = queue_size
        self.queue_timeout = queue_timeout
        self.active = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def _acquire(self, ticket: Any = None) -> None:
        """``ticket``: the request's QoS ticket, which only a QoS queue reads (``gateway.qos_queues``)."""
        if self.active < self.max_concurrent and not self._waiters:
            self.active += 1
            return
        if len(self._waiters) >= self.queue_size:
            raise GatewayError(429, "too many requests: the gateway queue is full", code="queue_full",
                               headers={"Retry-After": "1"})
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.queue_timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            if fut.done() and not fut.cancelled():
                self._release()  # the slot arrived as we gave up: pass it on
            else:
                fut.cancel()
                self._waiters.remove(fut)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise GatewayError(408, f"request waited more than {self.queue_timeout:g}s in the gateway queue",
                               code="queue_timeout") from None

    def _release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot moves to the waiter; active is unchanged
                return
        self.active -= 1

    def slot(self, ticket: Any = None) -> "_Slot":
        """``async with admission.slot():`` around the upstream call."""
        return _Slot(self, ticket)


class _Slot:
    """A plain class, not ``@asynccontextmanager``: the generator-based one cost ~3 µs per
    request even with admission off (bench/RESULTS.md)."""

    __slots__ = ("admission", "held", "ticket")

    def __init__(self, admission: Admission, ticket: Any) -> None:
        self.admission = admission
        self.held = False
        self.ticket = ticket

    async def __aenter__(self) -> None:
        if self.admission.max_concurrent > 0:
            await self.admission._acquire(self.ticket)
            self.held = True

    async def __aexit__(self, *exc_info: object) -> None:
        if self.held:
            self.held = False
            self.admission._release()
