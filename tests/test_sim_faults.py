"""Fault-injection knobs act as advertised on a real worker."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

from tests.sim_support import sim_worker
from tests.support import http_status


def post(url: str, body: dict, timeout: float = 10) -> int:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


BODY = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}


def test_crash_after_n_requests():
    with sim_worker("--time-scale", "50", "--fault-crash-after", "3") as (url, proc):
        assert [post(url + "/generate", BODY) for _ in range(3)] == [200, 200, 200]
        try:
            post(url + "/generate", BODY)
        except (urllib.error.URLError, ConnectionError, socket.timeout):
            pass
        deadline = time.monotonic() + 5
        while proc.popen.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.popen.poll() is not None


def test_fail_rate_latency_and_hang():
    with sim_worker("--time-scale", "50", "--fault-fail-rate", "1.0") as (url, _):
        assert post(url + "/generate", BODY) == 500
    with sim_worker("--time-scale", "50", "--fault-latency-ms", "300") as (url, _):
        t0 = time.monotonic()
        assert post(url + "/generate", BODY) == 200
        assert time.monotonic() - t0 >= 0.3
    with sim_worker("--time-scale", "50", "--fault-hang-rate", "1.0") as (url, _):
        t0 = time.monotonic()
        try:
            post(url + "/generate", BODY, timeout=1.0)
            hung = False
        except (socket.timeout, urllib.error.URLError, TimeoutError):
            hung = True
        assert hung and time.monotonic() - t0 >= 0.9
        assert http_status(url + "/health") == 200  # only generation hangs


def test_health_flaps():
    with sim_worker("--time-scale", "50", "--fault-health-flap-secs", "0.5",
                    timeout=30) as (url, _):
        seen = set()
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and seen != {200, 503}:
            seen.add(http_status(url + "/health"))
            time.sleep(0.05)
        assert seen == {200, 503}
