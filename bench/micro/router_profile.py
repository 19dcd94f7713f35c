"""Where a router's CPU per request goes: kvgate and SMG under the same closed-loop load.

Each router of ``--routers`` runs alone in front of one stub (``bench/overhead.py``'s set-up:
wrk on ``--load-cpu``, router and stub on ``--server-cpus``), round robin, non-stream chat
completions at ``--concurrency`` connections. While wrk runs, ``perf record`` samples the
router's process and its samples are split by where they land:

- ``kernel``       system calls and the TCP stack (both routers make the same four socket
                   exchanges per request: read the client's, write upstream, read upstream's,
                   write the client's)
- ``interpreter``  CPython's own code (bytecode evaluation, object allocation, GC)
- ``extensions``   compiled extension modules (uvloop, aiohttp's C parser, msgspec, multidict, yarl)
- ``libc``/``alloc`` the C library and the allocator
- ``binary``       SMG: its own Rust code (hyper, tokio, routing, middleware), by crate below

For kvgate ``py-spy`` samples the same window by Python function as well, split into
``aiohttp server``, ``aiohttp client``, ``gateway`` (kvgate's own code), ``asyncio`` and the
rest; each share times the router's CPU per request gives microseconds per request.

    PYTHONPATH=$PWD python -m bench.micro.router_profile            # ~1 min; needs perf and py-spy
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.overhead import body, run_load, start_variants
from bench.services import smg_python
from tests.support import Proc

# py-spy names a frame "function (path/relative/to/sys.path.py:line)"
PY_BUCKETS = (("aiohttp server", ("(aiohttp/web", "(aiohttp/http_writer", "(aiohttp/base_protocol", "(aiohttp/_http_parser")),
              ("aiohttp client", ("(aiohttp/client", "(aiohttp/connector", "(aiohttp/streams", "(aiohttp/http_parser",
                                  "(aiohttp/payload")),
              ("gateway", ("(gateway/", "(policies/", "(index/", "(wire/")),
              ("asyncio", ("(asyncio/", "uvloop")),
              ("metrics", ("(prometheus_client",)))


def perf_split(pid: int, seconds: float, out: Path) -> collections.Counter:
    """Shares of ``pid``'s on-CPU samples by where they land (see the module docstring)."""
    data = out / f"perf-{pid}.data"
    subprocess.run(["perf", "record", "-q", "-F", "999", "-p", str(pid), "-o", str(data), "--", "sleep", str(seconds)],
                   check=True, capture_output=True)
    rep = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--sort", "dso,sym", "--stdio",
                          "--percent-limit", "0"], capture_output=True, text=True, check=True).stdout
    split: collections.Counter = collections.Counter()
    for line in rep.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[([.kH])\]\s+(.*)", line)
        if not m:
            continue
        pct, dso, where, sym = float(m[1]), m[2], m[3], m[4]
        if where == "k" or dso.startswith("[kernel"):
            split["kernel"] += pct
        elif "python3" in dso or dso.startswith("libpython"):
            split["interpreter"] += pct
        elif dso.startswith("libc") or dso.startswith("ld-linux"):
            split["libc"] += pct
        elif "jemalloc" in sym or "malloc" in dso:
            split["alloc"] += pct
        elif dso.startswith("smg_rs"):
            crate = re.search(r"(?:_R\w*?\d+)?(tokio|hyper|reqwest|h2|axum|tower|smg|serde_json|openai_protocol|"
                              r"tracing|prometheus|metrics|jemalloc|bytes|http)", sym)
            split[f"binary: {crate[1] if crate else 'other'}"] += pct
        else:
            split["extensions"] += pct
    return split


def pyspy_split(pid: int, seconds: float, out: Path) -> collections.Counter:
    """Shares of ``pid``'s Python samples by the innermost frame's bucket (PY_BUCKETS)."""
    raw = out / f"pyspy-{pid}.txt"
    subprocess.run(["py-spy", "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "200", "--format", "raw",
                    "-o", str(raw), "--nonblocking"], check=True, capture_output=True)
    split: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        bucket = "other"
        for frame in reversed(frames):  # innermost frame first
            name = next((b for b, keys in PY_BUCKETS if any(k in frame for k in keys)), None)
            if name:
                bucket = name
                break
        split[bucket] += int(count)
    total = sum(split.values()) or 1
    return collections.Counter({k: 100.0 * v / total for k, v in split.items()})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--routers", nargs="+", default=["kvgate", "smg"], choices=["kvgate", "smg", "sglang-router"])
    p.add_argument("--seconds", type=float, default=8.0, help="profiled load per router")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--load-cpu", default="0")
    p.add_argument("--server-cpus", default="1")
    a = p.parse_args(argv)
    for tool in ("perf", "wrk") + (("py-spy",) if "kvgate" in a.routers else ()):
        if not shutil.which(tool) and not Path(sys.executable).with_name(tool).exists():
            raise SystemExit(f"{tool} not found")
    out = Path(tempfile.mkdtemp(prefix="router-profile-"))
    for name in a.routers:
        started: list[Proc] = []
        try:
            (v,) = [x for x in start_variants([name], 1, a.server_cpus, started, smg_python=smg_python())
                    if x.name == name]
            run_load("wrk", a.load_cpu, v.url, body(None), a.concurrency, 2, False)  # warm-up
            pid = v.procs[0].popen.pid
            cpu0 = v.cpu()
            load = subprocess.Popen(["taskset", "-c", a.load_cpu, "wrk", "-t1", f"-c{a.concurrency}",
                                     f"-d{a.seconds * 1.5 + 3:.0f}s", "-s", str(Path(__file__).parents[1] / "wrk_post.lua"),
                                     v.url + "/v1/chat/completions"], env={"BODY": body(None), "COUNT_EVENTS": "0",
                                                                           "PATH": "/usr/bin:/bin"},
                                    stdout=subprocess.PIPE, text=True)
            time.sleep(1)
            split = perf_split(pid, a.seconds, out)
            py = pyspy_split(pid, a.seconds / 2, out) if name == "kvgate" else None
            stdout, _ = load.communicate(timeout=60)
            cpu = v.cpu() - cpu0
            reqs = next((int(x) for x in re.findall(r'"requests":\s*(\d+)', stdout)), 0)
        finally:
            for proc in reversed(started):
                proc.stop()
        us = cpu / reqs * 1e6 if reqs else 0.0
        print(f"\n{name}: {reqs} requests, {us:.0f} us CPU per request (router process, whole run)")
        for k, pct in split.most_common():
            if pct >= 0.5:
                print(f"  perf  {k:24s} {pct:5.1f}%  ~{us * pct / 100:5.0f} us/req")
        for k, pct in (py or {}).items():
            print(f"  py-spy {k:23s} {pct:5.1f}% of Python samples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
