"""The QoS scheduler alone (``gateway.fair_queue``, ``gateway.qos_queues``): priority
order, weighted fair shares by tokens, work conservation, no banked credit, preemption
inside the queue. Pure: a virtual clock drives the fleet's slots, no network."""

from __future__ import annotations

import asyncio
import heapq
from dataclasses import dataclass, field
from typing import Any

import pytest

from gateway.errors import GatewayError
from gateway.fair_queue import FairQueue
from gateway.qos_queues import FairAdmission, FairHoldRoom


@dataclass(eq=False)
class T:
    """A ticket, as ``gateway.fair_queue.Share`` reads one."""

    tenant: str
    rank: int = 0
    weight: float = 1.0
    cost: float = 100.0
    model: str | None = None
    hold: bool = True
    charged: list[tuple[Any, float]] = field(default_factory=list)


def order(q: FairQueue) -> list[str]:
    return [w.item for w in q.pop_many(q.size)]


def test_a_more_urgent_class_goes_first_and_fifo_within_a_tenant():
    q = FairQueue(ranks=3)
    q.push(T("a", rank=2), "low1")
    q.push(T("a", rank=2), "low2")
    q.push(T("b", rank=1), "mid")
    q.push(T("c", rank=0), "high")
    assert order(q) == ["high", "mid", "low1", "low2"]


def test_a_batch_woken_at_once_is_interleaved_by_share():
    q = FairQueue(ranks=1)
    for i in range(4):
        q.push(T("a"), f"a{i}")
    for i in range(2):
        q.push(T("b"), f"b{i}")
    assert order(q) == ["a0", "b0", "a1", "b1", "a2", "a3"]


def serve(slots: int, arrivals: dict[str, tuple[float, float, float, float]], until: float,
          backlog: int = 4) -> dict[str, list[tuple[float, float]]]:
    """A fleet of ``slots`` serving one token per time unit each, fed from one queue.

    ``arrivals[tenant] = (weight, cost, start, stop)``: from ``start`` to ``stop`` the tenant
    keeps ``backlog`` requests of ``cost`` tokens waiting. Returns, per tenant, (start, tokens)
    of each request served. Every loop is bounded by ``until``."""
    q = FairQueue(ranks=1)
    tickets = {t: T(t, weight=w, cost=c) for t, (w, c, _, _) in arrivals.items()}
    waiting = dict.fromkeys(arrivals, 0)
    served: dict[str, list[tuple[float, float]]] = {t: [] for t in arrivals}
    free, ends, now = slots, [], 0.0
    while now < until:
        for t, (_, _, start, stop) in arrivals.items():
            while start <= now < stop and waiting[t] < backlog:
                q.push(tickets[t], t)
                waiting[t] += 1
        while free and q.size:
            w = q.pop()
            q.charge(w.ticket)
            waiting[w.item] -= 1
            served[w.item].append((now, w.ticket.cost))
            heapq.heappush(ends, now + w.ticket.cost)
            free -= 1
        assert free == 0 or not q.size  # work-conserving: no slot idles while anyone waits
        nxt = [e for e in (ends[0] if ends else None,) if e is not None]
        now = min(nxt + [now + 1.0])
        while ends and ends[0] <= now:
            heapq.heappop(ends)
            free += 1
    return served


def tokens(served: dict[str, list[tuple[float, float]]], t: str, since: float = 0.0, until: float = 1e18) -> float:
    return sum(c for at, c in served[t] if since <= at < until)


def test_slots_are_shared_by_weight_under_contention():
    served = serve(slots=4, arrivals={"a": (2.0, 100, 0, 1e9), "b": (1.0, 100, 0, 1e9)}, until=20_000)
    ratio = tokens(served, "a") / tokens(served, "b")
    assert 1.9 < ratio < 2.1, ratio


def test_shares_count_tokens_not_requests():
    served = serve(slots=4, arrivals={"a": (1.0, 1000, 0, 1e9), "b": (1.0, 50, 0, 1e9)}, until=50_000)
    ratio = tokens(served, "a") / tokens(served, "b")
    assert 0.9 < ratio < 1.1, ratio
    assert len(served["b"]) > 10 * len(served["a"])


