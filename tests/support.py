"""Start real processes on 127.0.0.1 and wait for them, with bounded time everywhere.

Every test that needs a gateway, a simulated worker or ``mooncake_master`` goes through
``Proc`` so that ports never collide between concurrently running suites and no process
outlives its test.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# How aiohttp/asyncio ("[Errno 98] ... address already in use"), ZMQ ("Address already in
# use (addr=...)") and Mooncake report a port that something else bound first.
BIND_ERRORS = ("address already in use", "eaddrinuse", "errno 98", "failed to bind",
               "failed to start http metadata server")

FREE_PORT = "<free-port>"  # in a launch argument: replaced by a port picked for that try


def bind_failed(output: str) -> bool:
    low = output.lower()
    return any(marker in low for marker in BIND_ERRORS)


@contextmanager
def refused_address() -> Iterator[str]:
    """``http://127.0.0.1:<port>`` where connects are refused for as long as this is held:
    the port is bound (so nothing else can take it) but never listening."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _spaced_port(taken: set[int]) -> int:
    """A free port whose next one is free too and neither next to one in ``taken``: a
    simulator binds its KV-event replay socket at its KV-event port + 1."""
    for _ in range(50):
        port = free_port()
        if not taken & {port - 1, port, port + 1} and _bindable(port + 1):
            return port
    return port


def fill_ports(args: list[str]) -> tuple[list[str], list[int]]:
    """``args`` with every ``FREE_PORT`` replaced by a freshly picked port, and those ports in order."""
    ports: list[int] = []
    out = []
    for arg in args:
        while FREE_PORT in arg:
            ports.append(_spaced_port(set(ports)))
            arg = arg.replace(FREE_PORT, str(ports[-1]), 1)
        out.append(arg)
    return out, ports


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def http_status(url: str, timeout: float = 1.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, urllib.error.URLError):
        return None


class ProcExited(RuntimeError):
    def __init__(self, proc: "Proc") -> None:
        super().__init__(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.output()[-4000:]}")
        self.proc = proc


class Proc:
    """A child process whose output goes to a temp file (shown when a wait fails)."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, name: str = "proc") -> None:
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix=f"kvgate-{name}-", suffix=".log", delete=False)
        self.popen = subprocess.Popen(
            args, stdout=self.log, stderr=subprocess.STDOUT, env=env or child_env(),
            cwd=ROOT, start_new_session=True,
        )

    @classmethod
    def python(cls, module: str, *args: str, name: str | None = None, **env: str) -> "Proc":
        return cls([sys.executable, "-m", module, *args], env=child_env(**env), name=name or module)

    def output(self) -> str:
        if not self.log.closed:  # read after stop() too: launch() looks for a bind error then
            self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def wait_http(self, url: str, timeout: float = 30.0, ok: tuple[int, ...] = (200,)) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise ProcExited(self)
            if http_status(url) in ok:
                if self.popen.poll() is not None:  # another process answered on the port we picked
                    raise ProcExited(self)
                return
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} not ready at {url} after {timeout}s:\n{self.output()[-4000:]}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.popen.poll() is None:
            self.kill(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill(signal.SIGKILL)
                self.popen.wait(5)
        self.log.close()
        return self.popen.returncode


def launch(start: Callable[[], Proc], ready: Callable[[Proc], object], tries: int = 4) -> Proc:
    """``start()`` a process on freshly picked ports and wait until ``ready(proc)``.

    A port picked by ``free_port`` can be taken by another process before the child binds
    it; the child then exits with a bind error (HTTP or ZMQ), and is started again on new
    ports, at most ``tries`` times. Any other failure stops the process and is raised."""
    for attempt in range(tries):
        proc = start()
        try:
            ready(proc)
            return proc
        except BaseException as exc:
            proc.stop()
            if not (isinstance(exc, ProcExited) and bind_failed(proc.output()) and attempt + 1 < tries):
                raise
    raise AssertionError("unreachable")


def serve(argv: list[str], path: str, name: str, timeout: float = 60.0, ok: tuple[int, ...] = (200,)) -> Proc:
    """Start the command line ``argv``, whose first ``FREE_PORT`` is the HTTP port where
    ``path`` must answer (``proc.url``; all picked ports in ``proc.ports``), through ``launch``."""

    def start() -> Proc:
        args, ports = fill_ports(argv)
        proc = Proc(args, name=name)
        proc.url, proc.ports = f"http://127.0.0.1:{ports[0]}", ports
        return proc

    return launch(start, lambda proc: proc.wait_http(proc.url + path, timeout=timeout, ok=ok))


def wait_until(check: Callable[[], object], why: str = "", timeout: float = 15.0, proc: "Proc | None" = None) -> object:
    """Poll ``check`` every 50 ms until it returns something true, and return that; after
    ``timeout`` seconds fail with ``why`` (and the end of ``proc``'s output, when given)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout}s: {why}" + (f"\n{proc.output()[-4000:]}" if proc is not None else ""))


def request_json(method: str, url: str, body: object | None = None, headers: dict[str, str] | None = None,
                 timeout: float = 30.0) -> tuple[int, object]:
    """One HTTP call; returns (status, decoded JSON or raw text)."""
    import json

    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus sample across series whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        series, _, labelpart = head.partition("{")
        if series != name:
            continue
        if all(f'{k}="{v}"' in labelpart for k, v in labels.items()):
            total += float(value)
    return total


def get_text(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def policy_stats(base: str) -> dict[str, float]:
    """The routing policy's own stats, as the gateway exports them (``kvgate_policy_stat``)."""
    import re

    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'kvgate_policy_stat\{[^}]*stat="([a-z_]+)"\} ([0-9.e+-]+)', get_text(base + "/metrics"))}


def assert_predicted_exactly(served: list[tuple[int, int]], stats: dict[str, float]) -> None:
    """``served``: (turn, cached tokens the engine reported) per request. Every later turn found
    its history cached, no request was routed on text, and the precise index predicted exactly
    what the engines reported."""
    assert all(cached > 0 for turn, cached in served if turn > 0), served
    assert stats["fallback_requests_total"] == 0 and stats["hit_verified_requests_total"] == len(served)
    assert stats["hit_predicted_tokens_total"] == stats["hit_actual_tokens_total"] > 0, stats


def converse(base: str, model: str, conversations: int, turns: int, system_words: int = 80,
             as_parts: bool = False, **extra: object) -> list[tuple[int, int]]:
    """Multi-turn chats through the gateway, each turn's history sent back whole; returns
    (turn, engine-reported cached tokens) per request. ``as_parts`` sends user content as a
    list of text parts; ``extra`` goes into every request body."""
    import json

    usage = []
    for conv in range(conversations):
        messages: list[dict[str, object]] = [
            {"role": "system", "content": f"conversation {conv}: " + "background " * system_words}]
        for turn in range(turns):
            text = f"question {turn} " * 20
            messages.append({"role": "user", "content": [{"type": "text", "text": text}] if as_parts else text})
            body = json.dumps({"model": model, "messages": messages, "max_tokens": 16, **extra}).encode()
            req = urllib.request.Request(base + "/v1/chat/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as resp:
                out = json.loads(resp.read())
            details = out["usage"].get("prompt_tokens_details") or {}
            usage.append((turn, details.get("cached_tokens") or 0))
            messages.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})
    return usage
