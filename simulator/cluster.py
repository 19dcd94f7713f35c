"""``SimCluster``: a fleet of simulated workers as real processes, with a sync API.

Used by tests, benchmarks and ``kvgate up`` / ``kvgate sim``. Each worker is
``sys.executable -m simulator serve ...`` in its own process group, with PYTHONPATH set
to this checkout so it runs uninstalled.

Port layout when ``base_port`` is given (else every port is a free ephemeral one):
HTTP ``base_port + i``, PD bootstrap ``base_port + 100 + i``, KV events
``base_port + 200 + 2*dp*i`` (PUB, one per DP rank) and ``+ dp`` (replay), for worker
index ``i`` (prefill workers first, then decode, then unified). ``kv_event_endpoints``
names DP rank 0's publisher; rank r is at its port + r, as in SGLang.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _free_run(host: str, n: int) -> int:
    """A port p with p .. p+n-1 all free (DP rank r's KV publisher binds base + r)."""
    for _ in range(200):
        p = _free_port(host)
        socks = []
        try:
            for k in range(1, n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind((host, p + k))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {n} free ports on {host}")


# How aiohttp/asyncio ("[Errno 98] ... address already in use"), ZMQ ("Address already in
# use (addr=...)") and Mooncake report a port that another process bound first.
_BIND_ERRORS = ("address already in use", "eaddrinuse", "errno 98", "failed to bind")


def bind_failed(output: str) -> bool:
    low = output.lower()
    return any(marker in low for marker in _BIND_ERRORS)


def _dp_size(args: Sequence[str]) -> int:
    for i, a in enumerate(args):
        if a == "--dp-size" and i + 1 < len(args):
            return int(args[i + 1])
        if a.startswith("--dp-size="):
            return int(a.split("=", 1)[1])
    return 1


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, http.client.HTTPException):  # not up yet, or another worker's ZMQ port (picked twice)
        return None


class _Worker:
    def __init__(self, role: str, url: str, args: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.role, self.url, self.args, self.log_path = role, url, args, log_path
        self.bootstrap_port: int | None = None
        self.kv_endpoint: str | None = None
        self.log = open(log_path, "wb")
        self.popen = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                      start_new_session=True)

    def tail(self, n: int = 3000) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def stop(self, timeout: float = 5.0) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)
            except ProcessLookupError:
                pass
        self.log.close()


class _PortTaken(RuntimeError):
    """A worker could not bind the port picked for it: something else took it meanwhile."""


