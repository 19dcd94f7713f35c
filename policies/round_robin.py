"""Round robin: the baseline every other policy is measured against."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from policies.base import Choice, NoOptions, Policy, RequestView, WorkerView, require_workers


class RoundRobin(Policy):
    name = "round_robin"
    Options = NoOptions
    needs_prompt = False
    shares_routing = False

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._counter = itertools.count()

    def select(self, request: RequestView, workers: Sequence[WorkerView]) -> Choice:
        require_workers(workers)
        return Choice(workers[next(self._counter) % len(workers)], reason="round_robin")
