"""Late binding: where requests wait when the policy answers ``Hold``.

A policy holds a request when every worker would make it wait (a prefill backlog, or KV
memory that is full). Sent anyway, the request would sit in one engine's queue, bound to
that engine even if another frees first, and behind a long prompt that does not fit yet
it would block everything queued after it. Held here, it is decided again at the moments
the fleet changes: a routed request's first token (its prefill left the queue) or its end
(its KV was freed). Waiters are woken in the order they started waiting, so the oldest is
decided first, and each decision books its worker before the next one runs.
"""

from __future__ import annotations

import asyncio
import collections


class HoldRoom:
    def __init__(self, max_hold_s: float) -> None:
        self.max_hold_s = max_hold_s
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def held(self) -> int:
        return len(self._waiters)

    def notify(self) -> None:
        """Something freed: every held request is decided again (oldest first)."""
        waiters, self._waiters = self._waiters, collections.deque()
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def wait(self, timeout: float) -> None:
        """Until the next ``notify`` or ``timeout`` seconds, whichever is first."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(fut, max(timeout, 0.0))
        except asyncio.TimeoutError:
            pass
        finally:  # wait_for cancelled the future on timeout or cancellation
            try:
                self._waiters.remove(fut)
            except ValueError:  # notify took it already
                pass
