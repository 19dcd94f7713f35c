"""The upstream HTTP client: one aiohttp session for every worker.

aiohttp, not httpx: measured here, httpx's pool collapses under concurrency (10-20x slower
as a proxy client). No total timeout (streams can be long); a per-read timeout catches a
worker that stops sending bytes.
"""

from __future__ import annotations

import aiohttp


def make_session(*, connect_timeout: float, read_timeout: float, limit_per_host: int = 0) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(
        limit=0,  # admission control lives in the gateway, not in the pool
        limit_per_host=limit_per_host,
        keepalive_timeout=60,
        ttl_dns_cache=300,
        enable_cleanup_closed=True,
    )
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, sock_read=read_timeout)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        auto_decompress=False,  # bytes pass through untouched
        skip_auto_headers=("User-Agent",),
        read_bufsize=2**16,
    )
