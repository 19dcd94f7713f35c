"""Tenant budgets hold across gateway replicas sharing one NATS bus (``gateway.records.Used``
applied by ``gateway.peers``): real processes on 127.0.0.1, as tests/test_gateway_peers.py."""

from __future__ import annotations

import json

import pytest

from gateway.nats_server import EmbeddedNats
from tests.conftest import MODEL
from tests.support import get_text, metric_value
from tests.support import wait_until as wait_for
from tests.test_gateway_wire import post

# A window long enough that nothing refills while the test runs
TENANTS = """
budget_window_secs: 600
tenants:
  beta: {keys: [sk-beta], requests_per_minute: 3}
  gamma: {keys: [sk-gamma], tokens_per_minute: 5}
"""


def state(gw, name: str, **labels: str) -> float:
    return metric_value(get_text(gw.url + "/metrics"), name, **labels)


def one(gw, key: str = "sk-beta", max_tokens: int = 2) -> tuple[int, dict[str, str]]:
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": max_tokens, "ignore_eos": True}).encode()
    status, _, headers = post(gw.url + "/v1/completions", body, {"Authorization": f"Bearer {key}"})
    return status, headers


@pytest.fixture
def nats():
    with EmbeddedNats() as server:
        yield server


def replicas(start_sim, start_gateway, nats, tmp_path):
    """Two gateways with the tenants file on one NATS, once they hear each other; and their arguments."""
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS)
    sim = start_sim()
    args = ("--tenants-file", str(path), "--policy", "least_load", "--state-heartbeat-secs", "0.3")
    a = start_gateway(sim.url, args=args + ("--state-url", nats.url))
    b = start_gateway(sim.url, args=args + ("--state-url", nats.url))
    a.sim_url = sim.url
    wait_for(lambda: state(a, "kvgate_state_peers") >= 1 and state(b, "kvgate_state_peers") >= 1,
             why="a and b hear each other")
    return a, b, args


def test_a_tenants_budget_is_the_groups_not_each_replicas(start_sim, start_gateway, nats, tmp_path):
    a, b, args = replicas(start_sim, start_gateway, nats, tmp_path)
    alone = start_gateway(a.sim_url, args=args)  # the control: no shared state
    assert [one(a)[0] for _ in range(2)] == [200, 200]
    wait_for(lambda: state(b, "kvgate_state_records_total", outcome="charged") >= 2, why="b charges a's requests")
    status, headers = one(b)
    assert status == 200 and headers["x-ratelimit-remaining-requests"] == "0"
    wait_for(lambda: state(a, "kvgate_state_records_total", outcome="charged") >= 1, why="a charges b's request")
    status, headers = one(a)
    assert status == 429 and headers["x-ratelimit-remaining-requests"] == "0"
    assert one(b)[0] == 429
    assert [one(alone)[0] for _ in range(3)] == [200, 200, 200]  # alone, each replica would give 3 more
    assert one(alone)[0] == 429


def test_tokens_reported_at_one_replica_count_at_the_other(start_sim, start_gateway, nats, tmp_path):
    a, b, _ = replicas(start_sim, start_gateway, nats, tmp_path)
    status, headers = one(a, "sk-gamma", max_tokens=8)  # 8 completion tokens and the prompt's: over 5
    assert status == 200 and headers["x-ratelimit-limit-tokens"] == "5"
    wait_for(lambda: state(b, "kvgate_state_records_total", outcome="charged") >= 1, why="b charges a's tokens")
    status, headers = one(b, "sk-gamma")
    assert status == 429 and headers["x-ratelimit-remaining-tokens"] == "0"
