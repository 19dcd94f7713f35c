"""Late binding: where requests wait when the policy answers ``Hold``.

A policy holds a request when every worker would make it wait (a prefill backlog, or KV
memory that is full). Sent anyway, the request would sit in one engine's queue, bound to
that engine even if another frees first, and behind a long prompt that does not fit yet
it would block everything queued after it. Held here, it is decided again at the moments
the fleet changes: a routed request's first token (its prefill left the queue) or its end
(its KV was freed), and at the retry time the policy gave it.

An event frees room on one worker, usually for one request, so it wakes only the ``wake``
oldest held requests (default 4), not all of them: waking every one made each event cost
a policy decision per held request, so under saturation, where requests are held, the
gateway's work grew with the square of the load (bench/RESULTS.md, "Late binding"). Each
woken request that goes to a worker wakes the next oldest (``committed``): the room it
found may hold more, and a freed burst of room still fills in order. The rest are decided
at their own retry time. A request keeps its place (when it was first held) however often
it is held again, each decision books its worker before the next one runs, and so the
oldest request that fits is the one that goes.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools


class HoldRoom:
    def __init__(self, max_hold_s: float, wake: int = 4) -> None:
        self.max_hold_s = max_hold_s
        self.wake = max(int(wake), 0)  # oldest waiters decided again per event; 0: every one
        self._queue: list[tuple[float, int, asyncio.Future[None]]] = []  # heap by first-held time
        self._held = 0
        self._seq = itertools.count()  # ties (and futures) are never compared

    @property
    def held(self) -> int:
        return self._held

    def notify(self) -> None:
        """Something freed: the oldest held requests are decided again."""
        self._wake(self.wake or self._held)

    def committed(self) -> None:
        """A request an event woke went to a worker: there may be room for the next one."""
        if self.wake:
            self._wake(1)

    def _wake(self, n: int) -> None:
        queue = self._queue
        while n > 0 and queue:
            fut = heapq.heappop(queue)[2]
            if not fut.done():  # else it timed out or left: a stale entry
                fut.set_result(None)
                n -= 1

    async def wait(self, timeout: float, since: float) -> bool:
        """Until an event wakes it (True) or ``timeout`` seconds pass (False). ``since``, when
        the request was first held, is its place in line. A caller an event woke reports
        with ``committed`` when its request then goes to a worker."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._queue
        if len(queue) > 2 * self._held + 64:  # timed-out entries pile up between events
            queue[:] = [e for e in queue if not e[2].done()]
            heapq.heapify(queue)
        heapq.heappush(queue, (since, next(self._seq), fut))
        self._held += 1
        try:
            await asyncio.wait_for(fut, max(timeout, 0.0))
            return True
        except asyncio.TimeoutError:
            return False
        finally:  # wait_for cancelled the future on timeout or cancellation: stale in the heap
            self._held -= 1
