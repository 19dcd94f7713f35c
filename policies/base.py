"""The routing plugin API.

The gateway builds a ``RequestView`` per request and a ``WorkerView`` per eligible worker,
calls ``Policy.select`` (plain or ``async``), and reports the request's life back through
the ``on_*`` hooks. ``select`` may answer ``Hold`` instead of a ``Choice`` when the request
says it ``may_hold``: the gateway then keeps the request and asks again when a routed
request reaches its first token or finishes (the moments a worker's queue or KV memory
frees), or after ``Hold.retry_s``. Everything a policy learns about the world comes through these calls,
so a policy is testable as a pure function over snapshots and swappable at runtime.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from index.views import EngineLoad, Outcome, RequestView, WorkerView
from wire.options import NoOptions, OptionError, opt, parse_options

__all__ = ["Choice", "EngineLoad", "Hold", "NoOptions", "NoWorkerAvailable", "OptionError", "Outcome", "Policy",
           "RequestView", "WorkerView", "opt", "require_workers"]


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
    ``needs_prompt = False`` tells the gateway this policy never reads ``text`` or
    ``token_ids``, so it can skip the chat template and tokenizer (their cost grows with
    the prompt); the default is to build them.
    """

    name: ClassVar[str] = "policy"
    needs_engine_load: ClassVar[bool] = False
    needs_prompt: ClassVar[bool] = True
    Options: ClassVar[type | None] = None

    def __init__(self, **options: Any) -> None:
        self.options = options
        self.opts: Any = parse_options(self.Options, options, self.name) if self.Options is not None else None

    def select(self, request: RequestView, workers: Sequence[WorkerView]) -> Choice | Hold | Awaitable[Choice | Hold]:
        """The worker for this request; ``Hold`` only when ``request.may_hold``."""
        raise NotImplementedError

    # Lifecycle hooks: the defaults do nothing, so simple policies stay simple.
    def on_routed(self, request: RequestView, worker: WorkerView) -> None: ...

    def on_first_token(self, request: RequestView, worker: WorkerView) -> None:
        """At a stream's first chunk; for a response that is not streamed, when the whole
        answer has arrived (so its time includes the decode)."""

    def on_complete(self, request: RequestView, worker: WorkerView, outcome: Outcome) -> None: ...

    def on_worker_added(self, worker: WorkerView) -> None: ...

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
