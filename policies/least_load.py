"""Fewest in-flight requests, as booked by the gateway at routing time.

The gateway increments ``in_flight`` before the request leaves, so a burst that arrives
between engine load reports still spreads out.
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import Choice, NoOptions, Policy, RequestView, WorkerView, require_workers


class LeastLoad(Policy):
    name = "least_load"
    Options = NoOptions
    needs_prompt = False

    def select(self, request: RequestView, workers: Sequence[WorkerView]) -> Choice:
        require_workers(workers)
        return Choice(min(workers, key=lambda w: w.in_flight), reason="least_load")
