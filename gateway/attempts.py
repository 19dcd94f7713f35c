"""The one retry loop both modes share: choose, attempt, and on a retryable failure choose
again, at most ``max_retries`` more times.

What is attempted is a ``Target``'s business: one worker (``gateway.proxy.Unified``) or a
prefill/decode pair (``gateway.pd.Pairs``). A target chooses through the policy, makes the
engine requests, and answers the client's response or a ``Failure``. Retries happen only
while nothing has reached the client: a target answers a response once the client's
headers are sent (a stream's after its first chunk came), so a failure before that costs a
retry. A stream that breaks after it is answered ``Broken``, and ``gateway.migration``
finishes it on other workers (or, where it may not, it ends with one JSON error event and
``[DONE]``).

Holding (late binding) lives here too: only a first choice may be held, since a retry has
waited already.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from aiohttp import web

from gateway.errors import GatewayError
from gateway.hold import HoldRoom
from gateway.metrics import GatewayMetrics
from gateway.stream_record import Record
from index.views import RequestView, WorkerView
from policies.base import Choice, Hold, NoWorkerAvailable, Policy

if TYPE_CHECKING:
    from gateway.migration import Migration
    from gateway.workers import Worker

log = logging.getLogger("kvgate.proxy")

RETRYABLE_STATUS = frozenset({500, 502, 503, 504})
# A QoS request that finds others held ahead of it waits its turn without a decision
DEFERRED = Hold(retry_s=0.05, reason="behind held requests of its class or a more urgent one")
T = TypeVar("T")
P = TypeVar("P")


@dataclass(frozen=True, slots=True)
class Reply:
    """An engine's whole answer, read."""

    status: int
    body: bytes
    content_type: str  # as the engine sent it, parameters included


@dataclass(frozen=True, slots=True)
class Failure:
    """An attempt that produced nothing for the client.

    ``status`` is the engine's HTTP status, or 0 when no answer came (then ``body`` is empty
    and ``cause`` says what happened: connect, timeout, read, malformed, stream_start). When
    the loop ends on a failure with a status of 400 or more, the client gets that status,
    body and ``content_type``. ``retryable`` failures let the loop try another choice."""

    status: int
    body: bytes = b""
    content_type: str = ""
    cause: str = ""
    retryable: bool = True

    @property
    def timed_out(self) -> bool:
        """No answer in the request timeout: never worth the same worker again."""
        return self.status == 0 and self.cause == "timeout"

    @classmethod
    def answered(cls, status: int, body: bytes, content_type: str) -> Failure:
        """An engine's error answer: a 5xx is worth another worker, a 4xx is the request's own."""
        return cls(status, body, content_type.split(";")[0], f"http_{status}", retryable=status >= 500)


@dataclass(frozen=True, slots=True)
class Broken:
    """A stream that broke after its first chunk reached the client: ``response`` is the
    client's, open; ``sink`` holds what the client has had (``gateway.stream_record``);
    ``cause`` says what broke it (reset, timeout, eof, error_event, health, removed)."""

    response: web.StreamResponse
    sink: Any
    cause: str


def failed(worker: Worker, cause: str, detail: str, metrics: GatewayMetrics) -> Failure:
    """Count a worker's fault (breaker, last error, metric, log) and the failure it makes."""
    worker.breaker.record_failure()
    worker.last_error = detail
    metrics.upstream_errors.labels(worker.url, cause).inc()
    log.warning("upstream %s failed (%s): %s", worker.url, cause, detail)
    return Failure(0, cause=cause)


def refused_hold(policy: Policy) -> GatewayError:
    """A policy answered ``Hold`` to a request that may not be held: a plugin bug."""
    return GatewayError(500, f"policy {policy.name!r} held a request it was told not to hold", code="policy_error")


async def select(policy: Policy, view: RequestView, workers: Sequence[WorkerView]) -> Choice | Hold:
    """``Policy.select`` may be plain or async; a plain ``Choice`` skips ``inspect.isawaitable``."""
    choice = policy.select(view, workers)
    if type(choice) is not Choice and inspect.isawaitable(choice):
        choice = await choice
    return choice  # type: ignore[return-value]


class Tried:
    """The workers a request's attempts went to, in order, and those that timed out."""

    __slots__ = ("urls", "timed_out", "attempts", "timeouts")

    def __init__(self) -> None:
        self.urls: list[str] = []
        self.timed_out: list[str] = []
        self.attempts = 0
        self.timeouts = 0


class Target(Protocol[P]):
    """What the loop attempts: ``P`` is one choice (a worker, a pair of them)."""

    policy: Policy  # named in the errors of a policy that holds wrongly

    async def decide(self, view: RequestView, tried: Tried) -> P | Hold:
        """A choice among the available workers (untried ones first); raises
        ``NoWorkerAvailable`` when there is none."""

    def urls(self, pick: P) -> Sequence[str]: ...

    async def attempt(self, request: web.Request, view: RequestView, raw: bytes, body: object, pick: P,
                      n: int, sink: Any = None) -> web.StreamResponse | Failure | Broken:
        """Attempt ``n`` (0 first): the client's response, or the failure to retry past.
        ``sink``: where a stream's chunks pass on their way to the client (given only for a
        stream that may migrate: a ``Record``, or a continuation's ``Resume``)."""

    def exhausted(self, view: RequestView, tried: Tried) -> GatewayError:
        """Every attempt failed with no answer worth passing on (not all timed out)."""

    def timed_out(self, view: RequestView, tried: Tried) -> GatewayError: ...

    def unavailable(self, view: RequestView) -> GatewayError:
        """Nothing could be attempted at all."""


