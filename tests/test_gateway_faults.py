"""Failures upstream: the client sees a clear result and everyone else keeps being served."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import signal
import time

import aiohttp

from tests.conftest import MODEL
from tests.support import get_text, metric_value, refused_address, request_json


def chat(url: str, content: str = "hi", max_tokens: int = 4, **extra) -> tuple[int, object]:
    return request_json("POST", url + "/v1/chat/completions",
                        {"model": MODEL, "messages": [{"role": "user", "content": content}],
                         "max_tokens": max_tokens, **extra})


def wait_metric(gw_url: str, name: str, value: float, timeout: float = 10.0) -> bool:
    """Poll the gateway's /metrics until ``name`` reads ``value`` (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric_value(get_text(gw_url + "/metrics"), name) == value:
            return True
        time.sleep(0.02)
    return False


def workers(gw_url: str) -> dict[str, dict]:
    _, data = request_json("GET", gw_url + "/workers")
    return {w["url"]: w for w in data["workers"]}


def test_failing_worker_is_retried_past_and_its_circuit_opens(start_sim, start_gateway):
    bad = start_sim("--time-scale", "20", "--fault-fail-rate", "1.0", name="bad")
    good = start_sim("--time-scale", "20", name="good")
    gw = start_gateway(bad.url, good.url, args=("--cb-failure-threshold", "2", "--cb-timeout-secs", "60"))
    results = [chat(gw.url, f"q{i}") for i in range(10)]
    assert all(status == 200 for status, _ in results), results
    assert workers(gw.url)[bad.url]["circuit"] == "open"
    metrics = get_text(gw.url + "/metrics")
    assert metric_value(metrics, "kvgate_upstream_errors_total", worker=bad.url) == 2  # then the breaker held
    assert metric_value(metrics, "kvgate_retries_total") == 2


def test_unreachable_worker_is_marked_unhealthy_and_skipped(start_sim, start_gateway):
    good = start_sim("--time-scale", "20")
    with refused_address() as dead:
        gw = start_gateway(dead, good.url)
        assert all(chat(gw.url, f"q{i}")[0] == 200 for i in range(6))
        state = workers(gw.url)
    assert state[dead]["healthy"] is False and state[good.url]["healthy"] is True


async def _stream(url: str, body: dict, *, stop_after: int | None = None, on_chunk=None) -> list[bytes]:
    events: list[bytes] = []
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        async with s.post(url, json=body) as resp:
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    events.append(event)
                    if on_chunk:
                        on_chunk(len(events))
                    if stop_after and len(events) >= stop_after:
                        return events
    return events


def test_worker_killed_mid_stream_without_migration_ends_with_error_frame_then_done(start_sim, start_gateway):
    """With migration off (tests/test_gateway_migration.py has it on), the stream ends so."""
    victim = start_sim("--time-scale", "1", name="victim")
    gw = start_gateway(victim.url, args=("--migration-limit", "0"))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "long answer"}], "max_tokens": 2000,
            "stream": True}

    def kill_after_some(n: int) -> None:
        if n == 3:
            victim.kill(signal.SIGKILL)

    events = asyncio.run(_stream(gw.url + "/v1/chat/completions", body, on_chunk=kill_after_some))
    assert len(events) >= 4
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2].removeprefix(b"data: "))
    assert error["error"]["type"] == "upstream_error" and "mid-stream" in error["error"]["message"]
    for e in events[:-2]:
        json.loads(e.removeprefix(b"data: "))  # every event before it is intact JSON


def test_worker_killed_mid_stream_is_finished_by_another(start_sim, start_gateway):
    victim = start_sim("--time-scale", "1", name="victim")
    survivor = start_sim("--time-scale", "20", name="survivor")
    gw = start_gateway(victim.url, survivor.url, args=("--policy", "round_robin"))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "long answer"}], "max_tokens": 200, "seed": 4}
    _, whole = chat(survivor.url, **body)

    def kill_after_some(n: int) -> None:
        if n == 3:
            victim.kill(signal.SIGKILL)

    events = asyncio.run(_stream(gw.url + "/v1/chat/completions", {**body, "stream": True}, on_chunk=kill_after_some))
    assert events[-1] == b"data: [DONE]" and events.count(b"data: [DONE]") == 1
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == \
        whole["choices"][0]["message"]["content"]
    assert metric_value(get_text(gw.url + "/metrics"), "kvgate_migrations_total") == 1


