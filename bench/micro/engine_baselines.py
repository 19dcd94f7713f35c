"""Client-side routing baselines on a simulated fleet: how much routing alone moves hit rate.

Starts ``--workers`` simulated workers, replays the same trace slice once per strategy
(caches flushed in between) and prints one row per strategy. No gateway involved: this is
the yardstick the gateway's policies are compared against.

    python -m bench.micro.engine_baselines --workers 4 --limit 400 --time-scale 50
"""

from __future__ import annotations

import argparse
import asyncio
import random
import urllib.request
import zlib
from collections.abc import Sequence

from simulator.cluster import SimCluster

from ..replay import replay, round_robin
from ..trace import DEFAULT_TRACE, TraceRecord, bounded_oracle_hit_rate, load_trace, oracle_hit_rate


def conversation_affinity(i: int, record: TraceRecord, urls: Sequence[str]) -> str:
    """Sticky by conversation: the first hash id after the shared system block."""
    key = record.hash_ids[1] if len(record.hash_ids) > 1 else (record.hash_ids[0] if record.hash_ids else i)
    return urls[zlib.crc32(str(key).encode()) % len(urls)]


def affinity_oracle(records: Sequence[TraceRecord], workers: int, capacity: int) -> float:
    """Trace-only hit rate if ``conversation_affinity`` routed to ``workers`` LRU caches."""
    urls = [str(i) for i in range(workers)]
    groups: dict[str, list[TraceRecord]] = {}
    for i, r in enumerate(records):
        groups.setdefault(conversation_affinity(i, r, urls), []).append(r)
    total = sum(r.input_length for r in records)
    hit = sum(bounded_oracle_hit_rate(g, capacity) * sum(r.input_length for r in g) for g in groups.values())
    return hit / total if total else 0.0


def uniform_random(seed: int = 0):
    rng = random.Random(seed)
    return lambda i, record, urls: urls[rng.randrange(len(urls))]


def _flush(urls: Sequence[str]) -> None:
    for u in urls:
        urllib.request.urlopen(urllib.request.Request(u + "/flush_cache", method="POST"), timeout=10).read()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--limit", type=int, default=400)
    p.add_argument("--time-scale", type=float, default=50)
    p.add_argument("--max-tokens-cap", type=int, default=256)
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--engine-args", default="", help="extra worker options, e.g. '--enable-hierarchical-cache'")
    a = p.parse_args(argv)
    records = load_trace(a.trace, a.limit)
    strategies = {"round_robin": round_robin, "random": uniform_random(), "conversation_affinity": conversation_affinity}
    print(f"{a.limit} requests, {a.workers} workers, time_scale {a.time_scale:g}, output capped at "
          f"{a.max_tokens_cap}; oracle hit rate: one infinite cache {oracle_hit_rate(records):.3f}, "
          f"conversation affinity over {a.workers} LRU pools of 400k tokens "
          f"{affinity_oracle(records, a.workers, 400_000):.3f}")
    engine_args = ["--time-scale", str(a.time_scale), *a.engine_args.split()]
    print(f"worker options: {' '.join(engine_args)}")
    print(f"{'strategy':<24}{'hit rate':>9}{'TTFT p50 s':>12}{'TTFT p99 s':>12}{'TPOT p50 ms':>13}{'errors':>8}")
    with SimCluster(workers=a.workers, engine_args=engine_args, kv_events=False) as c:
        for name, router in strategies.items():
            _flush(c.urls)
            res = asyncio.run(replay(records, c.urls, speedup=a.time_scale, router=router,
                                     max_tokens_cap=a.max_tokens_cap, time_scale=a.time_scale))
            s = res.summary()
            print(f"{name:<24}{s['hit_rate']:>9.3f}{s['ttft_p50_s'] or 0:>12.2f}{s['ttft_p99_s'] or 0:>12.2f}"
                  f"{(s['tpot_p50_s'] or 0) * 1000:>13.1f}{s['errors']:>8}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
