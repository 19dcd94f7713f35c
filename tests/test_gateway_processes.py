"""``kvgate serve --processes N``: a group of gateway processes on one port, as a client and an
operator see it: both members serve, /metrics is the group's, SIGTERM drains, SIGHUP reloads
without a failed request, a killed member's client gets an error and the member is replaced."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from tests.conftest import MODEL
from tests.support import FREE_PORT, Proc, get_text, http_status, metric_value, serve
from tests.test_gateway_shutdown import exit_code, read_stream

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def start_group(sim_url: str, *extra: str, processes: int = 2, tmp_path: Path | None = None) -> Proc:
    """A group in front of ``sim_url``, once every member publishes its figures; with ``tmp_path``
    the process count and the worker come from a YAML file, as ``--config`` gives them."""
    if tmp_path is not None:
        cfg = tmp_path / "kvgate.yaml"
        cfg.write_text(f"processes: {processes}\nworker_urls: [{sim_url}]\npolicy: round_robin\n")
        source = ["--config", str(cfg)]
    else:
        source = ["--processes", str(processes), "--worker-urls", sim_url, "--policy", "round_robin"]
    proc = serve([sys.executable, "-m", "gateway", "serve", "--host", "127.0.0.1", "--port", FREE_PORT, *source,
                  "--health-check-interval-secs", "0.5", *extra], "/readiness", name="group")
    try:
        wait_members(proc, processes)
    except BaseException:
        proc.stop()
        raise
    return proc


def members(proc: Proc) -> dict[int, int]:
    """Slot -> pid of the member the supervisor last reported listening there."""
    return {int(i): int(pid) for i, pid in re.findall(r"process (\d+) \(pid (\d+)\) listening", proc.output())}


def wait_members(proc: Proc, count: int, timeout: float = 30.0, changed: dict[int, int] | None = None) -> dict[int, int]:
    """Until ``count`` slots have a listening member (other pids than ``changed`` has, when given)
    and the group's /metrics shows each of them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.popen.poll() is None, proc.output()[-4000:]
        now = members(proc)
        fresh = changed is None or all(now.get(i) != pid for i, pid in changed.items())
        if len(now) == count and fresh and http_status(proc.url + "/metrics") == 200:
            text = get_text(proc.url + "/metrics")
            if all(f'kvgate_event_loop_tasks{{process="{i}"}}' in text for i in range(count)):
                return now
        time.sleep(0.1)
    raise AssertionError(f"members not up after {timeout}s:\n{proc.output()[-4000:]}")


def chat(url: str, timeout: float = 10.0) -> int:
    """One request on a new connection; the status, or 0 when the connection failed."""
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(CHAT).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def alive(pid: int) -> bool:
    """Running: neither gone nor a zombie its new parent has not reaped yet."""
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def group_metric(proc: Proc, name: str, **labels: str) -> float:
    return metric_value(get_text(proc.url + "/metrics"), name, **labels)


def test_both_processes_serve_and_metrics_add_up(start_sim, tmp_path):
    sim = start_sim("--time-scale", "50")
    proc = start_group(sim.url, "--prometheus-port", FREE_PORT, "--log-dir", str(tmp_path / "logs"), tmp_path=tmp_path)
    try:
        assert http_status(proc.url + "/health") == 200 and http_status(proc.url + "/readiness") == 200
        statuses = [chat(proc.url) for _ in range(60)]
        assert statuses == [200] * 60
        # counters are the group's at once; each member's own count within a publish beat
        assert group_metric(proc, "kvgate_requests_total", route="/v1/chat/completions", status="200") == 60
        scrape = f"http://127.0.0.1:{proc.ports[1]}/metrics"  # every member listens there, each answers for all
        assert [metric_value(get_text(scrape), "kvgate_requests_total", route="/v1/chat/completions", status="200")
                for _ in range(6)] == [60] * 6
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            per = [group_metric(proc, "kvgate_process_requests", process=str(i)) for i in range(2)]
            if sum(per) >= 60:
                break
            time.sleep(0.2)
        assert sum(per) >= 60 and all(n > 0 for n in per), per
        text = get_text(proc.url + "/metrics")
        assert metric_value(text, "kvgate_worker_healthy", worker=sim.url) == 1
        assert 'kvgate_open_fds{process="0"}' in text and 'kvgate_open_fds{process="1"}' in text
    finally:
        assert proc.stop() == 0, proc.output()[-4000:]
    assert "processes: 2" in Path(tmp_path / "kvgate.yaml").read_text()
    log = (tmp_path / "logs" / "kvgate.log").read_text()  # the supervisor's and every member's lines
    assert "kvgate group of 2 processes serving" in log
    assert "kvgate[0]: shut down" in log and "kvgate[1]: shut down" in log


