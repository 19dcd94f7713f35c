"""Multi-tenant QoS at the gateway's door: who is asking, in which class, within what budget.

Each request on a QoS gateway gets a ``Ticket``: its tenant (the API key's, else the one
``--tenant-header`` names, else ``default``), its priority class (the ``X-Priority``
header's, else the class whose engine priority the body's ``priority`` field names, else
the tenant's own; any of them only among the tenant's allowed classes) and its expected
tokens. The ticket orders the admission queue and the hold room (``gateway.qos_queues``),
is charged to the tenant's budgets (``gateway.budgets``), and is settled with the tokens
the engine reported when the request ends. docs/qos.md has the design.

Keys are never kept or logged: a presented key is looked up by its hash.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from gateway.auth import bearer_token
from gateway.budgets import Budgets
from gateway.errors import GatewayError
from gateway.pd import splice_fields
from gateway.metrics import GatewayMetrics
from gateway.qos_metrics import QosMetrics
from gateway.qos_queues import FairAdmission, FairHoldRoom
from gateway.tenants import DEFAULT_TENANT, ClassSpec, QosSpec, TenantSpec
from index.views import Outcome, RequestView

PRIORITY_HEADER = "X-Priority"
TICKET = "kvgate.qos"  # the request's ticket, in the aiohttp request's own mapping


def key_digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


class Ticket:
    """One request's QoS: what the queues (``gateway.fair_queue.Share``), the budgets and
    the metrics read. ``outcome`` is the last attempt's, set by the proxy."""

    __slots__ = ("tenant", "klass", "rank", "weight", "cost", "model", "slo", "hold", "started", "first_at",
                 "outcome", "charged")

    def __init__(self, tenant: str, klass: ClassSpec, rank: int, weight: float, cost: float,
                 model: str | None) -> None:
        self.tenant = tenant
        self.klass = klass.name
        self.rank = rank
        self.weight = weight
        self.cost = cost
        self.model = model
        self.slo = klass.ttft_slo_secs
        self.hold = klass.hold  # may wait in the hold room (``ClassSpec.hold``)
        self.started = time.perf_counter()
        self.first_at: float | None = None  # a stream's first byte to the client
        self.outcome: Outcome | None = None
        self.charged: list[tuple[Any, float]] = []


