"""The per-worker circuit breaker: opens after consecutive failures, lets one trial through
after its timeout (half-open), closes on the trial's success and re-opens on its failure."""

from __future__ import annotations

import time

import gateway.circuit as circuit
from tests.support import get_text, metric_value
from tests.test_gateway_faults import chat, workers


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def breaker(monkeypatch, threshold: int = 3, timeout: float = 10.0) -> tuple[circuit.CircuitBreaker, Clock]:
    clock = Clock()
    monkeypatch.setattr(circuit, "time", clock)
    return circuit.CircuitBreaker(threshold, timeout), clock


def open_it(cb: circuit.CircuitBreaker) -> None:
    for _ in range(cb.failure_threshold):
        assert cb.allows()
        cb.on_attempt()
        cb.record_failure()
    assert cb.state == "open" and not cb.allows()


def test_opens_only_after_consecutive_failures(monkeypatch):
    cb, _ = breaker(monkeypatch)
    cb.record_failure()
    cb.record_failure()
    cb.record_success()  # the streak is broken
    cb.record_failure()
    cb.record_failure()
    assert cb.state == "closed" and cb.allows()
    cb.record_failure()
    assert cb.state == "open" and not cb.allows()


def test_half_open_lets_exactly_one_trial_through_and_success_closes(monkeypatch):
    cb, clock = breaker(monkeypatch)
    open_it(cb)
    clock.now += 9.99
    assert cb.state == "open" and not cb.allows()
    clock.now += 0.01
    assert cb.state == "half_open" and cb.allows()
    cb.on_attempt()
    assert not cb.allows()  # one trial at a time
    cb.record_success()
    assert cb.state == "closed" and cb.allows() and cb.failures == 0
    cb.record_failure()  # a fresh streak is needed to open again
    assert cb.state == "closed"


def test_a_failed_trial_reopens_for_a_whole_timeout(monkeypatch):
    cb, clock = breaker(monkeypatch)
    open_it(cb)
    clock.now += 10
    cb.on_attempt()
    clock.now += 3  # the trial took a while before failing
    cb.record_failure()
    assert cb.state == "open" and not cb.allows()
    clock.now += 9.99  # counted from the failed trial, not from the first opening
    assert cb.state == "open"
    clock.now += 0.01
    assert cb.state == "half_open" and cb.allows()


def test_the_gateway_sends_a_half_open_trial_and_reopens_on_its_failure(start_sim, start_gateway):
    bad = start_sim("--time-scale", "20", "--fault-fail-rate", "1.0", name="bad")
    good = start_sim("--time-scale", "20", name="good")
    gw = start_gateway(bad.url, good.url, args=("--cb-failure-threshold", "2", "--cb-timeout-secs", "0.5",
                                                "--policy", "round_robin"))

    def errors() -> float:
        return metric_value(get_text(gw.url + "/metrics"), "kvgate_upstream_errors_total", worker=bad.url)

    for i in range(20):  # round robin: every other request tries bad until its circuit opens
        assert chat(gw.url, f"open {i}")[0] == 200
        if errors() == 2:
            break
    assert errors() == 2
    deadline = time.monotonic() + 10
    while workers(gw.url)[bad.url]["circuit"] != "half_open":
        assert time.monotonic() < deadline, workers(gw.url)[bad.url]
        time.sleep(0.05)
    for i in range(6):  # the trial fails, is retried on good, and the client never sees it
        assert chat(gw.url, f"trial {i}")[0] == 200
        if errors() == 3:
            break
    assert errors() == 3
    assert metric_value(get_text(gw.url + "/metrics"), "kvgate_retries_total") == 3
