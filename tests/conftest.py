"""Fixtures that start real simulator workers and gateways on 127.0.0.1."""

from __future__ import annotations

import pytest

from tests.sim_support import spawn_sim
from tests.support import Proc, free_port, launch

MODEL = "sim-llama-8b"


def _start_sim(procs: list, *args: str, name: str = "sim") -> Proc:
    proc = spawn_sim("--model-name", MODEL, *args, name=name)
    procs.append(proc)
    return proc


def _start_gateway(procs: list, *worker_urls: str, args: tuple[str, ...] = (), ready: bool = True,
                   env: dict[str, str] | None = None) -> Proc:
    workers = ["--worker-urls", *worker_urls] if worker_urls else []

    def start() -> Proc:
        port = free_port()
        proc = Proc.python("gateway", "serve", "--host", "127.0.0.1", "--port", str(port), *workers,
                           "--health-check-interval-secs", "0.5", *args, name="gateway", **(env or {}))
        proc.url = f"http://127.0.0.1:{port}"
        return proc

    def wait(proc: Proc) -> None:
        proc.wait_http(proc.url + "/health", timeout=30)
        if ready:
            proc.wait_http(proc.url + "/readiness", timeout=30)

    proc = launch(start, wait)
    procs.append(proc)
    return proc


@pytest.fixture
def start_sim():
    procs: list[Proc] = []
    yield lambda *args, name="sim": _start_sim(procs, *args, name=name)
    for p in procs:
        p.stop()


@pytest.fixture
def start_gateway():
    procs: list[Proc] = []
    yield lambda *urls, args=(), ready=True, env=None: _start_gateway(procs, *urls, args=args, ready=ready, env=env)
    for p in procs:
        p.stop()


@pytest.fixture(scope="module")
def fleet():
    """Two simulated workers behind one gateway, shared by a module's read-only tests."""
    procs: list[Proc] = []
    try:
        sims = [_start_sim(procs, "--time-scale", "20", name=f"sim{i}") for i in range(2)]
        gw = _start_gateway(procs, *(s.url for s in sims))
        yield gw, sims
    finally:
        for p in procs:
            p.stop()
