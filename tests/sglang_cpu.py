"""Import the real ``sglang`` package on a CPU machine, or skip with the reason.

``engine_patches/install_sglang_cpu.sh`` installs sglang (no deps), a CPU torch and the
few packages its Python modules import; ``triton`` and ``torchvision`` come from
``tests/shims`` (import-only stand-ins) when the real ones are absent.
"""

from __future__ import annotations

import importlib
import os
import sys
from importlib.util import find_spec
from pathlib import Path
from types import ModuleType

import pytest

SHIMS = Path(__file__).resolve().parent / "shims"
INSTALL_HINT = "PYTHON=<venv>/bin/python bash engine_patches/install_sglang_cpu.sh"


def _real_missing() -> bool:
    return find_spec("triton") is None or find_spec("torchvision") is None


# Decided once, before add_shims() can make the stand-ins findable.
NEEDS_SHIMS = _real_missing()


def add_shims() -> None:
    if NEEDS_SHIMS and str(SHIMS) not in sys.path:
        sys.path.append(str(SHIMS))  # appended: a real triton/torchvision always wins


def require(module: str) -> ModuleType:
    """Import ``module`` from sglang or skip the calling test with a precise reason."""
    for dist in ("sglang", "torch"):
        if find_spec(dist) is None:
            pytest.skip(f"{dist} is not installed in {sys.executable}; run {INSTALL_HINT}")
    add_shims()
    try:
        return importlib.import_module(module)
    except Exception as exc:  # an ImportError deep inside sglang, a CUDA-only check ...
        pytest.skip(f"{module} does not import on this CPU: {type(exc).__name__}: {exc}")


def child_pythonpath(root: Path) -> str:
    """PYTHONPATH for a child process that imports sglang the same way."""
    parts = [str(root)]
    if NEEDS_SHIMS:
        parts.append(str(SHIMS))
    if os.environ.get("PYTHONPATH"):
        parts.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(parts)
