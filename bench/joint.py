"""The joint test: PD disaggregation x KV-cache offload x router, as one matrix.

Every cell runs the same workload (same requests, same arrival schedule) on the same
number of simulated GPUs; what changes is

* topology: N unified workers, or P prefill + D decode (KV moved over Mooncake, charged
  as the model's KV over ``--transfer-bandwidth-gbps``);
* KV placement: GPU only; + HiCache host tier (``--enable-hierarchical-cache``); + a shared
  Mooncake Store pool as L3 (a real ``mooncake_master``, ``SimCluster(pool=True)``);
* router: kvgate ``cost`` (``pd_cost`` in PD), sglang-router ``cache_aware`` or SMG ``cache_aware``.

Latencies are simulated seconds. Goodput: requests that finished with TTFT <= ``--slo-ttft``
per simulated second of the arrival schedule. Hit rates are the prefill-side (or unified)
workers' prompt tokens served from each tier. KV bytes are the model's (llama3-8b: 128 KiB
per token), not the scaled-down bytes really moved here.

    PYTHONPATH=$PWD python -m bench.joint --quick     # < 5 min on 2 vCPU
    PYTHONPATH=$PWD python -m bench.joint             # the full matrix, ~30 min
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from simulator.cluster import SimCluster
from simulator.profiles import get_profile

from .joint_fleet import (ExternalFleet, Topology, external_fleet, http_post, since, ttft_sums,
                          worker_totals)
from .joint_workloads import WORKLOADS
from .replay import replay, summarize
from .services import Service, smg_python, start_kvgate, start_service, start_sglang_router, start_smg
from .trace import DEFAULT_TRACE, TraceRecord

ROOT = Path(__file__).resolve().parent.parent
PLACEMENTS = ("gpu", "host", "pool")
ROUTERS = ("kvgate", "sglang-router", "smg")


@dataclass(frozen=True)
class Cell:
    workload: str
    topology: Topology
    placement: str
    router: str

    @property
    def label(self) -> str:
        return f"{self.workload}/{self.topology.name}/{self.placement}/{self.router}"


@dataclass
class CellResult:
    cell: Cell
    runs: list[dict] = field(default_factory=list)  # one summary per repetition
    ttft: list[float] = field(default_factory=list)  # first run's per-request values, simulated s
    tpot: list[float] = field(default_factory=list)
    error: str = ""

    def median(self, key: str) -> float | None:
        vals = [r[key] for r in self.runs if r.get(key) is not None]
        return statistics.median(vals) if vals else None


def topologies(gpus: int, splits: list[int]) -> list[Topology]:
    return [Topology(f"{gpus}U", unified=gpus)] + [Topology(f"{p}P+{gpus - p}D", prefill=p, decode=gpus - p)
                                                   for p in splits if 0 < p < gpus]


def engine_args(a: argparse.Namespace, placement: str) -> list[str]:
    args = ["--profile", a.profile, "--time-scale", str(a.time_scale), "--max-total-tokens", str(a.gpu_tokens),
            "--page-size", str(a.page_size),
            "--kv-bytes-per-token", str(a.kv_bytes_per_token), "--kv-pool-mb", str(a.kv_pool_mb),
            "--transfer-bandwidth-gbps", str(a.transfer_bandwidth_gbps)]
    if placement in ("host", "pool"):
        args += ["--enable-hierarchical-cache", "--hicache-ratio", str(a.hicache_ratio)]
    if placement == "pool":
        args += ["--hicache-storage-prefetch-policy", a.prefetch_policy, "--storage-timing", "link",
                 "--storage-bandwidth-gbps", str(a.storage_bandwidth_gbps)]
    return args


def start_router(cell: Cell, cluster: SimCluster | ExternalFleet, a: argparse.Namespace, log: Path) -> Service:
    """kvgate (``cost`` / ``pd_cost``, the transfer priced at the simulated link), sglang-router or SMG."""
    # the policy prices pool loads at the rate the simulated fleet charges them
    pool_tps = a.storage_bandwidth_gbps * 1e9 / get_profile(a.profile).kv_bytes_per_token
    if not cell.topology.pd:
        if cell.router == "kvgate":
            return start_kvgate(cluster.urls, "cost", {"pool_load_tokens_per_s": f"{pool_tps:.0f}"}, log,
                                tokenizer=a.gateway_tokenizer)
        if cell.router == "smg":
            return start_smg(cluster.urls, "cache_aware", {}, log)
        return start_sglang_router(cluster.urls, "cache_aware", {}, log)
    legs: list[str] = []
    for url, port in cluster.prefill:
        legs += ["--prefill", url, str(port)]
    for url in cluster.decode:
        legs += ["--decode", url]
    if cell.router == "kvgate":
        bw = str(a.transfer_bandwidth_gbps * 1e9)
        make = lambda port: [sys.executable, "-m", "gateway", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--log-level", "warning", "--tokenizer", a.gateway_tokenizer, "--pd-disaggregation",
                             "--policy", "pd_cost", "--policy-option", f"cross_host_bytes_per_s={bw}",
                             "--policy-option", f"same_host_bytes_per_s={bw}",
                             "--policy-option", f"pool_load_tokens_per_s={pool_tps:.0f}", *legs]
        return start_service(make, log, "/readiness")
    if cell.router == "smg":
        return start_smg([], "cache_aware", {}, log, pd=["--pd-disaggregation", *legs])
    make = lambda port: [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                         str(port), "--prometheus-port", str(_free()), "--log-level", "warn", "--pd-disaggregation",
                         "--policy", "cache_aware", *legs]
    return start_service(make, log, "/health")


def _free() -> int:
    from .services import free_port

    return free_port()


def run_cell(cell: Cell, records: list[TraceRecord], span_s: float, a: argparse.Namespace, out: Path,
             keep_rows: bool) -> tuple[dict, list[float], list[float]]:
    logs = out / "logs" / cell.label.replace("/", "_").replace("+", "")
    logs.mkdir(parents=True, exist_ok=True)
    topo = cell.topology
    fleet = a.external or SimCluster(workers=topo.unified, prefill=topo.prefill, decode=topo.decode,
                                     engine_args=engine_args(a, cell.placement), pool=cell.placement == "pool",
                                     pool_segment=a.pool_segment, log_dir=str(logs), startup_timeout=120)
    with fleet as cluster, contextlib.ExitStack() as stack:
        router = start_router(cell, cluster, a, logs / "router.log")
        stack.callback(router.stop)
        kv_bytes = get_profile(a.profile).kv_bytes_per_token
        before = ttft0 = None
        if a.external is not None:  # long-lived engines: start cold, count this run only
            for u in cluster.all_urls:
                http_post(u + "/flush_cache")
            before, ttft0 = worker_totals(cluster.all_urls, kv_bytes), ttft_sums([w for w, _ in cluster.prefill])
        time.sleep(1.0)  # the policy subscribes to every worker's KV events
        res = asyncio.run(replay(records, router.url, api="generate", speedup=a.time_scale, concurrency=4096,
                                 time_scale=a.time_scale, timeout=a.request_timeout, load_urls=cluster.all_urls,
                                 load_interval=1.0))
        totals = since(worker_totals(cluster.all_urls, kv_bytes), before)
        roles = {w: "prefill" for w, _ in cluster.prefill} | {w: "decode" for w in cluster.decode} \
            | {w: "unified" for w in cluster.urls}
        ttft_sum, ttft_n = ttft_sums([w for w, _ in cluster.prefill])
        if ttft0 is not None:
            ttft_sum, ttft_n = ttft_sum - ttft0[0], ttft_n - ttft0[1]
        prefill_ttft = ttft_sum / ttft_n * a.time_scale if ttft_n else None
    s = summarize(res.rows, res.wall_s, res.time_scale)
    f = res.time_scale
    good = sum(1 for r in res.rows if r.ok and r.ttft_s is not None and r.ttft_s * f <= a.slo_ttft)
    s["goodput_rps"] = good / span_s if span_s else None
    both = sum(1 for r in res.rows if r.ok and r.ttft_s is not None and r.ttft_s * f <= a.slo_ttft
               and (r.tpot_s is None or r.tpot_s * f <= a.slo_tpot))
    s["goodput_both_rps"] = both / span_s if span_s else None
    s["slo_share"] = good / len(res.rows) if res.rows else 0.0
    p = totals["prompt"] or 1
    s.update({"hit_gpu": totals["device"] / p, "hit_host": totals["host"] / p, "hit_pool": totals["storage"] / p,
              "pd_gb": totals["pd_bytes"] / 1e9, "pd_loopback_gb": totals["pd_loopback_bytes"] / 1e9,
              "pd_ms_per_req": totals["pd_sim_s"] * 1000 / max(1, s["ok"]) if topo.pd else None,
              "pd_queue_s": totals["pd_queue_sim_s"], "pool_gb": totals["pool_bytes"] / 1e9,
              "pool_load_s": totals["pool_load_sim_s"], "pool_query_wall_s": totals["pool_query_wall_s"],
              "pool_fetch_wall_s": totals["pool_fetch_wall_s"], "pool_queries": totals["pool_queries"],
              "lag_s": max(totals["lag_s"], res.meta.get("sim_max_lag_s") or 0.0),
              # simulated GPU busy share per role (mean over its workers) over the run
              **{f"busy_{role}": sum(b) / len(b) / s["duration_s"] for role, b in totals["busy"].items()},
              "errors_sample": [r.error for r in res.rows if not r.ok][:2]})
    s["prefill_ttft_mean_s"] = prefill_ttft
    for role in set(roles.values()):  # queueing and KV memory per role, sampled every wall second
        samples = [x for x in res.loads if roles.get(x.url) == role]
        if samples:
            s[f"waiting_{role}"] = sum(x.waiting for x in samples) / len(samples)  # per worker
            s[f"kv_usage_{role}"] = sum(x.token_usage for x in samples) / len(samples)
    ttft = [r.ttft_s * f for r in res.rows if r.ok and r.ttft_s is not None] if keep_rows else []
    tpot = [r.tpot_s * f for r in res.rows if r.ok and r.tpot_s is not None] if keep_rows else []
    return s, ttft, tpot


def plan(a: argparse.Namespace) -> list[Cell]:
    """The cells to run, in order: every workload's topology x placement x router."""
    topos = topologies(a.gpus, a.splits)
    cells = []
    for w in a.workloads:
        for t in topos if w == a.workloads[0] else topos[:1 + a.side_splits]:
            for p in a.placements:
                for r in a.routers:
                    if r == "kvgate" or w == a.workloads[0]:
                        cells.append(Cell(w, t, p, r))
    return cells