def test_work_conserving_an_idle_tenants_share_goes_to_the_others():
    served = serve(slots=4, arrivals={"a": (1.0, 100, 0, 1e9), "b": (3.0, 100, 10_000, 1e9)}, until=20_000)
    assert tokens(served, "a", 0, 10_000) == pytest.approx(4 * 10_000, rel=0.02)  # all of it, b being idle
    late = tokens(served, "a", 11_000), tokens(served, "b", 11_000)
    assert late[1] / late[0] == pytest.approx(3.0, rel=0.1)  # b's weight applies as soon as it waits


def test_an_idle_tenant_banks_no_credit():
    """b was idle while a used the whole fleet: when b comes back it gets its share, not the
    whole fleet until its counter catches up with a's."""
    served = serve(slots=2, arrivals={"a": (1.0, 100, 0, 1e9), "b": (1.0, 100, 10_000, 1e9)}, until=12_000)
    first = tokens(served, "a", 10_000, 11_000), tokens(served, "b", 10_000, 11_000)
    assert first[0] > 0 and 0.7 < first[1] / first[0] < 1.4, first


def test_a_light_tenant_joining_goes_at_the_next_turn():
    """b's request is lifted to the class's virtual time (a's last start), below a's next:
    it goes before a's next request, not after it."""
    q = FairQueue(ranks=1)
    for i in range(5):
        q.push(T("a"), f"a{i}")
    for _ in range(2):
        q.charge(q.pop().ticket)
    q.push(T("b"), "b0")
    assert q.counter(0, "b") == pytest.approx(100) and q.counter(0, "a") == pytest.approx(200)
    assert order(q)[:2] == ["b0", "a2"]


def test_a_newcomer_waits_only_behind_those_it_would_come_after():
    q = FairQueue(ranks=2)
    for i in range(3):
        q.push(T("a", rank=1), f"a{i}")
    assert q.ahead_of(T("b", rank=1))  # equal counters: a waits already
    q.charge(q.pop().ticket)  # a's counter is one request past the class's virtual time
    assert not q.ahead_of(T("b", rank=1))  # b would go first: it may be decided at once
    assert q.ahead_of(T("a", rank=1))  # a's own older requests
    assert not q.ahead_of(T("x", rank=0))  # a more urgent class
    q.push(T("y", rank=0), "y")
    assert q.ahead_of(T("b", rank=1))


def test_settling_counts_the_tokens_the_engine_reported():
    q = FairQueue(ranks=1)
    big, small = T("a", cost=100), T("b", cost=100)
    q.charge(big)
    q.charge(small)
    q.push(T("a"), "a")  # both wait, with equal counters: a, being older, would go first
    q.push(T("b"), "b")
    q.settle(big, 1000, 100)  # a's running request used ten times what was expected
    q.settle(small, 10, 100)
    assert q.counter(0, "a") == pytest.approx(1000) and q.counter(0, "b") == pytest.approx(10)
    assert order(q) == ["b", "a"]


def test_the_victim_is_the_newest_of_the_least_urgent_class_below_the_newcomer():
    q = FairQueue(ranks=3)
    q.push(T("a", rank=1), "mid")
    q.push(T("a", rank=2), "low-old")
    q.push(T("b", rank=2), "low-new")
    assert q.victim(T("x", rank=2)) is None  # nobody below its own class
    assert q.victim(T("x", rank=0)).item in ("low-old", "low-new")
    assert q.victim(T("x", rank=0)).item in ("low-old", "low-new")
    assert q.victim(T("x", rank=1)) is None  # "mid" is not below rank 1
    assert q.size == 1 and q.ahead_of(T("x", rank=1)) and not q.ahead_of(T("x", rank=0))


