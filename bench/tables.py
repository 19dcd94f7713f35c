"""Reporting shared by the benchmarks: the machine and versions a run had, and its tables."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

from bench.host import cpu_name
from tests.support import ROOT


def machine() -> str:
    model = cpu_name()
    try:
        mem_kb = next(int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines()
                      if ln.startswith("MemTotal"))
        mem = f"{mem_kb / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        mem = "? RAM"
    return f"{model}, {os.cpu_count()} CPUs (nproc), {mem}, {platform.platform()}"


def versions() -> str:
    parts = [f"python {platform.python_version()}"]
    for dist in ("aiohttp", "uvloop", "msgspec", "prometheus-client", "starlette", "uvicorn", "httptools",
                 "sglang-router"):
        try:
            parts.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{dist} (missing)")
    wrk = subprocess.run(["wrk", "--version"], capture_output=True, text=True)
    parts.append((wrk.stdout or wrk.stderr).split(" [")[0].strip() or "wrk ?")
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "gateway"],
                           capture_output=True, text=True).stdout.strip()
    parts.append(f"kvgate {rev.stdout.strip() or '(not a git checkout)'}{'+dirty' if dirty else ''}")
    return ", ".join(parts)


def markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(lines)


def plain(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows)


def write_results(section: str, path: Path, name: str, script: str = "bench/overhead.py") -> None:
    """Replace this run's marked section (by ``--section``) and leave the rest of the file alone."""
    text = path.read_text() if path.exists() else "# kvgate benchmark results\n"
    tag = script + ("" if name == "main" else f":{name}")
    begin, end = f"<!-- {tag}:begin -->", f"<!-- {tag}:end -->"
    block = f"{begin}\n{section.strip()}\n{end}"
    if begin in text and end in text:
        head, _, rest = text.partition(begin)
        _, _, tail = rest.partition(end)
        text = head + block + tail
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)
