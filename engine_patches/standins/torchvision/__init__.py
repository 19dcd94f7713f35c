"""Import-only stand-in for ``torchvision`` (see ../_standin.py)."""

from _standin import inert_getattr as __getattr__, stand_in  # noqa: F401

__version__ = "0.0.0+kvgate.standin"
stand_in(__name__)
