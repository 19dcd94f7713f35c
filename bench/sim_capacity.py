"""How many requests per second one simulated worker sustains (wall clock, one core).

Drives a fresh ``python -m simulator serve`` at a high ``--time-scale`` with a closed loop
of concurrent short requests over aiohttp, and reports requests/s and the worker's CPU
time per request. Usage: ``python -m bench.sim_capacity [--requests 3000] [--concurrency 64]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import time

import aiohttp

from simulator.cluster import SimCluster


def _cpu_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(parts[11]) + int(parts[12])) / ticks


async def _drive(url: str, n: int, concurrency: int, prompt_len: int, max_new: int, stream: bool) -> float:
    sem = asyncio.Semaphore(concurrency)
    body_base = {"sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}, "stream": stream}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        async def one(i: int) -> None:
            body = dict(body_base, text=("shared system prompt " * 20)[:prompt_len // 2] + f"{i:08d}" * (prompt_len // 16))
            async with sem:
                async with s.post(url + "/generate", json=body) as r:
                    await r.read()
                    assert r.status == 200

        t0 = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(n)))
        return time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--time-scale", type=float, default=1000)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--stream", action="store_true")
    a = p.parse_args(argv)
    with SimCluster(workers=1, engine_args=["--time-scale", str(a.time_scale)]) as c:
        url = c.urls[0]
        pid = c._workers[0].popen.pid
        cpu0 = _cpu_of(pid)
        wall = asyncio.run(_drive(url, a.requests, a.concurrency, a.prompt_len, a.max_new, a.stream))
        cpu = _cpu_of(pid) - cpu0
    print(f"machine: {platform.node()} {os.cpu_count()} cpus, python {platform.python_version()}")
    print(f"requests {a.requests}  concurrency {a.concurrency}  prompt {a.prompt_len}  max_new {a.max_new}  "
          f"stream {a.stream}  time_scale {a.time_scale:g}")
    print(f"wall {wall:.2f}s  -> {a.requests / wall:.0f} req/s;  worker CPU {cpu:.2f}s "
          f"({cpu / a.requests * 1000:.2f} ms/request, {cpu / wall * 100:.0f}% of one core)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
