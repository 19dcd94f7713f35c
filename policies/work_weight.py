"""``cost``'s work weight: how many times a miss's prefill is charged, from how busy the fleet is.

The weight is rho / (1 - rho) of the busy share rho (the share of workers with prefill or a KV
wait queued), averaged over the last ``load_window_s``, times
``work_weight`` / its value at ``full_weight_busy`` (0.75: 3), and ``work_weight``
from there on (``load_aware`` false: always ``work_weight``). With ``work_weight``
auto (the default) the scale is 1: the weight is rho / (1 - rho) up to 3.

Why rho / (1 - rho): a miss's extra prefill delays whoever queues behind it before it
drains, and in a single queue at utilisation rho that is rho / (1 - rho) requests on
average (M/M/1's mean number in system; Little's law). So with most of the fleet idle
a miss costs nobody else, and a burst sharing one prefix spreads over the idle workers
instead of queueing on its warm worker (bench.burst_trace); on a loaded fleet a warm
worker keeps its conversations until its queue costs more than the prefill they
save several times over. Capped at ``full_weight_busy``: past it the averaged share
of a few workers is too coarse to tell 3 from 30 (at 7 of 8 busy the odds are 7), and
a larger weight piles sessions on warm workers (bench.suite: ``work_weight`` 12 and 36
lose wherever prefixes are shared, docs/cost-model.md). Averaged, not each decision's own
share: the instantaneous share lost hits on the Mooncake trace, and a burst arriving
after a pause still sees the pause. The first decision takes the share as it finds
it: starting from "busy" queued a cold start's first burst on one worker.

With ``per_worker`` (``weight_by=worker``) each worker's weight follows its own busy share
the same way: work added to a hot worker delays more requests than on an idle one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

_exp = math.exp


class WorkWeight:
    """The busy shares, averaged over ``load_window_s``, and the weight they give."""

    def __init__(self, work_weight: float | str, load_aware: bool, load_window_s: float, full_weight_busy: float,
                 per_worker: bool = False) -> None:
        full = min(max(full_weight_busy, 0.0), 0.99)
        self.full_odds = full / (1.0 - full)  # rho / (1 - rho) where the weight is full
        # "auto": the full weight is the odds themselves, so the weight is rho / (1 - rho)
        self.full = self.full_odds if work_weight == "auto" else float(work_weight)
        self.load_aware, self.window, self.per_worker = load_aware, load_window_s, per_worker
        self.busy_share = 1.0  # the fleet's, averaged; the first decision sets it
        self.worker_busy: dict[str, float] = {}  # url -> its own, averaged (``per_worker``)
        self.at: float | None = None  # when the shares were last moved
        self.last = self.full  # the fleet's weight at the last decision

    def of(self, rho: float) -> float:
        """The weight at busy share ``rho``."""
        if rho >= 1.0 or not self.full_odds:
            return self.full
        odds = rho / (1.0 - rho) / self.full_odds
        return self.full * odds if odds < 1.0 else self.full

    def decide(self, busy: int, urls: Sequence[str], bases: Sequence[float], decode: Sequence[float],
               now: float) -> tuple[float, list[float] | None]:
        """The fleet's weight when ``busy`` of the workers ``urls`` have prefill (or a KV wait)
        queued, and with ``per_worker`` each one's (queued: its base, the wait plus
        ``decode``, exceeds ``decode``); the shares move towards what is seen now."""
        keep = 0.0  # how much of the averages stays
        if self.at is not None and self.window > 0:
            since = now - self.at
            keep = _exp(-since / self.window) if since > 0.0 else 1.0
        if not self.load_aware or not urls:
            self.last = self.full
            return self.full, None
        self.at = now
        share = busy / len(urls)
        self.busy_share = share + (self.busy_share - share) * keep
        self.last = self.of(self.busy_share)
        if not self.per_worker:
            return self.last, None
        shares, out = self.worker_busy, []
        for url, base, dec in zip(urls, bases, decode):
            flag = 1.0 if base - dec > 0.0 else 0.0
            old = shares.get(url)
            shares[url] = rho = flag if old is None else flag + (old - flag) * keep
            out.append(self.of(rho))
        return self.last, out
