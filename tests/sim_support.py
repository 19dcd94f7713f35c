"""Start simulated workers for tests (real processes via ``tests.support.Proc``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from tests.support import FREE_PORT, Proc, fill_ports, launch


def spawn_sim(*args: str, name: str = "sim", timeout: float = 30.0) -> Proc:
    """A simulated worker on a free port, healthy before it is returned (``proc.url``).

    Each ``FREE_PORT`` in ``args`` becomes a free port (``proc.ports``, in order); all of
    them are picked again when the worker finds one taken."""

    def start() -> Proc:
        argv, ports = fill_ports(["--port", FREE_PORT, *args])
        proc = Proc.python("simulator", "serve", "--host", "127.0.0.1", *argv, name=name)
        proc.url = f"http://127.0.0.1:{ports[0]}"
        proc.ports = ports[1:]
        return proc

    return launch(start, lambda proc: proc.wait_http(proc.url + "/health", timeout=timeout))


@contextlib.contextmanager
def sim_worker(*args: str, name: str = "sim", timeout: float = 30.0) -> Iterator[tuple[str, Proc]]:
    proc = spawn_sim(*args, name=name, timeout=timeout)
    try:
        yield proc.url, proc
    finally:
        proc.stop()


def join_kv_events(sub, url: str, timeout: float = 10.0, **fields: object) -> int:
    """Wait until the SUB socket ``sub`` receives ``url``'s KV events (a ZMQ subscription
    joins a moment after connect, and a batch published before is not delivered).

    Posts one prompt of new pages at a time to ``url`` (``fields`` added to each body, e.g.
    ``routed_dp_rank``) until a batch arrives, drains what arrived and returns the last seq
    seen (at most ``timeout`` seconds, then it fails)."""
    import json
    import time
    import urllib.request

    from wire.kv_events import unpack_seq

    with urllib.request.urlopen(url + "/server_info", timeout=10) as r:
        page = int(json.loads(r.read()).get("page_size") or 1)
    deadline = time.monotonic() + timeout
    for i in range(1000):
        assert time.monotonic() < deadline, f"no KV event from {url} within {timeout}s"
        body = {"input_ids": [30000 + i] * (2 * page + 1), "sampling_params": {"max_new_tokens": 1}, **fields}
        req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=10).close()
        if sub.poll(200):
            last = -1
            while sub.poll(200):
                last = unpack_seq(sub.recv_multipart()[1])
            return last
    raise AssertionError("unreachable")
