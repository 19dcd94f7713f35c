"""Routers under benchmark as real processes: kvgate's gateway and sglang-router.

Benchmarks measure what a user would run, so each router is its own process on a free
port, started from this checkout (``PYTHONPATH``), logging to a file, and stopped by its
process group so nothing outlives a run.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from simulator.cluster import _Worker, bind_failed

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int | None, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return None, b""


class Service(_Worker):
    """One child process in its own session (the simulator's worker process handling);
    ``stop`` ends its whole group."""

    def __init__(self, args: Sequence[str], log_path: Path, url: str) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["PYTHONUNBUFFERED"] = "1"
        super().__init__("router", url, list(args), log_path, env)

    def wait_ready(self, path: str = "/health", timeout: float = 60.0) -> "Service":
        """Block until ``path`` answers 200; on failure (or Ctrl-C) stop the process and raise."""
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.popen.poll() is not None:
                    raise RuntimeError(f"{self.args[:4]} exited with {self.popen.returncode}:\n{self.tail()}")
                if http_get(self.url + path, timeout=1.0)[0] == 200:
                    return self
                time.sleep(0.1)
            raise TimeoutError(f"{self.url}{path} not ready after {timeout}s:\n{self.tail()}")
        except BaseException:
            self.stop()
            raise


def start_service(make_args: Callable[[int], list[str]], log_path: Path, path: str, tries: int = 3) -> Service:
    """``make_args(port)`` started on a freshly picked port and ready at ``path``; a process
    that exits because another one took a port it was given (HTTP or ZMQ) is started
    again on new ports, at most ``tries`` times."""
    for attempt in range(tries):
        port = free_port()
        try:
            return Service(make_args(port), log_path, f"http://127.0.0.1:{port}").wait_ready(path)
        except RuntimeError as exc:
            if attempt + 1 == tries or not bind_failed(str(exc)):
                raise
    raise AssertionError("unreachable")


def start_kvgate(worker_urls: Sequence[str], policy: str, options: dict[str, str], log_path: Path,
                 tokenizer: str | None = "byte", extra: Sequence[str] = ()) -> Service:
    def make_args(port: int) -> list[str]:
        args = [sys.executable, "-m", "gateway", "serve", "--host", "127.0.0.1", "--port", str(port),
                "--policy", policy, "--log-level", os.environ.get("KVGATE_BENCH_LOG_LEVEL", "warning"),
                "--worker-urls", *worker_urls, *extra]
        if tokenizer:
            args += ["--tokenizer", tokenizer]
        for k, v in options.items():
            args += ["--policy-option", f"{k}={v}"]
        return args

    return start_service(make_args, log_path, "/readiness")


def start_sglang_router(worker_urls: Sequence[str], policy: str, options: dict[str, str], log_path: Path) -> Service:
    def make_args(port: int) -> list[str]:
        args = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                "--prometheus-port", str(free_port()), "--policy", policy, "--log-level", "warn",
                "--worker-urls", *worker_urls]
        for k, v in options.items():
            args += [f"--{k.replace('_', '-')}", str(v)]
        return args

    return start_service(make_args, log_path, "/health")