def test_sigterm_drains_every_member_and_exits_0(start_sim):
    """One member drains a stream, the other has nothing to finish and exits at once: from then
    on every new connection reaches the draining member and gets its 503, none waits on the
    exited member's socket; the stream ends with [DONE] and the group exits 0."""
    sim = start_sim("--time-scale", "1")
    proc = start_group(sim.url, "--shutdown-grace-secs", "20")

    async def probe(url: str) -> int | str:
        """A fresh connection each time, as a load balancer's probe opens."""
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=5)) as s:
            try:
                async with s.get(url) as resp:
                    return resp.status
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                return type(exc).__name__

    async def scenario() -> tuple[list[bytes], list[int | str]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            started = asyncio.Event()
            stream = asyncio.create_task(read_stream(s, proc.url + "/v1/chat/completions", 1000, started))
            await asyncio.wait_for(started.wait(), 20)
            os.kill(proc.popen.pid, signal.SIGTERM)  # the supervisor alone: it passes the signal on
            deadline = time.monotonic() + 10
            while not re.search(r"process \d \(pid \d+\) exited", proc.output()) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not stream.done() and proc.popen.poll() is None, proc.output()[-4000:]
            probes = [await probe(proc.url + "/readiness") for _ in range(20)]
            return await stream, probes

    try:
        events, probes = asyncio.run(scenario())
        assert probes == [503] * 20, probes
        assert events[-1] == b"data: [DONE]", events[-3:]
        assert exit_code(proc, 20) == 0, proc.output()[-4000:]
        out = proc.output()
        assert "kvgate[0]: shut down" in out and "kvgate[1]: shut down" in out
    finally:
        proc.stop()


def test_sighup_reload_replaces_members_without_a_failed_request(start_sim):
    sim = start_sim("--time-scale", "5")
    proc = start_group(sim.url)
    try:
        before = members(proc)
        statuses: list[int] = []
        stop = threading.Event()

        def load() -> None:
            deadline = time.monotonic() + 60
            while not stop.is_set() and len(statuses) < 3000 and time.monotonic() < deadline:
                statuses.append(chat(proc.url))

        async def reload_with_streams() -> list[list[bytes]]:
            """Streams in flight keep the old members busy while the reload retires them."""
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                flags = [asyncio.Event() for _ in range(6)]
                tasks = [asyncio.create_task(read_stream(s, proc.url + "/v1/chat/completions", 600, f))
                         for f in flags]
                await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flags)), 20)
                os.kill(proc.popen.pid, signal.SIGHUP)
                await asyncio.to_thread(wait_members, proc, 2, 30.0, before)
                return await asyncio.gather(*tasks)

        client = threading.Thread(target=load)
        client.start()
        try:
            while len(statuses) < 20 and client.is_alive():
                time.sleep(0.02)
            streams = asyncio.run(reload_with_streams())
            deadline = time.monotonic() + 30
            while "reload: done" not in proc.output() and time.monotonic() < deadline:
                time.sleep(0.05)
            served = len(statuses)
            while len(statuses) < served + 20 and client.is_alive():
                time.sleep(0.02)
        finally:
            stop.set()
            client.join(30)
        assert "reload: done" in proc.output()
        assert statuses.count(200) == len(statuses) > 40, [s for s in statuses if s != 200][:10]
        for events in streams:  # the retired members finished what they had
            assert events[-1] == b"data: [DONE]", events[-3:]
        after = members(proc)
        assert set(after.values()).isdisjoint(before.values())
        deadline = time.monotonic() + 15
        while any(alive(pid) for pid in before.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(pid) for pid in before.values())  # drained and exited
        # the replaced members' counts stay in the group's sums
        assert group_metric(proc, "kvgate_requests_total", route="/v1/chat/completions") == len(statuses) + 6
    finally:
        assert proc.stop() == 0, proc.output()[-4000:]


