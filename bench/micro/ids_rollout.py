"""Gateway CPU per request for rollouts that send their own ids, with the recent-list reader
on and off (``--ids-cache-mb 64`` against ``0``), in one run.

Two ``kvgate serve --policy cost`` processes in front of the same stub backend
(``bench/stub_backend.py``, answers at once), both alive the whole run. Each repetition
sends both the same rollouts, in alternating order: ``--rollouts`` concurrent RL-style
trajectories of ``--turns`` turns on ``/generate``, each turn the previous one's ids plus
``--grow`` new ones (the answer and a tool's result), starting at ``--ids`` ids. The
rollouts differ from one repetition to the next, so a turn 0 is always a first sight. The
gateway's user+system CPU over the repetition, divided by its requests, is the figure:
steadier than req/s on a shared machine. The load generator runs on ``--load-cpu``, the
stub and both gateways on ``--server-cpus``.

Late binding is off by default (``--max-hold-secs 0``): the stub answers at once, but
``cost`` prices prefill as a GPU would, so it holds most of 64 rollouts' requests and decides
each again at every first token and completion, ~1.8 ms of CPU a request at the stub's
pace (2.5 ms in all against 0.7 without holding, measured here); real engines' pace
bounds that (``bench/micro/hold_wake.py``), and it would hide what this bench measures.

    PYTHONPATH=$PWD python -m bench.micro.ids_rollout [--reps 5]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import msgspec

from bench.host import cpu_name
from bench.overhead import _start
from tests.support import Proc, free_port, http_status

VARIANTS = {"ids cache on (64 MB)": "64", "ids cache off": "0"}


def cpu_seconds(pid: int) -> float:
    """On-CPU time of every thread of ``pid`` (``schedstat``: nanoseconds, where ``stat``
    counts 10 ms ticks, too coarse for a few hundred requests)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


def rollouts(seed: int, n: int, turns: int, first: int, grow: int) -> list[list[bytes]]:
    """Each rollout's bodies, turn by turn (encoded up front: the load generator's own cost
    stays out of the way)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randrange(150_000) for _ in range(first)]
        bodies = []
        for _ in range(turns):
            bodies.append(msgspec.json.encode({"input_ids": ids, "sampling_params": {"max_new_tokens": 16}}))
            ids = ids + [rng.randrange(150_000) for _ in range(grow)]
        out.append(bodies)
    return out


async def drive(url: str, work: list[list[bytes]]) -> tuple[int, int, float]:
    """Every rollout at once, each sending its turns one after another; (ok, errors, seconds)."""
    ok = errors = 0

    async def one(session: aiohttp.ClientSession, bodies: list[bytes]) -> None:
        nonlocal ok, errors
        for body in bodies:
            async with session.post(url + "/generate", data=body,
                                    headers={"Content-Type": "application/json"}) as resp:
                await resp.read()
                if resp.status == 200:
                    ok += 1
                else:
                    errors += 1

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(one(session, b) for b in work))
    return ok, errors, time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rollouts", type=int, default=32)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--ids", type=int, default=2000, help="ids in a rollout's first turn")
    p.add_argument("--grow", type=int, default=300, help="ids each turn adds")
    p.add_argument("--load-cpu", default="0")
    p.add_argument("--server-cpus", default="1")
    p.add_argument("--gateway-args", default="--max-hold-secs 0",
                   help="more flags for both gateways, one string (default: no late binding; see the docstring)")
    a = p.parse_args()
    if a.load_cpu:
        os.sched_setaffinity(0, {int(c) for c in a.load_cpu.split(",")})
    started: list[Proc] = []
    try:
        stub_port = free_port()
        started.append(_start("stub", a.server_cpus, "bench.stub_backend", "--port", str(stub_port)))
        stub = f"http://127.0.0.1:{stub_port}"
        gateways: dict[str, tuple[str, Proc]] = {}
        for name, mb in VARIANTS.items():
            port = free_port()
            proc = _start(name, a.server_cpus, "gateway", "serve", "--host", "127.0.0.1", "--port", str(port),
                          "--policy", "cost", "--ids-cache-mb", mb, "--log-level", "warning", *a.gateway_args.split(),
                          "--worker-urls", stub)
            started.append(proc)
            gateways[name] = (f"http://127.0.0.1:{port}", proc)
        for url, proc in [(stub, started[0]), *gateways.values()]:
            proc.wait_http(url + "/health", timeout=60)
        for url, _ in gateways.values():  # a healthy worker behind it, and the hot path warm
            deadline = time.monotonic() + 30
            while http_status(url + "/readiness") != 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            asyncio.run(drive(url, rollouts(10_000, 4, 2, a.ids, a.grow)))
        cpu_us: dict[str, list[float]] = {n: [] for n in VARIANTS}
        rps: dict[str, list[float]] = {n: [] for n in VARIANTS}
        failed = 0
        for rep in range(a.reps):
            work = rollouts(rep, a.rollouts, a.turns, a.ids, a.grow)
            names = list(VARIANTS) if rep % 2 == 0 else list(reversed(VARIANTS))
            for name in names:
                url, proc = gateways[name]
                before = cpu_seconds(proc.popen.pid)
                ok, errors, secs = asyncio.run(drive(url, work))
                used = cpu_seconds(proc.popen.pid) - before
                failed += errors
                cpu_us[name].append(used / max(1, ok) * 1e6)
                rps[name].append(ok / secs)
    finally:
        for proc in reversed(started):
            proc.stop()
    requests = a.rollouts * a.turns
    mean_ids = a.ids + a.grow * (a.turns - 1) / 2
    print(f"# Gateway CPU per rollout request, ids cache on vs off "
          f"({dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC})")
    print(f"machine: {cpu_name()}, {platform.system()} {platform.release()}, Python {platform.python_version()}")
    print(f"command: PYTHONPATH=$PWD python -m bench.micro.ids_rollout {' '.join(sys.argv[1:])}".rstrip())
    print(f"load: {a.rollouts} rollouts x {a.turns} turns per repetition ({requests} requests, "
          f"{a.ids:,} ids growing by {a.grow} a turn, {mean_ids:,.0f} on average), {a.reps} repetitions, "
          f"variants alternating; load generator on CPU {a.load_cpu}, stub + gateways on CPU {a.server_cpus}; "
          f"errors: {failed}")
    print()
    print("| gateway | CPU us per request (median of reps) | per rep | req/s (median) |")
    print("|---|---|---|---|")
    for name in VARIANTS:
        each = ", ".join(f"{v:.0f}" for v in cpu_us[name])
        print(f"| {name} | {statistics.median(cpu_us[name]):.0f} | {each} | {statistics.median(rps[name]):.0f} |")
    on, off = (statistics.median(cpu_us[n]) for n in VARIANTS)
    print()
    print(f"on / off: {on / off:.2f} of the gateway's CPU per request ({off - on:+.0f} us saved per request)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
