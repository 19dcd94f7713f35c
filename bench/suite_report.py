"""Table, targets, plot and RESULTS.md section for ``bench.suite``.

The section is delimited by HTML comments so that a rerun replaces only its own part;
the hand-written reading sits after the end marker and survives.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .quality_report import medians as router_medians

BEGIN = "<!-- workload-suite:begin -->"
END = "<!-- workload-suite:end -->"
PLOT = "suite.png"
MEAN_TARGET, P99_TARGET, FLOOR_SLACK, HIT_TARGET = 0.7, 0.7, 1.1, 0.95


def medians(rows: list[dict]) -> list[dict]:
    """One row per (workload, router): medians over repetitions (quality_report's, per workload)."""
    out: list[dict] = []
    for name in dict.fromkeys(r["workload"] for r in rows):
        out += router_medians([r for r in rows if r["workload"] == name])
    return out


def is_peer(row: dict) -> bool:
    return row["router"] != "kvgate" and row["policy"] == "cache_aware"


def best_peer(rows: list[dict], workload: str, key: str) -> float | None:
    vals = [r[key] for r in rows if r["workload"] == workload and is_peer(r) and r.get(key) is not None]
    return min(vals) if vals else None


def floor(setup: dict) -> tuple[float, float]:
    """The TTFT floor (mean, p99) a workload's rows are held to: every request alone on an
    idle GPU with no cache; where the load leaves no room (its prefill at the bounded
    oracle's hit rate is the fleet's capacity or more, so queues must grow under any router)
    the no-cache floor with the fleet's queues (``bench.offered_load.queue_floor``)."""
    if setup["prefill_load_at_bounded_oracle"] >= 1.0 and "ttft_queue_floor_mean_s" in setup:
        return setup["ttft_queue_floor_mean_s"], setup["ttft_queue_floor_p99_s"]
    return setup["ttft_floor_mean_s"], setup["ttft_floor_p99_s"]


def _f(v: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if v is None else fmt.format(v)


HEADER = ["workload", "router", "hit", "/bounded", "TTFT mean", "p99", "vs peer mean", "p99",
          "floor mean", "p99", "wait mean", "prefill max/mean", "lag max", "lagged", "errors"]


def table_rows(rows: list[dict], setups: dict) -> list[list[str]]:
    out = []
    for r in rows:
        s = setups[r["workload"]]
        pm, pp = best_peer(rows, r["workload"], "ttft_mean_s"), best_peer(rows, r["workload"], "ttft_p99_s")
        out.append([r["workload"], r["label"].split(" (median")[0], _f(r["hit_rate"]), _f(r["hit_vs_bounded"], "{:.2f}"),
                    _f(r["ttft_mean_s"]), _f(r["ttft_p99_s"]),
                    _f(r["ttft_mean_s"] / pm if pm and r["ttft_mean_s"] else None, "{:.2f}x"),
                    _f(r["ttft_p99_s"] / pp if pp and r["ttft_p99_s"] else None, "{:.2f}x"),
                    *(_f(v) for v in floor(s)), _f(r["wait_mean_s"]),
                    _f(r["prefill_imbalance"], "{:.2f}"), _f(r["sim_lag_max_s"]), "yes" if r["lagged"] else "no",
                    str(r["errors"])])
    return out


def format_table(rows: list[dict], setups: dict, markdown: bool = False) -> str:
    cells = [HEADER] + table_rows(rows, setups)
    if markdown:
        return "\n".join(["| " + " | ".join(HEADER) + " |", "|" + "|".join("---" for _ in HEADER) + "|"]
                         + ["| " + " | ".join(c) + " |" for c in cells[1:]])
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADER))]
    return "\n".join("  ".join(c[i].ljust(widths[i]) if i < 2 else c[i].rjust(widths[i]) for i in range(len(c)))
                     for c in cells)


def targets(rows: list[dict], setups: dict) -> list[str]:
    """Each kvgate ``cost`` row against the targets: mean and p99 TTFT <= 0.7x the best peer
    (another router's cache_aware) or <= 1.1x the no-cache floor; hit >= 0.95 of the
    capacity-bounded oracle."""
    out = []
    for r in rows:
        if r["router"] != "kvgate" or r["policy"] != "cost":
            continue
        s, parts, met = setups[r["workload"]], [], True
        for key, bound, limit in zip(("ttft_mean_s", "ttft_p99_s"), floor(s), (MEAN_TARGET, P99_TARGET)):
            peer, v = best_peer(rows, r["workload"], key), r[key]
            if v is None:
                parts.append(f"{key}: no data")
                met = False
                continue
            vs_peer = v / peer if peer else float("inf")
            vs_floor = v / bound if bound else float("inf")
            ok = vs_peer <= limit or vs_floor <= FLOOR_SLACK
            met &= ok
            parts.append(f"{key.split('_')[1]} {vs_peer:.2f}x peer, {vs_floor:.2f}x floor ({'ok' if ok else 'MISS'})")
        hit = r["hit_vs_bounded"] or 0.0
        met &= hit >= HIT_TARGET
        parts.append(f"hit/bounded {hit:.2f} ({'ok' if hit >= HIT_TARGET else 'MISS'})")
        out.append(f"- {r['workload']} {r['label'].split(' (median')[0]}: {'meets' if met else 'misses'}: "
                   + "; ".join(parts))
    return out


