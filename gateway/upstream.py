"""The upstream HTTP client: one aiohttp session for every worker.

aiohttp, not httpx: measured here, httpx's pool collapses under concurrency (10-20x slower
as a proxy client). No total timeout (streams can be long); a per-read timeout catches a
worker that stops sending bytes.
"""

from __future__ import annotations

import ssl
from typing import Any

import aiohttp

from gateway.worker_policy import WorkerGate, ip_literal


class WorkerAddressRefused(aiohttp.ClientConnectionError):
    """A connection the worker URL policy (``gateway.worker_policy``) does not allow."""


class GuardedConnector(aiohttp.TCPConnector):
    """A ``TCPConnector`` that applies the worker URL policy to the addresses of every new
    connection: after DNS (a name that now resolves elsewhere) and for every redirect hop.

    It hooks ``_resolve_host``, which aiohttp calls once per new connection with the host of
    the URL being connected to (IP literals included) and returns the addresses it will
    use; pooled connections skip it, so the request path pays nothing once connected."""

    def __init__(self, gate: WorkerGate, **kwargs: Any) -> None:
        if not callable(getattr(aiohttp.TCPConnector, "_resolve_host", None)):
            raise RuntimeError("this aiohttp has no TCPConnector._resolve_host: the worker address guard cannot run")
        super().__init__(**kwargs)
        self._gate = gate

    async def _resolve_host(self, host: str, port: int, *args: Any, **kwargs: Any) -> list[Any]:
        hosts = await super()._resolve_host(host, port, *args, **kwargs)  # type: ignore[misc]
        addrs = [a for a in (ip_literal(h["host"]) for h in hosts) if a is not None]
        if len(addrs) != len(hosts):  # an answer that is not an address cannot be checked
            raise WorkerAddressRefused(f"{host}: resolver answered something that is not an IP address")
        refusal = self._gate.connect_refusal(host, addrs)
        if refusal is not None:
            raise WorkerAddressRefused(f"refused by the worker URL policy: {refusal.detail}")
        return hosts


def make_session(*, connect_timeout: float, read_timeout: float, limit_per_host: int = 0,
                 gate: WorkerGate | None = None, ssl_context: ssl.SSLContext | None = None) -> aiohttp.ClientSession:
    """``gate``: check every new connection against the worker URL policy; ``ssl_context``: how
    https workers are verified and which client certificate is shown (default: system CAs)."""
    options: dict[str, Any] = dict(
        limit=0,  # admission control lives in the gateway, not in the pool
        limit_per_host=limit_per_host,
        keepalive_timeout=60,
        ttl_dns_cache=300,
        enable_cleanup_closed=True,
        ssl=ssl_context if ssl_context is not None else True,
    )
    connector = GuardedConnector(gate, **options) if gate is not None else aiohttp.TCPConnector(**options)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, sock_read=read_timeout)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        # Every client's requests share one aiohttp client: a cookie a worker (or a balancer
        # in front of it) sets on one answer must never ride on another client's request.
        cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=False,  # bytes pass through untouched
        skip_auto_headers=("User-Agent",),
        read_bufsize=2**16,
    )
