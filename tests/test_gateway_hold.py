"""Late binding: a policy answers ``Hold`` and the gateway keeps the request until a
worker can start it (real gateway, real simulated workers, real HTTP on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import os
import socket
import textwrap
import time
import urllib.parse

import aiohttp
import pytest

from tests.conftest import MODEL
from tests.requires import need
from tests.support import ROOT, get_text, metric_value, request_json

PLUGIN = textwrap.dedent('''
    from policies import Choice, Hold, Policy

    class AlwaysHold(Policy):
        """Holds every request for as long as the gateway allows, then takes the first worker."""
        name = "always_hold"

        def select(self, request, workers):
            if request.may_hold:
                return Hold(retry_s=0.1, reason="testing the cap")
            return Choice(workers[0], reason=f"held {request.held_s:.2f}s")

    class OneAtATime(Policy):
        """Holds while any worker has a request in flight; only an event can wake it early."""
        name = "one_at_a_time"

        def select(self, request, workers):
            if request.may_hold and any(w.in_flight for w in workers):
                return Hold(retry_s=60.0, reason="busy")
            return Choice(workers[0], reason="idle")

    class IgnoresMayHold(Policy):
        """A broken plugin: holds even when told it may not."""
        name = "ignores_may_hold"

        def select(self, request, workers):
            return Hold(retry_s=0.1)
''')


@pytest.fixture
def plugin_env(tmp_path):
    pkg = tmp_path / "hold_plugins"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(PLUGIN)
    return {"PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}


def _complete(url: str, prompt: str, max_tokens: int, out: dict, key: str) -> None:
    t0 = time.monotonic()
    out[key] = request_json("POST", url + "/v1/completions",
                            {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True},
                            timeout=60)
    out[key + "_s"] = time.monotonic() - t0


def test_cost_holds_a_request_that_does_not_fit_until_memory_frees(start_sim, start_gateway):
    """Two prompts that do not both fit in the worker's KV pool: the second is held at the
    gateway (not queued in the engine) and sent as soon as the first ends."""
    sim = start_sim("--time-scale", "1", "--max-total-tokens", "6000")
    gw = start_gateway(sim.url, args=("--policy", "cost", "--tokenizer", "byte", "--max-hold-secs", "20",
                                      "--policy-option", "hold_wait_s=0.05"))
    out = _held_until_the_first_ends(gw.url)
    assert out["b"] == 200, out
    metrics = get_text(gw.url + "/metrics")
    assert metric_value(metrics, "kvgate_held_total") == 1
    held_s = metric_value(metrics, "kvgate_hold_seconds_sum")
    assert 0 < held_s < 15, held_s  # released by the first one's end, long before the 20 s cap
    assert metric_value(metrics, "kvgate_held_requests") == 0
    assert metric_value(metrics, "kvgate_policy_stat", stat="booked_kv_tokens") == 0


def _held_until_the_first_ends(gw_url: str) -> dict:
    """A long streamed request "a" (~20 s of decoding at time-scale 1), and "b" sent once "a"
    streams. Once the gateway holds "b" (waited for, never timed: however slow the machine,
    "a" is still running), "a"'s client goes away, which ends "a" at once and must wake "b"."""

    async def main() -> dict:
        out: dict = {}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            a = await s.post(gw_url + "/v1/completions", json={
                "model": MODEL, "prompt": "a" * 3500, "max_tokens": 2000, "ignore_eos": True, "stream": True})
            assert a.status == 200 and await a.content.readany()  # routed and running
            b = asyncio.create_task(s.post(gw_url + "/v1/completions", json={
                "model": MODEL, "prompt": "b" * 3500, "max_tokens": 20, "ignore_eos": True}))
            deadline = time.monotonic() + 10
            while True:
                async with s.get(gw_url + "/metrics") as m:
                    if metric_value(await m.text(), "kvgate_held_requests") >= 1:
                        break
                assert not b.done() and time.monotonic() < deadline, "the second request was never held"
                await asyncio.sleep(0.02)
            t0 = time.monotonic()
            a.close()
            resp = await b
            out["b"], out["b_s"] = resp.status, time.monotonic() - t0
            resp.release()
        return out

    return asyncio.run(main())


