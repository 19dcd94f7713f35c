"""Per-tenant budgets: requests and tokens per window (a minute unless the tenants file
says otherwise), answered as OpenAI answers its rate limits.

Each budget is a bucket that holds at most its limit and refills continuously at limit
per window, so ``remaining`` and ``reset`` (the time until it is full again) mean what
OpenAI's ``x-ratelimit-*`` headers mean. A request is let in while its tenant has a
request left and its token bucket is above zero; the request costs one request at once
and its prompt and completion tokens, as the engine reported them, when it ends. Tokens
are known only then, so a tenant's concurrent requests may take the token bucket below
zero: that debt (down to minus one window's worth) is paid by refill before the next
request is let in.

In a gateway group every spend travels on the state bus (``gateway.records.Used``): each
process charges its peers' spends to the same buckets, so a tenant's budget is the
group's, not each process's (within the bus's sub-millisecond lag on one host). Tenants
are names from the tenants file, so no key travels.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from gateway.errors import GatewayError
from gateway.tenants import QosSpec


class _Bucket:
    __slots__ = ("limit", "rate", "level", "stamp")

    def __init__(self, limit: float, window_s: float, now: float) -> None:
        self.limit = limit
        self.rate = limit / window_s
        self.level = limit
        self.stamp = now

    def refill(self, now: float) -> float:
        self.level = min(self.limit, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        return self.level

    def spend(self, amount: float) -> None:
        self.level = max(self.level - amount, -self.limit)


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def duration(seconds: float) -> str:
    """OpenAI's spelling of a reset time: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs}s"


class Budgets:
    def __init__(self, spec: QosSpec, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        now = clock()
        window = spec.budget_window_secs
        self._requests = {t.name: _Bucket(t.requests_per_minute, window, now)
                          for t in spec.tenants.values() if t.requests_per_minute is not None}
        self._tokens = {t.name: _Bucket(t.tokens_per_minute, window, now)
                        for t in spec.tenants.values() if t.tokens_per_minute is not None}
        self.on_used: Callable[[str, int, int], None] | None = None  # told of each spend here (the group's)

    def take(self, tenant: str) -> None:
        """Spend one request of ``tenant``'s, or raise 429 saying which budget is out and when."""
        now = self.clock()
        req, tok = self._requests.get(tenant), self._tokens.get(tenant)
        wait, which = 0.0, ""
        if req is not None and req.refill(now) < 1.0:
            wait, which = (1.0 - req.level) / req.rate, "requests"
        if tok is not None and tok.refill(now) <= 0.0:
            tok_wait = -tok.level / tok.rate + 1e-3
            if tok_wait > wait:
                wait, which = tok_wait, "tokens"
        if which:
            headers = self.headers(tenant)
            headers["Retry-After"] = str(max(1, math.ceil(wait)))
            limit = (req if which == "requests" else tok).limit  # type: ignore[union-attr]
            raise GatewayError(429, f"tenant {tenant!r} is over its budget of {_num(limit)} {which} per "
                               f"{_num(self._window(req or tok))}s; retry in {duration(wait)}",
                               code=f"{which}_budget_exceeded", headers=headers)
        if req is not None:
            req.spend(1.0)
            if self.on_used is not None:
                self.on_used(tenant, 1, 0)

    @staticmethod
    def _window(bucket: _Bucket | None) -> float:
        return bucket.limit / bucket.rate if bucket is not None else 60.0

    def use(self, tenant: str, tokens: int) -> None:
        """A request of ``tenant``'s ended having used ``tokens`` (prompt and completion)."""
        tok = self._tokens.get(tenant)
        if tok is None or tokens <= 0:
            return
        tok.refill(self.clock())
        tok.spend(tokens)
        if self.on_used is not None:
            self.on_used(tenant, 0, tokens)

    def charge(self, tenant: str, requests: int, tokens: int) -> None:
        """A peer spent this of ``tenant``'s budgets."""
        now = self.clock()
        for bucket, amount in ((self._requests.get(tenant), requests), (self._tokens.get(tenant), tokens)):
            if bucket is not None and amount > 0:
                bucket.refill(now)
                bucket.spend(amount)

    def headers(self, tenant: str) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers for the budgets ``tenant`` has."""
        now = self.clock()
        out: dict[str, str] = {}
        for kind, bucket in (("requests", self._requests.get(tenant)), ("tokens", self._tokens.get(tenant))):
            if bucket is None:
                continue
            level = bucket.refill(now)
            out[f"x-ratelimit-limit-{kind}"] = _num(bucket.limit)
            out[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(level)))
            out[f"x-ratelimit-reset-{kind}"] = duration((bucket.limit - level) / bucket.rate)
        return out

    def limited(self, tenant: str) -> bool:
        return tenant in self._requests or tenant in self._tokens