def headline(cell: Cell, a: argparse.Namespace) -> bool:
    """Cells repeated ``--repeat`` times (medians reported): the first workload, kvgate, GPU only
    and GPU + host + pool (each technique alone and both together)."""
    return cell.workload == a.workloads[0] and cell.router == "kvgate" and cell.placement != "host"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.joint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="conversation workload, 4U and 2P+2D, one run per cell")
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS),
                   help="the first gets the whole matrix (both routers, every split, repeats)")
    p.add_argument("--requests", type=int, default=300, help="requests per workload")
    p.add_argument("--span-s", type=float, default=60.0, help="simulated seconds the arrivals are spread over")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--splits", type=int, nargs="+", default=[2, 1], help="prefill workers of each PD split")
    p.add_argument("--side-splits", type=int, default=1, help="PD splits run on the other workloads")
    p.add_argument("--placements", nargs="+", default=list(PLACEMENTS), choices=PLACEMENTS)
    p.add_argument("--routers", nargs="+", default=[r for r in ROUTERS if r != "smg" or smg_python()], choices=ROUTERS,
                   help="default: all three, SMG when it is installed (scripts/setup.sh --bench)")
    p.add_argument("--repeat", type=int, default=2, help="runs of each headline cell (medians)")
    p.add_argument("--profile", default="llama3-8b-h100")
    p.add_argument("--time-scale", type=float, default=2.0)
    p.add_argument("--gpu-tokens", type=int, default=200_000,
                   help="KV pool tokens per GPU, every role alike (scaled to the slice so the GPU tier fills)")
    p.add_argument("--hicache-ratio", type=float, default=2.0)
    p.add_argument("--prefetch-policy", default="wait_complete")
    p.add_argument("--pool-segment", default="256mb", help="memory each worker lends to the Mooncake pool")
    p.add_argument("--kv-bytes-per-token", type=int, default=256, help="bytes really moved per token here")
    p.add_argument("--kv-pool-mb", type=int, default=128, help="each worker's registered PD transfer buffer")
    p.add_argument("--transfer-bandwidth-gbps", type=float, default=25.0, help="simulated PD link, GB/s")
    p.add_argument("--storage-bandwidth-gbps", type=float, default=20.0,
                   help="simulated pool -> GPU load, GB/s (RDMA Mooncake Store; at 5 GB/s an 8B model's KV loads "
                        "no faster than an H100 recomputes it)")
    p.add_argument("--page-size", type=int, default=256,
                   help="KV page tokens (the trace's 512-token blocks lose nothing; 4x fewer pool objects than 64)")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO for goodput, simulated s")
    p.add_argument("--slo-tpot", type=float, default=0.025, help="TPOT SLO of the second goodput, simulated s")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "joint"))
    p.add_argument("--plots", default=str(ROOT / "bench" / "results"), help="where the PNGs go")
    p.add_argument("--no-results", action="store_true", help="do not rewrite bench/RESULTS.md")
    p.add_argument("--only", nargs="*", default=[], help="run only the cells whose label holds one of these")
    ext = p.add_argument_group("real engines (instead of the simulator; time-scale 1, one topology)")
    ext.add_argument("--worker-url", nargs="+", default=[], help="unified SGLang workers")
    ext.add_argument("--prefill-url", nargs=2, action="append", default=[], metavar=("URL", "BOOTSTRAP_PORT"))
    ext.add_argument("--decode-url", action="append", default=[])
    ext.add_argument("--external-placement", choices=PLACEMENTS, default="gpu",
                     help="how those engines were launched (HiCache host tier, Mooncake Store L3)")
    ext.add_argument("--gateway-tokenizer", default="byte",
                     help="the gateway's tokenizer: 'byte' for the simulator, the model directory for real engines")
    return p