def write_outputs(out: Path, meta: dict, setups: dict, rows: list[dict]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    summary = out / "summary.json"
    summary.write_text(json.dumps({"meta": meta, "setups": setups, "runs": rows}, indent=2, default=str))
    table = out / "table.md"
    table.write_text(format_table(medians(rows), setups, markdown=True) + "\n")
    return [summary, table, *plot(out / PLOT, medians(rows), setups)]


def plot(path: Path, rows: list[dict], setups: dict) -> list[Path]:
    """Mean TTFT over the no-cache floor and hit over the bounded oracle, a bar per router
    in each workload's group; nothing (and a message) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("suite: matplotlib is not installed; no plot")
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["workload"] for r in rows))
    routers = list(dict.fromkeys(r["label"].split(" (median")[0] for r in rows))
    width = 0.8 / max(1, len(routers))
    fig, axes = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for k, label in enumerate(routers):
        xs, mean, hit = [], [], []
        for i, name in enumerate(names):
            r = next((r for r in rows if r["workload"] == name and r["label"].split(" (median")[0] == label), None)
            if r is None or r["ttft_mean_s"] is None:
                continue
            xs.append(i + (k - (len(routers) - 1) / 2) * width)
            mean.append(r["ttft_mean_s"] / floor(setups[name])[0])
            hit.append(r["hit_vs_bounded"] or 0.0)
        axes[0].bar(xs, mean, width, label=label)
        axes[1].bar(xs, hit, width, label=label)
    axes[0].set_yscale("log")
    axes[0].axhline(1.0, color="black", linestyle=":", linewidth=1)
    axes[0].set_ylabel("mean TTFT / no-cache floor")
    axes[1].axhline(HIT_TARGET, color="black", linestyle=":", linewidth=1)
    axes[1].set_ylabel("hit / bounded oracle")
    axes[1].set_xticks(range(len(names)), names)
    axes[0].legend(fontsize=7)
    for ax in axes:
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path]


def section(meta: dict, setups: dict, rows: list[dict]) -> str:
    summary = medians(rows)
    lagged = sorted({f"{r['workload']} {r['label']}" for r in rows if r["lagged"]})
    loads = "; ".join(f"{n} {s['requests']} req over {s['span_s']:.0f} s, load {s['prefill_load_no_cache']:.2f} / "
                      f"{s['prefill_load_at_bounded_oracle']:.2f}, bounded oracle {s['bounded_oracle_hit_rate']:.3f}"
                      for n, s in setups.items())
    return "\n".join([
        BEGIN,
        "## Workload suite (`bench/suite.py`)",
        "",
        f"- Date: {meta['date']}",
        f"- Machine: {meta['machine']}",
        f"- Command: `{meta['command']}`",
        f"- Fleet: {meta['workers']} simulated workers `{meta['profile']}`, `--time-scale {meta['time_scale']:g}`, "
        f"fresh cluster per run; medians of {meta['repeat']} interleaved passes. Workloads (`bench/workloads.py`, "
        "design in `bench/README.md`), with offered prefill load as a share of the fleet with no cache / at the "
        f"bounded oracle's hit rate: {loads}.",
        "- Columns: hit = cached/prompt tokens from the engines; /bounded its ratio to one LRU of the fleet's KV "
        "capacity; TTFT in simulated s; vs peer = over the best other router's cache_aware; floor = every request "
        "alone on an idle GPU with no cache, or, where the load at the bounded oracle's hit rate is 1 or more, "
        "with no cache and one first-come-first-served queue over the fleet's GPUs; wait = TTFT minus own prefill; prefill max/mean over workers; "
        "lagged = a run's simulated schedulers or client fell behind (routing_quality's test: the machine, not "
        "the router, limited it).",
        f"- Lag: {'beyond tolerance in ' + ', '.join(lagged) if lagged else 'no run lagged beyond tolerance'}.",
        "",
        format_table(summary, setups, markdown=True),
        "",
        "Targets (`cost`: mean and p99 TTFT <= 0.7x the best peer or <= 1.1x the floor; hit >= 0.95 of bounded):",
        "",
        *targets(summary, setups),
        "",
        f"![suite](results/{PLOT})",
        END,
    ])


def update_results(bench_dir: Path, meta: dict, setups: dict, rows: list[dict], out: Path) -> list[Path]:
    written = []
    if (out / PLOT).exists():
        (bench_dir / "results").mkdir(exist_ok=True)
        shutil.copyfile(out / PLOT, bench_dir / "results" / PLOT)
        written.append(bench_dir / "results" / PLOT)
    md = bench_dir / "RESULTS.md"
    text = md.read_text()
    new = section(meta, setups, rows)
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + new + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + new + "\n"
    md.write_text(text)
    return [*written, md]
