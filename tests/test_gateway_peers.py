"""Gateway replicas sharing one routing state over a real NATS server (``gateway.peers``).

Each test starts a ``nats-server``, simulated workers and two or three gateways as real
processes on 127.0.0.1. ``least_load`` picks the first of equally loaded workers, so where
a replica would send a request is known exactly: to the first worker when it knows only
its own traffic, to the second when it also counts what its peer routed.
"""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest

from gateway.nats_server import EmbeddedNats
from tests.conftest import MODEL
from tests.support import get_text, metric_value, request_json
from tests.support import wait_until as wait_for

HEARTBEAT = "0.3"




def state(gw, name: str, **labels: str) -> float:
    return metric_value(get_text(gw.url + "/metrics"), name, **labels)


def routed_to(gw, url: str) -> float:
    return state(gw, "kvgate_routed_total", worker=url)


class Stream:
    """A long streamed completion through ``gw``, read in a thread until it ends."""

    def __init__(self, gw, max_tokens: int = 3000, start: threading.Barrier | None = None) -> None:
        body = json.dumps({"model": MODEL, "prompt": "hold this worker " * 20, "max_tokens": max_tokens,
                           "ignore_eos": True, "stream": True}).encode()
        self.req = urllib.request.Request(gw.url + "/v1/completions", data=body,
                                          headers={"Content-Type": "application/json"})
        self.error: BaseException | None = None
        self.start = start
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            if self.start is not None:
                self.start.wait(10)
            with urllib.request.urlopen(self.req, timeout=120) as r:
                r.read()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.error = exc


