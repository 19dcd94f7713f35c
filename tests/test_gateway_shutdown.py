"""SIGTERM drains: in-flight streams finish, new work gets 503 JSON, the process exits 0."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp

from tests.conftest import MODEL

STREAM = {"model": MODEL, "messages": [{"role": "user", "content": "tell a long story"}], "stream": True}


async def read_stream(session: aiohttp.ClientSession, url: str, max_tokens: int, started: asyncio.Event) -> list[bytes]:
    events: list[bytes] = []
    async with session.post(url, json={**STREAM, "max_tokens": max_tokens}) as resp:
        assert resp.status == 200
        buf = b""
        try:
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    events.append(event)
                    started.set()
        except aiohttp.ClientPayloadError:
            events.append(b"<cut>")
    return events


def exit_code(proc, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.popen.poll() is None:
        time.sleep(0.05)
    return proc.popen.poll()


async def _drain_scenario(gw, sim) -> float:
    """Returns when SIGTERM was sent, so the caller times the drain and not the set-up."""
    url = gw.url + "/v1/chat/completions"
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as streams, \
            aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=1)) as keepalive:
        async with keepalive.get(gw.url + "/v1/models") as resp:  # opens the connection we reuse later
            assert resp.status == 200
            await resp.read()
        flags = [asyncio.Event() for _ in range(3)]
        tasks = [asyncio.create_task(read_stream(streams, url, 400, f)) for f in flags]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flags)), 20)
        os.kill(gw.popen.pid, signal.SIGTERM)
        signalled = time.monotonic()
        # until the gateway has seen the signal (a fixed sleep lost that race on a loaded machine);
        # the keep-alive connection stays idle meanwhile, so it is still the one reused below
        deadline = signalled + 10
        while time.monotonic() < deadline:
            async with streams.get(gw.url + "/readiness") as resp:
                if resp.status == 503:
                    break
            await asyncio.sleep(0.02)
        async with keepalive.post(url, json={**STREAM, "stream": False, "max_tokens": 2}) as resp:
            body = await resp.json()
            assert resp.status == 503 and resp.headers["Connection"] == "close", (resp.status, body)
            assert body["error"]["code"] == "shutting_down" and body["error"]["type"] == "service_unavailable"
        async with streams.get(gw.url + "/readiness") as resp:
            body = await resp.json()
            assert resp.status == 503 and body["draining"] is True and body["status"] == "not_ready"
        assert gw.popen.poll() is None  # still draining while streams run
        results = await asyncio.gather(*tasks)
    for events in results:
        assert events[-1] == b"data: [DONE]", events[-3:]
        payloads = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
        assert not any("error" in p for p in payloads)
        assert sum(len(p["choices"][0]["delta"].get("content") or "") for p in payloads if p.get("choices")) > 0
    return signalled


def test_sigterm_lets_streams_finish_and_refuses_new_work(start_sim, start_gateway):
    sim = start_sim("--time-scale", "1")
    gw = start_gateway(sim.url, args=("--shutdown-grace-secs", "20"))
    signalled = asyncio.run(_drain_scenario(gw, sim))
    assert exit_code(gw, 10) == 0
    assert time.monotonic() - signalled < 15  # it left once the streams were done, not at the end of the grace
    assert "shut down" in gw.output()


def test_grace_period_bounds_the_drain(start_sim, start_gateway):
    sim = start_sim("--time-scale", "1")
    gw = start_gateway(sim.url, args=("--shutdown-grace-secs", "1"))

    async def scenario() -> list[bytes]:
        flag = asyncio.Event()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            task = asyncio.create_task(read_stream(s, gw.url + "/v1/chat/completions", 5000, flag))
            await asyncio.wait_for(flag.wait(), 20)
            os.kill(gw.popen.pid, signal.SIGTERM)
            sent.append(time.monotonic())  # timed from the signal, not from the stream's set-up
            return await task

    sent: list[float] = []
    events = asyncio.run(scenario())
    assert exit_code(gw, 10) == 0
    assert time.monotonic() - sent[0] < 6
    assert events[-1] != b"data: [DONE]"  # a 35 s stream was cut at the end of the grace
    assert "grace period over with 1 requests in flight" in gw.output()
