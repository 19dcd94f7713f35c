"""One routing state for a group of gateway processes and replicas: each publishes the life
of what it routes (``gateway.records``) on the group's bus (``gateway.bus``) and applies
everyone else's to its own policies and registry, as if it had routed them itself.

What is shared is what only a gateway knows: which request went to which worker with which
predicted hit (a policy's ``on_peer_routed`` records it as its own ``select`` would: the
approximate tree's insert, ``cost``'s booking with its hit), first tokens and completions
(the ledger's queues and learned rates, held requests woken), the in-flight count per
worker (a peer's request counts in the worker's ``WorkerView.in_flight`` here), and each
client's rate-limit spend, each tenant's budget spend, and which worker stores each Responses object. What engines report (KV events, load) each process hears itself.

Nothing waits on the bus. Records are applied as they arrive (one publisher's in order);
while the bus is down each process routes on what it has. Liveness: every process says
every ``heartbeat_s`` which requests it has in flight (``Alive``); a peer's request missing
from that list ended without its record reaching here and is released, and a peer silent
for three heartbeats is gone (a killed process, a partition) and all of its requests are
released. On every (re)connection a process says ``Hello`` and sends its in-flight
requests again, and every peer that hears a ``Hello`` does the same, so a process that
joined, restarted or was cut off rebuilds the group's bookings within a heartbeat. What
is lost in an outage is what completed during it: its approximate-tree inserts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from gateway.peer_requests import InFlight, Leg, PeerRequests
from gateway.records import (Alive, Completed, FirstToken, Hello, Member, Owned, Routed, Spent, Used, decode_batch, encode,
                             request_fields)
from index.views import Outcome, RequestView, WorkerView
from policies.base import Policy

log = logging.getLogger("kvgate.peers")


class Local:
    """The gateway alone: nothing to tell anyone."""

    claims: Any = None  # gateway.claims.Claims: a group's decisions, one at a time per worker

    def claim_tries(self, first: bool) -> int:
        """How many claims a decision may lose before it keeps its choice (0: no claims: the
        gateway alone, a retry, or a group deciding too fast for them, ``gateway.claims``)."""
        return 0

    async def stands(self, view: RequestView, worker: WorkerView, cached: int | None, candidates: int) -> bool:
        """Whether a choice that may be claimed (``claim_tries`` left) stands: nothing to
        claim, or its claim won (False: the caller withdraws it and asks the policy again)."""
        return True

    def routed(self, view: RequestView, worker: WorkerView, cached: int | None) -> None: ...
    def first_token(self, view: RequestView, worker: WorkerView) -> None: ...
    def completed(self, view: RequestView, worker: WorkerView, outcome: Outcome) -> None: ...


ALONE = Local()


def new_origin() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Peers(Local):
    """This process's side of the group: ``routed``/``first_token``/``completed`` next to
    the policy's own hooks; ``apply`` for what peers send (see the module)."""

    def __init__(self, url: str, subject: str, policies: Mapping[str, Policy], workers: Mapping[str, Any],
                 heartbeat_s: float = 1.0, origin: str | None = None, wake_step_s: float = 0.01,
                 tls: ssl.SSLContext | None = None, claims: bool = True, claims_max_rps: float = 100.0) -> None:
        self.origin = origin or new_origin()
        self.heartbeat_s = heartbeat_s
        self.wake_step_s = wake_step_s  # longer than a record's usual trip (the bus lingers 2 ms)
        self.freed: Callable[[], None] = lambda: None  # wakes held requests (the proxy's)
        self.charge: Callable[[str], None] | None = None  # debits a client's rate-limit bucket
        self.use: Callable[[str, int, int], None] | None = None  # debits a tenant's budgets (requests, tokens)
        self.learn_owner: Callable[[str, str], None] | None = None  # a Responses object's worker
        self.membership: Any = None  # gateway.membership.SharedMembership: admin changes are the group's
        self.mine: dict[str, InFlight] = {}  # rid -> what this process has in flight
        self.theirs = PeerRequests(policies, workers)  # what each peer has in flight
        self.heard: dict[str, float] = {}  # origin -> monotonic time of its last record
        self.charged = 0
        self.lag_observe: Callable[[float], None] = lambda _s: None
        from gateway.bus import Bus  # nats-py is imported only by a gateway that shares its state

        self.bus = Bus(url, subject, self.apply, self._state, name=f"kvgate {self.origin}", tls=tls)
        if claims:
            from gateway.claims import Claims

            self.claims = Claims(subject, self.apply, max_rps=claims_max_rps)
        self._timer: asyncio.Task | None = None
        self._attaching: asyncio.Task | None = None

    async def start(self) -> None:
        await self.bus.start()
        self._timer = asyncio.get_running_loop().create_task(self._beat())

    async def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        await self.bus.stop()

    # -- this process's requests -------------------------------------------------------
    def routed(self, view: RequestView, worker: WorkerView, cached: int | None) -> None:
        mine = self.mine.get(view.request_id)
        first = mine is None
        if first:
            mine = self.mine[view.request_id] = InFlight(view)
        mine.legs[worker.role] = Leg(worker.url, cached)
        self._routed(view, worker.role, worker.url, cached, first, False)

    def _routed(self, view: RequestView, role: str, url: str, cached: int | None, prompt: bool, first_token: bool) -> None:
        fields = request_fields(view) if prompt else {}
        self.bus.publish(encode(Routed(self.origin, view.request_id, role, url, time.time(), cached,
                                       first_token=first_token, **fields)))

    def claim_tries(self, first: bool) -> int:
        claims = self.claims
        return claims.tries if claims is not None and first and claims.wanted() else 0

    async def stands(self, view: RequestView, worker: WorkerView, cached: int | None, candidates: int) -> bool:
        return candidates == 1 or await self.claim(view, worker, cached)

    async def claim(self, view: RequestView, worker: WorkerView, cached: int | None) -> bool:
        """Claim ``worker`` for ``view``'s first leg (``gateway.claims``): False when a peer
        claimed it first, and the caller should choose again."""
        record = Routed(self.origin, view.request_id, worker.role, worker.url, time.time(), cached,
                        **request_fields(view))
        return await self.claims.claim(worker.url, encode(record))

    def first_token(self, view: RequestView, worker: WorkerView) -> None:
        mine = self.mine.get(view.request_id)
        leg = mine.legs.get(worker.role) if mine is not None else None
        if leg is not None:
            leg.first_token = True
        self.bus.publish(encode(FirstToken(self.origin, view.request_id, worker.role, worker.url, time.time())))

    def completed(self, view: RequestView, worker: WorkerView, outcome: Outcome) -> None:
        mine = self.mine.get(view.request_id)
        if mine is not None:
            mine.legs.pop(worker.role, None)
            if not mine.legs:
                del self.mine[view.request_id]
        self.bus.publish(encode(Completed(self.origin, view.request_id, worker.role, worker.url, time.time(),
                                          outcome.ok, outcome.status, outcome.prompt_tokens, outcome.cached_tokens,
                                          outcome.completion_tokens)))

    def spent(self, client: str) -> None:
        self.bus.publish(encode(Spent(self.origin, time.time(), client)))

    def used(self, tenant: str, requests: int, tokens: int) -> None:
        self.bus.publish(encode(Used(self.origin, time.time(), tenant, requests, tokens)))

    def owned(self, response_id: str, url: str) -> None:
        self.bus.publish(encode(Owned(self.origin, time.time(), response_id, url)))

    def _resend(self) -> None:
        """Everything in flight here, again (a peer joined or this process reconnected), and
        the fleet's admin changes."""
        if self.membership is not None:
            self.membership.resend()
        for rid, mine in self.mine.items():
            for i, (role, leg) in enumerate(mine.legs.items()):
                self._routed(mine.view, role, leg.url, leg.cached, i == 0, leg.first_token)

    def _state(self, connected: bool) -> None:
        if self.claims is not None:
            if connected and self.bus.nc is not None:
                self._attaching = asyncio.get_running_loop().create_task(self.claims.attach(self.bus.nc))
            else:
                self.claims.detach()
        if connected:
            self.bus.publish(encode(Hello(self.origin, time.time())))
            self._resend()

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                self.bus.publish(encode(Alive(self.origin, time.time(), list(self.mine))))
                now = time.monotonic()
                for origin, at in list(self.heard.items()):
                    if now - at > 3 * self.heartbeat_s:
                        self._forget(origin, f"silent for {now - at:.1f}s")
            except Exception:  # a bug here must not stop every later heartbeat
                log.exception("peers: heartbeat failed")

    # -- peers' records ----------------------------------------------------------------
    def apply(self, data: bytes) -> None:
        now, wall = time.monotonic(), time.time()
        for record in decode_batch(data):
            origin = record.origin
            if origin == self.origin:
                continue
            kind = type(record)
            if origin not in self.heard:
                log.info("peer %s joined", origin)
                if kind is not Hello:  # one that was forgotten (silent too long): ask it for everything again
                    self.bus.publish(encode(Hello(self.origin, time.time())))
            self.heard[origin] = now
            if kind is Routed:
                self.theirs.routed(record)
                self.lag_observe(wall - record.sent)
            elif kind is FirstToken:
                if self.theirs.first_token(record):
                    self._wake_after(origin)
            elif kind is Completed:
                if self.theirs.completed(record):
                    self._wake_after(origin)
                self.lag_observe(wall - record.sent)
            elif kind is Alive:
                if self.theirs.alive(record):
                    self.freed()
            elif kind is Hello:
                self._resend()
            elif kind is Spent and self.charge is not None:
                self.charge(record.client)
                self.charged += 1
            elif kind is Used and self.use is not None:
                self.use(record.tenant, record.requests, record.tokens)
                self.charged += 1
            elif kind is Owned and self.learn_owner is not None:
                self.learn_owner(record.response_id, record.url)
            elif kind is Member and self.membership is not None:
                self.membership.apply(record)

    def _wake_after(self, origin: str) -> None:
        """Held requests here are decided again after a peer's request freed a worker, but not
        all processes at once: each would see the same free room before the others' bookings
        reach it, and all would send a request there. The origin (which hears its own event
        first) goes at once; the others follow a ``wake_step_s`` apart, in a rotating order,
        each after the bookings of those before it have arrived. While claims are on, they
        serve that purpose better, and everyone wakes at once."""
        if self.wake_step_s <= 0 or (self.claims is not None and self.claims.active):
            self.freed()  # (claiming, those woken here and there take the freed worker one at a time)
            return
        ring = sorted([*self.heard, self.origin])
        at = ring.index(origin) if origin in ring else 0
        turn = (ring.index(self.origin) - at) % len(ring)
        if turn == 0:
            self.freed()
        else:
            asyncio.get_running_loop().call_later(turn * self.wake_step_s, self.freed)

    def _forget(self, origin: str, why: str) -> None:
        released = self.theirs.forget(origin)
        log.warning("peer %s %s: released its %d requests in flight", origin, why, released)
        self.heard.pop(origin, None)
        self.freed()

    def stats(self) -> dict[str, float]:
        claims = self.claims.stats() if self.claims is not None else {}
        return {**claims, "connected": float(self.bus.connected), "peers": float(len(self.heard)),
                "published": float(self.bus.published), "dropped": float(self.bus.dropped),
                "applied": float(self.theirs.applied), "ignored": float(self.theirs.ignored),
                "released": float(self.theirs.released), "charged": float(self.charged),
                "peer_requests_in_flight": float(self.theirs.count)}