class Qos:
    def __init__(self, spec: QosSpec, tenant_header: str | None, metrics: GatewayMetrics) -> None:
        self.spec = spec
        self.tenant_header = tenant_header
        self.metrics = QosMetrics(metrics.registry, [c.name for c in spec.classes], metrics.add_local)
        self.by_name = spec.tenants
        self.by_key = {key_digest(k): t for t in spec.tenants.values() for k in t.keys}
        self.ranks = {c.name: i for i, c in enumerate(spec.classes)}
        self.by_priority = {c.priority: i for i, c in reversed(list(enumerate(spec.classes)))}
        self.allowed = {t.name: frozenset(self.ranks[c] for c in t.classes) for t in spec.tenants.values()}
        self.budgets = Budgets(spec) if spec.budgets else None
        # the predicted TTFT of a request with its ticket, where the policy can tell (state.py)
        self.predict: Callable[[RequestView, Ticket], float | None] | None = None

    # -- the queues ---------------------------------------------------------------------
    def admission(self, cfg: Any) -> FairAdmission:
        admission = FairAdmission(cfg.max_concurrent_requests, cfg.queue_size, cfg.queue_timeout_secs,
                                  len(self.spec.classes), self.fallback, self.reject)
        self.metrics.queues.append(("admission", admission.fair.counts))
        return admission

    def hold_room(self, cfg: Any) -> FairHoldRoom:
        room = FairHoldRoom(cfg.max_hold_secs, cfg.hold_wake, len(self.spec.classes), self.admitted)
        self.metrics.queues.append(("hold", room.counts))
        return room

    def watch(self, room: FairHoldRoom, policy: Any, candidates: Callable[[str | None], list[Any]]) -> None:
        """Predict TTFTs for the classes' SLOs with ``policy`` where it can tell
        (``Policy.predicted_ttft``): its best worker's, plus the work held ahead of the
        request at the fleet's prefill speed."""
        if not any(c.ttft_slo_secs is not None for c in self.spec.classes):
            return

        def predict(view: RequestView, ticket: Ticket) -> float | None:
            workers = [w.view for w in candidates(view.model)]
            best = policy.predicted_ttft(view, workers) if workers else None
            if best is None:
                return None
            queue = room.queues.get(ticket.model)
            ahead = queue.work_ahead(ticket) if queue is not None else 0.0
            speed = getattr(policy, "prefill_tps", 0.0) * len(workers)
            return best + (ahead / speed if speed > 0 else 0.0)

        self.predict = predict

    # -- who, which class ---------------------------------------------------------------
    def tenant_of(self, request: web.Request) -> TenantSpec:
        """The key's tenant, else the tenant header's (a name in the file), else ``default``."""
        if self.by_key:
            token = bearer_token(request.headers.get("Authorization"))
            if token:
                found = self.by_key.get(key_digest(token))
                if found is not None:
                    return found
        if self.tenant_header:
            named = request.headers.get(self.tenant_header)
            if named and named in self.by_name:
                return self.by_name[named]
        return self.by_name[DEFAULT_TENANT]

    def rank_of(self, request: web.Request, priority: Any, tenant: TenantSpec) -> int:
        asked = request.headers.get(PRIORITY_HEADER)
        if asked is not None:
            rank = self.ranks.get(asked.strip())
            if rank is None:
                raise GatewayError(400, f"{PRIORITY_HEADER} {asked.strip()[:64]!r} is not a priority class; "
                                   f"classes: {', '.join(self.ranks)}", code="unknown_priority_class")
        elif priority is not None:
            rank = self.by_priority.get(priority) if type(priority) is int else None
            if rank is None:
                if not self.spec.engine_priority:
                    return self.ranks[tenant.default_class]  # the engine's business alone
                values = ", ".join(str(c.priority) for c in self.spec.classes)
                raise GatewayError(400, f"'priority' must be one of the classes' priorities: {values}",
                                   code="unknown_priority_class", param="priority")
        else:
            return self.ranks[tenant.default_class]
        if rank not in self.allowed[tenant.name]:
            raise GatewayError(403, f"tenant {tenant.name!r} may not use priority class "
                               f"{self.spec.classes[rank].name!r}", code="priority_not_allowed")
        return rank

    # -- a request's life ---------------------------------------------------------------
    def fallback(self) -> Ticket:
        """The ticket of a request that carries no body to read (the default tenant's)."""
        t = self.by_name[DEFAULT_TENANT]
        rank = self.ranks[t.default_class]
        return Ticket(t.name, self.spec.classes[rank], rank, t.weight, float(self.spec.default_output_tokens), None)

    def admit(self, request: web.Request, raw: bytes, model: str | None, priority: Any, max_tokens: int | None,
              splice: bool = True) -> tuple[Ticket, bytes]:
        """The request's ticket, and its body with the class's priority where the engines
        take one and the body names none. Raises 400/403 for a class it may not ask for and
        429 for a spent budget; the ticket is in ``request[TICKET]`` for the headers."""
        tenant = self.tenant_of(request)
        try:
            rank = self.rank_of(request, priority, tenant)
        except GatewayError as exc:
            self.metrics.rejected_by(tenant.name, tenant.default_class, exc.code or "priority").inc()
            raise
        klass = self.spec.classes[rank]
        expected = (max_tokens if max_tokens is not None else self.spec.default_output_tokens) + len(raw) / 4
        ticket = Ticket(tenant.name, klass, rank, tenant.weight, float(expected), model)
        request[TICKET] = ticket
        if self.budgets is not None:
            try:
                self.budgets.take(tenant.name)
            except GatewayError as exc:
                self.reject(ticket, exc.code or "budget")
                raise
        if splice and self.spec.engine_priority and priority is None:
            raw = splice_fields(raw, {"priority": klass.priority})
        return ticket, raw

    def routed(self, ticket: Ticket, view: RequestView) -> None:
        """The request's prompt is read: expect its tokens, and refuse it now if its class's
        TTFT SLO is predicted out of reach."""
        if view.token_ids is not None:  # a queue that charged the estimate settles what it charged
            ticket.cost = float(len(view.token_ids) + (view.max_tokens or self.spec.default_output_tokens))
        if ticket.slo is not None and self.predict is not None:
            predicted = self.predict(view, ticket)
            if predicted is not None and predicted > ticket.slo:
                self.reject(ticket, "slo")
                raise GatewayError(503, f"no worker is predicted to start this request within the "
                                   f"{ticket.klass!r} class's TTFT objective of {ticket.slo:g}s (predicted "
                                   f"{predicted:.2f}s); retry later or in a less urgent class",
                                   code="slo_unattainable", headers={"Retry-After": "1"})

    def finish(self, ticket: Ticket) -> None:
        """The response has ended: settle the tenant's counters and budget with the tokens
        the engine reported, and time its first token."""
        outcome = ticket.outcome
        if outcome is None:
            return
        used = (outcome.prompt_tokens or 0) + (outcome.completion_tokens or 0)
        if used:
            for queue, charged in ticket.charged:
                queue.settle(ticket, used, charged)
            if self.budgets is not None:
                self.budgets.use(ticket.tenant, used)
            self.metrics.tokens(ticket, outcome.prompt_tokens or 0, outcome.completion_tokens or 0)
        if outcome.ok:
            first = ticket.first_at if ticket.first_at is not None else time.perf_counter()
            self.metrics.ttft_of(ticket.tenant, ticket.klass).observe(first - ticket.started)

    def reject(self, ticket: Any, reason: str) -> None:
        self.metrics.rejected_by(ticket.tenant, ticket.klass, reason).inc()

    def admitted(self, ticket: Any) -> None:
        self.metrics.admitted_by(ticket.tenant, ticket.klass).inc()

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """OpenAI's ``x-ratelimit-*`` headers on every answer to a tenant with a budget
        (an ``on_response_prepare`` signal: streams send their headers before the end)."""
        ticket = request.get(TICKET)
        if ticket is not None and self.budgets is not None and self.budgets.limited(ticket.tenant):
            response.headers.update(self.budgets.headers(ticket.tenant))
