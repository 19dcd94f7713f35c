"""``cost``: route to the worker with the lowest predicted time to first token.

Thresholds like cache_aware's trade cache hits against load with magic numbers; this
policy prices both in seconds instead:

    ttft(w) = max(queued prefill work on w, wait for KV memory on w)
            + prefill(this request's uncached tokens after its cached ones)
            + tokens loaded from host memory / host load speed
            + tokens loaded from the shared pool / pool load speed
            + running requests on w * decode_cost_s

    prefill(n after c) = n / prefill speed * (1 + (c + n / 2) / attention_tokens)

The second factor is attention: its FLOPs per token grow with the context while the
matmuls' do not, and ``attention_tokens`` is the context at which they are equal (2 *
params / (4 * layers * q_dim): ~30k for Llama-3-8B, ~54k for 70B). Without it a 100k-token
prompt looks 2.5x cheaper than it is, and short requests queue behind it.

The KV wait: an engine admits a request only when its KV fits in the pool, and under a
burst of long prompts the pool, not prefill compute, is what requests queue for (measured
on the Mooncake trace: bench/RESULTS.md). Every routed request books ``prompt +
max_tokens / 2`` tokens on its worker until it completes; when a new request does not fit
(capacity from ``/v1/loads`` or ``server_info``), the wait is the time until enough booked
requests are expected to finish, ``max_tokens`` after their first token at the worker's
measured time per output token (``tpot_s`` until measured), for the share of ``max_tokens``
that completed requests actually generated (EOS usually comes first; stat ``output_share``).
``memory=false`` turns it off.
``engine_load``: the engines' own waiting counts (``/v1/loads``), each at the average
prefill per request when the report came, stand in for traffic this gateway did not route;
``drain`` (default) discounts them by the work done since the poll, ``max`` takes them as
they are, ``off`` ignores them. Each worker's backlog is kept across decisions
(``policies.fleet_backlog``) and recomputed when its bookings or report change.

Queued prefill work is booked when a request is routed (``on_routed``), moves to the
decode count at its first token and is freed at completion, so a burst of requests sees
the work its predecessors just queued. The engine works through that queue while it waits,
so the booked wait drains with the clock at the prefill rate, and each first token re-times
what is left from that moment (first come, first served). Counted in full until the first
token instead, a worker 8 s into a 100k-token prompt still read as 13 s away, and
conversations left their warm worker for a wait that was nearly over (bench/RESULTS.md).
A hit in a slower tier is worth ``1 - prefill_speed / load_speed`` of a GPU hit, which is where the tier credits come from.
``index``: ``auto`` (default) matches on the precise KV-event index where the request has
token ids and the workers publish KV events, else on the approximate text tree, which
learns from the decisions it makes (``index.fallback``); ``precise`` is the same
but warns when it has to fall back; ``approx`` is the approximate tree alone (no ZMQ
subscriptions).

Defaults are an 8B BF16 model on one H100: ~25k prefill tokens/s, 128 KiB of KV per token,
so ~190k tokens/s over 25 GB/s PCIe from host memory and ~40k tokens/s from a Mooncake pool
at ~5 GB/s (host hit worth ~0.87 of a GPU hit, pool hit ~0.38); each running request adds
~0.2 ms. Only the ratios matter, so set them from the fleet's own numbers. The prefill rate
is also measured (``learn_prefill``, on by default): a request routed to a worker where
nothing else of this gateway's is in prefill, with no engine-reported queue and its KV
fitting, times its own prefill at its first token (streamed requests only: a response that
is not streamed arrives after its decode), and the configured rate is scaled by
the running average of measured / predicted (stats ``prefill_tokens_per_s``,
``prefill_samples``). The configured figure is then only the starting point.

The choice minimises ``ttft + work_weight * prefill(uncached)``: a miss is charged for the
prefill it adds to the fleet (the wait of whoever queues behind it), not only for its own
wait, so a warm worker keeps a conversation unless its queue really costs more. Greedy
own-TTFT (``work_weight=0``) gave up hits the fleet then paid for (bench/RESULTS.md,
"Routing quality"). The default, 12, charges that work twelve times: under load, prefill
saved is fleet capacity, and a prefix duplicated on a second worker takes KV pool room that
evicts someone else's. On the Mooncake trace, raising it from 2 to 12 raised the hit rate
steadily (0.82 to 0.92 of the capacity-bounded oracle, pooled medians) while mean and p99
TTFT stayed within the run-to-run noise. That weight is for a loaded fleet, so it follows
load (``load_aware``, see ``Cost.weight``): full from ``full_weight_busy`` (3/4) of the
workers with prefill queued over the last ``load_window_s`` (1 s), less along
rho / (1 - rho) below. Blind to load, a burst sharing one prefix queued on its warm worker
until that queue was worth ~13 prefills of the prefix while other workers sat idle; now it
spreads over them. Stat ``work_weight``: the weight the last decision charged.
Stats ``diverted`` and ``diverted_tokens`` count the decisions that still sent a request
away from the worker holding more of its prompt, and the cached tokens so given up: on
the Mooncake trace, mostly follow-ups whose warm worker was seconds deep in a long
prompt's prefill.

``temperature`` (seconds) > 0 samples with softmax over -ttft instead of taking the
minimum, which spreads near-equal choices and keeps the index from tunnelling.

Late binding (``Hold``, see ``policies.base``): while the best worker's predicted wait (the
TTFT less the request's own prefill and loads) and every other worker's exceed
``hold_wait_s`` (0.1 s; 0 turns it off), the request stays at the gateway and is decided
again at the next first token or completion, until it has been held ``hold_patience`` (3)
times its still-predicted wait. On the Mooncake trace it cut mean TTFT by ~10% against
committing at once (bench/RESULTS.md, "Routing quality"): under a burst the predicted KV
waits are where the error is, and a held request goes wherever room actually frees first.
"""

