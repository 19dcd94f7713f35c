"""Simulated time, tied to the wall clock by ``time_scale``.

Simulated seconds advance ``time_scale`` times faster than wall seconds; the scheduler
prices steps in simulated seconds and sleeps the wall equivalent.
"""

from __future__ import annotations

import time


class SimClock:
    def __init__(self, time_scale: float = 1.0) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.scale = time_scale
        self._t0 = time.monotonic()

    def now(self) -> float:
        """Simulated seconds since start."""
        return (time.monotonic() - self._t0) * self.scale

    def wall_at(self, sim_t: float) -> float:
        """The ``time.monotonic()`` instant at which simulated time ``sim_t`` is reached."""
        return self._t0 + sim_t / self.scale
