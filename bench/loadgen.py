"""A closed-loop HTTP load generator on aiohttp: fixed concurrency, fixed duration.

wrk (C) is the default generator in ``bench/overhead.py``; this one is the cross-check
that reads every SSE event in Python (``--loadgen aiohttp``) and prints the same JSON
line as ``bench/wrk_post.lua``. On one core it saturates near 5-8k req/s, so use it for
streams and chunk counts, not for the fastest non-stream variants.

    python -m bench.loadgen --url http://127.0.0.1:P/v1/chat/completions --body '{...}' -c 64 -d 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp


async def run(url: str, body: bytes, concurrency: int, duration: float) -> dict[str, float]:
    latencies: list[float] = []
    events = errors = 0
    deadline = time.perf_counter() + duration
    headers = {"Content-Type": "application/json"}

    async def one_client(session: aiohttp.ClientSession) -> None:
        nonlocal events, errors
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            try:
                async with session.post(url, data=body, headers=headers) as resp:
                    data = await resp.read()
                    if resp.status != 200:
                        errors += 1
                        continue
            except (aiohttp.ClientError, asyncio.TimeoutError):
                errors += 1
                continue
            latencies.append(time.perf_counter() - t0)
            events += data.count(b"data: {")

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=30)
    started = time.perf_counter()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:
        await asyncio.gather(*(one_client(session) for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    latencies.sort()

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1e6 if latencies else 0.0

    return {"requests": len(latencies), "duration_us": elapsed * 1e6, "events": events, "errors": errors,
            "p50_us": pct(0.50), "p99_us": pct(0.99),
            "mean_us": sum(latencies) / len(latencies) * 1e6 if latencies else 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--body", required=True)
    p.add_argument("-c", "--concurrency", type=int, default=64)
    p.add_argument("-d", "--duration", type=float, default=5.0)
    a = p.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    print(json.dumps(asyncio.run(run(a.url, a.body.encode(), a.concurrency, a.duration))), flush=True)


if __name__ == "__main__":
    main()
