"""``bench.joint``'s output: the markdown table, the reading of it, and the PNG plots."""

from __future__ import annotations

import argparse
import datetime
import shlex
from pathlib import Path

from .tables import markdown, write_results as _write_section
from .routing_quality import machine

ROOT = Path(__file__).resolve().parent.parent


def _f(v: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def table(results: list) -> str:
    rows = [["workload", "fleet", "KV placement", "router", "runs", "ok/req", "TTFT mean / p50 / p99 s",
             "TPOT mean / p99 ms", "out tok/s", "goodput req/s (share)", "goodput +TPOT", "hit GPU / host / pool",
             "PD KV GB (ms/req)", "pool->GPU GB", "lag s"]]
    for r in results:
        c = r.cell
        router = "kvgate " + ("pd_cost" if c.topology.pd else "cost") if c.router == "kvgate" \
            else f"{c.router} cache_aware"
        if not r.runs:
            rows.append([c.workload, c.topology.name, c.placement, router, "0", f"cannot run: {r.error}"]
                        + ["-"] * 9)
            continue
        m = r.median
        first = r.runs[0]
        pd = f"{_f(m('pd_gb'), 1, 1)} ({_f(m('pd_ms_per_req'), 1, 0)})" if c.topology.pd else "-"
        rows.append([
            c.workload, c.topology.name, c.placement, router, str(len(r.runs)), f"{first['ok']}/{first['requests']}",
            f"{_f(m('ttft_mean_s'))} / {_f(m('ttft_p50_s'))} / {_f(m('ttft_p99_s'))}",
            f"{_f(m('tpot_mean_s'), 1000, 1)} / {_f(m('tpot_p99_s'), 1000, 1)}",
            _f(m("output_tok_per_s"), 1, 0), f"{_f(m('goodput_rps'))} ({_f(m('slo_share'), 100, 0)}%)",
            _f(m("goodput_both_rps")),
            f"{_f(m('hit_gpu'))} / {_f(m('hit_host'))} / {_f(m('hit_pool'))}", pd, _f(m("pool_gb"), 1, 1),
            _f(max(x["lag_s"] for x in r.runs)),
        ])
    return markdown(rows)


def verdict(results: list, workload: str) -> list[str]:
    """The target on one workload: PD + pool (kvgate) against the best single-technique cell."""
    kv = {(r.cell.topology, r.cell.placement): r for r in results
          if r.cell.workload == workload and r.cell.router == "kvgate" and r.runs}
    pd_only = [r for (t, p), r in kv.items() if t.pd and p == "gpu"]
    offload_only = [r for (t, p), r in kv.items() if not t.pd and p != "gpu"]
    joint = [r for (t, p), r in kv.items() if t.pd and p == "pool"]
    if not (joint and (pd_only or offload_only)):
        return []
    lines = []
    for key, better, name in (("ttft_p99_s", min, "TTFT p99"), ("goodput_rps", max, "goodput")):
        singles = [r for r in pd_only + offload_only if r.median(key) is not None]
        best_single = better(singles, key=lambda r: r.median(key))
        best_joint = better(joint, key=lambda r: r.median(key))
        js, ss = best_joint.median(key), best_single.median(key)
        ok = js <= ss if better is min else js >= ss
        lines.append(f"- {workload}, {name}: PD + pool ({best_joint.cell.topology.name}) {js:.2f} vs best single "
                     f"technique ({best_single.cell.topology.name}/{best_single.cell.placement}) {ss:.2f}: "
                     + ("at least as good" if ok else "worse"))
    return lines


def section(results: list, workloads: dict, a: argparse.Namespace, argv: list[str], wall_s: float) -> str:
    cmd = "PYTHONPATH=$PWD python -m bench.joint " + shlex.join(argv)
    sizes = ", ".join(f"{w} {len(r)} requests ({sum(x.input_length for x in r) / len(r) / 1000:.1f}k prompt, "
                      f"{sum(x.output_length for x in r) / len(r):.0f} output tokens mean)" for w, r in workloads.items())
    title = "## Joint matrix: PD x KV offload x router (`bench/joint.py`" + (", --quick)" if a.quick else ")")
    lines = [
        title, "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; wall {wall_s / 60:.1f} min",
        f"- command: `{cmd.strip()}`",
        f"- machine: {machine()}",
        f"- setup: {a.gpus} simulated GPUs per cell ({a.profile}, {a.gpu_tokens // 1000}k KV tokens each, every role), "
        f"time-scale {a.time_scale:g}; {sizes}; arrivals over {a.span_s:g} simulated s, identical in every cell; "
        f"host tier {a.hicache_ratio:g}x GPU; pool = real mooncake_master, {a.pool_segment} per worker, prefetch "
        f"{a.prefetch_policy}; PD KV charged at 128 KiB/token over {a.transfer_bandwidth_gbps:g} GB/s per prefill "
        f"link, {a.kv_bytes_per_token} B/token really moved over loopback",
        f"- goodput: requests finished with TTFT <= {a.slo_ttft:g} s, per simulated second of the arrival schedule "
        f"(share of all requests in brackets); +TPOT: those that also kept TPOT <= {a.slo_tpot * 1000:g} ms. Latencies in simulated seconds. `runs` > 1: medians. Hit rates: "
        "prompt tokens served per tier on the prefill/unified workers. lag: the simulator's worst lag behind its "
        "time scale (scheduler or transfer), in simulated s.", "",
        table(results), "",
    ]
    for w in workloads:
        lines += verdict(results, w)
    return "\n".join(lines)


def write_results(text: str, quick: bool) -> None:
    _write_section(text, ROOT / "bench" / "RESULTS.md", "quick" if quick else "main", script="bench/joint.py")


def plots(results: list, out: Path, quick: bool) -> str:
    """TTFT and TPOT CDFs per workload (one line per cell), goodput bars; PNG via matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return "plots skipped: matplotlib is not installed (pip install -e '.[bench]')"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    prefix = "joint_quick" if quick else "joint"
    written = []
    for w in dict.fromkeys(r.cell.workload for r in results):
        cells = [r for r in results if r.cell.workload == w and r.runs]
        for attr, label, scale in (("ttft", "TTFT (s, simulated)", 1.0), ("tpot", "TPOT (ms, simulated)", 1000.0)):
            fig, ax = plt.subplots(figsize=(8, 5))
            for r in cells:
                xs = sorted(v * scale for v in getattr(r, attr))
                if xs:
                    style = "-" if r.cell.router == "kvgate" else ":"
                    ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], style,
                            label=f"{r.cell.topology.name}/{r.cell.placement}/{r.cell.router}")
            ax.set_xscale("log")
            ax.set_xlabel(label)
            ax.set_ylabel("CDF")
            ax.set_title(f"{w}: {attr.upper()}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=6, ncol=2)
            fig.tight_layout()
            path = out / f"{prefix}_{w}_{attr}_cdf.png"
            fig.savefig(path, dpi=100)
            plt.close(fig)
            written.append(path)
    ok = [r for r in results if r.runs]
    fig, ax = plt.subplots(figsize=(max(8, len(ok) * 0.35), 5))
    ax.bar(range(len(ok)), [r.median("goodput_rps") or 0 for r in ok],
           color=["C0" if r.cell.router == "kvgate" else "C1" for r in ok])
    ax.set_xticks(range(len(ok)), [r.cell.label.replace("/kvgate", "").replace("/sglang-router", "/sgl")
                                   for r in ok], rotation=75, fontsize=6)
    ax.set_ylabel("goodput (req/s at the TTFT SLO, simulated)")
    ax.set_title("goodput per cell (blue kvgate, orange the peers)")
    fig.tight_layout()
    path = out / f"{prefix}_goodput.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
    return "wrote " + ", ".join(str(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p) for p in written)
