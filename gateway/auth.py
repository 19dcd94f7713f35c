"""API-key checks, in constant time, for data routes and (optionally separate) admin routes."""

from __future__ import annotations

import hmac
from collections.abc import Sequence


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def key_matches(presented: str | None, keys: Sequence[str]) -> bool:
    """Compare against every key, without early exit, so timing says nothing about which matched."""
    if presented is None:
        return False
    p = presented.encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(p, key.encode())
    return matched
