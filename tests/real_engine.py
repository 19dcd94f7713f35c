"""Real SGLang servers for the real-engine tier: SGLang's own server on its CPU engine,
serving a tiny Llama made at test time (``engine_patches.tiny_model``).

Each server is ``python -m engine_patches.launch --device cpu ...``, exactly what a user runs,
on 127.0.0.1 with freshly picked ports; it is ready when ``/health_generate`` has run a
generation. Start-up is ~20 s on 2 cores, so modules share a server (module-scoped fixtures).
Where sglang is not installed the tier skips, and fails in CI (``tests.requires``).
"""

from __future__ import annotations

import functools
import sys
import tempfile
from importlib.util import find_spec
from pathlib import Path

from tests.requires import missing
from tests.support import FREE_PORT, Proc, serve

INSTALL_HINT = "PYTHON=<venv>/bin/python bash engine_patches/install_sglang_cpu.sh"
START_TIMEOUT_S = 240.0


def need_sglang() -> None:
    for module in ("sglang", "torch", "uvicorn", "xgrammar"):
        if find_spec(module) is None:
            missing(f"{module} is not installed in {sys.executable}; run {INSTALL_HINT}")


@functools.lru_cache(maxsize=None)
def tiny_model(template: str = "llama3") -> Path:
    """The tiny model's directory, built once per test session (a few seconds)."""
    need_sglang()
    from engine_patches.tiny_model import build

    return build(Path(tempfile.mkdtemp(prefix=f"kvgate-tiny-{template}-")), template)


def start_engine(role: str = "unified", *args: str, name: str | None = None, kv_events: bool = True,
                 template: str = "llama3", timeout: float = START_TIMEOUT_S) -> Proc:
    """One real SGLang server. ``proc.url`` is its HTTP address; ``proc.ports`` are the ports
    picked for it (HTTP, then KV events PUB and replay when ``kv_events``, then PD bootstrap
    for prefill/decode). ``args`` go to ``engine_patches.launch`` (after ``--``: to SGLang)."""
    argv = [sys.executable, "-m", "engine_patches.launch", "--role", role, "--device", "cpu",
            "--model", str(tiny_model(template)), "--host", "127.0.0.1", "--port", FREE_PORT]
    if kv_events:
        argv += ["--kv-events-port", FREE_PORT, "--kv-events-replay-port", FREE_PORT,
                 "--kv-events-host", "127.0.0.1", "--kv-events-topic", "kv"]
    if role != "unified":
        argv += ["--bootstrap-port", FREE_PORT]
    return serve([*argv, *args], "/health_generate", name or f"sglang-{role}", timeout=timeout)
