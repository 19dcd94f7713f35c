"""Routers under benchmark as real processes: kvgate's gateway, sglang-router and SMG.

Benchmarks measure what a user would run, so each router is its own process on a free
port, started from this checkout (``PYTHONPATH``), logging to a file, and stopped by its
process group so nothing outlives a run.
"""

from __future__ import annotations

import json
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
        self.metrics_url = url  # where its Prometheus /metrics is served (SMG: a port of its own)

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


# ---- SMG (the Shepherd Model Gateway, sglang-router's successor) -----------------------------------
SMG_VENV = ROOT / ".venv-smg"  # scripts/setup.sh --bench installs the pinned smg there


def smg_python() -> str | None:
    """The interpreter whose environment has the ``smg`` package: ``$SMG_PYTHON``, else
    ``.venv-smg`` in this checkout, else this interpreter if it has one. Its own
    environment because sglang-router's wheel installs an unrelated console script named
    ``smg``: the module is run (``python -m smg``), never a script found on the PATH."""
    import importlib.util

    for cand in (os.environ.get("SMG_PYTHON"), str(SMG_VENV / "bin" / "python")):
        if cand and Path(cand).exists():
            return cand
    return sys.executable if importlib.util.find_spec("smg") else None


def smg_flags(options: dict[str, str]) -> list[str]:
    """``{"selection_temperature": "0.1", "disable_worker_overload_protection": ""}`` ->
    ``--selection-temperature 0.1 --disable-worker-overload-protection``: an empty or
    ``true`` value is a bare switch."""
    out: list[str] = []
    for k, v in options.items():
        out.append(f"--{k.replace('_', '-')}")
        if v not in ("", "true"):
            out.append(str(v))
    return out


def start_smg(worker_urls: Sequence[str], policy: str, options: dict[str, str], log_path: Path,
              python: str | None = None, pd: Sequence[str] = ()) -> Service:
    """``python -m smg launch`` in front of ``worker_urls`` (or, with ``pd``, the
    ``--pd-disaggregation --prefill URL PORT --decode URL`` arguments it is given), ready
    once ``/readiness`` reports every worker healthy."""
    python = python or smg_python()
    if python is None:
        raise RuntimeError("no smg package: run scripts/setup.sh --bench (installs .venv-smg) or set SMG_PYTHON")

    def make_args(port: int) -> list[str]:
        workers = list(pd) if pd else ["--worker-urls", *worker_urls]
        return [python, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(port),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                "--log-level", os.environ.get("KVGATE_BENCH_SMG_LOG_LEVEL", "warn"), "--policy", policy,
                *workers, *smg_flags(options)]

    svc = start_service(make_args, log_path, "/readiness")
    svc.metrics_url = "http://127.0.0.1:" + svc.args[svc.args.index("--prometheus-port") + 1]
    wait_smg_loads(svc, len(worker_urls) if not pd else sum(1 for x in pd if x.startswith("http")))
    return svc


def wait_smg_loads(svc: Service, workers: int, timeout: float = 30.0) -> None:
    """Block until SMG's load monitor has polled every worker once. Its first poll runs when
    the first worker registers, the next one a --load-monitor-interval (10 s) later; until
    then the workers it has no load for are scored in other units than the one it has, and
    traffic sent in that window lands on one worker. A deployment is past that window
    before it serves, so a benchmark waits it out too."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, body = http_get(svc.url + "/get_loads", timeout=2.0)
        if status == 200:
            loads = json.loads(body).get("loads") or []
            if len({x["worker"] for x in loads if x.get("max_total_num_tokens", 0) > 0}) >= workers:
                return
        time.sleep(0.2)
    tail = svc.tail()
    svc.stop()
    raise TimeoutError(f"SMG at {svc.url} polled fewer than {workers} workers' loads in {timeout:.0f}s:\n{tail}")


ROUTERS = ("kvgate", "sglang-router", "smg")


def start_router(router: str, worker_urls: Sequence[str], policy: str, options: dict[str, str], log_path: Path,
                 extra: Sequence[str] = ()) -> Service:
    """One router of ``ROUTERS`` by name (``extra``: more kvgate arguments)."""
    if router == "kvgate":
        return start_kvgate(worker_urls, policy, options, log_path, extra=extra)
    if router == "sglang-router":
        return start_sglang_router(worker_urls, policy, options, log_path)
    if router == "smg":
        return start_smg(worker_urls, policy, options, log_path)
    raise ValueError(f"unknown router {router!r}; choose from {', '.join(ROUTERS)}")
