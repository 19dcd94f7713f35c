"""Noisy neighbour: does one tenant's burst queue everybody? kvgate with and without QoS.

Tenant B sends steadily at half the fleet's capacity (Poisson arrivals); tenant A bursts
to three times the rest (1.5x capacity), so the fleet is offered twice what it can do.
Runs on a fresh simulated fleet each (no cache shared between runs), the same
arrival schedules in each:

- capacity: a closed loop that keeps the fleet saturated measures the prefills it starts
  per second (the rates below are fractions of this);
- ``B alone``: the gateway without a tenants file, tenant B only (the baseline B's TTFT is held to);
- ``FIFO``: the gateway without a tenants file, A and B together;
- ``QoS, equal weights``: a tenants file naming A and B, one class, weight 1 each (B asks
  for exactly its share);
- ``QoS, B weight 3``: the same with B's weight 3 (a share of 3/4, above what it asks);
- ``QoS, B interactive``: B in a more urgent class than A, passed on to engines that
  schedule by priority, and not held at the gateway (``hold: false``): sent at once, it
  waits in the engine only for the step that is running.

Targets: B's p99 TTFT with QoS at most 1.2x its p99 alone, and the fleet as busy as with
FIFO (A absorbs the slack). Prompts are random (no prefix hits), so a request's cost is its
shape. TTFTs are wall seconds: the simulated fleet runs ``--time-scale`` simulated seconds
per wall second. The cost policy keeps held requests at the gateway for as long as the
fleet is full (``hold_patience``, ``--max-hold-secs``): the gateway's queue is the one QoS
orders; see docs/qos.md.

    PYTHONPATH=$PWD python -m bench.noisy_neighbour           # ~4-5 min on 2 cores; writes
                                                              # its section of bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import datetime
import json
import random
import shlex
import string
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from bench.services import Service, http_get, start_kvgate
from bench.tables import machine, markdown, plain, write_results
from simulator.cluster import SimCluster
from simulator.cost_model import CostModel
from simulator.profiles import get_profile

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
PROFILE = "llama3-8b-h100"
KEYS = {"A": "sk-tenant-a", "B": "sk-tenant-b"}
TENANTS = """
tenants:
  A: {keys: [sk-tenant-a], weight: 1}
  B: {keys: [sk-tenant-b], weight: %s}
"""
CLASSES = """
classes: {interactive: {priority: 10, hold: false}, standard: {priority: 0}}
default_class: standard
engine_priority: true
tenants:
  A: {keys: [sk-tenant-a]}
  B: {keys: [sk-tenant-b], class: interactive}
