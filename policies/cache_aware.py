"""``cache_aware``: sglang-router's rule, on a shared prefix index, minus its known pitfalls.

The rule (sglang-router 0.3.2 ``cache_aware``, same defaults): if the fleet is imbalanced
(``max - min > balance_abs_threshold`` and ``max > min * balance_rel_threshold``, load =
requests in flight) route to the least loaded worker; otherwise, if the best prefix match
covers more than ``cache_threshold`` of the request, route to the matching worker; else to
a worker with room (least loaded, then smallest tree). Every decision is inserted into the
index for the chosen worker.

What differs, and why:

* the key is the whole prompt the gateway built (the full chat history through the same
  chat template as the engine), so turn N+1 of a conversation matches turn N's worker;
* when several workers share the matched prefix (within ``tie_ratio``), the least loaded of
  them wins instead of whichever the tree reports, so a hot shared prefix fans out over the
  workers that hold it rather than piling onto one;
* a miss goes to the least loaded worker (smallest tree breaks ties) instead of the
  smallest tree regardless of load;
* one memory budget for the whole index (``max_tree_size``, see ``index.radix``);
* hit verification (``policies.hit_verification``) turns cache routing off while the
  engine's reported cache hits contradict the index;
* a request with a client key (``prompt_cache_key``, ``X-Session-ID``, ``user``) credits
  the key's last worker with what it probably still holds where the index knows less
  (``policies.affinity``); the balance thresholds still decide before any prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Mapping, Sequence

from dataclasses import dataclass

from index.build import RadixOptions, make_radix
from index.tree_budget import TreeBudget
from index.prefix import IndexMatch, PrefixIndex
from index.views import SameUrls
from policies.affinity import AffinityOptions, forgetting, make_affinity
from policies.base import Choice, Outcome, Policy, RequestView, WorkerView, opt, require_workers
from policies.hit_verification import VerifierOptions, make_verifier

log = logging.getLogger("kvgate.policies")


def in_flight(workers: Sequence[WorkerView]) -> list[int]:
    # (a comprehension: ~25% faster than map(attrgetter) over slotted views, 3.5 vs 4.5 us at 64)
    return [w.in_flight for w in workers]


def engine_queue(workers: Sequence[WorkerView]) -> list[int]:
    return [max(w.in_flight, w.load.running + w.load.waiting) if w.load else w.in_flight for w in workers]


LOADS = {"in_flight": in_flight, "engine": engine_queue}


@dataclass
class CacheAwareOptions(RadixOptions, VerifierOptions, AffinityOptions):
    cache_threshold: float = opt(0.3, "route to the prefix holder when the best match covers more than this share")
    balance_abs_threshold: float = opt(64.0, "imbalanced when max - min load exceeds this ...")
    balance_rel_threshold: float = opt(1.5, "... and max exceeds this times min: then least loaded wins")
    tie_ratio: float = opt(0.9, "workers matching at least this share of the best match count as sharers")
    load: str = opt("in_flight", "load measure: in_flight (booked by the gateway) or engine (with the engine's queue)",
                    choices=tuple(LOADS))
    host_credit: float = opt(0.9, "a host-memory hit counts this much of a GPU hit")
    pool_credit: float = opt(0.6, "a shared-pool hit counts this much of a GPU hit")
    eviction_interval_s: float = opt(60.0, "how often the age-based eviction timer runs")


class CacheAware(Policy):
    name = "cache_aware"
    Options = CacheAwareOptions

    def __init__(self, index: PrefixIndex | None = None, **options) -> None:
        super().__init__(**options)
        o = self.opts
        self.cache_threshold = o.cache_threshold
        self.balance_abs_threshold = o.balance_abs_threshold
        self.balance_rel_threshold = o.balance_rel_threshold
        self.tie_ratio = o.tie_ratio
        self.host_credit = o.host_credit
        self.pool_credit = o.pool_credit
        self.eviction_interval_s = o.eviction_interval_s
        self._loads = LOADS[o.load]
        if isinstance(index, str):
            raise ValueError("cache_aware keeps its own approximate index; the precise one is policy kv_events")
        self.budget: TreeBudget | None = None  # set when the policy built its own tree
        if index is None:
            index, self.budget = self.build_index()
        self.index: PrefixIndex = index
        self.verifier = make_verifier(self.name, o)
        self.affinity = make_affinity(o)
        self.decisions: Counter[str] = Counter()
        self._timer: asyncio.Task | None = None
        self._positions_of: tuple[SameUrls, dict[str, int]] = (SameUrls(), {})

    def build_index(self) -> tuple[PrefixIndex, TreeBudget | None]:
        """The index this policy matches on, from its options (``self.opts``)."""
        return make_radix(self.opts)

    # -- decision -----------------------------------------------------------------------
    def _positions(self, workers: Sequence[WorkerView]) -> dict[str, int]:
        """url -> place in ``workers`` (the first, if listed twice), kept while the list
        names the same urls in the same order (``SameUrls``)."""
        same = self._positions_of[0]
        if same.changed(workers):
            self._positions_of = (same, {url: i for i, url in reversed(list(enumerate(same.urls)))})
        return self._positions_of[1]

    def _least_loaded(self, workers: Sequence[WorkerView], loads: list[int], lo: int) -> WorkerView:
        tied = [w for w, load in zip(workers, loads) if load == lo]
        if len(tied) == 1:
            return tied[0]
        return min(tied, key=lambda w: self.index.worker_size(w.url))

    def decide(self, request: RequestView, workers: Sequence[WorkerView], match: IndexMatch) -> tuple[WorkerView, str]:
        loads = self._loads(workers)
        lo, hi = min(loads), max(loads)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            return self._least_loaded(workers, loads, lo), "imbalanced"
        if self.verifier.degraded:
            return self._least_loaded(workers, loads, lo), "degraded"
        query_len = match.query_len
        if query_len:
            hc, pc = self.host_credit, self.pool_credit
            gpu, host, pool = match.everyone
            shared = gpu + hc * host + pc * pool
            scores = [(gpu + hc * host + pc * pool, url) for url, (gpu, host, pool) in match.hits.items()]
            best = max(max(scores)[0], shared) if scores else shared
            if best and best / query_len > self.cache_threshold:
                floor = best * self.tie_ratio
                at = self._positions(workers).get
                found = [(loads[i], -score, i) for score, url in scores
                         if score >= floor and (i := at(url)) is not None]
                if shared >= floor:  # every worker qualifies: the first least loaded stands for the rest
                    found.append((lo, -shared, loads.index(lo)))
                if found:
                    return workers[min(found)[2]], "prefix"
        return self._least_loaded(workers, loads, lo), "miss"

    def select(self, request: RequestView, workers: Sequence[WorkerView]) -> Choice:
        require_workers(workers)
        match = self.index.match(request, workers) if self.index.usable(request) else IndexMatch()
        if request.session_key and self.affinity is not None:
            match = self.affinity.credit(request, workers, match, forgetting(self.index, request))
        chosen, reason = self.decide(request, workers, match)
        self.decisions[reason] += 1
        self.index.record(request, chosen)
        fraction = match.fraction(chosen.url)
        predicted = round(fraction * request.prompt_tokens_estimate)
        self.verifier.expect(request.request_id, fraction, predicted)
        return Choice(chosen, predicted, reason)

    # -- hooks --------------------------------------------------------------------------
    def on_routed(self, request: RequestView, worker: WorkerView) -> None:
        if self.affinity is not None:
            self.affinity.routed(request, worker, forgetting(self.index))

    def on_withdrawn(self, request: RequestView, worker: WorkerView) -> None:
        self.index.retract(request, worker)

    def on_peer_routed(self, request: RequestView, worker: WorkerView, cached_tokens: int | None) -> None:
        self.index.record(request, worker)
        self.on_routed(request, worker)

    def on_complete(self, request: RequestView, worker: WorkerView, outcome: Outcome) -> None:
        self.verifier.complete(request.request_id, outcome)
        if self.affinity is not None:
            self.affinity.completed(request, worker, outcome)
        if self.budget is not None:
            self.budget.learn(request, outcome)

    def on_worker_added(self, worker: WorkerView) -> None:
        if self.budget is not None:
            self.budget.worker_changed(worker)

    def on_worker_updated(self, worker: WorkerView) -> None:
        if self.budget is not None:
            self.budget.worker_changed(worker)

    def on_worker_removed(self, worker: WorkerView) -> None:
        self.index.remove_worker(worker.url)
        if self.budget is not None:
            self.budget.worker_removed(worker.url)
        if self.affinity is not None:
            self.affinity.worker_removed(worker.url)

    async def _maintain(self) -> None:
        while True:
            await asyncio.sleep(self.eviction_interval_s)
            try:
                self.index.maintain()
            except Exception:  # a bug here must not stop every later eviction
                log.exception("%s: index maintenance failed", self.name)

    async def start(self) -> None:
        if self._timer is None and self.eviction_interval_s > 0:
            self._timer = asyncio.get_running_loop().create_task(self._maintain())

    async def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer
            self._timer = None

    def stats(self) -> Mapping[str, float]:
        out = dict(self.index.stats())
        out.update(self.verifier.stats())
        if self.budget is not None:
            out.update(self.budget.stats())
        if self.affinity is not None:
            out.update(self.affinity.stats())
        for reason in ("prefix", "miss", "imbalanced", "degraded"):
            out[f"decisions_{reason}_total"] = float(self.decisions[reason])
        return out
