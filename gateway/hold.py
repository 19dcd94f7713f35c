"""Late binding: where requests wait when the policy answers ``Hold``.

A policy holds a request when every worker would make it wait (a prefill backlog, or KV
memory that is full). Sent anyway, the request would sit in one engine's queue, bound to
that engine even if another frees first, and behind a long prompt that does not fit yet
it would block everything queued after it. Held here, it is decided again at the moments
the fleet changes: a routed request's first token (its prefill left the queue) or its end
(its KV was freed), and at the retry time the policy gave it.

An event frees room on one worker, usually for one request, so it wakes only the ``wake``
held requests decided least recently (default 16), not all of them: waking every one made
each event cost a policy decision per held request, so under saturation, where requests
are held, the gateway's work grew with the square of the load (bench/RESULTS.md, "Late
binding"). Each woken request that goes to a worker wakes the next (``committed``): the
room it found may hold more, and a freed burst of room still fills. A request held again
goes to the back of the line, so a few requests that cannot start yet (long prompts
waiting for KV memory) do not take every event's turns from younger ones that could.
Each decision books its worker before the next one runs.
"""

from __future__ import annotations

import asyncio
from typing import Any


class HoldRoom:
    def __init__(self, max_hold_s: float, wake: int = 16) -> None:
        self.max_hold_s = max_hold_s
        self.wake = max(int(wake), 0)  # waiters decided again per event; 0: every one
        self._waiters: dict[asyncio.Future[None], None] = {}  # least recently decided first

    @property
    def held(self) -> int:
        return len(self._waiters)

    def notify(self) -> None:
        """Something freed: the held requests decided least recently are decided again."""
        self._wake(self.wake or len(self._waiters))

    def committed(self, ticket: Any = None) -> None:
        """A request an event woke went to a worker: there may be room for the next one."""
        if self.wake:
            self._wake(1)

    # A QoS room (``gateway.qos_queues``) orders its waiters by their tickets; this one
    # keeps them in the order of their last decision and reads no ticket.
    def outranked(self, ticket: Any) -> bool:
        """Whether a request with ``ticket`` must let held requests decide before it."""
        return False

    def handover(self, ticket: Any) -> None:
        """The retry time of a request with ``ticket`` came while others outrank it."""

    def dispatched(self, ticket: Any) -> None:
        """A request with ``ticket`` goes to a worker now (held or not)."""

    def _wake(self, n: int) -> None:
        waiters = self._waiters
        while n > 0 and waiters:
            fut = next(iter(waiters))
            del waiters[fut]
            if not fut.done():
                fut.set_result(None)
                n -= 1

    async def wait(self, timeout: float, ticket: Any = None) -> bool:
        """Until an event wakes it (True) or ``timeout`` seconds pass (False). A caller an
        event woke reports with ``committed`` when its request then goes to a worker."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[fut] = None
        try:
            await asyncio.wait_for(fut, max(timeout, 0.0))
            return True
        except asyncio.TimeoutError:
            return False
        finally:  # wait_for cancelled the future on timeout or cancellation
            self._waiters.pop(fut, None)
