"""The shared retry loop (``gateway.attempts``) and its typed results, as plain functions: no
HTTP, no processes (the end-to-end retries are in test_gateway_faults, _resilience and _pd)."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from gateway.attempts import Attempts, Failure, Tried, failed
from gateway.config import GatewayConfig, WorkerSpec
from gateway.errors import GatewayError
from gateway.metrics import GatewayMetrics
from gateway.workers import Worker
from policies.base import NoWorkerAvailable, RequestView
from policies.loader import load_policy


def test_an_engine_error_answer_is_retryable_only_for_a_5xx():
    busy = Failure.answered(503, b'{"error": "busy"}', "application/json; charset=utf-8")
    assert (busy.status, busy.body, busy.content_type, busy.cause, busy.retryable) == (
        503, b'{"error": "busy"}', "application/json", "http_503", True)
    too_long = Failure.answered(400, b"{}", "application/json")
    assert not too_long.retryable and not too_long.timed_out
    assert Failure(0, cause="timeout").timed_out and Failure(0, cause="connect").retryable
    with pytest.raises(AttributeError):
        busy.status = 200  # type: ignore[misc]  # frozen


def test_a_worker_fault_is_counted_once_where_it_happened():
    metrics = GatewayMetrics()
    worker = Worker(WorkerSpec("http://127.0.0.1:9"), GatewayConfig(cb_failure_threshold=1))
    got = failed(worker, "connect", "refused", metrics)
    assert got == Failure(0, cause="connect") and got.retryable
    assert worker.last_error == "refused" and not worker.breaker.allows()
    assert metrics.upstream_errors.labels(worker.url, "connect")._value.get() == 1


class _Script:
    """A target whose attempts answer what the test scripted, one per attempt."""

    def __init__(self, answers: list, workers: int = 3) -> None:
        self.policy = load_policy("round_robin")
        self.answers = answers
        self.workers = [f"http://w{i}" for i in range(workers)]
        self.asked: list[list[str]] = []  # the urls tried so far, at each decision
        self.attempted: list[tuple[str, int]] = []

    async def decide(self, view: RequestView, tried: Tried) -> str:
        self.asked.append(list(tried.urls))
        left = [w for w in self.workers if w not in tried.urls]
        if not left:
            raise NoWorkerAvailable
        return left[0]

    @staticmethod
    def urls(pick: str) -> tuple[str]:
        return (pick,)

    async def attempt(self, request, view, raw, body, pick: str, n: int):
        self.attempted.append((pick, n))
        return self.answers[n]

    @staticmethod
    def exhausted(view, tried):
        return GatewayError(502, f"all failed ({', '.join(tried.urls)})", code="upstream_unavailable")

    @staticmethod
    def timed_out(view, tried):
        return GatewayError(504, "timed out", code="upstream_timeout")

    @staticmethod
    def unavailable(view):
        return GatewayError(503, "none", code="no_worker_available")


def _run(target: _Script, max_retries: int) -> tuple[web.StreamResponse | GatewayError, float]:
    metrics = GatewayMetrics()
    loop = Attempts(metrics, max_retries)
    loop.target = target

    async def main():
        try:
            return await loop.run(None, RequestView("r", "/generate", text="x"), b"{}", None)  # type: ignore[arg-type]
        except GatewayError as exc:
            return exc

    return asyncio.run(main()), metrics.retries._value.get()


def test_retryable_failures_try_other_workers_up_to_the_configured_retries():
    ok = web.Response(status=200, body=b"ok")
    target = _Script([Failure(0, cause="connect"), Failure.answered(502, b"bad", "text/plain"), ok])
    got, retries = _run(target, max_retries=2)
    assert got is ok and retries == 2
    assert target.attempted == [("http://w0", 0), ("http://w1", 1), ("http://w2", 2)]
    assert target.asked == [[], ["http://w0"], ["http://w0", "http://w1"]]

    target = _Script([Failure(0, cause="connect")] * 3)
    got, retries = _run(target, max_retries=1)  # bounded: two attempts, then the 502 naming both
    assert isinstance(got, GatewayError) and got.status == 502 and retries == 1
    assert got.message == "all failed (http://w0, http://w1)"


def test_the_last_engine_answer_is_passed_on_and_a_4xx_is_not_retried():
    target = _Script([Failure.answered(400, b'{"error": "too long"}', "application/json"), None])
    got, retries = _run(target, max_retries=3)
    assert isinstance(got, web.Response) and got.status == 400 and retries == 0
    assert json.loads(got.body) == {"error": "too long"} and got.headers["X-Request-ID"] == "r"
    target = _Script([Failure(0, cause="connect"), Failure.answered(503, b"busy", "text/plain")])
    got, _ = _run(target, max_retries=1)
    assert isinstance(got, web.Response) and got.status == 503 and got.body == b"busy"


def test_all_timed_out_is_504_and_no_worker_at_all_is_503():
    got, _ = _run(_Script([Failure(0, cause="timeout")] * 2), max_retries=1)
    assert isinstance(got, GatewayError) and got.status == 504
    got, _ = _run(_Script([Failure(0, cause="timeout"), Failure(0, cause="connect")]), max_retries=1)
    assert isinstance(got, GatewayError) and got.status == 502
    got, _ = _run(_Script([], workers=0), max_retries=2)
    assert isinstance(got, GatewayError) and got.status == 503


def test_the_fast_replacements_keep_every_other_field():
    """``WorkerView.with_in_flight`` and ``RequestView.holding`` list the fields by hand (for
    speed): a field added to either and not passed on fails here."""
    import dataclasses

    from policies.base import EngineLoad, WorkerView

    def sample(cls):
        values = {"url": "http://w:1", "request_id": "r", "route": "/generate", "role": "decode",
                  "models": frozenset({"m"}), "healthy": False, "load": EngineLoad(running=1), "bootstrap_port": 7,
                  "server_info": {"page_size": 16}, "model": "m", "text": "t", "token_ids": [1, 2],
                  "packed_ids": b"\x01\x00\x00\x00\x02\x00\x00\x00", "session_key": "s", "stream": True,
                  "max_tokens": 3, "cache_salt": "salt", "headers": {"a": "b"}, "in_flight": 2,
                  "may_hold": False, "held_s": 0.0, "qos": "ticket"}
        names = [f.name for f in dataclasses.fields(cls)]
        assert set(names) <= values.keys(), set(names) - values.keys()
        return cls(**{n: values[n] for n in names})

    w = sample(WorkerView)
    assert dataclasses.astuple(w.with_in_flight(5)) == dataclasses.astuple(dataclasses.replace(w, in_flight=5))
    r = sample(RequestView)
    assert r.holding(True, 1.5) == dataclasses.replace(r, may_hold=True, held_s=1.5)
