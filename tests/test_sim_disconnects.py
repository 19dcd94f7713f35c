"""Clients that hang up mid-stream must not break the streams of everyone else.

Regression: every stream awaited one shared scheduler future; a disconnecting client's
cancelled wait cancelled that future, and every later stream was cut after one chunk.
"""

from __future__ import annotations

import asyncio

import aiohttp

from tests.sim_support import sim_worker


async def _streams(url: str, n: int, hang_up_after: int | None) -> list[bytes]:
    async def one(session: aiohttp.ClientSession, i: int) -> bytes:
        body = {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 40, "stream": True}
        data = b""
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            async for chunk in resp.content.iter_any():
                data += chunk
                if hang_up_after is not None and data.count(b"\n\n") >= hang_up_after:
                    return b"hung up"
        return data

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        return await asyncio.gather(*(one(session, i) for i in range(n)))


def test_streams_complete_after_other_clients_hang_up():
    with sim_worker("--time-scale", "20", "--model-name", "m") as (url, _):
        asyncio.run(_streams(url, 20, hang_up_after=2))
        bodies = asyncio.run(_streams(url, 20, hang_up_after=None))
        assert all(b.endswith(b"data: [DONE]\n\n") for b in bodies)
