"""The order of a QoS queue: priority classes first, then weighted fair sharing by tokens.

A queue holds waiters, each with a ticket naming its tenant, its class's rank (0 is the
most urgent), the tenant's weight and the request's expected tokens (prompt plus
expected output). A lower rank always goes first. Within a class, the tenants share by
virtual token counters (VTC, Sheng et al., "Fairness in Serving Large Language Models",
OSDI '24): each tenant's counter grows by the tokens it is served divided by its weight,
and the waiting tenant with the smallest counter goes next, its requests in arrival order.

Two rules keep it fair and work-conserving:

- ``charge`` is called when a request is *served* (leaves the queue, or passes it without
  waiting), never when it arrives: a counter measures service, not demand.
- A tenant that starts waiting after none of its requests were waiting is lifted to the
  class's virtual time: the counter the last request served in the class had just before
  it was charged (start-time fair queueing's system virtual time). An idle tenant cannot
  bank credit to flood the queue later, a busy one is not punished for having used what
  nobody else wanted, and a light tenant's request goes at the next turn (the others'
  counters are each at least one request past it), not after one more of theirs.

A request's expected tokens are settled against what the engine reported when it ends
(``settle``), so counters track real usage. Each class is a VTC of its own. The queue is
pure bookkeeping: waking, timeouts and slots are the caller's (``gateway.qos_queues``).
"""

from __future__ import annotations

import collections
import itertools
from typing import Any, Protocol


class Share(Protocol):
    """What the queue reads of a request's ticket (``gateway.qos.Ticket``)."""

    tenant: str
    rank: int
    weight: float
    cost: float  # expected tokens
    charged: list[tuple[Any, float]]  # (queue, tokens charged there), for ``settle``


class Waiter:
    __slots__ = ("ticket", "item", "seq")

    def __init__(self, ticket: Share, item: Any, seq: int) -> None:
        self.ticket = ticket
        self.item = item  # the caller's (a future to wake)
        self.seq = seq


