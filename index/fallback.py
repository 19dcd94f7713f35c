"""A ``PrefixIndex`` that is precise when it can be and approximate when it must be.

The KV-event index keys requests by page hashes of token ids; requests that reach the
gateway as text (chat without a configured tokenizer) have none, and a fleet whose engines
publish no events gives the index nothing. Rather than route those blind, they go through an
approximate text radix tree that learns from the decisions it makes. It does not learn from
the precise index's: a chat request carries its text beside its token ids, and inserting
~10k characters into a tree kept at its budget cost every such decision ~21 us median and
~0.75 ms p99 (evictions), for a tree consulted only when a request has no ids or no worker
publishes events (the first fallbacks then route on load until it learns). Fallbacks are
counted and logged once: a fleet that always falls back is a configuration problem (no
``--tokenizer``, or engines without ``--kv-events-config``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from index.views import RequestView, WorkerView
from index.block_index import BlockIndex
from index.prefix import IndexMatch, Unit
from index.radix import RadixIndex

log = logging.getLogger("kvgate.policies")


class PreciseOrApprox:
    unit: Unit = "tokens"

    def __init__(self, precise: BlockIndex, approx: RadixIndex, owner: str = "policy",
                 fed: Callable[[Sequence[WorkerView]], bool] | None = None, quiet: bool = False) -> None:
        self.precise = precise
        self.approx = approx
        self.owner = owner
        self.fed = fed  # whether KV events describe any of these workers
        self.fallbacks = 0
        self.fallbacks_no_events = 0
        self._approx_for: str | None = None  # the request the text tree last matched
        self._no_events_level = logging.INFO if quiet else logging.WARNING

    def usable(self, request: RequestView) -> bool:
        return self.precise.usable(request) or self.approx.usable(request)

    def match(self, request: RequestView, workers: Sequence[WorkerView]) -> IndexMatch:
        if self.precise.usable(request):
            if self.fed is None or self.fed(workers):
                return self.precise.match(request, workers)
            if not self.fallbacks_no_events:
                log.log(self._no_events_level, "%s: none of the candidate workers publishes KV events, "
                        "matching with the approximate index (counted as fallback_no_events_total)",
                        self.owner)
            self.fallbacks_no_events += 1
        elif not self.fallbacks - self.fallbacks_no_events:
            log.warning("%s: request without token ids, matching on text with the approximate index "
                        "(give the gateway the engine's tokenizer for precise matching); "
                        "counted in stats as fallback_requests_total", self.owner)
        self.fallbacks += 1
        self._approx_for = request.request_id
        return self.approx.match(request, workers)

    def forgotten_for(self, request: RequestView | None = None) -> int | None:
        """The precise index's ``forgotten``; None where the text tree answered ``request``
        (the last one matched), which hears of no eviction."""
        if request is not None and self._approx_for == request.request_id:
            return None
        return self.precise.forgotten

    def record(self, request: RequestView, worker: WorkerView) -> None:
        self.precise.record(request, worker)
        routed_by_text = self._approx_for == request.request_id or not self.precise.usable(request)
        if request.text is not None and routed_by_text:
            self.approx.record(request, worker)

    def retract(self, request: RequestView, worker: WorkerView) -> None:
        self.precise.retract(request, worker)
        self.approx.retract(request, worker)

    def remove_worker(self, url: str) -> None:
        self.precise.remove_worker(url)
        self.approx.remove_worker(url)

    def worker_size(self, url: str) -> int:
        return self.precise.worker_size(url) or self.approx.worker_size(url)

    def maintain(self, now: float | None = None) -> None:
        self.precise.maintain(now)
        self.approx.maintain(now)

    def stats(self) -> Mapping[str, float]:
        out = {f"approx_{k}": v for k, v in self.approx.stats().items()}
        out.update(self.precise.stats())
        out["fallback_requests_total"] = self.fallbacks
        out["fallback_no_events_total"] = self.fallbacks_no_events
        return out
