"""The fleet a ``bench.joint`` cell runs on, and what its workers report after the run:
tier hits, KV traffic in the model's bytes, lag, busy time, the prefill-side TTFT."""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from dataclasses import dataclass

from .services import http_get


@dataclass(frozen=True)
class Topology:
    name: str
    prefill: int = 0
    decode: int = 0
    unified: int = 0

    @property
    def pd(self) -> bool:
        return self.prefill > 0


@dataclass
class ExternalFleet:
    """Engines started elsewhere (real SGLang, ``docs/joint-matrix.md``): cells run only the
    routers on them, each after a ``/flush_cache`` and counted as after-minus-before; the
    tier and transfer figures only the simulator reports stay empty."""

    urls: list[str]
    prefill: list[tuple[str, int]]
    decode: list[str]

    @property
    def all_urls(self) -> list[str]:
        return [u for u, _ in self.prefill] + self.decode + self.urls

    @property
    def topology(self) -> Topology:
        if self.prefill:
            return Topology(f"{len(self.prefill)}P+{len(self.decode)}D", len(self.prefill), len(self.decode))
        return Topology(f"{len(self.urls)}U", unified=len(self.urls))

    def __enter__(self) -> "ExternalFleet":
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def external_fleet(a: argparse.Namespace) -> ExternalFleet | None:
    if not (a.worker_url or a.prefill_url or a.decode_url):
        return None
    if bool(a.prefill_url) != bool(a.decode_url) or (a.worker_url and a.prefill_url):
        raise SystemExit("give --worker-url (unified) or --prefill-url and --decode-url (PD), not a mix")
    return ExternalFleet(list(a.worker_url), [(u, int(port)) for u, port in a.prefill_url], list(a.decode_url))


def http_post(url: str) -> int | None:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=10) as r:
            return r.status
    except (urllib.error.HTTPError, OSError):
        return None




def worker_totals(urls: list[str], kv_bytes: int) -> dict:
    """Tier hits, KV traffic (model bytes) and lag, summed over the fleet's /server_info."""
    t = {"prompt": 0, "device": 0, "host": 0, "storage": 0, "pd_bytes": 0, "pd_loopback_bytes": 0, "pd_sim_s": 0.0,
         "pd_queue_sim_s": 0.0, "pool_bytes": 0, "pool_load_sim_s": 0.0, "pool_query_wall_s": 0.0,
         "pool_fetch_wall_s": 0.0, "pool_queries": 0, "lag_s": 0.0, "busy": {}}
    for u in urls:
        status, body = http_get(u + "/server_info")
        if status != 200:
            continue
        info = json.loads(body)
        sim = info.get("simulator") or {}
        for k in ("prompt", "device", "host", "storage"):
            if info.get("disaggregation_mode") != "decode":  # decode recomputes nothing, caches nothing
                t[k] += (sim.get("cached_by_tier") or {}).get(k, 0)
        role = {"null": "unified"}.get(info.get("disaggregation_mode"), info.get("disaggregation_mode"))
        t["busy"].setdefault(role, []).append(sim.get("busy_sim_s") or 0.0)
        pd = sim.get("pd_transfer") or {}
        if info.get("disaggregation_mode") == "prefill":
            t["pd_bytes"] += pd.get("model_bytes", 0)
            t["pd_loopback_bytes"] += pd.get("loopback_bytes", 0)
            t["pd_sim_s"] += pd.get("sim_s", 0.0)
            t["pd_queue_sim_s"] += pd.get("queue_sim_s", 0.0)
        pool = sim.get("pool") or {}
        t["pool_bytes"] += int(pool.get("fetched_pages", 0)) * info.get("page_size", 64) * kv_bytes
        for k in ("load_sim_s", "query_wall_s", "fetch_wall_s", "queries"):
            t["pool_" + k] += pool.get(k, 0)
        t["lag_s"] = max(t["lag_s"], sim.get("max_lag_sim_s") or 0.0, pd.get("max_lag_sim_s") or 0.0,
                         pool.get("max_lag_sim_s") or 0.0)
    return t


def ttft_sums(urls: list[str]) -> tuple[float, float]:
    """(sum, count) of the TTFT the workers themselves measured (a prefill's: arrival to the
    end of its forward), wall seconds."""
    total = count = 0.0
    for u in urls:
        status, body = http_get(u + "/metrics")
        if status != 200:
            continue
        for line in body.decode().splitlines():
            if line.startswith("sglang:time_to_first_token_seconds_sum"):
                total += float(line.rsplit(" ", 1)[1])
            elif line.startswith("sglang:time_to_first_token_seconds_count"):
                count += float(line.rsplit(" ", 1)[1])
    return total, count


def since(after: dict, before: dict | None) -> dict:
    """Counters of a run on engines that outlive it (external ones): after minus before."""
    if before is None:
        return after
    out = dict(after)
    for k, v in after.items():
        if k == "busy":
            out[k] = {r: [x - y for x, y in zip(b, before[k].get(r, [0.0] * len(b)))] for r, b in v.items()}
        elif k != "lag_s":
            out[k] = v - before[k]
    return out
