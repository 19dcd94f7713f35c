"""``cost``'s ledger: what this gateway routed where and what it has learned since.

Bookings per worker (``Booked``: queued prefill work, when it drains, requests decoding, KV
held), the live requests behind them, each worker's KV release schedule (``KvReleases``), and
the learned rates: time per output token per worker, the share of ``max_tokens`` requests
use, the average ``max_tokens``, the average prefill per request, and the prefill speed
(learned from first tokens that timed a prefill alone, with the rescale of booked queues).

A plain object with explicit methods (``chose``, ``routed``, ``first_token``,
``completed``, ``worker_removed``) and no knowledge of the index or of worker roles: where
a PD prefill worker differs (its KV leaves at the first token, and its first token waits
for the transfer so it times no prefill), the policy says so in flags. Its state is what a
shared-state engine would replicate. Work is in linear-token equivalents (the pricer's
``prefill_tokens``), seconds are at ``inv_prefill``; see docs/cost-model.md.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from policies.base import Outcome, RequestView, WorkerView
from policies.fleet_backlog import Booked
from policies.kv_release import KvReleases

# Share of ``max_new_tokens`` a request's KV is booked at: the engine reserves part of it at
# admission and fills it as it decodes (SGLang's new_token_ratio starts at 0.7, decays).
OUTPUT_SHARE = 0.5


def _nothing(*_: object) -> None:
    return None


@dataclass(slots=True)
class Live:
    """A request between routing and completion, as the ledger booked it."""

    url: str
    tokens: float  # prefill work still queued (linear-token equivalents); 0 after the first token
    footprint: float  # KV tokens it adds on the engine: its uncached prompt and a share of its output
    output: float  # output tokens expected: max_tokens x the share requests have been using
    max_tokens: float
    first_token_at: float | None = None
    routed_at: float = 0.0
    alone: float = 0.0  # its prefill work in seconds at the base rate when it started at once (a speed sample), else 0


class Ledger:
    """Bookings, KV release schedules and learned rates. ``clock`` reads the time where a
    hook needs it; ``touched(url)`` is called when a worker's bookings change and
    ``repriced()`` when the learned prefill speed moves (the pricer's rows follow both)."""

    def __init__(self, prefill_tokens_per_s: float, default_tpot_s: float, clock: Callable[[], float],
                 touched: Callable[[str], None] = _nothing, repriced: Callable[[], None] = _nothing) -> None:
        self.prefill_tps = prefill_tokens_per_s
        self.inv_prefill = 1.0 / prefill_tokens_per_s  # seconds per linear token, every wait's factor
        self.base_inv = 1.0 / prefill_tokens_per_s  # the configured rate, which learning scales
        self.log_scale = 0.0  # log(measured prefill time / configured), averaged over samples
        self.prefill_samples = 0
        self.default_tpot_s = default_tpot_s
        self.clock, self.touched, self.repriced = clock, touched, repriced
        self.book: dict[str, Booked] = {}  # per worker: what this gateway sent it
        self.avg_uncached = 0.0  # average prefill work per routed request
        self.avg_max_new = 256.0
        self.out_ratio = 1.0  # completion tokens / max_tokens, learned from completions
        self.picked: OrderedDict[str, tuple[str, float, float | None]] = OrderedDict()  # chose -> routed
        self.live: dict[str, Live] = {}
        self.kv: dict[str, KvReleases] = {}  # worker -> its live requests (KV they hold)
        self.tpot: dict[str, float] = {}  # worker -> measured seconds per output token
        self.sampling: dict[str, Live] = {}  # worker -> our request timing a prefill alone there, until its first token

    # -- what a decision reads ----------------------------------------------------------
    def expected_output(self, max_tokens: int | None) -> float:
        """KV tokens a request's output is booked at."""
        return OUTPUT_SHARE * self.out_ratio * float(max_tokens if max_tokens is not None else self.avg_max_new)

    def memory_wait(self, url: str, over: float, now: float, queue_wait: float) -> float:
        """Seconds until ``over`` more KV tokens are free on the worker than it has now.

        An engine admits a request only when its KV fits (SGLang's scheduler stops at the
        first waiting request that does not, so everything behind it waits too). Each
        request booked there is expected to free its KV after its expected output
        (``max_tokens`` times the share of it requests have been using: EOS usually comes
        first) after its first token (``queue_wait`` from now if it has none yet), at the
        worker's measured time per output token. Sorted once per change of those, not per
        question: ``KvReleases``."""
        releases = self.kv.get(url)
        if releases is None or not releases.lives:
            return 0.0
        return releases.wait(over, now, queue_wait, self.tpot.get(url, self.default_tpot_s))

    def memory_first(self, url: str, now: float, queue_wait: float) -> float:
        """A lower bound on ``memory_wait`` for any shortfall: until the worker's first booked
        request is expected to end (``KvReleases.first``)."""
        releases = self.kv.get(url)
        if releases is None or not releases.lives:
            return 0.0
        return releases.first(now, queue_wait, self.tpot.get(url, self.default_tpot_s))

    # -- the request's life -------------------------------------------------------------
    def chose(self, request_id: str, url: str, tokens: float, uncached: float | None = None) -> None:
        """A decision sent ``request_id`` to ``url`` with ``tokens`` of prefill work and
        ``uncached`` prompt tokens not in its cache (None: the whole prompt); ``routed``
        books it."""
        self.picked[request_id] = (url, tokens, uncached)
        if len(self.picked) > 100_000:
            self.picked.popitem(last=False)

    def withdrawn(self, request_id: str) -> None:
        """The decision ``chose`` recorded will not be used."""
        self.picked.pop(request_id, None)

    def routed(self, request: RequestView, worker: WorkerView, full: float, *, keeps_output: bool = True,
               times_prefill: bool = True) -> None:
        """Book ``request`` on ``worker``: the work ``chose`` gave it there, else ``full``
        (the gateway sent it elsewhere: a retry). ``keeps_output`` false: its KV leaves
        before any output (a PD prefill worker); ``times_prefill`` false: its first token
        times more than a prefill (a PD prefill worker's waits for the transfer)."""
        prompt = float(request.prompt_tokens_estimate)
        url, tokens, uncached = self.picked.pop(request.request_id, (worker.url, full, None))
        if url != worker.url:
            tokens, uncached = full, None
        book = self.booked(worker.url)
        book.queued += tokens
        now = self.clock()
        book.done = (book.done if book.done > now else now) + tokens * self.inv_prefill
        max_new = float(request.max_tokens if request.max_tokens is not None else self.avg_max_new)
        self.avg_max_new += 0.05 * (max_new - self.avg_max_new)
        output = max_new * self.out_ratio if keeps_output else 0.0
        # The KV it adds: its cached prefix is already there, and held by whoever else uses it
        # (the engine's own report counts shared pages once: ``FleetBacklog``).
        adds = prompt if uncached is None else uncached
        live = Live(worker.url, tokens, adds + OUTPUT_SHARE * output, output, max_new, None, now)
        self.spoil_sample(worker.url)  # a sample there no longer runs alone: this one may share its step
        if request.stream and book.queued - tokens < 1.0 and times_prefill:
            # Nothing else of ours in prefill there, and a first token that is one (a
            # response not streamed arrives after its decode)
            live.alone = self._alone(worker, book, tokens, live.footprint)
            if live.alone:
                self.sampling[worker.url] = live
        self.live[request.request_id] = live
        releases = self.kv.get(worker.url)
        if releases is None:
            releases = self.kv[worker.url] = KvReleases()
        releases.add(request.request_id, live)
        book.kv += live.footprint
        self.avg_uncached += 0.05 * (tokens - self.avg_uncached)

    def _alone(self, worker: WorkerView, book: Booked, tokens: float, footprint: float) -> float:
        """The request's prefill in seconds at the configured rate, if its first token will
        time that prefill alone, else 0. The caller checks that nothing else of this
        gateway's is queued there and that the first token times only a prefill (not a PD
        prefill worker's, which also waits for the KV transfer); here: no engine-reported
        queue, its KV fits, and long enough (50 ms) that the round trip is noise."""
        work = tokens * self.base_inv
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

    def first_token(self, request_id: str, *, releases_kv: bool = False) -> None:
        """Its prefill is done: the work booked before it there (first come, first served)
        is what is left, from now. ``releases_kv``: its KV left with the first token (a PD
        prefill worker's goes to the decode worker)."""
        live = self.live.get(request_id)
        if live and live.first_token_at is None:
            live.first_token_at = now = self.clock()
            book = self._unqueue(live)
            book.done = now + book.queued * self.inv_prefill
            book.decoding += 1
            if live.alone:
                self.learn_prefill(now - live.routed_at, live.alone)
                self.sampling.pop(live.url, None)
            releases = self.kv.get(live.url)
            if releases is not None:
                releases.started(live)
            if releases_kv:
                self._release_kv(request_id, live)

    def spoil_sample(self, url: str) -> None:
        """Another request may be ahead of or batched with the pending sample on ``url`` (a
        peer's, or one of ours routed there before the sample's first token: the engine may
        prefill both in one step): that first token will not time a prefill alone."""
        live = self.sampling.pop(url, None)
        if live is not None:
            live.alone = 0.0

    def learn_prefill(self, seconds: float, work: float) -> None:
        """A first token timed ``work`` seconds (at the configured rate) of prefill alone in
        ``seconds``. The configured rate is a guess for one model on one GPU, and every wait
        the pricer predicts is in its units. A running average of log(measured / configured), each sample clipped to
        1/4-4x, applied when it moves the rate by more than 2%. Then what each booked queue
        has left is the same work at the new speed (a queue booked at the old rate would
        otherwise read wrong until its next first token), and ``repriced``."""
        ratio = min(max(seconds / work, 0.25), 4.0)
        self.prefill_samples += 1
        self.log_scale += 0.1 * (math.log(ratio) - self.log_scale)
        inv = self.base_inv * math.exp(self.log_scale)
        change = inv / self.inv_prefill
        if abs(change - 1.0) > 0.02:
            now = self.clock()
            for book in self.book.values():
                if book.queued > 0.0 and book.done > now:
                    book.done = now + (book.done - now) * change
            self.inv_prefill = inv
            self.prefill_tps = 1.0 / inv
            self.repriced()

    def completed(self, request_id: str, outcome: Outcome) -> None:
        """Free its bookings; learn the output share and the worker's time per token."""
        self.picked.pop(request_id, None)
        live = self.live.pop(request_id, None)
        if live:
            if live.first_token_at is None:
                self._unqueue(live)
                if self.sampling.get(live.url) is live:
                    del self.sampling[live.url]
            else:
                book = self.booked(live.url)
                book.decoding = max(book.decoding - 1, 0)
                if outcome.ok and outcome.completion_tokens and live.output:
                    used = min(outcome.completion_tokens / live.max_tokens, 1.0)
                    self.out_ratio += 0.05 * (used - self.out_ratio)
                if outcome.ok and outcome.completion_tokens and outcome.completion_tokens > 1:
                    sample = (self.clock() - live.first_token_at) / (outcome.completion_tokens - 1)
                    old = self.tpot.get(live.url, sample)
                    self.tpot[live.url] = old + 0.1 * (sample - old)
            self._release_kv(request_id, live)

    def worker_removed(self, url: str) -> None:
        self.book.pop(url, None)
        self.sampling.pop(url, None)
        self.touched(url)
        self.kv.pop(url, None)
        self.tpot.pop(url, None)

    # -- internals ----------------------------------------------------------------------
    def _release_kv(self, request_id: str, live: Live) -> None:
        releases = self.kv.get(live.url)
        if releases is not None and releases.pop(request_id) is not None:
            book = self.booked(live.url)
            book.kv = max(book.kv - live.footprint, 0.0)

    def booked(self, url: str) -> Booked:
        """``url``'s bookings, to change them (``touched``)."""
        self.touched(url)
        book = self.book.get(url)
        if book is None:
            book = self.book[url] = Booked()
        return book

    def _unqueue(self, live: Live) -> Booked:
        """Take ``live``'s prefill out of its worker's queue (as if never there: a request
        that ended before its first token; ``first_token`` re-times the rest)."""
        book = self.booked(live.url)
        book.queued = max(book.queued - live.tokens, 0.0)
        book.done -= live.tokens * self.inv_prefill
        live.tokens = 0.0
        return book

    def stats(self) -> Mapping[str, float]:
        book = self.book.values()
        return {"queued_prefill_tokens": sum(b.queued for b in book),
                "decoding_requests": float(sum(b.decoding for b in book)),
                "booked_kv_tokens": sum(b.kv for b in book),
                "output_share": self.out_ratio,
                "prefill_tokens_per_s": self.prefill_tps,
                "prefill_samples": float(self.prefill_samples)}
