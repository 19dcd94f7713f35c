"""Write a replay's per-request CSV/JSON, its summary, and PNG plots."""

from __future__ import annotations

import csv
from dataclasses import asdict, fields
from pathlib import Path

import msgspec

from .replay import ReplayResult, RequestResult


def write_outputs(result: ReplayResult, summary: dict, out_dir: str | Path, plots: bool = True) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "requests.csv", out / "requests.json", out / "summary.json"]
    with open(paths[0], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([fl.name for fl in fields(RequestResult)])
        for r in result.rows:
            w.writerow([getattr(r, fl.name) for fl in fields(RequestResult)])
    paths[1].write_bytes(msgspec.json.encode([asdict(r) for r in result.rows]))
    if result.loads:
        lp = out / "loads.csv"
        with open(lp, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["t_s", "url", "running", "waiting", "token_usage"])
            for x in result.loads:
                w.writerow([x.t_s, x.url, x.running, x.waiting, x.token_usage])
        paths.append(lp)
    paths[2].write_bytes(msgspec.json.format(msgspec.json.encode({"summary": summary, "meta": result.meta}), indent=2))
    if plots:
        paths += plot(result, out)
    return paths


def plot(result: ReplayResult, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f = result.time_scale
    ok = sorted((r for r in result.rows if r.ok), key=lambda r: r.sent_s)
    written: list[Path] = []

    def figure(name: str, xlabel: str, ylabel: str, draw, legend: bool = False) -> None:
        """One PNG: ``draw(ax)`` plots, the axes, grid and file handling are shared."""
        fig, ax = plt.subplots(figsize=(6, 4))
        draw(ax)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if legend:
            ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written.append(out / name)

    ttft = sorted(r.ttft_s * f * 1000 for r in ok if r.ttft_s is not None)
    if ttft:
        def cdf(ax) -> None:
            ax.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))])
            ax.set_xscale("log")

        figure("ttft_cdf.png", "TTFT (ms, simulated)" if f != 1 else "TTFT (ms)", "CDF", cdf)
    if ok:
        window = max(1, len(ok) // 50)
        xs, ys = [], []
        for i in range(0, len(ok), window):
            chunk = ok[i:i + window]
            prompt = sum(r.prompt_tokens for r in chunk)
            xs.append(chunk[-1].sent_s * f)
            ys.append(sum(r.cached_tokens for r in chunk) / prompt if prompt else 0.0)

        def hits(ax) -> None:
            ax.plot(xs, ys, marker=".")
            ax.set_ylim(0, 1)

        figure("hit_rate.png", "time (s)", f"hit rate (window of {window} requests)", hits)
    if result.loads:
        def loads(ax) -> None:
            for u in sorted({x.url for x in result.loads}):
                pts = [x for x in result.loads if x.url == u]
                ax.plot([x.t_s * f for x in pts], [x.running + x.waiting for x in pts], label=u)

        figure("worker_load.png", "time (s)", "running + waiting requests", loads, legend=True)
    workers = sorted({r.worker for r in ok if r.worker})
    if workers:
        def routed(ax) -> None:
            for w in workers:
                ts = [r.sent_s * f for r in ok if r.worker == w]
                ax.plot(ts, range(1, len(ts) + 1), label=w)

        figure("worker_requests.png", "time (s)", "requests routed (cumulative)", routed, legend=True)
    return written
