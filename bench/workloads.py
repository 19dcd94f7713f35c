"""Seeded workloads for ``bench.suite``: each a different shape routing must handle.

Every generator is a plain function ``(size, load, fleet, seed) -> list[TraceRecord]``
returning Mooncake-format records (``bench.trace.TraceRecord``: 512-token hash-id blocks,
millisecond timestamps), so ``bench.replay`` and ``bench.routing_quality`` replay them as
they replay the conversation trace. ``size`` is about how many requests; ``load`` is the
offered prefill load as a share of the fleet's prefill capacity at the capacity-bounded
oracle's hit rate (``bench.offered_load``): the arrival times are stretched or
compressed until the slice asks exactly that of the fleet, so a workload loads any fleet
alike. Block ids of different workloads never meet (each has its own id range).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from simulator.profiles import get_profile

from .burst_trace import bursts as burst_records
from .offered_load import offered_load
from .trace import BLOCK, DEFAULT_TRACE, TraceRecord, bounded_oracle_hit_rate, load_trace


@dataclass(frozen=True)
class Fleet:
    """The simulated fleet a workload is scaled to."""

    workers: int = 8
    profile: str = "llama3-8b-h100"

    @property
    def capacity_tokens(self) -> int:
        return self.workers * get_profile(self.profile).max_total_num_tokens


def offered(records: list[TraceRecord], fleet: Fleet) -> dict:
    """``offered_load`` of these records as they are (no arrival speedup), at the
    capacity-bounded oracle's hit rate, plus that rate."""
    bounded = bounded_oracle_hit_rate(records, fleet.capacity_tokens)
    return {**offered_load(records, fleet.profile, fleet.workers, 1.0, bounded), "bounded_oracle_hit_rate": bounded}


def fit_load(records: list[TraceRecord], load: float, fleet: Fleet) -> list[TraceRecord]:
    """The same records, arrival times scaled so that the prefill they ask for at the bounded
    oracle's hit rate is ``load`` x the fleet's capacity (the first arrival at 0)."""
    records = sorted(records, key=lambda r: r.timestamp)
    t0 = records[0].timestamp
    now = offered(records, fleet)["prefill_load_at_bounded_oracle"]
    k = now / load if load > 0 and now > 0 else 1.0
    return [TraceRecord(round((r.timestamp - t0) * k, 3), r.input_length, r.output_length, r.hash_ids)
            for r in records]


def _record(t_ms: float, blocks: list[int], tail_tokens: int, output: int) -> TraceRecord:
    """A prompt of ``blocks`` whose last block holds ``tail_tokens`` (1..512) tokens."""
    return TraceRecord(t_ms, (len(blocks) - 1) * BLOCK + tail_tokens, output, list(blocks))


class _Ids:
    """Fresh block ids from a workload's own range."""

    def __init__(self, base: int) -> None:
        self._next = itertools.count(base)

    def take(self, n: int) -> list[int]:
        return [next(self._next) for _ in range(n)]


def _poisson(rng: random.Random, rate_per_s: float = 1.0) -> Iterator[float]:
    """Poisson arrival times in milliseconds, without end."""
    t = 0.0
    while True:
        t += rng.expovariate(rate_per_s)
        yield t * 1000.0


# ---- the workloads ----------------------------------------------------------------------------
def chat(size: int, load: float, fleet: Fleet, seed: int = 0, trace: Path | None = None) -> list[TraceRecord]:
    """The Mooncake conversation trace: its first ``size`` requests (``seed`` unused: the
    trace is the trace). Load 0.67 is routing_quality's default arrival speedup (x3)."""
    return fit_load(load_trace(trace or DEFAULT_TRACE, size), load, fleet)


def agents(size: int, load: float, fleet: Fleet, seed: int = 0) -> list[TraceRecord]:
    """Agent sessions: one of 3 agent kinds' long tool/system prefix (8k tokens), a task,
    then 4-10 turns, each appending a tool result (1-4k tokens: files, pages, command
    output) and asking for a short action (32-128 tokens); seconds of tool time between turns, sessions
    overlapping. The whole history is reused turn to turn: a router that moves a session
    re-prefills it, one that piles every session of a kind on one worker queues them."""
    rng = random.Random(seed)
    ids = _Ids(10_000_000)
    prefixes = [ids.take(16) for _ in range(3)]
    out: list[TraceRecord] = []
    starts = _poisson(rng, 1.0)
    while len(out) < size:
        t = next(starts)
        blocks = prefixes[rng.randrange(3)] + ids.take(2)
        for _ in range(rng.randint(4, 10)):
            out.append(_record(t, blocks, rng.randint(64, BLOCK), rng.randint(32, 128)))
            blocks = blocks + ids.take(rng.randint(2, 8))
            t += rng.uniform(1000, 4000)
            if len(out) >= size:
                break
    return fit_load(out, load, fleet)


