"""Per-worker circuit breaker.

Health checks catch a dead worker within a few intervals; the breaker catches a worker
that answers /health but fails real requests, and stops sending it traffic after
``failure_threshold`` consecutive failures. After ``timeout`` it lets one trial through
(half-open); success closes it, failure re-opens it.
"""

from __future__ import annotations

import time


class CircuitBreaker:
    __slots__ = ("failure_threshold", "timeout", "failures", "opened_at", "_trial_in_flight")

    def __init__(self, failure_threshold: int = 5, timeout: float = 10.0) -> None:
        self.failure_threshold = failure_threshold
        self.timeout = timeout
        self.failures = 0
        self.opened_at: float | None = None
        self._trial_in_flight = False

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "half_open" if time.monotonic() - self.opened_at >= self.timeout else "open"

    def allows(self) -> bool:
        if self.opened_at is None:  # closed: the per-request case, without a clock read
            return True
        state = self.state
        return state == "closed" or (state == "half_open" and not self._trial_in_flight)

    def on_attempt(self) -> None:
        if self.state == "half_open":
            self._trial_in_flight = True

    def record_success(self) -> None:
        self.failures = 0
        self.opened_at = None
        self._trial_in_flight = False

    def record_failure(self) -> None:
        self.failures += 1
        self._trial_in_flight = False
        if self.opened_at is not None or self.failures >= self.failure_threshold:
            self.opened_at = time.monotonic()
