"""The control plane on real processes: the posture said at start-up, admin routes refused on
an exposed bind without an admin key, the worker URL policy before runtime adds and at every
connection (redirects included), and the audit trail.

Every address used is in 127.0.0.0/8. An "exposed" gateway binds 0.0.0.0 (every 127.x address
is loopback, so no loopback bind can honestly count as exposed) and is only ever reached at
127.0.0.1. A refused worker URL points at a listening socket on 127.0.0.3, which must accept
nothing: the refusal happened before any connection.
"""

from __future__ import annotations

import contextlib
import http.server
import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import MODEL
from tests.support import Proc, free_port, get_text, launch, metric_value, request_json
from tests.support import wait_until as wait_for
from tests.test_gateway_security import call

REFUSED_HOST = "127.0.0.3"


class Listener:
    """A listening TCP socket on a 127.x address; ``accepted()`` counts what connected to it
    (a connect completes in the backlog even if never accepted)."""

    def __init__(self, host: str) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind((host, 0))
        self.sock.listen(16)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"

    def accepted(self) -> int:
        count = 0
        for _ in range(64):
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                break
            conn.close()
            count += 1
        return count


@contextlib.contextmanager
def listener(host: str = REFUSED_HOST) -> Iterator[Listener]:
    lst = Listener(host)
    try:
        yield lst
    finally:
        lst.sock.close()


def gateway_log(gw: Proc) -> str:
    return Path(gw.log.name).read_text(errors="replace")


def posture_line(gw: Proc) -> str:
    lines = [ln for ln in gateway_log(gw).splitlines() if "security posture:" in ln]
    assert len(lines) == 1, gateway_log(gw)[-3000:]
    return lines[0]


def audit_lines(gw: Proc, action: str) -> list[str]:
    return [ln for ln in gateway_log(gw).splitlines() if " kvgate.audit: " in ln and f"action={action} " in ln]




def listed(gw_url: str, key: str | None = None) -> dict[str, dict]:
    status, data, _ = call("GET", gw_url + "/workers", key)
    assert status == 200, data
    return {w["url"]: w for w in data["workers"]}


