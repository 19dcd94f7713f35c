"""Which SGLang is installed, and whether a patch was written for it.

Patches reach into SGLang internals that move between releases, so each one declares
the range it was read against and refuses to touch anything outside it: a silent
no-op with one log line is better than a monkeypatch on a method that changed meaning.
"""

from __future__ import annotations

import logging
import re
from importlib import metadata

log = logging.getLogger("kvgate.engine_patches")

Version = tuple[int, int, int]

# The release the launcher assumes when no sglang is importable here (the GPU image has it).
DEFAULT_SGLANG = (0, 5, 23)


def parse_version(text: str) -> Version:
    """'0.5.23', '0.5.5.post3', '0.5.10rc1' -> (0, 5, 23) etc.; local and dev tags ignored."""
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        raise ValueError(f"not a version: {text!r}")
    return int(m[1]), int(m[2]), int(m[3] or 0)


def installed_sglang() -> Version | None:
    try:
        return parse_version(metadata.version("sglang"))
    except metadata.PackageNotFoundError:
        return None


def fmt(v: Version) -> str:
    return ".".join(map(str, v))


def check_range(what: str, version: Version | None, lo: Version, hi: Version) -> bool:
    """True when ``lo <= version <= hi``; otherwise log why the patch stays out."""
    if version is None:
        log.warning("%s: sglang is not installed; patch not applied", what)
        return False
    if not lo <= version <= hi:
        log.warning(
            "%s: sglang %s is outside the tested range %s..%s; patch not applied",
            what, fmt(version), fmt(lo), fmt(hi),
        )
        return False
    return True
