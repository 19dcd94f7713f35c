"""Run a ``mooncake_master`` (the Mooncake Store's master plus its HTTP metadata server)
on free loopback ports, for ``SimCluster(pool=True)`` and the tests.

Every port the master opens is chosen here, including its metrics port (fixed 9003 by
default), so several pools can run side by side on one machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .cluster import bind_failed


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class _PortTaken(RuntimeError):
    """The master could not bind a port picked for it: another process took it meanwhile."""


def master_binary() -> str | None:
    """``mooncake_master`` next to this interpreter (the venv), else on PATH."""
    local = Path(sys.executable).parent / "mooncake_master"
    if local.exists():
        return str(local)
    return shutil.which("mooncake_master")


class MooncakeMaster:
    def __init__(self, host: str = "127.0.0.1", log_dir: str | None = None) -> None:
        self.host = host
        self.rpc_port = _free_port(host)
        self.http_port = _free_port(host)
        self.metrics_port = _free_port(host)
        self.log_path = Path(log_dir or tempfile.mkdtemp(prefix="kvgate-mooncake-")) / "mooncake_master.log"
        self.popen: subprocess.Popen | None = None

    @property
    def master_address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.http_port}/metadata"

    def extra_config(self, global_segment_size: int | str = "64mb") -> dict:
        """SGLang's ``--hicache-storage-backend-extra-config`` for workers of this pool."""
        return {"master_server_address": self.master_address, "metadata_server": self.metadata_url,
                "global_segment_size": global_segment_size, "protocol": "tcp", "device_name": ""}

    def start(self, timeout: float = 20.0, tries: int = 3) -> MooncakeMaster:
        """Start the master; when it exits because a picked port was taken meanwhile (it
        says "Address already in use" or "Failed to start ... server"), pick new ports."""
        for attempt in range(tries):
            try:
                return self._start_once(timeout)
            except _PortTaken:
                if attempt + 1 == tries:
                    raise
                self.rpc_port, self.http_port, self.metrics_port = (_free_port(self.host) for _ in range(3))
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> MooncakeMaster:
        binary = master_binary()
        if binary is None:
            raise FileNotFoundError("mooncake_master not found (pip install mooncake-transfer-engine-non-cuda)")
        args = [binary, f"--rpc_address={self.host}", f"--rpc_port={self.rpc_port}",
                "--enable_http_metadata_server=true", f"--http_metadata_server_host={self.host}",
                f"--http_metadata_server_port={self.http_port}", f"--metrics_host={self.host}",
                f"--metrics_port={self.metrics_port}"]
        self._log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not (self._listening(self.rpc_port) and self._listening(self.http_port)):
            if self.popen.poll() is not None:
                tail, code = self.tail(), self.popen.returncode
                self.stop()
                error = _PortTaken if bind_failed(tail) or "failed to start" in tail.lower() else RuntimeError
                raise error(f"mooncake_master exited with {code}:\n{tail}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"mooncake_master not listening after {timeout}s:\n{self.tail()}")
            time.sleep(0.05)
        return self

    def _listening(self, port: int) -> bool:
        try:
            socket.create_connection((self.host, port), 0.2).close()
            return True
        except OSError:
            return False

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout: float = 5.0) -> None:
        p = self.popen
        if p is not None and p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
            except ProcessLookupError:
                pass
        if p is not None:
            self._log.close()
        self.popen = None

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