class FairQueue:
    def __init__(self, ranks: int) -> None:
        # per class rank: tenant -> its waiters, oldest first
        self._lanes: list[dict[str, collections.deque[Waiter]]] = [{} for _ in range(max(ranks, 1))]
        self._counters: dict[tuple[int, str], float] = {}
        self._floor = [0.0] * max(ranks, 1)  # per class: its virtual time (see the module)
        self._seq = itertools.count()
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def counter(self, rank: int, tenant: str) -> float:
        return self._counters.get((rank, tenant), 0.0)

    def push(self, ticket: Share, item: Any, seq: int | None = None) -> Waiter:
        """Queue ``item``; ``seq`` keeps an earlier place in its tenant's line (a re-queue)."""
        lanes = self._lanes[ticket.rank]
        lane = lanes.get(ticket.tenant)
        if lane is None:
            lane = lanes[ticket.tenant] = collections.deque()
        if not lane:
            self._lift(ticket.rank, ticket.tenant)
        waiter = Waiter(ticket, item, next(self._seq) if seq is None else seq)
        lane.append(waiter)
        self.size += 1
        return waiter

    def _lift(self, rank: int, tenant: str) -> None:
        key = (rank, tenant)
        if self._counters.get(key, 0.0) < self._floor[rank]:
            self._counters[key] = self._floor[rank]

    def discard(self, waiter: Waiter) -> bool:
        """Take out a waiter that gave up; False when it is no longer queued."""
        lane = self._lanes[waiter.ticket.rank].get(waiter.ticket.tenant)
        try:
            lane.remove(waiter)  # type: ignore[union-attr]
        except (ValueError, AttributeError):
            return False
        self.size -= 1
        return True

    def _best_rank(self, below: int | None = None) -> int | None:
        for rank, lanes in enumerate(self._lanes[:below]):
            if any(lanes.values()):
                return rank
        return None

    def pop_many(self, n: int) -> list[Waiter]:
        """The next ``n`` waiters in order, taken out. Each pick counts its tokens for the
        picks after it (not in the counters: only ``charge`` does that), so a batch woken
        at once is interleaved as the tenants' shares say."""
        out: list[Waiter] = []
        extra: dict[tuple[int, str], float] = {}
        while len(out) < n and self.size:
            rank = self._best_rank()
            assert rank is not None
            best: tuple[float, int, str] | None = None
            for tenant, lane in self._lanes[rank].items():
                if lane:
                    key = (self.counter(rank, tenant) + extra.get((rank, tenant), 0.0), lane[0].seq, tenant)
                    if best is None or key < best:
                        best = key
            assert best is not None
            waiter = self._lanes[rank][best[2]].popleft()
            self.size -= 1
            t = waiter.ticket
            extra[(rank, t.tenant)] = extra.get((rank, t.tenant), 0.0) + t.cost / t.weight
            out.append(waiter)
        return out

    def pop(self) -> Waiter | None:
        got = self.pop_many(1)
        return got[0] if got else None

    def ahead_of(self, ticket: Share) -> bool:
        """Whether a newcomer with ``ticket`` would come after someone queued: anyone of a
        more urgent class, an older request of its own tenant, or a tenant of its class
        whose counter is not above the one the newcomer would have on joining (ties go to
        who waits already)."""
        if self._best_rank(ticket.rank) is not None:
            return True
        lanes = self._lanes[ticket.rank]
        if lanes.get(ticket.tenant):
            return True
        waiting = [self.counter(ticket.rank, t) for t, lane in lanes.items() if lane]
        joined = max(self.counter(ticket.rank, ticket.tenant), self._floor[ticket.rank])
        return bool(waiting) and min(waiting) <= joined

    def victim(self, ticket: Share) -> Waiter | None:
        """The waiter a newcomer with ``ticket`` may push out of a full queue, taken out, or
        None. Someone of a less urgent class first: the newest of the least urgent class,
        from the tenant served most there. Else, within the newcomer's class, the newest of
        the tenant with the longest line, where that line is longer than the newcomer's
        tenant's would be: a full queue drops from the tenant that filled it, not the
        newcomer of a light one."""
        for rank in range(len(self._lanes) - 1, ticket.rank, -1):
            lanes = [(self.counter(rank, t), t) for t, lane in self._lanes[rank].items() if lane]
            if lanes:
                return self._take_newest(rank, max(lanes)[1])
        lanes = self._lanes[ticket.rank]
        own = len(lanes.get(ticket.tenant) or ())
        longest = max(((len(lane), self.counter(ticket.rank, t), t) for t, lane in lanes.items() if lane),
                      default=None)
        if longest is not None and longest[0] > own + 1:
            return self._take_newest(ticket.rank, longest[2])
        return None

    def _take_newest(self, rank: int, tenant: str) -> Waiter:
        self.size -= 1
        return self._lanes[rank][tenant].pop()

    def work_ahead(self, ticket: Share) -> float:
        """Expected tokens of the waiters of ``ticket``'s class and more urgent ones."""
        return sum(w.ticket.cost for lanes in self._lanes[:ticket.rank + 1] for lane in lanes.values() for w in lane)

    def charge(self, ticket: Share) -> None:
        """``ticket``'s request is served now: its expected tokens count against its tenant."""
        key = (ticket.rank, ticket.tenant)
        before = self._counters.get(key, 0.0)
        self._counters[key] = before + ticket.cost / ticket.weight
        self._floor[ticket.rank] = before
        ticket.charged.append((self, ticket.cost))

    def settle(self, ticket: Share, tokens: float, charged: float) -> None:
        """The request ended having used ``tokens``, where ``charged`` were counted."""
        key = (ticket.rank, ticket.tenant)
        self._counters[key] = self._counters.get(key, 0.0) + (tokens - charged) / ticket.weight

    def counts(self) -> dict[tuple[str, int], int]:
        """Waiters per (tenant, rank), for the queued gauge."""
        return {(t, rank): len(lane) for rank, lanes in enumerate(self._lanes) for t, lane in lanes.items()}