def one(gw) -> int:
    status, _ = request_json("POST", gw.url + "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
    return status


@pytest.fixture
def nats():
    with EmbeddedNats() as server:
        yield server


@pytest.fixture
def sims(start_sim):
    return [start_sim(name=f"sim{i}").url for i in range(2)]


def replica(start_gateway, sims, nats, *extra: str):
    args = ("--policy", "least_load", "--state-heartbeat-secs", HEARTBEAT, *extra)
    return start_gateway(*sims, args=args + (("--state-url", nats.url) if nats is not None else ()))


def test_a_replica_counts_what_its_peer_routed(start_gateway, sims, nats):
    a, b = replica(start_gateway, sims, nats), replica(start_gateway, sims, nats)
    alone = replica(start_gateway, sims, None)  # the control: no shared state
    wait_for(lambda: state(b, "kvgate_state_peers") >= 1, why="b hears a")
    stream = Stream(a)
    wait_for(lambda: routed_to(a, sims[0]) == 1, why="a routes its stream to the first worker")
    wait_for(lambda: state(b, "kvgate_state_peer_requests_in_flight") == 1, why="b applies a's routing")
    workers = {w["url"]: w["in_flight"] for w in request_json("GET", b.url + "/workers")[1]["workers"]}
    assert workers == {sims[0]: 1, sims[1]: 0}
    assert one(b) == 200 and routed_to(b, sims[1]) == 1 and routed_to(b, sims[0]) == 0
    assert one(alone) == 200 and routed_to(alone, sims[0]) == 1  # it would have herded onto the busy one
    assert stream.error is None


def test_replicas_deciding_at_once_claim_different_workers(start_gateway, sims, nats):
    """Each replica's request reaches it before the other's record can: both would pick the
    first worker, but a worker is claimed once, and the loser is told, catches up and moves."""
    a, b = replica(start_gateway, sims, nats), replica(start_gateway, sims, nats)
    wait_for(lambda: all(state(gw, "kvgate_state_peers") >= 1 and state(gw, "kvgate_state_claims_ready") == 1
                         for gw in (a, b)), why="a and b hear each other and can claim")
    start = threading.Barrier(2)
    streams = [Stream(a, start=start), Stream(b, start=start)]
    wait_for(lambda: sum(routed_to(gw, url) for gw in (a, b) for url in sims) == 2, why="both streams routed")
    assert [routed_to(a, url) + routed_to(b, url) for url in sims] == [1, 1]
    won = sum(state(gw, "kvgate_state_claims_total", outcome="won") for gw in (a, b))
    assert won == 2 and all(s.error is None for s in streams)


def test_a_killed_peers_requests_are_released(start_gateway, sims, nats):
    a, b = replica(start_gateway, sims, nats), replica(start_gateway, sims, nats)
    wait_for(lambda: state(b, "kvgate_state_peers") >= 1, why="b hears a")
    Stream(a)
    wait_for(lambda: state(b, "kvgate_state_peer_requests_in_flight") == 1, why="b applies a's routing")
    a.kill()
    wait_for(lambda: state(b, "kvgate_state_peers") == 0, timeout=10, why="b forgets a silent peer")
    assert state(b, "kvgate_state_peer_requests_in_flight") == 0
    assert state(b, "kvgate_state_records_total", outcome="released") == 1
    assert [w["in_flight"] for w in request_json("GET", b.url + "/workers")[1]["workers"]] == [0, 0]


def test_bus_outage_keeps_serving_and_resyncs(start_gateway, sims, nats):
    port = int(nats.url.rsplit(":", 1)[1])
    a, b = replica(start_gateway, sims, nats), replica(start_gateway, sims, nats)
    wait_for(lambda: state(a, "kvgate_state_peers") >= 1 and state(b, "kvgate_state_peers") >= 1,
             why="a and b hear each other")
    nats.proc.kill()
    nats.proc.wait(5)
    wait_for(lambda: state(a, "kvgate_state_connected") == 0 and state(b, "kvgate_state_connected") == 0,
             why="both see the bus gone")
    assert [one(a) for _ in range(3)] + [one(b) for _ in range(3)] == [200] * 6  # routing goes on, alone
    stream = Stream(a)  # routed while the bus is down: b learns of it only by the resync
    wait_for(lambda: routed_to(a, sims[0]) >= 1 and state(a, "kvgate_worker_in_flight", worker=sims[0]) >= 0,
             why="a routes its stream")
    with EmbeddedNats(port=port):
        wait_for(lambda: state(a, "kvgate_state_connected") == 1 and state(b, "kvgate_state_connected") == 1,
                 timeout=20, why="both reconnect")
        wait_for(lambda: state(b, "kvgate_state_peer_requests_in_flight") == 1, why="b learns a's stream again")
        assert stream.error is None


def test_a_joining_replica_learns_what_is_in_flight(start_gateway, sims, nats):
    a = replica(start_gateway, sims, nats)
    stream = Stream(a)
    wait_for(lambda: routed_to(a, sims[0]) == 1, why="a routes its stream")
    b = replica(start_gateway, sims, nats)  # its Hello asks a for what a has in flight
    wait_for(lambda: state(b, "kvgate_state_peer_requests_in_flight") == 1, why="b learns a's stream")
    assert one(b) == 200 and routed_to(b, sims[1]) == 1
    assert stream.error is None


def test_rate_limits_hold_across_replicas(start_gateway, sims, nats):
    limit = ("--rate-limit-rps", "0.01", "--rate-limit-burst", "3")
    a, b = replica(start_gateway, sims, nats, *limit), replica(start_gateway, sims, nats, *limit)
    alone = replica(start_gateway, sims, None, *limit)
    wait_for(lambda: state(b, "kvgate_state_peers") >= 1, why="b hears a")
    assert [one(a) for _ in range(3)] == [200] * 3
    wait_for(lambda: state(b, "kvgate_state_records_total", outcome="charged") == 3, why="b charges a's spends")
    assert one(b) == 429  # the client's burst is spent, through whichever replica
    assert one(alone) == 200  # the control: a replica of its own keeps a bucket of its own


def test_every_replica_hears_the_engines_kv_events_itself(start_sim, start_gateway):
    """The precise index needs no bus: each replica subscribes to every engine, so what one
    replica's traffic cached is in the other's index, to the block."""
    from tests.support import FREE_PORT, converse, policy_stats

    sims = [start_sim("--kv-events-port", FREE_PORT, name=f"sim{i}").url for i in range(2)]
    args = ("--policy", "kv_events", "--tokenizer", "byte")
    a, b = start_gateway(*sims, args=args), start_gateway(*sims, args=args)
    served = converse(a.url, MODEL, conversations=2, turns=2)
    assert all(cached > 0 for turn, cached in served if turn > 0), served
    wait_for(lambda: policy_stats(b.url)["index_blocks"] == policy_stats(a.url)["index_blocks"] > 0,
             why="b's index holds what a's traffic cached")
    again = converse(b.url, MODEL, conversations=2, turns=1)  # the same first turns, through b
    stats = policy_stats(b.url)
    assert all(cached > 0 for _, cached in again), again
    # b predicts a's cached prompt to the page: the engine reuses at most the pages of all
    # but the prompt's last token, which the index does not subtract for a repeated prompt
    predicted, actual = stats["hit_predicted_tokens_total"], stats["hit_actual_tokens_total"]
    assert 0 < actual <= predicted <= actual + 64 * len(again), (predicted, actual)


def listed(gw) -> set[str]:
    return {w["url"] for w in request_json("GET", gw.url + "/workers")[1]["workers"]}


def test_workers_added_or_removed_at_one_replica_are_the_groups(start_sim, start_gateway, sims, nats):
    a, b = replica(start_gateway, sims[:1], nats), replica(start_gateway, sims[:1], nats)
    wait_for(lambda: state(b, "kvgate_state_peers") >= 1 and state(a, "kvgate_state_peers") >= 1,
             why="a and b hear each other")
    status, _ = request_json("POST", a.url + "/workers", {"url": sims[1]})
    assert status == 201
    wait_for(lambda: sims[1] in listed(b), why="b adds the worker added at a")
    late = replica(start_gateway, sims[:1], nats)  # joins after the change: learns it on its Hello
    wait_for(lambda: listed(late) == set(sims), why="a replica started later adds it too")
    status, _ = request_json("DELETE", b.url + f"/workers?url={sims[0]}")  # one the configuration named
    assert status == 200
    for gw in (a, late):
        wait_for(lambda gw=gw: listed(gw) == {sims[1]}, why="every replica removes the worker removed at b")
    assert one(late) == 200 and state(late, "kvgate_routed_total", worker=sims[1]) == 1
