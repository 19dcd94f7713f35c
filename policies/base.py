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
from dataclasses import dataclass, field
from typing import Any, ClassVar

from wire.hashing import uint32_le


@dataclass(slots=True)
class EngineLoad:
    """What the engine itself reports (``/get_load`` or ``/v1/loads``), summed over DP ranks."""

    running: int = 0
    waiting: int = 0
    used_tokens: int = 0
    max_tokens: int = 0
    timestamp: float = 0.0

    @property
    def token_usage(self) -> float:
        return self.used_tokens / self.max_tokens if self.max_tokens else 0.0


@dataclass(slots=True)
class WorkerView:
    """A read-only snapshot of one worker, as the gateway sees it at routing time."""

    url: str
    role: str = "unified"  # unified | prefill | decode
    models: frozenset[str] = frozenset()
    healthy: bool = True
    in_flight: int = 0  # requests the gateway has routed there and not yet finished
    load: EngineLoad | None = None
    bootstrap_port: int | None = None
    server_info: Mapping[str, Any] = field(default_factory=dict)

    # Bumped whenever any view's ``load`` or ``server_info`` is replaced, so a policy that
    # keeps figures per worker (``policies.fleet_backlog``) learns in one read that no
    # report changed since it last looked, instead of reading every worker's on every
    # decision. Changes made inside either object are not counted: the gateway's poller
    # replaces them whole.
    reports: ClassVar[int] = 0

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name == "load" or name == "server_info":
            WorkerView.reports += 1

    @property
    def host(self) -> str:
        rest = self.url.split("://", 1)[-1]
        host = rest.split("/", 1)[0]
        return host.rsplit(":", 1)[0].strip("[]") if ":" in host else host


@dataclass(slots=True)
class RequestView:
    """What a policy may know about a request. Token ids are present only when the client
    sent ``input_ids`` or the gateway was given the engine's tokenizer."""

    request_id: str
    route: str
    model: str | None = None
    text: str | None = None
    # The prompt's ids: a list, or array("I") for ids a client sent (the gateway reads them
    # without building an int per id, wire.prefix_ids); index, slice, iterate or pack it.
    token_ids: Sequence[int] | None = None
    # token_ids as uint32 little-endian where the gateway had them so (its tokenizer's reused
    # prefix, or a client's id list read with a recent one's: wire.prefix_tokens,
    # wire.prefix_ids), so that an index need not pack them again (``packed``)
    packed_ids: bytes | None = None
    session_key: str | None = None
    stream: bool = False
    max_tokens: int | None = None
    cache_salt: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    may_hold: bool = False  # the gateway accepts ``Hold`` for this decision
    held_s: float = 0.0  # how long the gateway has held this request so far

    def packed(self) -> bytes | None:
        """``token_ids`` as uint32 little-endian (None if some id is no uint32): ``packed_ids``
        where they are these ids, else packed now and left there. A request the gateway holds
        is decided again at later first tokens and completions, with other requests'
        decisions in between; it packs its prompt once, not each time (~6 ns a token: 0.8 ms
        for the trace's longest prompts, which are the ones held longest)."""
        tokens = self.token_ids or []
        packed = self.packed_ids
        if packed is None or len(packed) != 4 * len(tokens):
            try:
                packed = self.packed_ids = uint32_le(tokens)
            except (OverflowError, TypeError):
                return None
        return packed

    @property
    def prompt_tokens_estimate(self) -> int:
        if self.token_ids is not None:
            return len(self.token_ids)
        # ~4 bytes per token for BPE tokenizers; exact for the byte tokenizer's callers
        # who pass token_ids anyway.
        return len(self.text or "") // 4


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


@dataclass(slots=True)
class Outcome:
    """How a routed request ended, as reported by the engine where it says so."""

    ok: bool
    status: int = 200
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None


class NoWorkerAvailable(Exception):
    """Raised by ``select`` when no worker can take the request."""


class Policy:
    """Base class for routing policies; subclasses override ``select`` and any hooks.

    ``options`` come from the CLI (``--policy-option key=value``) or the YAML config.
    ``needs_engine_load`` asks the gateway to poll engine load for this policy.
    ``needs_prompt = False`` tells the gateway this policy never reads ``text`` or
    ``token_ids``, so it can skip the chat template and tokenizer (their cost grows with
    the prompt); the default is to build them.
    """

    name: ClassVar[str] = "policy"
    needs_engine_load: ClassVar[bool] = False
    needs_prompt: ClassVar[bool] = True

    def __init__(self, **options: Any) -> None:
        self.options = options

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
