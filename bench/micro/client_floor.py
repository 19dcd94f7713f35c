"""The CPU floor of a Python proxy built on aiohttp: each half of it, measured alone.

A proxied request costs the router one server exchange (parse the client's request, write
the answer) and one client exchange (write the upstream request, parse its answer). This
script times both halves in isolation against the same stub, with nothing else in the
process, to show what no amount of work in kvgate's own code can remove:

- ``client``: kvgate's upstream session (``gateway.upstream.make_session``) posting the
  benchmark's chat body to the stub from ``--concurrency`` tasks, pinned to
  ``--client-cpu``; CPU of this process per request.
- ``server``: the stub (a bare ``aiohttp.web`` app, ``bench/stub_backend.py``) pinned to
  ``--server-cpu``; its CPU per request from the same runs, i.e. what a minimal aiohttp.web
  handler costs including writing a small JSON answer.

sglang-router's whole request (server + routing + client) costs ~78 us of CPU on this
machine (``bench/overhead.py``); if one half of an aiohttp proxy costs about that already,
matching its req/s on one core is out of reach for aiohttp in any arrangement.

    PYTHONPATH=$PWD /work/venv/bin/python -m bench.micro.client_floor        # ~30 s
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import resource
import statistics
import sys
import time

from bench.overhead import RESULTS, _start, _wait_post, body, group_cpu_seconds, machine, versions, write_results
from tests.support import free_port


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def client_run(url: str, requests: int, concurrency: int) -> tuple[float, float]:
    """(req/s, CPU seconds of this process) for ``requests`` posts after a warm-up."""
    from gateway.upstream import make_session

    data = body(None).encode()
    headers = {"Content-Type": "application/json", "X-Request-ID": "0123456789abcdef"}
    async with make_session(connect_timeout=5, read_timeout=60) as session:
        async def loop(n: int) -> None:
            for _ in range(n):
                resp = await session.post(url, data=data, headers=headers)
                await resp.read()
                resp.close()

        await asyncio.gather(*[loop(100) for _ in range(concurrency)])
        per_task = requests // concurrency
        cpu0, t0 = _cpu(), time.perf_counter()
        await asyncio.gather(*[loop(per_task) for _ in range(concurrency)])
        return per_task * concurrency / (time.perf_counter() - t0), _cpu() - cpu0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=30_000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--client-cpu", default="0")
    p.add_argument("--server-cpu", default="1")
    p.add_argument("--no-results", action="store_true", help="print only; leave bench/RESULTS.md alone")
    a = p.parse_args(argv)

    import os

    import uvloop

    os.sched_setaffinity(0, {int(a.client_cpu)})
    port = free_port()
    stub = _start("stub", a.server_cpu, "bench.stub_backend", "--port", str(port))
    url = f"http://127.0.0.1:{port}"
    rows: list[tuple[float, float, float]] = []
    try:
        _wait_post(stub, url)
        for _ in range(a.reps):
            server0 = group_cpu_seconds([stub.popen.pid])
            rps, client_cpu = uvloop.run(client_run(url + "/v1/chat/completions", a.requests, a.concurrency))
            server_cpu = group_cpu_seconds([stub.popen.pid]) - server0
            n = a.requests // a.concurrency * a.concurrency
            rows.append((rps, 1e6 * client_cpu / n, 1e6 * server_cpu / n))
    finally:
        stub.stop()
    med = [statistics.median(r[i] for r in rows) for i in range(3)]
    lines = [
        f"- date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- command: `PYTHONPATH=$PWD {' '.join([sys.executable, '-m', 'bench.micro.client_floor', *(argv or sys.argv[1:])])}`",
        f"- machine: {machine()}",
        f"- versions: {versions()}",
        f"- setup: kvgate's upstream aiohttp session on CPU {a.client_cpu}, {a.concurrency} tasks in a closed loop, "
        f"{n:,} non-stream chat posts per repetition after a warm-up; the stub (bare aiohttp.web) on CPU "
        f"{a.server_cpu}; medians of {a.reps}",
        "",
        "| half of a proxy | req/s | CPU µs/req (median) | all repetitions |",
        "|---|---|---|---|",
        f"| client: aiohttp `ClientSession.post` + `read` | {med[0]:,.0f} | {med[1]:.0f} | "
        f"{', '.join(f'{r[1]:.0f}' for r in rows)} |",
        f"| server: bare aiohttp.web handler + small JSON answer | - | {med[2]:.0f} | "
        f"{', '.join(f'{r[2]:.0f}' for r in rows)} |",
        f"| sum: floor of an aiohttp proxy, before any routing | - | {med[1] + med[2]:.0f} | |",
    ]
    text = "\n".join(lines)
    print(text)
    if not a.no_results:
        write_results("## Floor of an aiohttp proxy (`bench/micro/client_floor.py`)\n\n" + text, RESULTS, "main", "bench/micro/client_floor.py")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
