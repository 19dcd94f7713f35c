"""When one worker's booked KV comes back: the schedule ``cost`` prices a KV wait from.

On a saturated fleet every decision asks every worker "how long until ``over`` more KV
tokens are free?". Sorting the worker's live requests by expected end for each question
cost 0.4 ms a decision at 32 running per worker and 2.2 ms at 256 (bench/decision_cost.py
``--live``). The ends only move when a request is booked, reaches its first token or ends,
or the worker's time per token is re-measured; so they are kept sorted, with running sums of
the KV they free (a booking change moves one entry, a new time per token re-sorts), and a
question is a few bisections.

A request past its first token ends at a fixed time: first token + expected output x time
per token. One still queued ends that long after its first token, which is ``queue_wait``
from now, a figure each decision computes afresh: so the two kinds are kept apart, the
queued ones by output alone, and combined at question time.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from itertools import accumulate
from typing import Protocol

_INF = float("inf")


class Booking(Protocol):
    """What the schedule reads of a live request (``policies.cost_ledger.Live``)."""

    footprint: float  # KV tokens it holds
    output: float  # output tokens expected
    first_token_at: float | None


class KvReleases:
    """One worker's live requests and, sorted on demand, when their KV is expected back.

    Sorted once per change of the worker's time per token (each completion there re-measures
    it); a booking, first token or completion in between moves one entry in place."""

    __slots__ = ("lives", "_tpot", "_started", "_queued")

    def __init__(self) -> None:
        self.lives: dict[str, Booking] = {}
        self._tpot: float | None = None  # the time per token the sort used; None: stale
        self._started = _Run([], [])  # started requests by expected end
        self._queued = _Run([], [])  # queued requests by end - their first token

    def add(self, request_id: str, live: Booking) -> None:
        self.lives[request_id] = live
        if self._tpot is not None:
            self._run(live).insert(self._key(live), live.footprint)

    def pop(self, request_id: str) -> Booking | None:
        live = self.lives.pop(request_id, None)
        if live is not None and self._tpot is not None:
            if not self._run(live).remove(self._key(live), live.footprint):
                self._tpot = None
        return live

    def started(self, live: Booking) -> None:
        """``live`` (booked here) has just reached its first token: its end is now fixed."""
        if self._tpot is not None:
            if self._queued.remove(live.output * self._tpot, live.footprint):
                self._started.insert(self._key(live), live.footprint)
            else:
                self._tpot = None

    def _run(self, live: Booking) -> _Run:
        return self._queued if live.first_token_at is None else self._started

    def _key(self, live: Booking) -> float:
        """Its place in its run; the same arithmetic as ``_sort``, so removal finds it."""
        assert self._tpot is not None
        if live.first_token_at is None:
            return live.output * self._tpot
        return live.first_token_at + live.output * self._tpot

    def _sort(self, tpot: float) -> None:
        started = [live for live in self.lives.values() if live.first_token_at is not None]
        queued = [live for live in self.lives.values() if live.first_token_at is None]
        self._started = _Run.of([live.first_token_at + live.output * tpot for live in started], started)
        self._queued = _Run.of([live.output * tpot for live in queued], queued)
        self._tpot = tpot

    def wait(self, over: float, now: float, queue_wait: float, tpot: float) -> float:
        """Seconds until ``over`` more KV tokens are free than now (if never that many: until
        the last expected end), the queued requests reaching their first token
        ``queue_wait`` from now."""
        if self._tpot != tpot:
            self._sort(tpot)
        ends, offsets, start = self._started.keys, self._queued.keys, now + queue_wait
        i = bisect_left(self._started.sums(), over)
        if i < len(ends):  # started requests alone free enough by ends[i]
            best = ends[i]
            if offsets and start + offsets[0] < best:  # but some queued request ends sooner
                best = self._with_queued(over, start, best)
        elif not offsets:  # never enough: everything booked has to end
            best = ends[-1] if ends else now
        else:
            best = self._with_queued(over, start, _INF)
            if best == _INF:
                best = start + offsets[-1] if not ends or start + offsets[-1] > ends[-1] else ends[-1]
        return best - now if best > now else 0.0

    def first(self, now: float, queue_wait: float, tpot: float) -> float:
        """Seconds until the first booked request is expected to end: no KV comes back
        sooner, so ``wait`` is at least this for any ``over`` > 0 (a bound that costs two
        reads, where ``wait`` walks the schedule)."""
        if self._tpot != tpot:
            self._sort(tpot)
        ends, offsets = self._started.keys, self._queued.keys
        best = ends[0] if ends else now  # (nothing booked: nothing to wait for, as in ``wait``)
        if offsets and (not ends or now + queue_wait + offsets[0] < best):
            best = now + queue_wait + offsets[0]
        return best - now if best > now else 0.0

    def _with_queued(self, over: float, start: float, alone: float) -> float:
        """The earliest time by which, for some k >= 1, the k earliest-ending queued
        requests have ended and started ones have freed the rest (``alone``: k = 0).

        As k grows the queued part ends later and the started part earlier, so the best
        k is at or just before the first k where the queued part ends no earlier, found
        by bisection."""
        ends, freed, offsets, qfreed = self._started.keys, self._started.sums(), self._queued.keys, self._queued.sums()
        n = len(ends)
        if not n:  # queued requests alone
            j = bisect_left(qfreed, over)
            return start + offsets[j] if j < len(offsets) else _INF
        lo, hi = 1, len(offsets)
        while lo < hi:
            mid = (lo + hi) // 2
            need = over - qfreed[mid - 1]
            i = bisect_left(freed, need) if need > 0.0 else -1  # -1: the queued ones suffice
            if i < 0 or (i < n and start + offsets[mid - 1] >= ends[i]):
                hi = mid
            else:
                lo = mid + 1
        best = alone
        for k in range(max(lo - 1, 1), lo + 1):
            need = over - qfreed[k - 1]
            finish = start + offsets[k - 1]
            if need > 0.0:
                i = bisect_left(freed, need)
                if i >= n:  # the started ones cannot free the rest
                    continue
                if ends[i] > finish:
                    finish = ends[i]
            if finish < best:
                best = finish
        return best


class _Run:
    """Keys ascending, the KV each entry frees, and their running sums (made on demand)."""

    __slots__ = ("keys", "footprints", "_sums")

    def __init__(self, keys: list[float], footprints: list[float]) -> None:
        self.keys, self.footprints = keys, footprints
        self._sums: list[float] | None = None

    @classmethod
    def of(cls, keys: list[float], lives: list[Booking]) -> _Run:
        """Sorting indices by a float key is ~1.5x faster than sorting (key, footprint)
        tuples, and at 256 live requests this sort is most of what a re-measured time per
        token costs."""
        order = sorted(range(len(keys)), key=keys.__getitem__)
        return cls([keys[i] for i in order], [lives[i].footprint for i in order])

    def sums(self) -> list[float]:
        if self._sums is None:
            self._sums = list(accumulate(self.footprints))
        return self._sums

    def insert(self, key: float, footprint: float) -> None:
        i = bisect_right(self.keys, key)
        self.keys.insert(i, key)
        self.footprints.insert(i, footprint)
        self._sums = None

    def remove(self, key: float, footprint: float) -> bool:
        """Remove one entry (key, footprint); False if there is none (the caller re-sorts)."""
        keys, footprints = self.keys, self.footprints
        i = bisect_left(keys, key)
        while i < len(keys) and keys[i] == key:
            if footprints[i] == footprint:
                del keys[i], footprints[i]
                self._sums = None
                return True
            i += 1
        return False
