"""The one interface every cache-aware policy matches prefixes through.

An index answers "how much of this request's prefix does each worker already hold, and in
which tier", and learns from the routing decisions the policy makes. The approximate radix
tree (``index.radix``) and the precise KV-event block index
(``index.block_index``) both implement it, so a policy is written once and the index is
a constructor argument.

Lengths are in the index's own ``unit``: characters for the text radix tree, tokens for
token ids. ``IndexMatch.fraction`` turns them into the share of the prompt that is cached,
which policies scale to tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol, runtime_checkable

from index.views import RequestView, WorkerView

Unit = Literal["chars", "tokens"]


class Tiers(NamedTuple):
    """Prefix lengths per tier, each *beyond* the previous: the first ``gpu`` units are on
    the device, the next ``host`` units in host memory (HiCache L2), the next ``pool`` units
    in the shared store (Mooncake, L3). ``total`` is the whole reusable prefix."""

    gpu: int = 0
    host: int = 0
    pool: int = 0

    @property
    def total(self) -> int:
        return self.gpu + self.host + self.pool


NO_HIT = Tiers()


@dataclass(slots=True)
class IndexMatch:
    """Per-worker prefixes of one request. ``everyone`` is what every candidate can reuse
    whether ``hits`` lists it or not: the shared pool's leading pages, which any engine
    attached to the pool loads, and (precise index) a prefix every candidate holds itself,
    such as a system prompt on the whole fleet. ``hits`` then lists only the workers that
    hold more, so such a prompt costs the few workers holding more rather than the whole
    fleet."""

    query_len: int = 0
    unit: Unit = "chars"
    hits: dict[str, Tiers] = field(default_factory=dict)
    everyone: Tiers = NO_HIT

    def get(self, url: str) -> Tiers:
        return self.hits.get(url, self.everyone)

    def fraction(self, url: str) -> float:
        return self.get(url).total / self.query_len if self.query_len else 0.0


@runtime_checkable
class PrefixIndex(Protocol):
    """What a cache-aware policy needs from an index; see the module docstring."""

    unit: Unit

    def usable(self, request: RequestView) -> bool:
        """Whether this index can key the request at all (the precise one needs token ids)."""
        ...

    def match(self, request: RequestView, workers: Sequence[WorkerView]) -> IndexMatch:
        """Per-worker cached prefix of ``request``, only for ``workers``: in ``hits`` where a
        worker holds more than ``everyone`` (what all of them reuse), absent otherwise."""
        ...

    def record(self, request: RequestView, worker: WorkerView) -> None:
        """The request was routed to ``worker``: from now on its prefix counts as cached there
        (for good in the approximate index, until KV events confirm it in the precise one)."""
        ...

    def retract(self, request: RequestView, worker: WorkerView) -> None:
        """Undo the last ``record`` of ``request`` on ``worker``: the request went elsewhere."""
        ...

    def remove_worker(self, url: str) -> None:
        """Forget everything about ``url`` (worker gone, or its cache state is unknown)."""
        ...

    def worker_size(self, url: str) -> int:
        """How much the index holds for ``url``: the "smallest tree" tie-breaker."""
        ...

    def maintain(self, now: float | None = None) -> None:
        """Periodic upkeep (age-based eviction, expiring speculative entries)."""
        ...

    def stats(self) -> Mapping[str, float]: ...
