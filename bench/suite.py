"""Workload suite: every router on every workload of ``bench.workloads``, one table.

Each (workload, router) run is ``routing_quality``'s own run (``run_one``: a fresh simulated
cluster, the router as a process, the replay) and analysis (``analyse``); only the records
differ. Routers are interleaved within each workload and repetition, so a drift in the
machine's load hits them alike; the headline is the median over repetitions.

    PYTHONPATH=$PWD python -m bench.suite --quick           # a third of each workload, one pass (~10 min)
    PYTHONPATH=$PWD python -m bench.suite                   # full sizes, 2 repetitions
    PYTHONPATH=$PWD python -m bench.suite --quick --workloads agents rag --sweep work_weight=3,12,48

Writes bench/out/suite/ (summary.json, table.md, suite.png) and, unless ``--no-results``,
the "Workload suite" section of bench/RESULTS.md and bench/results/suite.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path

from . import services
from .routing_quality import RunSpec, analyse, machine, parse_spec, run_one
from .routing_quality import build_parser as quality_parser
from .suite_report import format_table, medians, targets, update_results, write_outputs
from .trace import oracle_hit_rate
from .workloads import WORKLOADS, Fleet, offered

ROOT = Path(__file__).resolve().parent.parent
QUICK_SIZES = {"chat": 200, "long": 80}  # others: a third of the full size


def router_specs(a: argparse.Namespace) -> list[RunSpec]:
    specs = [parse_spec("kvgate", t) for t in a.kvgate]
    for item in a.sweep:  # key=v1,v2,...: one cost run per value
        key, _, values = item.partition("=")
        specs += [parse_spec("kvgate", f"cost[{key}={v}]") for v in values.split(",") if v]
    specs += [parse_spec("sglang-router", t) for t in a.sglang_router]
    if a.smg:
        if hasattr(services, "start_smg"):
            specs += [parse_spec("smg", t) for t in a.smg]
        else:
            print("suite: bench.services has no start_smg; skipping the smg rows", file=sys.stderr)
    return specs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.suite", description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--kvgate", nargs="*", default=["cost", "cache_aware"], metavar="POLICY")
    p.add_argument("--sglang-router", nargs="*", default=["cache_aware"], metavar="POLICY")
    p.add_argument("--smg", nargs="*", default=["cache_aware"], metavar="POLICY",
                   help="SMG policies (skipped while bench.services has no start_smg)")
    p.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                   help="extra cost runs, one per value of a policy option (repeatable)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every workload's size")
    p.add_argument("--load", type=float, default=1.0, help="multiply every workload's offered load")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--profile", default="llama3-8b-h100")
    p.add_argument("--time-scale", type=float, default=1.0, help="simulated s per wall s")
    p.add_argument("--repeat", type=int, default=None, help="passes over every router (default 2, quick 1)")
    p.add_argument("--quick", action="store_true", help="a third of each workload, one pass")
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "suite"))
    p.add_argument("--render", action="store_true", help="run nothing: rewrite RESULTS.md from --out's summary.json")
    p.add_argument("--no-results", action="store_true", help="do not touch bench/RESULTS.md and bench/results/")
    return p


def run_args(a: argparse.Namespace) -> argparse.Namespace:
    """What ``run_one`` and ``analyse`` read, from routing_quality's own defaults."""
    q = quality_parser().parse_args([])
    q.workers, q.profile, q.time_scale, q.arrival_speedup = a.workers, a.profile, a.time_scale, 1.0
    return q


def workload_setup(name: str, a: argparse.Namespace, fleet: Fleet) -> tuple[list, dict]:
    w = WORKLOADS[name]
    size = round((QUICK_SIZES.get(name, w.size // 3) if a.quick else w.size) * a.scale)
    records = w.make(size, w.load * a.load, fleet, a.seed)
    load = offered(records, fleet)
    return records, {"workload": name, "what": w.what, "requests": len(records), "oracle_hit_rate": oracle_hit_rate(records),
                     **load}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    out = Path(a.out)
    if a.render:
        saved = json.loads((out / "summary.json").read_text())
        for p in update_results(ROOT / "bench", saved["meta"], saved["setups"], saved["runs"], out):
            print(f"updated {p.relative_to(ROOT)}")
        return 0
    repeat = a.repeat or (1 if a.quick else 2)
    fleet = Fleet(a.workers, a.profile)
    q = run_args(a)
    specs = router_specs(a)
    host = machine()
    setups = {}
    for name in a.workloads:
        records, s = workload_setup(name, a, fleet)
        setups[name] = s
        print(f"{name}: {s['requests']} requests over {s['span_s']:.1f} simulated s ({s['req_per_s']:.1f} req/s); "
              f"offered prefill load {s['prefill_load_no_cache']:.2f} with no cache, "
              f"{s['prefill_load_at_bounded_oracle']:.2f} at the bounded oracle's hit rate "
              f"{s['bounded_oracle_hit_rate']:.3f}; TTFT floor mean {s['ttft_floor_mean_s']:.3f}s "
              f"p99 {s['ttft_floor_p99_s']:.3f}s", flush=True)
    rows = []
    for rep in range(repeat):
        for name in a.workloads:
            records, s = workload_setup(name, a, fleet)
            for spec in specs:
                run = run_one(spec, records, q, out / name, rep)
                row = analyse(run, s["oracle_hit_rate"], s["bounded_oracle_hit_rate"], q)
                row.update(workload=name, base_label=row["label"], repeat=rep + 1)
                rows.append(row)
                print(f"  {name} {row['label']} #{rep + 1}: hit {row['hit_rate']:.3f} "
                      f"({row['hit_vs_bounded'] or 0:.2f} of bounded), TTFT mean {row['ttft_mean_s'] or 0:.3f}s "
                      f"p99 {row['ttft_p99_s'] or 0:.3f}s, lag max {row['sim_lag_max_s']:.3f}s, "
                      f"{row['errors']} errors, {row['run_wall_s']:.0f}s wall", flush=True)
    command = "PYTHONPATH=$PWD python -m bench.suite" + (" " + shlex.join(argv) if argv else "")
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": host, "command": command, "repeat": repeat, "workers": a.workers, "profile": a.profile,
            "time_scale": a.time_scale}
    summary = medians(rows)
    print(format_table(summary, setups))
    print("\n".join(targets(summary, setups)))
    paths = write_outputs(out, meta, setups, rows)
    print("wrote " + ", ".join(str(p) for p in paths))
    if not a.no_results:
        for p in update_results(ROOT / "bench", meta, setups, rows, out):
            print(f"updated {p.relative_to(ROOT)}")
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