from __future__ import annotations

import math
import random
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain

from dataclasses import dataclass
from typing import Any

from index.build import PreciseOptions, RadixOptions, make_radix, precise_index
from index.kv_feed import KvEventFeed
from index.prefix import NO_HIT, IndexMatch, PrefixIndex, Tiers
from index.tree_budget import TreeBudget
from policies.base import Choice, Hold, Outcome, Policy, RequestView, WorkerView, opt, require_workers
from policies.fleet_backlog import Booked, FleetBacklog, Pricing
from policies.hit_verification import VerifierOptions, make_verifier
from policies.kv_release import KvReleases
from wire.options import optional, whole

# Share of ``max_new_tokens`` a request's KV is booked at: the engine reserves part of it at
# admission and fills it as it decodes (SGLang's new_token_ratio starts at 0.7, decays).
_OUTPUT_SHARE = 0.5
_INF = float("inf")
_exp = math.exp


def _engine_load(value: Any) -> str:
    return "off" if value is False else str(value)  # YAML reads a bare off as false


@dataclass
class CostOptions(RadixOptions, PreciseOptions, VerifierOptions):
    """``cost``'s model (see the module docstring) and the indexes it matches on."""

    prefill_tokens_per_s: float = opt(25_000.0, "prefill speed the model starts from (learned, see learn_prefill)")
    host_load_tokens_per_s: float = opt(190_000.0, "tokens/s loaded from host memory (HiCache L2)")
    pool_load_tokens_per_s: float = opt(40_000.0, "tokens/s loaded from the shared Mooncake pool (L3)")
    decode_cost_s: float = opt(0.0002, "seconds each running request adds to a prefill")
    attention_tokens: float = opt(32_768.0, "context at which attention costs as much as the matmuls (0: ignore)")
    work_weight: float = opt(12.0, "how many times a miss's prefill is charged on a loaded fleet")
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
    load_aware: bool = opt(True, "scale work_weight by how busy the fleet is")
    load_window_s: float = opt(1.0, "window the fleet's busy share is averaged over")
    full_weight_busy: float = opt(0.75, "busy share from which work_weight applies in full")
    learn_prefill: bool = opt(True, "learn the prefill speed from streamed first tokens that timed a prefill alone")


@dataclass(slots=True)
class _Live:
    """A request between routing and completion, as this policy booked it."""

    url: str
    tokens: float  # prefill work still queued (linear-token equivalents); 0 after the first token
    footprint: float  # KV tokens it holds on the engine
    output: float  # output tokens expected: max_tokens x the share requests have been using
    max_tokens: float
    first_token_at: float | None = None
    routed_at: float = 0.0
    alone: float = 0.0  # its prefill work in seconds at the base rate when it started at once (a speed sample), else 0


