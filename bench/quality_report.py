"""Tables, files and plots for ``bench.routing_quality``.

The RESULTS.md section is delimited by HTML comments so that re-running the benchmark
replaces only its own section; other benchmarks own the rest of the file.
"""

from __future__ import annotations

import csv
import json
import shutil
import statistics
from dataclasses import asdict
from pathlib import Path

BEGIN = "<!-- routing-quality:begin -->"
END = "<!-- routing-quality:end -->"
PLOTS = ("quality_ttft_cdf.png", "quality_hit_rate.png")

COLUMNS = [  # (header, key, format)
    ("run", "label", "{}"),
    ("hit", "hit_rate", "{:.3f}"),
    ("/oracle", "hit_vs_oracle", "{:.2f}"),
    ("/bounded", "hit_vs_bounded", "{:.2f}"),
    ("lost: diverted", "lost_diverted", "{:.3f}"),
    ("evicted", "lost_evicted", "{:.3f}"),
    ("TTFT mean", "ttft_mean_s", "{:.3f}"),
    ("p50", "ttft_p50_s", "{:.3f}"),
    ("p99", "ttft_p99_s", "{:.3f}"),
    ("wait mean", "wait_mean_s", "{:.3f}"),
    ("p99", "wait_p99_s", "{:.3f}"),
    ("TPOT mean", "tpot_mean_s", "{:.4f}"),
    ("p50", "tpot_p50_s", "{:.4f}"),
    ("p99", "tpot_p99_s", "{:.4f}"),
    ("req/s", "req_per_s", "{:.2f}"),
    ("out tok/s", "output_tok_per_s", "{:.0f}"),
    ("req max/mean", "req_imbalance", "{:.2f}"),
    ("prompt max/mean", "prompt_imbalance", "{:.2f}"),
    ("prefill max/mean", "prefill_imbalance", "{:.2f}"),
    ("drift", "drift_window", "{:.2f}"),
    ("lag mean s", "sim_lag_mean_s", "{:.4f}"),
    ("lag max s", "sim_lag_max_s", "{:.3f}"),
    ("errors", "errors", "{}"),
]


def _cell(row: dict, key: str, fmt: str) -> str:
    v = row.get(key)
    return "-" if v is None else fmt.format(v)


def format_table(rows: list[dict], markdown: bool = False) -> str:
    cells = [[h for h, _, _ in COLUMNS]] + [[_cell(r, k, f) for _, k, f in COLUMNS] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(cells[0]) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
        lines += ["| " + " | ".join(c) + " |" for c in cells[1:]]
        return "\n".join(lines)
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c[i].rjust(widths[i]) if i else c[i].ljust(widths[i]) for i in range(len(c)))
                     for c in cells)


