"""Patches that let SGLang's own server run on a CPU-only machine (``launch --device cpu``).

SGLang 0.5.23 serves on CPU with ``--device cpu``, but a few code paths assume CUDA even
then. Each patch below closes one such gap with what SGLang itself does on the CPU
elsewhere, and none changes a result: the same tokens, the same KV, the same events, only
moved by plain torch instead of a GPU call. ``run_server`` applies them in every SGLang
process when ``SGLANG_USE_CPU_ENGINE`` is set; each checks the release it was read against.

- ``torch.cpu.Stream`` has no ``synchronize()``, which HiCache's controller calls on its
  copy streams: CPU work is synchronous, so it is a no-op.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from engine_patches.versions import Version, check_range, installed_sglang

log = logging.getLogger("kvgate.engine_patches")

TESTED: tuple[Version, Version] = ((0, 5, 23), (0, 5, 23))

_applied = False


def enabled() -> bool:
    return os.environ.get("SGLANG_USE_CPU_ENGINE", "").lower() in ("1", "true", "yes")


def _cpu_stream_synchronize() -> None:
    import torch

    if not hasattr(torch.cpu.Stream, "synchronize"):
        torch.cpu.Stream.synchronize = lambda self: None


PATCHES: list[Callable[[], None]] = [_cpu_stream_synchronize]


def install(version: Version | None = None) -> bool:
    """Apply every patch once in this process; False (and one log line) outside the tested range."""
    global _applied
    if _applied:
        return True
    if not check_range("cpu_engine", version or installed_sglang(), *TESTED):
        return False
    for patch in PATCHES:
        patch()
    _applied = True
    return True
