"""What the gateway, the indexes and the policies all read: a request, a worker, an engine's
load report and how a routed request ended.

The gateway builds these; an index or a policy only reads them. ``WorkerView`` is a
snapshot at routing time and ``RequestView`` what may be known of a request before it is
sent (token ids only where the client sent them or the gateway holds the engine's
tokenizer).

What changes is replaced, never mutated. ``WorkerView`` is frozen: the gateway's registry
holds each worker's current view and replaces it when its health, models, in-flight count,
load or server_info change; every decision is given the current views (a ``Workers`` list,
whose membership token says which urls they are, in which order). So a view a policy
kept (from a hook, from an earlier decision) is what the worker was then, and a policy that
keeps figures per worker keys them by ``url``, not by view. The gateway replaces a
``RequestView`` where its hold state (``may_hold``, ``held_s``) changes between decisions
(``holding``) and changes none it has handed out; it is not frozen only because a frozen
dataclass's ``__init__`` costs four times as much, on every request.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import count
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


@dataclass(slots=True, frozen=True, eq=False)
class WorkerView:
    """A snapshot of one worker, as the gateway sees it at routing time (frozen: see the module).
    Views compare by identity: a replaced view is another snapshot even where its figures are
    the same, and a list of views compares in C, with no field-by-field equality per worker."""

    url: str
    role: str = "unified"  # unified | prefill | decode
    models: frozenset[str] = frozenset()
    healthy: bool = True
    in_flight: int = 0  # requests the gateway has routed there and not yet finished
    load: EngineLoad | None = None
    bootstrap_port: int | None = None
    server_info: Mapping[str, Any] = field(default_factory=dict)

    # The reports contract. ``reports`` counts the views built by ``reported``, the one way
    # to replace a worker's view with a new ``load`` or ``server_info`` (the gateway's
    # registry uses nothing else; its replacements for health, models and in-flight counts
    # keep both objects and count nothing). So a policy that keeps figures per worker
    # (``policies.fleet_backlog``) learns in one read that no report changed since it last
    # looked: while ``WorkerView.reports`` is unchanged, every worker's current view carries
    # the same ``load`` and ``server_info`` objects as the one it read them from. Views built
    # from scratch (a new worker, tests) are new urls or a new list to such a policy; a caller
    # that replaces a report any other way breaks the contract. Neither object is changed
    # inside: a poll builds a new ``EngineLoad``, discovery a new dict.
    reports: ClassVar[int] = 0

    def reported(self, **reports: Any) -> WorkerView:
        """This view with a new ``load`` and/or ``server_info``, counted in ``reports``."""
        if not reports.keys() <= {"load", "server_info"}:
            raise TypeError(f"reported() takes load and server_info, not {sorted(reports)}")
        WorkerView.reports += 1
        return replace(self, **reports)

    def with_in_flight(self, in_flight: int) -> WorkerView:
        """This view with another in-flight count, twice a request (``dataclasses.replace``
        costs ~2.5x as much; tests/test_gateway_attempts.py holds it to every field)."""
        return WorkerView(self.url, self.role, self.models, self.healthy, in_flight, self.load,
                          self.bootstrap_port, self.server_info)

    @property
    def host(self) -> str:
        rest = self.url.split("://", 1)[-1]
        host = rest.split("/", 1)[0]
        return host.rsplit(":", 1)[0].strip("[]") if ":" in host else host


@dataclass(slots=True)
class RequestView:
    """What a policy may know about a request. Token ids are present only when the client
    sent ``input_ids`` or the gateway was given the engine's tokenizer. Never changed once
    handed out (see the module), but for ``packed_ids``, which ``packed`` may fill in once:
    a memo of a pure function of ``token_ids``, carried into the views that replace this one."""

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
    # The client's key for what its requests share: X-Session-ID, else prompt_cache_key, else
    # user (gateway.request.session_key); consistent_hash hashes it, the cache-aware
    # policies follow it to the worker of its last turn (policies.affinity)
    session_key: str | None = None
    stream: bool = False
    max_tokens: int | None = None
    cache_salt: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    may_hold: bool = False  # the gateway accepts ``Hold`` for this decision
    held_s: float = 0.0  # how long the gateway has held this request so far
    qos: Any = None  # the gateway's QoS ticket (gateway.qos.Ticket); None where QoS is off

    def holding(self, may_hold: bool, held_s: float) -> RequestView:
        """This request with a new hold state (``dataclasses.replace`` costs ~7x as much,
        twice a request; tests/test_gateway_attempts.py holds it to every field)."""
        return RequestView(self.request_id, self.route, self.model, self.text, self.token_ids, self.packed_ids,
                           self.session_key, self.stream, self.max_tokens, self.cache_salt, self.headers,
                           may_hold, held_s, self.qos)

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
                packed = self.packed_ids = uint32_le(tokens)  # the memo: see the class
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
class Outcome:
    """How a routed request ended, as reported by the engine where it says so."""

    ok: bool
    status: int = 200
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None


_memberships = count(1)


def new_membership() -> int:
    """A membership token no other list of workers in this process was given (``Workers``)."""
    return next(_memberships)


class Workers(list[WorkerView]):
    """Worker views as the gateway hands them to a policy, with a ``membership`` token that
    names which urls they are, in which order.

    The contract: two ``Workers`` with the same token name the same urls in the same order;
    their views may differ (a view replaced for its in-flight count or a report is the same
    worker). Tokens come from ``new_membership`` and are never reused, so whoever builds
    these lists gives a list of other urls, or of the same in another order, another token
    (a new token for the same urls is allowed: it only costs a comparison of the urls), and
    changes a list in place only by replacing a view with one of the same worker. A cache
    that follows a worker list by its urls (``SameUrls``, ``urls_of``,
    ``policies.fleet_backlog``) then recognises one in a single comparison of tokens: the
    gateway replaces a view whenever its in-flight count moves, so between two decisions
    some view usually was, and the views no longer compare equal by identity. A plain
    list (plugins, tests) is compared by its views and urls, as before. A list derived from
    one (a slice, ``list()``, a copy) is a plain list, without the token."""

    __slots__ = ("membership",)

    def __init__(self, views: Iterable[WorkerView], membership: int) -> None:
        if membership < 1:
            raise ValueError("a membership token comes from new_membership()")
        list.__init__(self, views)
        self.membership = membership


_last: tuple[list[WorkerView], list[str], int] = ([], [], 0)  # views, their urls, and their token (0: none)


def urls_of(workers: Sequence[WorkerView]) -> list[str]:
    """The urls of ``workers``, in order (the caller must not change the list). A decision
    asks for them at several caches (the index, the feed, the backlog rows) with the same
    views, so the last answer is kept: finding it again is a comparison of membership
    tokens (``Workers``), or of the views by identity, in C."""
    global _last
    views, urls, membership = _last
    token = workers.membership if type(workers) is Workers else 0
    if token and token == membership:
        return urls
    if workers == views:
        if token:
            _last = (views, urls, token)
        return urls
    views = list(workers)
    _last = (views, [w.url for w in views], token)
    return _last[1]


class SameUrls:
    """Whether a worker list names the same urls, in the same order, as the last one a cache
    was built for. A ``Workers`` list with the token of the last is known at once; the same
    view objects come back while no in-flight count moved (compared by identity, in C, as a
    benchmark's fixed views always do); otherwise (the gateway replaces a view whenever its
    in-flight count moves) the urls are compared (~1.5 us at 64)."""

    __slots__ = ("views", "urls", "membership")

    def __init__(self) -> None:
        self.views: list[WorkerView] = []
        self.urls: list[str] = []
        self.membership = 0  # the token of a ``Workers`` naming ``urls``; 0: none known

    def changed(self, workers: Sequence[WorkerView]) -> bool:
        """True when ``workers`` name other urls than last time (then they are remembered)."""
        token = workers.membership if type(workers) is Workers else 0
        if token and token == self.membership:
            return False
        views = workers if token or type(workers) is list else list(workers)
        if views == self.views:
            if token:
                self.membership = token
            return False
        self.views = list(views)
        urls = urls_of(workers)
        self.membership = token
        if urls == self.urls:
            return False
        self.urls = urls
        return True