def medians(rows: list[dict]) -> list[dict]:
    """One row per router over its repetitions: the median of every number (one run per
    router gives the rows back unchanged). Run-to-run noise on this benchmark is ~15%:
    a target is judged on medians, never on one lucky run."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r.get("base_label", r["label"]), []).append(r)
    if all(len(g) == 1 for g in groups.values()):
        return rows
    out = []
    for label, group in groups.items():
        row = dict(group[0], label=f"{label} (median of {len(group)})")
        for key, value in group[0].items():
            values = [g.get(key) for g in group]
            if isinstance(value, (int, float)) and not isinstance(value, bool) and all(
                    isinstance(v, (int, float)) for v in values):
                ints = all(isinstance(v, int) for v in values)
                row[key] = (statistics.median_low if ints else statistics.median)(values)
        row["lagged"] = any(g["lagged"] for g in group)
        out.append(row)
    return out


def targets(rows: list[dict]) -> list[str]:
    """The targets (hit/bounded >= 0.90; TTFT mean and p99 <= 0.5x), checked against sglang-router cache_aware."""
    ref = next((r for r in rows if r["router"] == "sglang-router" and r["policy"] == "cache_aware"), None)
    out = []
    for r in rows:
        if r["router"] != "kvgate":
            continue
        parts = [f"hit/bounded {r['hit_vs_bounded']:.2f} {'>=' if r['hit_vs_bounded'] >= 0.9 else '<'} 0.90"]
        if ref and ref["ttft_mean_s"] and r["ttft_mean_s"] is not None:
            m, p = r["ttft_mean_s"] / ref["ttft_mean_s"], r["ttft_p99_s"] / ref["ttft_p99_s"]
            parts.append(f"TTFT mean {m:.2f}x, p99 {p:.2f}x sglang-router cache_aware "
                         f"({'meets' if m <= 0.5 and p <= 0.5 else 'misses'} <= 0.5x)")
        out.append(f"- {r['label']}: " + "; ".join(parts))
    return out


def write_outputs(out: Path, meta: dict, rows: list[dict], runs: list[dict]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    summary = out / "summary.json"
    summary.write_text(json.dumps({"meta": meta, "runs": rows}, indent=2, default=str))
    table = out / "runs.csv"
    scalar = [k for k, v in rows[0].items() if not isinstance(v, (list, dict))] if rows else []
    with open(table, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(scalar)
        for r in rows:
            w.writerow([r.get(k) for k in scalar])
    written = [summary, table]
    for run, row in zip(runs, rows):
        p = out / f"requests-{_slug(row['label'])}.csv"
        res = run["result"]
        with open(p, "w", newline="") as f:
            w = csv.writer(f)
            fields = list(asdict(res.rows[0])) if res.rows else []
            w.writerow(fields)
            for r in res.rows:
                w.writerow(list(asdict(r).values()))
        written.append(p)
    written += plot(out, runs, rows, meta.get("setup"))
    return written


def _slug(label: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in label)


def plot(out: Path, runs: list[dict], rows: list[dict], setup: dict | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run, row in zip(runs, rows):
        res = run["result"]
        ttft = sorted(r.ttft_s * res.time_scale for r in res.rows if r.ok and r.ttft_s is not None)
        if ttft:
            ax.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=row["label"],
                    linestyle="-" if row["router"] == "kvgate" else "--")
    ax.set_xscale("log")
    p1 = _save(plt, fig, ax, "TTFT (simulated s)", "CDF", out / PLOTS[0])

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run, row in zip(runs, rows):
        res = run["result"]
        ok = sorted((r for r in res.rows if r.ok), key=lambda r: r.scheduled_s)
        window = max(1, len(ok) // 25)
        xs, ys = [], []
        for i in range(0, len(ok) - window + 1, window):
            chunk = ok[i:i + window]
            prompt = sum(r.prompt_tokens for r in chunk)
            xs.append(chunk[-1].scheduled_s * res.time_scale)
            ys.append(sum(r.cached_tokens for r in chunk) / prompt if prompt else 0.0)
        ax.plot(xs, ys, marker=".", label=row["label"], linestyle="-" if row["router"] == "kvgate" else "--")
    if setup:
        ax.axhline(setup["oracle_hit_rate"], color="black", linestyle=":", label="oracle (whole slice)")
        ax.axhline(setup["bounded_oracle_hit_rate"], color="grey", linestyle=":", label="bounded oracle (whole slice)")
    ax.set_ylim(0, 0.6)
    p2 = _save(plt, fig, ax, "arrival time (simulated s)", "hit rate (cached / prompt tokens, per window)", out / PLOTS[1])
    return [p1, p2]


def _save(plt, fig, ax, xlabel: str, ylabel: str, path: Path) -> Path:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def section(meta: dict, rows: list[dict], notes: str = "") -> str:
    s = meta["setup"]
    summary = medians(rows)
    lagged = [f"{r['label']} (scheduler lag mean {r['sim_lag_mean_s']:.4f} s, max {r['sim_lag_max_s']:.3f} s; "
              f"client send delay p99 {r['send_delay_p99_s']:.3f} s)" for r in rows if r["lagged"]]
    lines = [
        BEGIN,
        "## Routing quality",
        "",
        f"- Date: {meta['date']}",
        f"- Machine: {meta['machine']}",
        f"- Command: `{meta['command']}`",
        f"- Workload: first {s['requests']} requests of `{Path(s['trace']).name}`, arrivals compressed "
        f"x{s['arrival_speedup']:g} in simulated time ({s['req_per_s']:.1f} req/s over {s['span_s']:.0f} simulated s), "
        f"{s['workers']} simulated workers `{s['profile']}`, `--time-scale {s['time_scale']:g}`; "
        f"offered prefill load {s['prefill_load_no_cache']:.0%} of the fleet with no cache, "
        f"{s['prefill_load_at_bounded_oracle']:.0%} at the bounded-oracle hit rate. Fresh cluster per run, same requests and schedule.",
        f"- Oracle hit rate of this slice: {s['oracle_hit_rate']:.3f} infinite cache "
        f"(full trace {s['full_trace_oracle_hit_rate']:.3f}), {s['bounded_oracle_hit_rate']:.3f} with one LRU of "
        f"{s['capacity_tokens']:,} tokens ({s['workers']} x each worker's KV pool).",
        f"- TTFT floor (every request alone on an idle GPU, no cache): mean {s['ttft_floor_mean_s']:.3f} s, "
        f"p50 {s['ttft_floor_p50_s']:.3f} s, p99 {s['ttft_floor_p99_s']:.3f} s: the trace's longest prompts "
        "(up to ~120k tokens) bound p99 TTFT from below whatever the router does.",
        "- Columns: hit = cached/prompt tokens as the engines report them; /oracle and /bounded its ratio to those oracles; "
        "lost = reusable prompt tokens the engines did not reuse, as shares of all prompt tokens (bench.hit_loss): "
        "diverted = served away from every worker the prefix had been sent to, evicted = served where it had been; "
        "TTFT/TPOT in simulated seconds; wait = TTFT minus the request's own prefill time on an idle GPU with the "
        "cache it got (time spent queued: what routing controls); max/mean over workers of requests, prompt tokens and prefilled (uncached) tokens "
        "from the workers' /metrics; drift = kvgate hit verification's share of predicted cached tokens that the engine "
        "did not reuse (last 64 requests); lag = how far simulated schedulers fell behind their clock (mean per "
        "forward step over all workers, and the worst single step).",
        f"- Lag: {'runs beyond tolerance: ' + '; '.join(lagged) if lagged else 'no run lagged beyond tolerance (results are not CPU-bound)'}.",
        "",
        format_table(rows, markdown=True),
        *(["", f"Medians over {len(rows) // len(summary)} interleaved repetitions of every router:", "",
            format_table(summary, markdown=True)] if summary is not rows else []),
        "",
        "Targets" + (", on the medians:" if summary is not rows else ":"),
        "",
        *targets(summary),
        "",
        f"![TTFT CDF](results/{PLOTS[0]})",
        f"![hit rate over time](results/{PLOTS[1]})",
        *(["", notes.strip()] if notes.strip() else []),
        END,
    ]
    return "\n".join(lines)


def update_results(bench_dir: Path, meta: dict, rows: list[dict], out: Path, notes: str = "") -> list[Path]:
    results_dir = bench_dir / "results"
    results_dir.mkdir(exist_ok=True)
    written = []
    for name in PLOTS:
        shutil.copyfile(out / name, results_dir / name)
        written.append(results_dir / name)
    md = bench_dir / "RESULTS.md"
    text = md.read_text() if md.exists() else "# Benchmark results\n"
    new = section(meta, rows, notes)
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        text = head + new + tail
    else:
        text = text.rstrip("\n") + "\n\n" + new + "\n"
    md.write_text(text)
    written.append(md)
    return written
