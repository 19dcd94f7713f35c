"""Import the real ``sglang`` package on a CPU machine, or skip with the reason where it is not installed.

``engine_patches/install_sglang_cpu.sh`` installs sglang (no deps), a CPU torch and the
packages its modules import; ``sgl_kernel``, ``triton`` and ``torchvision`` come from
``engine_patches/standins`` (import-only stand-ins) when the real ones are absent.
"""

from __future__ import annotations

import importlib
import os
import sys
from importlib.util import find_spec
from pathlib import Path
from types import ModuleType

from tests.requires import missing

SHIMS = Path(__file__).resolve().parent.parent / "engine_patches" / "standins"
INSTALL_HINT = "PYTHON=<venv>/bin/python bash engine_patches/install_sglang_cpu.sh"


def _real_missing() -> bool:
    return any(find_spec(m) is None for m in ("sgl_kernel", "triton", "torchvision"))


# Decided once, before add_shims() can make the stand-ins findable.
NEEDS_SHIMS = _real_missing()


def add_shims() -> None:
    if NEEDS_SHIMS and str(SHIMS) not in sys.path:
        sys.path.append(str(SHIMS))  # appended: a real triton/torchvision always wins


def require(module: str) -> ModuleType:
    """Import ``module`` from sglang; when sglang or torch is not installed, skip (fail in
    CI: ``tests.requires``). An installed sglang that does not import fails the test."""
    for dist in ("sglang", "torch"):
        if find_spec(dist) is None:
            missing(f"{dist} is not installed in {sys.executable}; run {INSTALL_HINT}")
    add_shims()
    return importlib.import_module(module)


def child_pythonpath(root: Path) -> str:
    """PYTHONPATH for a child process that imports sglang the same way."""
    parts = [str(root)]
    if NEEDS_SHIMS:
        parts.append(str(SHIMS))
    if os.environ.get("PYTHONPATH"):
        parts.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(parts)