def main(argv: list[str] | None = None) -> int:
    from . import joint_report

    a = build_parser().parse_args(argv)
    peers = [r for r in a.routers if r != "kvgate"]
    if a.quick:
        a.workloads, a.splits, a.repeat = a.workloads[:1], a.splits[:1], 1
        a.requests, a.span_s = min(a.requests, 150), min(a.span_s, 30.0)
        a.routers = [r for r in a.routers if r == "kvgate"]
    if "conversation" in a.workloads and not Path(a.trace).exists():
        print(f"trace not found: {a.trace}; running without the conversation workload", file=sys.stderr)
        a.workloads = [w for w in a.workloads if w != "conversation"]
    workloads = {w: (WORKLOADS[w](a.trace, a.requests, a.span_s, a.seed) if w == "conversation"
                     else WORKLOADS[w](a.requests, a.span_s, a.seed)) for w in a.workloads}
    a.external = external_fleet(a)
    if a.external is not None:
        a.time_scale = 1.0
        cells = [Cell(w, a.external.topology, a.external_placement, r) for w in a.workloads for r in a.routers]
    else:
        cells = [c for c in plan(a) if not a.only or any(x in c.label for x in a.only)]
    if a.quick and peers and a.external is None:  # one peer cell: the joint one
        pd = [c for c in cells if c.topology.pd and c.placement == a.placements[-1]]
        cells += [Cell(c.workload, c.topology, c.placement, r) for c in pd[:1] for r in peers]
    out = Path(a.out)
    started = time.monotonic()
    results: list[CellResult] = []
    for i, cell in enumerate(cells):
        res = CellResult(cell)
        for rep in range(a.repeat if headline(cell, a) else 1):
            t0 = time.monotonic()
            try:
                s, ttft, tpot = run_cell(cell, workloads[cell.workload], a.span_s, a, out, keep_rows=rep == 0)
            except (RuntimeError, TimeoutError, OSError) as e:
                res.error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                print(f"[{i + 1}/{len(cells)}] {cell.label}: cannot run: {res.error}", file=sys.stderr, flush=True)
                break
            res.runs.append(s)
            if rep == 0:
                res.ttft, res.tpot = ttft, tpot
            print(f"[{i + 1}/{len(cells)}] {cell.label} run {rep + 1}: ok {s['ok']}/{s['requests']}, TTFT p99 "
                  f"{s['ttft_p99_s'] or 0:.2f} s, TPOT p99 {(s['tpot_p99_s'] or 0) * 1000:.1f} ms, goodput "
                  f"{s['goodput_rps']:.2f} req/s, lag {s['lag_s']:.2f} s, {time.monotonic() - t0:.0f} s wall; pool: "
                  f"{s['pool_queries']} queries {s['pool_query_wall_s']:.1f} wall s, fetch {s['pool_fetch_wall_s']:.1f} "
                  f"wall s, charged {s['pool_load_s']:.1f} sim s; prefill-side TTFT {s['prefill_ttft_mean_s'] or 0:.2f} s; "
                  + ", ".join(f"{k} {v:.2f}" for k, v in s.items() if k.startswith(("busy_", "waiting_", "kv_usage_"))),
                  file=sys.stderr, flush=True)
        results.append(res)
    wall = time.monotonic() - started
    text = joint_report.section(results, workloads, a, argv if argv is not None else sys.argv[1:], wall)
    print(text)
    print(joint_report.plots(results, Path(a.plots), quick=a.quick))
    if not a.no_results:
        joint_report.write_results(text, quick=a.quick)
    return 0 if all(r.runs for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