class Attempts(Generic[P]):
    """The retry loop and the hold room. ``target`` is set once, by whoever builds it (it
    is given ``freed``, to wake held requests when its requests free a worker)."""

    target: Target[P]
    migration: Migration | None = None  # finishes broken streams elsewhere (None: they end in an error event)

    def __init__(self, metrics: GatewayMetrics, max_retries: int, max_hold_s: float = 0.0,
                 hold_wake: int = 16) -> None:
        self.metrics = metrics
        self.max_retries = max_retries
        self.holds = HoldRoom(max_hold_s, hold_wake)

    async def run(self, request: web.Request, view: RequestView, raw: bytes, body: object) -> web.StreamResponse:
        target, tried = self.target, Tried()
        last: Failure | None = None
        migration, migrates, strip_ids = self.migration, False, False
        if migration is not None:
            migrates, strip_ids, raw = migration.prepare(view, body, raw)
        for n in range(self.max_retries + 1):
            try:
                pick, view = await self.choose(view, lambda v: target.decide(v, tried), first=not n)
            except NoWorkerAvailable:
                break
            if n:
                self.metrics.retries.inc()
            urls = target.urls(pick)
            tried.urls.extend(urls)
            if migration is not None and migrates:
                record = Record(view.route, strip_ids, migration.watch)
                result = await target.attempt(request, view, raw, body, pick, n, sink=record)
                if isinstance(result, Broken):
                    return await migration.resume(self, request, view, raw, result, tried, strip_ids)
            else:
                result = await target.attempt(request, view, raw, body, pick, n)
            if not isinstance(result, Failure):
                return result
            tried.attempts += 1
            if result.timed_out:
                tried.timeouts += 1
                tried.timed_out.extend(urls)
            last = result
            if not result.retryable:
                break
        if last is not None and last.status >= 400:
            return web.Response(status=last.status, body=last.body, content_type=last.content_type,
                                headers={"X-Request-ID": view.request_id})
        if tried.attempts and tried.timeouts == tried.attempts:
            raise target.timed_out(view, tried)
        if tried.attempts:
            raise target.exhausted(view, tried)
        raise target.unavailable(view)

    async def choose(self, view: RequestView, decide: Callable[[RequestView], Awaitable[T | Hold]],
                     first: bool) -> tuple[T, RequestView]:
        """``decide(view)``, holding the request while it answers ``Hold``; the answer, and
        the view as it stands after (``may_hold`` false: the decision is made)."""
        ticket = view.qos
        may_hold = first and self.holds.max_hold_s > 0 and (ticket is None or ticket.hold)
        if view.may_hold is not may_hold:
            view = view.holding(may_hold, view.held_s)
        if ticket is not None and may_hold and self.holds.outranked(ticket):
            result: T | Hold = DEFERRED  # not decided: a decision books its worker
        else:
            result = await decide(view)
        if isinstance(result, Hold):
            got = await self.hold(view, result, decide)
        else:
            if view.may_hold:
                view = view.holding(False, view.held_s)
            got = result, view
        if ticket is not None and first:
            self.holds.dispatched(ticket)
        return got

    async def hold(self, view: RequestView, held: Hold, decide: Callable[[RequestView], Awaitable[T | Hold]]
                   ) -> tuple[T, RequestView]:
        """Keep a held request until ``decide`` answers something other than ``Hold``.

        It is asked again when a routed request reaches its first token or ends (some
        held requests are, see ``HoldRoom``), or after the policy's ``retry_s`` (backing
        off while those retries find no room); past ``max_hold_s`` the request no longer
        ``may_hold`` and the policy must choose."""
        policy = self.target.policy
        if not view.may_hold:
            raise refused_hold(policy)
        room, start, ticket = self.holds, time.monotonic(), view.qos
        self.metrics.held.inc()
        timeout = held.retry_s
        try:
            while True:
                left = room.max_hold_s - (time.monotonic() - start)
                woken = left > 0 and await room.wait(min(timeout, left), ticket)
                held_s = time.monotonic() - start
                view = view.holding(held_s < room.max_hold_s, held_s)
                if not woken and view.may_hold and room.outranked(ticket):
                    room.handover(ticket)  # its retry time is the turn of whoever is first
                    timeout = max(held.retry_s, min(2 * timeout, 1.0))
                    continue
                result = await decide(view)
                if not isinstance(result, Hold):
                    if woken:
                        room.committed(ticket)
                    return result, view.holding(False, held_s)
                if not view.may_hold:
                    raise GatewayError(500, f"policy {policy.name!r} held a request past max_hold_secs",
                                       code="policy_error")
                held = result
                # Held again after its own retry time: the room it was predicted did not come,
                # so it backs off (doubling, to 1 s). Held requests book nothing, so every one
                # is predicted to start soon, and fixed retries of a few ms would cost a
                # decision per held request every few ms; events still wake some at once.
                timeout = held.retry_s if woken else max(held.retry_s, min(2 * timeout, 1.0))
        finally:
            self.metrics.hold_seconds.observe(time.monotonic() - start)

    def freed(self) -> None:
        """A request reached its first token or ended: some held requests are decided again (``HoldRoom``)."""
        if self.holds.held:
            self.holds.notify()
