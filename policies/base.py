"""The routing plugin API.

The gateway builds a ``RequestView`` per request and a ``WorkerView`` per eligible worker,
calls ``Policy.select`` (plain or ``async``), and reports the request's life back through
the ``on_*`` hooks. ``select`` may answer ``Hold`` instead of a ``Choice`` when the request
says it ``may_hold``: the gateway then keeps the request and asks again when a routed
request reaches its first token or finishes (the moments a worker's queue or KV memory
frees), or after ``Hold.retry_s``. Everything a policy learns about the world comes through these calls,
so a policy is testable as a pure function over snapshots and swappable at runtime.

In PD mode a request needs a prefill and a decode worker. The gateway has a prefill policy
and a decode policy (``--prefill-policy``, ``--decode-policy``; prefill defaults to the main
policy, decode to ``least_load``). It asks the prefill policy's ``select_pair`` for both
when that policy serves decode too or overrides ``select_pair`` (it prices the two legs as
one decision, as ``pd_cost`` does, whatever the decode policy is); otherwise each leg is
chosen by its own policy (``select_each``), as the default ``select_pair`` does with one.

A group of gateway processes and replicas shares one routing state (``gateway.peers``):
each policy also hears what its peers routed (``on_peer_routed``) and how those requests
went (the same ``on_first_token`` and ``on_complete``; their request ids end in
``@origin``). A policy whose ``select`` records something (an index insert, a booking
with a hit) records it again there, so every process decides on the whole group's traffic.

Views are snapshots, never changed once given (``index.views``): a worker's view is
replaced when its state moves, and each call gets the current ones, from the gateway in a
``Workers`` list (a list whose ``membership`` token names its urls in order; tests and
tools may pass any sequence).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from index.views import EngineLoad, Outcome, RequestView, WorkerView, Workers
from wire.options import NoOptions, OptionError, opt, parse_options

__all__ = ["Choice", "EngineLoad", "Hold", "NoOptions", "NoWorkerAvailable", "OptionError", "Outcome", "Policy",
           "RequestView", "WorkerView", "Workers", "opt", "require_workers", "select_each", "selects_pairs"]


@dataclass(slots=True)
class Choice:
    """A policy's answer. ``predicted_cached_tokens`` feeds hit verification."""

    worker: WorkerView
    predicted_cached_tokens: int | None = None
    reason: str = ""


@dataclass(slots=True)
class Hold:
    """A policy's answer when no worker can start the request soon (late binding).

    A request sent to a worker now would wait in that worker's queue, bound to it even when
    another frees first; held at the gateway it goes to whichever worker can start it when
    one can. The gateway asks again on a first token or completion anywhere (a few held
    requests are asked, those asked least recently first), or after ``retry_s``, doubling
    while those retries are held again (to 1 s), and stops holding at its
    ``max_hold_secs``."""

    retry_s: float = 0.5
    reason: str = ""


class NoWorkerAvailable(Exception):
    """Raised by ``select`` when no worker can take the request."""


