"""What a scheduler's steps say about the process: how far simulated time fell behind the
clock (a CPU-starved process cannot keep up with ``--time-scale``, and every latency it
reports grows), and SGLang's ``gen_throughput``."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("simulator.scheduler")

DECODE_LOG_INTERVAL = 40  # SGLang's --decode-log-interval: gen_throughput is measured over this many decode steps


class StepStats:
    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.lag_sim = 0.0  # simulated seconds behind, right now
        self.lag_max_s = 0.0
        self.lag_sum_s = 0.0
        self._lag_warned = -1e9
        # tokens the last DECODE_LOG_INTERVAL decode steps produced per wall second they
        # spanned (prefill steps between them included), kept while idle
        self.gen_throughput = 0.0
        self._gen_tokens = 0
        self._gen_steps = 0
        self._gen_tic = time.monotonic()

    def late(self, delay: float) -> None:
        """A step due ``delay`` wall seconds from now (negative: overdue)."""
        if delay >= 0:
            self.lag_sim = 0.0
            return
        self.lag_sim = lag = -delay * self.scale
        self.lag_sum_s += lag
        if lag > self.lag_max_s:
            self.lag_max_s = lag
        if lag > 1.0 and time.monotonic() - self._lag_warned > 30:
            self._lag_warned = time.monotonic()
            log.warning("simulated time is %.1f s behind --time-scale %g (CPU-bound); latencies are "
                        "inflated - lower the time scale", lag, self.scale)

    def decoded(self, tokens: int) -> None:
        """One decode step that produced ``tokens``."""
        self._gen_tokens += tokens
        self._gen_steps += 1
        if self._gen_steps >= DECODE_LOG_INTERVAL:
            now = time.monotonic()
            self.gen_throughput = self._gen_tokens / max(now - self._gen_tic, 1e-6)
            self._gen_tokens, self._gen_steps, self._gen_tic = 0, 0, now

    def idle(self) -> None:
        """The GPU went idle: idle time is not decode time."""
        self._gen_tokens, self._gen_steps, self._gen_tic = 0, 0, time.monotonic()
