"""Soak: hold a gateway at about twice its cluster's capacity, then look for leaks.

Mixed traffic (plain and streamed chats, some clients hanging up mid-stream) runs for a
fixed time; every answer must be a 200 with a whole body or a well-formed 429/408 error.
Afterwards, once the gateway is idle, its process must be back where it started: no
upstream connection still in use, no stray asyncio task, no extra file descriptor, and a
bounded resident set. The test suite runs this for half a minute
(tests/test_gateway_soak.py); by hand::

    python -m bench.soak --minutes 30

starts two simulated workers and a gateway, prints one line per minute and a verdict.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import msgspec

ROOT = Path(__file__).resolve().parent.parent
MODEL = "sim-llama-8b"
WORKER_SLOTS = 4  # --max-running-requests per simulated worker
ENGINE_ARGS = ("--time-scale", "4", "--max-running-requests", str(WORKER_SLOTS))
_json = msgspec.json.Decoder()


def gateway_args(workers: int) -> list[str]:
    """Admission sized to the cluster: as many in flight as the engines run, a short queue."""
    return ["--max-concurrent-requests", str(workers * WORKER_SLOTS), "--queue-size", str(workers * 2),
            "--queue-timeout-secs", "0.5", "--health-check-interval-secs", "1"]


def upstream_bound(workers: int) -> int:
    """Pooled upstream connections an idle gateway may keep to any ONE worker.

    aiohttp pools per host, and each host's pool keeps as many connections as were ever in
    use to that host at once: every admitted request, if the policy sent them all there,
    plus its health and load probes. A cluster-wide bound (admitted + probes) is wrong: the
    cost policy's split drifts, each worker's pool peaks at a different moment, and the sum
    of idle pools went past it (14 of 12) on a loaded machine with nothing leaked."""
    return workers * WORKER_SLOTS + 2


@dataclass
class Tally:
    statuses: Counter = field(default_factory=Counter)
    disconnects: int = 0
    bad: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.statuses.values()) + self.disconnects

    def fail(self, why: str) -> None:
        if len(self.bad) < 20:
            self.bad.append(why)
        self.statuses["bad"] += 1


def _check_error(status: int, raw: bytes, tally: Tally) -> None:
    try:
        err = _json.decode(raw)["error"]
        ok = (status, err["type"], err["code"]) in {(429, "rate_limit_error", "queue_full"),
                                                   (408, "timeout_error", "queue_timeout")}
        ok = ok and isinstance(err["message"], str)
    except Exception:
        ok = False
    if ok:
        tally.statuses[status] += 1
    else:
        tally.fail(f"{status}: {raw[:200]!r}")


async def _one(session: aiohttp.ClientSession, url: str, rng: random.Random, tally: Tally) -> None:
    stream = rng.random() < 0.5
    hang_up = stream and rng.random() < 0.2
    body = {"model": MODEL, "max_tokens": rng.randint(8, 96), "stream": stream,
            "messages": [{"role": "user", "content": f"soak {rng.getrandbits(32)} " * rng.randint(1, 20)}]}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            _check_error(resp.status, await resp.read(), tally)
            return
        if not stream:
            data = _json.decode(await resp.read())
            if data.get("choices") and data["usage"]["completion_tokens"] == body["max_tokens"]:
                tally.statuses[200] += 1
            else:
                tally.fail(f"200 without a whole answer: {str(data)[:200]}")
            return
        raw = b""
        async for chunk in resp.content.iter_any():
            raw += chunk
            if hang_up and b"\n\n" in raw:
                tally.disconnects += 1
                return  # leaving the block closes the connection mid-stream
        if raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw:
            tally.statuses[200] += 1
        else:
            tally.fail(f"stream did not end cleanly: {raw[-200:]!r}")


async def drive(url: str, seconds: float, clients: int, seed: int = 0, tally: Tally | None = None) -> Tally:
    """``clients`` closed loops for ``seconds``; a refused client waits 20 ms and asks again."""
    tally = tally or Tally()
    deadline = time.monotonic() + seconds
    timeout = aiohttp.ClientTimeout(total=30)

    async def loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while time.monotonic() < deadline:
                try:
                    await _one(session, url, rng, tally)
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    tally.fail(f"client error: {exc!r}")
                if tally.statuses[429]:
                    await asyncio.sleep(0.02)

    await asyncio.gather(*(loop(i) for i in range(clients)))
    return tally


# --- the gateway process, seen from outside --------------------------------------------------

def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def established(pid: int) -> list[tuple[int, int]]:
    """(local port, remote port) of the process's ESTABLISHED TCP sockets."""
    mine = _socket_inodes(pid)
    out = []
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[3] == "01" and parts[9] in mine:
                out.append((int(parts[1].rsplit(":", 1)[1], 16), int(parts[2].rsplit(":", 1)[1], 16)))
    return out


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class Snapshot:
    fds: int
    rss_mb: float
    tasks: int
    in_flight: float
    upstream_conns: int
    client_conns: int
    upstream_max: int  # the most connections to any one worker

    def row(self) -> str:
        return (f"fds={self.fds:4d} rss={self.rss_mb:6.1f}MiB tasks={self.tasks:3d} in_flight={self.in_flight:3.0f} "
                f"upstream_conns={self.upstream_conns:3d} (max {self.upstream_max} to one) client_conns={self.client_conns:3d}")


