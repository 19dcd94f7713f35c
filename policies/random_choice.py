"""Uniform random choice (registered as ``random``)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from dataclasses import dataclass

from policies.base import Choice, Policy, RequestView, WorkerView, opt, require_workers
from wire.options import optional, whole


@dataclass
class SeedOptions:
    seed: int | None = opt(None, "random seed (unset: a fresh one each start)", parse=optional(whole))


class RandomChoice(Policy):
    name = "random"
    needs_prompt = False
    shares_routing = False

    Options = SeedOptions

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._rng = random.Random(self.opts.seed)

    def select(self, request: RequestView, workers: Sequence[WorkerView]) -> Choice:
        require_workers(workers)
        return Choice(self._rng.choice(workers), reason="random")
