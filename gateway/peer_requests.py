"""Peers' requests in flight, applied to this process's policies and registry as if it had
routed them (``gateway.peers`` hears them and decides when; this keeps them and ends them).

A peer's request is booked here when its ``Routed`` record arrives (``on_peer_routed``, the
worker's in-flight count), moves on its ``FirstToken`` and ends on its ``Completed``; one that
ended without its record arriving is released by the peer's next ``Alive``, and all of a peer's
are released when it is forgotten (silent too long).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.records import Alive, Completed, FirstToken, Routed, outcome_of, peer_view
from index.views import Outcome, RequestView
from policies.base import Policy


@dataclass(slots=True)
class Leg:
    url: str
    cached: int | None
    first_token: bool = False


@dataclass(slots=True)
class InFlight:
    view: RequestView
    legs: dict[str, Leg] = field(default_factory=dict)  # role -> leg


class PeerRequests:
    def __init__(self, policies: Mapping[str, Policy], workers: Mapping[str, Any]) -> None:
        self.policies = policies
        self.workers = workers  # url -> gateway.workers.Worker (the registry's table)
        self.by_origin: dict[str, dict[str, InFlight]] = {}  # origin -> rid -> in flight there
        self.applied = self.ignored = self.released = 0

    @property
    def count(self) -> int:
        return sum(len(t) for t in self.by_origin.values())

    def routed(self, r: Routed) -> None:
        theirs = self.by_origin.setdefault(r.origin, {})
        req = theirs.get(r.rid)
        if req is None:
            if not r.prompt:  # a later leg whose first was lost: the next resend brings it whole
                self.ignored += 1
                return
            req = theirs[r.rid] = InFlight(peer_view(r, f"{r.rid}@{r.origin}"))
        if r.role in req.legs:
            return  # sent again in a resync: already applied
        found = self._worker(r.role, r.url)
        if found is None:
            if not req.legs:
                del theirs[r.rid]
            return
        policy, worker = found
        worker.started()
        policy.on_peer_routed(req.view, worker.view, r.cached)
        req.legs[r.role] = Leg(r.url, r.cached, r.first_token)
        if r.first_token:
            policy.on_first_token(req.view, worker.view)
        self.applied += 1

    def first_token(self, r: FirstToken) -> bool:
        """Whether it moved a request (False: unknown here, or already past its first token)."""
        found = self._leg(r.origin, r.rid, r.role)
        if found is None or found[1].first_token:
            return False
        req, leg = found
        leg.first_token = True
        worker = self.workers.get(leg.url)
        if worker is not None:
            self.policies[r.role].on_first_token(req.view, worker.view)
        self.applied += 1
        return True

    def completed(self, r: Completed) -> bool:
        """Whether it ended a request known here."""
        if self._leg(r.origin, r.rid, r.role) is None:
            return False
        self._end(r.origin, r.rid, r.role, outcome_of(r))
        self.applied += 1
        return True

    def alive(self, r: Alive) -> bool:
        """Release the peer's requests it no longer has in flight; whether any were."""
        theirs = self.by_origin.get(r.origin)
        if not theirs:
            return False
        live = set(r.live)
        gone = [rid for rid in theirs if rid not in live]
        for rid in gone:
            self._release(r.origin, rid)
        return bool(gone)

    def forget(self, origin: str) -> int:
        """Release every request of a peer that is gone; how many there were."""
        theirs = self.by_origin.pop(origin, {})
        for rid in list(theirs):
            self._release(origin, rid, theirs)
        return len(theirs)

    def _worker(self, role: str, url: str) -> tuple[Policy, Any] | None:
        worker = self.workers.get(url)
        policy = self.policies.get(role)
        if worker is None or policy is None or worker.view.role != role:
            self.ignored += 1  # a worker this process does not have (yet): membership is its own
            return None
        return policy, worker

    def _leg(self, origin: str, rid: str, role: str) -> tuple[InFlight, Leg] | None:
        req = self.by_origin.get(origin, {}).get(rid)
        leg = req.legs.get(role) if req is not None else None
        return (req, leg) if leg is not None else None  # type: ignore[return-value]

    def _end(self, origin: str, rid: str, role: str, outcome: Outcome,
             theirs: dict[str, InFlight] | None = None) -> None:
        theirs = self.by_origin[origin] if theirs is None else theirs
        req = theirs[rid]
        leg = req.legs.pop(role)
        if not req.legs:
            del theirs[rid]
        worker = self.workers.get(leg.url)
        if worker is not None:
            worker.finished()
            self.policies[role].on_complete(req.view, worker.view, outcome)

    def _release(self, origin: str, rid: str, theirs: dict[str, InFlight] | None = None) -> None:
        """A peer's request that ended without its record reaching here."""
        theirs = self.by_origin[origin] if theirs is None else theirs
        lost = Outcome(ok=False, status=0, error="ended at a peer, record lost")
        for role in list(theirs[rid].legs):
            self._end(origin, rid, role, lost, theirs)
            self.released += 1
