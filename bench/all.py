"""Every benchmark in one command, in the order the report reads.

    PYTHONPATH=$PWD python -m bench.all            # ~30 min on a 2-core machine
    PYTHONPATH=$PWD python -m bench.all --quick    # smoke run, a few minutes

Each bench runs as its own process (so one crashing does not stop the rest), its output is
kept in bench/out/all/<name>.txt, and the benches that own a section of bench/RESULTS.md
(overhead, routing quality, PD vs colocated) rewrite it with machine, command and date.
The others print their tables for the sections that quote them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

BENCHES: list[tuple[str, list[str], list[str]]] = [
    # name, full args, --quick args
    ("overhead", [], ["--quick"]),
    ("routing_quality", [], ["--quick"]),
    ("pd_vs_colocated", [], ["--quick"]),
    ("pool_bench", ["--limit", "300", "--workers", "4", "--kv-bytes-per-token", "256", "--time-scale", "2"],
     ["--limit", "100", "--workers", "2", "--kv-bytes-per-token", "256", "--time-scale", "2"]),
    ("decision_cost", [], ["--blocks", "100000", "--decisions", "500"]),
    ("micro.hold_wake", [], ["--held", "10", "100", "--events", "30", "--repeat", "1"]),
    ("micro.cost_table", [], []),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", nargs="*", help="names to run (default: all)")
    a = p.parse_args(argv)
    out = ROOT / "bench" / "out" / "all"
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    summary = []
    for name, full, quick in BENCHES:
        if a.only and name not in a.only:
            continue
        cmd = [sys.executable, "-m", f"bench.{name}", *(quick if a.quick else full)]
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        started = time.monotonic()
        with open(out / f"{name}.txt", "w") as log:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        summary.append((name, rc, time.monotonic() - started))
        print((out / f"{name}.txt").read_text()[-3000:], flush=True)
    print("\n| bench | exit | seconds |\n|---|---|---|")
    for name, rc, secs in summary:
        print(f"| {name} | {rc} | {secs:.0f} |")
    return max((rc for _, rc, _ in summary), default=0)


if __name__ == "__main__":
    sys.exit(main())
