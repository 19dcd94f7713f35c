"""The load a workload offers the simulated fleet, and the TTFTs no router can beat.

Priced with the simulator's own cost model (``simulator.cost_model``), one request at a
time: the prefill GPU-seconds per second as a share of the fleet, with no cache and at a
given hit rate, and the TTFT floors (an idle GPU and no cache; one first-come-first-served
queue over every GPU and no cache) that the suite's targets are read against.
"""

from __future__ import annotations

import heapq

from simulator.cost_model import CostModel
from simulator.profiles import get_profile

from .trace import TraceRecord


def offered_load(records: list[TraceRecord], profile: str, workers: int, arrival_speedup: float,
                 hit_rate: float) -> dict:
    """Prefill GPU-seconds the slice asks for per simulated second, as a share of the fleet.

    Priced by the simulator's own cost model one request at a time (no batching gains), with
    no cache and with ``hit_rate`` of every prompt cached.
    """
    cm = CostModel(get_profile(profile))
    span = (records[-1].timestamp - records[0].timestamp) / 1000.0 / arrival_speedup
    cold_s = [cm.prefill_time(r.input_length) for r in records]
    floor = sorted(cold_s)
    cold = sum(floor)
    queued = queue_floor([r.timestamp / 1000.0 / arrival_speedup for r in records], cold_s, workers)
    warm = sum(cm.prefill_time(round(r.input_length * (1 - hit_rate)), round(r.input_length * hit_rate))
               for r in records)
    return {"span_s": span, "req_per_s": len(records) / span if span else 0.0,
            "prefill_load_no_cache": cold / (span * workers) if span else 0.0,
            "prefill_load_at_bounded_oracle": warm / (span * workers) if span else 0.0,
            # TTFT with an idle GPU and no cache: what no router can beat (long prompts)
            "ttft_floor_mean_s": cold / len(records), "ttft_floor_p50_s": floor[len(floor) // 2],
            "ttft_floor_p99_s": floor[int(0.99 * (len(floor) - 1))],
            # ... and with the fleet's queues: one queue over every GPU, in arrival order, no cache
            "ttft_queue_floor_mean_s": sum(queued) / len(queued), "ttft_queue_floor_p99_s": queued[int(0.99 * (len(queued) - 1))]}


def queue_floor(arrivals_s: list[float], prefill_s: list[float], workers: int) -> list[float]:
    """Sorted TTFTs of requests served first come first served from one queue by ``workers``
    GPUs that never idle while a request waits: the least any router that keeps arrival
    order and has no cache can reach once the load leaves the GPUs no idle time."""
    free = [0.0] * workers
    out = []
    for t, s in sorted(zip(arrivals_s, prefill_s), key=lambda ts: ts[0]):
        start = max(heapq.heappop(free), t)
        heapq.heappush(free, start + s)
        out.append(start + s - t)
    return sorted(out)
