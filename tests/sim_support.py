"""Start simulated workers for tests (real processes via ``tests.support.Proc``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from tests.support import Proc, free_port


def spawn_sim(*args: str, name: str = "sim", timeout: float = 30.0) -> Proc:
    """A simulated worker on a free port, healthy before it is returned (``proc.url``)."""
    port = free_port()
    proc = Proc.python("simulator", "serve", "--host", "127.0.0.1", "--port", str(port), *args, name=name)
    proc.url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(proc.url + "/health", timeout=timeout)
    except BaseException:
        proc.stop()
        raise
    return proc


@contextlib.contextmanager
def sim_worker(*args: str, name: str = "sim", timeout: float = 30.0) -> Iterator[tuple[str, Proc]]:
    proc = spawn_sim(*args, name=name, timeout=timeout)
    try:
        yield proc.url, proc
    finally:
        proc.stop()
