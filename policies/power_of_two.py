"""Power of two choices over engine-reported load plus gateway-booked in-flight requests.

Engine load (``/get_load`` or ``/v1/loads``) lags by a poll interval; adding the requests
routed since keeps two quick routing decisions from landing on the same "idle" worker.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from policies.base import Choice, Policy, RequestView, WorkerView, require_workers
from policies.random_choice import SeedOptions


def load_score(worker: WorkerView) -> float:
    engine = worker.load
    queued = (engine.running + engine.waiting) if engine else 0
    return max(queued, worker.in_flight) + (engine.token_usage if engine else 0.0)


class PowerOfTwo(Policy):
    name = "power_of_two"
    needs_prompt = False
    needs_engine_load = True

    Options = SeedOptions

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._rng = random.Random(self.opts.seed)

    def select(self, request: RequestView, workers: Sequence[WorkerView]) -> Choice:
        require_workers(workers)
        if len(workers) == 1:
            return Choice(workers[0], reason="only worker")
        a, b = self._rng.sample(list(workers), 2)
        return Choice(a if load_score(a) <= load_score(b) else b, reason="power_of_two")
