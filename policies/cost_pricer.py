"""``cost``'s pricer: seconds to first token per worker, from the ledger and an index match.

    ttft(w) = max(queued prefill work on w, wait for KV memory on w)
            + prefill(uncached tokens after the cached ones) / prefill speed
            + host-tier tokens / host load speed + pool tokens / pool load speed
            + running requests on w * decode_cost_s

and the choice minimises ``ttft + weight * prefill(uncached) / prefill speed``, the work
weight following how busy the fleet is (``policies.work_weight``). The model, its defaults and
the measurements behind them: docs/cost-model.md.

``Pricer.backlogs`` prices what every worker costs with no hit (``Backlogs``); from it,
``Pricer.price`` is every worker's (ttft, uncached, cached) and score, and
``Pricer.cheapest`` the fast path ``select`` takes (the cheapest miss by ``min``, then
only the hit holders priced). Both spell each float operation the same way, so they
choose alike. The pricer holds constants and the work weight; everything else it
reads from the ledger (bookings through ``FleetBacklog`` rows, KV release schedules, the
learned prefill speed).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from itertools import chain

from index.prefix import NO_HIT, IndexMatch, Tiers
from policies.base import RequestView, WorkerView
from policies.cost_ledger import Ledger
from policies.fleet_backlog import FleetBacklog, Pricing
from policies.work_weight import WorkWeight

_INF = float("inf")

Cost3 = tuple[float, float, float]  # (ttft seconds, uncached tokens, cached tokens)


def prefill_tokens(uncached: float, cached: float, inv_attention: float, scale: float = 1.0) -> float:
    """Prefill work of ``uncached`` tokens after ``cached`` ones, in tokens at the linear rate,
    times ``scale`` (1, or seconds per token times a weight: multiplied first, as every
    caller's floats always were). Attention's FLOPs per token grow with the context while
    the matmuls' do not; ``inv_attention`` is 1 / the context at which they are equal."""
    return scale * uncached * (1.0 + (cached + uncached / 2.0) * inv_attention)


@dataclass(slots=True)
class Backlogs:
    """One request's view of the fleet before hit credits (``Pricer.backlogs``)."""

    prompt: float  # prompt tokens
    full: float  # seconds to prefill all of them
    output: float  # output tokens expected (KV they will hold)
    now: float
    bases: list[float]  # per worker, in order: wait + decode cost with no hit
    weight: float  # the work weight this decision charges (``WorkWeight``)
    hits: dict[str, tuple[int, Tiers, tuple[float, float, float, float]]]  # url -> (position, tiers,
    # (queue wait, decode cost, KV held, KV capacity or 0 when memory is off)): the workers
    # to price with a hit, which with a prompt in the shared pool are those holding more
    # than ``everyone`` and the few others that could be the cheapest (see ``backlogs``)
    most: float  # the most of the prompt one of ``hits`` holds (what ``diverted`` counts from)
    everyone: Tiers = NO_HIT  # what any worker reuses (the pool's leading pages, a prefix all hold)
    rows: tuple[list[str], list[float], list[float], list[float], list[float]] | None = None
    # (urls, waits, decode, KV, capacity) of every worker, to price ``everyone`` anywhere
    busy: int = 0  # workers with prefill or a KV wait queued (what the weight follows)
    weights: list[float] | None = None  # per worker, in order, with weight_by=worker
    prefix: Hashable | None = None  # the deepest held prefix's key (``PrefixDemand``)
    shared: bool = False  # whether the weight was shared with recent requests for it

    def tiers(self, url: str) -> Tiers:
        hit = self.hits.get(url)
        return self.everyone if hit is None else hit[1]


class Pricer:
    """Constants, the work weight and the backlog rows; prices from the ledger."""

    def __init__(self, ledger: Ledger, *, host_tps: float, pool_tps: float, decode_cost_s: float,
                 attention_tokens: float, work_weight: float | str, load_aware: bool, load_window_s: float,
                 full_weight_busy: float, engine_load: str, memory: bool, per_worker: bool = False) -> None:
        self.ledger = ledger
        self.host_tps, self.pool_tps, self.decode_cost_s = host_tps, pool_tps, decode_cost_s
        self.inv_attention = 1.0 / attention_tokens if attention_tokens > 0 else 0.0
        self.weights = WorkWeight(work_weight, load_aware, load_window_s, full_weight_busy, per_worker)
        self.rows = FleetBacklog(Pricing(ledger.inv_prefill, decode_cost_s, engine_load, memory), ledger.book,
                                 lambda: ledger.avg_uncached)
        ledger.touched, ledger.repriced = self.rows.touch, self.rate_changed

    def rate_changed(self) -> None:
        """The ledger learned a new prefill speed: every row is repriced."""
        self.rows.pricing.inv_prefill = self.ledger.inv_prefill
        self.rows.reprice()

    def prefill(self, uncached: float, cached: float) -> float:
        """``prefill_tokens`` with this model's attention."""
        return prefill_tokens(uncached, cached, self.inv_attention)

    # -- the backlogs -------------------------------------------------------------------
    def backlogs(self, request: RequestView, workers: Sequence[WorkerView], match: IndexMatch, now: float,
                 exact: bool = True, demand: float = 0.0) -> Backlogs:
        """Every worker's cost with no hit, and where the hits are. Split so ``cheapest`` can
        take the cheapest miss with ``min`` and price only the few workers that hold part of
        the prompt. The rows come from ``FleetBacklog`` (kept across decisions); this prices
        what moves with the clock and with this request's size: queues still draining, and
        the KV wait where the request does not fit.

        The KV wait is the costly part (a walk of the worker's release schedule), and on a
        saturated fleet every worker has one. A worker's queue wait bounds its cost from
        below, so with ``exact`` false (the fast path, which needs only the cheapest) a
        worker whose queue alone costs more than the cheapest found so far keeps that bound
        as its base and is not priced further, nor is one whose first booked request ends
        after that cheapest (``memory_first``): ``min(bases)`` and its place stay what
        pricing everyone gives, the other bases may be low. Only workers with a queue wait
        are skipped, so ``busy`` (which counts KV waits on idle queues) stays exact.

        ``demand``: the other recent requests for the deepest held prefix
        (``policies.prefix_demand``); the work weight is shared with them, 1 / (1 + demand)."""
        ledger = self.ledger
        prompt = float(request.prompt_tokens_estimate)
        output = ledger.expected_output(request.max_tokens)
        need = prompt + output
        fleet = self.rows.fleet(workers, now)
        bases, waits, decode, busy = fleet.base.copy(), fleet.wait, fleet.decode, fleet.busy
        draining = fleet.draining
        if draining:  # queues still draining with the clock (``FleetBacklog``)
            waits, done = waits.copy(), fleet.done
            for i in draining:
                waits[i] = wait = done[i] - now
                bases[i] = wait + decode[i]
            busy += len(draining)
        hit_at: dict[str, tuple[int, Tiers, tuple[float, float, float, float]]] = {}
        most = 0.0  # the most of the prompt any of them holds
        kvs, caps = fleet.kv, fleet.cap
        everyone = NO_HIT
        if match.hits or match.everyone.total:
            scale = 1.0
            if match.unit != "tokens":
                scale = prompt / match.query_len if match.query_len else 0.0
            pos = fleet.pos
            for url, t in match.hits.items():
                i = pos.get(url)
                if i is not None:
                    if scale != 1.0:
                        t = Tiers(*(x * scale for x in t))
                    hit_at[url] = (i, t, (waits[i], decode[i], kvs[i], caps[i]))
                    held = t[0] + t[1] + t[2]
                    if held > most:
                        most = held
            everyone = match.everyone if scale == 1.0 else Tiers(*(x * scale for x in match.everyone))
        tight = fleet.tight(need)
        short = [i for _, i in tight if kvs[i] + need > caps[i]] if tight else tight  # where it does not fit
        queued = None
        if short and not exact:
            queued = {i for i in short if waits[i] > 0.0}
            if queued:
                short = [i for i in short if i not in queued]
        memory_wait = ledger.memory_wait
        for i in short:  # the KV wait, where this request does not fit
            wait = waits[i]
            over = memory_wait(fleet.urls[i], kvs[i] + need - caps[i], now, wait)
            if over > wait:
                if not wait > 0.0:
                    busy += 1
                bases[i] = over + decode[i]
        if queued:
            # Cheapest base first, where a worker in ``queued`` stands at its queue wait, a
            # lower bound: priced when it could still be the cheapest, and from the first
            # that cannot, none can. Before its schedule is walked, the time its first
            # booked request ends (a tighter bound, two reads) may already rule it out.
            cheapest = _INF
            for i in sorted(range(len(bases)), key=bases.__getitem__):
                bound = bases[i]
                if bound > cheapest:
                    break
                if i in queued:
                    url, wait = fleet.urls[i], waits[i]
                    first = ledger.memory_first(url, now, wait) + decode[i]
                    if first > cheapest:  # no KV frees there before the cheapest: a bound will do
                        bases[i] = first
                        continue
                    over = memory_wait(url, kvs[i] + need - caps[i], now, wait)
                    if over > wait:
                        bases[i] = over + decode[i]
                if bases[i] < cheapest:
                    cheapest = bases[i]
        rows = None
        if everyone.total:
            # Every worker can load the pool's pages. One holding no more costs its base plus
            # the same for all, except where its KV is short (``tight``), so only the least
            # backlog and those are priced here, beside the workers holding more. Unless
            # ``exact``, a tight worker whose queue alone costs more than the least backlog
            # with its KV wait is left out: with the same pages loaded it costs more still.
            urls = fleet.urls
            rows = (urls, waits, decode, kvs, caps)
            least = bases.index(min(bases))
            bound = _INF if exact or urls[least] in hit_at else bases[least]
            for i in chain((least,), [i for _, i in tight if not waits[i] + decode[i] > bound]):
                if urls[i] not in hit_at:
                    hit_at[urls[i]] = (i, everyone, (waits[i], decode[i], kvs[i], caps[i]))
                    if everyone.total > most:
                        most = everyone.total
        full = self.prefill(prompt, 0.0) * ledger.inv_prefill
        weight, weights = self.weights.decide(busy, fleet.urls, bases, decode, now)
        if demand > 0.0:
            share = 1.0 / (1.0 + demand)
            weight *= share
            if weights is not None:
                weights = [w * share for w in weights]
        return Backlogs(prompt, full, output, now, bases, weight, hit_at, min(most, prompt), everyone, rows, busy,
                        weights, shared=demand > 0.0)

    def hit(self, url: str, tiers: Tiers, b: Backlogs, wait: float, decode: float, kv: float,
            capacity: float) -> tuple[float, Cost3]:
        """(score, (ttft, uncached, cached)) of a worker holding ``tiers`` of the prompt, in
        one pass, since the fast path runs it for every worker holding part of the prompt
        (all of them when it is in the shared pool)."""
        gpu, host, pool = tiers
        prompt = b.prompt
        cached = gpu + host + pool
        if cached > prompt:
            cached = prompt
        uncached = prompt - cached
        if capacity and kv + uncached + b.output > capacity:
            over = self.ledger.memory_wait(url, kv + uncached + b.output - capacity, b.now, wait)
            if over > wait:
                wait = over
        own = prefill_tokens(uncached, cached, self.inv_attention) / self.ledger.prefill_tps
        ttft = wait + decode + own
        if host:
            ttft += host / self.host_tps
        if pool:
            ttft += pool / self.pool_tps
        return ttft + b.weight * own, (ttft, uncached, cached)

    def price(self, b: Backlogs) -> tuple[list[Cost3], list[float]]:
        """Every worker's (ttft, uncached, cached), in order, and its score: the TTFT plus
        ``b.weight`` times the prefill work a miss adds to the fleet (what the choice
        minimises)."""
        hit = self.hit
        if b.rows is None:
            costs = [(base + b.full, b.prompt, 0.0) for base in b.bases]
        else:  # every worker can load the pool's pages
            pool = b.everyone
            costs = [hit(url, pool, b, *state)[1] for url, *state in zip(*b.rows)]
        for url, (i, tiers, state) in b.hits.items():
            costs[i] = hit(url, tiers, b, *state)[1]
        if b.weights is not None:
            inv_tps, inv_attention = 1.0 / self.ledger.prefill_tps, self.inv_attention
            return costs, [ttft + prefill_tokens(uncached, cached, inv_attention, w * inv_tps)
                           for (ttft, uncached, cached), w in zip(costs, b.weights)]
        if not b.weight:
            return costs, [ttft for ttft, _, _ in costs]
        k, inv_attention = b.weight / self.ledger.prefill_tps, self.inv_attention
        if b.rows is not None:
            return costs, [ttft + prefill_tokens(uncached, cached, inv_attention, k)
                           for ttft, uncached, cached in costs]
        # Every miss adds the same work: computed once (a call per worker cost as much as
        # the whole prediction with 64 workers), then the hits one by one.
        miss = prefill_tokens(b.prompt, 0.0, inv_attention, k)
        scores = [ttft + miss for ttft, _, _ in costs]
        for i, _, _ in b.hits.values():
            ttft, uncached, cached = costs[i]
            scores[i] = ttft + prefill_tokens(uncached, cached, inv_attention, k)
        return costs, scores

    def cheapest(self, b: Backlogs) -> tuple[int, Cost3] | None:
        """``price``'s first minimum without pricing every worker: every miss adds the same
        prefill, so the cheapest miss is the least backlog, and only the workers holding
        part of the prompt are priced one by one. None where a hit on the least backlog is
        priced above its miss (a slow pool): no shortcut, ``price`` them all. With a weight per
        worker, the cheapest miss is the least base plus each one's weighted work (the bases
        must be ``exact``), and a prompt in the pool gets no shortcut."""
        bases, prompt, weights = b.bases, b.prompt, b.weights
        if weights is None:
            i = bases.index(min(bases))
            cost = (bases[i] + b.full, prompt, 0.0)
            score = cost[0]  # ``price``'s score, the same operations, the same float
            if b.weight:
                score += prefill_tokens(prompt, 0.0, self.inv_attention, b.weight / self.ledger.prefill_tps)
        elif b.rows is not None:  # pool pages anyone can load: the least backlog may not stand for the rest
            return None
        else:  # each worker's weight on the same miss (exact bases): ``price``'s floats, inlined
            inv_tps, full = 1.0 / self.ledger.prefill_tps, b.full
            f = 1.0 + (0.0 + prompt / 2.0) * self.inv_attention
            misses = [base + full + w * inv_tps * prompt * f for base, w in zip(bases, weights)]
            score = min(misses)
            i = misses.index(score)
            cost = (bases[i] + full, prompt, 0.0)
        miss = best = (score, i)
        hit = self.hit
        for url, (j, tiers, state) in b.hits.items():
            score, priced = hit(url, tiers, b, *state)
            if weights is not None:
                ttft, uncached, cached = priced
                score = ttft + prefill_tokens(uncached, cached, self.inv_attention, weights[j] * inv_tps)
            score = (score, j)
            if j == i:
                if score > miss:
                    return None
                if score <= best:  # the same worker: its hit stands for its miss
                    best, cost = score, priced
            elif score < best:
                best, cost = score, priced
        return best[1], cost

    def delay(self, b: Backlogs, url: str, cost: Cost3) -> float:
        """The part of a predicted TTFT spent not working on this request: its queue and KV
        wait (and the decode steps it shares), i.e. the TTFT less its own prefill and loads."""
        ttft, uncached, cached = cost
        own = self.prefill(uncached, cached) / self.ledger.prefill_tps
        if cached:
            _, host, pool = b.tiers(url)
            own += host / self.host_tps + pool / self.pool_tps
        return ttft - own
