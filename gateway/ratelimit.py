"""Per-client token buckets: a steady request rate with room for a short burst.

Admission bounds what the *cluster* takes on; this bounds what one *client* may ask for,
so a single noisy key cannot fill the admission queue for everyone else. The client is the
presented API key once auth has accepted it (a bad key never gets a bucket, so random keys
cannot grow the table), or the peer address when auth is off.

In a group of gateway processes and replicas (``gateway.peers``) every admitted request is
charged to its client's bucket in every process (``on_spent`` publishes it, ``charge``
applies a peer's), so a client gets ``rate`` across the group, not per process; the
records travel in well under a millisecond on one host, which is the window in which
two processes may both admit the last token. API keys are hashed in the client key, so
no key travels on the bus.
"""

from __future__ import annotations

import collections
import hashlib
import math
import time
from collections.abc import Callable

from aiohttp import web

from gateway.auth import bearer_token
from gateway.errors import GatewayError


class TokenBucket:
    __slots__ = ("tokens", "stamp")

    def __init__(self, burst: float, now: float) -> None:
        self.tokens = burst
        self.stamp = now


class RateLimiter:
    """``rate`` requests per second per client, ``burst`` at once; idle buckets are dropped
    oldest-first past ``max_clients`` (a dropped bucket is simply full again next time)."""

    def __init__(self, rate: float, burst: float, max_clients: int = 100_000) -> None:
        self.rate = rate
        self.burst = max(burst, 1.0)
        self.max_clients = max_clients
        self._buckets: collections.OrderedDict[str, TokenBucket] = collections.OrderedDict()
        self.on_spent: Callable[[str], None] | None = None  # told of each admitted request (the group's)

    def _bucket(self, client: str, now: float) -> TokenBucket:
        bucket = self._buckets.get(client)
        if bucket is None:
            bucket = self._buckets[client] = TokenBucket(self.burst, now)
            if len(self._buckets) > self.max_clients:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(client)
            bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.stamp) * self.rate)
            bucket.stamp = now
        return bucket

    def try_acquire(self, client: str, now: float | None = None) -> float:
        """0.0 when admitted, else the seconds until a token is available."""
        bucket = self._bucket(client, time.monotonic() if now is None else now)
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            if self.on_spent is not None:
                self.on_spent(client)
            return 0.0
        return (1.0 - bucket.tokens) / self.rate

    def charge(self, client: str, now: float | None = None) -> None:
        """A peer admitted a request of ``client``: one token less here too. A bucket may go
        down to ``-burst`` (two processes admitted at once): the debt is paid by refill."""
        bucket = self._bucket(client, time.monotonic() if now is None else now)
        bucket.tokens = max(bucket.tokens - 1.0, -self.burst)


def client_key(request: web.Request, auth_on: bool) -> str:
    if auth_on:
        token = bearer_token(request.headers.get("Authorization"))
        if token:
            return "key:" + hashlib.blake2b(token.encode(), digest_size=12).hexdigest()
    return "ip:" + (request.remote or "unknown")


def check_rate(limiter: RateLimiter, request: web.Request, auth_on: bool) -> None:
    """Raise 429 with Retry-After when this client's bucket is empty (call after auth)."""
    wait = limiter.try_acquire(client_key(request, auth_on))
    if wait:
        raise GatewayError(429, f"rate limit exceeded ({limiter.rate:g} requests/s, burst {limiter.burst:g})",
                           code="rate_limit_exceeded", headers={"Retry-After": str(max(1, math.ceil(wait)))})
