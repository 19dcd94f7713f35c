"""A peer's records, applied to this process's real policies and workers (``gateway.peers``):
the bookings, index inserts and in-flight counts are those the peer's own decision made."""

from __future__ import annotations

import pytest

from gateway.bus import batch_header
from gateway.config import GatewayConfig, WorkerSpec
from gateway.peers import Peers
from gateway.records import Alive, Completed, FirstToken, Routed, encode
from gateway.workers import Worker
from policies.base import RequestView
from policies.cache_aware import CacheAware
from policies.cost import Cost

URLS = ["http://w:1", "http://w:2"]
PROMPT = list(range(1, 2049))


def batch(*records) -> bytes:
    return batch_header(len(records)) + b"".join(encode(r) for r in records)


def group(policy) -> tuple[Peers, dict[str, Worker]]:
    cfg = GatewayConfig()
    workers = {u: Worker(WorkerSpec(u), cfg) for u in URLS}
    for w in workers.values():
        w.set_healthy(True)
        policy.on_worker_added(w.view)
    return Peers("nats://127.0.0.1:1", "t", {"unified": policy}, workers, origin="me", wake_step_s=0), workers


def routed(rid: str, url: str, cached: int | None, **extra) -> Routed:
    fields: dict = dict(prompt=True, route="/generate", max_tokens=100)
    fields.update(ids=b"".join(t.to_bytes(4, "little") for t in PROMPT))
    fields.update(extra)
    return Routed("peer", rid, "unified", url, 0.0, cached, **fields)


def views(workers: dict[str, Worker]):
    return [w.view for w in workers.values()]


def test_cost_books_a_peers_choice_with_its_hit_and_frees_it():
    cost = Cost(index="approx")
    peers, workers = group(cost)
    peers.apply(batch(routed("r1", URLS[1], cached=1024)))
    assert workers[URLS[1]].view.in_flight == 1 and workers[URLS[0]].view.in_flight == 0
    assert cost.ledger.book[URLS[1]].queued == pytest.approx(cost.pricer.prefill(1024.0, 1024.0))
    assert "r1@peer" in cost.ledger.live
    # the approximate index now holds the prompt where the peer sent it
    match = cost.match(RequestView("q", "/generate", token_ids=PROMPT), views(workers))
    assert set(match.hits) == {URLS[1]}
    peers.apply(batch(FirstToken("peer", "r1", "unified", URLS[1], 0.0),
                      Completed("peer", "r1", "unified", URLS[1], 0.0, True, 200, 2048, 1024, 10)))
    assert cost.ledger.book[URLS[1]].queued == 0.0 and not cost.ledger.live
    assert workers[URLS[1]].view.in_flight == 0
    assert peers.stats()["applied"] == 3


def test_cache_aware_follows_a_peers_prefix_choice():
    alone = CacheAware()
    _, workers = group(alone)
    request = RequestView("q", "/generate", token_ids=PROMPT)
    assert alone.select(request, views(workers)).worker.url == URLS[0]  # the control: no history, first worker
    shared = CacheAware()
    peers, workers = group(shared)
    peers.apply(batch(routed("r1", URLS[1], cached=0)))
    peers.apply(batch(Completed("peer", "r1", "unified", URLS[1], 0.0, True)))
    choice = shared.select(request, views(workers))
    assert (choice.worker.url, choice.reason) == (URLS[1], "prefix")


def test_a_later_leg_or_retry_reuses_the_prompt_and_a_resend_is_applied_once():
    cost = Cost(index="approx")
    peers, workers = group(cost)
    first = routed("r1", URLS[0], cached=0)
    peers.apply(batch(first, first))  # the second is a resync's copy
    assert workers[URLS[0]].view.in_flight == 1
    peers.apply(batch(Completed("peer", "r1", "unified", URLS[0], 0.0, False, 502)))
    peers.apply(batch(Routed("peer", "r1", "unified", URLS[1], 0.0, None)))  # a retry: the prompt went before
    assert peers.stats()["ignored"] == 1  # the first attempt ended, so nothing is known of r1 here any more
    assert [w.view.in_flight for w in workers.values()] == [0, 0]


def test_alive_releases_what_ended_unheard_and_unknown_workers_are_skipped():
    cost = Cost(index="approx")
    peers, workers = group(cost)
    peers.apply(batch(routed("r1", URLS[0], 0), routed("r2", URLS[1], 0), routed("r3", "http://gone:9", 0)))
    assert [w.view.in_flight for w in workers.values()] == [1, 1] and peers.stats()["ignored"] == 1
    peers.apply(batch(Alive("peer", 0.0, ["r2"])))
    assert [w.view.in_flight for w in workers.values()] == [0, 1]
    assert peers.stats()["released"] == 1 and "r1@peer" not in cost.ledger.live
    peers._forget("peer", "gone")
    assert [w.view.in_flight for w in workers.values()] == [0, 0] and not cost.ledger.live


def test_held_requests_wake_at_once_while_claims_serialise_the_freed_worker():
    """A peer's completion frees a worker: without claims this process waits its turn (the
    origin first, then one ``wake_step_s`` per place in the ring), with them it wakes at once."""
    import asyncio

    async def woken_at_once(claiming: bool) -> bool:
        cfg = GatewayConfig()
        workers = {u: Worker(WorkerSpec(u), cfg) for u in URLS}
        peers = Peers("nats://127.0.0.1:1", "t", {"unified": Cost(index="approx")}, workers, origin="me",
                      wake_step_s=0.05)
        woken: list[bool] = []
        peers.freed = lambda: woken.append(True)
        peers.claims.ready = claiming
        peers.heard["a-peer"] = 0.0  # the ring: a-peer, me, peer (sorted): two turns after "peer"
        peers.apply(batch(routed("r1", URLS[0], cached=0)))
        peers.apply(batch(Completed("peer", "r1", "unified", URLS[0], 0.0, True)))
        return bool(woken)

    assert asyncio.run(woken_at_once(True)) is True
    assert asyncio.run(woken_at_once(False)) is False