@dataclass(slots=True)
class _Backlogs:
    """One request's view of the fleet before hit credits (see ``Cost._backlogs``)."""

    prompt: float  # prompt tokens
    full: float  # seconds to prefill all of them
    output: float  # output tokens expected (KV they will hold)
    now: float
    bases: list[float]  # per worker, in order: wait + decode cost with no hit
    weight: float  # the work weight this decision charges (``Cost.weight``)
    hits: dict[str, tuple[int, Tiers, tuple[float, float, float, float]]]  # url -> (position, tiers,
    # (queue wait, decode cost, KV held, KV capacity or 0 when memory is off)): the workers
    # to price with a hit, which with a prompt in the shared pool are those holding more
    # than ``everyone`` and the few others that could be the cheapest (see ``_backlogs``)
    most: float  # the most of the prompt one of ``hits`` holds (what ``diverted`` counts from)
    everyone: Tiers = NO_HIT  # what any worker reuses (the pool's leading pages, a prefix all hold)
    rows: tuple[list[str], list[float], list[float], list[float], list[float]] | None = None
    # (urls, waits, decode, KV, capacity) of every worker, to price ``everyone`` anywhere

    def tiers(self, url: str) -> Tiers:
        hit = self.hits.get(url)
        return self.everyone if hit is None else hit[1]