class SimCluster:
    """Start ``workers`` unified workers, or ``prefill`` + ``decode`` PD workers (or both).

    KV events are on by default (one PUB + replay socket per worker, listed in
    ``kv_event_endpoints``) because precise cache-aware routing needs them.

    ``pool=True`` starts a ``mooncake_master`` on free ports first and points every worker
    at it (``--hicache-storage-backend mooncake``), so the fleet shares one HiCache L3 pool;
    each worker lends ``pool_segment`` of its memory to it.
    """

    def __init__(self, workers: int = 4, prefill: int = 0, decode: int = 0, host: str = "127.0.0.1",
                 base_port: int | None = None, engine_args: Sequence[str] = (), startup_timeout: float = 30,
                 kv_events: bool = True, log_dir: str | None = None, pool: bool = False,
                 pool_segment: str = "64mb") -> None:
        self.n_unified, self.n_prefill, self.n_decode = workers, prefill, decode
        self.host = host
        self.base_port = base_port
        self.engine_args = list(engine_args)
        self.startup_timeout = startup_timeout
        self.kv_events = kv_events or any(a.startswith("--kv-events") for a in self.engine_args)
        if self.kv_events:  # ports are assigned per worker here
            self.engine_args = _strip_kv_args(self.engine_args)
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="kvgate-sim-"))
        self.urls: list[str] = []
        self.prefill: list[tuple[str, int]] = []
        self.decode: list[str] = []
        self.kv_event_endpoints: dict[str, str] = {}
        self._workers: list[_Worker] = []
        self.pool, self.pool_segment = pool, pool_segment
        self.master = None  # pool_master.MooncakeMaster when pool=True
        self._env: dict[str, str] = {}
        self._picked: set[int] = set()  # ports picked for this start's workers

    # ---- lifecycle -----------------------------------------------------------------------
    def _port(self, offset: int) -> int:
        if self.base_port is not None:
            return self.base_port + offset
        return self._distinct(lambda: _free_port(self.host), 1)

    def _distinct(self, pick: Callable[[], int], n: int) -> int:
        """A port run ``pick`` found free, none of it picked before for this cluster: two free
        picks can return the same port, and a worker's readiness check would then be answered
        by the other worker on it (bounded)."""
        for _ in range(100):
            p = pick()
            run = set(range(p, p + n))
            if not run & self._picked:
                self._picked |= run
                return p
        raise RuntimeError("no distinct free port found")

    def start(self) -> "SimCluster":
        """Start every worker; with ports picked here (no ``base_port``), a port another
        process took between the pick and the worker's bind is picked again (bounded)."""
        for attempt in range(3):
            try:
                return self._start_once()
            except _PortTaken:
                if self.base_port is not None or attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _start_once(self) -> "SimCluster":
        self._picked = set()
        env = self._env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["PYTHONUNBUFFERED"] = "1"
        roles = ["prefill"] * self.n_prefill + ["decode"] * self.n_decode + ["unified"] * self.n_unified
        pool_args: list[str] = []
        try:
            if self.pool:
                from .pool_master import MooncakeMaster

                self.master = MooncakeMaster(self.host, log_dir=str(self.log_dir)).start()
                pool_args = ["--hicache-storage-backend", "mooncake", "--hicache-storage-backend-extra-config",
                             json.dumps(self.master.extra_config(self.pool_segment))]
            for i, role in enumerate(roles):
                port = self._port(i)
                url = f"http://{self.host}:{port}"
                args = [sys.executable, "-m", "simulator", "serve", "--host", self.host, "--port", str(port),
                        *self.engine_args, *(pool_args if role != "decode" else ())]
                bootstrap = kv = None
                if role != "unified":
                    args += ["--disaggregation-mode", role]
                if role == "prefill":
                    bootstrap = self._port(100 + i)
                    args += ["--disaggregation-bootstrap-port", str(bootstrap)]
                if self.kv_events:
                    dp = _dp_size(self.engine_args)
                    if self.base_port is not None:
                        pub = self.base_port + 200 + 2 * dp * i
                        replay = pub + dp
                    else:
                        pub = self._distinct(lambda: _free_run(self.host, dp), dp)
                        replay = self._distinct(lambda: _free_run(self.host, dp), dp)
                    cfg = {"publisher": "zmq", "endpoint": f"tcp://*:{pub}", "topic": "kv",
                           "replay_endpoint": f"tcp://*:{replay}"}
                    args += ["--kv-events-config", json.dumps(cfg)]
                    kv = f"tcp://{self.host}:{pub}"
                w = _Worker(role, url, args, self.log_dir / f"{role}-{i}-{port}.log", env)
                w.bootstrap_port, w.kv_endpoint = bootstrap, kv
                self._workers.append(w)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        for w in self._workers:
            if w.role == "prefill":
                self.prefill.append((w.url, w.bootstrap_port))
            elif w.role == "decode":
                self.decode.append(w.url)
            else:
                self.urls.append(w.url)
            if w.kv_endpoint:
                self.kv_event_endpoints[w.url] = w.kv_endpoint
        return self

    def kill(self, url: str) -> None:
        """SIGKILL one worker's process group: a crash, as its clients see it."""
        w = self._worker(url)
        try:
            os.killpg(w.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        w.popen.wait(10)

    def restart(self, url: str, timeout: float = 30.0) -> None:
        """Start a dead worker again with its own arguments and ports (its clients know its
        URL). Its ports were free until it died, but any process may take a free port as the
        local end of a connection meanwhile: a start that cannot bind is tried again, within
        ``timeout`` seconds in all."""
        old = self._worker(url)
        deadline = time.monotonic() + timeout
        stem = old.log_path.name.split(".")[0]
        for n in range(1, 1000):
            w = _Worker(old.role, old.url, old.args, old.log_path.with_name(f"{stem}.r{n}.log"), self._env)
            w.bootstrap_port, w.kv_endpoint = old.bootstrap_port, old.kv_endpoint
            self._workers[self._workers.index(old)] = old = w
            try:
                self._wait_ready([w], deadline)
                return
            except _PortTaken:
                w.stop()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        raise AssertionError("unreachable")

    def _worker(self, url: str) -> _Worker:
        return next(w for w in self._workers if w.url == url)

    def _wait_ready(self, workers: list[_Worker] | None = None, deadline: float | None = None) -> None:
        deadline = deadline or time.monotonic() + self.startup_timeout
        pending = list(self._workers if workers is None else workers)
        while pending:
            for w in list(pending):
                if w.popen.poll() is not None:
                    tail = w.tail()
                    error = _PortTaken if bind_failed(tail) else RuntimeError
                    raise error(f"simulated worker {w.url} exited with {w.popen.returncode}:\n{tail}")
                if _status(w.url + "/health") == 200:
                    pending.remove(w)
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"simulated worker {pending[0].url} not healthy after "
                                   f"{self.startup_timeout}s:\n{pending[0].tail()}")
            if pending:
                time.sleep(0.05)

    def stop(self) -> None:
        for w in self._workers:
            if w.popen.poll() is None:
                try:
                    os.killpg(w.popen.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for w in self._workers:
            w.stop()
        self._workers.clear()
        if self.master is not None:
            self.master.stop()
            self.master = None

    def alive(self) -> list[str]:
        return [w.url for w in self._workers if w.popen.poll() is None]

    def dead(self) -> list[tuple[str, int]]:
        return [(w.url, w.popen.returncode) for w in self._workers if w.popen.poll() is not None]

    @property
    def all_urls(self) -> list[str]:
        return [w.url for w in self._workers]

    @property
    def log_paths(self) -> list[Path]:
        """This cluster's worker logs (a shared ``log_dir`` may hold earlier clusters' too)."""
        return [w.log_path for w in self._workers]

    def __enter__(self) -> "SimCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _strip_kv_args(args: list[str]) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("--kv-events-port", "--kv-events-config"):
            skip = True
            continue
        if a.startswith(("--kv-events-port=", "--kv-events-config=")) or a == "--kv-events":
            continue
        out.append(a)
    return out
