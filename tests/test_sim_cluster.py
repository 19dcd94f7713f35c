"""SimCluster and ``kvgate sim`` start real worker processes and stop them cleanly."""

from __future__ import annotations

import json
import signal
import time
import urllib.request

import pytest

from simulator.cluster import SimCluster, bind_failed
from tests.support import Proc, http_status


def test_sim_cluster_start_stop():
    with SimCluster(workers=2, engine_args=["--time-scale", "20"], startup_timeout=30, kv_events=True) as c:
        assert len(c.urls) == 2 and len(set(c.urls)) == 2
        assert set(c.kv_event_endpoints) == set(c.urls)
        for url in c.urls:
            info = json.loads(urllib.request.urlopen(url + "/server_info", timeout=5).read())
            assert info["time_scale"] == 20
            port = c.kv_event_endpoints[url].rsplit(":", 1)[1]
            assert info["kv_events"]["endpoint"] == f"tcp://*:{port}"
        urls = list(c.urls)
    assert all(http_status(u + "/health") is None for u in urls)


def test_sim_cluster_dp_ranks_get_port_runs():
    with SimCluster(workers=2, engine_args=["--time-scale", "20", "--dp-size", "2"]) as c:
        for url in c.urls:
            loads = json.loads(urllib.request.urlopen(url + "/v1/loads", timeout=5).read())["loads"]
            assert [x["dp_rank"] for x in loads] == [0, 1]


def test_kvgate_sim_cli_prints_urls_and_stops_on_sigterm():
    proc = Proc.python("simulator", "sim", "--workers", "2", "--time-scale", "20", name="kvgate-sim")
    try:
        deadline = time.monotonic() + 30
        urls: list[str] = []
        while time.monotonic() < deadline and len(urls) < 2:
            urls = [ln.split()[1] for ln in proc.output().splitlines() if ln.startswith("worker ")]
            time.sleep(0.1)
        assert len(urls) == 2, proc.output()
        assert all(http_status(u + "/health") == 200 for u in urls)
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(15) == 0
        assert all(http_status(u + "/health") is None for u in urls)
    finally:
        proc.stop()


@pytest.mark.parametrize("kv_events, taken_at, picks", [(False, 0, 2), (True, 1, 6)], ids=["http", "kv-publisher"])
def test_sim_cluster_picks_again_when_a_port_is_taken_before_the_worker_binds(monkeypatch, kv_events, taken_at, picks):
    """Ports are picked free and bound later by the worker process; another process can
    take one in between (it happened in a benchmark). The cluster then retries with new ports,
    also for a KV-event publisher port, whose bind error ZMQ words its own way. Ports are
    handed out in order: HTTP, then the KV publisher and its replay socket."""
    import socket

    import simulator.cluster as cluster

    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    real, handed = cluster._free_port, []

    def one_taken(host: str) -> int:
        port = taken if len(handed) == taken_at else real(host)
        handed.append(port)
        return port

    monkeypatch.setattr(cluster, "_free_port", one_taken)
    try:
        with SimCluster(workers=1, engine_args=["--time-scale", "20"], kv_events=kv_events) as c:
            assert handed[taken_at] == taken and len(handed) >= picks
            assert c.urls and not c.urls[0].endswith(f":{taken}")
            if kv_events:
                assert c.kv_event_endpoints[c.urls[0]] != f"tcp://127.0.0.1:{taken}"
            assert http_status(c.urls[0] + "/health") == 200
    finally:
        squatter.close()


def test_two_workers_never_get_the_same_port_when_a_free_pick_repeats(monkeypatch):
    """Two free-port picks can return the same port; the second worker's readiness check
    would then be answered by the first, and a router given the list would see one URL
    twice. The cluster picks again until its ports are distinct."""
    import simulator.cluster as cluster

    real, handed = cluster._free_port, []

    def repeats_the_first(host: str) -> int:
        port = handed[0] if len(handed) == 1 else real(host)
        handed.append(port)
        return port

    monkeypatch.setattr(cluster, "_free_port", repeats_the_first)
    with SimCluster(workers=2, engine_args=["--time-scale", "20"], kv_events=False) as c:
        assert handed[0] == handed[1]  # the repeat was handed out, and passed over
        assert len(set(c.urls)) == 2
        assert all(http_status(u + "/health") == 200 for u in c.urls)


def test_a_port_answering_zmq_is_not_ready_rather_than_a_crash():
    """CI once saw a worker's picked HTTP port taken first by another worker's ZMQ socket:
    the readiness poll got ZMQ's greeting and the whole cluster start raised. It must read
    as "not up yet", so the worker's own bind failure leads to the retry with new ports."""
    import socket
    import threading

    from simulator.cluster import _status

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()

        def greet() -> None:  # read the HTTP request, answer ZMTP's signature, hang up cleanly
            conn, _ = server.accept()
            with conn:
                data = b""
                while b"\r\n\r\n" not in data and len(data) < 65536:
                    data += conn.recv(4096) or b"\r\n\r\n"
                conn.sendall(b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f")
                conn.shutdown(socket.SHUT_WR)
                conn.recv(16)

        threading.Thread(target=greet, daemon=True).start()
        assert _status(f"http://127.0.0.1:{server.getsockname()[1]}/health") is None


def test_a_killed_worker_restarts_on_its_ports_once_they_are_free_again():
    """A worker killed and started again keeps its URL (a gateway's list names it); a port
    taken meanwhile (here: squatted for a moment) delays the restart instead of failing it."""
    import socket
    import threading

    with SimCluster(workers=2, engine_args=["--time-scale", "20"], kv_events=True) as c:
        url = c.urls[0]
        c.kill(url)
        assert http_status(url + "/health") is None and c.dead() == [(url, -signal.SIGKILL)]
        squat = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        squat.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the old server's connections linger
        squat.bind(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        squat.listen()
        timer = threading.Timer(4.0, squat.close)  # past the first try's start-up (~1-2 s)
        timer.start()
        try:
            c.restart(url)
        finally:
            timer.cancel()
            squat.close()
        assert http_status(url + "/health") == 200 and c.alive() == c.urls
        log = c.log_paths[0]
        assert len(c.log_paths) == 2 and not log.name.endswith(".r1.log")  # tried again
        assert bind_failed(log.with_name(log.name.split(".")[0] + ".r1.log").read_text())


def test_a_test_process_whose_port_is_taken_starts_again_on_another(monkeypatch):
    """tests.support.launch: a child that exits on a bind error is started again on new
    ports (its output is read after it was stopped)."""
    import socket

    import tests.support as support
    from tests.sim_support import spawn_sim

    squat = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squat.bind(("127.0.0.1", 0))
    squat.listen()
    real, picks = support.free_port, []

    def pick() -> int:
        picks.append(real() if picks else squat.getsockname()[1])
        return picks[-1]

    monkeypatch.setattr(support, "free_port", pick)
    try:
        proc = spawn_sim("--time-scale", "20")
        try:
            # picks[1:] are real picks; a pick whose neighbour is taken is skipped (``_spaced_port``)
            assert picks[0] == squat.getsockname()[1] and len(picks) >= 2 and proc.url.endswith(f":{picks[-1]}")
            assert http_status(proc.url + "/health") == 200
        finally:
            proc.stop()
    finally:
        squat.close()
