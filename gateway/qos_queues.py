"""The gateway's two queues in QoS order (``gateway.fair_queue``): the admission queue in
front of ``--max-concurrent-requests`` and the late-binding hold room.

Admission: a freed slot goes to the first waiter in class and fair-share order. A full
queue refuses a newcomer (429) unless someone queued is of a less urgent class: then the
newest of those is pushed out (429, ``preempted``) and the newcomer takes its place.
Nothing is ever taken from a worker: preemption happens only in the gateway's queues.

Hold room: held requests are woken in that order at each first token or completion, one
queue per model (held requests of one model never wait for another's workers). A
newcomer that would be behind someone held waits its turn without a decision (a decision
books a worker); a held request whose retry time comes while others are ahead of it
gives that turn to the first of them. Every request's tokens are charged to its tenant
when it goes to a worker, held or not.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from gateway.admission import Admission
from gateway.errors import GatewayError
from gateway.fair_queue import FairQueue, Waiter
from gateway.hold import HoldRoom

MAX_MODEL_QUEUES = 64  # past this, queues with nobody held are dropped (their counters restart)
Reject = Callable[[Any, str], None]  # (ticket, reason)


def _no_reject(_ticket: Any, _reason: str) -> None:
    pass


class FairAdmission(Admission):
    """``Admission`` whose queue is a ``FairQueue``; requests without a ticket (routes
    that carry no body to read) get ``fallback()``'s."""

    def __init__(self, max_concurrent: int, queue_size: int, queue_timeout: float, ranks: int,
                 fallback: Callable[[], Any], on_reject: Reject = _no_reject) -> None:
        super().__init__(max_concurrent, queue_size, queue_timeout)
        self.fair = FairQueue(ranks)
        self.fallback = fallback
        self.on_reject = on_reject

    @property
    def queued(self) -> int:
        return self.fair.size

    async def _acquire(self, ticket: Any = None) -> None:
        ticket = ticket if ticket is not None else self.fallback()
        fair = self.fair
        if self.active < self.max_concurrent and not fair.size:
            self.active += 1
            fair.charge(ticket)
            return
        if fair.size >= self.queue_size:
            victim = fair.victim(ticket)
            if victim is None:
                self.on_reject(ticket, "queue_full")
                raise GatewayError(429, "too many requests: the gateway queue is full", code="queue_full",
                                   headers={"Retry-After": "1"})
            self.on_reject(victim.ticket, "preempted")
            victim.item.set_exception(GatewayError(
                429, "too many requests: a more urgent request took this one's place in the gateway queue",
                code="preempted", headers={"Retry-After": "1"}))
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter = fair.push(ticket, fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.queue_timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._release()  # the slot arrived as we gave up: pass it on
            else:
                if not fut.done():
                    fut.cancel()
                fair.discard(waiter)
            if isinstance(exc, asyncio.CancelledError):
                raise
            self.on_reject(ticket, "queue_timeout")
            raise GatewayError(408, f"request waited more than {self.queue_timeout:g}s in the gateway queue",
                               code="queue_timeout") from None

    def _release(self) -> None:
        while (waiter := self.fair.pop()) is not None:
            if not waiter.item.done():
                self.fair.charge(waiter.ticket)
                waiter.item.set_result(None)  # the slot moves to the waiter; active is unchanged
                return
        self.active -= 1


class FairHoldRoom(HoldRoom):
    """``HoldRoom`` whose ticketed waiters wait in a ``FairQueue`` per model (the plain
    waiters, without a ticket, as before: woken after them)."""

    def __init__(self, max_hold_s: float, wake: int, ranks: int,
                 on_dispatch: Callable[[Any], None] = lambda _t: None) -> None:
        super().__init__(max_hold_s, wake)
        self.ranks = ranks
        self.on_dispatch = on_dispatch
        self.queues: dict[str | None, FairQueue] = {}

    def queue(self, model: str | None) -> FairQueue:
        q = self.queues.get(model)
        if q is None:
            if len(self.queues) >= MAX_MODEL_QUEUES:
                for name in [m for m, other in self.queues.items() if not other.size]:
                    del self.queues[name]
            q = self.queues[model] = FairQueue(self.ranks)
        return q

    @property
    def held(self) -> int:
        return super().held + sum(q.size for q in self.queues.values())

    def notify(self) -> None:
        self._wake(self.wake or self.held)

    def _wake_in(self, q: FairQueue, n: int) -> None:
        for waiter in q.pop_many(n):
            if not waiter.item.done():
                waiter.item.set_result(None)

    def _wake(self, n: int) -> None:
        for q in list(self.queues.values()):
            self._wake_in(q, n)
        super()._wake(n)

    def committed(self, ticket: Any = None) -> None:
        if not self.wake:
            return
        if ticket is None:
            super()._wake(1)
        else:
            self._wake_in(self.queue(ticket.model), 1)

    def outranked(self, ticket: Any) -> bool:
        if ticket is None:
            return False
        q = self.queues.get(ticket.model)
        return q is not None and q.ahead_of(ticket)

    def handover(self, ticket: Any) -> None:
        if ticket is not None:
            self._wake_in(self.queue(ticket.model), 1)

    def dispatched(self, ticket: Any) -> None:
        self.queue(ticket.model).charge(ticket)
        self.on_dispatch(ticket)

    async def wait(self, timeout: float, ticket: Any = None) -> bool:
        if ticket is None:
            return await super().wait(timeout)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        q = self.queue(ticket.model)
        waiter: Waiter = q.push(ticket, fut)
        try:
            await asyncio.wait_for(fut, max(timeout, 0.0))
            return True
        except asyncio.TimeoutError:
            return False
        finally:  # woken: popped already; timed out or cancelled: still queued
            q.discard(waiter)

    def counts(self) -> dict[tuple[str, int], int]:
        out: dict[tuple[str, int], int] = {}
        for q in self.queues.values():
            for key, n in q.counts().items():
                out[key] = out.get(key, 0) + n
        return out
