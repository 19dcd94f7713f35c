"""The timing and the in-service rows of ``bench/decision_cost.py``.

``timed`` and ``row`` time a decision path and format its row. ``event_rows`` times the
KV-event path (applying BlockStored / BlockRemoved, one page or a step's batch);
``traffic_rows`` times ``cost`` with a routing gateway's traffic between decisions and on a
saturated fleet.
"""

from __future__ import annotations

import random
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from index.block_index import BlockIndex
from index.radix import RadixIndex
from index.views import Workers, new_membership
from policies.base import EngineLoad, Outcome, RequestView, WorkerView
from policies.cost import Cost
from wire.hashing import page_hashes
from wire.kv_events import BlockRemoved, BlockStored

Pair = tuple[RequestView, RequestView]  # (previous turn, next turn)


def timed(fn, requests, workers) -> tuple[list[float], list[float]]:
    """Wall and thread-CPU microseconds per call. On a shared machine the CPU time is the
    decision's own cost; wall time adds whatever preemption by other processes cost."""
    wall, cpu = [], []
    clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    for r in requests:
        c0, t0 = cpu_clock(), clock()
        fn(r, workers)
        t1, c1 = clock(), cpu_clock()
        wall.append((t1 - t0) / 1000)
        cpu.append((c1 - c0) / 1000)
    return wall, cpu


def p99(us: list[float]) -> float:
    us = sorted(us)
    return us[min(len(us) - 1, int(len(us) * 0.99))]


def row(name: str, times: tuple[list[float], list[float]]) -> str:
    wall, cpu = times
    return (f"| {name} | {len(wall)} | {statistics.median(cpu):.1f} | {p99(cpu):.1f} "
            f"| {statistics.median(wall):.1f} | {p99(wall):.1f} |")


