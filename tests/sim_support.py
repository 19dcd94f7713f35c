"""Start simulated workers for tests (real processes via ``tests.support.Proc``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from tests.support import Proc, free_port


@contextlib.contextmanager
def sim_worker(*args: str, name: str = "sim", timeout: float = 30.0) -> Iterator[tuple[str, Proc]]:
    port = free_port()
    proc = Proc.python("simulator", "serve", "--host", "127.0.0.1", "--port", str(port), *args, name=name)
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(url + "/health", timeout=timeout)
        yield url, proc
    finally:
        proc.stop()
