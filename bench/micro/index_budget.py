"""The precise index's memory budget (``max_index_blocks``): memory held, and what keeping it costs.

For each budget, in a process of its own (so its RSS is its own), the decision bench's fleet
(``bench.decision_cost``: 64 workers, conversations of 250 pages cached on 1-3 of them) is
stored into a ``BlockIndex`` with that budget, then:

* RSS of the index once built, and blocks held and evicted;
* the event path at the budget: batches of 40 new pages (a scheduler step's chain, half
  continuing a conversation's first turn) applied per page, each store evicting what it
  pushes over (whole least recently used runs, so the cost comes in lumps: see the p99);
* a ``kv_events`` decision on the next turn of a conversation stored last (so still held):
  the walk touches its run in the eviction order (budget 0 does not keep an order at all).

    PYTHONPATH=$PWD python bench/micro/index_budget.py [--budgets 0 1000000 500000 250000]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.decision_cost import conversation, fill, fleet, rss_mib  # noqa: E402
from bench.decision_cost_live import p99, timed  # noqa: E402
from bench.host import cpu_name, interpreter_ns_per_step  # noqa: E402
from gateway.app import tune_gc  # noqa: E402
from policies.base import RequestView  # noqa: E402
from index.block_index import BlockIndex  # noqa: E402
from policies.kv_events import KvEvents  # noqa: E402
from wire.hashing import page_hashes  # noqa: E402
from wire.kv_events import BlockStored  # noqa: E402


def one(budget: int, blocks: int, page_size: int, conv_pages: int, batches: int, decisions: int, recent: int,
        seed: int) -> dict:
    """One budget's figures (run in a fresh process)."""
    rng = random.Random(seed)
    n_conv = max(1, blocks // conv_pages)
    workers, owners = fleet(64, page_size, n_conv, rng)
    gc.collect()
    base = rss_mib()
    t0 = time.perf_counter()
    policy = KvEvents(max_index_blocks=budget, speculative_ttl_s=3.0)
    index: BlockIndex = policy.index.precise  # type: ignore[attr-defined]
    fill(index, workers, owners, conv_pages, page_size)
    build_s = time.perf_counter() - t0
    gc.collect()
    mem = rss_mib() - base
    held = index.known_blocks()
    tune_gc()

    ps, cut = page_size, conv_pages * page_size // 5
    ev = random.Random(seed + 7)
    url = workers[-1].url
    steps = []
    for i in range(batches):
        head = conversation(ev.randrange(n_conv), conv_pages, ps)[:cut] if i % 2 else []
        tokens = head + [ev.randrange(32_000) for _ in range(40 * ps)]
        hashes = page_hashes(tokens, ps)
        first = len(head) // ps
        steps.append([BlockStored([hashes[j]], hashes[j - 1] if j else None, tokens[j * ps:(j + 1) * ps], ps)
                      for j in range(first, len(hashes))])
    evicted0 = index.evicted
    wall, cpu = timed(lambda b, _w: index.apply_batch(url, b), steps, workers)
    per_page = [c / 40 for c in cpu]

    # next turns of the conversations stored last (the most recent: held under every budget
    # that holds ``recent`` conversations and the stores above), the same for every budget
    last = list(owners)[-recent:]
    reqs = []
    for i in range(decisions):
        c = last[i % len(last)]
        tokens = conversation(c, conv_pages, ps)
        reqs.append(RequestView(f"d{i}", "/generate", token_ids=tokens[: cut * 2] + [ev.randrange(32_000)] * 40))
    dwall, dcpu = timed(policy.select, reqs, workers)
    return {"budget": budget, "rss_mib": mem, "build_s": build_s, "held": held,
            "evicted": index.evicted, "dropped": index.dropped,
            "store_evicted": index.evicted - evicted0,
            "store_page_median": statistics.median(per_page), "store_page_p99": p99(per_page),
            "decision_median": statistics.median(dcpu), "decision_p99": p99(dcpu)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", type=int, nargs="*", default=[0, 1_000_000, 500_000, 250_000])
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--conv-pages", type=int, default=250)
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--decisions", type=int, default=2000)
    ap.add_argument("--recent", type=int, default=400, help="conversations the decisions continue (the last stored)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.one, args.blocks, args.page_size, args.conv_pages, args.batches,
                             args.decisions, args.recent, args.seed)))
        return
    print("# precise index under a memory budget (max_index_blocks)")
    print(f"machine: {cpu_name()}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, "
          f"{interpreter_ns_per_step():.0f} ns per step of a plain Python loop")
    print(f"command: PYTHONPATH=$PWD python bench/micro/index_budget.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"fleet: 64 workers, {args.blocks:,} blocks stored (page {args.page_size}, "
          f"{args.conv_pages} pages a conversation); each budget in its own process")
    print()
    print("| max_index_blocks | held | evicted (of which by the 40-page stores) | dropped (parent evicted) "
          "| RSS MiB | bytes / block held | build s | store per page CPU median / p99 us "
          "| kv_events decision CPU median / p99 us |")
    print("|---|---|---|---|---|---|---|---|---|")
    for budget in args.budgets:
        cmd = [sys.executable, __file__, "--one", str(budget), "--blocks", str(args.blocks),
               "--page-size", str(args.page_size), "--conv-pages", str(args.conv_pages),
               "--batches", str(args.batches), "--decisions", str(args.decisions), "--recent", str(args.recent),
               "--seed", str(args.seed)]
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        print(f"| {budget or 'none'} | {r['held']:,} | {r['evicted']:,} ({r['store_evicted']:,}) | {r['dropped']:,} "
              f"| {r['rss_mib']:.0f} | {r['rss_mib'] * 2**20 / max(r['held'], 1):.0f} | {r['build_s']:.1f} "
              f"| {r['store_page_median']:.1f} / {r['store_page_p99']:.1f} "
              f"| {r['decision_median']:.1f} / {r['decision_p99']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
