"""Sick workers: hanging, slow, answering garbage, flapping health. Each test checks what the
affected client sees AND that the requests running beside it all succeed."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import aiohttp

from tests.conftest import MODEL
from tests.support import get_text, metric_value, request_json
from tests.test_gateway_faults import workers


def timed_chat(url: str, i: int, stream: bool = False) -> tuple[int, object, float]:
    started = time.monotonic()
    status, data = request_json("POST", url + "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 4,
        "stream": stream}, timeout=30)
    return status, data, time.monotonic() - started


def burst(url: str, n: int = 8) -> list[tuple[int, object, float]]:
    """n concurrent chats, every other one streamed."""
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda i: timed_chat(url, i, stream=i % 2 == 1), range(n)))


def assert_error(data: object, status_type: str, code: str) -> str:
    assert isinstance(data, dict) and data["error"]["type"] == status_type and data["error"]["code"] == code, data
    return data["error"]["message"]


def sick_and_well(start_sim, start_gateway, fault: tuple[str, ...], gateway_args: tuple[str, ...]):
    """A faulty and a healthy worker behind a round-robin gateway, and a burst through it that all succeeds."""
    sick = start_sim("--time-scale", "50", *fault, name="sick")
    well = start_sim("--time-scale", "50", name="well")
    gw = start_gateway(sick.url, well.url, args=("--policy", "round_robin", *gateway_args))
    results = burst(gw.url)
    assert [s for s, _, _ in results] == [200] * 8, results
    return sick, well, gw, results


def test_hanging_worker_is_retried_before_first_byte_and_alone_gives_504(start_sim, start_gateway):
    hang, good, gw, results = sick_and_well(start_sim, start_gateway, ("--fault-hang-rate", "1.0"),
                                            ("--request-timeout-secs", "1"))
    assert any(t >= 1.0 for _, _, t in results)  # some went to the hanging worker first
    m = get_text(gw.url + "/metrics")
    assert metric_value(m, "kvgate_upstream_errors_total", worker=hang.url, kind="timeout") >= 1
    assert metric_value(m, "kvgate_upstream_errors_total", worker=good.url) == 0

    alone = start_gateway(hang.url, args=("--request-timeout-secs", "1"))
    status, data = request_json("POST", alone.url + "/v1/chat/completions",
                                {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    assert status == 504
    assert "within the request timeout" in assert_error(data, "timeout_error", "upstream_timeout")
    m = get_text(alone.url + "/metrics")  # one attempt: a worker that timed out is not asked again
    assert metric_value(m, "kvgate_upstream_errors_total", worker=hang.url) == 1
    assert metric_value(m, "kvgate_retries_total") == 0
    hang.kill()  # its handlers never end, so a polite stop would wait for them


def test_slow_worker_delays_only_its_own_requests(start_sim, start_gateway):
    slow, well, gw, results = sick_and_well(start_sim, start_gateway, ("--fault-latency-ms", "3000"),
                                            ("--request-timeout-secs", "20"))
    m = get_text(gw.url + "/metrics")
    assert metric_value(m, "kvgate_routed_total", worker=slow.url) == metric_value(
        m, "kvgate_routed_total", worker=well.url) == 4
    times = sorted(t for _, _, t in results)
    # Half waited for the slow worker's 3 s, half did not: a 4-token answer at time-scale 50
    # takes a few ms, so "less than the injected delay alone" leaves a margin of hundreds.
    assert times[4] >= 3.0 and times[3] < 3.0, times
    assert metric_value(m, "kvgate_upstream_errors_total") == 0 and metric_value(m, "kvgate_retries_total") == 0


def test_garbage_answers_become_502_json_and_the_gateway_keeps_serving(start_sim, start_gateway):
    junk = start_sim("--time-scale", "50", "--fault-garbage-rate", "1.0", name="junk")
    good = start_sim("--time-scale", "50", name="good")
    # no retries: the clients routed to the broken worker see a clear 502, the others 200
    gw = start_gateway(junk.url, good.url, args=("--max-retries", "0", "--policy", "round_robin"))
    results = burst(gw.url)
    statuses = sorted(s for s, _, _ in results)
    assert statuses == [200] * 4 + [502] * 4, results
    for status, data, _ in results:
        if status == 502:
            assert "malformed JSON" in assert_error(data, "upstream_error", "upstream_unavailable")
        else:
            assert data.rstrip().endswith("data: [DONE]") if isinstance(data, str) else data["choices"]
    assert all(timed_chat(gw.url, i)[0] in (200, 502) for i in range(4))
    assert request_json("GET", gw.url + "/readiness")[0] == 200
    # with retries (the default) the broken worker costs a retry, never an error
    retrying = start_gateway(junk.url, good.url, args=("--policy", "round_robin"))
    results = burst(retrying.url)
    assert [s for s, _, _ in results] == [200] * 8, results
    m = get_text(retrying.url + "/metrics")
    assert metric_value(m, "kvgate_upstream_errors_total", worker=junk.url, kind="malformed") >= 1


def test_flapping_health_leaves_and_rejoins_rotation_without_client_errors(start_sim, start_gateway):
    flappy = start_sim("--time-scale", "50", "--fault-health-flap-secs", "1.5", name="flappy")
    steady = start_sim("--time-scale", "50", name="steady")
    gw = start_gateway(flappy.url, steady.url, args=("--health-failure-threshold", "2",
                                                     "--health-success-threshold", "2"))
    seen: list[bool] = []
    statuses: list[int] = []
    deadline = time.monotonic() + 30  # the flap takes ~4 s; a busy machine may take longer

    def left_and_rejoined() -> bool:
        states = "".join("u" if h else "d" for h in seen)
        return "ud" in states and "u" in states[states.index("ud") + 1:]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        while not left_and_rejoined():
            assert time.monotonic() < deadline, seen
            seen.append(workers(gw.url)[flappy.url]["healthy"])
            statuses += [s for s, _, _ in pool.map(lambda i: timed_chat(gw.url, i), range(4))]
            time.sleep(0.1)
    assert statuses and set(statuses) == {200}, statuses
    assert workers(gw.url)[steady.url]["healthy"] is True


async def _streams_beside_hang_ups(url: str, n: int) -> list[bytes]:
    """n streams that read to the end while n others hang up after their first event."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "stream"}], "max_tokens": 200, "stream": True}

    async def one(hang_up: bool) -> bytes:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            async with s.post(url + "/v1/chat/completions", json=body) as resp:
                raw = b""
                async for chunk in resp.content.iter_any():
                    raw += chunk
                    if hang_up and b"\n\n" in raw:
                        return b"hung up"
                return raw

    return await asyncio.gather(*(one(i % 2 == 1) for i in range(2 * n)))


def test_clients_hanging_up_do_not_break_other_streams(start_sim, start_gateway):
    sim = start_sim("--time-scale", "2")
    gw = start_gateway(sim.url)
    results = asyncio.run(_streams_beside_hang_ups(gw.url, 4))
    finished = [r for r in results if r != b"hung up"]
    assert len(finished) == 4
    for raw in finished:
        assert raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw, raw[-300:]
    assert metric_value(get_text(gw.url + "/metrics"), "kvgate_upstream_errors_total") == 0
