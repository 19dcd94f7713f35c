"""Router overhead: the same stub backend reached directly and through each router, in one run.

Variants (all in front of the same stub process(es), all alive for the whole run):

- ``direct``        the stub itself (baseline)
- ``kvgate``        ``python -m gateway serve --policy round_robin``
- ``sglang-router`` ``python -m sglang_router.launch_router --policy round_robin`` (Rust)
- ``smg``           ``python -m smg launch --policy round_robin``: the ``smg`` package (Rust; 1.13 was
                    measured), from the interpreter ``--smg-python`` names (default: ``.venv-smg``,
                    which ``scripts/setup.sh --bench`` installs; left out when none is found)
- ``kvgate-pN``     ``kvgate serve --processes N``, one variant per N in ``--kvgate-processes``
- ``aiohttp-min``   ``bench/proxy_variants.py aiohttp``: bare aiohttp.web proxy
- ``starlette-min`` ``bench/proxy_variants.py starlette``: Starlette+uvicorn proxy, same client

Tests, each a closed loop of ``--duration`` seconds, repeated ``--reps`` times with the
variants interleaved inside every repetition (so slow drifts in machine load hit all alike):

- ``rps``   non-stream chat completions at ``--concurrency`` connections: req/s, p50/p99
- ``lat``   the same at 1 connection: p50/p99 and the latency added over ``direct``
- ``sseN``  streamed chat completions of N chunks (``max_tokens=N`` tells the stub how many)
            at ``--concurrency`` connections: streams/s and SSE chunks/s (events counted)

Pinning: the load generator runs on ``--load-cpu``, every router on ``--server-cpus``, the
same for every variant, and the stubs there too unless ``--stub-cpus`` gives them their own. Medians over repetitions are reported.
Results are printed and written into a marked section of ``bench/RESULTS.md``.

    PYTHONPATH=$PWD /work/venv/bin/python -m bench.overhead            # ~4 min
    PYTHONPATH=$PWD /work/venv/bin/python -m bench.overhead --quick    # ~1 min, a smoke run
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.tables import machine, markdown, plain, versions, write_results  # noqa: F401 (bench.micro uses them from here)
from bench.services import smg_python
from tests.support import ROOT, Proc, child_env, free_port

RESULTS = ROOT / "bench" / "RESULTS.md"
LUA = ROOT / "bench" / "wrk_post.lua"
MODEL = "stub-model"
ROUTE = "/v1/chat/completions"
VARIANTS = ("direct", "kvgate", "sglang-router", "smg", "aiohttp-min", "starlette-min")


def body(stream_chunks: int | None) -> str:
    msg = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi in one word."}]}
    if stream_chunks:
        msg.update(stream=True, max_tokens=stream_chunks)
    return json.dumps(msg, separators=(",", ":"))


@dataclass
class Variant:
    name: str
    url: str
    procs: list[Proc]

    def cpu(self) -> float:
        return group_cpu_seconds([p.popen.pid for p in self.procs])


def _pinned(cpus: str, argv: list[str]) -> list[str]:
    return ["taskset", "-c", cpus, *argv] if cpus else argv


def _start(name: str, cpus: str, *argv: str, tree: Path | None = None, python: str = sys.executable) -> Proc:
    env, flags = child_env(), []
    if tree is not None:  # another checkout of kvgate first on the path (-P: not the cwd): before/after
        env["PYTHONPATH"] = f"{tree}{os.pathsep}{env['PYTHONPATH']}"
        flags = ["-P"]
    return Proc(_pinned(cpus, [python, *flags, "-m", *argv]), env=env, name=name)


def _wait_post(proc: Proc, url: str, timeout: float = 60.0) -> None:
    """Ready means a real completion comes back, whatever the router's health route says."""
    deadline = time.monotonic() + timeout
    req_body = body(None).encode()
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.output()[-3000:]}")
        try:
            req = urllib.request.Request(url + ROUTE, data=req_body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{proc.name} not answering at {url} after {timeout}s:\n{proc.output()[-3000:]}")


def start_variants(names: list[str], stubs: int, cpus: str, started: list[Proc],
                   kvgate_ref: Path | None = None, stub_cpus: str | None = None,
                   smg_python: str | None = sys.executable) -> list[Variant]:
    """Every process goes into ``started`` as soon as it exists, so the caller stops them all
    even when a later one fails to come up."""
    stub_procs, stub_urls = [], []
    for i in range(stubs):
        port = free_port()
        stub_procs.append(_start(f"stub{i}", cpus if stub_cpus is None else stub_cpus, "bench.stub_backend",
                                 "--port", str(port), "--chunks", "16"))
        started.append(stub_procs[-1])
        stub_urls.append(f"http://127.0.0.1:{port}")
    for proc, url in zip(stub_procs, stub_urls):
        _wait_post(proc, url, 30)
    variants = []
    for name in names:
        if name == "direct":
            # with two stubs the direct baseline is the first one: per-request cost is what matters
            variants.append(Variant(name, stub_urls[0], stub_procs[:1]))
            continue
        port = free_port()
        if name in ("kvgate", "kvgate-ref") or name.startswith("kvgate-p"):
            processes = ["--processes", name.removeprefix("kvgate-p")] if name.startswith("kvgate-p") else []
            proc = _start(name, cpus, "gateway", "serve", "--host", "127.0.0.1", "--port", str(port),
                          "--policy", "round_robin", "--log-level", "warning", "--worker-urls", *stub_urls,
                          *processes, tree=kvgate_ref if name == "kvgate-ref" else None)
        elif name in ("sglang-router", "smg"):  # SMG takes sglang-router's flags
            module = ("smg", "launch") if name == "smg" else ("sglang_router.launch_router",)
            proc = _start(name, cpus, *module, "--host", "127.0.0.1", "--port", str(port),
                          "--policy", "round_robin", "--log-level", "warn", "--prometheus-host", "127.0.0.1",
                          "--prometheus-port", str(free_port()), "--worker-urls", *stub_urls,
                          python=(smg_python or sys.executable) if name == "smg" else sys.executable)
        elif name in ("aiohttp-min", "starlette-min"):
            proc = _start(name, cpus, "bench.proxy_variants", name.split("-")[0], "--port", str(port),
                          "--upstream", *stub_urls)
        else:
            raise SystemExit(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
        started.append(proc)
        variants.append(Variant(name, f"http://127.0.0.1:{port}", [proc]))
    for v in variants:
        for proc in v.procs:
            _wait_post(proc, v.url)
    return variants


_TICK = os.sysconf("SC_CLK_TCK")


def group_cpu_seconds(pgids: list[int]) -> float:
    """User+system CPU of every process in these process groups (each Proc leads its own):
    CPU per request is steadier than req/s on a machine shared with other work."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) in pgids:  # fields[0] is state: pgrp is the 5th field of stat overall
            total += int(fields[11]) + int(fields[12])
    return total / _TICK


def run_load(loadgen: str, cpu: str, url: str, req_body: str, connections: int, seconds: int,
             count_events: bool, threads: int = 1) -> dict[str, float]:
    if loadgen == "wrk":
        argv = ["wrk", f"-t{min(threads, connections)}", f"-c{connections}", f"-d{seconds}s", "--timeout", "10s", "-s", str(LUA), url + ROUTE]
        env = {**os.environ, "BODY": req_body, "COUNT_EVENTS": "1" if count_events else "0"}
    else:
        argv = [sys.executable, "-m", "bench.loadgen", "--url", url + ROUTE, "--body", req_body,
                "-c", str(connections), "-d", str(seconds)]
        env = child_env()
    out = subprocess.run(_pinned(cpu, argv), env=env, capture_output=True, text=True, timeout=seconds + 60)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"load generator failed ({out.returncode}): {out.stdout[-2000:]} {out.stderr[-2000:]}")
    r = json.loads(lines[-1])
    secs = r["duration_us"] / 1e6
    return {"rps": r["requests"] / secs, "eps": r["events"] / secs, "p50_ms": r["p50_us"] / 1e3,
            "p99_ms": r["p99_us"] / 1e3, "errors": r["errors"], "requests": r["requests"], "events": r["events"]}


def median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


# --- reporting --------------------------------------------------------------------------------

def table(results: dict[str, dict[str, list[dict[str, float]]]], tests: list[str]) -> list[list[str]]:
    """One row per variant, one column group per test that ran."""
    head = ["variant"]
    if "rps" in tests:
        head += ["req/s", "p50 ms", "p99 ms", "CPU µs/req"]
    if "lat" in tests:
        head += ["c=1 p50 µs", "c=1 p99 µs", "+p50 µs vs direct"]
    sse = [t for t in tests if t.startswith("sse") and not t.startswith("sselat")]
    for t in sse:
        head += [f"streams/s ({t[3:]})", f"chunks/s ({t[3:]})", f"CPU µs/stream ({t[3:]})"]
    sselat = [t for t in tests if t.startswith("sselat")]
    if sselat:
        head.append(f"c=1 stream p50 ms ({sselat[0][6:]})")
    rows = [head + ["errors"]]
    direct_lat = results.get("direct", {}).get("lat")
    for name, by_test in results.items():
        row = [name]
        if "rps" in tests:
            r = by_test["rps"]
            row += [f"{median(r, 'rps'):,.0f}", f"{median(r, 'p50_ms'):.2f}", f"{median(r, 'p99_ms'):.2f}",
                    f"{median(r, 'cpu_us'):.0f}"]
        if "lat" in tests:
            r = by_test["lat"]
            p50 = median(r, "p50_ms") * 1e3
            added = f"{p50 - median(direct_lat, 'p50_ms') * 1e3:+.0f}" if direct_lat and name != "direct" else "-"
            row += [f"{p50:.0f}", f"{median(r, 'p99_ms') * 1e3:.0f}", added]
        for t in sse:
            r = by_test[t]
            row += [f"{median(r, 'rps'):,.0f}", f"{median(r, 'eps'):,.0f}", f"{median(r, 'cpu_us'):.0f}"]
        if sselat:
            row.append(f"{median(by_test[sselat[0]], 'p50_ms'):.2f}")
        row.append(str(int(sum(r["errors"] for t in by_test.values() for r in t))))
        rows.append(row)
    return rows


def ratios(results, chunks: list[int]) -> list[str]:
    out = []

    def ratio(a: str, b: str, test: str, key: str, label: str) -> None:
        if a in results and b in results and test in results[a] and test in results[b]:
            out.append(f"{label}: {median(results[a][test], key) / median(results[b][test], key):.2f}x")

    for name in [n for n in results if n.startswith("kvgate-p")] + ["smg"]:
        ratio(name, "sglang-router", "rps", "rps", f"{name} / sglang-router, non-stream req/s")
    ratio("kvgate", "sglang-router", "rps", "rps", "kvgate / sglang-router, non-stream req/s")
    ratio("kvgate", "sglang-router", "rps", "cpu_us", "kvgate / sglang-router, non-stream CPU per request")
    ratio("kvgate", "smg", "rps", "rps", "kvgate / smg, non-stream req/s")
    ratio("kvgate", "smg", "rps", "cpu_us", "kvgate / smg, non-stream CPU per request")
    for n in chunks:
        ratio("kvgate", "smg", f"sse{n}", "rps", f"kvgate / smg, streams/s ({n} chunks)")
    for n in chunks:
        ratio("kvgate", "sglang-router", f"sse{n}", "rps", f"kvgate / sglang-router, streams/s ({n} chunks)")
    ratio("aiohttp-min", "starlette-min", "rps", "rps", "aiohttp-min / starlette-min, non-stream req/s")
    for n in chunks:
        ratio("aiohttp-min", "starlette-min", f"sse{n}", "rps", f"aiohttp-min / starlette-min, streams/s ({n} chunks)")
    ratio("kvgate", "aiohttp-min", "rps", "cpu_us", "kvgate / aiohttp-min, non-stream CPU per request")
    ratio("kvgate", "direct", "rps", "rps", "kvgate / direct, non-stream req/s")
    ratio("kvgate", "kvgate-ref", "rps", "rps", "kvgate / kvgate-ref, non-stream req/s")
    ratio("kvgate", "kvgate-ref", "rps", "cpu_us", "kvgate / kvgate-ref, non-stream CPU per request")
    for n in chunks:
        ratio("kvgate", "kvgate-ref", f"sse{n}", "rps", f"kvgate / kvgate-ref, streams/s ({n} chunks)")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", choices=VARIANTS,
                   default=[v for v in VARIANTS if v != "smg" or smg_python()])
    p.add_argument("--kvgate-ref", type=Path, metavar="DIR",
                   help="also run the kvgate found in DIR (e.g. `git archive main | tar -x -C DIR`) as 'kvgate-ref'")
    p.add_argument("--stubs", type=int, default=1, help="stub backend processes behind each router")
    p.add_argument("--kvgate-processes", type=int, nargs="+", default=[], metavar="N",
                   help="also run `kvgate serve --processes N` as 'kvgate-pN', for each N")
    p.add_argument("--smg-python", default=smg_python(),
                   help="the interpreter whose environment has the smg package, for the 'smg' variant "
                        "(default: $SMG_PYTHON, else .venv-smg)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--duration", type=int, default=3, help="seconds per throughput run")
    p.add_argument("--latency-duration", type=int, default=2, help="seconds per 1-connection latency run")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--chunks", type=int, nargs="+", default=[16, 64], help="SSE chunks per stream, one test each")
    p.add_argument("--tests", nargs="+", default=["rps", "lat", "sse", "sselat"],
                   choices=["rps", "lat", "sse", "sselat"], help="sselat: one stream at a time (first --chunks)")
    p.add_argument("--loadgen", choices=("wrk", "aiohttp"), default="wrk")
    p.add_argument("--load-cpu", default="0", help="taskset CPU list for the load generator ('' = no pinning)")
    p.add_argument("--server-cpus", default="1", help="taskset CPU list for stubs and routers ('' = no pinning)")
    p.add_argument("--stub-cpus", help="taskset CPU list for the stubs alone (default: --server-cpus)")
    p.add_argument("--load-threads", type=int, default=1, help="wrk threads (one per --load-cpu CPU)")
    p.add_argument("--quick", action="store_true", help="1 repetition of 2 s (1 s latency): a smoke run")
    p.add_argument("--note", default="", help="free text recorded with the results (e.g. 'machine busy')")
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--section", default="main",
                   help="which marked section of the results file this run replaces (e.g. 'before-after')")
    p.add_argument("--title", default="Router overhead", help="heading of the section")
    p.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    a = p.parse_args(argv)
    if a.quick:
        a.reps, a.duration, a.latency_duration = 1, 2, 1
    if a.loadgen == "wrk" and not shutil.which("wrk"):
        raise SystemExit("wrk not found (apt-get install wrk) or use --loadgen aiohttp")
    if (a.load_cpu or a.server_cpus) and not shutil.which("taskset"):
        raise SystemExit("taskset not found; pass --load-cpu '' --server-cpus '' to run unpinned")

    tests = [t for t in ("rps", "lat") if t in a.tests] + [f"sse{n}" for n in a.chunks if "sse" in a.tests]
    if "sselat" in a.tests:
        tests.append(f"sselat{a.chunks[0]}")
    began = time.monotonic()
    names = list(a.variants)
    if a.kvgate_ref:
        a.kvgate_ref = a.kvgate_ref.resolve()
        if not (a.kvgate_ref / "gateway" / "app.py").exists():
            raise SystemExit(f"{a.kvgate_ref} holds no gateway/app.py")
        names.insert(names.index("kvgate") + 1 if "kvgate" in names else len(names), "kvgate-ref")
    names += [f"kvgate-p{n}" for n in a.kvgate_processes]
    started: list[Proc] = []
    try:
        variants = start_variants(names, a.stubs, a.server_cpus, started, a.kvgate_ref, a.stub_cpus, a.smg_python)
        results: dict[str, dict[str, list[dict[str, float]]]] = {v.name: {t: [] for t in tests} for v in variants}
        for v in variants:  # warm-up: connection pools, lazy imports, JIT-free but cache-warm
            run_load(a.loadgen, a.load_cpu, v.url, body(None), a.concurrency, 1, False, a.load_threads)
            run_load(a.loadgen, a.load_cpu, v.url, body(a.chunks[0]), a.concurrency, 1, True, a.load_threads)
        for rep in range(a.reps):
            for test in tests:
                for v in variants:
                    cpu0 = v.cpu()
                    if test == "lat":
                        r = run_load(a.loadgen, a.load_cpu, v.url, body(None), 1, a.latency_duration, False, a.load_threads)
                    elif test == "rps":
                        r = run_load(a.loadgen, a.load_cpu, v.url, body(None), a.concurrency, a.duration, False, a.load_threads)
                    else:
                        n = int(test.removeprefix("sselat").removeprefix("sse"))
                        conns, secs = (1, a.latency_duration) if test.startswith("sselat") else (a.concurrency, a.duration)
                        r = run_load(a.loadgen, a.load_cpu, v.url, body(n), conns, secs, True, a.load_threads)
                        if r["events"] != r["requests"] * n:
                            r["errors"] += abs(r["events"] - r["requests"] * n) // max(n, 1) or 1
                    cpu = v.cpu() - cpu0
                    r["cpu_us"] = cpu / r["requests"] * 1e6 if r["requests"] else 0.0
                    results[v.name][test].append(r)
                    print(f"rep {rep + 1}/{a.reps} {test:6s} {v.name:14s} {r['rps']:9,.0f}/s"
                          + (f" {r['eps']:11,.0f} chunks/s" if test.startswith("sse") else "")
                          + f"  p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms  CPU {r['cpu_us']:.0f} µs/req"
                          + f"  err {r['errors']}",
                          file=sys.stderr, flush=True)
    finally:
        for proc in reversed(started):
            proc.stop()

    rows = table(results, tests)
    rat = ratios(results, a.chunks)
    print(plain(rows))
    print("\n".join(rat))
    command = "PYTHONPATH=$PWD /work/venv/bin/python -m bench.overhead " + " ".join(
        shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv))
    pin = (f"load generator on CPU {a.load_cpu} ({a.load_threads} wrk threads), routers on CPU {a.server_cpus},"
           f" stubs on CPU {a.server_cpus if a.stub_cpus is None else a.stub_cpus} (taskset)"
           if a.load_cpu or a.server_cpus else "unpinned")
    if "smg" in names and a.smg_python:
        smg = subprocess.run([a.smg_python, "-c", "from importlib import metadata; print(metadata.version('smg'))"],
                             capture_output=True, text=True).stdout.strip()
        where = Path(a.smg_python)
        pin += f"; smg {smg or '?'} from {where.relative_to(ROOT) if where.is_relative_to(ROOT) else where}"
    section = "\n".join([
        f"## {a.title} (`bench/overhead.py`)",
        "",
        f"- date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- command: `{command.strip()}`",
        f"- machine: {machine()}",
        f"- versions: {versions()}",
        f"- setup: {a.stubs} stub backend process(es) (`bench/stub_backend.py`), every router round robin;"
        f" {pin}; load generator `{a.loadgen}`, {a.concurrency} connections (latency columns: 1 connection);"
        f" {a.reps} x {a.duration:g} s per test ({a.latency_duration:g} s for latency), medians;"
        f" direct = the first stub; CPU µs/req = user+sys CPU of the router's own process(es) per request"
        f" (for direct: the stub's); wall time {time.monotonic() - began:.0f} s",
        *([f"- note: {a.note}"] if a.note else []),
        "",
        markdown(rows),
        "",
        *[f"- {r}" for r in rat],
    ])
    if not a.no_write:
        write_results(section, a.results, a.section)
        print(f"\nwritten to {a.results}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
