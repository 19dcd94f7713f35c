"""Optional test dependencies: skipped where they are not installed, failed in CI.

CI (``CI`` set, as every CI service does and ``.ci/run`` does) installs every test
dependency (``scripts/setup.sh --test``), so a missing one there is a broken setup that a
skip would hide. A dependency that is installed but does not import (a missing shared
library, a broken wheel) is never a skip: its ImportError fails the test.
"""

from __future__ import annotations

import importlib
import os
from importlib.util import find_spec
from types import ModuleType
from typing import NoReturn

import pytest


def missing(reason: str) -> NoReturn:
    """A dependency is not installed: skip the caller (test or module), or fail in CI."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must have every test dependency (scripts/setup.sh --test)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def installed(module: str) -> bool:
    try:
        return find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is absent
        return False


def need(module: str, hint: str = "") -> ModuleType:
    """``module`` imported; ``missing`` when it is not installed at all."""
    if not installed(module):
        missing(f"{module} is not installed" + (f" ({hint})" if hint else ""))
    return importlib.import_module(module)
