"""Uniform random choice (registered as ``random``)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from policies.base import Choice, Policy, RequestView, WorkerView, require_workers


class RandomChoice(Policy):
    name = "random"
    needs_prompt = False

    def __init__(self, seed: int | None = None, **options) -> None:
        super().__init__(**options)
        self._rng = random.Random(seed)

    def select(self, request: RequestView, workers: Sequence[WorkerView]) -> Choice:
        require_workers(workers)
        return Choice(self._rng.choice(workers), reason="random")
