"""Each worker's backlog as ``cost`` prices it, kept from one decision to the next.

Every decision needs every worker's queue wait and decode load, since the cheapest miss is
the least backlog. Recomputing them from this gateway's bookings and the engines' reports
was half of a decision with 64 workers (~30 us of ~75, bench/decision_cost.py). Between two
decisions almost none of it changes: a routing, a first token or a completion moves one
worker's bookings, a load poll replaces one worker's report. So a worker's row is computed
when one of those changes, and a decision reads the rows and re-prices only what moves with
the clock: a queue that is still draining (the booked one, and an engine-reported one with
``engine_load=drain``: a row keeps when it is done, and a decision subtracts the clock), and
the KV wait on the few workers the request would not fit on (left to ``cost``'s pricer, which
reads the ledger's release schedules; ``Fleet.tight`` finds those workers by bisection).

The engine's waiting requests are priced at ``cost``'s average prefill per request as it
was when this worker's report was first seen (``avg``), not as it drifts after every
routing: the report counts requests queued before it, and the drift would otherwise touch
every row on every decision.

A decision reads the workers' reports only when some view's was replaced since the last
(``WorkerView.reports``, contract in ``index.views``), to find which: the poller replaces
a few a second, decisions come hundreds of times as often. With a gateway's traffic between decisions the saving shrinks
(bench/RESULTS.md, "Routing decision cost"): a decision recomputes the rows its traffic
changed.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress, count
from operator import attrgetter, is_not

from index.views import Workers, urls_of
from policies.base import EngineLoad, WorkerView

_load = attrgetter("load")
_INF = float("inf")
_NO_INFO: Mapping = {}


@dataclass(slots=True)
class Booked:
    """What this gateway has sent one worker and not yet seen finish."""

    queued: float = 0.0  # prefill work before first tokens, in linear-token equivalents
    done: float = -float("inf")  # when that work is expected done: it drains at the prefill rate
    decoding: int = 0  # requests past their first token
    kv: float = 0.0  # KV tokens its live requests hold (sum of their footprints)


IDLE = Booked()  # read-only stand-in for a worker with nothing booked


@dataclass(slots=True)
class Pricing:
    """What turns bookings and reports into seconds (``cost``'s constants)."""

    inv_prefill: float  # 1 / prefill tokens per second, the factor every wait is computed with
    decode_cost_s: float
    engine_load: str  # drain | max | off
    memory: bool


@dataclass(slots=True, eq=False)
class Fleet:
    """The rows of one list of workers, by position in it.

    ``wait`` and ``base`` (wait + decode) are the settled values, what does not drain (an
    engine's queue as reported with ``engine_load=max``); for a position in ``draining`` a
    queue that drains with the clock (the booked one, or the engine's as reported with
    ``engine_load=drain``) still exceeds that at the last decision, and the decision's wait
    there is ``done - now``."""

    views: list[WorkerView]
    urls: list[str]
    pos: dict[str, int]
    loads: list[EngineLoad | None]
    infos: list[Mapping]  # server_info each row read its capacity from (see ``from_info``)
    queued: list[float]
    done: list[float]  # when the engine's reported queue drains at the prefill rate
    until: list[float]  # about when that falls to the settled wait; inf where not draining
    decode: list[float]
    kv: list[float]
    cap: list[float]  # KV capacity, 0 where no KV wait is priced
    wait: list[float]
    base: list[float]
    draining: set[int] = field(default_factory=set)
    headroom: list[tuple[float, int]] = field(default_factory=list)  # (cap - kv, position), sorted
    room: list[float] = field(default_factory=list)  # headroom's first items, to bisect on floats
    busy: int = 0  # settled positions with a wait
    from_info: set[int] = field(default_factory=set)  # capacity from server_info (no load figure)
    dirty: set[str] = field(default_factory=set)  # urls whose bookings changed
    now: float = float("-inf")  # the last decision's clock
    reports: int = -1  # ``WorkerView.reports`` when the rows last read the reports; -1: read them every time
    membership: int = 0  # the token of the last ``Workers`` naming these urls (``index.views``); 0: none

    def tight(self, need: float) -> list[tuple[float, int]]:
        """Positions with less KV room than ``need`` (and a few just above, for rounding)."""
        return self.headroom[:bisect_left(self.room, need + 1.0)]


class FleetBacklog:
    """Rows for the last few worker lists (``max_fleets``: unified workers, PD prefills),
    refreshed on each decision from what changed since the last."""

    def __init__(self, pricing: Pricing, book: Mapping[str, Booked], avg: Callable[[], float],
                 max_fleets: int = 4) -> None:
        self.pricing = pricing
        self.book = book
        self.avg = avg
        self.max_fleets = max_fleets
        self._fleets: list[Fleet] = []
        # url -> (report, avg prompt and booked KV when it was first seen)
        self._seen: dict[str, tuple[EngineLoad, float, float]] = {}

    def touch(self, url: str) -> None:
        """``url``'s bookings changed."""
        for fleet in self._fleets:
            fleet.dirty.add(url)

    def reprice(self) -> None:
        """The pricing changed: every row is recomputed at its next decision."""
        for fleet in self._fleets:
            fleet.dirty.update(fleet.urls)

    def fleet(self, workers: Sequence[WorkerView], now: float) -> Fleet:
        """The rows of ``workers``, current as of ``now``."""
        fleets = self._fleets
        token = workers.membership if type(workers) is Workers else 0
        fleet: Fleet | None
        if token and fleets and fleets[0].membership == token:  # the last list's urls (``_find``)
            fleet = fleets[0]
            fleet.views = list(workers)  # its current views: rows read their reports there
        else:
            fleet = self._find(workers, token)
        if fleet is None or now < fleet.now:  # a new list, or a clock that went back
            if fleet is not None:
                self._fleets.remove(fleet)
            fleet = self._build(list(workers))  # a copy: the caller may reuse its list
            fleet.membership = token
            self._fleets.insert(0, fleet)
            del self._fleets[self.max_fleets:]
        else:
            if fleet.reports != WorkerView.reports:  # some report was replaced (or views not counted: -1)
                if fleet.reports >= 0:
                    fleet.reports = WorkerView.reports
                loads = list(map(_load, fleet.views))
                if loads != fleet.loads:  # a poll replaced some (equal ones count as unchanged)
                    for i in compress(count(), map(is_not, loads, fleet.loads)):
                        self._row(fleet, i)
                if fleet.from_info:
                    for i in [i for i in fleet.from_info if fleet.views[i].server_info is not fleet.infos[i]]:
                        self._row(fleet, i)
            if fleet.dirty:
                if len(fleet.pos) == len(fleet.urls):
                    for url in fleet.dirty:
                        i = fleet.pos.get(url)
                        if i is not None:
                            self._row(fleet, i)
                else:  # a url listed twice: each of its places
                    for i in [i for i, url in enumerate(fleet.urls) if url in fleet.dirty]:
                        self._row(fleet, i)
                fleet.dirty.clear()
        fleet.now = now
        if fleet.draining and min(fleet.until) <= now + 1e-6:  # some may have drained (in C)
            for i in [i for i in fleet.draining if fleet.done[i] - now <= fleet.wait[i]]:
                fleet.draining.discard(i)  # drained to what does not drain: settled
                fleet.until[i] = _INF
                if fleet.wait[i] > 0.0:
                    fleet.busy += 1
        return fleet

    def _find(self, workers: Sequence[WorkerView], token: int) -> Fleet | None:
        """The fleet of ``workers``' urls (moved first: most recently used first), now with
        their views, where rows read the reports; None for a new list.

        A fleet is the list of urls. A ``Workers`` list is found by its membership token
        (``token``, ``index.views``), in one comparison per fleet; otherwise the same views
        as last time are found by identity, in C, and failing that (the gateway replaces a
        worker's view whenever its in-flight count moves) the urls say which fleet it is. The
        rows stay right whichever views come: bookings come through ``touch``, reports are
        counted."""
        fleets = self._fleets
        if token:
            for fleet in fleets:
                if fleet.membership == token:
                    if fleet is not fleets[0]:
                        fleets.remove(fleet)
                        fleets.insert(0, fleet)
                    fleet.views = list(workers)  # a copy: the caller may reuse its list
                    return fleet
        views = workers if token or type(workers) is list else list(workers)
        if fleets and fleets[0].views == views:
            found: Fleet | None = fleets[0]
        else:
            urls = urls_of(workers)
            found = next((f for f in fleets if f.urls == urls), None)
            if found is not None:
                fleets.remove(found)
                fleets.insert(0, found)
                found.views = list(views)
        if found is not None and token:
            found.membership = token
        return found

    def _build(self, views: list[WorkerView]) -> Fleet:
        n = len(views)
        urls = [w.url for w in views]
        pos: dict[str, int] = {}
        for i, url in enumerate(urls):
            pos.setdefault(url, i)  # a url listed twice: its first place, as hits are found
        fleet = Fleet(views, urls, pos, [None] * n, [_NO_INFO] * n, [0.0] * n, [0.0] * n, [_INF] * n,
                      [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n)
        if all(isinstance(w, WorkerView) for w in views):  # (others' replacements are not counted)
            fleet.reports = WorkerView.reports
        for i in range(n):
            self._row(fleet, i, fresh=True)
        return fleet

    def _row(self, fleet: Fleet, i: int, fresh: bool = False) -> None:
        """Recompute position ``i`` from its worker's bookings and report (the arithmetic
        ``cost`` priced every worker with on every decision)."""
        p = self.pricing
        w = fleet.views[i]
        url, load = w.url, w.load
        if not fresh:  # take the old row out of the aggregates
            if i in fleet.draining:
                fleet.draining.discard(i)
                fleet.until[i] = _INF
            elif fleet.wait[i] > 0.0:
                fleet.busy -= 1
            if fleet.cap[i]:
                at = bisect_left(fleet.headroom, (fleet.cap[i] - fleet.kv[i], i))
                del fleet.headroom[at], fleet.room[at]
        book = self.book.get(url, IDLE)
        queued, running, kv, capacity = book.queued, book.decoding, book.kv, 0
        done = book.done if queued > 0.0 else -_INF  # the booked queue drains with the clock
        wait = 0.0  # what does not drain: an engine's queue as reported, with engine_load=max
        if load is not None:
            seen = self._seen.get(url)
            if seen is None or (seen[0] is not load and seen[0] != load):  # a new report (by value)
                seen = self._seen[url] = (load, self.avg(), kv)
            if p.engine_load != "off":  # traffic this gateway did not route still occupies the engine
                backlog = load.waiting * seen[1]
                if p.engine_load == "drain":  # drains from the report's time, like the booked queue
                    if backlog > 0.0:
                        engine_done = load.timestamp + backlog * p.inv_prefill
                        if engine_done > done:
                            done = engine_done
                else:
                    wait = backlog * p.inv_prefill
                if load.running > running:
                    running = load.running
            capacity = load.max_tokens
            # The engine's count (shared prefixes once) plus what was booked or released here
            # since it was read; a booking counts only the KV it adds (``Ledger.routed``), so
            # alone it misses the prefixes it locks.
            reported = load.used_tokens + kv - seen[2]
            if reported > kv:
                kv = reported
        fleet.from_info.discard(i)
        if kv and p.memory:  # nothing held: nothing to wait for
            if not capacity:
                fleet.infos[i] = w.server_info
                fleet.from_info.add(i)
                capacity = w.server_info.get("max_total_num_tokens") or 0
        else:
            capacity = 0
        decode = running * p.decode_cost_s
        fleet.loads[i] = load
        fleet.queued[i], fleet.done[i] = queued, done
        fleet.decode[i], fleet.kv[i], fleet.cap[i] = decode, kv, capacity
        fleet.wait[i], fleet.base[i] = wait, wait + decode
        if done > -_INF:  # the next decision checks whether it has drained yet
            fleet.draining.add(i)
            fleet.until[i] = done - wait
        elif wait > 0.0:
            fleet.busy += 1
        if capacity:
            at = bisect_left(fleet.headroom, (capacity - kv, i))
            fleet.headroom.insert(at, (capacity - kv, i))
            fleet.room.insert(at, capacity - kv)