def test_within_a_class_a_full_queue_drops_from_the_longest_line():
    q = FairQueue(ranks=1)
    for i in range(3):
        q.push(T("heavy"), f"heavy{i}")
    q.push(T("light"), "light0")
    assert q.victim(T("heavy")) is None  # its own line is the longest: the newcomer is refused
    assert q.victim(T("light")).item == "heavy2"  # 3 waiting > 1 + 1
    assert q.victim(T("light")) is None  # 2 waiting, not more than light's 1 + 1
    assert order(q) == ["heavy0", "light0", "heavy1"]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_admission_gives_a_freed_slot_to_the_queued_high_priority_request_first():
    async def main() -> list[str]:
        admission = FairAdmission(1, 10, 5.0, ranks=2, fallback=lambda: T("default"))
        got: list[str] = []

        async def one(name: str, ticket: T) -> None:
            async with admission.slot(ticket):
                got.append(name)
                await asyncio.sleep(0.01)

        first = asyncio.ensure_future(one("running", T("a", rank=1)))
        await asyncio.sleep(0)
        tasks = [asyncio.ensure_future(one(n, T(n, rank=r))) for n, r in (("low1", 1), ("low2", 1), ("high", 0))]
        for _ in range(100):  # bounded: until all three are queued
            if admission.queued == 3:
                break
            await asyncio.sleep(0.001)
        assert admission.queued == 3
        await asyncio.gather(first, *tasks)
        return got

    assert run(main()) == ["running", "high", "low1", "low2"]


def test_admission_shares_slots_by_weight():
    async def main() -> list[str]:
        admission = FairAdmission(1, 100, 5.0, ranks=1, fallback=lambda: T("default"))
        got: list[str] = []
        a, b = T("a", weight=3.0), T("b", weight=1.0)

        async def one(ticket: T) -> None:
            async with admission.slot(ticket):
                got.append(ticket.tenant)
                await asyncio.sleep(0)

        blocker = asyncio.ensure_future(one(T("x")))
        await asyncio.sleep(0)
        tasks = [asyncio.ensure_future(one(t)) for t in [a] * 12 + [b] * 12]
        await asyncio.gather(blocker, *tasks)
        return got[1:]

    got = run(main())
    assert got[:8].count("a") == 6 and got[:8].count("b") == 2, got  # 3:1 while both wait
    assert got[-6:] == ["b"] * 6  # a done: b takes every slot


def test_a_full_queue_preempts_the_least_urgent_and_refuses_equals():
    async def main() -> tuple[list[str], list[str]]:
        admission = FairAdmission(1, 2, 5.0, ranks=2, fallback=lambda: T("default"))
        got: list[str] = []
        refused: list[str] = []

        async def one(name: str, rank: int) -> None:
            try:
                async with admission.slot(T(name, rank=rank)):
                    got.append(name)
                    await asyncio.sleep(0.01)
            except GatewayError as exc:
                refused.append(f"{name}:{exc.code}")

        tasks = [asyncio.ensure_future(one("run", 1))]
        await asyncio.sleep(0)
        for name, rank in (("low1", 1), ("low2", 1), ("low3", 1), ("high", 0)):
            tasks.append(asyncio.ensure_future(one(name, rank)))
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        return got, refused

    got, refused = run(main())
    assert refused == ["low3:queue_full", "low2:preempted"]
    assert got == ["run", "high", "low1"]


def test_hold_room_wakes_by_class_and_a_newcomer_behind_held_requests_waits():
    async def main() -> list[str]:
        room = FairHoldRoom(5.0, wake=1, ranks=2)
        woken: list[str] = []

        async def held(name: str, ticket: T) -> None:
            if await room.wait(5.0, ticket):
                woken.append(name)

        tasks = [asyncio.ensure_future(held(n, T(n, rank=r))) for n, r in (("low", 1), ("high", 0))]
        await asyncio.sleep(0)
        assert room.held == 2
        assert room.outranked(T("new", rank=1)) and room.outranked(T("new", rank=0))  # "high" is rank 0
        assert not room.outranked(T("other", rank=0, model="m2"))  # another model's queue
        room.notify()
        await asyncio.sleep(0)
        room.handover(T("x", rank=1))
        await asyncio.gather(*tasks)
        return woken

    assert run(main()) == ["high", "low"]


