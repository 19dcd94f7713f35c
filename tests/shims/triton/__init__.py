"""Import-only stand-in for ``triton`` (see tests/shims/_standin.py for why)."""

from _standin import jit, module_getattr as __getattr__, stand_in  # noqa: F401

__version__ = "0.0.0+kvgate.standin"
stand_in(__name__)