def test_a_finished_request_wakes_the_held_ones(start_sim, start_gateway, plugin_env):
    """The held request asks to be retried in 60 s and may be held 20 s: only the first
    request's end can release it sooner."""
    sim = start_sim("--time-scale", "1")
    gw = start_gateway(sim.url, args=("--policy", "hold_plugins:OneAtATime", "--max-hold-secs", "20"),
                       env=plugin_env)
    out = _held_until_the_first_ends(gw.url)
    assert out["b"] == 200, out
    metrics = get_text(gw.url + "/metrics")
    assert metric_value(metrics, "kvgate_held_total") == 1
    assert 0.0 < metric_value(metrics, "kvgate_hold_seconds_sum") < 15
    assert out["b_s"] < 15, out  # woken by the first one's end, not by the 20 s cap or the 60 s retry


def test_a_hold_ends_at_max_hold_secs_and_the_policy_must_choose(start_sim, start_gateway, plugin_env):
    sim = start_sim("--time-scale", "20")
    gw = start_gateway(sim.url, args=("--policy", "hold_plugins:AlwaysHold", "--max-hold-secs", "0.6"),
                       env=plugin_env)
    out: dict = {}
    _complete(gw.url, "hello", 2, out, "r")
    assert out["r"][0] == 200 and out["r_s"] >= 0.6, out
    metrics = get_text(gw.url + "/metrics")
    assert metric_value(metrics, "kvgate_held_total") == 1
    assert 0.6 <= metric_value(metrics, "kvgate_hold_seconds_sum") < 5
    assert metric_value(metrics, "kvgate_routed_total", worker=sim.url) == 1