def rag(size: int, load: float, fleet: Fleet, seed: int = 0) -> list[TraceRecord]:
    """Retrieval-augmented questions: a shared instruction block, one of 6 documents
    (4-8k tokens, picked by Zipf popularity), then passages retrieved for this question
    (1-3k tokens, never seen before) and the question (50-500 tokens). The document is the
    prefix others share: it decides where the hit is, and the popular ones are more than
    one worker's share of the load."""
    rng = random.Random(seed)
    ids = _Ids(20_000_000)
    system = ids.take(1)
    docs = [ids.take(rng.randint(8, 16)) for _ in range(6)]
    weights = [1.0 / (k + 1) for k in range(len(docs))]
    out = []
    for t in itertools.islice(_poisson(rng), size):
        doc = docs[rng.choices(range(len(docs)), weights)[0]]
        out.append(_record(t, system + doc + ids.take(rng.randint(3, 7)), rng.randint(50, 500),
                           rng.randint(64, 256)))
    return fit_load(out, load, fleet)


def burst(size: int, load: float, fleet: Fleet, seed: int = 0) -> list[TraceRecord]:
    """``bench.burst_trace``: bursts of 16 requests within 50 ms sharing one of 4 system
    prompts (4k tokens) plus 2k tokens each, at a fleet otherwise idle (load ~0.3)."""
    records = [TraceRecord(r.timestamp, r.input_length, r.output_length, [60_000_000 + h for h in r.hash_ids])
               for r in burst_records(count=max(1, size // 16), seed=seed + 1)]  # this workload's own ids
    return fit_load(records, load, fleet)


def tenants(size: int, load: float, fleet: Fleet, seed: int = 0) -> list[TraceRecord]:
    """Four tenants with disjoint prefixes and rates 8:4:2:1: each its own system prompt
    (1-16 blocks) and multi-turn conversations (1-6 turns, 1-2.5k tokens added a turn).
    The busiest tenant alone would fill more than its share of the fleet; the quiet ones'
    prompts must not be evicted or queued behind it."""
    rng = random.Random(seed)
    ids = _Ids(30_000_000)
    systems = [ids.take(n) for n in (2, 16, 4, 1)]
    rates = [8.0, 4.0, 2.0, 1.0]
    out: list[TraceRecord] = []
    starts = _poisson(rng, sum(rates) / 3.5)
    while len(out) < size:
        t = next(starts)
        tenant = rng.choices(range(4), rates)[0]
        blocks = systems[tenant] + ids.take(rng.randint(1, 3))
        for _ in range(rng.randint(1, 6)):
            out.append(_record(t, blocks, rng.randint(64, BLOCK), rng.randint(64, 384)))
            blocks = blocks + ids.take(rng.randint(2, 5))
            t += rng.uniform(2000, 10000)
    return fit_load(sorted(out, key=lambda r: r.timestamp)[:size], load, fleet)


def long_context(size: int, load: float, fleet: Fleet, seed: int = 0) -> list[TraceRecord]:
    """Long documents (40-110k tokens) asked about a few times each over the following
    seconds, with short unrelated chats (1-3k tokens) between them: first reads are seconds
    of prefill and a document takes a quarter of a worker's KV pool, so where a document
    sits decides both the hit and who queues behind it."""
    rng = random.Random(seed)
    ids = _Ids(40_000_000)
    out: list[TraceRecord] = []
    starts = _poisson(rng, 0.5)
    while len(out) < size:
        t = next(starts)
        doc = ids.take(rng.randint(80, 215))
        for _ in range(rng.randint(1, 5)):
            out.append(_record(t, doc + ids.take(1), rng.randint(32, 400), rng.randint(64, 256)))
            t += rng.uniform(1000, 8000)
        for _ in range(rng.randint(2, 4)):
            out.append(_record(next(starts), ids.take(rng.randint(2, 6)), rng.randint(64, BLOCK),
                               rng.randint(64, 256)))
    return fit_load(sorted(out, key=lambda r: r.timestamp)[:size], load, fleet)


def overload(size: int, load: float, fleet: Fleet, seed: int = 0) -> list[TraceRecord]:
    """Unique prompts (2-16k tokens, log-uniform) after one shared 512-token block, offered
    past the fleet's capacity: nothing to win from the cache, everything from balance."""
    rng = random.Random(seed)
    ids = _Ids(50_000_000)
    system = ids.take(1)
    out = []
    for t in itertools.islice(_poisson(rng), size):
        n = round(2 ** rng.uniform(11, 14))
        out.append(_record(t, system + ids.take(max(1, -(-n // BLOCK))), rng.randint(1, BLOCK),
                           rng.randint(64, 256)))
    return fit_load(out, load, fleet)


@dataclass(frozen=True)
class Workload:
    name: str
    make: Callable[..., list[TraceRecord]]
    load: float  # default offered prefill load at the bounded oracle's hit rate
    size: int  # requests in a full run; --quick takes a third
    what: str


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("chat", chat, 0.67, 800, "Mooncake conversation trace"),
    Workload("agents", agents, 0.5, 720, "long shared tool prefix, many short turns a session"),
    Workload("rag", rag, 0.5, 720, "6 shared documents, fresh passages and questions"),
    Workload("burst", burst, 0.3, 384, "bursts on a shared system prompt at an idle fleet"),
    Workload("tenants", tenants, 0.5, 720, "4 tenants, disjoint prefixes, rates 8:4:2:1"),
    Workload("long", long_context, 0.6, 240, "40-110k-token documents re-asked, short chats between"),
    Workload("overload", overload, 1.3, 720, "unique prompts at 1.3x the fleet's prefill capacity"),
)}
