"""Consistent hashing on a session key (``X-Session-ID`` header, ``prompt_cache_key`` or ``user``).

A session sticks to one worker, where its prefix is warm; adding or removing a worker moves
only the sessions on that worker's arcs. Requests without a key fall back to least load.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence

from dataclasses import dataclass

from policies.base import Choice, Policy, RequestView, WorkerView, opt, require_workers


@dataclass
class ConsistentHashOptions:
    virtual_nodes: int = opt(160, "points per worker on the hash ring")


def _point(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class ConsistentHash(Policy):
    name = "consistent_hash"
    needs_prompt = False

    Options = ConsistentHashOptions

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.virtual_nodes = self.opts.virtual_nodes
        self._ring_key: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def _ring(self, workers: Sequence[WorkerView]) -> None:
        key = tuple(sorted(w.url for w in workers))
        if key == self._ring_key:
            return
        ring = sorted((_point(f"{url}#{i}"), url) for url in key for i in range(self.virtual_nodes))
        self._points = [p for p, _ in ring]
        self._owners = [u for _, u in ring]
        self._ring_key = key

    def select(self, request: RequestView, workers: Sequence[WorkerView]) -> Choice:
        require_workers(workers)
        if not request.session_key:
            return Choice(min(workers, key=lambda w: w.in_flight), reason="no session key: least load")
        self._ring(workers)
        i = bisect.bisect(self._points, _point(request.session_key)) % len(self._points)
        owner = self._owners[i]
        return Choice(next(w for w in workers if w.url == owner), reason="session hash")