class Policy:
    """Base class for routing policies; subclasses override ``select`` and any hooks.

    ``options`` come from the CLI (``--policy-option key=value``, strings) or the YAML config
    (typed). A policy that declares ``Options`` (a dataclass of ``opt`` fields: default, doc,
    choices) gets them parsed once into ``self.opts``, and an unknown or malformed option is an
    ``OptionError`` at start-up; ``kvgate policies NAME`` prints them. A policy without
    ``Options`` receives them raw in ``self.options``.
    ``needs_engine_load`` asks the gateway to poll engine load for this policy.
    ``shares_routing = False`` tells a group of gateways that this policy reads nothing of past
    routing, not even in-flight counts, so no routing records are published for it (each
    record costs every other process of the group an application).
    ``needs_prompt = False`` tells the gateway this policy never reads ``text`` or
    ``token_ids``, so it can skip the chat template and tokenizer (their cost grows with
    the prompt); the default is to build them.
    """

    name: ClassVar[str] = "policy"
    needs_engine_load: ClassVar[bool] = False
    needs_prompt: ClassVar[bool] = True
    shares_routing: ClassVar[bool] = True
    Options: ClassVar[type | None] = None

    def __init__(self, **options: Any) -> None:
        self.options = options
        self.opts: Any = parse_options(self.Options, options, self.name) if self.Options is not None else None

    def select(self, request: RequestView, workers: Sequence[WorkerView]) -> Choice | Hold | Awaitable[Choice | Hold]:
        """The worker for this request; ``Hold`` only when ``request.may_hold``."""
        raise NotImplementedError

    def select_pair(self, request: RequestView, prefills: Sequence[WorkerView], decodes: Sequence[WorkerView]
                    ) -> tuple[Choice, Choice] | Hold | Awaitable[tuple[Choice, Choice] | Hold]:
        """A (prefill, decode) pair for one PD request, or ``Hold`` (only when
        ``request.may_hold``; nothing is booked then, and the whole pair is decided again).

        The default is two ``select`` calls (``select_each`` with this policy for both legs):
        the prefill first, its ``Hold`` answered as is, then the decode on the request as not
        ``may_hold`` (the prefill is chosen: the decode must follow). Raises
        ``NoWorkerAvailable`` as ``select`` does. Override it to price both legs together;
        the gateway then asks this policy for every pair (see the module)."""
        return select_each(self, self, request, prefills, decodes)

    def predicted_ttft(self, request: RequestView, workers: Sequence[WorkerView]) -> float | None:
        """Seconds to this request's first token on the best of ``workers`` if it were sent
        now, or None when the policy cannot tell (the default). Books nothing; the gateway
        reads it for priority classes with a TTFT objective (``gateway.qos``)."""
        return None

    # Lifecycle hooks: the defaults do nothing, so simple policies stay simple.
    def on_routed(self, request: RequestView, worker: WorkerView) -> None: ...

    def on_peer_routed(self, request: RequestView, worker: WorkerView, cached_tokens: int | None) -> None:
        """Another gateway process or replica of the group routed ``request`` to ``worker``,
        its policy expecting ``cached_tokens`` to hit (its ``Choice``; None when no policy
        chose it for a prefix, as a PD decode leg). Record what this policy's ``select``
        would have recorded had it made that choice, then book it as ``on_routed``; the
        request's ``on_first_token`` and ``on_complete`` follow as for one routed here. The
        default books it (``on_routed``)."""
        self.on_routed(request, worker)

    def on_withdrawn(self, request: RequestView, worker: WorkerView) -> None:
        """``select``'s choice of ``worker`` will not be used: the gateway asks again (a
        group's claim on it was lost to a peer's, ``gateway.claims``). Undo what ``select``
        recorded for it, so that the next ``select`` does not take it for a cache hit. The
        default does nothing."""

    def on_first_token(self, request: RequestView, worker: WorkerView) -> None:
        """At a stream's first chunk; for a response that is not streamed, when the whole
        answer has arrived (so its time includes the decode)."""

    def on_complete(self, request: RequestView, worker: WorkerView, outcome: Outcome) -> None: ...

    def on_worker_added(self, worker: WorkerView) -> None:
        """A worker joined the fleet this policy routes (before any ``select`` sees it)."""

    def on_worker_updated(self, worker: WorkerView) -> None:
        """A newer view of a known worker: its ``server_info`` was read again, or the KV
        capacity its load report states changed. Per-decision inputs (load, in-flight) do
        not call this; ``select`` is given them."""

    def on_worker_removed(self, worker: WorkerView) -> None: ...

    async def start(self) -> None:
        """Open background resources (subscriptions, timers) once the event loop runs."""

    async def stop(self) -> None:
        """Release what ``start`` opened."""

    def stats(self) -> Mapping[str, float]:
        """Numbers worth exporting as metrics (index size, drift, ...)."""
        return {}


def require_workers(workers: Sequence[WorkerView]) -> None:
    if not workers:
        raise NoWorkerAvailable("no healthy worker can serve this request")


def selects_pairs(prefill: Policy, decode: Policy) -> bool:
    """Whether the gateway asks ``prefill.select_pair`` for both legs: when one policy serves
    both, or when the prefill policy prices pairs itself (overrides ``select_pair``)."""
    return prefill is decode or type(prefill).select_pair is not Policy.select_pair


async def select_each(prefill: Policy, decode: Policy, request: RequestView, prefills: Sequence[WorkerView],
                      decodes: Sequence[WorkerView]) -> tuple[Choice, Choice] | Hold:
    """The prefill leg by ``prefill.select``, then the decode leg by ``decode.select`` (plain
    or async, either). A prefill ``Hold`` is the answer; the decode is asked with
    ``may_hold`` false, and a ``Hold`` from it is returned in the pair's second place for
    the caller to refuse (a plugin bug, not a decision)."""
    p: Any = prefill.select(request, prefills)
    if type(p) is not Choice and inspect.isawaitable(p):
        p = await p
    if isinstance(p, Hold):  # nothing is booked yet: the decode leg is chosen with it later
        return p
    d: Any = decode.select(request.holding(False, request.held_s) if request.may_hold else request, decodes)
    if type(d) is not Choice and inspect.isawaitable(d):
        d = await d
    return p, d
