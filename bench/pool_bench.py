"""The shared Mooncake pool against none, on the Mooncake conversation trace.

Same fleet, slice, policy and host tier in both runs; the only difference is
``SimCluster(pool=True)``: a real ``mooncake_master`` and every worker on it as HiCache L3.
The fleet is made capacity-bound on purpose (small GPU pool per worker), because on this
trace conversation turns come back long after one worker could have kept their prefix.

    python -m bench.pool_bench --workers 4 --limit 300 --time-scale 4

Prints one table row per mode: hit rate (of which from the pool), TTFT in simulated
seconds, and the pool traffic the workers measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
import urllib.request

from simulator.cluster import SimCluster
from tests.support import Proc, free_port

from .replay import replay
from .trace import load_trace, oracle_hit_rate

def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def run_mode(pool: bool, a: argparse.Namespace) -> dict:
    engine = ["--profile", a.profile, "--time-scale", str(a.time_scale), "--max-total-tokens", str(a.gpu_tokens),
              "--hicache-ratio", str(a.hicache_ratio), "--kv-bytes-per-token", str(a.kv_bytes_per_token),
              "--hicache-storage-prefetch-policy", a.prefetch_policy]
    records = load_trace(a.trace, a.limit)
    with SimCluster(workers=a.workers, engine_args=engine, pool=pool, pool_segment=a.pool_segment) as cluster:
        port = free_port()
        gw = Proc.python("gateway", "serve", "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
                         *cluster.urls, "--policy", a.policy, "--tokenizer", "byte", name="gateway")
        try:
            base = f"http://127.0.0.1:{port}"
            gw.wait_http(base + "/readiness", timeout=60)
            time.sleep(1.0)  # let the policy subscribe to every worker's KV events
            result = asyncio.run(replay(records, base, api="generate", speedup=a.time_scale,
                                        max_tokens_cap=a.max_tokens_cap, time_scale=a.time_scale))
            stats: dict[str, float] = {}
            for u in cluster.urls:
                for k, v in (_get_json(u + "/server_info")["simulator"].get("pool") or {}).items():
                    stats[k] = stats.get(k, 0) + v
        finally:
            gw.stop()
    s = result.summary()
    s["pool"] = stats
    return s


def _row(name: str, s: dict, workers: int) -> str:
    pool = s.get("pool") or {}
    storage = pool.get("credited_tokens", 0) / s["prompt_tokens"] if s["prompt_tokens"] else 0.0
    fetched = pool.get("fetch_bytes", 0)
    bw = fetched / pool["fetch_wall_s"] / 1e9 if pool.get("fetch_wall_s") else 0.0
    traffic = (f"{pool.get('backup_pages', 0):.0f} pages put, {fetched / 1e6:.0f} MB got at {bw:.2f} GB/s "
               f"measured, speedup {pool.get('speedup', 0) / workers:.1f}; per request: load charged "
               f"{pool.get('load_sim_s', 0) / s['requests'] * 1e3:.0f} sim ms, query {pool.get('query_wall_s', 0) / s['requests'] * 1e3:.1f} "
               f"wall ms, prefetch {pool.get('prefetch_wall_s', 0) / s['requests'] * 1e3:.1f} wall ms" if pool else "-")
    return (f"| {name} | {s['ok']}/{s['requests']} | {s['hit_rate']:.3f} | {storage:.3f} | "
            f"{s['ttft_mean_s']:.2f} / {s['ttft_p50_s']:.2f} / {s['ttft_p99_s']:.2f} | {s['wall_s']:.0f} | {traffic} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pool_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default="/work/shared/traces/mooncake_conversation_trace.jsonl")
    p.add_argument("--limit", type=int, default=300)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--policy", default="cost")
    p.add_argument("--profile", default="llama3-8b-h100")
    p.add_argument("--time-scale", type=float, default=4.0)
    p.add_argument("--gpu-tokens", type=int, default=100_000, help="--max-total-tokens per worker")
    p.add_argument("--hicache-ratio", type=float, default=1.0)
    p.add_argument("--kv-bytes-per-token", type=int, default=1024, help="bytes really moved per token")
    p.add_argument("--pool-segment", default="512mb", help="memory each worker lends to the pool")
    p.add_argument("--prefetch-policy", default="wait_complete")
    p.add_argument("--max-tokens-cap", type=int, default=32)
    p.add_argument("--modes", default="none,pool")
    a = p.parse_args(argv)
    records = load_trace(a.trace, a.limit)
    print(f"# {platform.node()} {os.cpu_count()} cpu, python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"# {a.limit} requests, {sum(r.input_length for r in records) / 1e6:.2f} M prompt tokens, "
          f"oracle hit rate (infinite cache) {oracle_hit_rate(records):.3f}")
    print("| mode | ok | hit rate | from pool | TTFT mean / p50 / p99 (sim s) | wall s | pool traffic |")
    print("|---|---|---|---|---|---|---|")
    for mode in a.modes.split(","):
        s = run_mode(mode == "pool", a)
        print(_row(mode, s, a.workers), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