def event_rows(precise: BlockIndex, workers: list[WorkerView], first_turn: Callable[[int], list[int]], n_conv: int,
               decisions: int, ps: int, seed: int) -> list[str]:
    """The event path (on the gateway's loop, off the request's): SGLang sends one page per
    BlockStored, parent first, and evicts leaf first. New chains of 40 pages on one worker,
    half continuing a fleet conversation's first turn (``first_turn(c)``, c < ``n_conv``),
    half new, then removed page by page."""
    ev = random.Random(seed)
    results = []
    chains = []
    for i in range(max(2, decisions // 20)):
        head = first_turn(ev.randrange(n_conv)) if i % 2 else []
        tokens = head + [ev.randrange(32_000) for _ in range(40 * ps)]
        chains.append((tokens[len(head):], page_hashes(tokens, ps)[len(head) // ps:],
                       page_hashes(head, ps)[-1] if head else None))
    url = workers[-1].url
    stores = [[BlockStored([h], parent if j == 0 else hashes[j - 1], tokens[j * ps:(j + 1) * ps], ps)
               for j, h in enumerate(hashes)] for tokens, hashes, parent in chains]
    removes = [[BlockRemoved([h]) for h in reversed(hashes)] for _, hashes, _ in chains]
    half = len(stores) // 2
    results.append(row("apply one BlockStored alone (one page with its tokens)",
                       timed(lambda e, _w: precise.apply(url, e), [e for b in stores[:half] for e in b], workers)))
    results.append(row("apply one BlockRemoved alone (one page, leaf first)",
                       timed(lambda e, _w: precise.apply(url, e), [e for b in removes[:half] for e in b], workers)))

    def per_page(batches: list[list]) -> tuple[list[float], list[float]]:
        wall, cpu = timed(lambda b, _w: precise.apply_batch(url, b), batches, workers)
        return [w / 40 for w in wall], [c / 40 for c in cpu]

    results.append(row("apply a batch of 40 BlockStored (a step's chain, one page each), per page",
                       per_page(stores[half:])))
    results.append(row("apply a batch of 40 BlockRemoved, per page", per_page(removes[half:])))
    return results


def traffic_rows(radix: RadixIndex, workers: list[WorkerView], info: Any, turns: Callable[[str], list[Pair]],
                 seed: int, lives: list[int]) -> list[str]:
    """``cost`` (approx index) timed in a gateway that is routing: bookings change and load
    reports are replaced between decisions; then, for each of ``lives``, on a saturated fleet."""
    results = []

    def with_traffic(fleet: list[WorkerView], live: int, held: int, tag: str, polls: bool = False
                     ) -> tuple[list[float], list[float]]:
        """``cost`` (approx index) with ``live`` requests of ``held`` prompt tokens booked
        per worker, an eighth still queued for prefill. Between two decisions (untimed) a
        decision's worth of traffic happens: one request ends, one is routed, one reaches its
        first token, and with ``polls`` one worker's load report is replaced by what this
        gateway's bookings there amount to (the gateway polls each every 0.5 s: 128 reports/s
        for 64 workers), so the decision also pays for the rows and release schedules those
        change (policies/fleet_backlog.py, kv_release.py)."""
        policy = Cost(index=radix)
        running: deque[tuple[RequestView, WorkerView]] = deque()
        queued: deque[tuple[RequestView, WorkerView]] = deque()
        traffic = random.Random(seed + live)
        prompt = [7] * held

        def book(w: WorkerView, start: bool) -> None:
            r = RequestView(f"live-{len(running) + len(queued)}-{traffic.random()}", "/generate",
                            token_ids=prompt, max_tokens=256)
            policy.on_routed(r, w)
            if start:
                policy.on_first_token(r, w)
                running.append((r, w))
            else:
                queued.append((r, w))

        for w in fleet:
            for k in range(live):
                book(w, start=k % 8 != 0)

        def one_decisions_traffic() -> None:
            done, w = (running or queued).popleft()
            policy.on_complete(done, w, Outcome(ok=True, completion_tokens=128))
            book(traffic.choice(fleet), start=False)
            first, w = queued.popleft()
            policy.on_first_token(first, w)
            running.append((first, w))
            if polls:  # what that engine reports: this gateway's own traffic there
                at = traffic.randrange(len(fleet))
                w = fleet[at]
                booked = policy.ledger.book[w.url]
                # replaced, as the gateway's poller does (the same worker in its place: the
                # list keeps its membership token, index.views.Workers)
                fleet[at] = w.reported(load=EngineLoad(
                    running=booked.decoding, waiting=sum(q.url == w.url for _, q in queued),
                    used_tokens=int(booked.kv), max_tokens=400_000, timestamp=time.monotonic()))

        wall, cpu = [], []
        for _, nxt in turns(tag):
            one_decisions_traffic()
            w, c = timed(policy.select, [nxt], fleet)
            wall += w
            cpu += c
        return wall, cpu

    # The fleet above, with traffic: what a decision costs in a gateway that is routing.
    polled = Workers([WorkerView(w.url, in_flight=w.in_flight, server_info=info, load=w.load) for w in workers],
                     new_membership())
    results.append(row("cost select, approx index, 8 requests booked per worker, 3 bookings changed "
                       "and 1 load report replaced between decisions", with_traffic(polled, 8, 2_000, "t", polls=True)))
    # A saturated fleet: every engine's KV pool full and this gateway's requests running on
    # it, so cost prices a KV wait on every worker (Cost.memory_wait over its live requests),
    # their prompts together as large as the pool.
    for live in lives:
        full_load = Workers([WorkerView(w.url, in_flight=w.in_flight, server_info=info,
                                        load=EngineLoad(running=live, waiting=0, used_tokens=399_950,
                                                        max_tokens=400_000, timestamp=time.monotonic()))
                             for w in workers], new_membership())
        results.append(row(f"cost select, approx index, KV full, {live} requests booked per worker "
                           "(1/8 queued), 3 bookings changed between decisions",
                           with_traffic(full_load, live, 390_000 // live, f"m{live}-")))  # bookings fill the pools
    return results
