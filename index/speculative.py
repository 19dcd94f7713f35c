"""Speculative entries of the precise index: a routed request's pages, until its events come.

They cover the time between routing a request and the engine's ``BlockStored`` arriving:
``record`` marks the request's pages the worker was not already known to hold as on its GPU
(its three bits in the run's ``spec`` list) until ``ttl_s`` seconds from now, and ``expire``
clears the entries whose time has come and trims from the trie what no block names.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from itertools import repeat
from operator import and_, or_

from index.block_masks import _combine
from index.page_trie import Path, Run, grow, trim


class Speculative:
    """Per-slot speculative bits on trie runs, with their expiry times and queue."""

    def __init__(self, ttl_s: float, roots: dict[tuple[int, str | None], Run],
                 lru: OrderedDict[Run, None] | None, root: Callable[[int, str | None], Run]) -> None:
        self.ttl_s = float(ttl_s)
        self.runs: dict[int, set[Run]] = {}  # slot -> runs holding its speculative bits
        self.queue: deque[tuple[float, int, list[tuple[Run, int, int]]]] = deque()
        self._roots, self._lru, self._root = roots, lru, root  # the index's, for trimming and new pages

    def record(self, s: int, walked: tuple[bytes, Path, Run | None, int], page_size: int, salt: str | None,
               skip: int) -> tuple[float, int, list[tuple[Run, int, int]]] | None:
        """Slot ``s`` holds the walked prompt's pages past its first ``skip`` on GPU for
        ``ttl_s``, the pages the trie lacks added past the walk's end (``walked``: packed ids,
        path, end run and offset, as ``page_trie.walk``). Returns the record (for ``retract``), or
        None where no page was marked."""
        packed, path, end, at = walked
        width = 4 * page_size
        pages = len(packed) // width
        if not pages or skip >= pages:
            return None
        ranges: list[tuple[Run, int, int]] = []
        done = 0
        for run, n in path:
            if skip < done + n:
                ranges.append((run, max(0, skip - done), n))
            done += n
        if done < pages:
            if end is None:
                end, at = self._root(page_size, salt), 0
            # (not put in the eviction order: pages no block names yet do not count against the
            # budget, and expire on their own; a store that names them puts their run in it)
            run, first = grow(end, at, packed[done * width: pages * width])
            ranges.append((run, first + max(0, skip - done), first + pages - done))
        until = time.monotonic() + self.ttl_s
        bits = 7 << (3 * s)
        runs = self.runs.setdefault(s, set())
        for run, a, b in ranges:
            if a >= b:
                continue
            if run.spec is None and run.until is None and not a and b == len(run.masks):  # new pages, grown above
                run.spec, run.until, run.spec_flat = [bits] * b, {s: [until] * b}, b
                runs.add(run)
                continue
            _combine(run.spec_list(), a, b, or_, bits)
            run.spec_changed(a, b)
            if run.until is None:
                run.until = {}
            times = run.until.get(s)
            if times is None:
                times = run.until[s] = [0.0] * b
            elif len(times) < b:
                times.extend(repeat(0.0, b - len(times)))
            times[a:b] = repeat(until, b - a)
            runs.add(run)
        entry = (until, s, ranges)
        self.queue.append(entry)
        return entry

    def expire(self, now: float | None = None, limit: int | None = None) -> int:
        """Clear the recorded entries due by ``now`` (at most ``limit`` records); returns how
        many records were taken off the queue."""
        now = time.monotonic() if now is None else now
        q = self.queue
        taken = 0
        while q and q[0][0] <= now and limit != 0:
            limit = None if limit is None else limit - 1
            self._clear(q.popleft())
            taken += 1
        return taken

    def _clear(self, entry: tuple[float, int, list[tuple[Run, int, int]]]) -> None:
        """Clear one record's bits, but on pages a later record refreshed."""
        until, s, ranges = entry
        clear = ~(7 << (3 * s))
        for run, a, b in ranges:
            times = run.until.get(s) if run.until else None
            spec = run.spec
            if times is None or spec is None:
                continue  # the worker was cleared since
            b = min(b, len(times), len(spec))
            if a >= b:
                continue
            if times[a:b].count(until) == b - a:  # not refreshed by a later request: all at once
                _combine(spec, a, b, and_, clear)
                times[a:b] = repeat(0.0, b - a)
                run.spec_changed(a, b)
            else:
                for i in range(a, b):
                    if times[i] == until:
                        times[i] = 0.0
                        spec[i] &= clear
                run.spec_changed(a)
            if not any(times):
                self.done(run, s)
            if not any(spec):
                run.spec = None
            trim(run, self._roots, self._lru)

    def retract(self, entry: tuple[float, int, list[tuple[Run, int, int]]]) -> None:
        """Clear what ``record`` returned before its time (its queue entry then clears nothing)."""
        self._clear(entry)

    def done(self, run: Run, s: int) -> None:
        """Slot ``s`` has no speculative page left on ``run``."""
        del run.until[s]  # type: ignore[index]
        self.runs.get(s, set()).discard(run)
        if not run.until:
            run.until = None

    def clear_slot(self, s: int, keep: int) -> None:
        """Drop every speculative entry of slot ``s`` (``keep``: the mask that clears its bits)."""
        for run in self.runs.pop(s, ()):
            if run.until is None or run.until.pop(s, None) is None:
                continue
            if not run.until:
                run.until = None
            if run.spec is not None:
                _combine(run.spec, 0, len(run.spec), and_, keep)  # (equal bits stay equal: spec_flat holds)
                if not any(run.spec):
                    run.spec = None
            trim(run, self._roots, self._lru)

    def pages(self) -> int:
        """Pages carrying some worker's speculative bits (counted, for stats and tests)."""
        runs = set().union(*self.runs.values()) if self.runs else set()
        return sum(len(r.spec) - r.spec.count(0) for r in runs if r.spec is not None)
