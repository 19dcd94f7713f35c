"""Worker slots of the precise index: which bits of a page's mask are whose.

Every worker url gets a slot (freed slots are reused); slot ``s`` owns bits ``3*s`` to
``3*s+2`` of every mask (see ``index.block_masks``). Per slot it keeps the raw tier bits of
each block hash the worker reported (``owned``: used to update masks, and its size is the
worker's size), the mask that clears its bits and ``_CUMULATIVE`` shifted into place. Page
sizes per worker and the candidate groups a match asks for (cached per worker set, and
invalidated by ``version``) live here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

from index.block_masks import _CUMULATIVE
from index.views import WorkerView

_url = attrgetter("url")


class WorkerSlots:
    """Slots, per-slot bits and page sizes of the workers an index has heard of."""

    def __init__(self, default_page_size: int = 1) -> None:
        self.default_page_size = int(default_page_size)
        self.by_url: dict[str, int] = {}
        self.urls: list[str | None] = []
        self.owned: list[dict[int, int]] = []  # per slot: block hash -> raw tier bits
        self.keep: list[int] = []  # per slot: the mask that clears its bits
        self.cumulative: list[list[int]] = []  # per slot: _CUMULATIVE shifted into place
        self.free: list[int] = []
        self.page_sizes: dict[str, int] = {}
        self.version = 0  # bumps when slots or page sizes change
        self._groups: dict[tuple[str, ...], tuple[int, list[tuple[int, int, list[str], frozenset[str]]]]] = {}
        self._last_candidates: tuple[int, list[WorkerView], list] = (-1, [], [])

    def slot(self, url: str) -> int:
        s = self.by_url.get(url)
        if s is None:
            if self.free:
                s = self.free.pop()
                self.urls[s] = url
            else:
                s = len(self.urls)
                self.urls.append(url)
                self.owned.append({})
                self.keep.append(~(7 << 3 * s))
                self.cumulative.append([c << 3 * s for c in _CUMULATIVE])
            self.by_url[url] = s
            self.version += 1
        return s

    def remove(self, url: str) -> None:
        """Free ``url``'s slot (its blocks cleared already) and forget its page size."""
        s = self.by_url.pop(url, None)
        if s is not None:
            self.urls[s] = None
            self.free.append(s)
        self.page_sizes.pop(url, None)
        self.version += 1

    def set_page_size(self, url: str, page_size: int) -> None:
        self.page_sizes[url] = int(page_size)
        self.version += 1

    def page_size_of(self, worker: WorkerView) -> int:
        """The engine's page size: from its events' ``block_size``, else ``server_info``, else
        the default (not remembered, so a later server_info or event still wins)."""
        ps = self.page_sizes.get(worker.url)
        if ps is None:
            reported = worker.server_info.get("page_size")
            if not reported:
                return self.default_page_size
            ps = self.page_sizes[worker.url] = int(reported)
            self.version += 1
        return ps

    def worker_size(self, url: str) -> int:
        s = self.by_url.get(url)
        return len(self.owned[s]) if s is not None else 0

    def candidates(self, workers: Sequence[WorkerView]) -> list[tuple[int, int, list[str], frozenset[str], bool]]:
        """(page size, mask of the candidates' bits, their urls as a list and a set, whether
        the index knows all of them) groups, cached per worker set."""
        last = self._last_candidates
        # Usually the same worker objects as last time: the list compares them by identity, in C.
        if last[0] == self.version and workers == last[1]:
            return last[2]
        key = tuple(map(_url, workers))
        got = self._groups.get(key)
        if got is not None and got[0] == self.version:
            self._last_candidates = (self.version, list(workers), got[1])
            return got[1]
        groups: dict[int, tuple[int, list[str], bool]] = {}
        for w in workers:  # a worker the index has not heard of yet holds nothing, but can load the pool
            s = self.by_url.get(w.url)
            ps = self.page_size_of(w)
            mask, urls, known = groups.get(ps, (0, [], True))
            groups[ps] = (mask if s is None else mask | (7 << (3 * s)), urls + [w.url], known and s is not None)
        if len(self._groups) > 256:
            self._groups.clear()
        self._groups[key] = (self.version, [(ps, m, u, frozenset(u), k) for ps, (m, u, k) in groups.items()])
        self._last_candidates = (self.version, list(workers), self._groups[key][1])
        return self._groups[key][1]