def test_exposed_bind_without_admin_key_refuses_admin_routes(start_sim, start_gateway):
    sim = start_sim("--time-scale", "50")
    gw = start_gateway(sim.url, args=("--host", "0.0.0.0"))
    with listener() as target:
        for method, path, body in [("POST", "/workers", {"url": target.url}),
                                   ("POST", f"/add_worker?url={target.url}", None),
                                   ("DELETE", f"/workers?url={sim.url}", None),
                                   ("POST", f"/remove_worker?url={sim.url}", None),
                                   ("POST", "/flush_cache", None),
                                   ("POST", "/abort_request", {"rid": "", "abort_all": True}),
                                   ("GET", "/workers", None)]:
            status, data, _ = call(method, gw.url + path, None, body)
            assert status == 403, (method, path, data)
            err = data["error"]
            assert err["type"] == "permission_error" and err["code"] == "admin_routes_disabled", data
            assert "--admin-api-key" in err["message"] and "--allow-open-admin" in err["message"], err
        assert target.accepted() == 0
    # the data plane is not affected; the worker is still there
    status, data, _ = call("POST", gw.url + "/v1/chat/completions", None,
                           {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert status == 200, data
    metrics = get_text(gw.url + "/metrics")
    assert metric_value(metrics, "kvgate_security_posture_info", bind="exposed", admin="refused",
                        membership="refused", data="open", metrics="open", tls="off") == 1, metrics
    line = posture_line(gw)
    assert " WARNING kvgate.security: " in line and "bind=0.0.0.0 (exposed)" in line, line
    assert "admin=refused membership=refused" in line and "open_without_credential=data,metrics" in line
    refused = audit_lines(gw, "add_worker")
    assert len(refused) == 2 and all("status=403" in ln and "key=none" in ln and "source=127.0.0.1" in ln
                                     for ln in refused), refused
    assert len(audit_lines(gw, "flush_cache")) == 1 and len(audit_lines(gw, "remove_worker")) == 2


def test_exposed_bind_serves_admin_with_a_key_or_when_allowed(start_sim, start_gateway):
    a = start_sim("--time-scale", "50", name="a")
    b = start_sim("--time-scale", "50", name="b")
    keyed = start_gateway(a.url, args=("--host", "0.0.0.0", "--admin-api-key", "adm-1", "--admin-api-key", "adm-2",
                                       "--protect-metrics"))
    assert call("POST", keyed.url + "/workers", None, {"url": b.url})[0] == 401
    status, data, _ = call("POST", keyed.url + "/workers", "adm-2", {"url": b.url})
    assert status == 201 and data["url"] == b.url, data
    assert call("DELETE", keyed.url + f"/workers?url={b.url}", "adm-1")[0] == 200
    assert call("POST", keyed.url + "/flush_cache", "adm-1")[0] == 200
    assert call("GET", keyed.url + "/metrics")[0] == 401  # --protect-metrics
    status, metrics, _ = call("GET", keyed.url + "/metrics", "adm-1")
    assert status == 200 and 'membership="key"' in metrics and 'metrics="key"' in metrics
    line = posture_line(keyed)
    assert " WARNING " in line and line.endswith("open_without_credential=data"), line  # data routes have no key
    added, removed = audit_lines(keyed, "add_worker"), audit_lines(keyed, "remove_worker")
    assert [ln.split("status=")[1] for ln in added] == ["401", "201"], added
    assert "key=missing" in added[0] and "key=admin_api_key[1]" in added[1] and f'target="{b.url}"' in added[1]
    assert "key=admin_api_key[0]" in removed[0] and "status=200" in removed[0]
    assert re.search(r"time=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z ", added[1]), added[1]
    assert not any(k in gateway_log(keyed) for k in ("adm-1", "adm-2")), "keys in the log"

    allowed = start_gateway(a.url, args=("--host", "0.0.0.0", "--allow-open-admin"))
    status, data, _ = call("POST", allowed.url + "/workers", None, {"url": b.url})
    assert status == 201, data
    assert "admin=open membership=open" in posture_line(allowed)


def test_loopback_bind_says_so_at_info(start_sim, start_gateway):
    sim = start_sim("--time-scale", "50")
    gw = start_gateway(sim.url, args=("--api-key", "k", "--protect-metrics"))
    line = posture_line(gw)
    assert " INFO kvgate.security: " in line and "bind=127.0.0.1 (loopback)" in line, line
    assert "data=key admin=key membership=key metrics=key" in line and "open_without_credential=none" in line


def sim_at(host: str) -> Proc:
    """A simulated worker listening on ``host`` (a 127.x address)."""
    def start() -> Proc:
        port = free_port()
        proc = Proc.python("simulator", "serve", "--host", host, "--port", str(port), "--model-name", MODEL,
                           "--time-scale", "50", name=f"sim-{host}")
        proc.url = f"http://{host}:{port}"
        return proc

    return launch(start, lambda p: p.wait_http(p.url + "/health", timeout=30))


def test_allowlist_admits_listed_workers_and_refuses_others_before_connecting(start_gateway):
    allowed = sim_at("127.0.0.2")
    try:
        gw = start_gateway(ready=False, args=("--worker-url-allow", "127.0.0.2/32"))
        status, data, _ = call("POST", gw.url + "/workers", None, {"url": allowed.url})
        assert status == 201, data
        wait_for(lambda: listed(gw.url)[allowed.url]["healthy"], "the allowed worker turns healthy")
        with listener() as target:
            for url in (target.url, f"http://localhost:{target.port}"):  # a literal, a name
                status, data, _ = call("POST", gw.url + "/workers", None, {"url": url})
                assert status == 403, data
                assert data["error"]["code"] == "worker_url_refused" and "--worker-url-allow" in data["error"]["message"]
            assert target.accepted() == 0, "a refused add connected to its target"
        assert set(listed(gw.url)) == {allowed.url}
        metrics = get_text(gw.url + "/metrics")
        assert metric_value(metrics, "kvgate_worker_url_refused_total", stage="add", reason="not_allowed") == 2
        assert 'worker_allow="1 entry"' in metrics
        refused = [ln for ln in audit_lines(gw, "add_worker") if "status=403" in ln]
        assert len(refused) == 2 and f'target="{target.url}"' in refused[0], refused
        assert gateway_log(gw).count("worker add refused: worker URL") == 2
    finally:
        allowed.stop()


class _Redirecting(http.server.BaseHTTPRequestHandler):
    """A worker that is healthy and redirects everything else to ``self.server.to``."""

    def do_GET(self) -> None:
        if self.path == "/health":
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(307)
        self.send_header("Location", self.server.to + self.path)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def redirecting_worker(host: str, to: str) -> Iterator[str]:
    server = http.server.ThreadingHTTPServer((host, 0), _Redirecting)
    server.to = to
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_every_connection_is_checked_redirects_and_configured_workers_included(start_gateway):
    with listener() as target, listener("127.0.0.1") as local, redirecting_worker("127.0.0.2", target.url) as worker:
        by_name = f"http://localhost:{local.port}"  # a configured name, checked by what it resolves to
        gw = start_gateway(worker, target.url, by_name, ready=False, args=("--worker-url-allow", "127.0.0.2/32"))
        wait_for(lambda: listed(gw.url)[worker]["healthy"], "the redirecting worker is healthy")
        status, data = request_json("GET", gw.url + "/server_info")
        assert status == 503, data  # its answer would have come from the refused host
        refused = wait_for(lambda: listed(gw.url)[target.url]["last_error"], "the configured refused worker's error")
        assert "worker URL policy" in refused and "not in --worker-url-allow" in refused, refused
        assert not listed(gw.url)[target.url]["healthy"]
        named = wait_for(lambda: listed(gw.url)[by_name]["last_error"], "the configured name's error")
        assert "localhost resolves to" in named and "not in --worker-url-allow" in named, named
        assert target.accepted() == 0 and local.accepted() == 0, "a connection reached a refused host"
        metrics = get_text(gw.url + "/metrics")
        assert metric_value(metrics, "kvgate_worker_url_refused_total", stage="connect", reason="not_allowed") >= 3
        assert gateway_log(gw).count("WARNING kvgate.security: connection to '127.0.0.3' refused") == 1  # then DEBUG
