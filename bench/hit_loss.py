"""Where a router's cache hits went: reused, or lost, and lost how.

The trace says which earlier requests share each prompt's prefix; the simulated engines'
request logs (``--log-requests``, one file per worker) say which worker served each request
and how much of it the engine reused. For every prompt the reusable prefix is the longest
one an earlier request already brought to some worker (SGLang's page rule applied), and
what the engine did not reuse of it is lost one of two ways:

- **diverted**: served away from every worker that had been sent that prefix (the router
  traded the hit for a shorter queue, did not know where it was, or knew it was evicted
  there: the trace cannot tell, so this bounds what routing lost from above; ``cost``'s
  own ``diverted`` stat counts only the hits its index still saw);
- **evicted**: served where the prefix had been sent, which no longer held all of it (KV
  pool pressure, or a prefix still being prefilled when the follow-up came).

A router that never diverts can still lose to eviction; one that balances harder trades
evictions for diversions. Both are shares of all prompt tokens, like the hit rate, and
``hit + diverted + evicted`` is about the infinite-cache oracle's hit rate for that
routing. Joined by the replay's ``rid`` (``replay-N-...``), which both kvgate and
sglang-router pass through to the engine.

Where the gateway ran ``cost`` at ``--log-level debug`` (the bench's
``KVGATE_BENCH_LOG_LEVEL=debug``), its log in the same directory also says what each hit
given up bought: the TTFT the chosen worker was predicted to save over the prefix's holder.

    python -m bench.hit_loss LOG_DIR_OR_FILES... [--limit 800]
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from .trace import BLOCK, DEFAULT_TRACE, TraceRecord, block_spans, engine_cap, load_trace

_LINE = re.compile(r"rid=replay-(\d+)-\S* prompt=(\d+) cached=(\d+)")
_DIVERTED = re.compile(r"diverted \S+: \S+ predicted TTFT ([\d.]+)s with (\d+) cached tokens; "
                       r"holder \S+ ([\d.]+)s with (\d+)")


def served(logs: str | Path | Iterable[Path]) -> dict[int, tuple[str, int]]:
    """Trace index -> (worker log, cached tokens), from the engines' request logs (the
    simulator started with ``--log-requests``): the given files, or every engine log in a
    directory (the gateway's own ``router.log`` skipped)."""
    if isinstance(logs, (str, Path)):
        logs = [p for p in sorted(Path(logs).glob("*.log")) if p.name != "router.log"]
    out: dict[int, tuple[str, int]] = {}
    for path in logs:
        with open(path, errors="replace") as f:
            for line in f:
                m = _LINE.search(line)
                if m:
                    out[int(m.group(1))] = (path.stem, int(m.group(3)))
    return out


def split(records: Sequence[TraceRecord], by_index: Mapping[int, tuple[str, int]], page_size: int = 64,
          block_size: int = BLOCK) -> dict[str, float]:
    """Shares of all served prompt tokens: ``hit``, ``diverted``, ``evicted``; and
    ``requests_diverted``, how many follow-ups went away from their prefix."""
    holders: dict[int, dict[str, int]] = {}  # block id -> worker -> tokens of it served there
    total = hit = diverted = evicted = 0
    moved = 0
    for i, r in enumerate(records):
        got = by_index.get(i)
        if got is None:  # failed or not logged: not part of any share
            continue
        worker, cached = got
        reusable, where = 0, None
        for h, length in block_spans(r, block_size):  # longest prefix some worker was given
            held = holders.get(h)
            if not held:
                break
            step = min(max(held.values()), length)
            reusable += step
            where = [w for w, n in held.items() if n >= step]
            if step < length:
                break
        reusable = engine_cap(reusable, r.input_length, page_size)
        lost = max(reusable - cached, 0)
        if lost and where is not None and worker not in where:
            diverted += lost
            moved += 1
        else:
            evicted += lost
        total += r.input_length
        hit += cached
        for h, length in block_spans(r, block_size):
            held = holders.setdefault(h, {})
            if held.get(worker, 0) < length:
                held[worker] = length
    if not total:
        return {}
    return {"hit": hit / total, "diverted": diverted / total, "evicted": evicted / total,
            "requests_diverted": float(moved)}


def diversions(gateway_log: str | Path, long_s: float = 2.0) -> dict[str, float]:
    """``cost``'s diversions in a gateway log written at debug level: how many, the cached
    tokens given up, and the TTFT they were predicted to save (the holder's less the chosen
    worker's) in total, at the median, and for those that saved more than ``long_s``."""
    saved: list[tuple[float, float]] = []  # (seconds saved, tokens given up)
    with open(gateway_log, errors="replace") as f:
        for line in f:
            m = _DIVERTED.search(line)
            if m:
                chosen_ttft, chosen_cached, held_ttft, held = map(float, m.groups())
                saved.append((held_ttft - chosen_ttft, held - chosen_cached))
    if not saved:
        return {}
    seconds = sorted(s for s, _ in saved)
    long = [(s, t) for s, t in saved if s > long_s]
    return {"diverted": float(len(saved)), "tokens": sum(t for _, t in saved), "saved_s": sum(seconds),
            "saved_s_median": seconds[len(seconds) // 2], "long": float(len(long)),
            "long_tokens": sum(t for _, t in long), "long_saved_s": sum(s for s, _ in long)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", help="one run's engine request logs (simulator --log-requests), "
                   "or the directory holding only that run's")
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--limit", type=int, default=800, help="first N requests of the trace, as replayed")
    a = p.parse_args(argv)
    got = served(a.logs[0] if len(a.logs) == 1 and Path(a.logs[0]).is_dir() else map(Path, a.logs))
    if not got:
        print(f"no engine request lines in {' '.join(a.logs)} (start the simulators with --log-requests)")
        return 1
    s = split(load_trace(a.trace, a.limit), got)
    print(f"{len(got)} requests: hit {s['hit']:.4f}, lost diverted {s['diverted']:.4f} "
          f"({s['requests_diverted']:.0f} requests), lost evicted {s['evicted']:.4f} (shares of prompt tokens)")
    gateway = sorted(Path(a.logs[0]).glob("router*.log")) if Path(a.logs[0]).is_dir() else []
    d = diversions(gateway[0]) if gateway else {}
    if d:
        print(f"cost diverted {d['diverted']:.0f} requests, {d['tokens']:.0f} cached tokens given up, predicted to "
              f"save {d['saved_s']:.1f} s of TTFT (median {d['saved_s_median']:.3f} s); {d['long']:.0f} of them "
              f"over 2 s: {d['long_tokens']:.0f} tokens, {d['long_saved_s']:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