def snapshot(pid: int, gateway_url: str, worker_urls: list[str]) -> Snapshot:
    req = urllib.request.Request(gateway_url + "/metrics", headers={"Connection": "close"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    time.sleep(0.05)  # let the scrape's own connection close
    worker_ports = {int(u.rsplit(":", 1)[1]) for u in worker_urls}
    gw_port = int(gateway_url.rsplit(":", 1)[1])
    conns = established(pid)
    rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmRSS:"))
    return Snapshot(fds=len(os.listdir(f"/proc/{pid}/fd")), rss_mb=rss / 1024,
                    tasks=int(_metric(text, "kvgate_event_loop_tasks")),
                    in_flight=_metric(text, "kvgate_worker_in_flight"),
                    upstream_conns=sum(remote in worker_ports for _, remote in conns),
                    upstream_max=max((sum(remote == w for _, remote in conns) for w in worker_ports), default=0),
                    client_conns=sum(local == gw_port for local, _ in conns))


def settled(pid: int, gateway_url: str, worker_urls: list[str], base: Snapshot, max_upstream: int,
            timeout: float = 15.0) -> tuple[Snapshot, list[str]]:
    """Poll until the idle gateway is back to ``base`` (bounded); returns what is still off."""
    deadline = time.monotonic() + timeout
    while True:
        now = snapshot(pid, gateway_url, worker_urls)
        problems = []
        if now.in_flight:
            problems.append(f"{now.in_flight:g} requests still in flight upstream")
        if now.client_conns:
            problems.append(f"{now.client_conns} client connections still open")
        if now.upstream_max > max_upstream:
            problems.append(f"{now.upstream_max} upstream connections to one worker (pool bound {max_upstream})")
        if now.tasks > base.tasks:
            problems.append(f"{now.tasks} event-loop tasks (baseline {base.tasks})")
        # pooled keep-alive connections come and go; every other fd must be back
        if now.fds - now.upstream_conns > base.fds - base.upstream_conns:
            problems.append(f"{now.fds} fds with {now.upstream_conns} pooled (baseline {base.fds} with "
                            f"{base.upstream_conns})")
        if not problems or time.monotonic() > deadline:
            return now, problems
        time.sleep(0.25)


# --- by hand -------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--load", type=float, default=2.0, help="concurrent clients / cluster slots")
    p.add_argument("--rss-growth-mb", type=float, default=64.0, help="allowed RSS growth over the warm baseline")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from bench.services import start_service
    from simulator.cluster import SimCluster

    clients = int(args.workers * WORKER_SLOTS * args.load)
    with SimCluster(workers=args.workers, engine_args=list(ENGINE_ARGS)) as cluster:
        log = tempfile.NamedTemporaryFile(prefix="kvgate-soak-gateway-", suffix=".log", delete=False)
        service = start_service(lambda port: [
            sys.executable, "-m", "gateway", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *cluster.urls, *gateway_args(args.workers)], Path(log.name), "/readiness", tries=3)
        gw, url = service.popen, service.url
        try:
            asyncio.run(drive(url, 3, clients, seed=1))  # warm: pools, caches, lazy imports
            base, _ = settled(gw.pid, url, cluster.urls, snapshot(gw.pid, url, cluster.urls), 10**6, 5)
            print(f"machine: {os.uname().nodename} cpus={os.cpu_count()}  workers={args.workers} clients={clients}")
            print(f"baseline        {base.row()}")
            tally = Tally()
            started = time.monotonic()
            minute = 0
            while time.monotonic() - started < args.minutes * 60:
                chunk = min(60.0, args.minutes * 60 - (time.monotonic() - started))
                asyncio.run(drive(url, chunk, clients, seed=100 + minute, tally=tally))
                minute += 1
                print(f"minute {minute:4d}     {snapshot(gw.pid, url, cluster.urls).row()}  "
                      f"answers={dict(tally.statuses)} hung_up={tally.disconnects}", flush=True)
            final, problems = settled(gw.pid, url, cluster.urls, base, max_upstream=upstream_bound(args.workers))
            if final.rss_mb > base.rss_mb + args.rss_growth_mb:
                problems.append(f"RSS grew {final.rss_mb - base.rss_mb:.1f} MiB")
            print(f"settled         {final.row()}")
            print(f"requests={tally.total} bad={tally.statuses['bad']} " + "; ".join(tally.bad[:5]))
            print("PASS" if not problems and not tally.bad else "FAIL: " + "; ".join(problems))
            return 0 if not problems and not tally.bad else 1
        finally:
            service.stop(30)


if __name__ == "__main__":
    sys.exit(main())
