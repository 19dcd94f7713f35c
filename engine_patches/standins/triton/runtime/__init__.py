"""``triton.runtime``: ``driver.active`` raises, as real triton's does with no GPU driver."""

from _standin import inert_getattr as __getattr__, jit  # noqa: F401


class _Driver:
    @property
    def active(self):
        raise RuntimeError("0 active drivers ([]). There should only be one. (kvgate triton stand-in: no GPU)")

    def __getattr__(self, name):
        raise RuntimeError("no triton driver on this machine (kvgate triton stand-in)")


driver = _Driver()