def test_a_client_that_leaves_while_held_is_never_sent_upstream(start_sim, start_gateway, plugin_env):
    sim = start_sim("--time-scale", "20")
    gw = start_gateway(sim.url, args=("--policy", "hold_plugins:AlwaysHold", "--max-hold-secs", "30"),
                       env=plugin_env)
    host = urllib.parse.urlsplit(gw.url)
    body = f'{{"model": "{MODEL}", "prompt": "bye", "max_tokens": 2}}'.encode()
    with socket.create_connection((host.hostname, host.port), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 10
        while metric_value(get_text(gw.url + "/metrics"), "kvgate_held_requests") < 1:
            assert time.monotonic() < deadline, "the request was never held"
            time.sleep(0.02)
    deadline = time.monotonic() + 10
    while metric_value(metrics := get_text(gw.url + "/metrics"), "kvgate_held_requests") > 0:
        assert time.monotonic() < deadline, "the held request outlived its client"
        time.sleep(0.05)
    assert metric_value(metrics, "kvgate_routed_total") == 0
    status, _ = request_json("GET", gw.url + "/v1/models")
    assert status == 200


def test_a_policy_that_holds_when_told_not_to_gets_a_clear_error(start_sim, start_gateway, plugin_env):
    sim = start_sim("--time-scale", "20")
    gw = start_gateway(sim.url, args=("--policy", "hold_plugins:IgnoresMayHold", "--max-hold-secs", "0"),
                       env=plugin_env)
    status, body = request_json("POST", gw.url + "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert status == 500 and body["error"]["code"] == "policy_error", body
    assert "told not to hold" in body["error"]["message"]
    status, _ = request_json("GET", gw.url + "/v1/models")
    assert status == 200


def test_pd_pairs_are_held_and_chosen_together(plugin_env):
    """In PD mode the prefill policy holds; the pair is chosen when it lets go."""
    need("mooncake.engine", "the Mooncake transfer engine, pip extra 'mooncake'")
    from tests.conftest import _start_gateway, _start_sim
    from tests.support import FREE_PORT

    procs: list = []
    try:
        prefill = _start_sim(procs, "--time-scale", "20", "--disaggregation-mode", "prefill",
                             "--disaggregation-bootstrap-port", FREE_PORT, name="prefill")
        port = prefill.ports[0]
        decode = _start_sim(procs, "--time-scale", "20", "--disaggregation-mode", "decode", name="decode")
        gw = _start_gateway(procs, args=("--pd-disaggregation", "--prefill", prefill.url, str(port),
                                         "--decode", decode.url, "--policy", "hold_plugins:AlwaysHold",
                                         "--max-hold-secs", "0.5"), env=plugin_env)
        status, data = request_json("POST", gw.url + "/generate",
                                    {"text": "held pair", "sampling_params": {"max_new_tokens": 2}})
        assert status == 200 and data["meta_info"]["completion_tokens"] == 2, data
        metrics = get_text(gw.url + "/metrics")
        assert metric_value(metrics, "kvgate_held_total") == 1
        assert metric_value(metrics, "kvgate_hold_seconds_sum") >= 0.5
        assert metric_value(metrics, "kvgate_routed_total") == 2  # one prefill and one decode attempt
    finally:
        for p in procs:
            p.stop()


def test_the_hold_room_wakes_in_order_and_forgets_the_ones_that_left():
    import asyncio

    from gateway.hold import HoldRoom

    async def main() -> list[str]:
        room, order = HoldRoom(max_hold_s=10, wake=0), []

        async def held(name: str, timeout: float) -> None:
            await room.wait(timeout)
            order.append(name)

        tasks = [asyncio.create_task(held(n, 5)) for n in ("first", "second", "third")]
        gone = asyncio.create_task(held("gone", 5))
        await asyncio.sleep(0.01)
        assert room.held == 4
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        assert room.held == 3  # a cancelled waiter (its client left) is not kept
        room.notify()  # wake=0: every held request
        await asyncio.gather(*tasks)
        assert room.held == 0
        await held("timer", 0.05)  # nothing notifies: the timeout ends the wait
        return order

    assert asyncio.run(main()) == ["first", "second", "third", "timer"]


def test_an_event_wakes_a_few_and_each_that_goes_wakes_the_next():
    """An event decides only ``wake`` held requests again, not all of them (each is a policy
    decision), those decided least recently first; one that then goes to a worker
    (``committed``) wakes the next. One held again goes to the back of the line, so requests
    that cannot start yet do not take every event's turns from the others."""
    import asyncio

    from gateway.hold import HoldRoom

    async def main() -> None:
        room = HoldRoom(max_hold_s=10, wake=2)
        woken: list[int] = []
        goes = set()

        async def held(i: int) -> None:
            while True:
                if await room.wait(30):
                    woken.append(i)
                    if i in goes:
                        room.committed()
                        return

        tasks = []
        for i in range(1, 7):
            tasks.append(asyncio.create_task(held(i)))
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        assert room.held == 6
        room.notify()
        await asyncio.sleep(0.01)
        assert woken == [1, 2] and room.held == 6  # held again: now behind 3, 4, 5, 6
        goes.update({3, 4})
        room.notify()
        await asyncio.sleep(0.01)
        # 3 and 4 go, each waking one more (5, 6), held again; 1 and 2 were not asked again.
        assert woken == [1, 2, 3, 4, 5, 6] and room.held == 4
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert room.held == 0

    asyncio.run(main())


def test_retries_that_find_no_room_back_off():
    """A policy asks for a retry every 10 ms and never finds room: held for 1.5 s with no
    event, the request is decided ~8 times (10 ms doubling to 1 s), not ~150. (The
    gateway's hold path in process: an event from any other request would wake it.)"""
    import asyncio

    from gateway.metrics import GatewayMetrics
    from gateway.proxy import Proxy
    from policies import Choice, Hold, Policy, RequestView, WorkerView

    worker = WorkerView("http://127.0.0.1:9")

    class RetriesFast(Policy):
        name = "retries_fast"

        def select(self, request, workers):
            return Hold(retry_s=0.01) if request.may_hold else Choice(workers[0])

    async def main() -> tuple[int, float]:
        policy, decisions = RetriesFast(), 0
        proxy = Proxy(None, policy, None, GatewayMetrics(), max_retries=0, max_hold_s=1.5)  # type: ignore[arg-type]
        view = RequestView("r", "/generate", text="hello")

        async def decide(asked: RequestView):  # the view as the hold loop replaced it
            nonlocal decisions
            decisions += 1
            return policy.select(asked, [worker])

        t0 = time.monotonic()
        choice, _ = await proxy.attempts.choose(view, decide, first=True)
        assert choice.worker is worker
        return decisions, time.monotonic() - t0

    decisions, held_s = asyncio.run(main())
    assert held_s >= 1.5 and 5 <= decisions <= 12, (decisions, held_s)
