"""What following a fleet's KV events costs the gateway: messages and pages per second one
process applies, CPU per message and per page, and how long the event loop stalls meanwhile.

Every worker's SGLang publisher sends an ``EventBatch`` per scheduler step that changed its
radix cache: one ``BlockStored`` per page (SGLang's granularity), and later the matching
``BlockRemoved`` as pages are evicted. The feed (``index.kv_feed``) receives them on the
gateway's event loop, the same loop that proxies requests, so its cost per message is what a
fleet of N workers takes from the proxy. Here a separate process plays ``--workers``
publishers on 127.0.0.1 (one PUB socket each, as SGLang opens them) and sends
``--messages`` batches per worker of ``--pages`` pages each (alternately a new chain and
its removal, so the index stays small), round robin over the workers. This process runs the
real ``KvEventFeed`` into a ``BlockIndex``, with a ticker task measuring how late a 5 ms
sleep wakes up (what a request waiting on the loop would see).

Two modes: ``--rate 0`` (default) sends as fast as the publisher can, measuring the most the
feed applies; ``--rate R`` paces the fleet at R messages/s in all, measuring the share of a
core that load takes.

    PYTHONPATH=$PWD python bench/micro/kv_feed_rate.py [--workers 64 --messages 200 --pages 8 --rate 0]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.host import cpu_name, interpreter_ns_per_step  # noqa: E402
from policies.base import WorkerView  # noqa: E402
from index.block_index import BlockIndex  # noqa: E402
from index.kv_feed import KvEventFeed  # noqa: E402
from wire.hashing import page_hashes  # noqa: E402
from wire.kv_events import BlockRemoved, BlockStored, EventBatch, encode_batch, pack_seq  # noqa: E402

PAGE = 16


def payloads(worker: int, messages: int, pages: int) -> list[bytes]:
    """One worker's batches: a new chain of ``pages`` one-page stores, then its removal."""
    rng = random.Random(worker)
    out: list[bytes] = []
    for m in range(messages):
        if m % 2 == 0:
            tokens = [rng.randrange(32_000) for _ in range(pages * PAGE)]
            hashes = page_hashes(tokens, PAGE)
            events: list = [BlockStored([h], hashes[j - 1] if j else None, tokens[j * PAGE:(j + 1) * PAGE], PAGE)
                            for j, h in enumerate(hashes)]
        else:
            events = [BlockRemoved([h]) for h in reversed(hashes)]
        out.append(encode_batch(EventBatch(time.time(), events, None)))
    return out


def publish(workers: int, messages: int, pages: int, rate: float) -> None:
    """The publisher process: bind, print the ports, wait for "go" on stdin, send, print the
    send time."""
    import zmq

    ctx = zmq.Context()
    socks, ports = [], []
    for _ in range(workers):
        s = ctx.socket(zmq.PUB)
        s.setsockopt(zmq.SNDHWM, 0)  # keep everything: a drop would read as the feed's loss
        ports.append(s.bind_to_random_port("tcp://127.0.0.1"))
        socks.append(s)
    batches = [payloads(w, messages, pages) for w in range(workers)]
    print(",".join(map(str, ports)), flush=True)
    sys.stdin.readline()
    t0 = time.perf_counter()
    sent = 0
    for m in range(messages):
        for w, s in enumerate(socks):
            s.send_multipart([b"", pack_seq(m), batches[w][m]])
            sent += 1
            if rate:
                ahead = t0 + sent / rate - time.perf_counter()
                if ahead > 0:
                    time.sleep(ahead)
    print(f"sent {time.perf_counter() - t0:.3f}", flush=True)
    sys.stdin.readline()  # hold the sockets open until the subscriber is done
    ctx.destroy(linger=0)