def test_others_keep_being_served_while_a_worker_dies(start_sim, start_gateway):
    victim = start_sim("--time-scale", "1", name="victim")
    survivor = start_sim("--time-scale", "20", name="survivor")
    gw = start_gateway(victim.url, survivor.url, args=("--policy", "round_robin"))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(chat, gw.url, f"during {i}", 4) for i in range(8)]
        victim.kill(signal.SIGKILL)
        during = [f.result() for f in futures]
    after = [chat(gw.url, f"after {i}") for i in range(10)]
    assert all(status == 200 for status, _ in after), after
    assert all(status == 200 for status, _ in during), during  # failed before first byte -> retried


def test_client_disconnect_cancels_the_upstream_request(start_sim, start_gateway):
    sim = start_sim("--time-scale", "1")
    gw = start_gateway(sim.url)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "very long"}], "max_tokens": 5000, "stream": True}
    asyncio.run(_stream(gw.url + "/v1/chat/completions", body, stop_after=2))
    deadline = time.monotonic() + 10
    running = None
    while time.monotonic() < deadline:
        running = metric_value(get_text(sim.url + "/metrics"), "sglang:num_running_reqs")
        if running == 0:
            break
        time.sleep(0.1)
    assert running == 0


def test_workers_added_and_removed_at_runtime(start_sim, start_gateway):
    a = start_sim("--time-scale", "20", name="a")
    b = start_sim("--time-scale", "20", name="b")
    gw = start_gateway(a.url, args=("--policy", "round_robin"))  # the split below is round robin's
    status, data = request_json("POST", gw.url + "/workers", {"url": b.url})
    assert status == 201 and data["healthy"] is True
    assert request_json("POST", gw.url + "/workers", {"url": b.url})[0] == 409
    for i in range(6):
        assert chat(gw.url, f"q{i}")[0] == 200
    routed = lambda: {u: metric_value(get_text(gw.url + "/metrics"), "kvgate_routed_total", worker=u)
                      for u in (a.url, b.url)}
    before = routed()
    assert before[a.url] == 3 and before[b.url] == 3
    assert request_json("DELETE", gw.url + f"/workers?url={b.url}")[0] == 200
    for i in range(4):
        assert chat(gw.url, f"r{i}")[0] == 200
    after = routed()
    assert after[b.url] == before[b.url] and after[a.url] == before[a.url] + 4
    assert request_json("DELETE", gw.url + f"/workers?url={b.url}")[0] == 404


def test_admission_queue_full_is_429_and_queue_timeout_is_408(start_sim, start_gateway):
    sim = start_sim("--time-scale", "1")
    gw = start_gateway(sim.url, args=("--max-concurrent-requests", "1", "--queue-size", "1",
                                      "--queue-timeout-secs", "1"))
    slow = {"model": MODEL, "messages": [{"role": "user", "content": "slow"}], "max_tokens": 400}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        first = pool.submit(request_json, "POST", gw.url + "/v1/chat/completions", slow)
        # wait until the gateway has really admitted / queued each one: fixed sleeps let a
        # loaded machine deliver the second request after the third, which swaps their answers
        assert wait_metric(gw.url, "kvgate_worker_in_flight", 1), "first request never went upstream"
        queued = pool.submit(request_json, "POST", gw.url + "/v1/chat/completions", slow)
        assert wait_metric(gw.url, "kvgate_queue_depth", 1), "second request never queued"
        status, data = request_json("POST", gw.url + "/v1/chat/completions", slow)
        assert status == 429 and data["error"]["code"] == "queue_full"
        status, data = queued.result()
        assert status == 408 and data["error"]["code"] == "queue_timeout"
        assert first.result()[0] == 200
