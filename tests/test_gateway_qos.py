"""Multi-tenant QoS across the wire: a real gateway with a tenants file in front of
simulated workers (or a recording upstream where the bytes sent are the point), all on
127.0.0.1. The scheduler's arithmetic is tests/test_qos_fair_queue.py's."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from tests.conftest import MODEL
from tests.support import get_text, metric_value
from tests.support import wait_until as wait_for
from tests.test_gateway_wire import Recorder, post

TENANTS = """
classes:
  interactive: {priority: 10}
  standard: {priority: 0}
  batch: {priority: -10}
default_class: standard
engine_priority: %(engine_priority)s
budget_window_secs: %(window)s
tenants:
  alpha: {keys: [sk-alpha], classes: [interactive, standard, batch]}
  beta: {keys: [sk-beta], requests_per_minute: 2}
"""


def tenants_file(tmp_path: Path, engine_priority: bool = False, window: float = 3.0, extra: str = "") -> str:
    path = tmp_path / f"tenants-{engine_priority}-{window}.yaml"
    path.write_text(TENANTS % {"engine_priority": str(engine_priority).lower(), "window": window} + extra)
    return str(path)




def completion(gw, key: str, max_tokens: int = 4, headers: dict[str, str] | None = None, stream: bool = False,
               **extra: object) -> tuple[int, bytes, dict[str, str]]:
    body = json.dumps({"model": MODEL, "prompt": "the quick brown fox", "max_tokens": max_tokens,
                       "ignore_eos": True, "stream": stream, **extra}).encode()
    return post(gw.url + "/v1/completions", body, {"Authorization": f"Bearer {key}", **(headers or {})})


def queued(gw) -> float:
    return metric_value(get_text(gw.url + "/metrics"), "kvgate_qos_queued")


def test_a_queued_high_priority_request_is_admitted_before_earlier_low_priority_ones(start_sim, start_gateway,
                                                                                      tmp_path):
    sim = start_sim()
    gw = start_gateway(sim.url, args=("--tenants-file", tenants_file(tmp_path), "--policy", "round_robin",
                                      "--max-concurrent-requests", "1"))
    finished: list[str] = []
    lock = threading.Lock()

    def send(name: str, cls: str, max_tokens: int = 4) -> None:
        status, _, _ = completion(gw, "sk-alpha", max_tokens, {"X-Priority": cls})
        with lock:
            finished.append(f"{name}:{status}")

    threads = [threading.Thread(target=send, args=("running", "batch", 150), daemon=True)]
    threads[0].start()
    wait_for(lambda: metric_value(get_text(gw.url + "/metrics"), "kvgate_qos_admitted_total") == 1,
             why="the long request holds the one slot")
    for name, cls in (("low1", "batch"), ("low2", "batch"), ("high", "interactive")):
        threads.append(threading.Thread(target=send, args=(name, cls), daemon=True))
        threads[-1].start()
        wait_for(lambda n=len(threads) - 1: queued(gw) == n, why=f"{name} queued")
    assert not finished, "the long request ended before the queue was built: the test proves nothing"
    for t in threads:
        t.join(60)
    assert finished == ["running:200", "high:200", "low1:200", "low2:200"]
    text = get_text(gw.url + "/metrics")
    assert metric_value(text, "kvgate_qos_admitted_total", tenant="alpha", **{"class": "interactive"}) == 1
    assert metric_value(text, "kvgate_qos_ttft_seconds_count", tenant="alpha", **{"class": "batch"}) == 3


def test_a_tenant_over_its_budget_gets_429_with_the_headers_and_is_let_in_after_the_window(start_sim, start_gateway,
                                                                                        tmp_path):
    sim = start_sim()
    gw = start_gateway(sim.url, args=("--tenants-file", tenants_file(tmp_path, window=3.0)))
    status, _, headers = completion(gw, "sk-beta")
    assert status == 200 and headers["x-ratelimit-remaining-requests"] == "1"
    status, body, headers = completion(gw, "sk-beta", stream=True)  # a stream's headers carry them too
    assert status == 200 and b"[DONE]" in body and headers["x-ratelimit-remaining-requests"] == "0"
    status, body, headers = completion(gw, "sk-beta")
    assert status == 429 and json.loads(body)["error"]["code"] == "requests_budget_exceeded"
    assert headers["x-ratelimit-limit-requests"] == "2" and headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"].endswith("s") and 1 <= int(headers["Retry-After"]) <= 2
    assert completion(gw, "sk-alpha")[0] == 200  # another tenant is not affected
    assert "x-ratelimit-limit-requests" not in completion(gw, "sk-alpha")[2]  # alpha has no budget
    started = time.monotonic()
    wait_for(lambda: completion(gw, "sk-beta")[0] == 200, timeout=5, why="beta let in again")
    assert time.monotonic() - started >= 0.5  # not before the bucket refilled (1.5 s a request)
    assert metric_value(get_text(gw.url + "/metrics"), "kvgate_qos_rejected_total", tenant="beta",
                        reason="requests_budget_exceeded") >= 1


def test_priority_reaches_the_engine_only_when_configured(start_gateway, tmp_path):
    with Recorder() as rec:
        on = start_gateway(rec.url, args=("--tenants-file", tenants_file(tmp_path, engine_priority=True)))
        off = start_gateway(rec.url, args=("--tenants-file", tenants_file(tmp_path, engine_priority=False)))
        body = b'{"model":"rec-model", "prompt":"hi","max_tokens":2}'
        auth = {"Authorization": "Bearer sk-alpha"}
        assert post(on.url + "/v1/completions", body, {**auth, "X-Priority": "interactive"})[0] == 200
        assert rec.bodies[-1] == body[:-1] + b',"priority":10}'  # spliced in: nothing else changed
        assert post(on.url + "/v1/completions", body, auth)[0] == 200
        assert rec.bodies[-1] == body[:-1] + b',"priority":0}'  # the tenant's own class
        own = b'{"model":"rec-model","prompt":"hi","priority":-10}'
        assert post(on.url + "/v1/completions", own, auth)[0] == 200
        assert rec.bodies[-1] == own  # the client's own priority, a class's value: untouched
        assert post(off.url + "/v1/completions", body, {**auth, "X-Priority": "interactive"})[0] == 200
        assert rec.bodies[-1] == body and b"priority" not in rec.bodies[-1]
        sent = len(rec.bodies)
        status, answer, _ = post(on.url + "/v1/completions", body,
                                 {"Authorization": "Bearer sk-beta", "X-Priority": "interactive"})
        assert status == 403 and json.loads(answer)["error"]["code"] == "priority_not_allowed"
        status, answer, _ = post(on.url + "/v1/completions", b'{"model":"rec-model","prompt":"hi","priority":99}',
                                 auth)
        assert status == 400 and json.loads(answer)["error"]["code"] == "unknown_priority_class"
        assert len(rec.bodies) == sent  # neither refused request reached the engine


def test_a_class_whose_ttft_objective_no_worker_can_meet_is_refused_at_once(start_sim, start_gateway, tmp_path):
    sim = start_sim()
    path = tmp_path / "slo.yaml"
    path.write_text((TENANTS % {"engine_priority": "false", "window": 60}).replace(
        "classes:\n", "classes:\n  urgent: {priority: 20, ttft_slo_secs: 0.0001}\n", 1)
        + "  gamma: {keys: [sk-gamma], class: urgent}\n")
    gw = start_gateway(sim.url, args=("--tenants-file", str(path), "--tokenizer", "byte"))
    started = time.monotonic()
    status, body, headers = completion(gw, "sk-gamma")
    assert status == 503 and json.loads(body)["error"]["code"] == "slo_unattainable", body
    assert time.monotonic() - started < 2 and headers["Retry-After"] == "1"
    assert completion(gw, "sk-gamma", headers={"X-Priority": "standard"})[0] == 200  # no objective there
    assert metric_value(get_text(gw.url + "/metrics"), "kvgate_qos_rejected_total", tenant="gamma",
                        reason="slo") == 1