"""
# run name -> (tenants file or None for no tenants file, the keys as plain API keys, engine flags)
VARIANTS = {
    "FIFO": (None, []),
    "QoS, equal weights": (TENANTS % 1, []),
    "QoS, B weight 3": (TENANTS % 3, []),
    "QoS, B interactive": (CLASSES, ["--enable-priority-scheduling"]),
}


@dataclass
class Row:
    tenant: str
    sent: float
    ttft: float | None = None
    done: float | None = None
    status: int = 0


def pct(xs: list[float | None], p: float) -> float:
    """A percentile; None (no first token before the run ended) counts as infinite."""
    ys = sorted(float("inf") if x is None else x for x in xs)
    return ys[min(len(ys) - 1, int(p / 100 * len(ys)))] if ys else float("nan")


def prompt(rng: random.Random, tokens: int) -> str:
    """Random letters: no prefix shared with any other request (the simulator's tokens are bytes)."""
    return "".join(rng.choices(string.ascii_lowercase + " ", k=tokens))


async def one(session: aiohttp.ClientSession, url: str, row: Row, text: str, max_tokens: int, t0: float) -> None:
    body = {"model": "sim-llama-8b", "prompt": text, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {KEYS[row.tenant]}"}
    try:
        async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
            row.status = resp.status
            async for chunk in resp.content.iter_any():
                if row.ttft is None and chunk.strip():
                    row.ttft = time.perf_counter() - t0 - row.sent
            row.done = time.perf_counter() - t0
    except (aiohttp.ClientError, asyncio.TimeoutError):
        row.status = -1


def schedule(rate: float, duration: float, rng: random.Random) -> list[float]:
    """Poisson arrival times in [0, duration)."""
    out, at = [], 0.0
    while rate > 0 and len(out) < 100_000:
        at += rng.expovariate(rate)
        if at >= duration:
            break
        out.append(at)
    return out


def busy_s(urls: list[str]) -> float:
    total = 0.0
    for url in urls:
        _, info = http_get(url + "/server_info")
        total += json.loads(info or b"{}").get("simulator", {}).get("busy_sim_s", 0.0)
    return total


async def offered(url: str, workers: list[str], arrivals: dict[str, list[float]], args: argparse.Namespace,
                  seed: int) -> tuple[list[Row], float]:
    """Send every tenant's arrivals; answer the rows and the fleet's busy share while they arrived.
    B's requests are waited for (bounded); whatever A still has open then is cancelled."""
    rng = random.Random(seed)
    texts = {t: [prompt(rng, args.prompt_tokens) for _ in times] for t, times in arrivals.items()}
    plan = sorted((at, t, i) for t, times in arrivals.items() for i, at in enumerate(times))
    rows: list[Row] = []
    tasks: dict[str, list[asyncio.Task]] = {t: [] for t in arrivals}
    timeout = aiohttp.ClientTimeout(total=args.duration + 120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        busy0 = busy_s(workers)
        for at, tenant, i in plan:
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            row = Row(tenant, at)
            rows.append(row)
            tasks[tenant].append(asyncio.ensure_future(one(session, url, row, texts[tenant][i], args.max_tokens, t0)))
        await asyncio.sleep(max(0.0, args.duration - (time.perf_counter() - t0)))
        busy = (busy_s(workers) - busy0) / (args.time_scale * len(workers) * (time.perf_counter() - t0))
        if tasks.get("B"):
            await asyncio.wait(tasks["B"], timeout=60)
        for task in (t for ts in tasks.values() for t in ts):
            task.cancel()
        await asyncio.gather(*(t for ts in tasks.values() for t in ts), return_exceptions=True)
    return rows, busy


def gateway(urls: list[str], args: argparse.Namespace, log: Path, tenants: Path | None) -> Service:
    extra = ["--max-hold-secs", str(args.duration + 60)]
    if tenants is not None:
        extra += ["--tenants-file", str(tenants)]
    else:
        extra += ["--api-key", KEYS["A"], "--api-key", KEYS["B"]]
    # the fleet's prefill speed in wall seconds (the simulated one, slowed by the time scale):
    # the policy starts from it rather than learning it under load
    model = CostModel(get_profile(PROFILE))
    tps = args.prompt_tokens / model.prefill_time(args.prompt_tokens) * args.time_scale
    options = {"hold_patience": "1000000", "hold_wait_s": str(args.hold_wait_s), "prefill_tokens_per_s": f"{tps:.0f}"}
    return start_kvgate(urls, "cost", options, log, extra=extra)


def fleet(args: argparse.Namespace, logs: Path, extra: list[str] | None = None) -> SimCluster:
    logs.mkdir(parents=True, exist_ok=True)
    engine = ["--profile", PROFILE, "--time-scale", str(args.time_scale), "--stream-interval", "4",
              *args.engine_arg, *(extra or [])]
    return SimCluster(workers=args.workers, engine_args=engine, kv_events=False, log_dir=str(logs)).start()


def run(name: str, arrivals: dict[str, list[float]], args: argparse.Namespace, out: Path, tenants: Path | None,
        seed: int, engine: list[str] | None = None) -> tuple[list[Row], float]:
    cluster = fleet(args, out / name, engine)
    try:
        gw = gateway(cluster.urls, args, out / f"{name}-gateway.log", tenants)
        try:
            return asyncio.run(offered(gw.url, cluster.urls, arrivals, args, seed))
        finally:
            gw.stop()
    finally:
        cluster.stop()


async def saturate(url: str, args: argparse.Namespace, seconds: float) -> float:
    """Prefills per second (first tokens) of a closed loop far past the fleet's capacity, over
    its second half. Not completions: an engine runs prefills before decodes, so under load
    streams end in bursts whenever prefill work pauses."""
    rng = random.Random(7)
    firsts: list[float] = []
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def loop() -> None:
            while time.perf_counter() - t0 < seconds:
                row = Row("B", time.perf_counter() - t0)
                task = asyncio.ensure_future(one(session, url, row, prompt(rng, args.prompt_tokens), 1, t0))
                await asyncio.wait_for(asyncio.shield(task), seconds + 60)
                if row.ttft is not None:
                    firsts.append(row.sent + row.ttft)

        await asyncio.gather(*(loop() for _ in range(args.saturate_clients)))
    late = [f for f in firsts if seconds / 2 <= f < seconds]
    return len(late) / (seconds / 2)


def capacity(args: argparse.Namespace, out: Path) -> float:
    cluster = fleet(args, out / "cap")
    try:
        gw = gateway(cluster.urls, args, out / "cap-gateway.log", None)
        try:
            return asyncio.run(saturate(gw.url, args, args.saturate_secs))
        finally:
            gw.stop()
    finally:
        cluster.stop()


def summary(name: str, rows: list[Row], busy: float, duration: float, cap: float, alone_p99: float | None
            ) -> list[str]:
    b = [r.ttft if r.status == 200 else None for r in rows if r.tenant == "B"]
    started = [r for r in rows if r.ttft is not None and r.sent + r.ttft <= duration]
    a_started = sum(r.tenant == "A" for r in started)
    p99 = pct(b, 99)
    ratio = f"{p99 / alone_p99:.2f}x" if alone_p99 else "1.00x"
    return [name, f"{sum(t is not None for t in b)}/{len(b)}", f"{pct(b, 50):.3f}", f"{pct(b, 90):.3f}",
            f"{p99:.3f}", ratio, f"{a_started / duration:.2f}", f"{len(started) / duration / cap:.0%}", f"{busy:.0%}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--time-scale", type=float, default=0.25, help="simulated seconds per wall second")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--duration", type=float, default=30.0, help="wall seconds of arrivals per run")
    p.add_argument("--hold-wait-s", type=float, default=0.03, help="the cost policy's hold_wait_s")
    p.add_argument("--saturate-secs", type=float, default=10.0)
    p.add_argument("--saturate-clients", type=int, default=48)
    p.add_argument("--capacity", type=float, help="requests/s the fleet completes (skip measuring it)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="bench/out/noisy_neighbour")
    p.add_argument("--engine-arg", action="append", default=[], help="extra simulator flag for every run")
    p.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    p.add_argument("--only", nargs="+", metavar="RUN", help="only these runs besides B alone (fifo, "
                   "qos-equal-weights, qos-b-weight-3, qos-b-interactive)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    cap = args.capacity or capacity(args, out)
    rng = random.Random(args.seed)
    b_times = schedule(0.5 * cap, args.duration, rng)
    a_times = schedule(1.5 * cap, args.duration, rng)
    results = {"B alone": run("alone", {"B": b_times}, args, out, None, args.seed)}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (text, engine) in VARIANTS.items():
            slug = name.lower().replace(",", "").replace(" ", "-")
            if args.only and slug not in args.only:
                continue
            tenants = None
            if text is not None:
                tenants = Path(tmp) / f"{slug}.yaml"
                tenants.write_text(text)
            results[name] = run(slug, {"B": b_times, "A": a_times}, args, out, tenants, args.seed, engine)
    alone_p99 = pct([r.ttft if r.status == 200 else None for r in results["B alone"][0]], 99)
    header = ["run", "B ok/sent", "B p50 s", "B p90 s", "B p99 s", "B p99 / alone", "A prefills/s",
              "prefills / capacity", "engines busy"]
    rows = [header] + [summary(name, rows, busy, args.duration, cap, alone_p99 if name != "B alone" else None)
                       for name, (rows, busy) in results.items()]
    command = (f"PYTHONPATH=$PWD python -m bench.noisy_neighbour "
               f"{shlex.join(argv if argv is not None else sys.argv[1:])}").rstrip()
    facts = [f"{started:%Y-%m-%d %H:%M} UTC; {machine()}", f"`{command}`",
             f"{args.workers} simulated {PROFILE} workers at time scale {args.time_scale:g}; capacity "
             f"{cap:.2f} prefills/s ({args.prompt_tokens}-token prompts, {args.max_tokens} output tokens); B offers "
             f"{len(b_times) / args.duration:.2f} req/s, A {len(a_times) / args.duration:.2f} req/s for "
             f"{args.duration:g} s; TTFT in wall seconds, from the client"]
    print("\n".join(["# noisy neighbour", *facts, plain(rows)]))
    (out / "summary.json").write_text(json.dumps({"capacity": cap, "rows": rows, "args": vars(args)}, indent=1))
    with (out / "requests.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["run", "tenant", "sent", "ttft", "done", "status"])
        writer.writerows([name, r.tenant, f"{r.sent:.4f}", r.ttft, r.done, r.status]
                         for name, (reqs, _) in results.items() for r in reqs)
    if not args.no_write:
        section = "\n\n".join(["## Noisy neighbour (`bench/noisy_neighbour.py`)", "\n".join(f"- {f}" for f in facts),
                                markdown(rows)])
        write_results(section, RESULTS, "main", script="bench/noisy_neighbour.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