class _Fleet:
    """A ``gateway.attempts`` target with ``slots`` places: a decision takes a free one or
    answers ``Hold``; an attempt keeps its place until the test lets it end."""

    def __init__(self, slots: int) -> None:
        from policies.loader import load_policy

        self.policy = load_policy("round_robin")
        self.free = slots
        self.decided: list[str] = []  # request ids, at each decision
        self.started: list[str] = []
        self.ends: dict[str, asyncio.Event] = {}

    async def decide(self, view, tried):
        from policies.base import Hold

        self.decided.append(view.request_id)
        if not self.free:
            return Hold(retry_s=5.0)
        self.free -= 1
        return "w"

    @staticmethod
    def urls(pick):
        return (pick,)

    async def attempt(self, request, view, raw, body, pick, n):
        from aiohttp import web

        self.started.append(view.request_id)
        end = self.ends[view.request_id] = asyncio.Event()
        await end.wait()
        return web.Response(status=200)


def test_held_requests_start_in_class_order_and_a_newcomer_behind_them_is_not_decided(monkeypatch):
    from gateway.attempts import Attempts
    from gateway.metrics import GatewayMetrics
    from policies.base import Hold, RequestView

    monkeypatch.setattr("gateway.attempts.DEFERRED", Hold(retry_s=5.0))  # no retry time within the test

    async def main() -> _Fleet:
        loop = Attempts(GatewayMetrics(), max_retries=0, max_hold_s=10.0)
        loop.holds = room = FairHoldRoom(10.0, wake=16, ranks=2)
        fleet = loop.target = _Fleet(slots=1)

        def send(rid: str, ticket: T) -> asyncio.Future:
            return asyncio.ensure_future(loop.run(None, RequestView(rid, "/generate", qos=ticket), b"{}", None))

        tasks = [send("running", T("a", rank=1))]
        for rid, rank in (("low1", 1), ("low2", 1), ("high", 0)):
            await asyncio.sleep(0.01)
            tasks.append(send(rid, T(rid, rank=rank)))
        await asyncio.sleep(0.01)
        assert fleet.started == ["running"] and room.held == 3
        assert fleet.decided == ["running", "low1", "high"]  # low2 waited behind low1 undecided
        for rid in ("running", "high", "low1"):
            fleet.free += 1
            fleet.ends[rid].set()
            loop.freed()  # as the proxy does at a completion
            for _ in range(100):  # bounded: until the next one has started
                if len(fleet.started) == 1 + ("running", "high", "low1").index(rid) + 1:
                    break
                await asyncio.sleep(0.001)
        fleet.ends["low2"].set()
        await asyncio.gather(*tasks)
        return fleet

    assert run(main()).started == ["running", "high", "low1", "low2"]


def test_a_class_that_is_not_held_is_decided_at_once_past_held_requests(monkeypatch):
    """``hold: false`` (a class the engines run first): no deferral, no hold; the policy
    must choose, and the request goes while others of its class stay held."""
    from gateway.attempts import Attempts
    from gateway.metrics import GatewayMetrics
    from policies.base import Hold, RequestView

    monkeypatch.setattr("gateway.attempts.DEFERRED", Hold(retry_s=5.0))

    async def main() -> _Fleet:
        loop = Attempts(GatewayMetrics(), max_retries=0, max_hold_s=10.0)
        loop.holds = FairHoldRoom(10.0, wake=16, ranks=1)
        fleet = loop.target = _Fleet(slots=1)

        def send(rid: str, ticket: T) -> asyncio.Future:
            return asyncio.ensure_future(loop.run(None, RequestView(rid, "/generate", qos=ticket), b"{}", None))

        tasks = [send("running", T("a")), send("held", T("b"))]
        await asyncio.sleep(0.01)
        fleet.free += 1  # room, with no event to wake the held request
        tasks.append(send("urgent", T("c", hold=False)))
        await asyncio.sleep(0.01)
        assert fleet.started == ["running", "urgent"]
        for rid in ("running", "urgent"):
            fleet.ends[rid].set()
        fleet.free += 1
        loop.freed()
        for _ in range(100):  # bounded: until the held one has started
            if "held" in fleet.ends:
                break
            await asyncio.sleep(0.001)
        fleet.ends["held"].set()
        await asyncio.gather(*tasks)
        return fleet

    assert run(main()).started == ["running", "urgent", "held"]
