"""``cost``: route to the worker with the lowest predicted time to first token.

Cache hits and load are both priced in seconds: each worker's predicted TTFT (its queued
prefill and KV-memory wait, this request's prefill after its cached tokens, tier loads and
decode steps), plus ``work_weight`` times the prefill a miss adds to the fleet, scaled by
how busy the fleet is. The model, its defaults and the measurements behind each piece are
in docs/cost-model.md.

Three parts: the ledger (``policies.cost_ledger``: bookings, KV release schedules, learned
rates), the pricer (``policies.cost_pricer``: backlogs, the one prefill formula, the work
weight, hit prices) and this policy (``Cost``: the index, its KV-event feed and hit
verification, the choice, late binding with ``Hold``, and the hooks that keep the ledger).
A request's session key credits its last worker where the index knows less
(``policies.affinity``), before anything is priced.
``temperature`` > 0 samples with softmax over -score instead of taking the minimum.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from index.build import PreciseOptions, RadixOptions, make_radix, precise_index
from index.kv_feed import KvEventFeed
from index.prefix import IndexMatch
from index.tree_budget import TreeBudget
from policies.affinity import AffinityOptions, forgetting, make_affinity
from policies.base import Choice, Hold, Outcome, Policy, RequestView, WorkerView, opt, require_workers
from policies.cost_ledger import Ledger
from policies.cost_pricer import Backlogs, Cost3, Pricer
from policies.hit_verification import VerifierOptions, make_verifier
from policies.prefix_demand import PrefixDemand
from wire.options import optional, whole

_NO_MATCH = IndexMatch()  # read only: what a degraded verifier lets the pricer see
log = logging.getLogger("kvgate.policies.cost")


def _clock() -> float:
    return time.monotonic()  # looked up here at each call, so a test's clock replaces it


def _weight_or_auto(value: Any) -> float | str:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("auto", "")):
        return "auto"
    weight = float(value)
    if not weight >= 0.0:
        raise ValueError("expected a number >= 0 or 'auto'")
    return weight


def _engine_load(value: Any) -> str:
    return "off" if value is False else str(value)  # YAML reads a bare off as false


@dataclass
class CostOptions(RadixOptions, PreciseOptions, VerifierOptions, AffinityOptions):
    """``cost``'s model (docs/cost-model.md) and the indexes it matches on."""

    prefill_tokens_per_s: float = opt(25_000.0, "prefill speed the model starts from (learned, see learn_prefill)")
    host_load_tokens_per_s: float = opt(190_000.0, "tokens/s loaded from host memory (HiCache L2)")
    pool_load_tokens_per_s: float = opt(40_000.0, "tokens/s loaded from the shared Mooncake pool (L3)")
    decode_cost_s: float = opt(0.0002, "seconds each running request adds to a prefill")
    attention_tokens: float = opt(32_768.0, "context at which attention costs as much as the matmuls (0: ignore)")
    work_weight: float | str = opt("auto", "how many times a miss's prefill is charged; auto: rho / (1 - rho) of the "
                                   "fleet's busy share (the requests queued behind it), up to its value at "
                                   "full_weight_busy", parse=_weight_or_auto)
    temperature: float = opt(0.0, "seconds; > 0 samples with softmax over -ttft instead of the minimum")
    seed: int | None = opt(None, "random seed for temperature sampling", parse=optional(whole))
    index: Any = opt("auto", "auto (precise where token ids and KV events exist, else approximate), precise, approx",
                     choices=("auto", "precise", "approx"), parse=lambda value: value)
    engine_load: str = opt("drain", "engine-reported queues: drain (discounted by work since the poll), max, off",
                           choices=("drain", "max", "off"), parse=_engine_load)
    memory: bool = opt(True, "price the wait for KV pool memory")
    tpot_s: float = opt(0.03, "seconds per output token until a worker's is measured")
    hold_wait_s: float = opt(0.1, "hold a request at the gateway while every worker's wait exceeds this (0: never)")
    hold_patience: float = opt(3.0, "stop holding after this many times the still-predicted wait")
    load_aware: bool = opt(True, "follow how busy the fleet is (false: always the full weight)")
    weight_by: str = opt("fleet", "whose busy share the weight follows: the fleet's, or each worker's own",
                         choices=("fleet", "worker"))
    load_window_s: float = opt(1.0, "window the fleet's busy share is averaged over")
    demand_window_s: float = opt(1.0, "a copy of a held prefix shares its work charge with the requests for that "
                                 "prefix within this window (0: never shared)")
    full_weight_busy: float = opt(0.75, "busy share from which the weight stops growing")
    learn_prefill: bool = opt(True, "learn the prefill speed from streamed first tokens that timed a prefill alone")



