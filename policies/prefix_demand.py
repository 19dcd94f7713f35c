"""``cost``'s prefix demand: how many recent requests asked for the same cached prefix.

A miss on a prefix another worker holds prefills it again, and ``cost`` charges that
work ``weight`` times (``policies.work_weight``): the requests it delays. But a copy of a
prefix many requests want is not spent on one request: it serves the next ones for that
prefix, which would otherwise all queue on its holders. So the charge is shared among the
requests the copy is likely to serve, estimated by how many asked for that prefix within
the last ``window_s`` (an exponentially decayed count): a document every other question
cites is copied once its holder's queue costs more than prefilling it, while a
conversation's history, asked for once a turn, keeps the full charge and its worker.

A prefix is known by where the deepest hit ends (``IndexMatch``'s units), rounded down to
``_GRAIN`` units since questions that start alike match a few units further, and the units
just before that, with the cache salt: the same document reached by different questions
gives the same key, a conversation's next turn a new one. Each request counts once, when
it is committed, not at every decision while held.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable

from index.prefix import IndexMatch
from policies.base import RequestView

_GRAIN = 64  # units the prefix's end is rounded down to
_TAIL = 32  # units before that end which, with its place, name the prefix


class PrefixDemand:
    """Decayed counts of recent requests per held prefix, the ``max_keys`` most recent kept."""

    def __init__(self, window_s: float, max_keys: int = 4096) -> None:
        self.window_s = window_s
        self.max_keys = max_keys
        self._counts: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()  # key -> (count, at)

    @property
    def on(self) -> bool:
        return self.window_s > 0.0

    @staticmethod
    def key(request: RequestView, match: IndexMatch) -> Hashable | None:
        """The deepest prefix some worker holds (past what every worker reuses), or None."""
        depth = 0
        for tiers in match.hits.values():
            held = tiers.gpu + tiers.host + tiers.pool
            if held > depth:
                depth = held
        if not depth > match.everyone.total:
            return None
        seq = request.token_ids if match.unit == "tokens" else request.text
        if seq is None:
            return None
        depth = int(depth) // _GRAIN * _GRAIN
        if not depth:
            return None
        tail = seq[max(depth - _TAIL, 0):depth]
        return (request.cache_salt, depth, tail if isinstance(tail, str) else tuple(tail))

    def count(self, key: Hashable | None, now: float) -> float:
        """Requests committed for ``key`` within about the last window (decayed), 0 for None."""
        if key is None or not self.on:
            return 0.0
        got = self._counts.get(key)
        if got is None:
            return 0.0
        count, at = got
        return count * math.exp(-(now - at) / self.window_s) if now > at else count

    def add(self, key: Hashable | None, now: float) -> None:
        """One more request committed for ``key``."""
        if key is None or not self.on:
            return
        counts = self._counts
        counts[key] = (self.count(key, now) + 1.0, now)
        counts.move_to_end(key)
        if len(counts) > self.max_keys:
            counts.popitem(last=False)

    def __len__(self) -> int:
        return len(self._counts)