def owner(pids: list[int], client_port: int) -> int:
    """Which of ``pids`` holds the server end of the TCP connection from ``client_port`` (Linux /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[2].rsplit(":", 1)[1], 16) == client_port:
                inodes.add(fields[9])
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if os.readlink(fd).removeprefix("socket:[").removesuffix("]") in inodes:
                    return pid
            except OSError:
                continue
    raise AssertionError(f"no member holds the connection from port {client_port}")


def test_killed_member_fails_its_client_and_is_replaced(start_sim):
    sim = start_sim("--time-scale", "1")
    proc = start_group(sim.url)
    try:
        before = members(proc)

        async def scenario() -> tuple[int, BaseException | None]:
            connector = aiohttp.TCPConnector(limit=1)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30), connector=connector) as s:
                body = {**CHAT, "stream": True, "max_tokens": 2000}
                async with s.post(proc.url + "/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200
                    await resp.content.readany()
                    victim = owner(list(before.values()), resp.connection.transport.get_extra_info("sockname")[1])
                    os.kill(victim, signal.SIGKILL)
                    try:
                        async for _ in resp.content.iter_any():
                            pass
                    except (aiohttp.ClientError, ConnectionError) as exc:
                        return victim, exc
            return victim, None

        victim, error = asyncio.run(scenario())
        assert error is not None and not isinstance(error, asyncio.TimeoutError), error
        slot = next(i for i, pid in before.items() if pid == victim)
        after = wait_members(proc, 2, changed={slot: victim})
        assert after[1 - slot] == before[1 - slot]  # the other member served on
        assert f"process {slot} (pid {victim}) died (exit status -9)" in proc.output()
        assert [chat(proc.url) for _ in range(30)] == [200] * 30
    finally:
        assert proc.stop() == 0, proc.output()[-4000:]


def children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def test_members_of_a_killed_supervisor_exit(start_sim):
    """And so does the group's embedded nats-server: nothing of the group outlives it."""
    sim = start_sim("--time-scale", "50")
    proc = start_group(sim.url, "--shutdown-grace-secs", "5")
    try:
        pids = list(members(proc).values())
        bus = [c for c in children(proc.popen.pid) if c not in pids]
        assert len(bus) == 1 and "nats-server" in Path(f"/proc/{bus[0]}/cmdline").read_text()
        pids += bus
        os.kill(proc.popen.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(alive(pid) for pid in pids):
            time.sleep(0.1)
        assert not any(alive(pid) for pid in pids), proc.output()[-4000:]
        assert "kvgate[0]: shut down" in proc.output() and "kvgate[1]: shut down" in proc.output()
    finally:
        proc.stop()


def test_a_member_that_cannot_start_stops_the_group_with_its_status(start_sim):
    sim = start_sim("--time-scale", "50")
    bad = Proc.python("gateway", "serve", "--host", "127.0.0.1", "--port", "0", "--processes", "2",
                      "--worker-urls", sim.url, "--policy", "cost", "--policy-option", "no_such_option=1",
                      name="bad-group")
    try:
        assert exit_code(bad, 60) == 2, bad.output()[-4000:]
        assert "kvgate: error" in bad.output() and "stopping the group" in bad.output()
    finally:
        bad.stop()


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_processes_flag_takes_a_positive_count_or_auto(value):
    from gateway.cli import build_parser
    from gateway.config import GatewayConfig

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--processes", value])
    assert exc.value.code == 2
    assert build_parser().parse_args(["serve", "--processes", "auto"]).processes == len(os.sched_getaffinity(0))
    assert GatewayConfig(processes="auto").processes == len(os.sched_getaffinity(0))
    assert GatewayConfig(processes="3").processes == 3


def test_the_groups_admission_limits_are_split_over_its_members(monkeypatch):
    from gateway import group

    assert group.share(10) == 10  # alone: the whole limit
    monkeypatch.setenv(group.SIZE_ENV, "3")
    parts = {}
    for index in range(3):
        monkeypatch.setenv(group.INDEX_ENV, str(index))
        parts[index] = (group.share(10), group.share(0), group.share(2))
    assert parts == {0: (4, 0, 1), 1: (3, 0, 1), 2: (3, 0, 1)}  # 0: unlimited; a part is at least 1


def test_members_share_bookings_so_a_burst_does_not_herd(start_sim):
    """Each member counts what the other routed (the group's embedded state bus): four long
    streams through two members land two on each worker, whichever member took each."""
    from tests.test_gateway_peers import Stream, wait_for

    sims = [start_sim(name=f"sim{i}").url for i in range(2)]
    proc = serve([sys.executable, "-m", "gateway", "serve", "--host", "127.0.0.1", "--port", FREE_PORT,
                  "--processes", "2", "--worker-urls", *sims, "--policy", "least_load",
                  "--health-check-interval-secs", "0.5"], "/readiness", name="group")
    try:
        wait_members(proc, 2)
        assert "embedded nats-server" in proc.output()
        streams = []
        for k in range(1, 5):
            streams.append(Stream(proc))
            # each stream is a peer's request to the member that did not route it
            wait_for(lambda: metric_value(get_text(proc.url + "/metrics"),
                                          "kvgate_state_peer_requests_in_flight") == k,
                     why=f"the other member counts stream {k}")
        workers = json.loads(get_text(proc.url + "/workers"))["workers"]
        assert sorted(w["in_flight"] for w in workers) == [2, 2], workers
        assert all(s.error is None for s in streams)
    finally:
        proc.stop()
