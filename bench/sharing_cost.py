"""What sharing routing state costs: one gateway alone, and the same gateway publishing its
records to a peer replica over NATS (``gateway.peers``), in front of the same stub backend,
interleaved in every repetition.

- ``alone``   ``kvgate serve --policy P`` (no ``--state-url``)
- ``shared``  the same with ``--state-url`` of an embedded nats-server, and a second
              replica on the same bus that receives no requests and applies every record;
              defaults: workers claimed on JetStream (``gateway.claims``) up to 100 req/s
- ``claims always`` the same, every decision claimed (``--state-claims-max-rps 0``)
- ``no claims`` the same, ``--no-state-claims``

For each: req/s and CPU µs per request of the loaded gateway and of the nats-server (closed
loop, ``wrk``); for the shared ones also the records it published per second, the peer's CPU µs per record applied,
and the publish-to-apply lag (p50/p99 from the peer's ``kvgate_state_lag_seconds``).
Prompts are padded to ``--prompt-tokens`` (the byte tokenizer: a token per byte), as the
routed record carries the prompt's ids.

    PYTHONPATH=$PWD python -m bench.sharing_cost --reps 3 --duration 5
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import statistics
import sys
import time

from bench.overhead import _start, _wait_post, group_cpu_seconds, machine, run_load
from gateway.nats_server import EmbeddedNats
from tests.support import Proc, free_port, get_text, metric_value

MODEL = "stub-model"


def body(prompt_tokens: int) -> str:
    text = ("Say hi in one word. " * (prompt_tokens // 20 + 1))[:prompt_tokens]
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}]}, separators=(",", ":"))


def gateway(name: str, cpus: str, stub: str, policy: str, extra: list[str]) -> tuple[Proc, str]:
    port = free_port()
    proc = _start(name, cpus, "gateway", "serve", "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                  "--tokenizer", "byte", "--log-level", "warning", "--worker-urls", *stub.split(","), *extra)
    return proc, f"http://127.0.0.1:{port}"


def lag_quantile(text: str, q: float) -> float:
    """A quantile of ``kvgate_state_lag_seconds`` from its buckets (the bucket's upper bound)."""
    buckets = []
    for line in text.splitlines():
        if line.startswith("kvgate_state_lag_seconds_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    total = buckets[-1][1] if buckets else 0.0
    for le, count in buckets:
        if total and count >= q * total:
            return le
    return float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="cost")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--duration", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--workers", type=int, default=4, help="stub workers (claims are per worker)")
    p.add_argument("--load-cpu", default="0")
    p.add_argument("--server-cpus", default="1")
    a = p.parse_args(argv)
    began = time.monotonic()
    req = body(a.prompt_tokens)
    started: list[Proc] = []
    variants = {"alone": [], "shared": ["--state-claims"], "claims always": ["--state-claims-max-rps", "0"],
                "no claims": ["--no-state-claims"]}
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    try:
        with EmbeddedNats() as nats:
            stub_urls = []
            for i in range(a.workers):
                stub_port = free_port()
                stub = _start(f"stub{i}", a.server_cpus, "bench.stub_backend", "--port", str(stub_port),
                              "--chunks", "16")
                started.append(stub)
                stub_urls.append(f"http://127.0.0.1:{stub_port}")
                _wait_post(stub, stub_urls[-1])
            stub_url = ",".join(stub_urls)
            gateways = {}
            for name, extra in variants.items():
                bus = ["--state-url", nats.url] if extra else []
                gateways[name] = gateway(name.replace(" ", "-"), a.server_cpus, stub_url, a.policy, bus + extra)
            peer, peer_url = gateway("peer", a.server_cpus, stub_url, a.policy, ["--state-url", nats.url])
            started += [proc for proc, _ in gateways.values()] + [peer]
            for proc, url in (*gateways.values(), (peer, peer_url)):
                _wait_post(proc, url)
            for _, url in gateways.values():  # warm-up
                run_load("wrk", a.load_cpu, url, req, a.concurrency, 1, False)
            for rep in range(a.reps):
                for name, (proc, url) in gateways.items():
                    pids = [proc.popen.pid, peer.popen.pid, nats.proc.pid]
                    cpu0, peer0, bus0 = (group_cpu_seconds([pid]) for pid in pids)
                    before = get_text(url + "/metrics"), get_text(peer_url + "/metrics")
                    r = run_load("wrk", a.load_cpu, url, req, a.concurrency, a.duration, False)
                    n = max(r["requests"], 1)
                    r["cpu_us"] = (group_cpu_seconds([proc.popen.pid]) - cpu0) / n * 1e6
                    r["bus_us"] = (group_cpu_seconds([nats.proc.pid]) - bus0) / n * 1e6
                    if variants[name]:
                        time.sleep(0.5)  # the last records reach the peer
                        after = get_text(url + "/metrics"), get_text(peer_url + "/metrics")
                        pub = (metric_value(after[0], "kvgate_state_records_total", outcome="published")
                               - metric_value(before[0], "kvgate_state_records_total", outcome="published"))
                        applied = (metric_value(after[1], "kvgate_state_records_total", outcome="applied")
                                   - metric_value(before[1], "kvgate_state_records_total", outcome="applied"))
                        r["records_s"] = pub / a.duration
                        r["applied"] = applied
                        r["peer_us"] = (group_cpu_seconds([peer.popen.pid]) - peer0) / max(applied, 1) * 1e6
                        r["lag_p50_ms"] = lag_quantile(after[1], 0.5) * 1e3
                        r["lag_p99_ms"] = lag_quantile(after[1], 0.99) * 1e3
                    rows[name].append(r)
                    print(f"rep {rep + 1} {name:13s} {r['rps']:8,.0f} req/s  CPU {r['cpu_us']:.0f} µs/req"
                          f" (bus {r['bus_us']:.0f})" + (f"  {r['records_s']:,.0f} records/s, peer {r['peer_us']:.1f} "
                                                         "µs/record" if variants[name] else ""),
                          file=sys.stderr, flush=True)
    finally:
        for proc in reversed(started):
            proc.stop()

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[name])

    command = "PYTHONPATH=$PWD python -m bench.sharing_cost " + shlex.join(sys.argv[1:] if argv is None else argv)
    print(f"## Cost of sharing routing state (`bench/sharing_cost.py`)\n\n"
          f"- date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC}\n- command: `{command.strip()}`\n"
          f"- machine: {machine()}\n- setup: policy {a.policy}, {a.prompt_tokens}-token prompts, {a.concurrency} "
          f"connections (wrk on CPU {a.load_cpu}), gateways, peer, {a.workers} stubs on CPU {a.server_cpus}; {a.reps} x "
          f"{a.duration} s, medians; wall {time.monotonic() - began:.0f} s\n")
    print("| gateway | req/s | CPU µs/req | nats-server CPU µs/req | records/s published | peer CPU µs/record "
          "| lag p50 / p99 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, extra in variants.items():
        shared = (f"{med(name, 'records_s'):,.0f} | {med(name, 'peer_us'):.1f} | {med(name, 'lag_p50_ms'):.1f} / "
                  f"{med(name, 'lag_p99_ms'):.1f} ms" if extra else "- | - | -")
        print(f"| {name} | {med(name, 'rps'):,.0f} | {med(name, 'cpu_us'):.0f} | {med(name, 'bus_us'):.0f} | {shared} |")
    for name in list(variants)[1:]:
        print(f"\n{name} / alone: req/s {med(name, 'rps') / med('alone', 'rps'):.2f}x, CPU per request "
              f"{med(name, 'cpu_us') / med('alone', 'cpu_us'):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
