"""Routing quality: the same Mooncake trace slice through kvgate's policies, sglang-router and SMG.

Every run gets a fresh simulated cluster (no warm caches shared between runs), the same
request set and the same arrival schedule. Latencies are in SIMULATED seconds. Arrivals
are compressed ``--arrival-speedup`` times relative to simulated time so that the fleet
is loaded enough for routing to matter (the raw trace keeps 8 H100s ~15% busy); the
offered prefill load is printed as a fraction of the cluster's prefill capacity.

    PYTHONPATH=$PWD python -m bench.routing_quality            # default, ~15 min
    PYTHONPATH=$PWD python -m bench.routing_quality --quick    # a few minutes

Writes bench/out/quality/ (summary.json, runs.csv, per-run requests CSV, plots) and, unless
``--no-results``, the "Routing quality" section of bench/RESULTS.md plus its two PNGs
under bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import platform
import shlex
import sys
import time
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from gateway.nats_server import EmbeddedNats
from simulator.cluster import SimCluster
from simulator.cost_model import CostModel
from simulator.profiles import get_profile

from . import hit_loss
from .offered_load import offered_load
from .replay import ReplayResult, replay, summarize
from .services import Service, http_get, smg_python, start_router
from .trace import TraceRecord, bounded_oracle_hit_rate, conversation_keys, load_trace, oracle_hit_rate

ROOT = Path(__file__).resolve().parent.parent
TRACE_NAME = Path("shared") / "traces" / "mooncake_conversation_trace.jsonl"
# ../shared from the main checkout; ../../shared from a worktree under wt/
DEFAULT_TRACE = next((p / TRACE_NAME for p in (ROOT.parent, ROOT.parent.parent) if (p / TRACE_NAME).exists()),
                     ROOT.parent / TRACE_NAME)
KVGATE_POLICIES = ["round_robin", "power_of_two", "cache_aware", "kv_events", "cost"]
ROUTER_POLICIES = ["cache_aware", "round_robin"]
FULL_TRACE_ORACLE = 0.374  # bench.trace.oracle_hit_rate over all 12031 requests


@dataclass
class RunSpec:
    router: str  # kvgate | sglang-router | smg (bench.services.start_router)
    policy: str
    options: dict[str, str] = field(default_factory=dict)
    replicas: int = 1  # kvgate instances, the client round-robining requests across them (as a Service)
    shared: bool = False  # the replicas share routing state on a NATS bus (gateway.peers)

    @property
    def label(self) -> str:
        return self.base_label + (f" x{self.replicas} {'shared' if self.shared else 'alone'}"
                                  if self.replicas > 1 else "")

    @property
    def base_label(self) -> str:
        opts = ",".join(f"{k}={v}" if v else k for k, v in self.options.items())
        return f"{self.router}:{self.policy}" + (f"[{opts}]" if opts else "")


def parse_spec(router: str, text: str) -> RunSpec:
    """``cost``, ``cost[index=precise,temperature=0.01]`` or ``cost:index=precise``; an
    option without ``=`` is a switch (``cache_aware:disable_worker_overload_protection``)."""
    name, sep, rest = text.partition("[") if "[" in text else text.partition(":")
    opts = {k: v for k, _, v in (kv.partition("=") for kv in rest.rstrip("]").split(",") if kv)} if sep else {}
    return RunSpec(router, name, opts)


# ---- scraping -----------------------------------------------------------------------------------
def prom_values(text: str, names: set[str]) -> dict[tuple[str, tuple], float]:
    out: dict[tuple[str, tuple], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in names:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def worker_stats(url: str) -> dict:
    """Per-worker totals from SGLang's /metrics and the simulator's scheduler stats."""
    _, body = http_get(url + "/metrics")
    vals = prom_values(body.decode(), {"sglang:num_requests_total", "sglang:prompt_tokens_total",
                                       "sglang:cached_tokens_total", "sglang:generation_tokens_total"})
    flat = {name.split(":")[1].removesuffix("_total"): v for (name, _), v in vals.items()}
    _, info = http_get(url + "/server_info")
    sim = (msgspec.json.decode(info) if info else {}).get("simulator", {})
    return {"url": url, "requests": int(flat.get("num_requests", 0)), "prompt_tokens": int(flat.get("prompt_tokens", 0)),
            "cached_tokens": int(flat.get("cached_tokens", 0)), "generation_tokens": int(flat.get("generation_tokens", 0)),
            "busy_s": sim.get("busy_sim_s"), "lag_max_s": sim.get("lag_max_s"), "lag_sum_s": sim.get("lag_sum_s"),
            "forward_steps": sim.get("forward_steps")}


def kvgate_policy_stats(url: str) -> dict[str, float]:
    """The policy's own stats, plus the gateway's count and time of held requests."""
    _, body = http_get(url + "/metrics")
    held = {"kvgate_held_total", "kvgate_hold_seconds_sum"}
    vals = prom_values(body.decode(), {"kvgate_policy_stat"} | held)
    return {name if name in held else dict(labels)["stat"]: v for (name, labels), v in vals.items()}


def smg_stats(url: str) -> dict[str, float]:
    """SMG's own account of its decisions: cache-aware branches (tree_match, spill,
    expected_wait_fallback, ...), requests sent anyway while every worker was overloaded,
    and stall/overload transitions."""
    _, body = http_get(url + "/metrics")
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            if s.name == "smg_cache_aware_policy_branch_total":
                out[f"decisions_{s.labels['branch']}_total"] = s.value
            elif s.name in ("smg_worker_overload_fallback_total", "smg_worker_liveness_fallback_total",
                            "smg_worker_stall_transitions_total", "smg_worker_overload_shed_total"):
                key = s.name.removeprefix("smg_worker_").removesuffix("_total")
                out[f"decisions_{key}_total"] = out.get(f"decisions_{key}_total", 0.0) + s.value
    return out


# ---- one run --------------------------------------------------------------------------------------
def run_one(spec: RunSpec, records: list[TraceRecord], a: argparse.Namespace, out: Path, rep: int = 0) -> dict:
    """One fresh cluster and router over ``records``; its logs (gateway and engines) in
    ``out/logs/<label>/<rep + 1>``, one directory a run, as ``bench.hit_loss`` reads them."""
    label = spec.label.replace(":", "_").replace("[", "_").replace("]", "").replace(",", "_").replace(" ", "_")
    logs = out / "logs" / label / str(rep + 1)
    logs.mkdir(parents=True, exist_ok=True)
    # One log line per request on every engine: which worker served it and what it reused
    # (bench.hit_loss splits the lost hits into diverted and evicted from them).
    engine_args = ["--profile", a.profile, "--time-scale", str(a.time_scale), "--log-requests",
                   *(x for x in a.engine_arg if x != "--log-requests")]
    t0 = time.monotonic()
    with SimCluster(workers=a.workers, engine_args=engine_args, kv_events=True, log_dir=str(logs),
                    startup_timeout=90) as cluster, contextlib.ExitStack() as stack:
        routers: list[Service] = []
        extra: list[str] = []
        if spec.shared:
            extra = ["--state-url", stack.enter_context(EmbeddedNats()).url]
        for i in range(spec.replicas):
            routers.append(start_router(spec.router, cluster.urls, spec.policy, spec.options, logs / f"router{i}.log",
                                        extra=extra))
            stack.callback(routers[-1].stop)
        router = routers[0]
        try:
            def progress(done: int, total: int) -> None:
                if done % max(1, total // 10) == 0 or done == total:
                    print(f"\r  {spec.label}: {done}/{total}", end="", file=sys.stderr, flush=True)

            res: ReplayResult = asyncio.run(replay(
                records, [r.url for r in routers], api="generate", speedup=a.time_scale * a.arrival_speedup,
                concurrency=4096, time_scale=a.time_scale, timeout=a.request_timeout, on_progress=progress,
                session_keys=conversation_keys(records) if a.session_keys else None))
            print(file=sys.stderr)
            workers = [worker_stats(u) for u in cluster.urls]
            pstats = (kvgate_policy_stats(router.url) if spec.router == "kvgate"
                      else smg_stats(router.metrics_url) if spec.router == "smg" else {})
        finally:
            stack.close()
        dead = cluster.dead()
        engine_logs = cluster.log_paths
    return {"spec": spec, "result": res, "workers": workers, "policy_stats": pstats, "dead": dead,
            "run_wall_s": time.monotonic() - t0, "hit_loss": hit_loss.split(records, hit_loss.served(engine_logs))}


def analyse(run: dict, oracle: float, bounded: float, a: argparse.Namespace) -> dict:
    res: ReplayResult = run["result"]
    s = summarize(res.rows, res.wall_s, res.time_scale)
    ws = run["workers"]
    n = len(ws)
    reqs = [w["requests"] for w in ws]
    prompt = [w["prompt_tokens"] for w in ws]
    prefill = [w["prompt_tokens"] - w["cached_tokens"] for w in ws]

    def imbalance(xs: list[int]) -> float:
        mean = sum(xs) / len(xs) if xs else 0.0
        return max(xs) / mean if mean else 0.0

    ts = res.time_scale
    send_delay = sorted(max(0.0, r.sent_s - r.scheduled_s) for r in res.rows)
    lag_max = max((w["lag_max_s"] or 0.0) for w in ws) if ws else 0.0
    steps = sum(w["forward_steps"] or 0 for w in ws)
    lag_mean = sum(w["lag_sum_s"] or 0.0 for w in ws) / steps if steps else 0.0
    busy = sum(w["busy_s"] or 0.0 for w in ws)
    ttft_p50 = s["ttft_p50_s"] or 0.0
    delay_p99 = send_delay[int(0.99 * (len(send_delay) - 1))] * ts if send_delay else 0.0
    # A single late step (a GC pause, another process's burst) is noise next to TTFTs of
    # a second; a scheduler that is behind on average, or one stall as long as half a
    # median TTFT, or a client that could not send on time, changes what is measured.
    lagged = (lag_mean > max(a.lag_tolerance_s / 5, 0.01 * ttft_p50) or lag_max > max(a.lag_tolerance_s, 0.5 * ttft_p50)
              or delay_p99 > a.lag_tolerance_s)
    # TTFT minus what this request's own prefill costs on an idle GPU with the cache it got:
    # the time it spent queued behind others, which is what routing controls.
    cm = CostModel(get_profile(a.profile))
    waits = sorted(r.ttft_s * ts - cm.prefill_time(r.prompt_tokens - r.cached_tokens, r.cached_tokens)
                   for r in res.rows if r.ok and r.ttft_s is not None)
    # Time outside the engine (client e2e minus the engine's own e2e_latency): the gateway's
    # holds, decisions and proxying, and the loopback; what replicas or a starved CPU add.
    outside = sorted(max(0.0, r.e2e_s - r.engine_e2e_s) * ts for r in res.rows
                     if r.ok and r.e2e_s is not None and r.engine_e2e_s is not None)
    p = run["policy_stats"]
    out = {
        "label": run["spec"].label, "router": run["spec"].router, "policy": run["spec"].policy,
        "options": run["spec"].options, **s,
        "oracle_hit_rate": oracle, "bounded_oracle_hit_rate": bounded,
        "hit_vs_oracle": s["hit_rate"] / oracle if oracle else None,
        "hit_vs_bounded": s["hit_rate"] / bounded if bounded else None,
        "wait_mean_s": sum(waits) / len(waits) if waits else None,
        "wait_p50_s": waits[len(waits) // 2] if waits else None,
        "wait_p99_s": waits[int(0.99 * (len(waits) - 1))] if waits else None,
        "worker_requests": reqs, "worker_prompt_tokens": prompt, "worker_prefill_tokens": prefill,
        "req_imbalance": imbalance(reqs), "prompt_imbalance": imbalance(prompt), "prefill_imbalance": imbalance(prefill),
        "engine_hit_rate": sum(w["cached_tokens"] for w in ws) / sum(prompt) if sum(prompt) else 0.0,
        "gpu_utilization": busy / (n * s["duration_s"]) if n and s["duration_s"] else None,
        "sim_lag_max_s": lag_max, "sim_lag_mean_s": lag_mean,
        "send_delay_p99_s": delay_p99,
        "outside_engine_mean_s": sum(outside) / len(outside) if outside else None,
        "outside_engine_p99_s": outside[int(0.99 * (len(outside) - 1))] if outside else None,
        "send_delay_max_s": send_delay[-1] * ts if send_delay else 0.0,
        "lagged": bool(lagged), "dead_workers": run["dead"], "run_wall_s": run["run_wall_s"],
        "drift_window": p.get("hit_drift_ratio"), "drift_degradations": p.get("hit_degradations_total"),
        "predicted_cached_tokens": p.get("hit_predicted_tokens_total"),
        "verified_cached_tokens": p.get("hit_actual_tokens_total"),
        "held": p.get("kvgate_held_total"), "hold_s_total": p.get("kvgate_hold_seconds_sum"),
        "hold_decisions": p.get("holds"),  # decisions that answered Hold (a held request's re-decisions)
        "holds_expired": p.get("holds_expired"),  # commits still predicted to wait, held out of patience
        "diverted": p.get("diverted"), "diverted_tokens": p.get("diverted_tokens"),
        "prefill_tokens_per_s": p.get("prefill_tokens_per_s"), "prefill_samples": p.get("prefill_samples"),
        "lost_diverted": run["hit_loss"].get("diverted"), "lost_evicted": run["hit_loss"].get("evicted"),
        "requests_diverted": run["hit_loss"].get("requests_diverted"),
        "affinity_credited": p.get("affinity_credited_total"), "affinity_kept": p.get("affinity_kept_total"),
        "affinity_moved": p.get("affinity_moved_total"),
        "decisions": {k.removeprefix("decisions_").removesuffix("_total"): v for k, v in p.items()
                      if k.startswith("decisions_")},
    }
    first_errors = [r.error for r in res.rows if not r.ok][:3]
    if first_errors:
        out["first_errors"] = first_errors
    return out


# ---- CLI ------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.routing_quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--limit", type=int, default=None, help="first N requests of the trace (default 800, quick 200)")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--profile", default="llama3-8b-h100")
    p.add_argument("--time-scale", type=float, default=None, help="simulated s per wall s (default 1)")
    p.add_argument("--arrival-speedup", type=float, default=None,
                   help="trace-time compression relative to SIMULATED time (default 3)")
    p.add_argument("--kvgate", nargs="*", default=None, metavar="POLICY",
                   help=f"kvgate policies, optionally with options: cost[index=precise] (default {KVGATE_POLICIES})")
    p.add_argument("--sglang-router", nargs="*", default=None, metavar="POLICY",
                   help=f"sglang-router policies (default {ROUTER_POLICIES})")
    p.add_argument("--smg", nargs="*", default=None, metavar="POLICY",
                   help="SMG policies with its `smg launch` options: cache_aware:disable_worker_overload_protection,"
                        "selection_temperature=0.1 (default cache_aware when smg is installed, see bench/README.md)")
    p.add_argument("--replicas", type=int, nargs="+", default=[1],
                   help="kvgate replicas per run, the client round-robining across them (e.g. 1 2 4)")
    p.add_argument("--share", choices=["on", "off", "both"], default="on",
                   help="with several replicas: share routing state on a NATS bus, not, or a run each way")
    p.add_argument("--engine-arg", action="append", default=[], help="extra simulator argument (repeatable)")
    p.add_argument("--session-keys", action="store_true",
                   help="send each request's conversation key as X-Session-ID (bench.trace.conversation_keys)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--lag-tolerance-s", type=float, default=0.1, help="simulated seconds of lag that still count as sound")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every router N times, interleaved; targets are judged on the medians")
    p.add_argument("--quick", action="store_true", help="200 requests: a few minutes, for iteration")
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "quality"))
    p.add_argument("--notes", default=None,
                   help="markdown file appended inside the generated RESULTS.md section (default: none; the hand-written "
                        "reading sits after the section's end marker and survives a rewrite)")
    p.add_argument("--render", action="store_true",
                   help="run nothing: rewrite the RESULTS.md section from --out's summary.json")
    p.add_argument("--no-results", action="store_true", help="do not touch bench/RESULTS.md and bench/results/")
    return p


def main(argv: list[str] | None = None) -> int:
    from .quality_report import format_table, medians, targets, update_results, write_outputs

    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    if a.render:
        saved = json.loads((Path(a.out) / "summary.json").read_text())
        notes = Path(a.notes).read_text() if a.notes and Path(a.notes).exists() else ""
        for p in update_results(ROOT / "bench", saved["meta"], saved["runs"], Path(a.out), notes):
            print(f"updated {p.relative_to(ROOT)}")
        return 0
    a.limit = a.limit or (200 if a.quick else 800)
    a.time_scale = a.time_scale or 1.0
    a.arrival_speedup = a.arrival_speedup or 3.0
    trace = Path(a.trace)
    if not trace.exists():
        print(f"routing_quality: trace {trace} not found; skipping (pass --trace PATH)", file=sys.stderr)
        return 0
    specs = [parse_spec("kvgate", t) for t in (KVGATE_POLICIES if a.kvgate is None else a.kvgate)]
    shares = {"on": [True], "off": [False], "both": [True, False]}[a.share]
    specs = [dataclasses.replace(s, replicas=r, shared=r > 1 and shared) for s in specs for r in a.replicas
             for shared in (shares if r > 1 else [False])]
    specs += [parse_spec("sglang-router", t) for t in (ROUTER_POLICIES if a.sglang_router is None else a.sglang_router)]
    specs += [parse_spec("smg", t) for t in (a.smg if a.smg is not None else ["cache_aware"] if smg_python() else [])]
    host = machine()  # load average before this benchmark adds its own
    records = load_trace(trace, a.limit)
    prof = get_profile(a.profile)
    capacity = a.workers * prof.max_total_num_tokens
    for i, arg in enumerate(a.engine_arg):  # a --max-total-tokens override changes the capacity
        if arg.startswith("--max-total-tokens"):
            capacity = a.workers * int(arg.split("=", 1)[1] if "=" in arg else a.engine_arg[i + 1])
    oracle = oracle_hit_rate(records)
    bounded = bounded_oracle_hit_rate(records, capacity)
    load = offered_load(records, a.profile, a.workers, a.arrival_speedup, bounded)
    setup = {"trace": str(trace), "requests": len(records), "workers": a.workers, "profile": a.profile,
             "time_scale": a.time_scale, "arrival_speedup": a.arrival_speedup,
             "replay_speedup": a.time_scale * a.arrival_speedup, "capacity_tokens": capacity,
             "session_keys": a.session_keys,
             "oracle_hit_rate": oracle, "bounded_oracle_hit_rate": bounded,
             "full_trace_oracle_hit_rate": FULL_TRACE_ORACLE, **load}
    print(f"{len(records)} requests over {load['span_s']:.0f} simulated s ({load['req_per_s']:.1f} req/s), "
          f"{a.workers} x {a.profile}, time-scale {a.time_scale:g}, arrivals x{a.arrival_speedup:g}; "
          f"offered prefill load {load['prefill_load_no_cache']:.0%} of the fleet with no cache, "
          f"{load['prefill_load_at_bounded_oracle']:.0%} at the bounded-oracle hit rate; "
          f"oracle hit rate {oracle:.3f}, bounded ({capacity} tokens) {bounded:.3f}; TTFT floor (idle GPU, no cache) "
          f"mean {load['ttft_floor_mean_s']:.3f}s p99 {load['ttft_floor_p99_s']:.3f}s", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, runs = [], []
    for rep, spec in ((rep, spec) for rep in range(a.repeat) for spec in specs):
        run = run_one(spec, records, a, out, rep)
        row = analyse(run, oracle, bounded, a)
        row["base_label"] = row["label"]
        if a.repeat > 1:  # interleaved: a slow drift in machine load hits every router alike
            row["label"] += f" #{rep + 1}"
        rows.append(row)
        runs.append(run)
        print(f"  {row['label']}: hit {row['hit_rate']:.3f}, TTFT mean {row['ttft_mean_s'] or 0:.3f}s "
              f"p99 {row['ttft_p99_s'] or 0:.3f}s, outside the engine mean {row['outside_engine_mean_s'] or 0:.3f}s "
              f"p99 {row['outside_engine_p99_s'] or 0:.3f}s, lag max {row['sim_lag_max_s']:.3f}s, "
              f"{row['errors']} errors, {row['run_wall_s']:.0f}s wall", flush=True)
    command = "PYTHONPATH=$PWD python -m bench.routing_quality" + (" " + shlex.join(argv) if argv else "")
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": host, "command": command, "setup": setup}
    table = format_table(rows)
    print(table)
    summary = medians(rows)
    if summary is not rows:
        print("\nmedians:\n" + format_table(summary))
    print("\n".join(targets(summary)))
    paths = write_outputs(out, meta, rows, runs)
    print("wrote " + ", ".join(str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p) for p in paths))
    if not a.no_results:
        notes = Path(a.notes).read_text() if a.notes and Path(a.notes).exists() else ""
        for p in update_results(ROOT / "bench", meta, rows, out, notes):
            print(f"updated {p.relative_to(ROOT)}")
    return 0 if all(r["ok"] for r in rows) else 1


def machine() -> str:
    import os

    from .host import cpu_name

    cpu = cpu_name()
    load = os.getloadavg()
    return (f"{platform.node() or 'host'}: {os.cpu_count()} CPU ({cpu}), Python {platform.python_version()}, "
            f"load average at start {load[0]:.1f}")


if __name__ == "__main__":
    sys.exit(main())
