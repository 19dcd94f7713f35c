"""Workers killed mid-replay: what clients see with mid-stream migration on and off.

A Mooncake-trace replay (chat, streamed) through kvgate to simulated workers, three runs
on fresh fleets with the same arrival schedule:

- ``no kills``: the baseline each request's latency is compared with;
- ``kills, migration off`` (``--migration-limit 0``) and ``kills, migration on`` (the
  default limit, 2): every ``--kill-every`` wall seconds one worker (in turn) is SIGKILLed
  and started again on its own port ``--restart-after`` seconds later.

Reported per run: requests, client-visible errors (an error event or a non-200 answer),
migrations (from the gateway's log and ``kvgate_migrations_total``), and for the migrated
requests the stall at the break (longest gap between two events, against the same
request's in the baseline) and the end-to-end latency added. Latencies are wall seconds.

    PYTHONPATH=$PWD python -m bench.migration        # ~2.5 min on 2 cores; writes its
                                                     # section of bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import re
import shlex
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

from bench.replay import ReplayResult, replay
from bench.services import http_get, start_kvgate
from bench.tables import machine, markdown, plain, write_results
from bench.trace import DEFAULT_TRACE, load_trace
from simulator.cluster import SimCluster

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
_CONTINUED = re.compile(r"request (replay-\d+) continued on")


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def _pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def killer(cluster: SimCluster, every: float, down: float, stop: threading.Event, kills: list[float]) -> None:
    """Every ``every`` s kill the next worker and start it again ``down`` s later."""
    start, n = time.monotonic(), 0
    while not stop.wait(max(0.0, start + (n + 1) * every - time.monotonic())):
        url = cluster.urls[n % len(cluster.urls)]
        cluster.kill(url)
        kills.append(time.monotonic() - start)
        stop.wait(down)
        cluster.restart(url)
        n += 1


def run(a: argparse.Namespace, records: list, limit: int | None, kill: bool, logs: Path) -> dict:
    engine = ["--profile", a.profile, "--time-scale", str(a.time_scale), "--stream-interval", "4"]
    name = "base" if not kill else f"limit{limit}"
    (logs / name).mkdir(parents=True, exist_ok=True)
    with SimCluster(workers=a.workers, engine_args=engine, kv_events=False, log_dir=str(logs / name)) as cluster:
        extra = ["--log-level", "info", "--health-check-interval-secs", "1"]
        if limit is not None:
            extra += ["--migration-limit", str(limit)]
        gw = start_kvgate(cluster.urls, "cost", {}, logs / f"gateway-{name}.log", extra=extra)
        stop, kills = threading.Event(), []
        thread = threading.Thread(target=killer, args=(cluster, a.kill_every, a.restart_after, stop, kills))
        try:
            if kill:
                thread.start()
            res: ReplayResult = asyncio.run(replay(
                records, gw.url, api="chat", speedup=a.time_scale * a.arrival_speedup, concurrency=1024,
                model="sim-llama-8b", max_tokens_cap=a.max_tokens, time_scale=1.0, timeout=300))
            metrics = http_get(gw.url + "/metrics")[1].decode()
        finally:
            stop.set()
            if kill:
                thread.join(60)
            gw.stop()
        migrated = set(_CONTINUED.findall(gw.log_path.read_text(errors="replace")))
    return {"res": res, "kills": len(kills), "migrated": migrated, "metrics": metrics,
            "lag": res.meta.get("sim_max_lag_s")}


def row_of(label: str, r: dict, base: dict) -> list[str]:
    rows = r["res"].rows
    errors = [x for x in rows if not x.ok]
    by_index = {x.index: x for x in base["res"].rows if x.ok}
    moved = [x for x in rows if x.ok and f"replay-{x.index}" in r["migrated"] and x.index in by_index]
    stall = [x.max_gap_s for x in moved]
    stall_base = [by_index[x.index].max_gap_s for x in moved]
    added = [x.e2e_s - by_index[x.index].e2e_s for x in moved]
    ttft = [x.ttft_s - by_index[x.index].ttft_s for x in moved if x.ttft_s is not None and by_index[x.index].ttft_s]

    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    return [label, str(len(rows)), str(r["kills"]), str(len(errors)),
            str(int(_metric(r["metrics"], "kvgate_migrations_total"))),
            str(int(_metric(r["metrics"], "kvgate_migrations_failed_total"))), str(len(moved)),
            s(_pct(ttft, 50)), s(_pct(stall_base, 50)), s(_pct(stall, 50)), s(_pct(stall, 90)), s(_pct(added, 50)),
            s(_pct(added, 90)), s(r["lag"])]


def reading(rows: list[list[str]]) -> str:
    """A few lines on the table's figures."""
    head, off, on = rows[0], dict(zip(rows[0], rows[2])), dict(zip(rows[0], rows[3]))
    assert head[0] == "run"
    return (f"Without migration every stream in flight on a killed worker ends in an error event: "
            f"{off['client errors']} of {off['requests']} requests. With it {on['client errors']} did: "
            f"{on['migrations']} continuations, {on['migrations failed']} of them failed. A migrated request pays "
            f"for its break: its continuation (prompt plus output so far) is prefilled again on another worker, "
            f"behind that worker's queue while one of the fleet is down, so its longest stall is "
            f"{on['stall p50 s']} s at the median and {on['stall p90 s']} s at p90 (against "
            f"{on['stall p50 s (no kills)']} s between events without kills) and it ends {on['added e2e p50 s']} s "
            f"later at the median. Breaks before the first byte are retries, in both runs.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.migration", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--profile", default="llama3-8b-h100")
    p.add_argument("--time-scale", type=float, default=2.0)
    p.add_argument("--arrival-speedup", type=float, default=0.5,
                   help="trace time compressed this much (0.5: the fleet about half busy)")
    p.add_argument("--max-tokens", type=int, default=256, help="output tokens asked, at most")
    p.add_argument("--kill-every", type=float, default=5.0, help="wall seconds between two kills")
    p.add_argument("--restart-after", type=float, default=2.0, help="wall seconds a killed worker stays down")
    p.add_argument("--no-write", action="store_true", help="print the table, leave bench/RESULTS.md alone")
    a = p.parse_args(argv)
    records = load_trace(a.trace, a.requests)
    logs = Path(tempfile.mkdtemp(prefix="kvgate-migration-"))
    base = run(a, records, None, False, logs)
    off = run(a, records, 0, True, logs)
    on = run(a, records, None, True, logs)
    header = ["run", "requests", "kills", "client errors", "migrations", "migrations failed", "migrated ok",
              "added TTFT p50 s", "stall p50 s (no kills)", "stall p50 s", "stall p90 s", "added e2e p50 s",
              "added e2e p90 s", "sim lag s"]
    rows = [header, row_of("no kills", base, base), row_of("kills, migration off", off, base),
            row_of("kills, migration on (limit 2)", on, base)]
    print(plain(rows))
    print(f"logs: {logs}")
    if a.no_write:
        return 0
    cmd = "PYTHONPATH=$PWD python -m bench.migration" + (" " + shlex.join(argv) if argv else "")
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = f"""## Mid-stream migration under worker kills (`bench/migration.py`)

- {when}; {machine()}
- `{cmd}`
- {len(records)} Mooncake-trace chat requests (output capped at {a.max_tokens} tokens), streamed through kvgate
  (cost policy) to {a.workers} simulated {a.profile} workers at time scale {a.time_scale:g}, arrivals
  {a.arrival_speedup:g}x the trace's; in the kill runs a worker (in turn) is SIGKILLed every {a.kill_every:g} s
  and restarted on its port {a.restart_after:g} s later. Wall seconds. Columns on "migrated ok" requests (finished
  after a migration), each against the same request in the run without kills: "added TTFT" (a break
  before the first token re-runs the prefill elsewhere), "stall" (the longest gap between two events after
  the first token: the break), "added e2e" (end-to-end latency).

{markdown(rows)}

{textwrap.fill(reading(rows), 100)}
"""
    write_results(section, RESULTS, "main", script="bench/migration.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
