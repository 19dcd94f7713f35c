"""What tokenizing long prompts on the event loop costs everyone else.

The gateway tokenizes prompts for the precise index with the model's tokenizer
(``--tokenizer DIR``). Encoding holds its thread for ~0.1-0.3 us per character, so a long
prompt encoded on the event loop stalls every other request the gateway is proxying.
``gateway.encoding`` encodes prompts longer than ``--tokenize-inline-chars`` on a thread
pool instead (the ``tokenizers`` batch call releases the GIL).

This runs both ways side by side on the same simulated workers: a gateway that encodes
everything inline (``--tokenize-inline-chars`` huge: what the gateway did before) and one
with the default threshold. Each gets a background stream of long chat prompts and, at the
same time, short chat requests from a few clients; the table gives the short requests'
latency, which is what the stall shows up in, and the long ones'. The tokenizer is
``simulator.tiny_tokenizer``'s byte-level BPE (built offline, ~0.3 us per character here:
slower than a large-vocabulary model's, so real stalls are shorter in proportion).

    PYTHONPATH=$PWD python bench/micro/tokenize_stall.py [--seconds 15 --repeat 2 --long-chars 100000 --long-rate 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.host import cpu_name  # noqa: E402
from bench.services import Service, free_port  # noqa: E402
from simulator.tiny_tokenizer import build  # noqa: E402
from wire.tokenizer import HFTokenizer  # noqa: E402

VARIANTS = {"inline (before)": "1000000000000", "offloaded (default 2048)": "2048"}


def _sim(model: Path, logs: Path, i: int) -> Service:
    port = free_port()
    args = [sys.executable, "-m", "simulator", "serve", "--port", str(port), "--tokenizer", str(model),
            "--time-scale", "100", "--max-total-tokens", "2000000", "--context-length", "1000000"]
    return Service(args, logs / f"sim{i}.log", f"http://127.0.0.1:{port}").wait_ready()


def _gateway(model: Path, workers: list[str], inline: str, logs: Path, name: str) -> Service:
    port = free_port()
    args = [sys.executable, "-m", "gateway", "serve", "--host", "127.0.0.1", "--port", str(port), "--policy", "cost",
            "--log-level", "warning", "--tokenizer", str(model), "--tokenize-inline-chars", inline,
            "--worker-urls", *workers]
    return Service(args, logs / f"gw-{name}.log", f"http://127.0.0.1:{port}").wait_ready("/readiness")


async def _post(session: aiohttp.ClientSession, url: str, text: str) -> float:
    body = {"model": "sim-llama-8b", "max_tokens": 1, "messages": [{"role": "user", "content": text}]}
    start = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{resp.status} from {url}")
    return time.perf_counter() - start


async def _run(url: str, seconds: float, long_chars: int, long_rate: float, clients: int) -> dict[str, list[float]]:
    long_text = ("the long document says " * (long_chars // 23 + 1))[:long_chars]
    short, long = [], []
    deadline = time.perf_counter() + seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def shorts(k: int) -> None:
            n = 0
            while time.perf_counter() < deadline:
                short.append(await _post(session, url, f"client {k} asks question {n}"))
                n += 1

        async def longs() -> None:
            tasks, n = [], 0
            while time.perf_counter() < deadline:
                tasks.append(asyncio.create_task(_post(session, url, f"{n} " + long_text)))
                n += 1
                await asyncio.sleep(1.0 / long_rate)
            long.extend(await asyncio.gather(*tasks))

        await asyncio.gather(longs(), *(shorts(k) for k in range(clients)))
    return {"short": short, "long": long}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--long-chars", type=int, default=100_000)
    p.add_argument("--long-rate", type=float, default=4.0, help="long prompts per second")
    p.add_argument("--clients", type=int, default=4, help="clients sending short requests back to back")
    args = p.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="kvgate-tokstall-"))
    model = build(logs / "model", "chatml")
    tok = HFTokenizer(str(model))
    text = ("the long document says " * (args.long_chars // 23 + 1))[:args.long_chars]
    start = time.perf_counter()
    n_tokens = len(tok.encode(text))
    encode_ms = (time.perf_counter() - start) * 1000
    services: list[Service] = []
    results: dict[str, list[dict[str, list[float]]]] = {v: [] for v in VARIANTS}
    try:
        sims = [_sim(model, logs, i) for i in range(2)]
        services += sims
        gateways = {v: _gateway(model, [s.url for s in sims], inline, logs, str(i))
                    for i, (v, inline) in enumerate(VARIANTS.items())}
        services += gateways.values()
        for _ in range(args.repeat):  # alternate, so drift on a noisy machine hits both
            for v, gw in gateways.items():
                results[v].append(asyncio.run(_run(gw.url, args.seconds, args.long_chars, args.long_rate,
                                                   args.clients)))
    finally:
        for s in services:
            s.stop()
    print(f"machine: {cpu_name()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"command: PYTHONPATH=$PWD python bench/micro/tokenize_stall.py --seconds {args.seconds:g} --repeat {args.repeat} "
          f"--long-chars {args.long_chars} --long-rate {args.long_rate:g} --clients {args.clients}")
    print(f"long prompt: {args.long_chars} chars, {n_tokens} tokens, encoded in {encode_ms:.1f} ms on one thread\n")
    print("| gateway | run | short requests | short p50 ms | short p99 ms | short max ms | long requests | long p50 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for v, runs in results.items():
        for i, r in enumerate(runs, 1):
            print(f"| {v} | {i} | {len(r['short'])} | {_pct(r['short'], 0.5):.1f} | {_pct(r['short'], 0.99):.1f} | "
                  f"{max(r['short']) * 1000:.1f} | {len(r['long'])} | {_pct(r['long'], 0.5):.1f} |")
    a, b = (statistics.median(_pct(r["short"], 0.99) for r in results[v]) for v in VARIANTS)
    c, d = (statistics.median(_pct(r["short"], 0.5) for r in results[v]) for v in VARIANTS)
    print(f"\nshort requests, offloaded / inline (medians over runs): p50 {d / c:.2f}x, p99 {b / a:.2f}x")


if __name__ == "__main__":
    main()