class Cost(Policy):
    name = "cost"
    needs_engine_load = True
    Options = CostOptions

    def __init__(self, **options) -> None:
        super().__init__(**options)
        o = self.opts
        self.learn_prefill = o.learn_prefill
        self.temperature = o.temperature
        self.hold_wait_s = o.hold_wait_s
        self.hold_patience = o.hold_patience
        self.holds = 0  # decisions answered with Hold
        self.holds_expired = 0  # commits still predicted to wait past hold_wait_s: held hold_patience x that long
        self.diverted = 0  # commits that passed over a worker holding more of the prompt
        self.diverted_tokens = 0.0  # the cached tokens those commits gave up
        self.shared_charges = 0  # commits whose work charge recent requests for their prefix shared
        self._rng = random.Random(o.seed)
        self.feed: KvEventFeed | None = None
        self.budget: TreeBudget | None = None  # set when the policy built its own tree
        index = o.index
        if index in ("precise", "auto"):
            self.index, self.feed, self.budget = precise_index(o, self.name, quiet=index == "auto")
        elif index == "approx":
            self.index, self.budget = make_radix(o)
        else:
            self.index = index
        self.verifier = make_verifier(self.name, o)
        self.affinity = make_affinity(o)
        self.ledger = Ledger(o.prefill_tokens_per_s, o.tpot_s, _clock)
        self.pricer = Pricer(self.ledger, host_tps=o.host_load_tokens_per_s, pool_tps=o.pool_load_tokens_per_s,
                             decode_cost_s=o.decode_cost_s, attention_tokens=o.attention_tokens,
                             work_weight=o.work_weight, load_aware=o.load_aware, load_window_s=o.load_window_s,
                             full_weight_busy=o.full_weight_busy, engine_load=o.engine_load, memory=o.memory,
                             per_worker=o.weight_by == "worker")
        self.demand = PrefixDemand(o.demand_window_s)

    @property
    def prefill_tps(self) -> float:
        """The prefill speed the model prices with now (configured, then learned)."""
        return self.ledger.prefill_tps

    # -- the decision -------------------------------------------------------------------
    def match(self, request: RequestView, workers: Sequence[WorkerView]) -> IndexMatch:
        """What the index knows of these workers right now, with the request's key's last
        worker credited where the index knows less (``policies.affinity``); nothing while
        hit verification has degraded routing to load alone."""
        match = self.index.match(request, workers) if self.index.usable(request) else IndexMatch()
        if self.verifier.degraded:
            return _NO_MATCH
        if request.session_key and self.affinity is not None:
            return self.affinity.credit(request, workers, match, forgetting(self.index, request))
        return match

    def backlogs(self, request: RequestView, workers: Sequence[WorkerView], match: IndexMatch | None = None,
                 exact: bool = True) -> Backlogs:
        """The pricer's view of ``workers`` for this request, now (``match``: the index's)."""
        if match is None:
            match = self.match(request, workers)
        elif self.verifier.degraded:
            match = _NO_MATCH
        now = time.monotonic()
        key = self.demand.key(request, match) if match.hits and self.demand.on else None  # off: no work
        b = self.pricer.backlogs(request, workers, match, now, exact, self.demand.count(key, now))
        b.prefix = key
        return b

    def price(self, request: RequestView, workers: Sequence[WorkerView],
              match: IndexMatch | None = None) -> tuple[list[Cost3], list[float]]:
        """Every worker's (ttft seconds, uncached tokens, cached tokens), in ``workers``
        order, and its score (the quantity ``select`` minimises)."""
        return self.pricer.price(self.backlogs(request, workers, match))

    def predicted_ttft(self, request: RequestView, workers: Sequence[WorkerView]) -> float | None:
        costs, _ = self.price(request, workers)
        return min(ttft for ttft, _, _ in costs) if costs else None

    def select(self, request: RequestView, workers: Sequence[WorkerView]) -> Choice | Hold:
        require_workers(workers)
        match = self.match(request, workers)
        if self.temperature > 0 and len(workers) > 1:
            return self._select_scored(request, workers, self.backlogs(request, workers, match))
        b = self.backlogs(request, workers, match, exact=self.pricer.weights.per_worker)
        found = self.pricer.cheapest(b)
        if found is None:  # a hit priced above a miss (a slow pool): no shortcut
            return self._select_scored(request, workers, self.backlogs(request, workers, match))
        i, cost = found
        return self.decide(request, workers[i], cost, b)

    def _select_scored(self, request: RequestView, workers: Sequence[WorkerView], b: Backlogs) -> Choice | Hold:
        """Score every worker: softmax sampling with a ``temperature``, else the first minimum."""
        costs, scores = self.pricer.price(b)
        best = min(scores)
        if self.temperature > 0 and len(workers) > 1:
            weights = [math.exp(-(sc - best) / self.temperature) for sc in scores]
            i = self._rng.choices(range(len(workers)), weights)[0]
        else:
            i = scores.index(best)  # first of equals
        return self.decide(request, workers[i], costs[i], b)

    def decide(self, request: RequestView, chosen: WorkerView, cost: Cost3, b: Backlogs) -> Choice | Hold:
        """``hold`` the request, else ``commit`` it to ``chosen``."""
        return self.hold(request, chosen, cost, b) or self.commit(request, chosen, cost, b)

    def hold(self, request: RequestView, chosen: WorkerView, cost: Cost3, b: Backlogs) -> Hold | None:
        """``Hold`` (late binding) while the best worker, ``chosen``, would keep the request
        waiting more than ``hold_wait_s`` and so would every other; None to commit.

        Held, it is decided again when a routed request reaches its first token or ends
        (those decided least recently first), so it goes wherever room frees first rather
        than where the prediction said room would be; and a long prompt that does not fit
        yet blocks no engine queue. A request held as long as it is still predicted to wait
        stops chasing and is committed, so a long prompt is not overtaken forever by short
        ones that fit sooner.

        Not while some worker could start it at once: a held request books nothing, so a
        burst held for the one worker that holds its prefix would not see itself queue
        there, and would reach that worker one first token at a time while others idle."""
        if request.may_hold and self.hold_wait_s > 0:
            delay = self.pricer.delay(b, chosen.url, cost)
            if delay > self.hold_wait_s and min(b.bases) > self.hold_wait_s:
                if request.held_s < self.hold_patience * delay:
                    self.holds += 1
                    return Hold(retry_s=min(max(delay - self.hold_wait_s, 0.05), 1.0), reason=f"wait {delay:.2f}s")
                self.holds_expired += 1
        return None

    def commit(self, request: RequestView, chosen: WorkerView, cost: Cost3, b: Backlogs) -> Choice:
        """Book the choice: speculative index entries, expected hit, queued prefill work; and
        count it as ``diverted`` when another worker holds more of the prompt (the hit given
        up for a shorter wait: the one number that says what balance costs in hits)."""
        ttft, uncached, cached = cost
        if b.hits:
            if b.most > cached:
                self.diverted += 1
                self.diverted_tokens += b.most - cached
                if log.isEnabledFor(logging.DEBUG):
                    self._log_diverted(request, chosen, cost, b)
        self.index.record(request, chosen)
        if b.prefix is not None:
            if b.shared:
                self.shared_charges += 1
            self.demand.add(b.prefix, b.now)
        self.ledger.chose(request.request_id, chosen.url, self.pricer.prefill(uncached, cached), uncached)
        prompt = request.prompt_tokens_estimate
        self.verifier.expect(request.request_id, cached / prompt if prompt else 0.0, round(cached))
        reason = "degraded" if self.verifier.degraded else "ttft"
        return Choice(chosen, round(cached), f"{reason} {ttft * 1000:.1f}ms")

    def _log_diverted(self, request: RequestView, chosen: WorkerView, cost: Cost3, b: Backlogs) -> None:
        """Debug: the hit given up, and what its deepest holder was predicted to cost."""
        url, (_, tiers, (wait, decode, kv, capacity)) = max(b.hits.items(), key=lambda h: sum(h[1][1]))
        _, (held_ttft, _, held) = self.pricer.hit(url, tiers, b, wait, decode, kv, capacity)
        log.debug("diverted %s: %s predicted TTFT %.3fs with %.0f cached tokens; holder %s %.3fs with %.0f; "
                  "work weight %.2f, held %.2fs", request.request_id, chosen.url, cost[0], cost[2], url, held_ttft,
                  held, b.weight, request.held_s)

    # -- bookkeeping (the ledger's; a PD prefill worker's KV leaves at its first token) ----
    def on_routed(self, request: RequestView, worker: WorkerView) -> None:
        self._book(request, worker, times_prefill=self.learn_prefill and worker.role == "unified")

    def _book(self, request: RequestView, worker: WorkerView, times_prefill: bool) -> None:
        prefill = worker.role == "prefill"
        self.ledger.routed(request, worker, self.pricer.prefill(float(request.prompt_tokens_estimate), 0.0),
                           keeps_output=not prefill, times_prefill=times_prefill)
        if self.affinity is not None:
            self.affinity.routed(request, worker, forgetting(self.index))

    def on_peer_routed(self, request: RequestView, worker: WorkerView, cached_tokens: int | None) -> None:
        """A peer's choice, recorded as ``commit`` records one, and booked. It times no
        prefill here (its record came over the bus, late by a varying lag), and, as any
        booking does, it spoils this gateway's pending sample on that worker: the peer may
        have sent it before ours reached the engine, so our first token may time its prefill too."""
        if cached_tokens is not None:
            self.index.record(request, worker)
            prompt = float(request.prompt_tokens_estimate)
            cached = min(float(cached_tokens), prompt)
            uncached = prompt - cached
            self.ledger.chose(request.request_id, worker.url, self.pricer.prefill(uncached, cached), uncached)
        self._book(request, worker, times_prefill=False)

    def on_withdrawn(self, request: RequestView, worker: WorkerView) -> None:
        self.index.retract(request, worker)
        self.ledger.withdrawn(request.request_id)

    def on_first_token(self, request: RequestView, worker: WorkerView) -> None:
        self.ledger.first_token(request.request_id, releases_kv=worker.role == "prefill")

    def on_complete(self, request: RequestView, worker: WorkerView, outcome: Outcome) -> None:
        self.ledger.completed(request.request_id, outcome)
        self.verifier.complete(request.request_id, outcome)
        if self.affinity is not None:
            self.affinity.completed(request, worker, outcome)
        if self.budget is not None:
            self.budget.learn(request, outcome)

    def on_worker_added(self, worker: WorkerView) -> None:
        if self.feed is not None:
            self.feed.add(worker)
        if self.budget is not None:
            self.budget.worker_changed(worker)

    def on_worker_updated(self, worker: WorkerView) -> None:
        if self.feed is not None:
            self.feed.update(worker)
        if self.budget is not None:
            self.budget.worker_changed(worker)

    def on_worker_removed(self, worker: WorkerView) -> None:
        if self.feed is not None:
            self.feed.remove(worker.url)
        if self.budget is not None:
            self.budget.worker_removed(worker.url)
        self.index.remove_worker(worker.url)
        self.ledger.worker_removed(worker.url)
        if self.affinity is not None:
            self.affinity.worker_removed(worker.url)

    async def start(self) -> None:
        if self.feed is not None:
            await self.feed.start()

    async def stop(self) -> None:
        if self.feed is not None:
            await self.feed.stop()

    def stats(self) -> Mapping[str, float]:
        out = dict(self.index.stats())
        out.update(self.verifier.stats())
        if self.budget is not None:
            out.update(self.budget.stats())
        out.update(self.ledger.stats())
        out["holds"] = float(self.holds)
        out["holds_expired"] = float(self.holds_expired)
        out["work_weight"] = self.pricer.weights.last
        out["busy_share"] = self.pricer.weights.busy_share
        out["diverted"] = float(self.diverted)
        out["diverted_tokens"] = self.diverted_tokens
        out["shared_charges"] = float(self.shared_charges)
        if self.feed is not None:
            out.update(self.feed.stats())
        if self.affinity is not None:
            out.update(self.affinity.stats())
        return out