class Cost(Policy):
    name = "cost"
    needs_engine_load = True
    Options = CostOptions

    def __init__(self, **options) -> None:
        super().__init__(**options)
        o = self.opts
        self.prefill_tps = o.prefill_tokens_per_s
        self._base_inv = 1.0 / self.prefill_tps  # the configured rate, which learning scales
        self.learn_prefill = o.learn_prefill
        self._log_scale = 0.0  # log(measured prefill time / configured), averaged over samples
        self.prefill_samples = 0
        self.host_tps = o.host_load_tokens_per_s
        self.pool_tps = o.pool_load_tokens_per_s
        self.decode_cost_s = o.decode_cost_s
        self.inv_attention = 1.0 / o.attention_tokens if o.attention_tokens > 0 else 0.0
        self.work_weight = o.work_weight
        self.load_aware = o.load_aware
        self.load_window_s = o.load_window_s
        full = min(max(o.full_weight_busy, 0.0), 0.99)
        self._full_odds = full / (1.0 - full)  # rho / (1 - rho) where the weight is full
        self.busy_share = 1.0  # the fleet's busy share, averaged (``weight``); the first decision sets it
        self._busy_at: float | None = None
        self.temperature = o.temperature
        self.engine_load = o.engine_load
        self.memory = o.memory
        self.default_tpot_s = o.tpot_s
        self.hold_wait_s = o.hold_wait_s
        self.hold_patience = o.hold_patience
        seed, index = o.seed, o.index
        self.holds = 0  # decisions answered with Hold
        self.last_weight = self.work_weight  # the work weight the last decision charged
        self.diverted = 0  # commits that passed over a worker holding more of the prompt
        self.diverted_tokens = 0.0  # the cached tokens those commits gave up
        self._rng = random.Random(seed)
        self.feed: KvEventFeed | None = None
        self.budget: TreeBudget | None = None  # set when the policy built its own tree
        if index in ("precise", "auto"):
            self.index, self.feed, self.budget = precise_index(o, self.name, quiet=index == "auto")
        elif index == "approx":
            self.index, self.budget = make_radix(o)
        else:
            self.index = index
        self.verifier = make_verifier(self.name, o)
        self._book: dict[str, Booked] = {}  # per worker: what this gateway sent it
        self._avg_uncached = 0.0
        self._inv_prefill = 1.0 / self.prefill_tps
        self._rows = FleetBacklog(Pricing(self._inv_prefill, self.decode_cost_s, self.engine_load, self.memory),
                                  self._book, lambda: self._avg_uncached)
        self._avg_max_new = 256.0
        self._out_ratio = 1.0  # completion tokens / max_tokens, learned from completions
        self._picked: OrderedDict[str, tuple[str, float]] = OrderedDict()  # select -> on_routed
        self._live: dict[str, _Live] = {}
        self._kv: dict[str, KvReleases] = {}  # worker -> its live requests (KV they hold)
        self._tpot: dict[str, float] = {}  # worker -> measured seconds per output token

    # -- the model ----------------------------------------------------------------------
    def prefill_tokens(self, uncached: float, cached: float) -> float:
        """Prefill work of ``uncached`` tokens after ``cached`` ones, in tokens at the linear rate."""
        return uncached * (1.0 + (cached + uncached / 2.0) * self.inv_attention)

    def predict(self, request: RequestView, workers: Sequence[WorkerView],
                match: IndexMatch) -> list[tuple[float, float, float]]:
        """(ttft seconds, uncached tokens, cached tokens) per worker, in ``workers`` order."""
        return self._predict(self._backlogs(request, workers, match))

    def _predict(self, b: _Backlogs) -> list[tuple[float, float, float]]:
        if b.rows is None:
            out = [(base + b.full, b.prompt, 0.0) for base in b.bases]
        else:  # every worker can load the pool's pages
            pool = b.everyone
            out = [self._hit_cost(url, pool, b, *state) for url, *state in zip(*b.rows)]
        for url, (i, tiers, state) in b.hits.items():
            out[i] = self._hit_cost(url, tiers, b, *state)
        return out

    def _backlogs(self, request: RequestView, workers: Sequence[WorkerView], match: IndexMatch,
                  exact: bool = True) -> _Backlogs:
        """Every worker's cost with no hit; where the hits are, for ``_hit_cost``. Split so
        ``select`` can take the cheapest miss with ``min`` and price only the few workers
        that hold part of the prompt. The rows come from ``FleetBacklog`` (kept across
        decisions); this prices what moves with the clock and with this request's size:
        queues still draining, and the KV wait where the request does not fit.

        The KV wait is the costly part (a walk of the worker's release schedule), and on a
        saturated fleet every worker has one. A worker's queue wait bounds its cost from
        below, so with ``exact`` false (``select``, which needs only the cheapest) a worker
        whose queue alone costs more than the cheapest found so far keeps that bound as its
        base and is not priced further, nor is one whose first booked request ends after
        that cheapest (``memory_first``): ``min(bases)`` and its place stay what pricing
        everyone gives, the other bases may be low. Only workers with a queue wait are
        skipped, so ``busy`` (which counts KV waits on idle queues) stays exact."""
        prompt = float(request.prompt_tokens_estimate)
        now = time.monotonic()
        output = _OUTPUT_SHARE * self._out_ratio * float(
            request.max_tokens if request.max_tokens is not None else self._avg_max_new)
        need = prompt + output
        fleet = self._rows.fleet(workers, now)
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
        if (match.hits or match.everyone.total) and not self.verifier.degraded:
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
        for i in short:  # the KV wait, where this request does not fit
            wait = waits[i]
            over = self.memory_wait(fleet.urls[i], kvs[i] + need - caps[i], now, wait)
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
                    first = self.memory_first(url, now, wait) + decode[i]
                    if first > cheapest:  # no KV frees there before the cheapest: a bound will do
                        bases[i] = first
                        continue
                    over = self.memory_wait(url, kvs[i] + need - caps[i], now, wait)
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
        full = self.prefill_tokens(prompt, 0.0) * self._inv_prefill
        self.last_weight = weight = self.weight(busy, len(bases), now)
        return _Backlogs(prompt, full, output, now, bases, weight, hit_at, min(most, prompt), everyone, rows)

    def weight(self, busy: int, workers: int, now: float) -> float:
        """The work weight when ``busy`` of ``workers`` have prefill (or a KV wait) queued:
        ``work_weight`` once the busy share rho, averaged over the last ``load_window_s``,
        reaches ``full_weight_busy`` (0.75), and below it less along rho / (1 - rho)
        (``load_aware`` false: always ``work_weight``).

        Work added to a queue delays the requests that arrive behind it before it drains,
        and in a single queue at utilisation rho that is rho / (1 - rho) of them on average.
        So with most of the fleet idle a miss costs nobody else, and a burst sharing one
        prefix spreads over the idle workers instead of queueing on its warm worker until
        that queue is worth ``work_weight`` prefills of the prefix (bench.burst_trace: mean
        TTFT 0.14 s instead of 0.72 s, as sglang-router's). On a loaded fleet the weight is
        ``work_weight``, which also stands for the KV room a duplicated prefix takes in a
        contended pool: the Mooncake trace keeps 8 of 8 workers busy at 87% of decisions,
        and following rho / (1 - rho) all the way up (no ``full_weight_busy``) cost it ~5% of
        its hits (0.116-0.119 vs 0.122-0.127, three pairs). Averaged, not each decision's own
        share: the instantaneous share lost hits too (0.112-0.124), and a burst arriving
        after a pause still sees the pause. The first decision takes the share as it finds
        it: starting from "busy" queued a cold start's first burst on one worker."""
        if not self.load_aware or not workers:
            return self.work_weight
        share = busy / workers
        if self._busy_at is None or self.load_window_s <= 0:  # nothing to average yet
            self.busy_share = share
        else:
            since = now - self._busy_at
            keep = _exp(-since / self.load_window_s) if since > 0.0 else 1.0
            self.busy_share = share + (self.busy_share - share) * keep
        self._busy_at = now
        rho = self.busy_share
        if rho >= 1.0 or not self._full_odds:
            return self.work_weight
        odds = rho / (1.0 - rho) / self._full_odds
        return self.work_weight * odds if odds < 1.0 else self.work_weight

    def _hit_cost(self, url: str, tiers: Tiers, b: _Backlogs, wait: float, decode: float, kv: float,
                  capacity: float) -> tuple[float, float, float]:
        """(ttft, uncached, cached) of a worker holding ``tiers`` of the prompt."""
        return self._hit_priced(url, tiers, b, wait, decode, kv, capacity)[1]

    def _hit_priced(self, url: str, tiers: Tiers, b: _Backlogs, wait: float, decode: float, kv: float,
                    capacity: float) -> tuple[float, tuple[float, float, float]]:
        """(score, cost): ``_hit_cost`` and its ``_score`` in one pass, since ``select`` runs
        it for every worker holding part of the prompt (all of them when it is in the
        shared pool)."""
        gpu, host, pool = tiers
        prompt = b.prompt
        cached = gpu + host + pool
        if cached > prompt:
            cached = prompt
        uncached = prompt - cached
        if capacity and kv + uncached + b.output > capacity:
            over = self.memory_wait(url, kv + uncached + b.output - capacity, b.now, wait)
            if over > wait:
                wait = over
        own = uncached * (1.0 + (cached + uncached / 2.0) * self.inv_attention) / self.prefill_tps
        ttft = wait + decode + own
        if host:
            ttft += host / self.host_tps
        if pool:
            ttft += pool / self.pool_tps
        return ttft + b.weight * own, (ttft, uncached, cached)

    def memory_wait(self, url: str, over: float, now: float, queue_wait: float) -> float:
        """Seconds until ``over`` more KV tokens are free on the worker than it has now.

        An engine admits a request only when its KV fits (SGLang's scheduler stops at the
        first waiting request that does not, so everything behind it waits too); under a
        burst the pool, not prefill compute, is what requests queue for. Each request booked
        there is expected to free its KV after its expected output (``max_tokens`` times the
        share of it that requests have been using: EOS usually comes first) after its first token
        (``queue_wait`` from now if it has none yet), at the worker's measured time per
        output token. Sorted once per change of those, not per question: ``KvReleases``.
        """
        releases = self._kv.get(url)
        if releases is None or not releases.lives:
            return 0.0
        return releases.wait(over, now, queue_wait, self._tpot.get(url, self.default_tpot_s))

    def memory_first(self, url: str, now: float, queue_wait: float) -> float:
        """A lower bound on ``memory_wait`` for any shortfall: until the worker's first booked
        request is expected to end (``KvReleases.first``)."""
        releases = self._kv.get(url)
        if releases is None or not releases.lives:
            return 0.0
        return releases.first(now, queue_wait, self._tpot.get(url, self.default_tpot_s))

    def _score(self, cost: tuple[float, float, float], weight: float) -> float:
        """What the choice minimises: the TTFT, plus (``weight``, see ``weight``) the prefill
        work a miss adds to the fleet."""
        return self.scores([cost], weight)[0]

    def scores(self, costs: Sequence[tuple[float, float, float]], weight: float) -> list[float]:
        """``_score`` over every worker in one comprehension (a method call per worker cost
        as much as the whole prediction with 64 workers)."""
        if not weight:
            return [ttft for ttft, _, _ in costs]
        k, inv_attention = weight / self.prefill_tps, self.inv_attention
        return [ttft + k * uncached * (1.0 + (cached + uncached / 2.0) * inv_attention)
                for ttft, uncached, cached in costs]

    def scored(self, request: RequestView, workers: Sequence[WorkerView],
               match: IndexMatch) -> tuple[list[tuple[float, float, float]], list[float]]:
        """``predict`` and each worker's score, the quantity ``select`` minimises."""
        return self._scored(self._backlogs(request, workers, match))

    def _scored(self, b: _Backlogs) -> tuple[list[tuple[float, float, float]], list[float]]:
        costs = self._predict(b)
        return costs, self.scores(costs, b.weight)

    def _match(self, request: RequestView, workers: Sequence[WorkerView]) -> IndexMatch:
        """What the index knows of these workers right now."""
        if self.feed is not None:
            self.feed.follow(workers)
        if self.budget is not None:
            self.budget.observe(workers)
        return self.index.match(request, workers) if self.index.usable(request) else IndexMatch()

    def costs(self, request: RequestView, workers: Sequence[WorkerView]) -> list[tuple[float, float, float]]:
        """``predict`` over what the index knows of these workers right now."""
        return self.predict(request, workers, self._match(request, workers))

    def select(self, request: RequestView, workers: Sequence[WorkerView]) -> Choice | Hold:
        require_workers(workers)
        match = self._match(request, workers)
        if self.temperature > 0 and len(workers) > 1:
            return self._select_scored(request, workers, self._backlogs(request, workers, match))
        b = self._backlogs(request, workers, match, exact=False)
        # Every miss adds the same prefill, so the cheapest miss is the least backlog and only
        # the workers holding part of the prompt need pricing one by one.
        bases, prompt = b.bases, b.prompt
        i = bases.index(min(bases))
        cost = (bases[i] + b.full, prompt, 0.0)
        score = cost[0]  # ``_score(cost, b.weight)`` spelled out: the same operations, the same float
        if b.weight:
            score += b.weight / self.prefill_tps * prompt * (1.0 + (0.0 + prompt / 2.0) * self.inv_attention)
        miss = best = (score, i)
        priced = self._hit_priced
        for url, (j, tiers, state) in b.hits.items():
            score, hit = priced(url, tiers, b, *state)
            score = (score, j)
            if j == i:
                if score > miss:  # a hit priced above a miss (a slow pool): no shortcut
                    return self._select_scored(request, workers, self._backlogs(request, workers, match))
                if score <= best:  # the same worker: its hit stands for its miss
                    best, cost = score, hit
            elif score < best:
                best, cost = score, hit
        return self._decide(request, workers[best[1]], cost, b)

    def _select_scored(self, request: RequestView, workers: Sequence[WorkerView], b: _Backlogs) -> Choice | Hold:
        """Score every worker: softmax sampling with a ``temperature``, else the first minimum."""
        costs, scores = self._scored(b)
        best = min(scores)
        if self.temperature > 0 and len(workers) > 1:
            weights = [math.exp(-(sc - best) / self.temperature) for sc in scores]
            i = self._rng.choices(range(len(workers)), weights)[0]
        else:
            i = scores.index(best)  # first of equals
        return self._decide(request, workers[i], costs[i], b)

    def delay(self, worker: WorkerView, cost: tuple[float, float, float], b: _Backlogs) -> float:
        """The part of a predicted TTFT spent not working on this request: its queue and KV
        wait (and the decode steps it shares), i.e. the TTFT less its own prefill and loads."""
        ttft, uncached, cached = cost
        own = self.prefill_tokens(uncached, cached) / self.prefill_tps
        if cached:
            _, host, pool = b.tiers(worker.url)
            own += host / self.host_tps + pool / self.pool_tps
        return ttft - own

    def _decide(self, request: RequestView, chosen: WorkerView, cost: tuple[float, float, float],
                b: _Backlogs) -> Choice | Hold:
        return self.hold(request, chosen, cost, b) or self.commit(request, chosen, cost, b)

    def hold(self, request: RequestView, chosen: WorkerView, cost: tuple[float, float, float],
             b: _Backlogs) -> Hold | None:
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
            delay = self.delay(chosen, cost, b)
            if (delay > self.hold_wait_s and request.held_s < self.hold_patience * delay
                    and min(b.bases) > self.hold_wait_s):
                self.holds += 1
                return Hold(retry_s=min(max(delay - self.hold_wait_s, 0.05), 1.0), reason=f"wait {delay:.2f}s")
        return None

    def commit(self, request: RequestView, chosen: WorkerView, cost: tuple[float, float, float],
               b: _Backlogs) -> Choice:
        """Book the choice: speculative index entries, expected hit, queued prefill work; and
        count it as ``diverted`` when another worker holds more of the prompt (the hit given
        up for a shorter wait: the one number that says what balance costs in hits)."""
        ttft, uncached, cached = cost
        if b.hits:
            if b.most > cached:
                self.diverted += 1
                self.diverted_tokens += b.most - cached
        self.index.record(request, chosen)
        self._picked[request.request_id] = (chosen.url, self.prefill_tokens(uncached, cached))
        if len(self._picked) > 100_000:
            self._picked.popitem(last=False)
        prompt = request.prompt_tokens_estimate
        self.verifier.expect(request.request_id, cached / prompt if prompt else 0.0, round(cached))
        reason = "degraded" if self.verifier.degraded else "ttft"
        return Choice(chosen, round(cached), f"{reason} {ttft * 1000:.1f}ms")

    # -- bookkeeping --------------------------------------------------------------------
    def on_routed(self, request: RequestView, worker: WorkerView) -> None:
        prompt = float(request.prompt_tokens_estimate)
        full = self.prefill_tokens(prompt, 0.0)
        url, tokens = self._picked.pop(request.request_id, (worker.url, full))
        if url != worker.url:  # the gateway sent it elsewhere (retry): book it there in full
            tokens = full
        book = self._booked(worker.url)
        book.queued += tokens
        now = time.monotonic()
        book.done = (book.done if book.done > now else now) + tokens * self._inv_prefill
        max_new = float(request.max_tokens if request.max_tokens is not None else self._avg_max_new)
        self._avg_max_new += 0.05 * (max_new - self._avg_max_new)
        output = 0.0 if worker.role == "prefill" else max_new * self._out_ratio  # PD prefill: KV leaves with the transfer
        live = _Live(worker.url, tokens, prompt + _OUTPUT_SHARE * output, output, max_new, None, now)
        if self.learn_prefill and request.stream and book.queued - tokens < 1.0 and worker.role == "unified":
            # Nothing else of ours in prefill there, no KV transfer in its first token, and
            # a first token that is one (a response not streamed arrives after its decode)
            live.alone = self._alone(worker, book, tokens, live.footprint)
        self._live[request.request_id] = live
        releases = self._kv.get(worker.url)
        if releases is None:
            releases = self._kv[worker.url] = KvReleases()
        releases.add(request.request_id, live)
        book.kv += live.footprint
        self._avg_uncached += 0.05 * (tokens - self._avg_uncached)

    def on_first_token(self, request: RequestView, worker: WorkerView) -> None:
        live = self._live.get(request.request_id)
        if live and live.first_token_at is None:
            live.first_token_at = now = time.monotonic()
            book = self._unqueue(live)
            # Its prefill is done, so (first come, first served) is everything routed there
            # before it: what is left is the work still booked, from now.
            book.done = now + book.queued * self._inv_prefill
            book.decoding += 1
            if live.alone:
                self._learn_prefill(now - live.routed_at, live.alone)
            releases = self._kv.get(live.url)
            if releases is not None:
                releases.started(live)
            if worker.role == "prefill":  # its KV went to the decode worker with the first token
                self._release_kv(request.request_id, live)

    def _alone(self, worker: WorkerView, book: Booked, tokens: float, footprint: float) -> float:
        """The request's prefill in seconds at the configured rate, if its first token will
        time that prefill alone, else 0. The caller checks that nothing else of this
        gateway's is queued there and that it is not a PD prefill worker (whose first token
        also waits for the KV transfer); here: no engine-reported queue, its KV fits, and
        long enough (50 ms) that the round trip is noise."""
        work = tokens * self._base_inv
        if work < 0.05:
            return 0.0
        load = worker.load
        used, cap = book.kv, 0.0
        if load is not None:
            if load.waiting:
                return 0.0
            cap = load.max_tokens
            if load.used_tokens > used:
                used = load.used_tokens
        if not cap:
            cap = (worker.server_info or {}).get("max_total_num_tokens") or 0.0
        return work if not cap or used + footprint <= cap else 0.0

    def _learn_prefill(self, seconds: float, work: float) -> None:
        """The engines' prefill speed, from first tokens that timed a prefill alone
        (``learn_prefill``): the configured rate is a guess for one model on one GPU, and
        every wait this policy predicts is in its units. A running average of log(measured
        / configured), each sample clipped to 1/4-4x; applied when it moves the rate by
        more than 2%. Then every row is repriced, and what each booked queue has left is
        the same work at the new speed: a queue booked at the old rate would otherwise read
        wrong until its next first token."""
        ratio = min(max(seconds / work, 0.25), 4.0)
        self.prefill_samples += 1
        self._log_scale += 0.1 * (math.log(ratio) - self._log_scale)
        inv = self._base_inv * math.exp(self._log_scale)
        change = inv / self._inv_prefill
        if abs(change - 1.0) > 0.02:
            now = time.monotonic()
            for book in self._book.values():
                if book.queued > 0.0 and book.done > now:
                    book.done = now + (book.done - now) * change
            self._inv_prefill = self._rows.pricing.inv_prefill = inv
            self.prefill_tps = 1.0 / inv
            self._rows.reprice()

    def on_complete(self, request: RequestView, worker: WorkerView, outcome: Outcome) -> None:
        self._picked.pop(request.request_id, None)
        live = self._live.pop(request.request_id, None)
        if live:
            if live.first_token_at is None:
                self._unqueue(live)
            else:
                book = self._booked(live.url)
                book.decoding = max(book.decoding - 1, 0)
                if outcome.ok and outcome.completion_tokens and live.output:
                    used = min(outcome.completion_tokens / live.max_tokens, 1.0)
                    self._out_ratio += 0.05 * (used - self._out_ratio)
                if outcome.ok and outcome.completion_tokens and outcome.completion_tokens > 1:
                    sample = (time.monotonic() - live.first_token_at) / (outcome.completion_tokens - 1)
                    old = self._tpot.get(live.url, sample)
                    self._tpot[live.url] = old + 0.1 * (sample - old)
            self._release_kv(request.request_id, live)
        self.verifier.complete(request.request_id, outcome)
        if self.budget is not None:
            self.budget.learn(request, outcome)

    def _release_kv(self, request_id: str, live: _Live) -> None:
        releases = self._kv.get(live.url)
        if releases is not None and releases.pop(request_id) is not None:
            book = self._booked(live.url)
            book.kv = max(book.kv - live.footprint, 0.0)

    def _booked(self, url: str) -> Booked:
        """``url``'s bookings, to change them (so its backlog row is recomputed)."""
        self._rows.touch(url)
        book = self._book.get(url)
        if book is None:
            book = self._book[url] = Booked()
        return book

    def _unqueue(self, live: _Live) -> Booked:
        """Take ``live``'s prefill out of its worker's queue (as if never there: a request
        that ended before its first token; ``on_first_token`` re-times the rest)."""
        book = self._booked(live.url)
        book.queued = max(book.queued - live.tokens, 0.0)
        book.done -= live.tokens * self._inv_prefill
        live.tokens = 0.0
        return book

    def on_worker_added(self, worker: WorkerView) -> None:
        if self.feed is not None:
            self.feed.add(worker)

    def on_worker_removed(self, worker: WorkerView) -> None:
        if self.feed is not None:
            self.feed.remove(worker.url)
        self.index.remove_worker(worker.url)
        self._book.pop(worker.url, None)
        self._rows.touch(worker.url)
        self._kv.pop(worker.url, None)
        self._tpot.pop(worker.url, None)

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
        out["queued_prefill_tokens"] = sum(b.queued for b in self._book.values())
        out["decoding_requests"] = float(sum(b.decoding for b in self._book.values()))
        out["booked_kv_tokens"] = sum(b.kv for b in self._book.values())
        out["output_share"] = self._out_ratio
        out["holds"] = float(self.holds)
        out["prefill_tokens_per_s"] = self.prefill_tps
        out["prefill_samples"] = float(self.prefill_samples)
        out["work_weight"] = self.last_weight
        out["busy_share"] = self.busy_share
        out["diverted"] = float(self.diverted)
        out["diverted_tokens"] = self.diverted_tokens
        if self.feed is not None:
            out.update(self.feed.stats())
        return out
