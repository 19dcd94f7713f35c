"""Where a gateway process logs: stderr, and with ``--log-dir`` (sglang-router's flag) also
``kvgate.log`` in that directory. The members of a group append to the same file; each line
names its process (``kvgate[N]``)."""

from __future__ import annotations

import logging
from pathlib import Path


def configure(level: str, fmt: str, log_dir: str | None) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(Path(log_dir) / "kvgate.log"))
    logging.basicConfig(level=level.upper(), format=fmt, handlers=handlers)
