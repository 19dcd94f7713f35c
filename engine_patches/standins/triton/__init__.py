"""Import-only stand-in for ``triton`` (see ../_standin.py): decorators and configs evaluate,
kernels never run, and the driver finds no GPU, as real triton's does on a CPU machine."""

from _standin import inert_getattr as __getattr__, jit, stand_in  # noqa: F401

__version__ = "0.0.0+kvgate.standin"


def autotune(*args, **kwargs):
    return jit


def heuristics(*args, **kwargs):
    return jit


stand_in(__name__)
import triton.runtime  # noqa: E402  (a real submodule: its driver must raise)
