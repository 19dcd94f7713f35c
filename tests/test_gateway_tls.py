"""TLS on both sides, on real processes with certificates made at test time (``trustme``):
clients to the gateway (and a SIGHUP that swaps its certificate under a live listener), and the
gateway to a simulated worker serving HTTPS that requires client certificates (mTLS), plus
workers whose certificate is wrong, each refused with a health error that says why."""

from __future__ import annotations

import http.client
import json
import os
import signal
import ssl
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import MODEL
from tests.requires import need
from tests.support import Proc, free_port, http_status, launch, request_json
from tests.test_gateway_control_plane import gateway_log, listed, posture_line, wait_for

trustme = need("trustme", "pip install -e '.[test]'")

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@dataclass
class Pair:
    cert: str
    key: str


@dataclass
class Pki:
    ca: object
    ca_file: str
    folder: Path

    def issue(self, name: str, *identities: str, ca: object | None = None) -> Pair:
        leaf = (ca or self.ca).issue_cert(*identities)
        pair = Pair(str(self.folder / f"{name}.pem"), str(self.folder / f"{name}-key.pem"))
        self.write(leaf, pair)
        return pair

    @staticmethod
    def write(leaf, pair: Pair) -> None:
        Path(pair.cert).write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
        leaf.private_key_pem.write_to_path(pair.key)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    return Pki(ca, str(tmp_path / "ca.pem"), tmp_path)


def client_context(ca_file: str, client: Pair | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=ca_file)
    if client is not None:
        ctx.load_cert_chain(client.cert, client.key)
    return ctx


def https_get(port: int, path: str, ctx: ssl.SSLContext, timeout: float = 5.0) -> tuple[int, bytes]:
    """(status, DER of the certificate the server showed) for one request on a new connection."""
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status, conn.sock.getpeercert(binary_form=True)
    finally:
        conn.close()


def answers(port: int, path: str, ctx: ssl.SSLContext) -> bool:
    try:
        return https_get(port, path, ctx)[0] == 200
    except (OSError, http.client.HTTPException):
        return False


def start_https(module: str, args: list[str], ctx: ssl.SSLContext, name: str) -> Proc:
    """``python -m module`` on a free port of 127.0.0.1, healthy over HTTPS with ``ctx``."""
    def start() -> Proc:
        port = free_port()
        proc = Proc.python(module, *args[:1], "--host", "127.0.0.1", "--port", str(port), *args[1:], name=name)
        proc.port = port
        return proc

    def ready(proc: Proc) -> None:
        deadline = time.monotonic() + 30
        while not answers(proc.port, "/health", ctx):
            if proc.popen.poll() is not None:
                raise AssertionError(f"{name} exited:\n{proc.output()[-3000:]}")
            assert time.monotonic() < deadline, f"{name} not answering over HTTPS:\n{proc.output()[-3000:]}"
            time.sleep(0.05)

    return launch(start, ready)


def tls_sim(pki: Pki, server: Pair, *extra: str, probe: ssl.SSLContext | None = None) -> Proc:
    args = ["serve", "--model-name", MODEL, "--time-scale", "50", "--ssl-certfile", server.cert,
            "--ssl-keyfile", server.key, *extra]
    proc = start_https("simulator", args, probe or client_context(pki.ca_file), name="tls-sim")
    proc.url = f"https://127.0.0.1:{proc.port}"
    return proc


