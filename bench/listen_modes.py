"""How a kvgate process group should listen (``gateway.listeners``): one ``SO_REUSEPORT``
socket per slot held by the supervisor (``reuseport``), one socket shared by every member
(``shared``), or one ``SO_REUSEPORT`` socket bound by each member (``reuseport-member``).

Every mode runs the same group (``--processes`` members, round robin, in front of one
``bench/stub_backend.py``), interleaved in every repetition, each test a closed loop of wrk:

- ``keepalive``  ``--concurrency`` keep-alive connections: req/s, and how the requests split
                 over the members (``kvgate_process_requests`` deltas: the busiest member's share)
- ``close``      the same with ``Connection: close`` on every request (a connection per request)
- ``reload``     keep-alive load while the supervisor gets SIGHUP one second in (each member is
                 replaced by a new one, the old one stops accepting): failed requests, req/s
- ``reload-close`` the same with a connection per request

    PYTHONPATH=$PWD /work/main/.venv/bin/python -m bench.listen_modes --server-cpus 1 --load-cpu 0
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

from bench.overhead import LUA, ROUTE, _pinned, _start, _wait_post, body, median
from bench.tables import machine, markdown, plain
from gateway import listeners
from tests.support import Proc, free_port, get_text, metric_value

MODES = listeners.MODES


def group_main(argv: list[str]) -> int:
    """``python -m bench.listen_modes serve MODE <kvgate serve flags>``: a group listening in that mode."""
    import logging

    from gateway.cli import build_parser, config_from_args
    from gateway.processes import supervise

    args = build_parser().parse_args(["serve", *argv[1:]])
    cfg = config_from_args(args)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return supervise(cfg, lambda: config_from_args(args), listen=argv[0])


def wrk(cpu: str, url: str, connections: int, seconds: float, close: bool) -> dict[str, float]:
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "--timeout", "10s", "-s", str(LUA), url + ROUTE]
    if close:
        argv[1:1] = ["-H", "Connection: close"]
    out = subprocess.run(_pinned(cpu, argv), env={**os.environ, "BODY": body(None), "COUNT_EVENTS": "0"},
                         capture_output=True, text=True, timeout=seconds + 60)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stdout[-2000:]} {out.stderr[-2000:]}")
    r = json.loads(lines[-1])
    return {"rps": r["requests"] / (r["duration_us"] / 1e6), "errors": r["errors"], "requests": r["requests"]}


def per_process(url: str, size: int) -> list[float]:
    text = get_text(url + "/metrics")
    return [metric_value(text, "kvgate_process_requests", process=str(i)) for i in range(size)]


def run_test(test: str, proc: Proc, url: str, a: argparse.Namespace) -> dict[str, float]:
    close = test.endswith("close")
    connections = a.close_concurrency if close else a.concurrency
    if test.startswith("reload"):  # members are replaced: no split to compare
        timer = threading.Timer(1.0, os.kill, (proc.popen.pid, signal.SIGHUP))
        timer.start()
        r = wrk(a.load_cpu, url, connections, a.reload_duration, close)
        timer.join()
        deadline = time.monotonic() + 30
        while proc.output().count("reload: done") < proc.reloads + 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.reloads += 1
        r["busiest"], r["split"] = float("nan"), "-"
        return r
    before = per_process(url, a.processes)
    r = wrk(a.load_cpu, url, connections, a.duration, close)
    time.sleep(1.5)  # each member publishes its count once a second (gateway.group_metrics)
    counts = [x - y for x, y in zip(per_process(url, a.processes), before)]
    r["busiest"] = max(counts) / max(sum(counts), 1)  # of the requests wrk made, during the test
    r["split"] = "/".join(f"{c:.0f}" for c in counts)
    return r


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        return group_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--duration", type=float, default=4.0)
    p.add_argument("--reload-duration", type=float, default=6.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--close-concurrency", type=int, default=16)
    p.add_argument("--load-cpu", default="0")
    p.add_argument("--server-cpus", default="1")
    p.add_argument("--tests", nargs="+", default=["keepalive", "close", "reload", "reload-close"])
    a = p.parse_args(argv)
    began = time.monotonic()
    started: list[Proc] = []
    results: dict[str, dict[str, list[dict[str, float]]]] = {m: {t: [] for t in a.tests} for m in MODES}
    try:
        stub_port = free_port()
        stub = _start("stub", a.server_cpus, "bench.stub_backend", "--port", str(stub_port))
        started.append(stub)
        _wait_post(stub, f"http://127.0.0.1:{stub_port}", 30)
        groups = {}
        for mode in MODES:
            port = free_port()
            proc = _start(mode, a.server_cpus, "bench.listen_modes", "serve", mode, "--host", "127.0.0.1",
                          "--port", str(port), "--processes", str(a.processes), "--policy", "round_robin",
                          "--worker-urls", f"http://127.0.0.1:{stub_port}")
            proc.reloads = 0
            started.append(proc)
            groups[mode] = (proc, f"http://127.0.0.1:{port}")
        for proc, url in groups.values():
            _wait_post(proc, url)
            wrk(a.load_cpu, url, a.concurrency, 1, False)  # warm-up
        for rep in range(a.reps):
            for test in a.tests:
                for mode, (proc, url) in groups.items():
                    r = run_test(test, proc, url, a)
                    results[mode][test].append(r)
                    print(f"rep {rep + 1}/{a.reps} {test:9s} {mode:9s} {r['rps']:8,.0f}/s  split {r['split']:>13s}"
                          f"  errors {r['errors']}", file=sys.stderr, flush=True)
    finally:
        for proc in reversed(started):
            proc.stop()
    head = ["listen"] + [c for t in a.tests for c in (f"{t} req/s", f"{t} busiest share (worst)", f"{t} errors")]
    rows = [head]
    for mode in MODES:
        row = [mode]
        for t in a.tests:
            rs = results[mode][t]
            worst = "-" if t.startswith("reload") else f"{max(r['busiest'] for r in rs):.2f}"
            row += [f"{median(rs, 'rps'):,.0f}", worst,
                    str(int(sum(r["errors"] for r in rs)))]
        rows.append(row)
    print(plain(rows))
    print("\n".join([
        "", f"- date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC}",
        "- command: `PYTHONPATH=$PWD python -m bench.listen_modes " + " ".join(shlex.quote(x) for x in argv) + "`",
        f"- machine: {machine()}",
        f"- setup: {a.processes} kvgate processes per mode, round robin, one stub backend; servers on CPU "
        f"{a.server_cpus or 'any'}, wrk on CPU {a.load_cpu or 'any'}; {a.reps} reps, medians (errors: summed);"
        f" busiest share: the busiest member's fraction of the requests, worst repetition (1/{a.processes} is even;"
        f" none after a reload, which replaces the members);"
        f" wall time {time.monotonic() - began:.0f} s", "", markdown(rows)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
