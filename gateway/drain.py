"""Graceful shutdown: stop taking work, let what is in flight finish, then exit.

On SIGTERM the gateway keeps its listening socket and keep-alive connections open for the
grace period, so a load balancer polling ``/readiness`` sees 503 and a client that sends a
new request gets a clear 503 JSON (with ``Connection: close``) instead of a reset; the
requests already in flight, streams included, run to completion. Only then does the
aiohttp runner close everything.
"""

from __future__ import annotations

import asyncio

from gateway.errors import GatewayError


class Drain:
    def __init__(self, open_paths: tuple[str, ...]) -> None:
        self.open_paths = open_paths
        self.draining = False
        self.retiring = False  # another process takes this one's place: answers carry Connection: close
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self, path: str) -> bool:
        """Count a request in (True), or refuse it while draining; probes are never counted."""
        if path in self.open_paths:
            return False
        if self.draining:
            raise GatewayError(503, "gateway is shutting down", code="shutting_down",
                               headers={"Connection": "close", "Retry-After": "1"})
        self.in_flight += 1
        self._idle.clear()
        return True

    def leave(self) -> None:
        self.in_flight -= 1
        if not self.in_flight:
            self._idle.set()

    async def drain(self, grace: float) -> bool:
        """Refuse new work and wait up to ``grace`` seconds for in-flight requests; True if all finished."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), grace)
            return True
        except asyncio.TimeoutError:
            return False
