"""Replicas across hosts share routing state over TLS with NATS's own authentication: a real
``nats-server`` that requires TLS, a client certificate and a token, and two gateways."""

from __future__ import annotations

import pytest

from gateway.nats_server import EmbeddedNats
from tests.requires import need
from tests.support import wait_until
from tests.test_gateway_control_plane import gateway_log, posture_line
from tests.test_gateway_peers import one, state
from tests.test_gateway_tls import Pki, pki  # noqa: F401 - the fixture

TOKEN = "bus-s3cret"


@pytest.fixture
def secure_nats(pki: Pki):  # noqa: F811
    need("trustme")
    server = pki.issue("nats", "127.0.0.1")
    conf = (f'tls {{ cert_file: "{server.cert}", key_file: "{server.key}", ca_file: "{pki.ca_file}", '
            f'verify: true, timeout: 2 }}\nauthorization {{ token: "{TOKEN}" }}')
    with EmbeddedNats(conf=conf, scheme="tls") as nats:
        yield nats


def secure_replica(start_gateway, sim_url: str, url: str, *tls: str):
    return start_gateway(sim_url, args=("--policy", "least_load", "--state-heartbeat-secs", "0.3",
                                        "--state-url", url, *tls))


def test_replicas_share_state_over_mtls_and_keep_the_token_out_of_the_logs(start_sim, start_gateway, pki,  # noqa: F811
                                                                           secure_nats):
    sim = start_sim().url
    client = pki.issue("gateway", "kvgate")
    url = secure_nats.url.replace("tls://", f"tls://{TOKEN}@")
    tls = ("--state-tls-ca-file", pki.ca_file, "--state-tls-cert-file", client.cert, "--state-tls-key-file", client.key)
    a, b = (secure_replica(start_gateway, sim, url, *tls) for _ in range(2))
    wait_until(lambda: state(b, "kvgate_state_peers") >= 1 and state(a, "kvgate_state_peers") >= 1,
               "the replicas never heard each other over TLS", timeout=15, proc=b)
    assert one(a) == 200
    wait_until(lambda: state(b, "kvgate_state_records_total", outcome="applied") >= 1,
               "b applied none of a's records", proc=b)
    assert "state_bus=mtls" in posture_line(a)
    assert TOKEN not in gateway_log(a) and "state bus connected: tls://127.0.0.1:" in gateway_log(a)


@pytest.mark.parametrize("case", ["no client certificate", "wrong token"])
def test_a_replica_the_bus_refuses_routes_alone_and_says_so(start_sim, start_gateway, pki, secure_nats,  # noqa: F811
                                                            case):
    sim = start_sim().url
    client = pki.issue("gateway", "kvgate")
    token = "wrong" if case == "wrong token" else TOKEN
    tls = ("--state-tls-ca-file", pki.ca_file)
    if case != "no client certificate":
        tls += ("--state-tls-cert-file", client.cert, "--state-tls-key-file", client.key)
    gw = secure_replica(start_gateway, sim, secure_nats.url.replace("tls://", f"tls://{token}@"), *tls)
    wait_until(lambda: "state bus tls://127.0.0.1:" in gateway_log(gw) and "unreachable" in gateway_log(gw),
               "no warning that the bus refused this replica", timeout=15, proc=gw)
    assert state(gw, "kvgate_state_connected") == 0
    assert one(gw) == 200  # routing on its own state meanwhile
    assert token not in gateway_log(gw)


def test_a_bus_on_another_host_without_tls_is_a_warning_in_the_posture(start_sim, start_gateway):
    gw = start_gateway(start_sim().url, args=("--state-url", "nats://10.255.255.1:4222"))
    line = posture_line(gw)
    assert "state_bus=plain" in line and "WARNING" in line and "give a tls:// --state-url" in line