async def subscribe(args: argparse.Namespace) -> dict[str, float]:
    pub = subprocess.Popen([sys.executable, __file__, "--publisher", str(args.workers),
                            "--messages", str(args.messages), "--pages", str(args.pages), "--rate", str(args.rate)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    try:
        assert pub.stdout is not None and pub.stdin is not None
        line = pub.stdout.readline().strip()
        if not line:
            raise RuntimeError("publisher did not start")
        ports = [int(p) for p in line.split(",")]
        index = BlockIndex(default_page_size=PAGE)
        feed = KvEventFeed(index)
        for i, p in enumerate(ports):
            feed.add(WorkerView(f"http://127.0.0.1:{20000 + i}", server_info={
                "page_size": PAGE, "kv_events": {"endpoint": f"tcp://127.0.0.1:{p}"}}))
        await feed.start()
        await asyncio.sleep(1.0)  # every SUB connected and subscribed (ZMQ's slow joiner)
        total = args.workers * args.messages
        lags: list[float] = []
        done = asyncio.Event()

        async def ticker() -> None:
            while not done.is_set():
                t = time.perf_counter()
                await asyncio.sleep(0.005)
                lags.append((time.perf_counter() - t - 0.005) * 1e3)

        tick = asyncio.create_task(ticker())
        cpu0, t0, loop0 = time.process_time(), time.perf_counter(), time.thread_time()
        pub.stdin.write("go\n")
        pub.stdin.flush()
        deadline = t0 + args.timeout
        while feed.counters["messages"] < total and time.perf_counter() < deadline:
            await asyncio.sleep(0.002)
        wall, cpu, loop_cpu = time.perf_counter() - t0, time.process_time() - cpu0, time.thread_time() - loop0
        done.set()
        await tick
        got = feed.counters["messages"]
        await feed.stop()
        pub.stdin.write("\n")
        pub.stdin.flush()
        sent_line = pub.stdout.readline().split()
        lags.sort()
        return {"received": got, "expected": total, "wall_s": wall, "cpu_s": cpu, "loop_cpu_s": loop_cpu,
                "send_s": float(sent_line[1]) if len(sent_line) == 2 else float("nan"),
                "gaps": feed.counters["gaps"], "unrecoverable": feed.counters["unrecoverable"],
                "lag_p50_ms": statistics.median(lags) if lags else 0.0,
                "lag_p99_ms": lags[min(len(lags) - 1, int(len(lags) * 0.99))] if lags else 0.0,
                "lag_max_ms": lags[-1] if lags else 0.0}
    finally:
        pub.kill()
        pub.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--messages", type=int, default=200, help="batches per worker")
    ap.add_argument("--pages", type=int, default=8, help="pages per batch (one event each)")
    ap.add_argument("--rate", type=float, default=0.0, help="messages/s for the whole fleet (0: as fast as possible)")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--publisher", type=int, help=argparse.SUPPRESS)  # (internal: the publisher process)
    args = ap.parse_args()
    if args.publisher:
        publish(args.publisher, args.messages, args.pages, args.rate)
        return
    try:
        import uvloop
        uvloop.install()
    except ImportError:  # pragma: no cover - the gateway's loop where it can have it
        pass
    r = asyncio.run(subscribe(args))
    print(f"# KV event feed cost ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)")
    print(f"machine: {cpu_name()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"{interpreter_ns_per_step():.0f} ns per plain-loop step; load average at end: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"command: PYTHONPATH=$PWD python bench/micro/kv_feed_rate.py {' '.join(sys.argv[1:])}")
    print(f"fleet: {args.workers} publishers, {args.messages} batches each of {args.pages} one-page events "
          f"(page {PAGE}), {'as fast as possible' if not args.rate else f'{args.rate:g} messages/s in all'}")
    pages = r["received"] * args.pages
    print()
    print("| received / sent | wall s | publisher send s | messages/s | pages/s | CPU % of a core | "
          "CPU us / message | CPU us / page | of which the event loop's thread | loop lag p50 / p99 / max ms | gaps (lost for good) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {r['received']:,} / {r['expected']:,} | {r['wall_s']:.2f} | {r['send_s']:.2f} "
          f"| {r['received'] / r['wall_s']:,.0f} | {pages / r['wall_s']:,.0f} | {100 * r['cpu_s'] / r['wall_s']:.0f} "
          f"| {1e6 * r['cpu_s'] / max(r['received'], 1):.0f} | {1e6 * r['cpu_s'] / max(pages, 1):.1f} "
          f"| {100 * r['loop_cpu_s'] / max(r['cpu_s'], 1e-9):.0f}% "
          f"| {r['lag_p50_ms']:.1f} / {r['lag_p99_ms']:.1f} / {r['lag_max_ms']:.1f} "
          f"| {r['gaps']:.0f} ({r['unrecoverable']:.0f}) |")


if __name__ == "__main__":
    main()