def test_clients_reach_the_gateway_over_tls_and_sighup_swaps_its_certificate(pki, start_sim):
    sim = start_sim("--time-scale", "50")
    first = pki.issue("gateway", "127.0.0.1")
    ctx = client_context(pki.ca_file)
    gw = start_https("gateway", ["serve", "--worker-urls", sim.url, "--health-check-interval-secs", "0.5",
                                 "--tls-cert-file", first.cert, "--tls-key-file", first.key], ctx, name="tls-gateway")
    try:
        assert http_status(f"http://127.0.0.1:{gw.port}/health") is None  # plain HTTP gets no answer
        wait_for(lambda: answers(gw.port, "/readiness", ctx), "the TLS gateway is ready")
        conn = http.client.HTTPSConnection("127.0.0.1", gw.port, context=ctx, timeout=10)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(CHAT), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        resp.read()
        before = conn.sock.getpeercert(binary_form=True)
        assert "tls=on" in posture_line(gw)

        Pki.write(pki.ca.issue_cert("127.0.0.1"), first)  # a new certificate in the same files
        os.kill(gw.popen.pid, signal.SIGHUP)
        after = wait_for(lambda: (lambda der: der if der != before else None)(https_get(gw.port, "/health", ctx)[1]),
                         "new connections get the reloaded certificate")
        conn.request("GET", "/health")  # the connection opened before the reload is still served
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read()
        assert conn.sock.getpeercert(binary_form=True) == before
        conn.close()

        Pki.write(pki.ca.issue_cert("127.0.0.1"), first)  # a reload that cannot load keeps what it had:
        Path(first.key).write_text("not a key\n")  # a new certificate, its key unreadable
        os.kill(gw.popen.pid, signal.SIGHUP)
        wait_for(lambda: "certificate not reloaded, the previous one stays" in gateway_log(gw), "the failed reload")
        assert https_get(gw.port, "/health", ctx) == (200, after)
        assert gw.popen.poll() is None
        assert gateway_log(gw).count("TLS server certificate reloaded") == 1
    finally:
        gw.stop()


def test_mtls_to_a_simulated_worker_that_requires_client_certificates(pki, start_gateway):
    client = pki.issue("gateway-client", "kvgate-gateway")
    sim = tls_sim(pki, pki.issue("worker", "127.0.0.1"), "--ssl-ca-certs", pki.ca_file, "--ssl-cert-reqs", "2",
                  probe=client_context(pki.ca_file, client))
    try:
        assert not answers(sim.port, "/health", client_context(pki.ca_file)), "the worker must require a client cert"
        gw = start_gateway(sim.url, args=("--worker-ca-file", pki.ca_file, "--worker-client-cert-file", client.cert,
                                          "--worker-client-key-file", client.key))
        status, data = request_json("POST", gw.url + "/v1/chat/completions", CHAT)
        assert status == 200, data
        assert "worker_tls=mtls" in posture_line(gw)

        no_cert = start_gateway(sim.url, ready=False, args=("--worker-ca-file", pki.ca_file))
        error = wait_for(lambda: listed(no_cert.url)[sim.url]["last_error"], "the health error without a client cert")
        assert "client certificate" in error and "--worker-client-cert-file" in error, error
        assert not listed(no_cert.url)[sim.url]["healthy"]
    finally:
        sim.stop()


@pytest.mark.parametrize("case", ["unknown CA", "other host"])
def test_a_worker_with_a_wrong_certificate_is_refused_with_a_clear_health_error(pki, start_gateway, case):
    if case == "unknown CA":
        rogue_ca = trustme.CA()
        server = pki.issue("rogue", "127.0.0.1", ca=rogue_ca)
        probe_ca = pki.folder / "rogue-ca.pem"
        rogue_ca.cert_pem.write_to_path(str(probe_ca))
        sim = tls_sim(pki, server, probe=client_context(str(probe_ca)))
        expected = "certificate verify failed"
    else:
        server = pki.issue("elsewhere", "worker.example")
        probe = client_context(pki.ca_file)
        probe.check_hostname = False
        sim = tls_sim(pki, server, probe=probe)
        expected = "IP address mismatch"
    try:
        gw = start_gateway(sim.url, ready=False, args=("--worker-ca-file", pki.ca_file))
        error = wait_for(lambda: listed(gw.url)[sim.url]["last_error"], "the health error")
        assert "TLS: the worker's certificate was rejected" in error and expected in error, error
        assert not listed(gw.url)[sim.url]["healthy"]
        assert request_json("GET", gw.url + "/readiness")[0] == 503
    finally:
        sim.stop()
